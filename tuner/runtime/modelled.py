"""Which strategy `auto` runs by the analytic model (`tuner.models.strategy_model`) where no measurement decides.

The loader asks with `strategy="auto"` and `backend="auto"`. The model ranks the implemented strategies
(`CANDIDATES`) on the call's global problem (`problem_of`) with the rates of the platform the program is
built for (`model_platform`); a strategy other than the ring is picked only when the call can run it
(`runnable`: `registry.why_not` with the call's shapes) and it is predicted at least `MARGIN` faster than
the ring, and the loader runs it only when `tuner.runtime.measured` decides nothing and the ring is not tuned
for this problem (a search or compiled row of its own). Otherwise the ring runs, as without the model.

The model decides on TPUs of a generation it has rates for, and on H100s and H200s only. On the CPU, a
simulation platform whose rates say nothing about real devices, and on other GPUs it never decides.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuner import registry
from tuner.models import platforms, strategy_model
from tuner.kernels.tpu_memory import CHIPS
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes

MARGIN = 0.10  # a strategy replaces the ring only when predicted to take at most 90% of the ring's time
CANDIDATES = tuple(s for s in registry.STRATEGIES if s not in registry.TWO_AXES)  # the one-axis strategies
Predictions = tuple[tuple[str, float, float | None], ...]  # (strategy, predicted s, measured s or None)


@dataclass(frozen=True)
class Verdict:
    """The model's answer for one call: the strategy it picks ("ring" unless another is runnable and
    `MARGIN` faster), why, and every candidate's predicted (and bench-measured) seconds; `implementation`,
    the implementation of a picked strategy other than the ring that runs the call
    (`registry.strategy_choice`)."""

    strategy: str
    reason: str
    predictions: Predictions
    implementation: str | None = None


def model_platform(platform: str, device_kind: str) -> str | None:
    """The `platforms.PLATFORMS` name of a device kind, or None where the model does not decide: a
    TPU generation of `tpu_memory.CHIPS` the model has rates for, "h100" for an H100, "h200" for an H200,
    else None."""
    if platform == "tpu":
        name = CHIPS.get(device_kind)
        return name if name in platforms.PLATFORMS else None
    if platform == "gpu":  # a GPU platform's name as a word of the kind: "NVIDIA GH200 480GB" is no H200
        gpus = [name for name in platforms.PLATFORMS if name not in CHIPS.values()]
        return next((name for name in gpus if re.search(rf"\b{name.upper()}\b", device_kind)), None)
    return None


def problem_of(shapes: LocalShapes, spec: AttentionSpec, ring_size: int, layout: str,
               packing: str | None = None) -> Problem | None:
    """The global `Problem` of one device's `shapes` on a ring of `ring_size` in `layout`, its documents
    packed as the call declares (`packing`; one document a row where it declares none), or None where the
    model has none (queries and keys of different lengths, a bias, a dtype it does not know)."""
    if shapes.q_len != shapes.kv_len or spec.has_bias:
        return None
    try:
        return Problem(batch=shapes.batch, seq_len=shapes.q_len * ring_size, heads=shapes.heads,
                       kv_heads=shapes.kv_heads, head_dim=shapes.head_dim, dtype=shapes.dtype, causal=spec.causal,
                       window=spec.window, chunk_size=spec.chunk_size,
                       segments=int(spec.has_segments and packing is None), softcap=spec.softcap,
                       sinks=spec.num_sinks, ring_size=ring_size, layout=layout,
                       value_head_dim=shapes.value_head_dim, packing=packing)
    except ValueError:
        return None


def bench_seconds(rows: list[dict[str, Any]], running: dict[str, str]) -> dict[str, float]:
    """Seconds per strategy from the bench rows of `tuner.runtime.measured.decisions`: each strategy's is the
    row of the implementation that would run it (`running`, by strategy)."""
    seconds = {}
    for row in rows:
        implementation = registry.find(row["backend"])
        if row["source"] != "bench" or implementation is None:
            continue
        strategy = registry.strategy_of(implementation)
        if strategy in CANDIDATES and running.get(strategy) == row["backend"]:
            seconds[strategy] = row["best_s"]
    return seconds


def decide(problem: Problem, platform: str, runnable: Callable[[str], str | None], *,
           measured: dict[str, float] | None = None, return_lse: bool = False) -> Verdict:
    """The `Verdict` for `problem` on `platform` (a name of `platforms.PLATFORMS`); `runnable(strategy)`
    says why the call cannot run a strategy (None when it can); `measured` are bench seconds per strategy.
    The backward pass is counted: the loader serves training steps."""
    ranked = strategy_model.rank(problem, platform, return_lse=return_lse, strategies=CANDIDATES)
    measured = measured or {}
    predictions = tuple((t.strategy, t.seconds, measured.get(t.strategy)) for t in ranked)
    ring = next(t for t in ranked if t.strategy == "ring")
    head = f"strategy model ({platform}): ring predicted {ring.seconds * 1e3:.3g} ms"
    notes = []
    for t in ranked[:ranked.index(ring)]:  # the ones predicted faster than the ring, fastest first
        lead = f"{t.strategy} predicted {t.seconds * 1e3:.3g} ms ({1 - t.seconds / ring.seconds:.0%} less)"
        why = runnable(t.strategy)
        if why is not None:
            notes.append(f"{lead} cannot run this call: {why}")
        elif t.seconds > (1 - MARGIN) * ring.seconds:
            notes.append(f"{lead}, under the {MARGIN:.0%} margin")
        else:
            return Verdict(t.strategy, f"{head}, {lead}: picked {t.strategy}", predictions)
    return Verdict("ring", f"{head}; keeps the ring{': ' if notes else ''}{'; '.join(notes)}", predictions)


def verdict(rows: list[dict[str, Any]], key, spec: AttentionSpec, dtype: Any, target: registry.Target,
            return_lse: bool) -> Verdict | None:
    """The model's verdict on the call of `key` (a `ProblemKey`), with the bench times of the problem's
    cache `rows` beside its predictions; None where the model does not decide (the CPU: a simulation
    platform, or a one-device ring)."""
    platform = model_platform(target.platform, key.device_kind)
    problem = None if platform is None or key.ring_size == 1 else problem_of(key, spec, key.ring_size, key.layout,
                                                                             key.packing)
    if problem is None:
        return None

    running, reasons = {"ring": key.backend}, {}
    for strategy in (s for s in CANDIDATES if s != "ring"):
        implementation, reasons[strategy] = registry.strategy_choice(
            strategy, spec, dtype, key.head_dim, target, return_lse=return_lse, shapes=key, ring_size=key.ring_size)
        if implementation is not None:
            running[strategy] = implementation.name
    picked = decide(problem, platform, reasons.get, measured=bench_seconds(rows, running), return_lse=return_lse)
    return dataclasses.replace(picked, implementation=running.get(picked.strategy))


__all__ = ["CANDIDATES", "MARGIN", "Predictions", "Verdict", "bench_seconds", "decide", "model_platform",
           "problem_of", "verdict"]
