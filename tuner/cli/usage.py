"""What a finished search tells its user: the summary `tuner search` prints, and the exact runtime
loader call that meets the entry it stored.

These are texts about a `SearchResult` and a `Problem`, apart from `tuner.tuning.search` (the search
machinery: optuna, compiled candidates, timing), so that printing them needs none of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner import registry
from tuner.runtime import plan
from tuner.semantics.problem import Problem
from tuner.support.tables import describe_config, table

if TYPE_CHECKING:
    from tuner.tuning.search import SearchResult


def loader_call(problem: Problem, backend: str | None = None) -> list[str]:
    """The runtime loader call that meets `problem`'s cache entry of `backend` exactly, as lines of Python:
    the mesh, the arrays it takes and the call. The call names `backend` where `auto` would not plan it:
    over one axis an implementation of another strategy than the ring (`auto` keeps the ring unless a
    measurement or the model says otherwise), over two axes any but the one a pair `axis_name` runs on the
    CPU (the loader does not choose by measurement there)."""
    ring, pair = problem.ring_size > 1, problem.group is not None
    options = (['axis_name=("ring", "a2a")'] if pair else ['axis_name="sp"']) if ring else []
    if pair:
        named = backend is not None and backend != plan.check_strategy("auto", "auto", ("ring", "a2a"))
    else:
        named = backend is not None and registry.strategy_of(registry.get(backend)) != "ring"
    if named:
        options.append(f'backend="{backend}"')
    options += [text for on, text in ((problem.causal, "causal=True"),
                                      (problem.window is not None, f"sliding_window={problem.window}"),
                                      (problem.chunk_size is not None, f"chunk_size={problem.chunk_size}"),
                                      (problem.softcap is not None, f"logits_soft_cap={problem.softcap}"),
                                      (problem.packing is not None, f'packing="{problem.packing}"')) if on]
    if ring:
        options += [f'layout="{problem.layout}"', "mesh=mesh"]
    extras, shapes = "", ""
    if problem.segments:
        extras += ", q_segment_ids=segment_ids, kv_segment_ids=segment_ids"
        shapes += f", segment_ids [{problem.batch}, {problem.seq_len}]"
    if problem.sinks:
        extras += ", softmax_aux=sinks"
        shapes += f", sinks [{problem.heads}{'' if problem.sinks == 1 else f', {problem.sinks}'}]"
    lines = []
    if pair:
        lines.append(f"mesh = Mesh(np.array(jax.devices()[:{problem.ring_size}]).reshape({problem.ring_positions}, "
                     f'{problem.a2a_size}), ("ring", "a2a"))')
    elif ring:
        lines.append(f'mesh = Mesh(np.array(jax.devices()[:{problem.ring_size}]), ("sp",))')
    kv_shape = f"{problem.batch}, {problem.seq_len}, {problem.kv_heads}"
    kv = f"k/v [{kv_shape}, {problem.head_dim}]" if problem.value_head_dim is None else \
        f"k [{kv_shape}, {problem.head_dim}], v [{kv_shape}, {problem.value_dim}]"
    lines += [f"attn = get_tuned_ring_attention({', '.join(options)})",
              f"out = attn(q, k, v{extras})  # {problem.dtype} q [{problem.batch}, {problem.seq_len}, {problem.heads}, "
              f"{problem.head_dim}], {kv}"
              f"{shapes}{', global, in token order' if ring else ''}"]
    return lines


def search_summary(result: SearchResult) -> list[str]:
    """The report of a finished search, line by line: the default and the winner timed side by side,
    the study's trials, every re-timed candidate against what its trial measured, where the winner went
    (stored, or kept: a better row of the study's workers), the study, the loader call that uses the entry
    and what to run next."""
    rows = []
    for name, measured, came in (("default", result.default, "default"), ("best", result.best, result.best_from)):
        times = [f"{t.median * 1e3:.1f}" if t is not None else "-" for t in (measured.fwd, measured.bwd)]
        rows.append([name, *times, f"{measured.seconds * 1e3:.1f}",
                     f"{result.default.seconds / measured.seconds:.2f}x",
                     describe_config(measured.config), came or "-"])
    failed = ", ".join(f"{reason} {count}" for reason, count in sorted(result.failed.items())) or "none"
    lines = [f"{result.backend} backend on {result.device_kind}: {result.problem.describe()}",
             table(["", "fwd ms", "bwd ms", "total ms", "speedup", "params", "from"], rows),
             f"trials   {result.trials_run} in the study ({result.new_trials} run now): "
             f"{result.trials_run - result.trials_pruned - sum(result.failed.values())} complete, "
             f"{result.trials_pruned} pruned, failed: {failed}"]
    lines += [f"re-timing skipped {failure}" for failure in result.failures]
    if result.retimed:
        lines.append("re-timed side by side at the end, against the default; the fastest is the winner:")
        width = max(len(name) for name, _, _ in result.retimed)
        lines += [f"         {name:<{width}}  {now:.2f}x" + ("" if then is None else f"  (in its trial {then:.2f}x)")
                  for name, then, now in result.retimed]
        confirmed = max((then for _, then, _ in result.retimed if then is not None), default=1.0)
        if result.best_from == "default" and confirmed > 1.0:
            lines.append(f"default  kept: re-timed side by side, no trial beat it; the progress bar's best trial "
                         f"({confirmed:.2f}x) was not confirmed")
    if result.decided_by:
        lines.append(f"winner   decided by worker {result.decided_by}, which re-timed it first; every worker "
                     f"of the study stores this row")
    if result.stored:
        lines.append(f"stored   key {result.key.digest} in {result.db_path}")
    else:
        lines.append(f"kept     key {result.key.digest} in {result.db_path}: an earlier result of this study's "
                     f"workers ({result.stored_speedup:.2f}x) beats this run's ({result.speedup:.2f}x)")
    if result.timed_out:
        lines.append(f"stopped  by --timeout with {result.trials_run} of {result.trials_asked} trials: the best "
                     f"verified config so far is the winner; run again to go on")
    lines.append(f"study    {result.study} in {result.storage}")
    if result.spent:
        spent = {part: result.spent.get(part, 0.0) for part in ("compile", "check", "timing")}
        spent["start-up, sampler and storage"] = max(0.0, result.seconds - sum(spent.values()))
        ahead = f"; {result.ahead:.0f} s more compiling ran ahead, beside it" if result.ahead >= 0.5 else ""
        lines.append(f"time     {result.seconds:.0f} s: " + ", ".join(
            f"{part} {seconds:.0f} s ({seconds / result.seconds:.0%})" for part, seconds in spent.items()) + ahead)
    else:
        lines.append(f"time     {result.seconds:.0f} s")
    lines += [f"use      {line}" for line in loader_call(result.problem, result.backend)]
    lines.append(f"next     `tuner bench` with the same options times them against dense attention; "
                 f"`tuner show {result.key.digest[:8]}` prints the entry, `tuner report {result.key.digest[:8]}` "
                 f"writes a page on its study")
    return lines
