"""The tuning cache (DESIGN section 8): SQLite through sqlite-utils, one row per tuned problem.

A row holds the problem key (`tuner.problem.ProblemKey`), the winning `FwdParams`/`BwdParams`, the
measured times (best and the backend default's), the trial counts, and the versions it was measured
with (jax, jaxlib, triton, the backend's code hash). A row whose versions no longer match this
installation is *stale*: kept and listed, never used.

Lookup order: exact key -> nearest tuned shape of the same family (device kind, backend, head dim,
dtype, features) -> entries shipped in `cache_db/*.jsonl` (exact, then nearest) -> the backend's
heuristic default.

The cache sits on the path of every training step, so it trusts nothing it reads:

- every row is validated before use (`row_problem`, `mechanism_problem`); a row that fails is skipped
  with one WARNING per row and process, naming the file, the row and what is wrong;
- readers never write: they open the file read-only (no table creation, no journal-mode change, no
  write lock), and a read-only file or folder is readable;
- a reader waits for a writer's lock at most its busy timeout (`LOADER_BUSY_TIMEOUT_S` for the
  runtime loader), then gives up with a `CacheError`;
- writers open in WAL mode with a generous busy timeout and take the write lock up front, so several
  `tuner search` processes can write at once; they create the indexes that keep lookups fast.

A second table, `mechanisms`, holds what `tuner bench --mechanisms` measured per problem (the ring
backends against gathered dense attention): the winner and every mechanism's seconds, with the
jax / jaxlib versions; the runtime loader with `backend="auto"` follows a current winner.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import math
import os
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import sqlite_utils

from tuner.params import BwdParams, FwdParams
from tuner.problem import DTYPES, OBJECTIVES, ProblemKey
from tuner.resources import shipped_dir, tuner_home
from tuner.spec import LAYOUTS

log = logging.getLogger("tuner.cache")

TABLE = "tuned"
SIZE_FIELDS = ("ring_size", "batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim")
KEY_FIELDS = ("op", "backend", "device_kind", "ring_size", "layout", "batch", "q_len", "kv_len", "heads",
              "kv_heads", "head_dim", "dtype", "features")
FAMILY_FIELDS = ("op", "backend", "device_kind", "head_dim", "dtype", "features")
VERSION_FIELDS = ("jax_version", "jaxlib_version", "triton_version", "code_hash")
TIME_FIELDS = ("best_s", "default_s", "speedup")
COLUMNS: dict[str, type] = {
    "key": str, **{f: (int if f in SIZE_FIELDS else str) for f in KEY_FIELDS},
    "fwd_params": str, "bwd_params": str, "objective": str,
    "best_s": float, "default_s": float, "speedup": float,
    "trials_run": int, "trials_pruned": int, "trials_failed": str,
    "measured_at": str, "tool_version": str, "study": str,
    **{f: str for f in VERSION_FIELDS},
}
INDEXES = {"tuned_family": FAMILY_FIELDS, "tuned_measured_at": ("measured_at",)}
FEATURES: dict[str, str] = {"causal": "bool", "window": "window", "chunk_size": "positive or null",
                            "softcap": "bool", "segments": "bool", "bias": "bool", "sinks": "count"}
MECHANISM_TABLE = "mechanisms"
MECHANISM_COLUMNS: dict[str, type] = {
    "key": str, "device_kind": str, "problem": str, "objective": str, "winner": str, "seconds": str,
    "jax_version": str, "jaxlib_version": str, "tool_version": str, "measured_at": str,
}
MECHANISM_NAME = re.compile(r"^(dense|jax_nn|ring/[a-z][a-z0-9_]*)$")
HEX_KEY = re.compile(r"^[0-9a-f]{16}$")

WRITE_BUSY_TIMEOUT_S = 60.0
READ_BUSY_TIMEOUT_S = 10.0
LOADER_BUSY_TIMEOUT_S = 0.25


class CacheError(RuntimeError):
    """The cache file cannot be read or written; the message says which file and what to do."""


def default_db_path() -> Path:
    """`$TUNER_DB`, else `$TUNER_HOME/tuning.sqlite`."""
    return Path(os.environ["TUNER_DB"]) if os.environ.get("TUNER_DB") else tuner_home() / "tuning.sqlite"


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


# --------------------------------------------------------------------------------------------------
# Validation: what a row must be before anything uses it.
# --------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_object(text: Any, name: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; `ValueError` naming `name` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be JSON text, got {text!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError(f"{name} is not JSON (nested too deep)") from None
    except ValueError as error:  # e.g. an integer of more digits than int() converts
        raise ValueError(f"{name} is not JSON ({str(error).split(';')[0]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text[:80]!r}")
    return value


def _check_features(features: dict[str, Any]) -> None:
    unknown = sorted(set(features) - set(FEATURES))
    missing = sorted(set(FEATURES) - set(features))
    if unknown or missing:
        raise ValueError("features: " + "; ".join(
            part for part in (f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                              f"missing key(s) {', '.join(missing)}" if missing else "") if part))
    for name, kind in FEATURES.items():
        value = features[name]
        ok = {"bool": isinstance(value, bool),
              "count": _is_int(value) and value >= 0,
              "positive or null": value is None or (_is_int(value) and value > 0),
              "window": value is None or (isinstance(value, list) and len(value) == 2
                                          and all(_is_int(v) and v >= 0 for v in value))}[kind]
        if not ok:
            raise ValueError(f"features.{name} must be {kind.replace('count', 'a non-negative int')}"
                             f"{' ([left, right] of non-negative ints, or null)' if kind == 'window' else ''}, "
                             f"got {value!r}")


def _params(text: Any, kind: type, name: str) -> FwdParams | BwdParams:
    """`kind` built from the JSON object `text`: only its known fields, each validated by `kind`."""
    values = _json_object(text, name)
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        return kind(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None


def _check_date(value: Any, name: str) -> None:
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
    for column, kind in COLUMNS.items():
        value = row[column]
        ok = _is_number(value) if kind is float else isinstance(value, kind) and not isinstance(value, bool)
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
        if not (math.isfinite(row[name]) and row[name] > 0):
            raise ValueError(f"field {name!r} must be a finite positive number, got {row[name]!r}")
    for name in ("trials_run", "trials_pruned"):
        if row[name] < 0:
            raise ValueError(f"field {name!r} must be zero or more, got {row[name]!r}")
    failed = _json_object(row["trials_failed"], "trials_failed")
    if not all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in failed.items()):
        raise ValueError(f"trials_failed must map reasons to counts, got {row['trials_failed'][:80]!r}")
    _check_date(row["measured_at"], "measured_at")
    _check_features(_json_object(row["features"], "features"))
    _params(row["fwd_params"], FwdParams, "fwd_params")
    _params(row["bwd_params"], BwdParams, "bwd_params")
    digest = row_key(row).digest
    if digest != row["key"]:
        raise ValueError(f"field 'key' is {row['key']!r} but the key fields hash to {digest!r}")


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


def mechanism_problem(row: dict[str, Any]) -> str | None:
    """Why `row` is not a valid `mechanisms` row (None when it is): every field text, the winner a
    mechanism name that has seconds, every seconds value finite and positive, the date parseable."""
    missing = [c for c in MECHANISM_COLUMNS if c not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    unknown = [c for c in row if c not in MECHANISM_COLUMNS]
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}"
    for column in MECHANISM_COLUMNS:
        if not isinstance(row[column], str):
            return f"field {column!r} must be str, got {row[column]!r}"
    if not HEX_KEY.match(row["key"]):
        return f"field 'key' must be 16 hex digits, got {row['key']!r}"
    try:
        seconds = _json_object(row["seconds"], "seconds")
        _check_date(row["measured_at"], "measured_at")
    except ValueError as error:
        return str(error)
    for name, value in seconds.items():
        if not MECHANISM_NAME.match(name):
            return f"seconds has an unknown mechanism {name!r}"
        if not (_is_number(value) and math.isfinite(value) and value > 0):
            return f"seconds of {name} must be a finite positive number, got {value!r}"
    if not MECHANISM_NAME.match(row["winner"]):
        return f"winner must be a mechanism name (dense, jax_nn, ring/<backend>), got {row['winner']!r}"
    if row["winner"] not in seconds:
        return f"winner {row['winner']} has no seconds"
    return None


_WARNED: set[tuple[str, ...]] = set()


def warn_once(path: Path | str, what: str, problem: str) -> None:
    """One WARNING per (file, what, problem) per process: a bad row or file costs speed, never a
    training step, and does not flood the log at every trace. `what` names the row (or the part of
    the cache) and `problem` says what is wrong with it."""
    token = (str(path), what, problem)
    if token not in _WARNED:
        _WARNED.add(token)
        log.warning("tuning cache %s: %s: %s", path, what, problem)


def row_key(row: dict[str, Any]) -> ProblemKey:
    """The `ProblemKey` of a cache row."""
    fields_ = {f: row[f] for f in KEY_FIELDS}
    fields_["features"] = json.loads(fields_["features"]) if isinstance(fields_["features"], str) \
        else fields_["features"]
    return ProblemKey(**fields_)


def row_params(row: dict[str, Any]) -> tuple[FwdParams, BwdParams]:
    """The tuned `FwdParams` and `BwdParams` of a valid cache row."""
    return (_params(row["fwd_params"], FwdParams, "fwd_params"),
            _params(row["bwd_params"], BwdParams, "bwd_params"))


def _features_text(features: dict[str, Any]) -> str:
    return json.dumps(features, sort_keys=True)


def make_row(key: ProblemKey, fwd: FwdParams, bwd: BwdParams, *, versions: dict[str, str],
             tool_version: str, **measured: Any) -> dict[str, Any]:
    """A complete cache row: key fields, params as JSON, versions, timestamp and `measured` fields
    (objective, best_s, default_s, speedup, trials_run, trials_pruned, trials_failed, study)."""
    fields_ = key.as_dict()
    fields_["features"] = _features_text(fields_["features"])
    failed = measured.pop("trials_failed", {})
    row = {"key": key.digest, **fields_, "fwd_params": json.dumps(fwd.to_dict()),
           "bwd_params": json.dumps(bwd.to_dict()), "trials_failed": json.dumps(failed, sort_keys=True),
           "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "tool_version": tool_version, **versions, **measured}
    check_row(row)
    return row


def _canonical(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its features in the one text form the family index is queried by."""
    return {**row, "features": _features_text(json.loads(row["features"]))}


@dataclass(frozen=True)
class Lookup:
    """The outcome of a cache lookup: the row used (None for the default), its source and why."""

    row: dict[str, Any] | None
    source: str  # "exact", "nearest", "shipped" or "default"
    reason: str


@dataclass(frozen=True)
class Listing:
    """One page of `Cache.listing`: the rows, and how many rows match in all."""

    rows: list[dict[str, Any]]
    total: int


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


def _distance(row: dict[str, Any], key: ProblemKey) -> float | None:
    """`ProblemKey.distance` from a row's size fields, or None when a size field is not a positive int
    (the row is then invalid, and reported as such when it is considered)."""
    total = 0.0
    for name in ("batch", "q_len", "kv_len", "heads", "kv_heads", "ring_size"):
        value = row[name]
        if not _is_int(value) or value <= 0:
            return None
        total += abs(math.log2(value / getattr(key, name)))
    return total + (0.5 if row["layout"] != key.layout else 0.0)


class _Notes:
    """What a lookup passed over and why, summarized: the first few in full, then a count."""

    SHOWN = 3

    def __init__(self) -> None:
        self.items: list[str] = []
        self.more = 0

    def add(self, text: str) -> None:
        if len(self.items) < self.SHOWN:
            self.items.append(text)
        else:
            self.more += 1

    def parts(self) -> list[str]:
        return self.items + ([f"{self.more} more passed over"] if self.more else [])


class Cache:
    """The tuning database at `path` (created on first write). `busy_timeout` bounds how long a read
    waits for another process's lock (`READ_BUSY_TIMEOUT_S` by default)."""

    def __init__(self, path: str | os.PathLike | None = None, *, busy_timeout: float = READ_BUSY_TIMEOUT_S):
        self.path = Path(path) if path is not None else default_db_path()
        self.busy_timeout = busy_timeout
        self._db: sqlite_utils.Database | None = None

    # -- opening ---------------------------------------------------------------------------------

    def _error(self, error: BaseException, writing: bool) -> CacheError:
        """The `CacheError` for a failure to read or write the file: locked, not writable, or corrupt."""
        text = str(error)
        if "locked" in text or "busy" in text:
            return CacheError(f"the cache at {self.path} is locked by another process ({text}); "
                              f"{'try again when it is done' if writing else 'gave up waiting for it'}")
        if writing and (isinstance(error, OSError) or "readonly" in text or "unable to open" in text):
            return CacheError(f"cannot write the cache at {self.path} ({text}); point --db or TUNER_DB at a "
                              f"writable file, or TUNER_HOME at a writable folder")
        return CacheError(f"cannot use the cache at {self.path} ({text}); if the file is corrupt, move it "
                          f"aside (mv {self.path} {self.path}.bad) and a new one is created, or point "
                          f"TUNER_DB / --db at another file")

    def _writer(self) -> sqlite_utils.Database:
        if self._db is not None:
            return self._db
        if self.path.is_dir():
            raise CacheError(f"the cache path {self.path} is a folder, not a file; point --db or TUNER_DB at a "
                             f"file (the default is $TUNER_HOME/tuning.sqlite)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=WRITE_BUSY_TIMEOUT_S)
            db = sqlite_utils.Database(conn)
            db.enable_wal()
            with _immediate(db):
                db[TABLE].create(COLUMNS, pk="key", if_not_exists=True)
                missing = set(COLUMNS) - set(db[TABLE].columns_dict)
                if missing:
                    raise CacheError(f"the cache at {self.path} has no column(s) {', '.join(sorted(missing))}: "
                                     f"it was written by another tool or version; move it aside "
                                     f"(mv {self.path} {self.path}.old) and search again")
                for name, columns in INDEXES.items():
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} ({', '.join(columns)})")
        except (sqlite3.DatabaseError, OSError) as error:
            raise self._error(error, writing=True) from error
        self._db = db
        return db

    def check_writable(self) -> None:
        """Open the cache for writing now (creating it if needed): `CacheError` saying what to do when
        it cannot be written, before any work whose result would be lost."""
        self._writer()

    def _connect(self, immutable: bool) -> sqlite3.Connection:
        uri = self.path.resolve().as_uri() + ("?immutable=1" if immutable else "?mode=ro")
        conn = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout)
        conn.row_factory = sqlite3.Row
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection | None]:
        """A read-only connection (None when there is no file). A WAL database in a folder this
        process cannot write is opened as immutable: nothing can be writing to it either."""
        if not self.path.exists():
            yield None
            return
        if self.path.is_dir():
            raise CacheError(f"the cache path {self.path} is a folder, not a file; point --db or TUNER_DB at a "
                             f"file (the default is $TUNER_HOME/tuning.sqlite)")
        if 0 < self.path.stat().st_size < 100:  # shorter than the SQLite header: SQLite reads 1 byte as empty
            raise self._error(sqlite3.DatabaseError("file is not a database"), writing=False)
        conn = None
        try:
            try:
                conn = self._connect(immutable=False)
            except sqlite3.OperationalError as error:
                if "unable to open" not in str(error) and "readonly" not in str(error):
                    raise
                conn = self._connect(immutable=True)
            yield conn
        except sqlite3.DatabaseError as error:
            raise self._error(error, writing=False) from error
        finally:
            if conn is not None:
                conn.close()

    def _tables(self, conn: sqlite3.Connection) -> set[str]:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def _select(self, sql: str, params: Iterable[Any] = (), table: str = TABLE) -> list[dict[str, Any]]:
        with self._reader() as conn:
            if conn is None or table not in self._tables(conn):
                return []
            return [dict(r) for r in conn.execute(sql, list(params))]

    def _write(self, action: Callable[[sqlite_utils.Database], Any]) -> Any:
        db = self._writer()
        try:
            return action(db)
        except sqlite3.DatabaseError as error:
            raise self._error(error, writing=True) from error

    # -- writing ---------------------------------------------------------------------------------

    def put(self, row: dict[str, Any]) -> None:
        """Insert or replace the row with `row["key"]` (checked first), in one transaction."""
        check_row(row)
        row = _canonical(row)

        def write(db):
            with _immediate(db):
                db[TABLE].upsert(row, pk="key")
        self._write(write)

    def put_best(self, row: dict[str, Any]) -> dict[str, Any]:
        """Store `row` unless the row already stored under its key answers the same question (same
        objective and versions) with a higher or equal speedup over the default; returns the row the
        cache holds afterwards. Read and write happen in one write transaction, so several search
        workers finishing one study keep the best of their results, not the last writer's."""
        check_row(row)
        row = _canonical(row)

        def write(db):
            with _immediate(db):
                found = list(db[TABLE].rows_where("key = ?", [row["key"]]))
                if found:
                    old = found[0]
                    same = row_problem(old) is None and old["objective"] == row["objective"] and all(
                        old[f] == row[f] for f in VERSION_FIELDS)
                    if same and old["speedup"] >= row["speedup"]:
                        return old
                db[TABLE].upsert(row, pk="key")
                return row
        return self._write(write)

    def put_many(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert or replace many rows (each checked first) in one transaction; returns how many."""
        rows = list(rows)
        for i, row in enumerate(rows):
            check_row(row, where=f"row {i + 1}")
        rows = [_canonical(r) for r in rows]

        def write(db):
            with _immediate(db):
                db[TABLE].upsert_all(rows, pk="key")
        self._write(write)
        return len(rows)

    def delete(self, keys: Iterable[str]) -> int:
        """Delete the rows with these keys; returns how many were deleted."""
        keys = list(keys)
        if not keys or not self.path.exists():
            return 0

        def remove(db):
            with _immediate(db):
                for key in keys:
                    db.conn.execute(f"DELETE FROM {TABLE} WHERE key = ?", [key])
            return len(keys)
        return self._write(remove)

    def put_mechanism(self, row: dict[str, Any]) -> None:
        """Record a `tuner bench --mechanisms` result (replacing the one of the same key)."""
        problem = mechanism_problem(row)
        if problem is not None:
            raise ValueError(f"mechanism row: {problem}")

        def write(db):
            with _immediate(db):
                db[MECHANISM_TABLE].upsert(row, pk="key", columns=MECHANISM_COLUMNS)
        self._write(write)

    # -- reading ---------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Every row as stored (valid or not), oldest measurement first."""
        return self._select(f"SELECT * FROM {TABLE} ORDER BY measured_at")

    def listing(self, *, limit: int | None = None, offset: int = 0,
                where: dict[str, Any] | None = None) -> Listing:
        """A page of rows, oldest measurement first, with the count of rows matching `where`
        (equality on key fields, e.g. `{"backend": "scan", "head_dim": 64}`)."""
        where = where or {}
        unknown = [name for name in where if name not in KEY_FIELDS]
        if unknown:
            raise ValueError(f"cannot filter on {', '.join(unknown)}; filters are {', '.join(KEY_FIELDS)}")
        clause = " AND ".join(f"{name} = ?" for name in where) or "1"
        page = f" LIMIT {int(limit)} OFFSET {int(offset)}" if limit is not None else ""
        with self._reader() as conn:
            if conn is None or TABLE not in self._tables(conn):
                return Listing([], 0)
            total = conn.execute(f"SELECT count(*) FROM {TABLE} WHERE {clause}", list(where.values())).fetchone()[0]
            rows = [dict(r) for r in conn.execute(
                f"SELECT * FROM {TABLE} WHERE {clause} ORDER BY measured_at{page}", list(where.values()))]
        return Listing(rows, total)

    def find(self, prefix: str) -> list[dict[str, Any]]:
        """Rows whose key starts with `prefix` (keys are hex digests; a short prefix is enough)."""
        if not re.fullmatch(r"[0-9a-fA-F]*", prefix):
            return []
        return self._select(f"SELECT * FROM {TABLE} WHERE key >= ? AND key < ? ORDER BY key",
                            [prefix.lower(), prefix.lower() + "g"])

    def mechanism(self, key: str) -> dict[str, Any] | None:
        """The recorded, valid mechanism measurement of problem key digest `key`, if any (an invalid
        one is skipped with a warning)."""
        rows = self._select(f"SELECT * FROM {MECHANISM_TABLE} WHERE key = ?", [key], table=MECHANISM_TABLE)
        if not rows:
            return None
        problem = mechanism_problem(rows[0])
        if problem is not None:
            warn_once(self.path, f"mechanisms row {key} skipped", problem)
            return None
        return rows[0]

    def lookup(self, key: ProblemKey, versions: dict[str, str],
               accept: Callable[[dict[str, Any]], str | None] | None = None) -> Lookup:
        """The entry to use for `key` (lookup order in the module docstring).

        Invalid rows (warned about once), stale rows and rows that `accept` rejects (it returns why)
        are passed over; the reason of the result says what was passed over and why, and when no
        exact entry was used but one exists for another layout of the same problem, says so.
        """
        notes = _Notes()
        other_layouts: list[str] = []

        def usable(row: dict[str, Any], where: str, origin: Path | str) -> bool:
            problem = row_problem(row)
            if problem is not None:
                warn_once(origin, f"{where} entry {row.get('key')!r} skipped", problem)
                notes.add(f"{where} entry {row.get('key')} invalid ({problem})")
                return False
            reason = stale_reason(row, versions) or (accept(row) if accept else None)
            if reason:
                notes.add(f"{where} entry {row['key']} passed over ({reason})")
            return reason is None

        def search(exact: list[dict[str, Any]], family: Callable[[], list[dict[str, Any]]],
                   full: Callable[[dict[str, Any]], dict[str, Any] | None], where: str,
                   origin: Path | str) -> tuple[dict[str, Any] | None, str]:
            """The exact row if usable, else the nearest usable row of `family()` (rows that may hold
            only the key, size, layout and version fields; `full` reads the whole row)."""
            if exact and usable(exact[0], where, origin):
                return exact[0], "exact"
            ranked = []
            for partial in family():
                distance = _distance(partial, key)
                if distance is None:  # a size field is not a positive int: report it invalid
                    row = full(partial)
                    if row is not None:
                        usable(row, where, origin)
                    continue
                ranked.append((distance, partial))
            ranked.sort(key=lambda item: item[0])
            found = None
            for distance, partial in ranked:
                if found is not None and distance > 0.5:
                    break
                stale = stale_reason(partial, versions)
                if stale:
                    notes.add(f"{where} entry {partial['key']} passed over ({stale})")
                    continue
                row = full(partial)
                if row is None:
                    continue
                if row["layout"] != key.layout and distance == 0.5 and row_problem(row) is None:
                    other_layouts.append(f"{row['layout']} ({where} entry {row['key']})")
                if found is None and usable(row, where, origin):
                    found = row
            return found, ("nearest" if found is not None else "")

        def local_row(partial: dict[str, Any]) -> dict[str, Any] | None:
            rows = self._select(f"SELECT * FROM {TABLE} WHERE rowid = ?", [partial["rowid"]])
            return rows[0] if rows else None

        matches = " AND ".join(f"{f} = ?" for f in FAMILY_FIELDS)
        family_values = [key.op, key.backend, key.device_kind, key.head_dim, key.dtype, _features_text(key.features)]
        brief = ", ".join(("rowid", "key", "layout", *SIZE_FIELDS, *VERSION_FIELDS))
        exact = self._select(f"SELECT * FROM {TABLE} WHERE key = ?", [key.digest])
        current = " AND ".join(f"{f} = ?" for f in VERSION_FIELDS)
        version_values = [versions[f] for f in VERSION_FIELDS]
        row, kind = search(exact, lambda: self._select(
            f"SELECT {brief} FROM {TABLE} WHERE {matches} AND {current} AND key != ?",
            [*family_values, *version_values, key.digest]), local_row, "local", self.path)
        if row is None or kind != "exact":
            stale = self._select(f"SELECT count(*) AS n FROM {TABLE} WHERE {matches} AND NOT ({current})",
                                 [*family_values, *version_values])
            if stale and stale[0]["n"]:
                notes.add(f"{stale[0]['n']} local entr{'y' if stale[0]['n'] == 1 else 'ies'} of this family "
                          f"passed over (measured with other versions)")
        origin, source = f"in {self.path}", kind
        if row is None:
            shipped = [r for r, _ in read_shipped()]
            row, kind = search([r for r in shipped if r["key"] == key.digest], lambda: [
                r for r in shipped if r["key"] != key.digest and row_key(r).family == key.family],
                lambda r: r, "shipped", shipped_dir())
            origin, source = f"from {shipped_dir()}", "shipped"
        parts = notes.parts()
        if row is not None:
            parts.append(f"{'shipped ' if source == 'shipped' else ''}{kind} entry {row['key']} {origin}")
        else:
            source = "default"
            parts.append("no tuned entry for this problem")
        if kind != "exact" and other_layouts:
            parts.append(f"a tuned entry exists for this problem with layout {other_layouts[0]}: pass that "
                         f"layout to use it")
        return Lookup(row, source, "; ".join(parts))


# --------------------------------------------------------------------------------------------------
# JSON lines: export, import, and the shipped entries.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rejected:
    """A line of a JSON-lines file that is not a valid cache row, and why."""

    line: int
    reason: str


def parse_jsonl(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[Rejected]]:
    """The valid rows of a JSON-lines file and the lines rejected, each with its reason (validated as
    strictly as the loader validates). `OSError` when the file cannot be read."""
    rows, rejected = [], []
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                rejected.append(Rejected(number, f"not JSON ({error.msg})"))
                continue
            except RecursionError:
                rejected.append(Rejected(number, "not JSON (nested too deep)"))
                continue
            except ValueError as error:  # e.g. an integer of more digits than int() converts
                rejected.append(Rejected(number, f"not JSON ({str(error).split(';')[0]})"))
                continue
            if not isinstance(row, dict):
                rejected.append(Rejected(number, "a cache row must be a JSON object"))
                continue
            problem = row_problem(row)
            if problem is not None:
                rejected.append(Rejected(number, problem))
                continue
            rows.append(row)
    return rows, rejected


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines export, each checked; `ValueError` naming the file and the first bad
    line."""
    rows, rejected = parse_jsonl(path)
    if rejected:
        raise ValueError(f"{path}:{rejected[0].line}: {rejected[0].reason}")
    yield from rows


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows as JSON lines (sorted keys, one row per line: diffs review well); returns the count.
    Rows are written as stored, invalid ones too; a BLOB (which only a foreign tool writes) as its text."""
    def blob_text(value: Any) -> str:
        if isinstance(value, bytes):
            return value.decode("utf-8", errors="replace")
        raise TypeError(f"a cache field cannot be {type(value).__name__}")

    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, sort_keys=True, default=blob_text) + "\n")
            count += 1
    return count


_SHIPPED: dict[Path, tuple[float, list[dict[str, Any]], list[Rejected]]] = {}


def shipped_files() -> list[Path]:
    """The `cache_db/*.jsonl` files shipped with the package."""
    folder = shipped_dir()
    return sorted(folder.glob("*.jsonl")) if folder.is_dir() else []


def read_shipped() -> Iterator[tuple[dict[str, Any], Path]]:
    """The valid rows of every shipped file, with their file (parsed once per file version; invalid
    lines are skipped with one warning each)."""
    for path in shipped_files():
        try:
            mtime = path.stat().st_mtime
            if path not in _SHIPPED or _SHIPPED[path][0] != mtime:
                _SHIPPED[path] = (mtime, *parse_jsonl(path))
        except OSError as error:
            warn_once(path, "shipped file unreadable", str(error))
            continue
        _, rows, rejected = _SHIPPED[path]
        for bad in rejected:
            warn_once(path, f"line {bad.line} skipped", bad.reason)
        for row in rows:
            yield row, path
