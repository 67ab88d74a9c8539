"""The cache as `tuner list / show / export / import / clear / info` present it: each function takes a
`Cache` and the verb's options and returns the text to print, or raises `RequestError` with a line
saying what to do (the CLI prints it as a usage error).

A row is shown as stored, valid or not: its status says whether the loader uses it (`ok`), skips it
(`invalid`, with why) or never matches it (`stale`, with the version that changed); a cell of an
invalid row that cannot be rendered is `?`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from tuner import registry
from tuner.cache.files import parse_jsonl, write_jsonl
from tuner.cache.rows import row_problem
from tuner.registry.versions import stale_reason
from tuner.cache.store import Cache
from tuner.support.tables import table

# The key fields `tuner list` filters on, with the type of each flag's value.
LIST_FILTERS: dict[str, type] = {"backend": str, "device_kind": str, "layout": str, "dtype": str, "head_dim": int,
                                 "ring_size": int}


class RequestError(ValueError):
    """A request the cache cannot meet as asked (no such entry, a page past the last, a file that cannot
    be read or written, invalid rows to import); the message says what to do."""


def status(row: dict[str, Any]) -> str:
    """ok, invalid (why: the loader skips it), or stale (which version changed: never used)."""
    problem = row_problem(row)
    if problem is not None:
        return f"invalid ({problem})"
    implementation = registry.find(row["backend"])
    if implementation is None:
        return f"stale (backend {row['backend']} is not registered here)"
    reason = stale_reason(row, registry.versions(implementation))
    return f"stale ({reason})" if reason else "ok"


def _features(row: dict[str, Any]) -> str:
    """The features a row's kernel compiles in, as `causal,window=128`; `full` for none."""
    try:
        features = json.loads(row["features"])
        on = [k if v is True else f"{k}={v}" for k, v in features.items() if v not in (None, False, 0)]
    except (TypeError, ValueError, AttributeError, RecursionError):
        return str(row.get("features"))[:40]
    return ",".join(on) or "full"


def _cell(row: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """A table cell of a row that may be invalid: `render(row)`, else "?" (the status column says why)."""
    try:
        return render(row)
    except (TypeError, ValueError, KeyError, AttributeError):
        return "?"


def _entries(count: int) -> str:
    return f"entr{'y' if count == 1 else 'ies'}"


def list_text(cache: Cache, *, where: dict[str, Any], limit: int | None, page: int) -> str:
    """Page `page` (from 1) of the rows matching `where`, `limit` a page (None: every row), as a
    table with each row's status, and a line saying how to see more when there is more."""
    offset = 0 if limit is None else (page - 1) * limit
    listing = cache.listing(limit=limit, offset=offset, where=where)
    if not listing.rows:
        if listing.total:
            raise RequestError(f"--page {page} is past the last page ({listing.total} entries, {limit} a page)")
        what = "matching " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in where.items()) if where else ""
        return (f"no tuned entries {what + ' ' if what else ''}in {cache.path}; run `tuner search --device cpu` "
                f"to add one")
    entries = [[_cell(r, lambda r: r["key"]), _cell(r, lambda r: r["backend"]), _cell(r, lambda r: r["source"]),
                _cell(r, lambda r: r["device_kind"]), _cell(r, lambda r: str(r["ring_size"])),
                _cell(r, lambda r: r["layout"]), _cell(r, lambda r: str(r["batch"])),
                _cell(r, lambda r: str(r["q_len"])), _cell(r, lambda r: f"{r['heads']}/{r['kv_heads']}"),
                _cell(r, lambda r: str(r["head_dim"])), _cell(r, lambda r: r["dtype"]), _features(r),
                _cell(r, lambda r: r["objective"]), _cell(r, lambda r: f"{r['best_s'] * 1e3:.1f}"),
                _cell(r, lambda r: "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"),
                _cell(r, lambda r: r["measured_at"][:10]), status(r)] for r in listing.rows]
    lines = [table(["key", "backend", "source", "device", "ring", "layout", "B", "Tq", "H/Hkv", "D", "dtype",
                    "features", "objective", "best ms", "speedup", "measured", "status"], entries)]
    if limit is not None and listing.total > len(listing.rows):
        last = offset + len(listing.rows)
        more = f"; `tuner list --page {page + 1}` for more" if last < listing.total else ""
        lines.append(f"entries {offset + 1}-{last} of {listing.total}{more}, `--all` for every one")
    return "\n".join(lines)


def find_one(cache: Cache, prefix: str) -> dict[str, Any]:
    """The one row whose key starts with `prefix`; `RequestError` when none or several do."""
    rows = cache.find(prefix)
    if not rows:
        raise RequestError(f"no cache entry with a key starting {prefix!r}; `tuner list` shows the keys")
    if len(rows) > 1:
        raise RequestError(f"{len(rows)} entries start with {prefix!r} ({', '.join(str(r['key']) for r in rows[:5])}"
                         f"{', ...' if len(rows) > 5 else ''}); give more of the key")
    return rows[0]


def show_text(row: dict[str, Any]) -> str:
    """Every field of `row`, one a line, then its status."""
    width = max(map(len, row))
    lines = [f"{field.ljust(width)}  {value}" for field, value in row.items()]
    return "\n".join([*lines, f"{'status'.ljust(width)}  {status(row)}"])


def export(cache: Cache, path: str | os.PathLike, prefix: str | None = None, *,
           warn: Callable[[str], None]) -> str:
    """Write the valid rows (those whose key starts with `prefix`, when given) to the JSON-lines file
    `path`, so that `tuner import` of the file keeps every one. Each invalid row goes to `warn`, by key
    and reason, and is left out: the loader skips it too."""
    rows = cache.find(prefix) if prefix else cache.rows()
    valid = []
    for row in rows:
        problem = row_problem(row)
        if problem is None:
            valid.append(row)
        else:
            warn(f"WARNING: entry {row.get('key')} not exported: invalid ({problem})")
    try:
        count = write_jsonl(path, valid)
    except OSError as error:
        raise RequestError(f"cannot write {path} ({error.strerror or error}); give a writable path") from None
    skipped = f", skipped {len(rows) - count} invalid" if count < len(rows) else ""
    return f"exported {count} {_entries(count)} to {path}{skipped}"


def import_file(cache: Cache, path: str | os.PathLike, *, skip_invalid: bool, warn: Callable[[str], None]) -> str:
    """Put the rows of the JSON-lines file `path` into the cache. Every rejected line goes to `warn`;
    any rejected line imports nothing (`RequestError`) unless `skip_invalid`."""
    try:
        rows, rejected = parse_jsonl(path)
    except OSError as error:
        raise RequestError(f"cannot read {path} ({error.strerror or error})") from None
    for bad in rejected:
        warn(f"{path}:{bad.line}: rejected: {bad.reason}")
    if rejected and not skip_invalid:
        raise RequestError(f"{len(rejected)} of {len(rows) + len(rejected)} rows of {path} are invalid (listed "
                         f"above); nothing was imported; fix them, or pass --skip-invalid to import the "
                         f"{len(rows)} valid rows")
    count = cache.put_many(rows)
    skipped = f", skipped {len(rejected)} invalid" if rejected else ""
    return f"imported {count} {_entries(count)} into {cache.path}{skipped}"


def clear(cache: Cache, *, stale: bool = False) -> str:
    """Delete every row, or with `stale` the rows the loader does not use (stale or invalid)."""
    rows = cache.rows()
    if stale:
        rows = [r for r in rows if status(r) != "ok"]
    count = cache.delete(r["key"] for r in rows)
    return f"deleted {count} {'stale ' if stale else ''}{_entries(count)} from {cache.path}"


def counts(cache: Cache) -> tuple[int, int, int, dict[str, int]]:
    """How many rows the cache holds, how many of them are stale and invalid, and how many rows of each
    source other than search (bench times, compiled configs)."""
    rows = cache.rows()
    statuses = [status(r).split(" ")[0] for r in rows]
    sources = Counter(r["source"] for r in rows if r["source"] != "search")
    return len(rows), statuses.count("stale"), statuses.count("invalid"), dict(sources)
