"""The documents layout: a ring layout computed from each batch row's segment ids, for packed batches.

A fixed layout balances one causal sequence. A packed row holds many documents, and each document's
causal work grows with the square of its length, so a fixed layout leaves one device with a long
document's tail, or spreads every document over every tile so that no tile can be skipped.

A plan, per batch row (a document is a run of equal segment ids), for a threshold `heavy` and a piece
length `piece`:

1. Cost. A token's work is the number of keys of its own document it may read (its offset plus one
   when causal, the document's length otherwise, both capped by the window). A document's cost is the
   sum over its tokens; a device's share is the row's total over P.
2. Heavy documents are cut. A document costing more than `heavy` shares is cut into 2k pieces of at
   least `piece` tokens (k <= P), paired as zigzag pairs them (piece j with piece 2k-1-j, pairs of equal
   cost), and the pairs of all heavy documents are dealt to the devices heaviest first, in snake order
   (0, 1, ..., P-1, P-1, ..., 0, 0, ...).
3. Light documents stay whole and in token order: they fill, in turn, what the heavy pieces leave of
   each device, so that a device holds a run of neighbouring documents.
4. Every device holds exactly T/P tokens: the devices' tokens are laid end to end and cut into P equal
   parts, so an overfull device hands its last tokens to the next.
5. Each device holds its tokens in token order, so a tile covers few documents and near positions.

The kernels skip a tile pair when the position and segment ranges of its two tiles cannot meet
(`tuner.semantics.masks`), so what a layout costs is a count of tile pairs, not of tokens: `busiest`
counts the tiles the busiest device computes, exactly as the ring skips them. `tuner.semantics.layouts.
document_order` takes, per row, the plan (over the thresholds `HEAVY` and piece lengths `PIECE`) or
fixed layout with the fewest: never more work on the busiest device than the best fixed layout. Worst
case: documents of a few tiles each, all of them costly, where no cut keeps a tile within one piece;
then a fixed layout is chosen.

Everything is array operations of fixed shapes (sorts, cumulative sums, segment sums), so the layout
is computed inside `jax.jit` from traced segment ids, and on the host from NumPy arrays alike."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tuner.semantics import masks
from tuner.semantics.spec import AttentionSpec

DOCUMENTS = "documents"
DEFAULT_TILE = 128  # the tile the layout is planned for when the caller does not say
HEAVY = (0.125, 0.5, 2.0)  # tried: a document costing more than this share of a device is cut
PIECE = (1, 4)  # tried: the shortest piece of a cut document, in tiles
COUNTED_TILES = 1024  # at most this many tiles a row when the candidates' work is counted


class Documents(NamedTuple):
    """Per token of one row: its document (numbered in order of appearance), the document's length, the
    token's offset in it, the keys of its own document it may read, and its document's cost (the sum of
    those reads)."""

    doc: Any
    size: Any
    offset: Any
    reads: Any
    cost: Any

    @classmethod
    def of(cls, segments, spec: AttentionSpec) -> Documents:
        """The documents of `segments [T]`: runs of equal segment ids."""
        total = segments.shape[0]
        token = jnp.arange(total, dtype=jnp.int32)
        starts = jnp.concatenate([jnp.ones((1,), bool), segments[1:] != segments[:-1]])
        doc = jnp.cumsum(starts, dtype=jnp.int32) - 1
        size = jax.ops.segment_sum(jnp.ones_like(token), doc, total)[doc]
        offset = token - jax.ops.segment_min(token, doc, total)[doc]
        left, right = (total, total) if spec.window is None else spec.window
        reads = jnp.minimum(offset, left) + 1
        if not spec.causal:
            reads += jnp.minimum(size - 1 - offset, right)
        reads = reads.astype(jnp.float32)
        return cls(doc, size, offset, reads, jax.ops.segment_sum(reads, doc, total)[doc])


def plans(segments, ring: int, spec: AttentionSpec, tile: int):
    """The candidate layouts of one row of `segments [T]`: `[n, T]`, one per threshold and piece length."""
    docs = Documents.of(segments, spec)
    return jnp.stack([plan(docs, ring, heavy, piece * tile) for heavy in HEAVY for piece in PIECE])


def plan(docs: Documents, ring: int, heavy: float, piece: int):
    """One row's layout (`[T]` token indices, device-major) that cuts every document costing more than
    `heavy` of a device's share into pieces of at least `piece` tokens, paired over up to P devices."""
    doc, size, offset, reads, cost = docs
    total = doc.shape[0]
    local = total // ring
    token = jnp.arange(total, dtype=jnp.int32)
    devices = jnp.clip(size // (2 * piece), 1, ring)  # the devices a heavy document is spread over
    is_heavy = (cost > heavy * reads.sum() / ring) & (devices > 1)

    # Heavy documents: 2k pieces over k devices, pieces j and 2k-1-j paired as zigzag pairs them.
    index = offset * (2 * devices) // size
    pair = jnp.minimum(index, 2 * devices - 1 - index)
    first_unit = jax.ops.segment_max(jnp.where(is_heavy, devices, 0), doc, total)
    unit = jnp.where(is_heavy, (jnp.cumsum(first_unit) - first_unit)[doc] + pair, total)
    unit_cost = jax.ops.segment_sum(reads, unit, total + 1)[:total]
    rank = jnp.argsort(jnp.argsort(jnp.where(unit_cost > 0, -unit_cost, jnp.inf), stable=True))
    lap, seat = rank // ring, rank % ring
    dealt = jnp.where(lap % 2 == 0, seat, ring - 1 - seat)  # heaviest first, snake order 0..P-1, P-1..0
    heavy_device = dealt[jnp.minimum(unit, total - 1)]

    # Light documents: whole, in token order, filling what the heavy pieces leave of each device.
    heavy_tokens = jax.ops.segment_sum(is_heavy.astype(jnp.int32), heavy_device, ring)
    room = jnp.cumsum(jnp.maximum(local - heavy_tokens, 0))
    light_index = jnp.cumsum(~is_heavy) - 1
    light_device = jnp.minimum(jnp.searchsorted(room, light_index, side="right"), ring - 1)
    preferred = jnp.where(is_heavy, heavy_device, light_device)

    # Exactly T/P tokens a device: the preferred tokens end to end, cut into P equal parts.
    stream = jnp.argsort(preferred * (2 * total) + jnp.where(is_heavy, 0, total) + token, stable=True)
    device = jnp.zeros_like(token).at[stream].set(token // local)

    # Each device's tokens in token order.
    return jnp.argsort(device * total + token, stable=True).astype(jnp.int32)


def busiest(order, segments, ring: int, spec: AttentionSpec, tiles: tuple[int, int]):
    """The busiest device's logit tile area under `order`: what the ring computes with `(query, key)`
    tiles of these sizes (cut to the shard), skipping the tile pairs whose ranges cannot meet."""
    total = order.shape[0]
    local = total // ring
    slot = jnp.arange(total)
    segments = segments[order]

    def bounds(tile: int):
        per_shard = -(-local // tile)
        index = slot // local * per_shard + slot % local // tile
        count = ring * per_shard
        return tuple(reduce(x, index, count) for x in (order, segments)
                     for reduce in (jax.ops.segment_min, jax.ops.segment_max))

    q_tile, kv_tile = (min(t, local) for t in tiles)
    q_lo, q_hi, q_seg_lo, q_seg_hi = bounds(q_tile)
    k_lo, k_hi, k_seg_lo, k_seg_hi = bounds(kv_tile)
    may = masks.ranges_may_attend(q_lo[:, None], q_hi[:, None], k_lo[None], k_hi[None],
                                  (q_seg_lo[:, None], q_seg_hi[:, None], k_seg_lo[None], k_seg_hi[None]), spec)
    return may.sum(1).reshape(ring, -1).sum(1).max() * q_tile * kv_tile


def lay_out_rows(x, order, *, axis: int = 1):
    """`x` with its sequence `axis` permuted row by row into `order` (`[B, T]`, from `document_order`);
    a batch dimension of 1 on either side is broadcast to the other's."""
    rows = max(x.shape[0], order.shape[0])
    x = jnp.broadcast_to(x, (rows,) + x.shape[1:])
    order = jnp.broadcast_to(order, (rows, order.shape[1]))
    shape = [1] * x.ndim
    shape[0], shape[axis] = order.shape
    index = jnp.broadcast_to(jnp.reshape(order, shape), x.shape)
    return jnp.take_along_axis(x, index, axis=axis)


def restore_rows(x, order, *, axis: int = 1):
    """Inverse of `lay_out_rows`: the sequence `axis` of `x` back in token order."""
    return lay_out_rows(x, jnp.argsort(order, axis=-1), axis=axis)
