"""The tuning cache (DESIGN section 8): SQLite through sqlite-utils, one row per tuned problem.

A row holds the problem key (`tuner.problem.ProblemKey`), the winning `FwdParams`/`BwdParams`, the
measured times (best and the backend default's), the trial counts, and the versions it was measured
with (jax, jaxlib, triton, the backend's code hash). A row whose versions no longer match this
installation is *stale*: kept and listed, never used.

Lookup order: exact key -> nearest tuned shape of the same family (device kind, backend, head dim,
dtype, features) -> entries shipped in the repository's `cache_db/*.jsonl` (exact, then nearest) ->
the backend's heuristic default. The database is opened in WAL mode with a generous busy timeout, so
several `tuner search` processes can write to it at once.

A second table, `mechanisms`, holds what `tuner bench --mechanisms` measured per problem (the ring
backends against gathered dense attention): the winner and every mechanism's seconds, with the
jax / jaxlib versions; the runtime loader with `backend="auto"` follows a current winner.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from tuner.params import BwdParams, FwdParams
from tuner.problem import ProblemKey

TABLE = "tuned"
KEY_FIELDS = ("op", "backend", "device_kind", "ring_size", "layout", "batch", "q_len", "kv_len", "heads",
              "kv_heads", "head_dim", "dtype", "features")
VERSION_FIELDS = ("jax_version", "jaxlib_version", "triton_version", "code_hash")
COLUMNS: dict[str, type] = {
    "key": str, **{f: (int if f in ("ring_size", "batch", "q_len", "kv_len", "heads", "kv_heads",
                                      "head_dim") else str) for f in KEY_FIELDS},
    "fwd_params": str, "bwd_params": str, "objective": str,
    "best_s": float, "default_s": float, "speedup": float,
    "trials_run": int, "trials_pruned": int, "trials_failed": str,
    "measured_at": str, "tool_version": str, "study": str,
    **{f: str for f in VERSION_FIELDS},
}
BUSY_TIMEOUT_S = 60.0
MECHANISM_TABLE = "mechanisms"
MECHANISM_COLUMNS: dict[str, type] = {
    "key": str, "device_kind": str, "problem": str, "objective": str, "winner": str, "seconds": str,
    "jax_version": str, "jaxlib_version": str, "tool_version": str, "measured_at": str,
}


class CacheError(RuntimeError):
    """The cache file cannot be read or written; the message says which file and what to do."""


def tuner_home() -> Path:
    """`$TUNER_HOME`, else `~/.cache/tuner`."""
    return Path(os.environ.get("TUNER_HOME") or Path.home() / ".cache" / "tuner")


def default_db_path() -> Path:
    """`$TUNER_DB`, else `$TUNER_HOME/tuning.sqlite`."""
    return Path(os.environ["TUNER_DB"]) if os.environ.get("TUNER_DB") else tuner_home() / "tuning.sqlite"


def shipped_dir() -> Path:
    """The repository's `cache_db/` (entries the project measured on real hardware)."""
    return Path(__file__).resolve().parents[1] / "cache_db"


def current_versions(code_hash: str, *, triton: bool = False) -> dict[str, str]:
    """The versions an entry measured now would carry, for a backend whose code hash is `code_hash`;
    the triton version only for a backend built on Triton ("-" otherwise, so that installing or
    upgrading triton does not make scan entries stale)."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return {"jax_version": version("jax"), "jaxlib_version": version("jaxlib"),
            "triton_version": version("triton") if triton else "-", "code_hash": code_hash}


def stale_reason(row: dict[str, Any], versions: dict[str, str]) -> str | None:
    """Which version of `row` differs from `versions`, or None when the row is current."""
    changed = [f"{f} {row.get(f)} -> {versions[f]}" for f in VERSION_FIELDS if row.get(f) != versions[f]]
    return ", ".join(changed) or None


def row_key(row: dict[str, Any]) -> ProblemKey:
    """The `ProblemKey` of a cache row."""
    fields = {f: row[f] for f in KEY_FIELDS}
    fields["features"] = json.loads(fields["features"]) if isinstance(fields["features"], str) \
        else fields["features"]
    return ProblemKey(**fields)


def row_params(row: dict[str, Any]) -> tuple[FwdParams, BwdParams]:
    """The tuned `FwdParams` and `BwdParams` of a cache row."""
    return FwdParams(**json.loads(row["fwd_params"])), BwdParams(**json.loads(row["bwd_params"]))


def make_row(key: ProblemKey, fwd: FwdParams, bwd: BwdParams, *, versions: dict[str, str],
             tool_version: str, **measured: Any) -> dict[str, Any]:
    """A complete cache row: key fields, params as JSON, versions, timestamp and `measured` fields
    (objective, best_s, default_s, speedup, trials_run, trials_pruned, trials_failed, study)."""
    fields = key.as_dict()
    fields["features"] = json.dumps(fields["features"], sort_keys=True)
    failed = measured.pop("trials_failed", {})
    row = {"key": key.digest, **fields, "fwd_params": json.dumps(fwd.to_dict()),
           "bwd_params": json.dumps(bwd.to_dict()), "trials_failed": json.dumps(failed, sort_keys=True),
           "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "tool_version": tool_version, **versions, **measured}
    check_row(row)
    return row


def check_row(row: dict[str, Any], where: str = "row") -> None:
    """Raise `ValueError` naming the field when `row` is not a complete, well-typed cache row."""
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    unknown = [c for c in row if c not in COLUMNS]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for column, kind in COLUMNS.items():
        value = row[column]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float \
            else isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{where}: field {column!r} must be {kind.__name__}, got {value!r}")
    try:
        key = row_key(row)
        row_params(row)
        json.loads(row["trials_failed"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if key.digest != row["key"]:
        raise ValueError(f"{where}: field 'key' is {row['key']!r} but the key fields hash to {key.digest!r}")


@dataclass(frozen=True)
class Lookup:
    """The outcome of a cache lookup: the row used (None for the default), its source and why."""

    row: dict[str, Any] | None
    source: str  # "exact", "nearest", "shipped" or "default"
    reason: str


@contextlib.contextmanager
def _immediate(db: sqlite_utils.Database) -> Iterator[None]:
    """A write transaction that takes the write lock when it begins: waiting for another writer then
    honours the busy timeout, where a read transaction upgraded to a write would fail at once with
    "database is locked" if another process wrote in between."""
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.conn.execute("ROLLBACK")
        raise
    db.conn.execute("COMMIT")


class Cache:
    """The tuning database at `path` (created on first write)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self._db: sqlite_utils.Database | None = None

    def _open(self, create: bool) -> sqlite_utils.Database | None:
        if self._db is not None:
            return self._db
        if not create and not self.path.exists():
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
            db = sqlite_utils.Database(conn)
            db.enable_wal()
            with _immediate(db):
                db[TABLE].create(COLUMNS, pk="key", if_not_exists=True)
            missing = set(COLUMNS) - set(db[TABLE].columns_dict)
            if missing:
                raise CacheError(f"the cache at {self.path} has no column(s) {', '.join(sorted(missing))}: "
                                 f"it was written by another tool or version; move it aside "
                                 f"(mv {self.path} {self.path}.old) and search again")
        except (sqlite3.DatabaseError, OSError) as error:
            raise CacheError(f"cannot use the cache at {self.path} ({error}); if the file is corrupt, "
                             f"move it aside (mv {self.path} {self.path}.bad) and a new one is created, "
                             f"or point TUNER_DB / --db at another file") from error
        self._db = db
        return db

    def _run(self, action: Callable[[sqlite_utils.Database], Any], *, create: bool, empty: Any = None):
        db = self._open(create)
        if db is None:
            return empty
        try:
            return action(db)
        except sqlite3.DatabaseError as error:
            raise CacheError(f"cannot use the cache at {self.path} ({error}); if the file is corrupt, "
                             f"move it aside (mv {self.path} {self.path}.bad)") from error

    def put(self, row: dict[str, Any]) -> None:
        """Insert or replace the row with `row["key"]` (checked first), in one transaction."""
        check_row(row)

        def write(db):
            with _immediate(db):
                db[TABLE].upsert(row, pk="key")
        self._run(write, create=True)

    def put_many(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert or replace many rows in one transaction; returns how many."""
        rows = list(rows)
        for i, row in enumerate(rows):
            check_row(row, where=f"row {i + 1}")

        def write(db):
            with _immediate(db):
                db[TABLE].upsert_all(rows, pk="key")
        self._run(write, create=True)
        return len(rows)

    def rows(self) -> list[dict[str, Any]]:
        """Every row, oldest measurement first."""
        return self._run(lambda db: list(db[TABLE].rows_where(order_by="measured_at")), create=False,
                         empty=[])

    def find(self, prefix: str) -> list[dict[str, Any]]:
        """Rows whose key starts with `prefix` (keys are hex digests; a short prefix is enough)."""
        return self._run(lambda db: list(db[TABLE].rows_where("key LIKE ?", [prefix + "%"])), create=False,
                         empty=[])

    def delete(self, keys: Iterable[str]) -> int:
        """Delete the rows with these keys; returns how many were deleted."""
        keys = list(keys)

        def remove(db):
            with _immediate(db):
                for key in keys:
                    db.conn.execute(f"DELETE FROM {TABLE} WHERE key = ?", [key])
            return len(keys)
        return self._run(remove, create=False, empty=0)

    def put_mechanism(self, row: dict[str, Any]) -> None:
        """Record a `tuner bench --mechanisms` result (replacing the one of the same key)."""
        missing = set(MECHANISM_COLUMNS) - set(row)
        if missing:
            raise ValueError(f"mechanism row lacks {', '.join(sorted(missing))}")

        def write(db):
            with _immediate(db):
                db[MECHANISM_TABLE].upsert(row, pk="key", columns=MECHANISM_COLUMNS)
        self._run(write, create=True)

    def mechanism(self, key: str) -> dict[str, Any] | None:
        """The recorded mechanism measurement of problem key digest `key` (see `ProblemKey`), if any."""
        def read(db):
            if MECHANISM_TABLE not in db.table_names():
                return None
            rows = list(db[MECHANISM_TABLE].rows_where("key = ?", [key]))
            return rows[0] if rows else None
        return self._run(read, create=False)

    def lookup(self, key: ProblemKey, versions: dict[str, str],
               accept: Callable[[dict[str, Any]], str | None] | None = None) -> Lookup:
        """The entry to use for `key` (lookup order in the module docstring).

        Stale rows and rows that `accept` rejects (it returns why) are passed over; the reason of the
        result says what was passed over and why.
        """
        notes: list[str] = []

        def usable(row: dict[str, Any], where: str) -> bool:
            reason = stale_reason(row, versions) or (accept(row) if accept else None)
            if reason:
                notes.append(f"{where} entry {row['key']} passed over ({reason})")
            return reason is None

        def search(rows: list[dict[str, Any]], where: str) -> tuple[dict[str, Any] | None, str]:
            exact = [r for r in rows if r["key"] == key.digest]
            if exact and usable(exact[0], where):
                return exact[0], "exact"
            family = [r for r in rows if r["key"] != key.digest and row_key(r).family == key.family]
            family.sort(key=lambda r: row_key(r).distance(key))
            for row in family:
                if usable(row, where):
                    return row, "nearest"
            return None, ""

        local, kind = search(self.rows(), "local")
        if local is not None:
            return Lookup(local, kind, "; ".join([*notes, f"{kind} entry {local['key']} in {self.path}"]))
        shipped, kind = search(list(read_shipped()), "shipped")
        if shipped is not None:
            return Lookup(shipped, "shipped",
                          "; ".join([*notes, f"shipped {kind} entry {shipped['key']} from {shipped_dir()}"]))
        return Lookup(None, "default", "; ".join([*notes, "no tuned entry for this problem"]))


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines export, each checked; `ValueError` names the file and line."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a cache row must be a JSON object")
            check_row(row, where=f"{path}:{number}")
            yield row


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines (sorted keys, one row per line: diffs review well); returns the count."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, sort_keys=True) + "\n")
            count += 1
    return count


def read_shipped() -> Iterator[dict[str, Any]]:
    """Rows of every `cache_db/*.jsonl` file shipped with the source."""
    folder = shipped_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.jsonl")):
            yield from read_jsonl(path)
