"""Positions known when the program is traced.

Without explicit positions, every device's shard holds the positions its layout gives it
(`layouts.local_positions_np`). So the ring driver knows, before anything runs, which positions a ring
step may pair: one case for each device of the ring at that step (and for each step of a loop, where the
step is a loop index). Whatever all those cases decide alike (the step visits its keys, a chunk pair of
the block is on the diagonal) is decided once, in the trace, instead of on the device at every step. The
trace runs the device's rules on those positions in NumPy (`KnownBlock.agreed`).

On a GPU this matters: a branch the device decides (`lax.cond`, `lax.switch`) waits for its predicate,
and its results are materialized at its boundary, where XLA could otherwise fuse them into what follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tuner.semantics import layouts, masks
from tuner.semantics.spec import AttentionSpec

LIMIT = 1 << 22  # positions a side at most (cases x tokens); past it, the device decides


@dataclass(frozen=True, eq=False)
class KnownBlock:
    """Every pair of positions a block may have: case `n` pairs queries at `q[n]` with keys at `kv[n]`
    (int32 NumPy, `[N, Tq]` and `[N, Tk]`), in every batch row."""

    q: np.ndarray
    kv: np.ndarray

    def chunk(self, q_start: int, q_size: int, kv_start: int, kv_size: int) -> KnownBlock:
        """The cases of the chunk pair of queries `[q_start, q_start + q_size)` and keys
        `[kv_start, kv_start + kv_size)`."""
        return KnownBlock(self.q[:, q_start:q_start + q_size], self.kv[:, kv_start:kv_start + kv_size])

    def agreed(self, rule: Callable) -> int | None:
        """The one value `rule(q, kv)` gives every case, as a Python int (a bool is 0 or 1), or None when
        the cases differ. `rule` takes `[N, T]` positions and returns `[N]` values: the device's own rule
        (`tuner.semantics.masks`' range rules answer in the library of their arguments), run here in NumPy
        on the known positions. Nothing is compiled, nothing is placed on a device, and no setting of the
        caller's applies: no transfer guard, no mesh of `jax.set_mesh` (jax programs of the rules failed
        there, under explicit axes, on a TPU topology's devices, which cannot run one)."""
        values = np.asarray(rule(self.q, self.kv))
        return int(values[0]) if bool((values == values[0]).all()) else None


def visited(block: KnownBlock | None, spec: AttentionSpec) -> int | None:
    """Whether the steps of `block` read their keys, 1 or 0, where every case agrees (the rule `masks.ring_mask`
    decides by on the device, `masks.rows_may_attend`); None where they differ, nothing is known, or segment
    ids (never known in the trace) may exclude keys. Without a mask, 1."""
    if not spec.has_mask:
        return 1
    if block is None or spec.has_segments:
        return None
    return block.agreed(lambda q, kv: masks.rows_may_attend(q, kv, spec))


def ring_block(layout: str | None, q_len: int, kv_len: int, size: int, steps: Iterable[int]) -> KnownBlock | None:
    """The `KnownBlock` of ring steps `steps` of a ring of `size` devices, each holding `q_len` queries
    and `kv_len` keys in `layout`: at step s, device r's queries meet the keys of device (r - s) mod size.
    None without a layout (positions were passed), or when it would hold more than `LIMIT` positions a
    side."""
    steps = tuple(steps)
    if layout is None or not steps or size * len(steps) * max(q_len, kv_len) > LIMIT:
        return None
    ranks = range(size)
    q = np.stack([layouts.local_positions_np(layout, q_len, size, rank) for rank in ranks for _ in steps])
    kv = np.stack([layouts.local_positions_np(layout, kv_len, size, (rank - step) % size)
                   for rank in ranks for step in steps])
    return KnownBlock(q.astype(np.int32), kv.astype(np.int32))


__all__ = ["KnownBlock", "LIMIT", "ring_block", "visited"]
