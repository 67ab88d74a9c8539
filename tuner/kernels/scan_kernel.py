"""The scan backend's kernel: blockwise flash attention in pure JAX, with loops over tile pairs.

Queries are cut into `block_q` tiles and keys into `block_kv` tiles. The loops run over the list of
the (query tile, key tile) pairs the masks let through (`Operands.visits`), so a pair whose position /
segment ranges exclude every pair (`masks.tile_pairs`) costs no iteration at all. The forward runs one
loop over the visited pairs, query tile by query tile, with the online softmax of the current query
tile in the loop's carry, resuming from that tile's running output and lse and writing them back as it
goes: merged in place into the ring's running state, with no block output beside it. The backward runs
one loop over all the visited pairs, adding each pair's gradients in place into buffers of all tiles
(dq into the ring's running dq). With no loop per tile, a block whose pairs are mostly skipped costs
little more than its tiling.

Heads stay grouped: queries are viewed as `[B, T, Hkv, G, D]` (G = H // Hkv query heads per kv head),
so grouped-query attention never repeats keys or values. Lengths that are not a multiple of the tile
are padded; padded keys are masked out and padded query rows are dropped. The values' head dim may
differ from the queries' and keys' (multi-head latent attention): the output, its accumulator and dv
take the values' one. The tiled operands are `tuner.kernels.scan_tiling`'s; this module holds the tile
loops.

`forward` and `backward` are the entry points, and `empty_state`, `accumulate` and `result` the forward
that merges into the ring's running state in place; `tuner.kernels.scan` wraps them in the backend
contract. The arguments are those of `block_fwd` / `block_bwd` (`tuner.kernels.base`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tuner.support import vma, work
from tuner.kernels.scan_tiling import Operands, Tiling, set_tile, tile, untile_query, untile_row_stat, widened
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
    """Logits of tile (i, j) from its query and key tiles (`Tiled` reads), masked to -inf, and the
    softcap's tanh (or None).

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


def _rows_first(x):
    """A query tile `[B, Hkv, G, bq, D]` as computed -> `[B, bq, Hkv, G, D]`, as a dq tile is kept."""
    return jnp.moveaxis(x, 3, 1)


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
# Backward: one loop over the visited pairs, key tile by key tile, adding each pair's dk, dv (and dq,
# when fused) in place into buffers of all tiles; or a separate dq pass, query tile by query tile.
# --------------------------------------------------------------------------------------------------


def _add_tile(x, value, index):
    """`x` with `value` added to its tile `index`, in place."""
    return set_tile(x, tile(x, index) + value, index)


class _Grads:
    """Gradient pieces of tile (i, j), from the final-softmax statistics.

    The dk/dv pass works `transposed` (key rows, see `_logits`); the separate dq pass does not.
    """

    def __init__(self, ops: Operands, spec: AttentionSpec, do, lse, delta, i, j, masked,
                 transposed: bool, k_tile, v_tile):
        self.transposed = transposed
        q_tile, do_tile = ops.q[i], do[i]
        s, tanh = _logits(ops, spec, q_tile, k_tile, i, j, masked, transposed)
        row = (lambda x: x[:, :, None]) if transposed else (lambda x: x[..., None])
        p = jnp.exp(s - row(lse[i]))
        if transposed:
            dp = _einsum("bhkd,bhgqd->bhkgq", v_tile, do_tile)
        else:
            dp = _einsum("bhgqd,bhkd->bhgqk", do_tile, v_tile)
        self.dlogits = p * (dp - row(delta[i]))
        ds = self.dlogits if tanh is None else self.dlogits * (1.0 - tanh * tanh)
        self.ds = ds * spec.scale
        self.p = p
        self.q_tile, self.do_tile, self.k_tile = q_tile, do_tile, k_tile

    def dk(self, ops: Operands):
        """`[B, bk, Hkv, D]`, a key tile of dk (transposed only)."""
        return jnp.moveaxis(_einsum("bhkgq,bhgqd->bhkd", _operand(self.ds, ops.q.dtype), self.q_tile), 2, 1)

    def dv(self, ops: Operands):
        """`[B, bk, Hkv, Dv]`, a key tile of dv (transposed only)."""
        return jnp.moveaxis(_einsum("bhkgq,bhgqd->bhkd", _operand(self.p, self.do_tile.dtype), self.do_tile), 2, 1)

    def dq(self, ops: Operands):
        """`[B, bq, Hkv, G, D]`, a query tile of dq."""
        if self.transposed:  # a plain matmul by k^T
            dq = _einsum("bhdk,bhkgq->bhdgq", jnp.swapaxes(self.k_tile, -1, -2), _operand(self.ds, ops.k.dtype))
            return jnp.transpose(dq, (0, 4, 1, 3, 2))  # [B, Hkv, D, G, bq] -> [B, bq, Hkv, G, D]
        return _rows_first(_einsum("bhgqk,bhkd->bhgqd", _operand(self.ds, ops.k.dtype), self.k_tile))

    def dbias(self, ops: Operands, i, j):
        dlogits = jnp.moveaxis(self.dlogits, 2, -1) if self.transposed else self.dlogits
        target = ops.bias[ops.bias_index(i, j)].shape
        axes = tuple(a for a, (got, want) in enumerate(zip(dlogits.shape, target)) if want == 1 < got)
        return dlogits.sum(axis=axes, keepdims=True)


def _backward(ops: Operands, spec: AttentionSpec, do, lse, delta, dq0, dq_pass: tuple | None):
    """dq (tiled as `dq0`, the dq so far, which it adds to), dk, dv and dbias, all tiled. dq in the dk/dv
    pass, or with `dq_pass`, `(operands, do, lse, delta)` tiled for it, in a pass of its own."""
    fused = dq_pass is None
    nq = ops.tiling.num_q

    def pair(carry, n, masked):
        j, i = n // nq, n % nq
        column, k_tile, v_tile, dk, dv, dq, dbias = carry
        # key tile by key tile: read a key tile's k and v once, not in every pair of it
        k_tile, v_tile = lax.cond(j != column, lambda: (ops.k[j], ops.v[j]), lambda: (k_tile, v_tile))
        grads = _Grads(ops, spec, do, lse, delta, i, j, masked, True, k_tile, v_tile)
        dk, dv = _add_tile(dk, grads.dk(ops), j), _add_tile(dv, grads.dv(ops), j)
        if fused:
            dq = _add_tile(dq, grads.dq(ops), i)
        if dbias is not None:
            dbias = dbias.at[ops.bias_index(i, j)].add(grads.dbias(ops, i, j))
        return vma.like(j, ops.q.data), k_tile, v_tile, dk, dv, dq, dbias

    dk0, dv0 = (vma.like(jnp.zeros(x.shape, F32), ops.q.data) for x in (ops.k, ops.v))
    dbias0 = None if ops.bias is None else vma.like(jnp.zeros(ops.bias.shape, F32), ops.q.data)
    tiles = tuple(vma.like(x, ops.q.data) for x in (jnp.int32(-1), jnp.zeros_like(ops.k[0]), jnp.zeros_like(ops.v[0])))
    codes = ops.visits(spec).T.reshape(-1)  # key tile by key tile
    *_, dk, dv, dq, dbias = _visit(ops, spec, codes, pair, (*tiles, dk0, dv0, dq0 if fused else None, dbias0))
    if not fused:
        dq_ops, dq_do, dq_lse, dq_delta = dq_pass
        dq = _dq_pass(dq_ops, spec, dq_do, dq_lse, dq_delta, dq0)
    return dq, dk, dv, dbias


def _dq_pass(ops: Operands, spec: AttentionSpec, do, lse, delta, dq0):
    def pair(dq, n, masked):
        i, j = n // ops.tiling.num_kv, n % ops.tiling.num_kv
        grads = _Grads(ops, spec, do, lse, delta, i, j, masked, False, ops.k[j], ops.v[j])
        return _add_tile(dq, grads.dq(ops), i)

    return _visit(ops, spec, ops.visits(spec).reshape(-1), pair, dq0)


# --------------------------------------------------------------------------------------------------
# Entry points.
# --------------------------------------------------------------------------------------------------


def empty_state(q, k, v, *, block_q: int, block_kv: int) -> tuple:
    """The running `(out, lse)` of queries `q` that have read nothing yet, tiled as `accumulate` keeps
    them for keys and values shaped as `k` and `v`: zeros and -inf."""
    tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
    b, h, (hkv, dv) = q.shape[0], q.shape[2], v.shape[2:]
    out = jnp.zeros((b, tiling.num_q, hkv, h // hkv, tiling.block_q, dv), F32)
    lse = jnp.full((tiling.num_q, b, hkv, h // hkv, tiling.block_q), -jnp.inf, F32)
    return vma.like(out, q), vma.like(lse, q)


def accumulate(state: tuple, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec, block_q: int,
               block_kv: int) -> tuple:
    """The running `(out, lse)` (`empty_state`'s tiling) with one key block's pairs merged in, in place."""
    tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
    return _accumulate(Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2]), spec, *state)


def result(state: tuple, q_len: int) -> tuple:
    """The running state as `(o [B, Tq, H, Dv], lse [B, H, Tq])` in float32."""
    out, lse = state
    return untile_query(jnp.moveaxis(out, 4, 2), q_len), untile_row_stat(lse, q_len)


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec, block_q: int, block_kv: int):
    """`(o, lse)` in float32 of one query block against one key block, in `block_q` x `block_kv` tiles."""
    tiles = {"block_q": block_q, "block_kv": block_kv}
    state = accumulate(empty_state(q, k, v, **tiles), q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec, **tiles)
    return result(state, q.shape[1])


def backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
             dkv_tiles: tuple[int, int], dq_tiles: tuple[int, int] | None, dq=None):
    """`(dq, dk, dv, dbias)` in float32: a dk/dv pass in `dkv_tiles` (query, key) tiles, which also
    accumulates dq when `dq_tiles` is None, else a separate dq pass in `dq_tiles`. With `dq` (float32
    `[B, Tq, H, D]`, the dq so far) the block's dq is added to it in place, else to zeros."""
    def prepared(block_q, block_kv):
        tiling = Tiling.make(q.shape[1], k.shape[1], block_q, block_kv)
        ops = Operands(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling, q.shape[2])
        safe_lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # p = exp(-inf - inf) = 0, no NaN
        return (ops, ops.query_side(do), ops.row_stat(safe_lse, jnp.inf),
                ops.row_stat(delta, 0.0))

    ops, do_t, lse_t, delta_t = prepared(*dkv_tiles)
    dq_pass = None if dq_tiles is None else prepared(*dq_tiles)
    dq_ops = ops if dq_pass is None else dq_pass[0]
    dq0 = vma.like(jnp.zeros(q.shape, F32), q) if dq is None else dq
    dq, dk, dv, dbias = _backward(ops, spec, do_t, lse_t, delta_t, dq_ops.tile_query(dq0), dq_pass)
    dq = dq_ops.untile_query(dq)
    dk, dv = ops.untile_key(dk), ops.untile_key(dv)
    if dbias is not None:
        dbias = ops.untile_bias(dbias)
    return dq, dk, dv, dbias
