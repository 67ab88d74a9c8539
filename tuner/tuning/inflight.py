"""Trials in flight: a search runs several trials at once, so the device does not wait on the compiler.

With `SearchOptions.in_flight` above 1, optuna runs that many trials in threads. Compiling is host work,
and trials compile side by side. What runs on the device, the reference check and the timed runs, takes
the `DeviceGate` alone. A timed run also waits for the compiles in flight to end, and no compile starts
while one runs or waits, so a trial is timed as it would be with nothing else in flight. On a GPU too:
there the same default kernel was timed at 1.2 to 5.8 ms beside compiles and 1.1 ms alone (an H100,
`benchmarks/gpu/README.md`), most likely as a compile's Python held the interpreter lock and the timed
calls waited to be dispatched. On the CPU the device is the host: there a check waits for the compiles
too.

The gate keeps the search's time split too. Each second of wall time goes to the activity that ran then,
the device's first (timing or check), else compiling, so the parts never add up to more than the wall
time. `compiling` counts every compile's own seconds: what exceeds the split's compile share ran beside
other work.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator


class DeviceGate:
    """One device shared by the trials in flight (module docstring). `host_is_device`: the device is
    the host's own cores (the CPU), so compiles and every device activity take turns; elsewhere only
    timing does."""

    def __init__(self, host_is_device: bool):
        self.host_is_device = host_is_device
        self.spent: Counter[str] = Counter()  # wall seconds by activity: "compile", "check", "timing"
        self.compiling = 0.0  # every compile's own seconds, summed over the trials in flight
        self._condition = threading.Condition()
        self._device: str | None = None  # the activity on the device now
        self._quiet_waiting = 0  # device requests waiting that need no compile beside them
        self._compiles = 0
        self._since = time.perf_counter()
        self._local = threading.local()

    def begin(self) -> None:
        """Start counting this thread's waits afresh (at the start of a trial)."""
        self._local.waited = 0.0

    def waited(self) -> float:
        """Seconds this thread waited for the gate since `begin`: not the trial's own time."""
        return getattr(self._local, "waited", 0.0)

    def quiet(self, activity: str | None) -> bool:
        """Whether `activity` on the device needs the host free of compiles: timing always, a check on
        the CPU."""
        return activity == "timing" or (self.host_is_device and activity is not None)

    @contextlib.contextmanager
    def compile(self) -> Iterator[None]:
        """Hold a compile slot: any number at once, but none beside timing (on the CPU, any device work)."""
        self._enter(lambda: not (self.quiet(self._device) or self._quiet_waiting), None)
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._condition:
                self._account()
                self._compiles -= 1
                self.compiling += time.perf_counter() - started
                self._condition.notify_all()

    @contextlib.contextmanager
    def device(self, activity: str) -> Iterator[None]:
        """Hold the device alone for `activity` ("check" or "timing")."""
        self._enter(lambda: self._device is None and not (self.quiet(activity) and self._compiles), activity)
        try:
            yield
        finally:
            with self._condition:
                self._account()
                self._device = None
                self._condition.notify_all()

    def _enter(self, free, activity: str | None) -> None:
        """Wait until `free()`, then take the device for `activity` (or a compile slot for None)."""
        started = time.perf_counter()
        waiting = int(self.quiet(activity))  # a quiet request waits in the count: no compile starts ahead
        with self._condition:
            self._quiet_waiting += waiting
            self._condition.wait_for(free)
            self._quiet_waiting -= waiting
            self._account()
            if activity is None:
                self._compiles += 1
            else:
                self._device = activity
        self._local.waited = self.waited() + time.perf_counter() - started

    def _account(self) -> None:
        """Give the seconds since the last change to what ran in them (called holding the condition)."""
        now = time.perf_counter()
        running = self._device or ("compile" if self._compiles else None)
        if running is not None:
            self.spent[running] += now - self._since
        self._since = now


__all__ = ["DeviceGate"]
