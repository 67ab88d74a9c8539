"""Honest timing of compiled JAX functions (DESIGN section 7).

Every candidate is compiled first (compile time is measured apart), warmed up, then the candidates
are run interleaved -- A, B, C, A, B, C, ... -- so that a slow spell of a shared machine hits them
all alike. Each run gets a freshly drawn, non-zero input set (never zeros: a kernel that skips work
on zeros would look fast). The result is the median with its spread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

DEVICE_WARMUP_S = 0.25  # seconds of warm-up before a timed run off the CPU: an idle GPU's clocks take a while to rise


def warmup_seconds_on(platform: str) -> float:
    """The least warm-up before timing on `platform` (a JAX platform name): `DEVICE_WARMUP_S` off the CPU,
    none on it (the CPU that times is the one that just compiled)."""
    return 0.0 if platform == "cpu" else DEVICE_WARMUP_S


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and spread over `runs` interleaved runs, plus the compile time."""

    median: float
    low: float
    high: float
    runs: int
    compile_seconds: float

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the measurement was."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"median_s": self.median, "min_s": self.low, "max_s": self.high, "runs": self.runs,
                "compile_s": self.compile_seconds, "spread": self.spread}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> Timing:
        """The timing `to_dict` wrote."""
        return cls(data["median_s"], data["min_s"], data["max_s"], int(data["runs"]), data["compile_s"])


def compile_timed(fn: Callable, args: Sequence) -> tuple[Callable, float]:
    """AOT-compile `jax.jit(fn)` for `args`; returns the compiled callable and the seconds it took."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def run_interleaved(
    thunks: dict[str, Callable[[int], object]],
    *,
    runs: int = 7,
    warmup: int = 2,
    warmup_seconds: float = 0.0,
    calls: int = 1,
    compile_seconds: dict[str, float] | None = None,
    deadline: float | None = None,
) -> dict[str, Timing]:
    """Median seconds per call of each already-compiled `thunk(i)` (call `i` picks its own input set),
    warmed up, then run interleaved.

    A run issues `calls` calls back to back and waits for them all, so its time per call leaves out
    the host's dispatch gap between calls (JAX dispatches asynchronously): what a sub-millisecond GPU
    kernel needs. The warm-up lasts `warmup` rounds and at least `warmup_seconds`: a GPU that idled
    while a program compiled runs at lower clocks for a while. Rounds alternate their order (A B C,
    then C B A), so that no thunk always meets the device first. Warm-up calls get the indices -1, -2,
    ...; timed calls 0, 1, .... With `deadline` (a `time.perf_counter()` value), raises `TimeoutError`
    as soon as the rounds run so far show that the remaining ones cannot finish before it.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not warmup_seconds >= 0:
        raise ValueError(f"warmup_seconds must be >= 0, got {warmup_seconds!r}")
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    names = list(thunks)
    samples: dict[str, list[float]] = {name: [] for name in names}
    warm_until = time.perf_counter() + warmup_seconds
    warm_rounds = timed_rounds = 0
    while timed_rounds < runs:
        warming = warm_rounds < warmup or time.perf_counter() < warm_until
        if warming:
            indices = range(-warm_rounds * calls - 1, -(warm_rounds + 1) * calls - 1, -1)
        else:
            indices = range(timed_rounds * calls, (timed_rounds + 1) * calls)
        order = names if (warm_rounds + timed_rounds) % 2 == 0 else names[::-1]
        round_start = time.perf_counter()
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready([thunks[name](i) for i in indices])
            if not warming:
                samples[name].append((time.perf_counter() - start) / calls)
        if warming:
            warm_rounds += 1
        else:
            timed_rounds += 1
        now = time.perf_counter()
        still = max(0.0, warm_until - now) + (runs - timed_rounds) * (now - round_start)
        if deadline is not None and now + still > deadline:
            raise TimeoutError(f"{runs} timed runs of {len(thunks)} function(s) would take "
                               f"{(runs + warm_rounds) * (now - round_start):.1f} s")
    compile_seconds = compile_seconds or {}
    return {name: Timing(statistics.median(s), min(s), max(s), len(s), compile_seconds.get(name, 0.0))
            for name, s in samples.items()}


def time_interleaved(
    candidates: dict[str, Callable],
    input_sets: Sequence[Sequence],
    *,
    runs: int = 7,
    warmup: int = 2,
) -> dict[str, Timing]:
    """Median seconds per call of each candidate, compiled, warmed up and run interleaved.

    `input_sets` are argument tuples drawn beforehand (distinct, non-zero); run `i` uses set
    `i % len(input_sets)`, so consecutive runs never reuse the same buffers.
    """
    if not input_sets:
        raise ValueError("input_sets must hold at least one argument tuple")
    compiled, compile_seconds = {}, {}
    for name, fn in candidates.items():
        compiled[name], compile_seconds[name] = compile_timed(fn, input_sets[0])
    thunks = {name: (lambda i, fn=fn: fn(*input_sets[i % len(input_sets)])) for name, fn in compiled.items()}
    return run_interleaved(thunks, runs=runs, warmup=warmup, compile_seconds=compile_seconds)


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *, causal: bool,
                    objective: str = "fwd", value_head_dim: int | None = None) -> float:
    """FLOPs of exact attention (DESIGN section 11): forward 2*B*H*Tq*Tk*(D + Dv) (4*B*H*Tq*Tk*D where the
    values have the query/key head dim: `value_head_dim` None), half when causal; backward 2.5x forward;
    `objective` is "fwd", "bwd" or "fwd+bwd"."""
    dims = head_dim + (head_dim if value_head_dim is None else value_head_dim)
    forward = 2.0 * batch * heads * q_len * kv_len * dims * (0.5 if causal else 1.0)
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    if objective not in factor:
        raise ValueError(f"objective must be one of {', '.join(factor)}, got {objective!r}")
    return forward * factor[objective]
