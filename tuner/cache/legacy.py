"""The `mechanisms` table of files written before decisions had one table, read and migrated.

Before the `source` column, `tuner bench --mechanisms` wrote one row per problem into a table of its own:
the winner and every implementation's seconds (`ring/<kernel>` for a ring), keyed by the problem's key
with backend `auto`, stamped with the jax and jaxlib versions only. Such a row is one bench run; this
module turns it into that run's bench rows of the `tuned` table (`bench_rows`):

- one row per implementation timed, `best_s` its seconds, `study` naming the legacy row;
- the config is the implementation's default for the problem: the legacy row did not record the config
  it ran, and the loader takes only the implementation from a bench row (the config comes from the
  search rows, as it did);
- the versions are the legacy row's jax and jaxlib, and this installation's triton and code hash for the
  implementation: the legacy row did not record them, and the rule that read it did not check them.

A writer migrates every legacy row it can into the `tuned` table and drops the legacy table once empty
(`tuner.cache.store`); a reader of a file no writer has opened since reads the legacy row of the problem
it decides (`tuner.runtime.dispatch`), so an old file keeps deciding as it did, read-only files included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from tuner import registry
from tuner.cache.rows import HEX_KEY, check_date, is_number, json_object, make_row
from tuner.semantics.problem import OBJECTIVES, Problem, ProblemKey
from tuner.semantics.spec import AttentionSpec

TABLE = "mechanisms"
COLUMNS: dict[str, type] = {
    "key": str, "device_kind": str, "problem": str, "objective": str, "winner": str, "seconds": str,
    "jax_version": str, "jaxlib_version": str, "tool_version": str, "measured_at": str,
}
NAME = re.compile(r"^(ring/)?[a-z][a-z0-9_]*$")  # ring/<kernel>, or a gathered implementation


def legacy_problem(row: dict[str, Any]) -> str | None:
    """Why `row` is not a valid legacy `mechanisms` row (None when it is): every field text, the winner
    the fastest of its seconds, every seconds value finite and positive and of an implementation
    registered here, the objective known, the date parseable."""
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    unknown = [c for c in row if c not in COLUMNS]
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}"
    for column in COLUMNS:
        if not isinstance(row[column], str):
            return f"field {column!r} must be str, got {row[column]!r}"
    if not HEX_KEY.match(row["key"]):
        return f"field 'key' must be 16 hex digits, got {row['key']!r}"
    if row["objective"] not in OBJECTIVES:
        return f"field 'objective' must be one of {', '.join(OBJECTIVES)}, got {row['objective']!r}"
    try:
        seconds = json_object(row["seconds"], "seconds")
        check_date(row["measured_at"], "measured_at")
    except ValueError as error:
        return str(error)
    for name, value in seconds.items():
        if not NAME.match(name):
            return f"seconds has an unknown mechanism {name!r}"
        if not (is_number(value) and math.isfinite(value) and value > 0):
            return f"seconds of {name} must be a finite positive number, got {value!r}"
    if not NAME.match(row["winner"]):
        return (f"winner must be an implementation's name (ring/<kernel> for a ring, else its name), got "
                f"{row['winner']!r}")
    if row["winner"] not in seconds:
        return f"winner {row['winner']} has no seconds"
    if seconds[row["winner"]] > min(seconds.values()):
        return f"winner {row['winner']} is not the fastest of its seconds"
    unknown = [n for n in seconds if registry.find(n.removeprefix("ring/")) is None]
    if unknown:
        return f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not an implementation of this version " \
               f"({', '.join(registry.names())})"
    return None


def problem_of(row: dict[str, Any]) -> tuple[ProblemKey, AttentionSpec]:
    """The `auto` key and the spec of a valid legacy row, from its problem description; `ValueError`
    when the description does not parse or does not hash to the row's key."""
    problem = Problem.parse(row["problem"])
    key = ProblemKey.of(problem.shapes, problem.spec, backend="auto", device_kind=row["device_kind"],
                        ring_size=problem.ring_size, layout=problem.layout)
    if key.digest != row["key"]:
        raise ValueError(f"its problem {row['problem']!r} on {row['device_kind']} has key {key.digest}, not "
                         f"{row['key']}")
    return key, problem.spec


def bench_rows(row: dict[str, Any], key: ProblemKey, spec: AttentionSpec) -> list[dict[str, Any]]:
    """The bench rows of the valid legacy `row` of the problem whose `auto` key is `key` and spec is
    `spec` (module docstring)."""
    rows = []
    for label, seconds in json.loads(row["seconds"]).items():
        implementation = registry.get(label.removeprefix("ring/"))
        own = dataclasses.replace(key, backend=implementation.name)
        config = implementation.default_config(registry.tile_shapes(implementation, own, key.ring_size), spec)
        versions = {**registry.versions(implementation), "jax_version": row["jax_version"],
                    "jaxlib_version": row["jaxlib_version"]}
        made = make_row(own, config, versions=versions, tool_version=row["tool_version"], source="bench",
                        objective=row["objective"],
                        best_s=float(seconds), default_s=None, speedup=None, trials_run=0, trials_pruned=0,
                        study=f"mechanisms row {row['key']}")
        rows.append({**made, "measured_at": row["measured_at"]})
    return rows

