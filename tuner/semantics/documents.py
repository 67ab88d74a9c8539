"""The documents layout: a ring layout computed from each batch row's segment ids, for packed batches.

A fixed layout balances one causal sequence. A packed row holds many documents, and each document's
causal work grows with the square of its length, so a fixed layout leaves one device with a long
document's tail, or spreads every document over every tile so that no tile can be skipped.

The kernels skip a tile pair when the position and segment ranges of its two tiles cannot meet
(`tuner.semantics.masks`), so what a layout costs is a count of tile pairs, not of tokens. The plan,
per batch row, deals whole chunks of the row to the devices:

1. Chunks. The row, in token order, is cut into chunks of the kernel's tile (the larger of the query
   and key tiles; coarser on long rows, so that a row has at most `COUNTED_TILES` chunks, and on a
   shard the tile does not divide, the next divisor of the shard: `chunk_size`). A chunk is
   a run of neighbouring tokens, so its position and segment ranges are as tight as a contiguous
   layout's tiles: whichever device holds it, the ring skips as much as it can at this tile size.
2. Cost. A chunk's cost is the number of chunks its queries may read, by the kernels' own skip rule
   (`masks.ranges_may_attend` on the chunks' ranges).
3. Dealing. The chunks are dealt to the devices costliest first, in snake order (0, 1, ..., P-1,
   P-1, ..., 0, 0, ...), so every device gets T/P tokens. Dealt so, the busiest device carries at most
   one chunk's cost more than the least busy one. A long document's chunks spread over every device,
   its early (cheap) chunks paired with its late (costly) ones, as zigzag pairs them.
4. Each device holds its chunks in token order.

`busiest` counts the tiles the busiest device computes, exactly as the ring skips them, and
`tuner.semantics.layouts.document_order` takes, per row, the plan or the fixed layout with the fewest:
never more work on the busiest device than the best fixed layout. Worst case: a shard that is not a
whole number of tiles, where the chunks are not whole tiles (longer than a tile: up to the whole shard,
where its length is prime) and a tile spans chunks from far apart; a fixed layout is then often chosen.
The plan's cost is at most `COUNTED_TILES` squared chunk pairs a row, whatever the length.

Everything is array operations of fixed shapes (sorts, sums, comparisons of `[n, n]` chunk pairs), so
the layout is computed inside `jax.jit` from traced segment ids, and on the host from NumPy arrays alike."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tuner.semantics import masks
from tuner.semantics.packing import Packing
from tuner.semantics.spec import AttentionSpec
from tuner.support import arrays, counting, permutations

DOCUMENTS = "documents"
DEFAULT_TILE = 128  # the tile the layout is planned for when the caller does not say
COUNTED_TILES = 1024  # at most this many chunks (and counted tiles) a row
PACKED_TILES = (64, 32, 16)  # the default tiles of a packed call, chosen from its documents (`tile_choice`)
PACKED_TILE = PACKED_TILES[0]  # the longest: a tile covering a whole shard skips nothing
EFFICIENT = 0.75  # a packed call's default tile: the longest whose `efficiency` reaches this
DECLARED_ROWS = 4  # the rows of a drawn packing its default tile is chosen on


def chunk_size(total: int, ring: int, tiles: tuple[int, int]) -> int:
    """The chunk the plan deals for a row of `total` tokens over `ring` devices: the smallest divisor of
    the shard that is at least the larger tile (cut to the shard) and leaves the row at most
    `COUNTED_TILES` chunks, and a multiple of that tile where the tile divides the shard. A divisor, so
    every device holds whole chunks; at least the tile, so a row whose shard the tile does not divide is
    not cut into chunks of a few tokens, whose pairs the plan would count by the billion."""
    local = total // ring
    tile = min(max(tiles), local)
    step = tile if local % tile == 0 else 1
    least = max(tile, -(-total // COUNTED_TILES))
    return next(d for d in range(-(-least // step) * step, local + 1, step) if local % d == 0)


def row_useful(segments, spec: AttentionSpec):
    """The logits a row of segment ids `segments [T]` needs, in token order: the (query, key) pairs of each
    document (a run of equal ids) that the masks allow (its causal triangle, cut by the window). float32,
    so that long rows do not overflow; traced or not, in NumPy for a NumPy row (`arrays.namespace`)."""
    xp = arrays.namespace(segments)
    total = segments.shape[0]
    token = xp.arange(total)
    start = xp.concatenate([xp.ones(1, bool), segments[1:] != segments[:-1]])  # a document's first token
    document = counting.counted_before(start) + start.astype(xp.int32) - 1  # each token's document, in row order
    # where each document starts (counted and scattered: a running max over the row costs the TPU compiler
    # seconds); the documents after the last start at `total`, so that the last ends at the row's end
    starts = _scattered(xp.full(total + 1, total), document, token, start)
    first, last = starts[document], starts[document + 1] - 1
    left, right = (None, None) if spec.window is None else spec.window
    before, after = token - first, last - token
    reads = (before if left is None else xp.minimum(before, left)) + 1
    if not spec.causal:
        reads = reads + (after if right is None else xp.minimum(after, right))
    return reads.astype(xp.float32).sum()


def _scattered(array, index, values, where):
    """`array` with `array[index[i]] = values[i]` wherever `where[i]`, in the library of `array`."""
    if isinstance(array, np.ndarray):
        array = array.copy()
        array[index[where]] = values[where]
        return array
    return array.at[jnp.where(where, index, array.shape[0])].set(values, mode="drop")


def useful_logits(lengths: Sequence[int], spec: AttentionSpec) -> float:
    """`row_useful` of a row of documents of these `lengths`, computed now in NumPy, even inside a trace."""
    return float(row_useful(_row(lengths, sum(lengths)), spec))


def chunk_costs(segments, spec: AttentionSpec, chunk: int):
    """Per chunk of `chunk` neighbouring tokens of `segments [T]` (T a multiple of `chunk`), the number of
    chunks its queries may read, by the kernels' own rule: what `plan` deals by. In NumPy for a NumPy row."""
    xp = arrays.namespace(segments)
    count = segments.shape[0] // chunk
    first = xp.arange(count, dtype=xp.int32) * chunk
    last = first + chunk - 1
    ids = segments.reshape(count, chunk)
    low, high = ids.min(axis=1), ids.max(axis=1)
    may = masks.ranges_may_attend(first[:, None], last[:, None], first[None], last[None],
                                  (low[:, None], high[:, None], low[None], high[None]), spec)
    return may.sum(axis=1)


def deal(cost, ring: int):
    """The device of each chunk of costs `cost [n]`, dealt costliest first in snake order (0, 1, ...,
    P-1, P-1, ..., 0, 0, ...): the busiest device within the costliest chunk of the least busy one. In
    NumPy for NumPy costs."""
    xp = arrays.namespace(cost)
    rank = permutations.inverse(arrays.stable_argsort(-cost))
    lap, seat = rank // ring, rank % ring
    return xp.where(lap % 2 == 0, seat, ring - 1 - seat)


def row_efficiency(segments, spec: AttentionSpec, ring: int, tile: int):
    """The share of the busiest device's logits that the documents of `segments [T]` need, times `ring`,
    when `plan` deals the row in tiles of `tile` over `ring` devices (counted in the plan's chunks, so a
    lower bound on a row of more than `COUNTED_TILES` tiles): 1 when the devices are balanced and no
    tile pair is computed in vain. Traced or not; float32 in NumPy for a NumPy row, as in a step."""
    xp = arrays.namespace(segments)
    chunk = chunk_size(segments.shape[0], ring, (tile, tile))
    cost = chunk_costs(segments, spec, chunk)
    device = deal(cost, ring)
    if xp is np:
        loads = np.bincount(device, weights=cost, minlength=ring)
    else:
        loads = jax.ops.segment_sum(cost, device, ring)
    busiest = loads.max().astype(xp.float32)
    return row_useful(segments, spec) / (ring * busiest * chunk * chunk)


def efficiency(lengths: Sequence[int], spec: AttentionSpec, ring: int, tile: int) -> float:
    """`row_efficiency` of a row of documents of these `lengths` (padded with one more document where the
    ring does not divide it, as a call on global arrays is), computed now in NumPy, even inside a trace."""
    return float(row_efficiency(_padded_row(lengths, ring), spec, ring, tile))


def packed_efficiencies(lengths: Sequence[int], spec: AttentionSpec, ring: int) -> list[float]:
    """`efficiency` on each of `PACKED_TILES`."""
    row = _padded_row(lengths, ring)
    return [float(row_efficiency(row, spec, ring, tile)) for tile in PACKED_TILES]


def _padded_row(lengths: Sequence[int], ring: int) -> np.ndarray:
    """The segment ids of a row of documents of these `lengths`, padded with one more to a multiple of `ring`."""
    total = sum(lengths)
    return _row(lengths, total + -total % ring)


def _row(lengths: Sequence[int], total: int) -> np.ndarray:
    """The segment ids of a row of documents of these `lengths`, and one more up to `total` tokens."""
    return np.repeat(np.arange(len(lengths) + 1, dtype=np.int32), [*lengths, total - sum(lengths)])


def tile_choice(efficiencies):
    """The index, in `PACKED_TILES`, of a packed call's default tile, from the worst row's efficiency on
    each tile (`efficiencies`, longest tile first): the first tile, and the next while the one reached is
    under `EFFICIENT` and the next raises it. A longer tile runs each of its logits faster on every
    backend; a shorter one skips more of a short document's causal diagonal and of its neighbours, and
    deals a long document more evenly. In NumPy for a NumPy array (a declared packing's, chosen on the host),
    else in jax (traced or not)."""
    xp = arrays.namespace(efficiencies)
    index, reached, walking = xp.int32(0), efficiencies[0], xp.bool_(True)
    for i in range(1, len(efficiencies)):
        walking = walking & (reached < EFFICIENT) & (efficiencies[i] > reached)
        index = xp.where(walking, i, index)
        reached = xp.where(walking, efficiencies[i], reached)
    return index


def packed_tile(rows: Sequence[Sequence[int]], spec: AttentionSpec, ring: int) -> int:
    """The default tile of a packed call whose rows hold documents of these lengths (`rows`: a list of
    rows' document lengths) over `ring` devices: `tile_choice` among `PACKED_TILES`, computed now in NumPy,
    in float32 as a traced call's rows choose."""
    worst = np.min([packed_efficiencies(row, spec, ring) for row in rows], axis=0).astype(np.float32)
    return PACKED_TILES[int(tile_choice(worst))]


def rows_tile_choice(segments, spec: AttentionSpec, ring: int):
    """`tile_choice` for the rows of segment ids `segments [B, T]` (traced: what a packed call with no
    declared packing runs, chosen in the step from its own rows)."""
    worst = [jax.vmap(lambda row, t=tile: row_efficiency(row, spec, ring, t))(segments).min()
             for tile in PACKED_TILES]
    return tile_choice(jnp.stack(worst))


@functools.lru_cache(maxsize=256)
def declared_tile(packing: str | None, seq_len: int, ring: int, spec: AttentionSpec) -> int | None:
    """The default tile of a packed call that declares `packing` (`Packing` text) on rows of `seq_len`
    tokens over `ring` devices: `packed_tile` of its first `DECLARED_ROWS` rows (a fixed packing shorter
    than the row, as a padded call's, gets one more document: the padding); None without a packing."""
    if packing is None:
        return None
    declared = Packing.parse(packing)
    if declared.kind == "fixed":
        short = seq_len - sum(declared.lengths)
        rows = [list(declared.lengths) + ([short] if short > 0 else [])]
    else:
        rows = [declared.row_lengths(seq_len, row) for row in range(DECLARED_ROWS)]
    return packed_tile(rows, spec, ring)


def plan(segments, ring: int, spec: AttentionSpec, chunk: int):
    """One row's layout (`[T]` token indices, device-major): the chunks of `chunk` tokens of
    `segments [T]` dealt to the `ring` devices (`deal`), each device's in token order."""
    xp = arrays.namespace(segments)
    total = segments.shape[0]
    count = total // chunk
    device = deal(chunk_costs(segments, spec, chunk), ring)
    chunks = arrays.stable_argsort(device * count + xp.arange(count))  # device-major, token order within one
    return (chunks[:, None] * chunk + xp.arange(chunk)[None]).reshape(total).astype(xp.int32)


def busiest(order, segments, ring: int, spec: AttentionSpec, tiles: tuple[int, int]):
    """How many tile pairs the busiest device computes under `order`, with `(query, key)` tiles of these
    sizes (cut to the shard), skipping the pairs whose ranges cannot meet. A count, not an area: the orders
    of a row are compared in the same tiles, and the area passes int32 from about 2**17 tokens."""
    xp = arrays.namespace(order, segments)
    total = order.shape[0]
    local = total // ring
    segments = segments[order]

    def bounds(tile: int):
        """(lowest, highest) token and segment id of each tile of each shard: the shards' tiles are runs
        of slots, so each is a reduction over a row of the shards cut in tiles (the last of a shard
        padded), not a scatter."""
        per_shard = -(-local // tile)

        def tiled(x, fill):
            shards = xp.pad(x.reshape(ring, local), ((0, 0), (0, per_shard * tile - local)), constant_values=fill)
            return shards.reshape(ring * per_shard, tile)

        return tuple(reduce(tiled(x, fill), axis=1) for x in (order, segments)
                     for reduce, fill in ((xp.min, np.iinfo(x.dtype).max), (xp.max, np.iinfo(x.dtype).min)))

    q_tile, kv_tile = (min(t, local) for t in tiles)
    q_lo, q_hi, q_seg_lo, q_seg_hi = bounds(q_tile)
    k_lo, k_hi, k_seg_lo, k_seg_hi = bounds(kv_tile)
    may = masks.ranges_may_attend(q_lo[:, None], q_hi[:, None], k_lo[None], k_hi[None],
                                  (q_seg_lo[:, None], q_seg_hi[:, None], k_seg_lo[None], k_seg_hi[None]), spec)
    return may.sum(1, dtype=xp.int32).reshape(ring, -1).sum(1).max()


def lay_out_rows(x, order, *, axis: int = 1):
    """`x` with its sequence `axis` permuted row by row into `order` (`[B, T]`, from `document_order`);
    a batch dimension of 1 on either side is broadcast to the other's."""
    if order.ndim != 2 or order.shape[1] != x.shape[axis]:
        raise ValueError(f"order must be [B, T] with T the length of axis {axis} of x {tuple(x.shape)}, got "
                         f"{tuple(order.shape)}")
    rows = max(x.shape[0], order.shape[0])
    x = jnp.broadcast_to(x, (rows,) + x.shape[1:])
    order = jnp.broadcast_to(order, (rows, order.shape[1]))
    return permute(x, jnp.asarray(order), axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def permute(x, order, axis: int):
    """`x` with its `axis` permuted: slot i holds `x[..., order[i], ...]`, with `order [T]` for every row
    alike, or `order [B, T]` row by row. Its gradient is the inverse permutation, a gather, where a
    gather's own would be a scatter-add."""
    if order.ndim == 1:
        return jnp.take(x, order, axis=axis)
    return jax.vmap(lambda row, row_order: jnp.take(row, row_order, axis=axis - 1))(x, order)  # whole slices


def _permute_forward(x, order, axis: int):
    return permute(x, order, axis), order


def _permute_backward(axis: int, order, cotangent):
    return permute(cotangent, permutations.inverse(order), axis), None


permute.defvjp(_permute_forward, _permute_backward)


def restore_rows(x, order, *, axis: int = 1):
    """Inverse of `lay_out_rows`: the sequence `axis` of `x` back in token order."""
    return lay_out_rows(x, permutations.inverse(order), axis=axis)
