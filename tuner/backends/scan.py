"""The scan backend: blockwise flash attention in pure JAX, with `lax.scan` over tiles.

Every feature, every platform: it is the fallback of the runtime loader and the verifier of the
kernel backends. Queries are cut into `block_q` tiles and keys into `block_kv` tiles; for each query
tile an online softmax runs over the key tiles. A tile pair whose position / segment ranges exclude
every pair (`masks.may_attend`) is skipped under `lax.cond`, not computed and thrown away.

Heads stay grouped: queries are viewed as `[B, Hkv, G, T, D]` (G = H // Hkv query heads per kv head),
so grouped-query attention never repeats keys or values. Lengths that are not a multiple of the tile
are padded; padded keys are masked out and padded query rows are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tuner import masks, vma, work
from tuner.backends.base import SearchSpace, reject_settings, source_hash
from tuner.params import BwdParams, FwdParams
from tuner.problem import Problem
from tuner.spec import AttentionSpec

F32 = jnp.float32


# --------------------------------------------------------------------------------------------------
# Tiling: move heads in front, pad the sequence to whole tiles, and put the tile index first.
# --------------------------------------------------------------------------------------------------


def _pad_to(x, axis: int, length: int, mode: str = "constant", value: float = 0):
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _split(x, axis: int, block: int):
    """`[..., n*block, ...]` -> `[n, ..., block, ...]` (tile index first)."""
    n = x.shape[axis] // block
    x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _merge(x, axis: int):
    """Inverse of `_split`: `[n, ..., block, ...]` -> `[..., n*block, ...]`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


@dataclass(frozen=True)
class _Tiling:
    """Tile sizes and counts of one block call (tiles never longer than the sequence)."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    @classmethod
    def make(cls, q_len: int, kv_len: int, block_q: int, block_kv: int) -> _Tiling:
        return cls(q_len, kv_len, min(block_q, q_len), min(block_kv, kv_len))

    @property
    def num_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def num_kv(self) -> int:
        return -(-self.kv_len // self.block_kv)

    @property
    def kv_padded(self) -> bool:
        return self.num_kv * self.block_kv != self.kv_len


class _Operands:
    """The inputs of one block call, tiled. Query-side arrays are `[nq, ...]`, key-side `[nk, ...]`."""

    def __init__(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling: _Tiling, num_heads: int):
        b, _, h, d = q.shape
        hkv = k.shape[2]
        self.tiling = tiling
        self.group = h // hkv
        tq, tk = tiling.num_q * tiling.block_q, tiling.num_kv * tiling.block_kv

        self.q = self.query_side(q)
        self.k = _split(_pad_to(jnp.moveaxis(k, 1, 2), 2, tk), 2, tiling.block_kv)  # [nk,B,Hkv,bk,D]
        self.v = _split(_pad_to(jnp.moveaxis(v, 1, 2), 2, tk), 2, tiling.block_kv)
        self.q_pos = _split(_pad_to(q_pos, 1, tq, "edge"), 1, tiling.block_q)  # [nq,B,bq]
        self.kv_pos = _split(_pad_to(kv_pos, 1, tk, "edge"), 1, tiling.block_kv)  # [nk,B,bk]
        self.q_seg = None if q_seg is None else _split(_pad_to(q_seg, 1, tq, "edge"), 1, tiling.block_q)
        self.kv_seg = None if kv_seg is None else _split(_pad_to(kv_seg, 1, tk, "edge"), 1,
                                                         tiling.block_kv)
        self.kv_valid = _split(jnp.arange(tk) < tiling.kv_len, 0, tiling.block_kv)  # [nk,bk]

        self.bias = None
        self.bias_shape = None if bias is None else bias.shape
        if bias is not None:
            bb, bh, bq, bk = bias.shape
            heads = (hkv, self.group) if bh == num_heads else (1, 1)
            grouped = bias.reshape((bb,) + heads + (bq, bk))
            self.bias_q_tiled, self.bias_kv_tiled = bq > 1, bk > 1
            if self.bias_kv_tiled:
                grouped = _split(_pad_to(grouped, 4, tk), 4, tiling.block_kv)
            else:
                grouped = grouped[None]
            if self.bias_q_tiled:
                grouped = _split(_pad_to(grouped, 4, tq), 4, tiling.block_q)
            else:
                grouped = grouped[None]
            self.bias = grouped  # [nq|1, nk|1, Bb, Hkv|1, G|1, bq|1, bk|1]

    def query_side(self, x):
        """`[B, T, H, D]` -> `[nq, B, Hkv, G, bq, D]` tiles (pads with zeros)."""
        b, t, h, d = x.shape
        x = jnp.moveaxis(x.reshape(b, t, h // self.group, self.group, d), 1, 3)
        return _split(_pad_to(x, 3, self.tiling.num_q * self.tiling.block_q), 3, self.tiling.block_q)

    def row_stat(self, x, pad_value: float):
        """`[B, H, T]` row statistic -> `[nq, B, Hkv, G, bq]` tiles."""
        b, h, t = x.shape
        x = x.reshape(b, h // self.group, self.group, t)
        return _split(_pad_to(x, 3, self.tiling.num_q * self.tiling.block_q, value=pad_value), 3,
                      self.tiling.block_q)

    def bias_index(self, i, j):
        return (i if self.bias_q_tiled else 0, j if self.bias_kv_tiled else 0)

    def bias_tile(self, i, j):
        if self.bias is None:
            return None
        return self.bias[self.bias_index(i, j)]

    def segments(self, i, j):
        """Segment ids of query tile i and key tile j (None, None without segments)."""
        if self.q_seg is None:
            return None, None
        return self.q_seg[i], self.kv_seg[j]

    def may_attend(self, spec: AttentionSpec, i, j):
        return masks.may_attend(self.q_pos[i], self.kv_pos[j], *self.segments(i, j), spec)

    def fully_allowed(self, spec: AttentionSpec, i, j):
        return masks.fully_allowed(self.q_pos[i], self.kv_pos[j], *self.segments(i, j), spec)

    def mask(self, spec: AttentionSpec, i, j, masked: bool):
        """Bool `[B, 1, 1, bq, bk]` of readable pairs of tile (i, j), or None if all are readable.

        With `masked=False` the caller knows the spec excludes no pair of this tile; only padding is
        masked then.
        """
        mask = None
        if masked:
            mask = masks.allowed(self.q_pos[i], self.kv_pos[j], *self.segments(i, j), spec)
        if self.tiling.kv_padded:
            valid = self.kv_valid[j][None, None, :]
            mask = valid if mask is None else mask & valid
        return None if mask is None else mask[:, None, None]


def _widen() -> bool:
    """On the CPU, matmuls of 16-bit operands run in float32: XLA:CPU cannot execute some
    bf16 x bf16 -> f32 dots ("Unsupported element type for DotThunk"), and there is no 16-bit matmul
    unit to gain speed from. Elsewhere they run in the input dtype, accumulating in float32."""
    return jax.default_backend() == "cpu"


def _operand(x, dtype):
    """A float32 intermediate (probabilities, their gradient) as a matmul operand: rounded to the input
    dtype where matmuls run in it, kept float32 where they are widened anyway."""
    return x if _widen() else x.astype(dtype)


def _einsum(subscripts: str, a, b):
    """`jnp.einsum` accumulating in float32 (16-bit operands widened on the CPU: a product of two
    16-bit floats is exact in float32)."""
    if _widen():
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(subscripts, a, b, preferred_element_type=F32)


def _logits(ops: _Operands, spec: AttentionSpec, q_tile, i, j, masked: bool, transposed: bool = False):
    """Logits of tile (i, j), masked to -inf, and the softcap's tanh (or None).

    `[B, Hkv, G, bq, bk]` (query rows), or with `transposed` `[B, Hkv, bk, G, bq]` (key rows), which
    lets the dk/dv matmuls contract over the trailing (G, bq) axes without transposing the tile.
    """
    if transposed:
        s = _einsum("bhkd,bhgqd->bhkgq", ops.k[j], q_tile)
    else:
        s = _einsum("bhgqd,bhkd->bhgqk", q_tile, ops.k[j])
    s = s * spec.scale
    orient = (lambda x: jnp.moveaxis(x, -1, 2)) if transposed else (lambda x: x)
    tanh = None
    if spec.softcap is not None:
        tanh = jnp.tanh(s / spec.softcap)
        s = spec.softcap * tanh
    bias = ops.bias_tile(i, j)
    if bias is not None:
        s = s + orient(bias.astype(F32))
    mask = ops.mask(spec, i, j, masked)
    if mask is not None:
        s = jnp.where(orient(mask), s, -jnp.inf)
    return s, tanh


def _visit_tile(ops: _Operands, spec: AttentionSpec, i, j, compute, carry):
    """Run `compute(carry, masked)` for tile (i, j): skipped when the masks exclude the whole tile,
    with `masked=False` (no mask built) when they exclude no pair of it, else with `masked=True`."""
    def counted(masked: bool):
        def run(c):
            work.record("tile_area", ops.tiling.block_q * ops.tiling.block_kv)
            return compute(c, masked)
        return run

    if not spec.has_mask:
        return counted(False)(carry)
    branch = jnp.where(ops.may_attend(spec, i, j), jnp.where(ops.fully_allowed(spec, i, j), 1, 2), 0)
    return lax.switch(branch, [lambda c: c, counted(False), counted(True)], carry)


# --------------------------------------------------------------------------------------------------
# Forward: for each query tile, an online softmax over the key tiles.
# --------------------------------------------------------------------------------------------------


def _forward(ops: _Operands, spec: AttentionSpec):
    tiles = ops.tiling

    def query_tile(i):
        q_tile = ops.q[i]
        stat_shape = q_tile.shape[:-1]

        def key_tile(carry, j):
            def compute(carry, masked):
                row_max, row_sum, acc = carry
                s, _ = _logits(ops, spec, q_tile, i, j, masked)
                new_max = jnp.maximum(row_max, s.max(axis=-1))
                safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                p = jnp.exp(s - safe_max[..., None])
                rescale = jnp.exp(row_max - safe_max)
                row_sum = rescale * row_sum + p.sum(axis=-1)
                pv = _einsum("bhgqk,bhkd->bhgqd", _operand(p, ops.v.dtype), ops.v[j])
                return new_max, row_sum, rescale[..., None] * acc + pv

            return _visit_tile(ops, spec, i, j, compute, carry), None

        init = (jnp.full(stat_shape, -jnp.inf, F32), jnp.zeros(stat_shape, F32),
                jnp.zeros(q_tile.shape, F32))
        init = jax.tree.map(lambda x: vma.like(x, q_tile), init)
        (row_max, row_sum, acc), _ = lax.scan(key_tile, init, jnp.arange(tiles.num_kv))
        has_mass = row_sum > 0
        safe_sum = jnp.where(has_mass, row_sum, 1.0)
        out = acc / safe_sum[..., None]
        lse = jnp.where(has_mass, row_max + jnp.log(safe_sum), -jnp.inf)
        return out, lse

    out, lse = lax.map(query_tile, jnp.arange(tiles.num_q))  # [nq,B,Hkv,G,bq,(D)]
    b, hkv, g = out.shape[1:4]
    out = _merge(out, 3)[:, :, :, :tiles.q_len]  # [B,Hkv,G,Tq,D]
    out = jnp.moveaxis(out, 3, 1).reshape(b, tiles.q_len, hkv * g, -1)
    lse = _merge(lse, 3)[..., :tiles.q_len].reshape(b, hkv * g, tiles.q_len)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Backward: a dk/dv pass (key tile held, query tiles streamed) and dq, fused into it or separate.
# --------------------------------------------------------------------------------------------------


class _Grads:
    """Gradient pieces of tile (i, j), from the final-softmax statistics.

    The dk/dv pass works `transposed` (key rows, see `_logits`); the separate dq pass does not.
    """

    def __init__(self, ops: _Operands, spec: AttentionSpec, do, lse, delta, i, j, masked: bool,
                 transposed: bool):
        self.transposed = transposed
        q_tile, do_tile = ops.q[i], do[i]
        s, tanh = _logits(ops, spec, q_tile, i, j, masked, transposed)
        row = (lambda x: x[:, :, None]) if transposed else (lambda x: x[..., None])
        p = jnp.exp(s - row(lse[i]))
        if transposed:
            dp = _einsum("bhkd,bhgqd->bhkgq", ops.v[j], do_tile)
        else:
            dp = _einsum("bhgqd,bhkd->bhgqk", do_tile, ops.v[j])
        self.dlogits = p * (dp - row(delta[i]))
        ds = self.dlogits if tanh is None else self.dlogits * (1.0 - tanh * tanh)
        self.ds = ds * spec.scale
        self.p = p
        self.q_tile, self.do_tile = q_tile, do_tile

    def dk(self, ops: _Operands):
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.ds, ops.q.dtype), self.q_tile)

    def dv(self, ops: _Operands):
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.p, self.do_tile.dtype), self.do_tile)

    def dq(self, ops: _Operands, j):
        """`[B, Hkv, G, bq, D]`, or `[B, Hkv, D, G, bq]` when transposed (a plain matmul by k^T)."""
        if self.transposed:
            return _einsum("bhdk,bhkgq->bhdgq", jnp.swapaxes(ops.k[j], -1, -2),
                              _operand(self.ds, ops.k.dtype))
        return _einsum("bhgqk,bhkd->bhgqd", _operand(self.ds, ops.k.dtype), ops.k[j])

    def dbias(self, ops: _Operands, i, j):
        dlogits = jnp.moveaxis(self.dlogits, 2, -1) if self.transposed else self.dlogits
        target = ops.bias[ops.bias_index(i, j)].shape
        axes = tuple(a for a, (got, want) in enumerate(zip(dlogits.shape, target)) if want == 1 < got)
        return dlogits.sum(axis=axes, keepdims=True)


def _backward(ops: _Operands, spec: AttentionSpec, do, lse, delta, dq_ops: _Operands | None,
              dq_do=None, dq_lse=None, dq_delta=None):
    tiles = ops.tiling
    k_tile_shape = ops.k.shape[1:]
    fused = dq_ops is None

    def key_tile(outer, j):
        def query_tile(inner, i):
            def compute(inner, masked):
                dk, dv, dq, dbias = inner
                grads = _Grads(ops, spec, do, lse, delta, i, j, masked, transposed=True)
                dk, dv = dk + grads.dk(ops), dv + grads.dv(ops)
                if fused:
                    dq = dq.at[i].add(grads.dq(ops, j))
                if dbias is not None:
                    dbias = dbias.at[ops.bias_index(i, j)].add(grads.dbias(ops, i, j))
                return dk, dv, dq, dbias

            return _visit_tile(ops, spec, i, j, compute, inner), None

        dq, dbias = outer
        zeros = vma.like(jnp.zeros(k_tile_shape, F32), ops.q)
        (dk, dv, dq, dbias), _ = lax.scan(query_tile, (zeros, zeros, dq, dbias), jnp.arange(tiles.num_q))
        return (dq, dbias), (dk, dv)

    nq, b, hkv, g, bq, d = ops.q.shape
    dq0 = vma.like(jnp.zeros((nq, b, hkv, d, g, bq), F32), ops.q) if fused else None  # transposed
    dbias0 = None if ops.bias is None else vma.like(jnp.zeros(ops.bias.shape, F32), ops.q)
    (dq, dbias), (dk, dv) = lax.scan(key_tile, (dq0, dbias0), jnp.arange(tiles.num_kv))
    if fused:
        dq = jnp.moveaxis(dq, 3, -1)
    else:
        dq = _dq_pass(dq_ops, spec, dq_do, dq_lse, dq_delta)
    return dq, dk, dv, dbias


def _dq_pass(ops: _Operands, spec: AttentionSpec, do, lse, delta):
    def query_tile(i):
        def key_tile(dq, j):
            def compute(dq, masked):
                grads = _Grads(ops, spec, do, lse, delta, i, j, masked, transposed=False)
                return dq + grads.dq(ops, j)
            return _visit_tile(ops, spec, i, j, compute, dq), None

        dq0 = vma.like(jnp.zeros(ops.q.shape[1:], F32), ops.q)
        dq, _ = lax.scan(key_tile, dq0, jnp.arange(ops.tiling.num_kv))
        return dq

    return lax.map(query_tile, jnp.arange(ops.tiling.num_q))


def _untile_query(x, tiling: _Tiling):
    """`[nq, B, Hkv, G, bq, D]` -> `[B, Tq, H, D]`."""
    x = _merge(x, 3)[:, :, :, :tiling.q_len]
    b, hkv, g, t, d = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, t, hkv * g, d)


def _untile_key(x, tiling: _Tiling):
    """`[nk, B, Hkv, bk, D]` -> `[B, Tk, Hkv, D]`."""
    return jnp.moveaxis(_merge(x, 2)[:, :, :tiling.kv_len], 2, 1)


def _untile_bias(x, ops: _Operands, tiling: _Tiling):
    """`[nq|1, nk|1, Bb, Hkv|1, G|1, bq|1, bk|1]` -> the bias's own shape."""
    x = _merge(x, 4) if ops.bias_q_tiled else x[0]
    x = _merge(x, 4) if ops.bias_kv_tiled else x[0]
    bb, bh, bq, bk = ops.bias_shape
    return x[..., :bq, :bk].reshape(ops.bias_shape)


# --------------------------------------------------------------------------------------------------
# The backend.
# --------------------------------------------------------------------------------------------------


TILE_BYTES_LIMIT = 256 * 2**20


class ScanBackend:
    """Pure-JAX blockwise attention; honours every feature on every platform."""

    name = "scan"

    def unavailable_reason(self, interpret: bool = False) -> str | None:
        return None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int) -> str | None:
        return None

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        reject_settings(self.name, fwd, bwd, launch=False, compute_slice=False)

    def default_params(self, q_len: int, kv_len: int, head_dim: int) -> tuple[FwdParams, BwdParams]:
        """Tall query tiles, short key tiles, dq fused: the best of a sweep on a 2-core x86 CPU
        (local T=1024, H=8, D=64, float32); half a 1024-token shard keeps zigzag chunks tile-aligned.
        Tiles are cut to the local lengths (the same computation, named as the search space names it)."""
        block_q, block_kv = min(512, q_len), min(256, kv_len)
        return (FwdParams(block_q=block_q, block_kv=block_kv),
                BwdParams(block_q_dkv=block_q, block_kv_dkv=block_kv))

    def search_space(self, problem: Problem) -> SearchSpace:
        """Powers of two from 32 up to the local length (and the local length itself): a longer tile
        would only be shortened to the sequence, a point already in the space."""
        local = problem.local_len
        tiles = tuple(sorted({t for t in (32, 64, 128, 256, 512, 1024, 2048, 4096) if t <= local}
                             | {min(local, 4096)}))
        return SearchSpace(fwd={"block_q": tiles, "block_kv": tiles},
                           bwd={"block_q_dkv": tiles, "block_kv_dkv": tiles}, dq_tiles=tiles)

    def violation(self, problem: Problem, fwd: FwdParams | None, bwd: BwdParams | None) -> str | None:
        """A float32 logits tile for every (batch, head) must fit in `TILE_BYTES_LIMIT`: larger tiles
        thrash the caches on a CPU and exhaust memory on an accelerator."""
        tiles = []
        if fwd is not None:
            tiles.append(("fwd", fwd.block_q, fwd.block_kv))
        if bwd is not None:
            tiles.append(("bwd dk/dv", bwd.block_q_dkv, bwd.block_kv_dkv))
            if not bwd.fused_dq:
                tiles.append(("bwd dq", bwd.block_q_dq, bwd.block_kv_dq))
        for name, block_q, block_kv in tiles:
            rows, cols = min(block_q, problem.local_len), min(block_kv, problem.local_len)
            size = 4 * problem.batch * problem.heads * rows * cols
            if size > TILE_BYTES_LIMIT:
                return (f"{name} logits tile {rows}x{cols} x B*H={problem.batch * problem.heads} is "
                        f"{size / 2**20:.0f} MiB, over the {TILE_BYTES_LIMIT // 2**20} MiB tile limit")
        return None

    def code_hash(self) -> str:
        return source_hash(Path(__file__))

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool = False):
        tiling = _Tiling.make(q.shape[1], k.shape[1], params.block_q, params.block_kv)
        ops = _Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2])
        return _forward(ops, spec)

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        def prepared(block_q, block_kv):
            tiling = _Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
            ops = _Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2])
            safe_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # p = exp(-inf - inf) = 0, no NaN
            return (ops, ops.query_side(do), ops.row_stat(safe_lse, jnp.inf),
                    ops.row_stat(delta, 0.0))

        ops, do_t, lse_t, delta_t = prepared(params.block_q_dkv, params.block_kv_dkv)
        if params.fused_dq:
            dq, dk, dv, dbias = _backward(ops, spec, do_t, lse_t, delta_t, None)
            dq = _untile_query(dq, ops.tiling)
        else:
            dq_ops, dq_do, dq_lse, dq_delta = prepared(params.block_q_dq, params.block_kv_dq)
            dq, dk, dv, dbias = _backward(ops, spec, do_t, lse_t, delta_t, dq_ops, dq_do, dq_lse, dq_delta)
            dq = _untile_query(dq, dq_ops.tiling)
        dk, dv = _untile_key(dk, ops.tiling), _untile_key(dv, ops.tiling)
        if dbias is not None:
            dbias = _untile_bias(dbias, ops, ops.tiling)
        return dq, dk, dv, dbias
