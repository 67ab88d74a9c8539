"""The masking rule of DESIGN section 2, written once: per pair of tokens, and per pair of ranges.

`allowed` decides whether one query may read one key. `ranges_may_attend` decides, from the position
and segment ranges of a group of queries and a group of keys, whether *any* pair in them may be
allowed; when it says no, the whole group is skipped: a tile pair (`tile_pairs`, `tile_schedule`), or a
ring step (`ring_mask` resolves it once for every step). `ranges_fully_allowed` decides whether *every*
pair is allowed; when it says yes, the tile is computed without building a mask. Both are conservative:
they may fail to skip, or fail to drop the mask, but never give a wrong result. The range rules take
NumPy arrays as well as jax ones, and answer in the library of their arguments: the trace runs them in
NumPy on the positions it knows (`tuner.semantics.known`), the device in jax.

Positions are int32 and may lie anywhere in its range: no bound computed here can wrap around.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from tuner.semantics.spec import INT32_MAX, INT32_MIN, AttentionSpec
from tuner.support.arrays import namespace


def window_bounds(q_lo, q_hi, window: tuple[int, int]):
    """`(q_lo - left, q_hi + right)` for a `(left, right)` window: the keys some query in [q_lo, q_hi]
    may read (with `(q, q)`, query q; with `(q_hi, q_lo)`, the keys every query of the range may read).
    Clamped to the int32 range before they are formed, so neither bound can wrap: exact for any int32
    positions and sides from 0 to 2**31 - 1, as no key lies outside that range."""
    left, right = window
    xp = namespace(q_lo, q_hi)
    return xp.maximum(q_lo, INT32_MIN + left) - left, xp.minimum(q_hi, INT32_MAX - right) + right


def allowed(q_pos, k_pos, q_seg, k_seg, spec: AttentionSpec):
    """Bool `[..., Tq, Tk]`: query i may read key j. Positions/segments are `[..., Tq]` and `[..., Tk]`.

    Returns None when the spec excludes nothing (no mask needs to be applied).
    """
    qp = q_pos[..., :, None]
    kp = k_pos[..., None, :]
    conditions = []
    if spec.causal:
        conditions.append(kp <= qp)
    if spec.window is not None:
        first, last = window_bounds(qp, qp, spec.window)
        conditions.append((kp >= first) & (kp <= last))
    if spec.chunk_size is not None:
        conditions.append(qp // spec.chunk_size == kp // spec.chunk_size)
    if spec.has_segments:
        conditions.append(q_seg[..., :, None] == k_seg[..., None, :])
    if not conditions:
        return None
    mask = conditions[0]
    for condition in conditions[1:]:
        mask = mask & condition
    return mask


def _bounds(x):
    """Per batch row (min, max) of `[B, T]` positions or segment ids."""
    return x.min(axis=-1), x.max(axis=-1)


def _ranges_overlap(lo_a, hi_a, lo_b, hi_b):
    return (lo_a <= hi_b) & (lo_b <= hi_a)


def ranges_may_attend(q_lo, q_hi, k_lo, k_hi, segments, spec: AttentionSpec):
    """Elementwise bool: some query with a position in [q_lo, q_hi] may read some key in [k_lo, k_hi]
    (and, with `segments = (q_seg_lo, q_seg_hi, k_seg_lo, k_seg_hi)`, segment ids in those ranges).
    Arguments broadcast: per batch row here, per tile pair in the Triton backend's schedule."""
    xp = namespace(q_lo, q_hi, k_lo, k_hi, *(segments or ()))
    possible = xp.ones(np.broadcast_shapes(np.shape(q_lo), np.shape(k_lo)), bool)
    if spec.causal:
        possible &= k_lo <= q_hi
    if spec.window is not None:
        possible &= _ranges_overlap(*window_bounds(q_lo, q_hi, spec.window), k_lo, k_hi)
    if spec.chunk_size is not None:
        c = spec.chunk_size
        possible &= _ranges_overlap(q_lo // c, q_hi // c, k_lo // c, k_hi // c)
    if spec.has_segments:
        possible &= _ranges_overlap(*segments)
    return possible


def rows_may_attend(q_pos, kv_pos, spec: AttentionSpec):
    """Per row of `[N, Tq]` query and `[N, Tk]` key positions, whether some query may read some key
    (`ranges_may_attend` of the rows' ranges; no segment ids)."""
    return ranges_may_attend(*_bounds(q_pos), *_bounds(kv_pos), None, spec)


def ranges_fully_allowed(q_lo, q_hi, k_lo, k_hi, segments, spec: AttentionSpec):
    """Elementwise bool: every query with a position in [q_lo, q_hi] may read every key in [k_lo, k_hi]
    (with `segments = (q_seg_lo, q_seg_hi, k_seg_lo, k_seg_hi)`: all of them in one and the same
    segment). Arguments broadcast like `ranges_may_attend`'s."""
    xp = namespace(q_lo, q_hi, k_lo, k_hi, *(segments or ()))
    every = xp.ones(np.broadcast_shapes(np.shape(q_lo), np.shape(k_lo)), bool)
    if spec.causal:
        every &= k_hi <= q_lo
    if spec.window is not None:
        first, last = window_bounds(q_hi, q_lo, spec.window)
        every &= (k_lo >= first) & (k_hi <= last)
    if spec.chunk_size is not None:
        c = spec.chunk_size
        every &= (q_lo // c == q_hi // c) & (k_lo // c == k_hi // c) & (q_lo // c == k_lo // c)
    if spec.has_segments:
        q_s_lo, q_s_hi, k_s_lo, k_s_hi = segments
        every &= (q_s_lo == q_s_hi) & (k_s_lo == k_s_hi) & (q_s_lo == k_s_lo)
    return every


class RingMask(NamedTuple):
    """The mask information of every step of a ring, resolved once before the ring turns: `visits [P]`
    (bool) says whether some query of this device may read some key of the shard that visits at step
    s -- the shard of ring position `(rank - s) mod P`; the ring driver skips the steps it says no to."""

    visits: Any


def ring_mask(q_pos, kv_pos, q_seg, kv_seg, spec: AttentionSpec, axis_name, size: int, rank) -> RingMask:
    """The `RingMask` of this device's queries over the key shards of a ring of `size` along
    `axis_name`: every device's key position (and segment) bounds, `[B]` each, are all-gathered once,
    and `ranges_may_attend` decides every step from them -- the same rule as `may_attend` on the
    visiting shard, without waiting for it."""
    if not spec.has_mask:
        return RingMask(jnp.ones((size,), bool))
    local = jnp.stack([*_bounds(kv_pos), *(_bounds(kv_seg) if spec.has_segments else ())])  # [2 or 4, B]
    every = lax.all_gather(local, axis_name) if size > 1 else local[None]  # [P, 2 or 4, B], by ring position
    shard = every[(rank - jnp.arange(size)) % size]  # by step
    def mine(x):  # this device's [B] bounds, against every step's [P, B]
        return tuple(bound[None] for bound in _bounds(x))

    segments = (*mine(q_seg), shard[:, 2], shard[:, 3]) if spec.has_segments else None
    return RingMask(ranges_may_attend(*mine(q_pos), shard[:, 0], shard[:, 1], segments, spec).any(axis=-1))


def _tile_bounds(x, block: int, tiles: int):
    """Per batch row and tile, (min, max) of `[B, T]` positions or segment ids (the last tile padded
    with its last value, so padding changes neither)."""
    padded = jnp.pad(x, ((0, 0), (0, tiles * block - x.shape[1])), mode="edge").reshape(x.shape[0], tiles, block)
    return padded.min(axis=-1), padded.max(axis=-1)


class TileSchedule(NamedTuple):
    """Which tiles a kernel visits, for each batch row and tile it holds (a query tile, or a key tile
    when scheduled `by_key`) among the tiles it streams past. `order [B, held, streamed]` (int32) lists
    the streamed tiles: first those that need no mask, then the rest of those that may attend, then the
    tiles to skip; `count [B, held]` is how many of `order` to visit, `unmasked [B, held]` how many of
    those (listed first) need no mask."""

    order: Any
    count: Any
    unmasked: Any


def tile_pairs(q_pos, kv_pos, q_seg, kv_seg, spec: AttentionSpec, block_q: int, block_kv: int):
    """Per batch row and (query tile, key tile) pair, bool `[B, nq, nk]` twice: `possible`, some query of
    the tile may read some key of it (`ranges_may_attend` of the tiles' position and segment ranges),
    and `every`, every query may read every key (`ranges_fully_allowed`). A last, partial tile is judged
    by the tokens it has."""
    nq, nk = -(-q_pos.shape[1] // block_q), -(-kv_pos.shape[1] // block_kv)
    q_lo, q_hi = _tile_bounds(q_pos, block_q, nq)
    k_lo, k_hi = _tile_bounds(kv_pos, block_kv, nk)
    segments = None
    if spec.has_segments:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = _tile_bounds(q_seg, block_q, nq), _tile_bounds(kv_seg, block_kv, nk)
        segments = (qs_lo[:, :, None], qs_hi[:, :, None], ks_lo[:, None, :], ks_hi[:, None, :])
    ranges = (q_lo[:, :, None], q_hi[:, :, None], k_lo[:, None, :], k_hi[:, None, :], segments, spec)
    return ranges_may_attend(*ranges), ranges_fully_allowed(*ranges)


def tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec: AttentionSpec, block_q: int, block_kv: int, *,
                  by_key: bool = False) -> TileSchedule:
    """The `TileSchedule` of query tiles over key tiles (with `by_key`, of key tiles over query tiles). A
    tile pair is visited when `tile_pairs` says it is possible, and needs no mask when every pair of it
    is allowed and both tiles are whole, inside the lengths: the rules the scan backend and the ring
    driver skip and drop masks by."""
    q_len, kv_len = q_pos.shape[1], kv_pos.shape[1]
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    possible, every = tile_pairs(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv)
    whole = (((jnp.arange(nq) + 1) * block_q <= q_len)[:, None]
             & ((jnp.arange(nk) + 1) * block_kv <= kv_len)[None, :])
    full = possible & every & whole[None]
    if by_key:
        possible, full = jnp.swapaxes(possible, 1, 2), jnp.swapaxes(full, 1, 2)
    rank = jnp.where(full, 0, jnp.where(possible, 1, 2))
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    return TileSchedule(order, possible.sum(axis=-1, dtype=jnp.int32), full.sum(axis=-1, dtype=jnp.int32))
