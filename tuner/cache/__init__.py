"""The tuning cache (DESIGN section 8): SQLite through sqlite-utils, one table of decisions. It imports
`support`, `semantics`, `kernels` (the tile params) and `registry` (configs, the version rule) only.

A row is one decision -- an implementation and its config for a problem -- with what measured it: the
problem key (`tuner.semantics.problem.ProblemKey`, whose backend is the implementation), the config, the measured
times, the trial counts, the versions it was measured with (jax, jaxlib, triton, the implementation's
code hash) and its `source`: `search` (the best config `tuner search` found) or `bench` (the time of
one implementation in a `tuner bench --mechanisms` run of every implementation side by side). A row
whose versions no longer match this installation is *stale*: kept and listed, never used.

The config of an implementation comes from the search rows; lookup order: exact key -> the problem's
`compiled` row (a TPU target's config chosen by compiling, never measured) -> nearest tuned shape of
the same family (device kind, backend, head dim, dtype, features) -> entries shipped in
`cache_db/*.jsonl` (exact, then nearest) -> the backend's heuristic default.

The cache sits on the path of every training step, so it trusts nothing it reads:

- every row is validated before use (`row_problem`); a row that fails is skipped
  with one WARNING per row and process, naming the file, the row and what is wrong;
- readers never write: they open the file read-only (no table creation, no journal-mode change, no
  write lock), and a read-only file or folder is readable;
- a reader waits for a writer's lock at most its busy timeout (`LOADER_BUSY_TIMEOUT_S` for the
  runtime loader), then gives up with a `CacheError`;
- writers open in WAL mode with a generous busy timeout and take the write lock up front, so several
  `tuner search` processes can write at once; they create the indexes that keep lookups fast.

The runtime loader with `backend="auto"` chooses the implementation from the decisions of every
implementation for the problem by one rule (`tuner.runtime.measured`). Files written before the `source`
column hold search rows only, and may hold a `mechanisms` table of bench runs: readers read both as
the current schema, writers migrate them (`legacy`).

The package's modules, one concern each: `rows` (the schema and everything about one row: validation,
building, keys, staleness, warnings), `legacy` (the `mechanisms` table of older files), `store` (the
SQLite file and the `Cache`), `lookup` (the search behind `Cache.lookup`), `files` (JSON lines: export,
import, shipped entries), `views` (the cache as the `tuner` verbs print it: listings, entries,
statuses). This module exports the names the rest of ring-tuner uses.
"""

from tuner.cache.files import Rejected, parse_jsonl, read_jsonl, read_shipped, write_jsonl
from tuner.cache.lookup import Lookup
from tuner.cache.rows import (COLUMNS, FEATURES, NEAR, NEAR_BEST, SOURCES, TABLE, make_row, near_configs, row_config,
                              row_digest, row_key, row_params, row_problem, warn_once)
from tuner.registry.versions import VERSION_FIELDS, current_versions, stale_reason
from tuner.cache.store import LOADER_BUSY_TIMEOUT_S, Cache, CacheError, Listing, writes

__all__ = ["COLUMNS", "FEATURES", "LOADER_BUSY_TIMEOUT_S", "NEAR", "NEAR_BEST", "SOURCES", "TABLE", "VERSION_FIELDS",
           "Cache", "CacheError", "Listing", "Lookup", "Rejected", "current_versions", "make_row", "near_configs",
           "parse_jsonl", "read_jsonl", "read_shipped", "row_config", "row_digest", "row_key", "row_params",
           "row_problem", "stale_reason", "warn_once", "write_jsonl", "writes"]
