"""The scan backend's kernel: blockwise flash attention in pure JAX, with loops over tile pairs.

Queries are cut into `block_q` tiles and keys into `block_kv` tiles. The loops run over the list of
the (query tile, key tile) pairs the masks let through (`Operands.visits`), so a pair whose position /
segment ranges exclude every pair (`masks.tile_pairs`) costs no iteration at all. The forward runs one
loop over the visited pairs, query tile by query tile, with the online softmax of the current query
tile in the loop's carry, writing that tile's output as it goes. The backward runs one loop over all
the visited pairs, adding each pair's gradients in place into buffers of all tiles. With no loop per
tile, a block whose pairs are mostly skipped costs little more than its tiling.

Heads stay grouped: queries are viewed as `[B, Hkv, G, T, D]` (G = H // Hkv query heads per kv head),
so grouped-query attention never repeats keys or values. Lengths that are not a multiple of the tile
are padded; padded keys are masked out and padded query rows are dropped. The values' head dim may
differ from the queries' and keys' (multi-head latent attention): the output, its accumulator and dv
take the values' one. The tiled operands are `tuner.kernels.scan_tiling`'s; this module holds the tile
loops.

`forward` and `backward` are the entry points; `tuner.kernels.scan` wraps them in the backend
contract. The arguments are those of `block_fwd` / `block_bwd` (`tuner.kernels.base`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tuner.support import vma, work
from tuner.kernels.scan_tiling import Operands, Tiling
from tuner.semantics.spec import AttentionSpec

F32 = jnp.float32


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


def _logits(ops: Operands, spec: AttentionSpec, q_tile, i, j, masked, transposed: bool = False):
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


def _visit(ops: Operands, spec: AttentionSpec, codes, compute, carry):
    """Run `compute(carry, n, masked)` for every entry `n` of `codes [N]` (tile pairs' codes, from
    `Operands.visits`) that is not 0, in index order. The loop runs over the list of the visited
    entries only, so a skipped pair (0) costs no iteration at all. `masked` is a traced bool, true for
    code 2 (the masks exclude some pairs of the tile, so its mask is built: `Operands.mask`); without a
    mask it is False."""
    def run(c, n, masked):
        work.record("tile_area", ops.tiling.block_q * ops.tiling.block_kv)
        return compute(c, n, masked)

    zero = jnp.int32(0)  # int32 loop indices, also under x64: the carries hold tile indices as int32
    if not spec.has_mask:
        return lax.fori_loop(zero, jnp.int32(codes.shape[0]), lambda n, c: run(c, n, False), carry)
    order = jnp.argsort(codes == 0, stable=True).astype(jnp.int32)  # the visited entries first, in order
    visited = jnp.sum(codes != 0, dtype=jnp.int32)
    return lax.fori_loop(zero, visited, lambda m, c: run(c, order[m], codes[order[m]] == 2), carry)


# --------------------------------------------------------------------------------------------------
# Forward: one loop over the visited pairs, query tile by query tile, an online softmax in the carry.
# --------------------------------------------------------------------------------------------------


def _forward(ops: Operands, spec: AttentionSpec):
    nq, b, hkv, g, bq, _ = ops.q.shape
    nk, dv = ops.tiling.num_kv, ops.v.shape[-1]

    def pair(carry, n, masked):
        row, row_max, row_sum, acc, out, lse = carry
        i, j = n // nk, n % nk
        row_max = jnp.where(i == row, row_max, -jnp.inf)  # a new query tile: rescale below zeroes sum and acc
        s, _ = _logits(ops, spec, ops.q[i], i, j, masked)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = jnp.exp(s - safe_max[..., None])
        rescale = jnp.exp(row_max - safe_max)
        row_sum = rescale * row_sum + p.sum(axis=-1)
        pv = _einsum("bhgqk,bhkd->bhgqd", _operand(p, ops.v.dtype), ops.v[j])
        acc = rescale[..., None] * acc + pv
        has_mass = row_sum > 0
        safe_sum = jnp.where(has_mass, row_sum, 1.0)
        out = out.at[i].set(acc / safe_sum[..., None])  # the query tile so far: its last visit leaves it whole
        lse = lse.at[i].set(jnp.where(has_mass, new_max + jnp.log(safe_sum), -jnp.inf))
        return vma.like(i, ops.q), new_max, row_sum, acc, out, lse

    stat = (b, hkv, g, bq)
    init = (jnp.int32(-1), jnp.full(stat, -jnp.inf, F32), jnp.zeros(stat, F32), jnp.zeros((*stat, dv), F32),
            jnp.zeros((nq, *stat, dv), F32), jnp.full((nq, *stat), -jnp.inf, F32))  # unvisited tiles: 0, -inf
    init = jax.tree.map(lambda x: vma.like(x, ops.q), init)
    *_, out, lse = _visit(ops, spec, ops.visits(spec).reshape(-1), pair, init)
    return ops.untile_query(out), ops.untile_row_stat(lse)


# --------------------------------------------------------------------------------------------------
# Backward: one loop over the visited pairs, key tile by key tile, adding each pair's dk, dv (and dq,
# when fused) in place into buffers of all tiles; or a separate dq pass, query tile by query tile.
# --------------------------------------------------------------------------------------------------


class _Grads:
    """Gradient pieces of tile (i, j), from the final-softmax statistics.

    The dk/dv pass works `transposed` (key rows, see `_logits`); the separate dq pass does not.
    """

    def __init__(self, ops: Operands, spec: AttentionSpec, do, lse, delta, i, j, masked,
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

    def dk(self, ops: Operands):
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.ds, ops.q.dtype), self.q_tile)

    def dv(self, ops: Operands):
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.p, self.do_tile.dtype), self.do_tile)

    def dq(self, ops: Operands, j):
        """`[B, Hkv, G, bq, D]`, or `[B, Hkv, D, G, bq]` when transposed (a plain matmul by k^T)."""
        if self.transposed:
            return _einsum("bhdk,bhkgq->bhdgq", jnp.swapaxes(ops.k[j], -1, -2),
                              _operand(self.ds, ops.k.dtype))
        return _einsum("bhgqk,bhkd->bhgqd", _operand(self.ds, ops.k.dtype), ops.k[j])

    def dbias(self, ops: Operands, i, j):
        dlogits = jnp.moveaxis(self.dlogits, 2, -1) if self.transposed else self.dlogits
        target = ops.bias[ops.bias_index(i, j)].shape
        axes = tuple(a for a, (got, want) in enumerate(zip(dlogits.shape, target)) if want == 1 < got)
        return dlogits.sum(axis=axes, keepdims=True)


def _backward(ops: Operands, spec: AttentionSpec, do, lse, delta, dq_ops: Operands | None,
              dq_do=None, dq_lse=None, dq_delta=None):
    fused = dq_ops is None
    nq, b, hkv, g, bq, d = ops.q.shape

    def pair(grads_so_far, n, masked):
        j, i = n // nq, n % nq
        dk, dv, dq, dbias = grads_so_far
        grads = _Grads(ops, spec, do, lse, delta, i, j, masked, transposed=True)
        dk, dv = dk.at[j].add(grads.dk(ops)), dv.at[j].add(grads.dv(ops))
        if fused:
            dq = dq.at[i].add(grads.dq(ops, j))
        if dbias is not None:
            dbias = dbias.at[ops.bias_index(i, j)].add(grads.dbias(ops, i, j))
        return dk, dv, dq, dbias

    dk0, dv0 = (vma.like(jnp.zeros(x.shape, F32), ops.q) for x in (ops.k, ops.v))
    dq0 = vma.like(jnp.zeros((nq, b, hkv, d, g, bq), F32), ops.q) if fused else None  # transposed
    dbias0 = None if ops.bias is None else vma.like(jnp.zeros(ops.bias.shape, F32), ops.q)
    codes = ops.visits(spec).T.reshape(-1)  # key tile by key tile
    dk, dv, dq, dbias = _visit(ops, spec, codes, pair, (dk0, dv0, dq0, dbias0))
    if fused:
        dq = jnp.moveaxis(dq, 3, -1)
    else:
        dq = _dq_pass(dq_ops, spec, dq_do, dq_lse, dq_delta)
    return dq, dk, dv, dbias


def _dq_pass(ops: Operands, spec: AttentionSpec, do, lse, delta):
    def pair(dq, n, masked):
        i, j = n // ops.tiling.num_kv, n % ops.tiling.num_kv
        grads = _Grads(ops, spec, do, lse, delta, i, j, masked, transposed=False)
        return dq.at[i].add(grads.dq(ops, j))

    dq0 = vma.like(jnp.zeros(ops.q.shape, F32), ops.q)
    return _visit(ops, spec, ops.visits(spec).reshape(-1), pair, dq0)


# --------------------------------------------------------------------------------------------------
# Entry points.
# --------------------------------------------------------------------------------------------------


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec, block_q: int, block_kv: int):
    """`(o, lse)` in float32 of one query block against one key block, in `block_q` x `block_kv` tiles."""
    tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
    return _forward(Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2]), spec)


def backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
             dkv_tiles: tuple[int, int], dq_tiles: tuple[int, int] | None):
    """`(dq, dk, dv, dbias)` in float32: a dk/dv pass in `dkv_tiles` (query, key) tiles, which also
    accumulates dq when `dq_tiles` is None, else a separate dq pass in `dq_tiles`."""
    def prepared(block_q, block_kv):
        tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
        ops = Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2])
        safe_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # p = exp(-inf - inf) = 0, no NaN
        return (ops, ops.query_side(do), ops.row_stat(safe_lse, jnp.inf),
                ops.row_stat(delta, 0.0))

    ops, do_t, lse_t, delta_t = prepared(*dkv_tiles)
    if dq_tiles is None:
        dq, dk, dv, dbias = _backward(ops, spec, do_t, lse_t, delta_t, None)
        dq = ops.untile_query(dq)
    else:
        dq_ops, dq_do, dq_lse, dq_delta = prepared(*dq_tiles)
        dq, dk, dv, dbias = _backward(ops, spec, do_t, lse_t, delta_t, dq_ops, dq_do, dq_lse, dq_delta)
        dq = dq_ops.untile_query(dq)
    dk, dv = ops.untile_key(dk), ops.untile_key(dv)
    if dbias is not None:
        dbias = ops.untile_bias(dbias)
    return dq, dk, dv, dbias
