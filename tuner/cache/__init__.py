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

The package's modules, one concern each: `rows` (the schema and everything about one row: validation,
building, keys, staleness, warnings), `store` (the SQLite file and the `Cache`), `lookup` (the search
behind `Cache.lookup`), `files` (JSON lines: export, import, shipped entries), `views` (the cache as the
`tuner` verbs print it: listings, entries, statuses). This module exports the names the rest of ring-tuner
uses.
"""

from tuner.cache.files import Rejected, parse_jsonl, read_jsonl, read_shipped, write_jsonl
from tuner.cache.lookup import Lookup
from tuner.cache.rows import (COLUMNS, FEATURES, MECHANISM_COLUMNS, MECHANISM_TABLE, TABLE, VERSION_FIELDS,
                              current_versions, make_row, row_config, row_key, row_params, row_problem, stale_reason,
                              warn_once)
from tuner.cache.store import LOADER_BUSY_TIMEOUT_S, Cache, CacheError, Listing

__all__ = ["COLUMNS", "FEATURES", "LOADER_BUSY_TIMEOUT_S", "MECHANISM_COLUMNS", "MECHANISM_TABLE", "TABLE",
           "VERSION_FIELDS", "Cache", "CacheError", "Listing", "Lookup", "Rejected", "current_versions", "make_row",
           "parse_jsonl", "read_jsonl", "read_shipped", "row_config", "row_key", "row_params", "row_problem",
           "stale_reason", "warn_once", "write_jsonl"]
