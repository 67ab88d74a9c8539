"""The tile pairs a kernel visits over a ring: what the time models count work in.

For every ring step and every device, the kernels visit the tile pairs whose position ranges may attend
(`tuner.semantics.masks.ranges_may_attend`, the rule of the kernels' tile schedules) on the positions
the layout gives that device and the shard visiting it. Segment ids are not counted (the schedule is that of the
positions alone: an upper bound when documents would let tiles be skipped).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tuner.semantics import layouts, masks
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec


def visited(problem: Problem, block_q: int, block_kv: int) -> np.ndarray:
    """Visited tile pairs per (step, device) of the ring, `[ring_size, ring_size]`, for tiles of `block_q`
    queries and `block_kv` keys (the same total whichever side a kernel walks)."""
    # The scale does not move a tile, and segment ids are not counted (module docstring).
    mask = dataclasses.replace(problem.spec, scale=1.0, has_segments=False)
    return _visited(problem.layout, problem.local_len, problem.ring_size, mask, block_q, block_kv)


def _bounds(positions: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile, the (min, max) position (the last tile padded with its last position, as the kernels'
    schedules pad it)."""
    tiles = -(-len(positions) // block)
    padded = np.pad(positions, (0, tiles * block - len(positions)), mode="edge").reshape(tiles, block)
    return padded.min(axis=1), padded.max(axis=1)


@functools.lru_cache(maxsize=512)
def _visited(layout: str, t: int, p: int, spec: AttentionSpec, block_q: int, block_kv: int) -> np.ndarray:
    positions = [np.asarray(layouts.local_positions(layout, t, p, r)) for r in range(p)]
    counts = np.zeros((p, p), np.int64)
    for step in range(p):
        for device in range(p):
            q_lo, q_hi = _bounds(positions[device], block_q)
            k_lo, k_hi = _bounds(positions[(device - step) % p], block_kv)
            pairs = masks.ranges_may_attend(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :], None, spec)
            counts[step, device] = int(np.asarray(pairs).sum())
    return counts


__all__ = ["visited"]
