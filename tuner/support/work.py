"""Counting the work a ring really does, to prove that masked work is skipped.

Inside `with count_work() as counts:`, functions *traced* there report, per device, each ring step
they compute (`"blocks"`) and the area of each logit tile they compute (`"tile_area"`, query rows x
key columns). Outside that context nothing is inserted and nothing costs anything. Because counting
is decided at trace time, trace a fresh function inside the context (a cached `jit` would not count).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_active: contextvars.ContextVar[WorkCounts | None] = contextvars.ContextVar("tuner_work", default=None)
_device: contextvars.ContextVar[object] = contextvars.ContextVar("tuner_work_device", default=0)


class WorkCounts:
    """Per-device totals: `counts[kind][device] -> int`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, kind: str, device, amount) -> None:
        with self._lock:
            self.totals[kind][int(device)] += int(amount)

    def __getitem__(self, kind: str) -> collections.Counter:
        return self.totals[kind]


@contextlib.contextmanager
def count_work() -> Iterator[WorkCounts]:
    """Count the blocks and tiles computed by functions traced inside this context."""
    counts = WorkCounts()
    token = _active.set(counts)
    try:
        yield counts
    finally:
        _active.reset(token)


@contextlib.contextmanager
def on_device(rank) -> Iterator[None]:
    """Attribute work recorded while tracing this block to ring position `rank` (may be traced)."""
    token = _device.set(rank)
    try:
        yield
    finally:
        _device.reset(token)


def record(kind: str, amount) -> None:
    """At trace time: if counting, make the traced program report `amount` of `kind` when it runs."""
    counts = _active.get()
    if counts is None:
        return
    device = jnp.asarray(_device.get(), jnp.int32)
    jax.debug.callback(lambda d, a: counts.add(kind, d, a), device, jnp.asarray(amount, jnp.int32))
