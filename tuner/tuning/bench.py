"""`tuner bench`: the tuned variant, the backend default, the scan fallback and dense attention, timed
side by side in one interleaved run (DESIGN section 11: ratios against references from the same run).

The tuned variant is what `get_tuned_ring_attention` would run for the problem (its `explain`
decision). Dense attention is `jax.nn.dot_product_attention` on one device over the whole sequence
(`xla`; also `cudnn` on a GPU): the same size and work, with only the causal mask.

`tuner bench --mechanisms` (`bench_mechanisms`) instead times every registered implementation that
runs here -- each ring, gathered dense attention, any a user registered -- on the same ring and inputs,
each checked against the scan ring first, and records the run in the cache: one bench row per
implementation that ran correctly, in place of the problem's earlier run (`tuner.cache.rows`).
`--mechanisms triton,cudnn` times only the implementations named: two engines compared alone, without
gathered attention's memory at long sequences. `time_winners` does that after a search of each engine.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import jax

from tuner.support.version import __version__
from tuner import registry
from tuner.cache import Cache, make_row
from tuner.semantics.problem import Problem
from tuner.tuning.decision import loader_plan
from tuner.tuning.options import SearchOptions
from tuner.tuning.search import resolve_backend
from tuner.tuning.verify import ReferenceCheck, TrialFailed
from tuner.support.tables import describe_config, table
from tuner.tuning.timing import attention_flops, run_interleaved, warmup_seconds_on
from tuner.tuning.workload import Compiled, Workload


def bench(problem: Problem, *, device: str, backend: str = "auto", objective: str = "fwd+bwd",
          runs: int = 7, calls: int = 1, db: str | None = None) -> str:
    """Time the candidates of the module docstring on `problem`; returns the printed table."""
    workload = Workload(problem)
    chosen = resolve_backend(backend, problem, device)
    explained = loader_plan(problem, chosen.name, db)
    scan = registry.get(registry.FALLBACK)
    rings = {
        f"tuned ({explained.source})": (explained.backend, explained.config),
        "default": (chosen.name, chosen.default_config(
            registry.problem_tile_shapes(chosen, problem), problem.spec)),
    }
    if not workload.pair:  # the scan ring runs over one axis
        rings["scan default"] = (scan.name, scan.default_config(problem.shapes, problem.spec))
    backward = objective != "fwd"
    sets = [workload.draw(seed=i) for i in range(3)]
    compiled: dict[str, Compiled] = {}
    labels: dict[str, list[str]] = {}
    seen = {}
    for name, (backend_name, config) in rings.items():
        if (backend_name, config) in seen:
            labels[seen[(backend_name, config)]][0] += f" = {name}"
            continue
        seen[(backend_name, config)] = name
        compiled[name] = workload.compile(workload.attend(backend_name, config), *sets[0], backward=backward)
        labels[name] = [name, backend_name, describe_config(config)]

    one_device = jax.devices()[0]
    dense_sets = [tuple(jax.device_put(x, one_device) for x in s) for s in sets]
    for implementation in ("xla", "cudnn") if device == "gpu" else ("xla",):
        name = f"dense {implementation}"
        compiled[name] = workload.compile(workload.dense(implementation), *dense_sets[0], backward=backward)
        labels[name] = [name, "jax.nn.dot_product_attention", "one device, whole sequence"]

    thunks = {}
    for name, fn in compiled.items():
        thunks.update(fn.thunks(name, dense_sets if name.startswith("dense") else sets))
    timings = run_interleaved(thunks, runs=runs, warmup=2, warmup_seconds=warmup_seconds_on(workload.platform),
                              calls=calls)

    flops = attention_flops(problem.batch, problem.heads, problem.seq_len, problem.seq_len, problem.head_dim,
                            causal=problem.causal, objective=objective, value_head_dim=problem.value_head_dim)
    totals = {name: sum(t.median for key, t in timings.items() if key.split(":")[0] == name)
              for name in compiled}
    reference = totals["dense xla"]
    rows = []
    for name in compiled:
        fwd = timings.get(f"{name}:fwd")
        bwd = timings.get(f"{name}:bwd")
        rows.append([*labels[name], f"{fwd.median * 1e3:.1f}", f"{bwd.median * 1e3:.1f}" if bwd else "-",
                     f"{totals[name] * 1e3:.1f}", f"{flops / totals[name] / 1e9:.1f}",
                     f"{reference / totals[name]:.2f}x"])
    header = (f"{problem.describe()} on {jax.devices()[0].device_kind}, objective {objective}, "
              f"medians of {runs} interleaved runs\ntuned: {explained.reason}")
    text = table(["", "backend", "params", "fwd ms", "bwd ms", "total ms", "GFLOP/s", "vs dense xla"], rows)
    note = ("GFLOP/s counts exact attention work (DESIGN section 11). Dense attention gets the causal mask "
            "only (no window, chunk, segments, sinks or softcap) and runs on one device.")
    return f"{header}\n{text}\n{note}"


def bench_mechanisms(problem: Problem, *, device: str, objective: str = "fwd+bwd", runs: int = 5,
                     calls: int = 1, db: str | None = None,
                     names: Sequence[str] | None = None) -> tuple[str, dict[str, Any]]:
    """Time every implementation that can run `problem` here (module docstring), or those of `names`,
    each checked against the scan ring first; record the run in the cache. Returns the printed report
    and the winner's row."""
    if problem.a2a_size > 1:
        raise ValueError(f"a2a_size={problem.a2a_size}: --mechanisms compares the implementations over one mesh "
                         f"axis, this problem is over two; bench its implementation alone (without --mechanisms)")
    registered = registry.names()
    unknown = [name for name in names or () if name not in registered]
    if unknown or names is not None and not names:
        what = f"unknown {', '.join(unknown)}" if unknown else "no implementation named"
        raise ValueError(f"--mechanisms: {what} (registered: {', '.join(registered)})")
    wanted = registered if names is None else [name for name in registered if name in names]
    workload = Workload(problem)
    spec, dtype = problem.spec, jax.numpy.dtype(problem.dtype)
    backward = objective != "fwd"
    candidates, labels, chosen, skipped = {}, {}, {}, []
    for name in wanted:
        implementation = registry.get(name)
        label = registry.label(name)
        if registry.mesh_axes(implementation) != 1:
            reason = "runs over two mesh axes (axis_name=(ring_axis, group_axis)); the bench times one-axis problems"
        else:
            reason = registry.why_not(implementation, spec, dtype, problem.head_dim, registry.Target(device),
                                      shapes=problem.shapes, ring_size=problem.ring_size)
        if reason is not None:
            skipped.append(f"{label} {reason}")
            continue
        decision = loader_plan(problem, name, db)
        candidates[label] = workload.attend(name, decision.config)
        chosen[label] = (implementation, decision.config)
        labels[label] = f"{implementation.summary}: {describe_config(decision.config)} [{decision.source}]"

    if not candidates:  # before the reference, which costs a scan ring's forward and backward
        raise RuntimeError(f"no mechanism can run here: {'; '.join(skipped)}")
    reference = ReferenceCheck(workload, seed=10_000, backward=backward)
    sets = [workload.draw(seed=i) for i in range(3)]
    compiled: dict[str, Compiled] = {}
    failed: dict[str, str] = {}
    for name, fn in candidates.items():
        try:
            compiled[name], _ = reference.compile_checked(fn, *sets[0])
        except TrialFailed as failure:  # a mechanism that cannot run is reported, not fatal
            failed[name] = str(failure)
    if not compiled:
        reasons = [*skipped, *(f"{name} {why}" for name, why in failed.items())]
        raise RuntimeError(f"no mechanism ran correctly: {'; '.join(reasons)}")
    thunks = {}
    for name, fn in compiled.items():
        thunks.update(fn.thunks(name, sets))
    timings = run_interleaved(thunks, runs=runs, warmup=2, warmup_seconds=warmup_seconds_on(workload.platform),
                              calls=calls)
    totals = {name: sum(t.median for key, t in timings.items() if key.split(":")[0] == name) for name in compiled}
    winner = min(totals, key=totals.get)

    device_kind = jax.devices()[0].device_kind
    run = f"bench {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}"
    recorded = []
    for name in compiled:
        implementation, config = chosen[name]
        recorded.append(make_row(
            registry.problem_key(problem, implementation.name, device_kind), config,
            versions=registry.versions(implementation), tool_version=__version__, source="bench",
            objective=objective, best_s=totals[name], default_s=None, speedup=None, trials_run=runs, trials_pruned=0,
            trials_failed={}, study=run))
    cache = Cache(db)
    cache.put_run(recorded)

    rows = []
    for name in candidates:
        if name in failed:
            rows.append([name, labels[name], "-", "-", "-", "-", failed[name]])
            continue
        fwd, bwd = timings.get(f"{name}:fwd"), timings.get(f"{name}:bwd")
        rows.append([name, labels[name], f"{fwd.median * 1e3:.1f}", f"{bwd.median * 1e3:.1f}" if bwd else "-",
                     f"{totals[name] * 1e3:.1f}", f"{totals[name] / totals[winner]:.2f}x",
                     "winner" if name == winner else "ok"])
    header = (f"{problem.describe()} on {device_kind}, objective {objective}, medians of {runs} interleaved "
              f"runs, every mechanism on the same {problem.ring_size}-device ring, checked against the scan ring")
    lines = [header, table(["mechanism", "how", "fwd ms", "bwd ms", "total ms", "vs winner", "check"], rows)]
    lines += [f"skipped  {note}" for note in skipped]
    winning = recorded[list(compiled).index(winner)]
    lines.append(f"recorded {winner} for key {winning['key']} in {cache.path} (and the {len(recorded) - 1} other "
                 f"time{'' if len(recorded) == 2 else 's'} of this run): get_tuned_ring_attention(backend='auto') "
                 f"now runs it for this problem")
    return "\n".join(lines), winning


def time_winners(problem: Problem, names: Sequence[str], *, device: str, options: SearchOptions,
                 db: str | None = None) -> tuple[str, dict[str, Any]]:
    """The winners of the searches of `names` on `problem` (each at the config the loader takes) timed side
    by side, as a search re-times its candidates (`options.final_runs` runs of `options.calls` calls, its
    objective), and recorded so that `backend="auto"` runs the fastest (`bench_mechanisms`)."""
    return bench_mechanisms(problem, device=device, objective=options.objective, runs=options.final_runs,
                            calls=options.calls, db=db, names=names)
