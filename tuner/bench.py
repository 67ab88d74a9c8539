"""`tuner bench`: the tuned variant, the backend default, the scan fallback and dense attention, timed
side by side in one interleaved run (DESIGN section 11: ratios against references from the same run).

The tuned variant is what `get_tuned_ring_attention` would run for the problem (its `explain`
decision). Dense attention is `jax.nn.dot_product_attention` on one device over the whole sequence
(`xla`; also `cudnn` on a GPU): the same size and work, with only the causal mask.
"""

from __future__ import annotations

import jax

from tuner.backends import get_backend
from tuner.dispatch import get_tuned_ring_attention
from tuner.problem import Problem
from tuner.search import resolve_backend
from tuner.tables import short_params, table
from tuner.timing import attention_flops, run_interleaved
from tuner.workload import Compiled, Workload


def bench(problem: Problem, *, device: str, backend: str = "auto", objective: str = "fwd+bwd",
          runs: int = 7, db: str | None = None) -> str:
    """Time the candidates of the module docstring on `problem`; returns the printed table."""
    workload = Workload(problem)
    chosen = resolve_backend(backend, problem, device)
    local = problem.local_len
    explained = get_tuned_ring_attention(
        axis_name="sp", causal=problem.causal, sliding_window=problem.window,
        chunk_size=problem.chunk_size, logits_soft_cap=problem.softcap, layout=problem.layout,
        backend=chosen.name, db=db,
    ).explain(*_local_structs(problem), ring_size=problem.ring_size, **_call_structs(problem))
    default = chosen.default_params(local, local, problem.head_dim)
    scan_default = get_backend("scan").default_params(local, local, problem.head_dim)
    rings = {
        f"tuned ({explained.source})": (explained.backend, explained.fwd_params, explained.bwd_params),
        "default": (chosen.name, *default),
        "scan default": ("scan", *scan_default),
    }
    backward = objective != "fwd"
    sets = [workload.draw(seed=i) for i in range(3)]
    compiled: dict[str, Compiled] = {}
    labels: dict[str, list[str]] = {}
    seen = {}
    for name, (backend_name, fwd, bwd) in rings.items():
        if (backend_name, fwd, bwd) in seen:
            labels[seen[(backend_name, fwd, bwd)]][0] += f" = {name}"
            continue
        seen[(backend_name, fwd, bwd)] = name
        compiled[name] = workload.compile(workload.ring(backend_name, fwd, bwd), *sets[0], backward=backward)
        labels[name] = [name, backend_name, f"fwd({short_params(fwd)}) bwd({short_params(bwd)})"]

    one_device = jax.devices()[0]
    dense_sets = [tuple(jax.device_put(x, one_device) for x in s) for s in sets]
    for implementation in ("xla", "cudnn") if device == "gpu" else ("xla",):
        name = f"dense {implementation}"
        compiled[name] = workload.compile(workload.dense(implementation), *dense_sets[0], backward=backward)
        labels[name] = [name, "jax.nn.dot_product_attention", "one device, whole sequence"]

    thunks = {}
    for name, fn in compiled.items():
        thunks.update(fn.thunks(name, dense_sets if name.startswith("dense") else sets))
    timings = run_interleaved(thunks, runs=runs, warmup=2)

    flops = attention_flops(problem.batch, problem.heads, problem.seq_len, problem.seq_len, problem.head_dim,
                            causal=problem.causal, objective=objective)
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


def _local_structs(problem: Problem):
    local = problem.local_len
    q = jax.ShapeDtypeStruct((problem.batch, local, problem.heads, problem.head_dim), problem.dtype)
    kv = jax.ShapeDtypeStruct((problem.batch, local, problem.kv_heads, problem.head_dim), problem.dtype)
    return q, kv, kv


def _call_structs(problem: Problem) -> dict:
    options = {}
    if problem.segments:
        seg = jax.ShapeDtypeStruct((problem.batch, problem.local_len), "int32")
        options.update(q_segment_ids=seg, kv_segment_ids=seg)
    if problem.sinks:
        shape = (problem.heads,) if problem.sinks == 1 else (problem.heads, problem.sinks)
        options["softmax_aux"] = jax.ShapeDtypeStruct(shape, problem.dtype)
    return options
