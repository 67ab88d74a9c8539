"""The SQLite file of the tuning cache (through sqlite-utils): opening it to read or to write, and
the `Cache` that stores, lists, finds and looks up rows.

Readers never write: they open the file read-only (no table creation, no journal-mode change, no
write lock), a read-only file or folder included, and wait for a writer's lock at most their busy
timeout (`LOADER_BUSY_TIMEOUT_S` for the runtime loader) before giving up with a `CacheError`.
Writers open in WAL mode with a generous busy timeout and take the write lock up front, so several
`tuner search` processes can write at once; they create the indexes that keep lookups fast.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from tuner.cache import legacy
from tuner.cache.lookup import Lookup, find_entry, neighbours
from tuner.cache.rows import (COLUMNS, INDEXES, KEY_FIELDS, TABLE, VERSION_FIELDS, canonical, check_row, row_problem,
                              upgrade, warn_once)
from tuner.semantics.problem import ProblemKey
from tuner.support.resources import tuner_home

WRITE_BUSY_TIMEOUT_S = 60.0
READ_BUSY_TIMEOUT_S = 10.0
LOADER_BUSY_TIMEOUT_S = 0.25

_writes = 0  # writes this process made to any cache file (see `writes`)


def writes() -> int:
    """How many writes this process has made to cache files: the loader decides a problem again after
    one, so a search in the process (`tuner.autotune`) reaches the next trace."""
    return _writes


class CacheError(RuntimeError):
    """The cache file cannot be read or written; the message says which file and what to do."""


def default_db_path() -> Path:
    """`$TUNER_DB`, else `$TUNER_HOME/tuning.sqlite`."""
    return Path(os.environ["TUNER_DB"]) if os.environ.get("TUNER_DB") else tuner_home() / "tuning.sqlite"


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


def _enable_wal(db: sqlite_utils.Database, timeout: float) -> None:
    """Put the file in WAL mode, waiting up to `timeout` seconds for other processes: changing the
    journal mode needs the file to itself, and SQLite answers "locked" at once, without its busy
    handler, while another writer (say, one creating the same new file) holds it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.enable_wal()
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


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
            _enable_wal(db, WRITE_BUSY_TIMEOUT_S)
            with _immediate(db):
                db[TABLE].create(COLUMNS, pk="key", if_not_exists=True)
                if "source" not in db[TABLE].columns_dict:  # written before decisions had one table
                    db[TABLE].add_column("source", str, not_null_default="search")
                if "near_best" not in db[TABLE].columns_dict:  # written before searches kept them
                    db[TABLE].add_column("near_best", str, not_null_default="[]")
                missing = set(COLUMNS) - set(db[TABLE].columns_dict)
                if missing:
                    raise CacheError(f"the cache at {self.path} has no column(s) {', '.join(sorted(missing))}: "
                                     f"it was written by another tool or version; move it aside "
                                     f"(mv {self.path} {self.path}.old) and search again")
                for name, columns in INDEXES.items():
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} ({', '.join(columns)})")
                if legacy.TABLE in db.table_names():
                    self._migrate(db)
        except (sqlite3.DatabaseError, OSError) as error:
            raise self._error(error, writing=True) from error
        self._db = db
        return db

    def _migrate(self, db: sqlite_utils.Database) -> None:
        """Move the rows of a legacy `mechanisms` table into the `tuned` table as bench rows
        (`tuner.cache.legacy`), unless bench rows of that problem were recorded since; a row that cannot
        be moved stays, with one warning, and the table goes once empty. Runs inside the writer's
        opening transaction."""
        moved = []
        for row in list(db[legacy.TABLE].rows):
            try:
                problem = legacy.legacy_problem(row)
                if problem is not None:
                    raise ValueError(problem)
                key, spec = legacy.problem_of(row)
                converted = legacy.bench_rows(row, key, spec)
            except ValueError as error:
                warn_once(self.path, f"mechanisms row {row.get('key')} not migrated", str(error))
                continue
            keys = [bench["key"] for bench in converted]
            newer = db.conn.execute(f"SELECT count(*) FROM {TABLE} WHERE key IN ({', '.join('?' * len(keys))})",
                                    keys).fetchall()[0][0]
            if not newer:  # else a bench run recorded since supersedes the legacy row
                db[TABLE].upsert_all([canonical(bench) for bench in converted], pk="key")
            moved.append(row["key"])
        for key in moved:
            db.conn.execute(f"DELETE FROM {legacy.TABLE} WHERE key = ?", [key])
        if not db.conn.execute(f"SELECT count(*) FROM {legacy.TABLE}").fetchall()[0][0]:
            db.conn.execute(f"DROP TABLE {legacy.TABLE}")

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
        """The rows `sql` selects, upgraded to the current schema; `{source}` in `sql` stands for the
        source column (the constant 'search' in a file written before it existed)."""
        with self._reader() as conn:
            if conn is None or table not in self._tables(conn):
                return []
            if table == TABLE:
                has_source = any(c[1] == "source" for c in conn.execute(f"PRAGMA table_info({TABLE})"))
                sql = sql.replace("{source}", "source" if has_source else "'search'")
                return [upgrade(dict(r)) for r in conn.execute(sql, list(params))]
            return [dict(r) for r in conn.execute(sql, list(params))]

    def _write(self, action: Callable[[sqlite_utils.Database], Any]) -> Any:
        global _writes
        db = self._writer()
        try:
            done = action(db)
        except sqlite3.DatabaseError as error:
            raise self._error(error, writing=True) from error
        _writes += 1
        return done

    # -- writing ---------------------------------------------------------------------------------

    def put(self, row: dict[str, Any]) -> None:
        """Insert or replace the row with `row["key"]` (checked first), in one transaction."""
        check_row(row)
        row = canonical(row)

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
        row = canonical(row)

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
        rows = [canonical(r) for r in rows]

        def write(db):
            with _immediate(db):
                db[TABLE].upsert_all(rows, pk="key")
        self._write(write)
        return len(rows)

    def put_run(self, rows: list[dict[str, Any]]) -> None:
        """Record the bench rows of one `tuner bench --mechanisms` run of one problem (each checked
        first) in place of every bench row of that problem: the newest run is the measurement."""
        for i, row in enumerate(rows):
            check_row(row, where=f"row {i + 1}")
        problems = {tuple(row[f] for f in KEY_FIELDS if f != "backend") for row in rows}
        if len(problems) != 1 or any(row["source"] != "bench" for row in rows):
            raise ValueError("put_run takes the bench rows of one problem")
        rows = [canonical(r) for r in rows]
        fields = [f for f in KEY_FIELDS if f != "backend"]
        match = " AND ".join(f"{f} = ?" for f in fields)

        def write(db):
            with _immediate(db):
                db.conn.execute(f"DELETE FROM {TABLE} WHERE source = 'bench' AND {match}",
                                [rows[0][f] for f in fields])
                db[TABLE].upsert_all(rows, pk="key")
        self._write(write)

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

    def entry(self, key: str) -> dict[str, Any] | None:
        """The row stored under problem key digest `key`, as stored (valid or not), or None."""
        rows = self.entries([key])
        return rows[0] if rows else None

    def entries(self, keys: list[str]) -> list[dict[str, Any]]:
        """The rows stored under these keys, as stored (valid or not), in one read."""
        if not keys:
            return []
        return self._select(f"SELECT * FROM {TABLE} WHERE key IN ({', '.join('?' * len(keys))})", keys)

    def find(self, prefix: str) -> list[dict[str, Any]]:
        """Rows whose key starts with `prefix` (keys are hex digests; a short prefix is enough)."""
        if not re.fullmatch(r"[0-9a-fA-F]*", prefix):
            return []
        return self._select(f"SELECT * FROM {TABLE} WHERE key >= ? AND key < ? ORDER BY key",
                            [prefix.lower(), prefix.lower() + "g"])

    def legacy_run(self, key: str) -> dict[str, Any] | None:
        """The legacy `mechanisms` row of `auto` key digest `key` in a file no writer has migrated
        (`tuner.cache.legacy`), valid, or None (an invalid one is skipped with a warning)."""
        rows = self._select(f"SELECT * FROM {legacy.TABLE} WHERE key = ?", [key], table=legacy.TABLE)
        if not rows:
            return None
        problem = legacy.legacy_problem(rows[0])
        if problem is not None:
            warn_once(self.path, f"mechanisms row {key} skipped", problem)
            return None
        return rows[0]

    def neighbours(self, key: ProblemKey, versions: dict[str, str], limit: int = 3) -> list[tuple[float, dict]]:
        """The rows tuned for the problems nearest `key` (`tuner.cache.lookup.neighbours`), nearest first."""
        return neighbours(self._select, key, versions, limit)

    def lookup(self, key: ProblemKey, versions: dict[str, str],
               accept: Callable[[dict[str, Any]], str | None] | None = None) -> Lookup:
        """The entry to use for `key` (lookup order in the `tuner.cache` docstring).

        Invalid rows (warned about once), stale rows and rows that `accept` rejects (it returns why)
        are passed over; the reason of the result says what was passed over and why, and when no
        exact entry was used but one exists for another layout of the same problem, says so.
        """
        return find_entry(self._select, self.path, key, versions, accept)
