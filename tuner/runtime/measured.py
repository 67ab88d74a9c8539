"""Which implementation `backend="auto"` runs by measurement: one rule over the cache's decisions.

The decisions of a problem are the current, valid cache rows of every registered implementation that
can honour the call (`tuner.cache.rows`): its search row and its bench row, and in a file no writer has
migrated, the legacy `mechanisms` row read as bench rows (`tuner.cache.legacy`). The rule:

1. bench rows first -- a `tuner bench --mechanisms` run timed every implementation side by side on the
   same inputs, the fairest comparison there is: the fastest of them that can honour the call (a run
   counts only while every row of it is current);
2. else the fastest search row (each implementation's best config, from its own study; rows of the
   fwd+bwd objective before the others), when more than the preferred implementation has one;
3. else nothing: the platform's preference decides (`tuner.registry.resolve_auto`).

Only the implementation is chosen here; its config comes from the search rows (`Cache.lookup`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tuner import registry
from tuner.cache import Cache, legacy, row_digest, row_problem, stale_reason, warn_once
from tuner.semantics.problem import ProblemKey
from tuner.semantics.spec import AttentionSpec


def decisions(cache: Cache, key: ProblemKey, spec: AttentionSpec) -> list[dict[str, Any]]:
    """The current, valid decision rows of every registered implementation for the problem of `key`
    (whatever its backend); an invalid bench row is skipped with a warning, and the bench run counts
    only when every row of it is current (its times compare implementations as they were then)."""
    wanted = {row_digest(dataclasses.replace(key, backend=name), source): (name, source)
              for name in registry.names() for source in ("search", "bench")}
    rows = []
    for row in cache.entries(list(wanted)):
        name, source = wanted[row["key"]]
        problem = row_problem(row)
        if problem is not None:
            if source != "search":  # an invalid search row is reported by the config lookup
                warn_once(cache.path, f"{source} entry {row.get('key')} skipped", problem)
            continue
        rows.append(row)
    if not any(r["source"] == "bench" for r in rows):
        old = cache.legacy_run(dataclasses.replace(key, backend="auto").digest)
        try:
            rows += [] if old is None else legacy.bench_rows(old, key, spec)
        except ValueError as error:
            warn_once(cache.path, f"mechanisms row {old['key']} skipped", str(error))
    versions = {name: registry.versions(registry.get(name)) for name in {r["backend"] for r in rows}}
    current = [r for r in rows if stale_reason(r, versions[r["backend"]]) is None]
    if any(r["source"] == "bench" and r not in current for r in rows):  # a run compares only when all of it is current
        current = [r for r in current if r["source"] != "bench"]
    return current

def choose(rows: list[dict[str, Any]], key: ProblemKey, runnable: Callable[[str], bool]) -> tuple[str, str] | None:
    """The implementation the rule of the module docstring picks for the problem of `key` (whose backend
    is the platform's preferred one) from its `decisions` rows, among those `runnable` accepts, and the
    reason to give; None to decide by preference."""
    run = sorted((r for r in rows if r["source"] == "bench"), key=lambda r: r["best_s"])
    usable = [r for r in run if runnable(r["backend"])]
    if usable:
        best = usable[0]
        others = ", ".join(f"{registry.label(r['backend'])} {r['best_s'] * 1e3:.1f} ms" for r in run if r is not best)
        scope = "this problem" if best is run[0] else "this call (the fastest cannot honour it)"
        winner = registry.label(best["backend"])
        return best["backend"], (f"tuner bench --mechanisms measured {winner} fastest for {scope} "
                                 f"({best['best_s'] * 1e3:.1f} ms; {others or 'nothing else ran'}) on "
                                 f"{best['measured_at'][:10]}")
    tuned = sorted((r for r in rows if r["source"] == "search" and runnable(r["backend"])),
                   key=lambda r: (r["objective"] != "fwd+bwd", r["best_s"]))
    if not tuned or (len(tuned) == 1 and tuned[0]["backend"] == key.backend):
        return None
    best = tuned[0]
    others = ", ".join(f"{r['backend']} {r['best_s'] * 1e3:.1f} ms" for r in tuned[1:])
    return best["backend"], (f"the fastest tuned entry for this problem is {best['backend']}'s "
                             f"({best['best_s'] * 1e3:.1f} ms, objective {best['objective']}; "
                             f"{others or 'no other implementation is tuned for it'})")


def runnable_choice(rows: list[dict[str, Any]], key: ProblemKey, spec: AttentionSpec, dtype: Any,
                    target: registry.Target, return_lse: bool, strategy: str) -> tuple[str, str] | None:
    """What `auto` runs by measurement for a call, and the reason to give (`choose` over the problem's
    `decisions` rows): only implementations that can honour this call (and are of `strategy`, unless it
    is "auto") count; the measured ones that cannot are named with their reason. None to decide by the
    platform's preference."""
    passed_over: dict[str, str] = {}

    def runnable(name: str) -> bool:
        implementation = registry.find(name)
        its = None if implementation is None else registry.strategy_of(implementation)
        if its is None or registry.mesh_axes(implementation) != 1 or strategy not in ("auto", its):
            return False
        reason = registry.why_not(implementation, spec, dtype, key.head_dim, target, return_lse=return_lse,
                                  shapes=key, ring_size=key.ring_size)
        if reason is not None:
            passed_over[name] = reason
        return reason is None

    chosen = choose(rows, key, runnable)
    if chosen is None or not passed_over:
        return chosen
    return chosen[0], f"{chosen[1]}; passed over: {'; '.join(f'{n} {r}' for n, r in passed_over.items())}"


__all__ = ["choose", "decisions", "runnable_choice"]
