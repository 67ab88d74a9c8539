"""The tile pairs a kernel visits over a ring: what the time models count work in.

For every ring step and every device, the kernels visit the tile pairs whose position ranges may attend
(`tuner.semantics.masks.ranges_may_attend`, the rule of the kernels' tile schedules) on the positions
the layout gives that device and the shard visiting it. Segment ids are not counted (the schedule is that of the
positions alone: an upper bound when documents would let tiles be skipped).

Inside the other strategies the kernel's ring runs on what the exchange gathered (`STRATEGIES`): all_to_all's
one step over the whole sequence in the layout's device-major order, all_gather's one step of a device's
queries against that sequence, the hybrid's ring over its ring positions, each holding its position's chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tuner import registry
from tuner.semantics import layouts, masks
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes


STRATEGIES = ("ring", "all_to_all", "all_gather", "hybrid")  # the kernel's ring inside each (module docstring)


def visited(problem: Problem, block_q: int, block_kv: int, strategy: str = "ring") -> np.ndarray:
    """Visited tile pairs per (step, device) of the kernel's ring inside `strategy`, `[steps, devices]`, for
    tiles of `block_q` queries and `block_kv` keys (the same total whichever side a kernel walks): a ring's
    `ring_size` steps on each device, the hybrid's steps on each ring position (its group's devices visit
    the same), one step on each device of all_to_all and all_gather."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if (strategy == "hybrid") != (problem.a2a_size > 1):
        raise ValueError(f"strategy {strategy!r} does not run {problem.describe()}: the hybrid runs over two mesh "
                         f"axes (a2a_size > 1), every other strategy over one")
    # The scale does not move a tile, and segment ids are not counted (module docstring).
    mask = dataclasses.replace(problem.spec, scale=1.0, has_segments=False)
    return _visited(problem.layout, problem.seq_len, problem.ring_positions, strategy, mask, block_q, block_kv)


def inside(problem: Problem, implementation: str, kernel: str) -> tuple[LocalShapes, str]:
    """What the block kernel `kernel` runs when `implementation` runs `problem`: its shapes on each device
    (`registry.problem_tile_shapes`) and the strategy it runs inside; `ValueError` naming `implementation`
    where it runs another kernel."""
    runs = registry.get(implementation)
    if getattr(runs, "engine", None) != kernel:
        raise ValueError(f"implementation {implementation!r} does not run the {kernel} kernel the model times")
    return registry.problem_tile_shapes(runs, problem), registry.strategy_of(runs)


def steps(problem: Problem, strategy: str = "ring") -> int:
    """The steps of the kernel's ring inside `strategy` (`visited`'s first axis): the ring positions of a
    ring or the hybrid, one step after all_to_all's or all_gather's exchange."""
    return problem.ring_positions if strategy in ("ring", "hybrid") else 1


def _bounds(positions: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile, the (min, max) position (the last tile padded with its last position, as the kernels'
    schedules pad it)."""
    tiles = -(-len(positions) // block)
    padded = np.pad(positions, (0, tiles * block - len(positions)), mode="edge").reshape(tiles, block)
    return padded.min(axis=1), padded.max(axis=1)


def _pairs(queries: np.ndarray, keys: np.ndarray, spec: AttentionSpec, block_q: int, block_kv: int) -> int:
    """The tile pairs of `queries` against `keys` (positions, in the order the kernel walks them) that may
    attend."""
    q_lo, q_hi = _bounds(queries, block_q)
    k_lo, k_hi = _bounds(keys, block_kv)
    return int(np.asarray(masks.ranges_may_attend(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :], None,
                                                  spec)).sum())


@functools.lru_cache(maxsize=512)
def _visited(layout: str, seq_len: int, p: int, strategy: str, spec: AttentionSpec, block_q: int, block_kv: int
             ) -> np.ndarray:
    """`visited` over `p` positions of the layout (the ring's devices, the hybrid's ring positions)."""
    shards = [layouts.local_positions_np(layout, seq_len // p, p, r) for r in range(p)]
    if strategy in ("ring", "hybrid"):  # step s: each position's shard against the one s positions back
        return np.array([[_pairs(shards[r], shards[(r - s) % p], spec, block_q, block_kv) for r in range(p)]
                         for s in range(p)], np.int64)
    whole = np.concatenate(shards)  # the gathered sequence, device-major (`layouts.global_order`)
    if strategy == "all_to_all":
        return np.full((1, p), _pairs(whole, whole, spec, block_q, block_kv), np.int64)
    return np.array([[_pairs(shard, whole, spec, block_q, block_kv) for shard in shards]], np.int64)


__all__ = ["STRATEGIES", "inside", "steps", "visited"]
