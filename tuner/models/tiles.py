"""The tile pairs a kernel visits over a ring: what the time models count work in.

For every ring step and every device, the tile schedule the kernels run
(`tuner.semantics.masks.tile_schedule` on the positions the layout gives that device and the shard
visiting it) says which tile pairs are visited. Segment ids are not counted (the schedule is that of the
positions alone: an upper bound when documents would let tiles be skipped).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from tuner.semantics import layouts, masks
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec


def visited(problem: Problem, block_q: int, block_kv: int, by_key: bool) -> np.ndarray:
    """Visited tile pairs per (step, device) of the ring, `[ring_size, ring_size]`, for tiles of
    `block_q` queries and `block_kv` keys (`by_key`: the schedule of a kernel that walks query tiles
    for each key tile, as dK/dV does)."""
    mask = dataclasses.replace(problem.spec, scale=1.0)  # the scale does not move a tile
    return _visited(problem.layout, problem.local_len, problem.ring_size, mask, block_q, block_kv, by_key)


@functools.lru_cache(maxsize=512)
def _visited(layout: str, t: int, p: int, spec: AttentionSpec, block_q: int, block_kv: int,
             by_key: bool) -> np.ndarray:
    positions = [jnp.broadcast_to(layouts.local_positions(layout, t, p, r), (1, t)) for r in range(p)]
    counts = np.zeros((p, p), np.int64)
    for step in range(p):
        for device in range(p):
            schedule = masks.tile_schedule(positions[device], positions[(device - step) % p], None, None,
                                           spec, block_q, block_kv, by_key=by_key)
            counts[step, device] = int(schedule.count.sum())
    return counts


__all__ = ["visited"]
