"""The tile pairs a kernel visits over a ring: what the time models count work in.

For every ring step and every device, the tile schedule the kernels run
(`tuner.semantics.masks.tile_schedule` on the positions the layout gives that device and the shard
visiting it) says which tile pairs are visited. Segment ids are not counted (the schedule is that of the
positions alone: an upper bound when documents would let tiles be skipped).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from tuner.semantics import layouts, masks
from tuner.semantics.problem import Problem


@functools.lru_cache(maxsize=256)
def visited(problem: Problem, block_q: int, block_kv: int, by_key: bool) -> np.ndarray:
    """Visited tile pairs per (step, device) of the ring, `[ring_size, ring_size]`, for tiles of
    `block_q` queries and `block_kv` keys (`by_key`: the schedule of a kernel that walks query tiles
    for each key tile, as dK/dV does)."""
    p, t = problem.ring_size, problem.local_len
    positions = [jnp.broadcast_to(layouts.local_positions(problem.layout, t, p, r), (1, t)) for r in range(p)]
    counts = np.zeros((p, p), np.int64)
    for step in range(p):
        for device in range(p):
            schedule = masks.tile_schedule(positions[device], positions[(device - step) % p], None, None,
                                           problem.spec, block_q, block_kv, by_key=by_key)
            counts[step, device] = int(schedule.count.sum())
    return counts


__all__ = ["visited"]
