"""One cache row -- one decision: an implementation and its config for a problem, with what measured it.

The `tuned` table holds every decision the tools measured, told apart by `source`:

- `search`: the best config `tuner search` found for one implementation (its `default_s` is the
  implementation's default config timed in the same study, `speedup` the ratio);
- `bench`: one implementation's time in a `tuner bench --mechanisms` run, which times every registered
  implementation side by side on the same inputs (`study` names the run, `trials_run` counts its timed
  runs; `default_s` and `speedup` are null: the run times one config per implementation);
- `compiled`: the config `tuner search --dry-run --target` chose for a TPU target among the variants
  the TPU compiler accepted, ranked by the analytic model of `tuner.models.tpu_model` (`best_s` is the
  model's time, not a measurement; `default_s` and `speedup` are null; `trials_run` counts the
  variants compiled, `trials_pruned` those the constraints ruled out).

A search row's key is its `ProblemKey` digest (as it has always been, so shipped entries and old files
keep their keys); a row of another source has the digest of the key and the source (`row_digest`).
Rows written before the `source` column existed are search rows (`upgrade`).

A search row also keeps the search's near-best configs (`near_best`, a JSON list of configs in
`Config.to_dict` form, the winner first): the configs its trials timed within `NEAR` of its best, at most
`NEAR_BEST` of them. A new problem's warm start ranks configs by how many of its nearest neighbours found
them near-best (`tuner.tuning.warm`). Rows written before the column existed hold none (`upgrade`).

The cache trusts nothing it reads, so this module says what a row must be before anything uses it
(`row_problem`, `check_row`), how a row is built from a measurement (`make_row`), what it holds
(`row_key`, `row_config`, `row_params`), whether it is current (`stale_reason` against
`current_versions`), and how a bad row is reported (`warn_once`, logger `tuner.cache`). Nothing here
opens a file: `tuner.cache.store` stores the rows, `tuner.cache.files` reads and writes them as JSON lines.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tuner import registry
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.packing import Packing
from tuner.semantics.problem import DTYPES, OBJECTIVES, ProblemKey
from tuner.registry import Config
from tuner.registry.versions import VERSION_FIELDS
from tuner.semantics.spec import LAYOUTS

log = logging.getLogger("tuner.cache")

TABLE = "tuned"
SIZE_FIELDS = ("ring_size", "batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim")
KEY_FIELDS = ("op", "backend", "device_kind", "ring_size", "layout", "batch", "q_len", "kv_len", "heads",
              "kv_heads", "head_dim", "dtype", "features")
FAMILY_FIELDS = ("op", "backend", "device_kind", "head_dim", "dtype", "features")
TIME_FIELDS = ("best_s", "default_s", "speedup")
COLUMNS: dict[str, type] = {
    "key": str, **{f: (int if f in SIZE_FIELDS else str) for f in KEY_FIELDS},
    "fwd_params": str, "bwd_params": str, "objective": str,
    "best_s": float, "default_s": float, "speedup": float,
    "trials_run": int, "trials_pruned": int, "trials_failed": str,
    "measured_at": str, "tool_version": str, "study": str,
    **{f: str for f in VERSION_FIELDS}, "source": str, "near_best": str,
}
NEAR = 1.05  # a trial within this factor of the study's best trial is near-best
NEAR_BEST = 8  # at most this many near-best configs are kept per row
SOURCES = ("search", "bench", "compiled")
UNTIMED_DEFAULT = ("default_s", "speedup")  # null in the rows of a source other than search
INDEXES = {"tuned_family": FAMILY_FIELDS, "tuned_measured_at": ("measured_at",)}
FEATURES: dict[str, str] = {"causal": "bool", "window": "window", "chunk_size": "positive or null",
                            "softcap": "bool", "segments": "bool", "bias": "bool", "sinks": "count"}
HEX_KEY = re.compile(r"^[0-9a-f]{16}$")
# A key whose value head dim differs from its query/key head dim (multi-head latent attention), or that names
# the packing of its documents, keeps them in its features JSON under these names: the table keeps its
# columns, every other row its text, and the family index tells such problems apart.
VALUE_DIM, PACKING = "value_head_dim", "packing"
IN_FEATURES = (VALUE_DIM, PACKING)


# --------------------------------------------------------------------------------------------------
# Validation: what a row must be before anything uses it.
# --------------------------------------------------------------------------------------------------


def is_int(value: Any) -> bool:
    """Whether `value` is an int (a bool is not: JSON `true` is no size or count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether `value` is an int or a float (a bool is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_json(text: str) -> Any:
    """`text` parsed as JSON; `ValueError` saying "not JSON (why)" for anything `json` cannot read,
    nesting too deep to parse included."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError("not JSON (nested too deep)") from None
    except ValueError as error:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"not JSON ({str(error).split(';')[0]})") from None


def json_object(text: Any, name: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; `ValueError` naming `name` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be JSON text, got {text!r}")
    try:
        value = parse_json(text)
    except ValueError as error:
        raise ValueError(f"{name} is {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text[:80]!r}")
    return value


def _check_features(features: dict[str, Any], head_dim: int) -> None:
    if VALUE_DIM in features:
        value = features[VALUE_DIM]
        if not (is_int(value) and value > 0 and value != head_dim):
            raise ValueError(f"features.{VALUE_DIM} must be a positive int other than head_dim {head_dim} (absent "
                             f"when the values have the query/key head dim), got {value!r}")
    if PACKING in features:
        packing = features[PACKING]
        try:
            described = Packing.parse(packing).describe() if isinstance(packing, str) else None
        except ValueError:
            described = None
        if described != packing or not features.get("segments"):
            raise ValueError(f"features.{PACKING} must be a packing in its one text form (tuner.semantics.packing), "
                             f"with segments, got {packing!r}")
    features = {k: v for k, v in features.items() if k not in IN_FEATURES}
    unknown = sorted(set(features) - set(FEATURES))
    missing = sorted(set(FEATURES) - set(features))
    if unknown or missing:
        raise ValueError("features: " + "; ".join(
            part for part in (f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                              f"missing key(s) {', '.join(missing)}" if missing else "") if part))
    for name, kind in FEATURES.items():
        value = features[name]
        ok = {"bool": isinstance(value, bool),
              "count": is_int(value) and value >= 0,
              "positive or null": value is None or (is_int(value) and value > 0),
              "window": value is None or (isinstance(value, list) and len(value) == 2
                                          and all(is_int(v) and v >= 0 for v in value))}[kind]
        if not ok:
            raise ValueError(f"features.{name} must be {kind.replace('count', 'a non-negative int')}"
                             f"{' ([left, right] of non-negative ints, or null)' if kind == 'window' else ''}, "
                             f"got {value!r}")


def _config(row: dict[str, Any]) -> Config | None:
    """The config of `row` (its `fwd_params` and `bwd_params` JSON objects), built and validated by the
    config type of the implementation that wrote it; None when no implementation of that name is
    registered in this process (its rows are then of no use here, but not malformed)."""
    fwd, bwd = json_object(row["fwd_params"], "fwd_params"), json_object(row["bwd_params"], "bwd_params")
    implementation = registry.find(row["backend"]) if isinstance(row["backend"], str) else None
    return None if implementation is None else registry.config_from_parts(implementation, fwd, bwd)


def _check_near_best(text: str, implementation: registry.Implementation | None) -> None:
    """`ValueError` unless `text` is a JSON list of at most `NEAR_BEST` configs, each valid for
    `implementation` (where it is registered in this process)."""
    try:
        near = parse_json(text)
    except ValueError as error:
        raise ValueError(f"near_best is {error}") from None
    if not (isinstance(near, list) and len(near) <= NEAR_BEST and all(isinstance(c, dict) for c in near)):
        raise ValueError(f"near_best must be a JSON list of at most {NEAR_BEST} configs, got {text[:80]!r}")
    for number, config in enumerate(near if implementation is not None else ()):
        try:
            implementation.config_type.from_dict(config)
        except ValueError as error:
            raise ValueError(f"near_best[{number}]: {error}") from None


def check_date(value: Any, name: str) -> None:
    """`ValueError` naming `name` unless `value` is an ISO date and time."""
    try:
        _dt.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an ISO date and time, got {value!r}") from None


def _check_row(row: dict[str, Any]) -> None:
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    unknown = [c for c in row if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    if row["source"] not in SOURCES:
        raise ValueError(f"field 'source' must be one of {', '.join(SOURCES)}, got {row['source']!r}")
    untimed = row["source"] != "search"
    for column, kind in COLUMNS.items():
        value = row[column]
        if untimed and column in UNTIMED_DEFAULT:
            if value is not None:
                raise ValueError(f"field {column!r} must be null in a {row['source']} row, got {value!r}")
            continue
        ok = is_number(value) if kind is float else isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"field {column!r} must be {kind.__name__}, got {value!r}")
    for name in SIZE_FIELDS:
        if row[name] <= 0:
            raise ValueError(f"field {name!r} must be a positive integer, got {row[name]!r}")
    if row["heads"] % row["kv_heads"]:
        raise ValueError(f"heads {row['heads']} is not a multiple of kv_heads {row['kv_heads']}")
    for name, allowed in (("layout", LAYOUTS), ("dtype", DTYPES), ("objective", OBJECTIVES)):
        if row[name] not in allowed:
            raise ValueError(f"field {name!r} must be one of {', '.join(allowed)}, got {row[name]!r}")
    for name in TIME_FIELDS:
        if row[name] is None:
            continue
        if not (math.isfinite(row[name]) and row[name] > 0):
            raise ValueError(f"field {name!r} must be a finite positive number, got {row[name]!r}")
    for name in ("trials_run", "trials_pruned"):
        if row[name] < 0:
            raise ValueError(f"field {name!r} must be zero or more, got {row[name]!r}")
    failed = json_object(row["trials_failed"], "trials_failed")
    if not all(isinstance(k, str) and is_int(v) and v >= 0 for k, v in failed.items()):
        raise ValueError(f"trials_failed must map reasons to counts, got {row['trials_failed'][:80]!r}")
    check_date(row["measured_at"], "measured_at")
    _check_features(json_object(row["features"], "features"), row["head_dim"])
    registered = _config(row) is not None
    _check_near_best(row["near_best"], registry.find(row["backend"]) if registered else None)
    digest = row_digest(row_key(row), row["source"])
    if digest != row["key"]:
        raise ValueError(f"field 'key' is {row['key']!r} but the key fields and source hash to {digest!r}")


def row_problem(row: dict[str, Any]) -> str | None:
    """Why `row` is not a complete, well-formed cache row (None when it is): every field present and
    of its type, sizes positive, times finite and positive, dates parseable, params and features JSON
    objects with known keys and valid values, and the key the hash of the key fields."""
    try:
        _check_row(row)
    except ValueError as error:
        return str(error)
    return None


def check_row(row: dict[str, Any], where: str = "row") -> None:
    """Raise `ValueError` (prefixed with `where`) when `row` is not a valid cache row."""
    problem = row_problem(row)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")


_WARNED: set[tuple[str, ...]] = set()


def warn_once(path: Path | str, what: str, problem: str) -> None:
    """One WARNING per (file, what, problem) per process: a bad row or file costs speed, never a
    training step, and does not flood the log at every trace. `what` names the row (or the part of
    the cache) and `problem` says what is wrong with it."""
    token = (str(path), what, problem)
    if token not in _WARNED:
        _WARNED.add(token)
        log.warning("tuning cache %s: %s: %s", path, what, problem)


def row_digest(key: ProblemKey, source: str) -> str:
    """The primary key of the row of `key` measured by `source`: the key's digest for a search row,
    else the digest of both."""
    if source == "search":
        return key.digest
    return hashlib.sha256(f"{key.digest}/{source}".encode()).hexdigest()[:16]


def upgrade(row: dict[str, Any]) -> dict[str, Any]:
    """`row` as the current schema has it: a whole row written before the `source` column is a search
    row, and one written before the `near_best` column has no near-best configs (anything else -- a part of
    a row, a count -- is returned as it is)."""
    if "fwd_params" not in row:
        return row
    return {"source": "search", "near_best": "[]", **row}


def row_key(row: dict[str, Any]) -> ProblemKey:
    """The `ProblemKey` of a cache row."""
    fields_ = {f: row[f] for f in KEY_FIELDS}
    features = json.loads(fields_["features"]) if isinstance(fields_["features"], str) else fields_["features"]
    fields_["features"] = {k: v for k, v in features.items() if k not in IN_FEATURES}
    return ProblemKey(**fields_, value_head_dim=features.get(VALUE_DIM), packing=features.get(PACKING))


def key_columns(key: ProblemKey) -> dict[str, Any]:
    """The key fields of `key` as a row stores them: the features as their one text, holding the value head
    dim where it differs and the packing where the key names one (`IN_FEATURES`)."""
    fields_ = key.as_dict()
    extra = {name: fields_.pop(name) for name in IN_FEATURES if name in fields_}
    fields_["features"] = features_text({**fields_["features"], **extra})
    return fields_


def row_config(row: dict[str, Any]) -> Config:
    """The config of a valid cache row of a registered implementation."""
    config = _config(row)
    if config is None:
        raise ValueError(f"no implementation named {row['backend']!r} is registered")
    return config


def near_configs(row: dict[str, Any]) -> list[Config]:
    """The near-best configs of a valid cache row of a registered implementation, winner first (the winner
    alone for a row that keeps none)."""
    winner = row_config(row)
    return [type(winner).from_dict(c) for c in json.loads(row["near_best"])] or [winner]


def row_params(row: dict[str, Any]) -> tuple[FwdParams, BwdParams]:
    """The forward and backward tiles of a valid cache row of a ring."""
    config = row_config(row)
    return config.fwd, config.bwd


def features_text(features: dict[str, Any]) -> str:
    """The one text form of a features dict, as stored and as the family index is queried by."""
    return json.dumps(features, sort_keys=True)


def make_row(key: ProblemKey, fwd: FwdParams | Config, bwd: BwdParams | None = None, *, versions: dict[str, str],
             tool_version: str, source: str = "search", near_best: Iterable[Config] = (),
             **measured: Any) -> dict[str, Any]:
    """A complete cache row of `source`: key fields, the config (or a ring's `fwd` and `bwd` tiles) as
    JSON, versions, timestamp, the near-best configs (winner first; the first `NEAR_BEST` kept) and
    `measured` fields (objective, best_s, default_s, speedup, trials_run, trials_pruned, trials_failed,
    study)."""
    parts = fwd.to_dict() if bwd is None else {"fwd": fwd.to_dict(), "bwd": bwd.to_dict()}
    fields_ = key_columns(key)
    failed = measured.pop("trials_failed", {})
    row = {"key": row_digest(key, source), **fields_, "source": source, "fwd_params": json.dumps(parts["fwd"]),
           "bwd_params": json.dumps(parts["bwd"]), "trials_failed": json.dumps(failed, sort_keys=True),
           "measured_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
           "tool_version": tool_version, **versions, **measured,
           "near_best": json.dumps([c.to_dict() for c in list(near_best)[:NEAR_BEST]], sort_keys=True)}
    check_row(row)
    return row


def canonical(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its features in the one text form the family index is queried by."""
    return {**row, "features": features_text(json.loads(row["features"]))}

