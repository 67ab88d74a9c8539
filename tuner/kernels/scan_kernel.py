"""The scan backend's kernel: blockwise flash attention in pure JAX, with loops over tile pairs.

Queries are cut into `block_q` tiles and keys into `block_kv` tiles. The loops run over the list of
the (query tile, key tile) pairs the masks let through (`Operands.visits`), query tile by query tile,
so a pair whose position / segment ranges exclude every pair (`masks.tile_pairs`) costs no iteration at
all, and a query tile is read once. The forward keeps the online softmax of the current query tile in
the loop's carry, resuming from that tile's running output and lse and writing them back as it goes:
merged in place into the ring's running state, with no block output beside it. The backward adds each
pair's dk and dv in place into buffers of all key tiles, and its dq into the running dq, which it
keeps in query tiles of its own layout (`dq_state`). With no loop per tile, a block whose pairs are
mostly skipped costs little more than its tiling.

Heads stay grouped: queries are viewed as `[B, T, Hkv, G, D]` (G = H // Hkv query heads per kv head),
so grouped-query attention never repeats keys or values; keys and values are read heads-major (the
ring passes them so, `heads_major`). Lengths that are not a multiple of the tile are padded; padded
keys are masked out and padded query rows are dropped. The values' head dim may differ from the
queries' and keys' (multi-head latent attention): the output, its accumulator and dv take the values'
one. The tiled operands are `tuner.kernels.scan_tiling`'s; this module holds the tile loops.

`forward` and `backward` are the entry points in the caller's layout (`block_fwd` / `block_bwd` of
`tuner.kernels.base`); `empty_state`, `accumulate` and `result` the forward that merges into the ring's
running state in place, `dq_state`, `step_backward` and `dq_result` the backward's. `tuner.kernels.scan`
wraps them in the backend contract.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tuner.support import vma, work
from tuner.kernels.scan_tiling import (Operands, Tiling, add_key_tile, caller_major, heads_major, set_tile, tile,
                                       untile_query, untile_row_stat, widened)
from tuner.semantics.spec import AttentionSpec

F32 = jnp.float32


def _operand(x, dtype):
    """A float32 intermediate (probabilities, their gradient) as a matmul operand: rounded to the input
    dtype where matmuls run in it, kept float32 where they are widened anyway."""
    return x if widened() else x.astype(dtype)


def _einsum(subscripts: str, a, b):
    """`jnp.einsum` accumulating in float32 (16-bit operands widened on the CPU: a product of two
    16-bit floats is exact in float32)."""
    if widened():
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(subscripts, a, b, preferred_element_type=F32)


def _logits(ops: Operands, spec: AttentionSpec, q_tile, k_tile, i, j, masked, transposed: bool = False):
    """Logits of tile (i, j) from its query and key tiles (`QueryTiles`, `KeyTiles` reads), masked to -inf,
    and the softcap's tanh (or None).

    `[B, Hkv, G, bq, bk]` (query rows), or with `transposed` `[B, Hkv, bk, G, bq]` (key rows), which
    lets the dk/dv matmuls contract over the trailing (G, bq) axes without transposing the tile.
    """
    if transposed:
        s = _einsum("bhkd,bhgqd->bhkgq", k_tile, q_tile)
    else:
        s = _einsum("bhgqd,bhkd->bhgqk", q_tile, k_tile)
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
# Forward: one loop over the visited pairs, query tile by query tile, an online softmax in the carry
# that starts from the running state of the query tile and writes it back.
# --------------------------------------------------------------------------------------------------


def _accumulate(ops: Operands, spec: AttentionSpec, out, lse):
    """`(out, lse)` with every visited pair of this block merged in: `out` the normalized output tiles
    `[B, nq, Hkv, G, bq, Dv]`, `lse` `[nq, B, Hkv, G, bq]` (0 and -inf where nothing was read yet).

    A query tile's running state is an online softmax already: its max is the lse, its sum 1 (0 where
    nothing was read) and its accumulator the normalized output. So each query tile resumes from it and
    writes it back as it goes, and no block output is made beside the running one."""
    nk = ops.tiling.num_kv

    def pair(carry, n, masked):
        row, q_tile, row_max, row_sum, acc, out, lse = carry
        i, j = n // nk, n % nk
        fresh = i != row  # a new query tile: read it once, and resume from its running state
        q_tile = lax.cond(fresh, lambda: ops.q[i], lambda: q_tile)
        running = lse[i]
        row_max = jnp.where(fresh, running, row_max)
        row_sum = jnp.where(fresh, jnp.where(running == -jnp.inf, 0.0, 1.0), row_sum)
        acc = jnp.where(fresh, tile(out, i), acc)

        s, _ = _logits(ops, spec, q_tile, ops.k[j], i, j, masked)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = jnp.exp(s - safe_max[..., None])
        rescale = jnp.exp(row_max - safe_max)
        row_sum = rescale * row_sum + p.sum(axis=-1)
        pv = _einsum("bhgqk,bhkd->bhgqd", _operand(p, ops.v.dtype), ops.v[j])
        acc = rescale[..., None] * acc + pv

        has_mass = row_sum > 0
        safe_sum = jnp.where(has_mass, row_sum, 1.0)
        out = set_tile(out, acc / safe_sum[..., None], i)  # the query tile so far: its last visit leaves it whole
        lse = lse.at[i].set(jnp.where(has_mass, new_max + jnp.log(safe_sum), -jnp.inf))
        return vma.like(i, ops.q.data), q_tile, new_max, row_sum, acc, out, lse

    b, _, hkv, g, bq, dv = out.shape
    stat = (b, hkv, g, bq)
    init = (jnp.int32(-1), jnp.zeros_like(ops.q[0]), jnp.full(stat, -jnp.inf, F32), jnp.zeros(stat, F32),
            jnp.zeros((*stat, dv), F32))
    init = tuple(vma.like(x, ops.q.data) for x in init) + (out, lse)
    *_, out, lse = _visit(ops, spec, ops.visits(spec).reshape(-1), pair, init)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Backward: one loop over the visited pairs, query tile by query tile, adding each pair's dk, dv in
# place into buffers of all key tiles, and its dq into the running dq of the query tile; or a separate
# dq pass, in tiles of its own.
# --------------------------------------------------------------------------------------------------


class _Grads:
    """Gradient pieces of tile (i, j), from the final-softmax statistics.

    The dk/dv pass works `transposed` (key rows, see `_logits`), which gives dk and dv as plain matmuls
    and dq as `[B, Hkv, D, G, bq]`; the separate dq pass does not, and gives dq as `[B, Hkv, G, bq, D]`.
    """

    def __init__(self, ops: Operands, spec: AttentionSpec, q_tile, do_tile, lse_tile, delta_tile, i, j, masked,
                 transposed: bool):
        self.transposed = transposed
        k_tile, v_tile = ops.k[j], ops.v[j]
        s, tanh = _logits(ops, spec, q_tile, k_tile, i, j, masked, transposed)
        row = (lambda x: x[:, :, None]) if transposed else (lambda x: x[..., None])
        p = jnp.exp(s - row(lse_tile))
        if transposed:
            dp = _einsum("bhkd,bhgqd->bhkgq", v_tile, do_tile)
        else:
            dp = _einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile)
        self.dlogits = p * (dp - row(delta_tile))
        ds = self.dlogits if tanh is None else self.dlogits * (1.0 - tanh * tanh)
        self.ds = ds * spec.scale
        self.p = p
        self.q_tile, self.do_tile, self.k_tile = q_tile, do_tile, k_tile

    def dk(self, ops: Operands):
        """`[B, Hkv, bk, D]`, a key tile of dk (transposed only)."""
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.ds, ops.q.dtype), self.q_tile)

    def dv(self, ops: Operands):
        """`[B, Hkv, bk, Dv]`, a key tile of dv (transposed only)."""
        return _einsum("bhkgq,bhgqd->bhkd", _operand(self.p, self.do_tile.dtype), self.do_tile)

    def dq(self, ops: Operands):
        """A query tile of dq: `[B, Hkv, D, G, bq]` transposed (a plain matmul by k^T), else `[B, Hkv, G, bq, D]`."""
        if self.transposed:
            return _einsum("bhdk,bhkgq->bhdgq", jnp.swapaxes(self.k_tile, -1, -2), _operand(self.ds, ops.k.dtype))
        return _einsum("bhgqk,bhkd->bhgqd", _operand(self.ds, ops.k.dtype), self.k_tile)

    def dbias(self, ops: Operands, i, j):
        dlogits = jnp.moveaxis(self.dlogits, 2, -1) if self.transposed else self.dlogits
        target = ops.bias[ops.bias_index(i, j)].shape
        axes = tuple(a for a, (got, want) in enumerate(zip(dlogits.shape, target)) if want == 1 < got)
        return dlogits.sum(axis=axes, keepdims=True)


def _grads_pass(ops: Operands, spec: AttentionSpec, do, lse, delta, dq, keys: bool):
    """One loop over the visited pairs, query tile by query tile: `(dq, dk, dv, dbias)`.

    With `keys` (the dk/dv pass) each pair's dk and dv (and dbias) are added in place into buffers of all
    key tiles, and its dq into `dq` unless `dq` is None (a separate pass computes it). Without `keys` (the
    separate dq pass) only dq. A query tile's q, the output's cotangent and its statistics are read once,
    when the loop reaches it; its dq resumes from the running one (`dq`, kept as `dq_state` keeps it) and
    is written back at every pair, so that its last pair leaves it whole."""
    nk = ops.tiling.num_kv
    transposed = keys

    def pair(carry, n, masked):
        row, q_tile, do_tile, dq_row, dk, dv, dq, dbias = carry
        i, j = n // nk, n % nk
        fresh = i != row  # a new query tile: read it once, and resume from its running dq
        q_tile, do_tile = lax.cond(fresh, lambda: (ops.q[i], do[i]), lambda: (q_tile, do_tile))
        grads = _Grads(ops, spec, q_tile, do_tile, lse[i], delta[i], i, j, masked, transposed)
        if keys:
            block = ops.tiling.block_kv
            dk, dv = add_key_tile(dk, grads.dk(ops), j, block), add_key_tile(dv, grads.dv(ops), j, block)
        if dq is not None:
            dq_row = jnp.where(fresh, tile(dq, i), dq_row) + grads.dq(ops)
            dq = set_tile(dq, dq_row, i)
        if dbias is not None:
            dbias = dbias.at[ops.bias_index(i, j)].add(grads.dbias(ops, i, j))
        return vma.like(i, ops.q.data), q_tile, do_tile, dq_row, dk, dv, dq, dbias

    def varying(x):
        return None if x is None else vma.like(x, ops.q.data)

    dk0 = dv0 = dbias0 = None
    if keys:
        dk0, dv0 = (varying(jnp.zeros(x.shape, F32)) for x in (ops.k, ops.v))
        dbias0 = None if ops.bias is None else varying(jnp.zeros(ops.bias.shape, F32))
    dq_row0 = None if dq is None else varying(jnp.zeros(dq.shape[:1] + dq.shape[2:], F32))
    init = (varying(jnp.int32(-1)), varying(jnp.zeros_like(ops.q[0])), varying(jnp.zeros_like(do[0])), dq_row0,
            dk0, dv0, dq, dbias0)
    *_, dk, dv, dq, dbias = _visit(ops, spec, ops.visits(spec).reshape(-1), pair, init)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------------
# Entry points.
# --------------------------------------------------------------------------------------------------


def empty_state(q, k, v, *, block_q: int, block_kv: int) -> tuple:
    """The running `(out, lse)` of queries `q` that have read nothing yet, tiled as `accumulate` keeps
    them for keys and values shaped as `k` and `v` (the caller's layout): zeros and -inf."""
    tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
    b, h, (hkv, dv) = q.shape[0], q.shape[2], v.shape[2:]
    out = jnp.zeros((b, tiling.num_q, hkv, h // hkv, tiling.block_q, dv), F32)
    lse = jnp.full((tiling.num_q, b, hkv, h // hkv, tiling.block_q), -jnp.inf, F32)
    return vma.like(out, q), vma.like(lse, q)


def accumulate(state: tuple, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec, block_q: int,
               block_kv: int) -> tuple:
    """The running `(out, lse)` (`empty_state`'s tiling) with one key block's pairs merged in, in place; `k`
    and `v` heads-major (`heads_major`)."""
    tiling = Tiling.make(q.shape[1], k.shape[2], block_q, block_kv)
    return _accumulate(Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2]), spec, *state)


def result(state: tuple, q_len: int) -> tuple:
    """The running state as `(o [B, Tq, H, Dv], lse [B, H, Tq])` in float32."""
    out, lse = state
    return untile_query(jnp.moveaxis(out, 4, 2), q_len), untile_row_stat(lse, q_len)


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec, block_q: int, block_kv: int):
    """`(o, lse)` in float32 of one query block against one key block (the caller's layout), in `block_q` x
    `block_kv` tiles."""
    tiles = {"block_q": block_q, "block_kv": block_kv}
    state = accumulate(empty_state(q, k, v, **tiles), q, heads_major(k), heads_major(v), q_pos, kv_pos, q_seg, kv_seg,
                       bias, spec=spec, **tiles)
    return result(state, q.shape[1])


def dq_state(q, k, *, dkv_tiles: tuple[int, int], dq_tiles: tuple[int, int] | None):
    """The running dq of queries `q` against keys shaped as `k` (the caller's layout), zero, in query tiles as
    the pass that computes it keeps them: `[B, nq, Hkv, D, G, bq]` in the dk/dv pass (`dq_tiles` None),
    `[B, nq, Hkv, G, bq, D]` in a dq pass of its own."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    block_q = Tiling.make(t, k.shape[1], *(dkv_tiles if dq_tiles is None else dq_tiles)).block_q
    rows = (d, h // hkv, block_q) if dq_tiles is None else (h // hkv, block_q, d)
    return vma.like(jnp.zeros((b, -(-t // block_q), hkv, *rows), F32), q)


def dq_result(dq, q_len: int, dq_tiles: tuple[int, int] | None):
    """`dq_state`'s tiles as float32 `[B, Tq, H, D]`."""
    rows = jnp.transpose(dq, (0, 1, 5, 2, 4, 3)) if dq_tiles is None else jnp.moveaxis(dq, 4, 2)
    return untile_query(rows, q_len)


def step_backward(dq, q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  dkv_tiles: tuple[int, int], dq_tiles: tuple[int, int] | None):
    """`(dq, dk, dv, dbias)` in float32 of one block, with `k` and `v` heads-major: the block's dq added into
    the running `dq` (`dq_state`'s) in place, dk and dv heads-major. A dk/dv pass in `dkv_tiles` (query, key)
    tiles, which also computes dq when `dq_tiles` is None, else a separate dq pass in `dq_tiles`."""
    def prepared(block_q, block_kv):
        tiling = Tiling.make(q.shape[1], k.shape[2], block_q, block_kv)
        ops = Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2])
        safe_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # p = exp(-inf - inf) = 0, no NaN
        return ops, ops.query_side(do), ops.row_stat(safe_lse, jnp.inf), ops.row_stat(delta, 0.0)

    ops, do_t, lse_t, delta_t = prepared(*dkv_tiles)
    fused = dq_tiles is None
    dq_block, dk, dv, dbias = _grads_pass(ops, spec, do_t, lse_t, delta_t, dq if fused else None, keys=True)
    if not fused:
        dq_ops, dq_do, dq_lse, dq_delta = prepared(*dq_tiles)
        dq_block, *_ = _grads_pass(dq_ops, spec, dq_do, dq_lse, dq_delta, dq, keys=False)
    if dbias is not None:
        dbias = ops.untile_bias(dbias)
    return dq_block, ops.untile_key(dk), ops.untile_key(dv), dbias


def backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
             dkv_tiles: tuple[int, int], dq_tiles: tuple[int, int] | None):
    """`(dq, dk, dv, dbias)` in float32 of one query block against one key block, all in the caller's
    layout (`step_backward`'s tiles)."""
    tiles = {"dkv_tiles": dkv_tiles, "dq_tiles": dq_tiles}
    dq, dk, dv, dbias = step_backward(dq_state(q, k, **tiles), q, heads_major(k), heads_major(v), lse, do, delta,
                                      q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec, **tiles)
    return dq_result(dq, q.shape[1], dq_tiles), caller_major(dk), caller_major(dv), dbias
