"""Finding the entry to use for a problem: exact key, nearest tuned shape, shipped entries, default.

`find_entry` is the search behind `Cache.lookup` (order in the `tuner.cache` docstring). It reads
only what it needs: the exact row by key, then the key, size, layout and version fields of the current
rows of the problem's family (device kind, backend, head dim, dtype, features), ranked by distance,
reading the whole row of a candidate only. Every row is validated before use; what was passed over
(invalid, stale, rejected by the caller) is summed up in the reason of the `Lookup`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.support import resources
from tuner.cache.files import read_shipped
from tuner.cache.rows import (FAMILY_FIELDS, SIZE_FIELDS, TABLE, is_int, key_columns, row_digest, row_key,
                              row_problem, warn_once)
from tuner.registry.versions import VERSION_FIELDS, stale_reason
from tuner.semantics.problem import ProblemKey


@dataclass(frozen=True)
class Lookup:
    """The outcome of a cache lookup: the row used (None for the default), its source and why."""

    row: dict[str, Any] | None
    source: str  # "exact", "compiled", "nearest", "shipped" or "default"
    reason: str


def _distance(row: dict[str, Any], key: ProblemKey) -> float | None:
    """`ProblemKey.distance` from a row's size fields, or None when a size field is not a positive int
    (the row is then invalid, and reported as such when it is considered)."""
    total = 0.0
    for name in ("batch", "q_len", "kv_len", "heads", "kv_heads", "ring_size"):
        value = row[name]
        if not is_int(value) or value <= 0:
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


class _Search:
    """One lookup of `key`: the local rows (read through `select`), then the shipped ones; it collects
    what it passed over and the entries tuned for another layout of the same problem."""

    def __init__(self, select: Callable[..., list[dict[str, Any]]], path: Path, key: ProblemKey,
                 versions: dict[str, str], accept: Callable[[dict[str, Any]], str | None] | None) -> None:
        self.select, self.path, self.key, self.versions, self.accept = select, path, key, versions, accept
        self.notes = _Notes()
        self.other_layouts: list[str] = []

    def usable(self, row: dict[str, Any], where: str, origin: Path | str) -> bool:
        """Whether `row` is valid, current and accepted; noted (an invalid row also warned about) if not."""
        problem = row_problem(row)
        if problem is not None:
            warn_once(origin, f"{where} entry {row.get('key')!r} skipped", problem)
            self.notes.add(f"{where} entry {row.get('key')} invalid ({problem})")
            return False
        reason = stale_reason(row, self.versions) or (self.accept(row) if self.accept else None)
        if reason:
            self.notes.add(f"{where} entry {row['key']} passed over ({reason})")
        return reason is None

    def best(self, exact: list[dict[str, Any]], family: Callable[[], list[dict[str, Any]]],
             full: Callable[[dict[str, Any]], dict[str, Any] | None], where: str,
             origin: Path | str) -> tuple[dict[str, Any] | None, str]:
        """The exact row if usable, else the nearest usable row of `family()` (rows that may hold
        only the key, size, layout and version fields; `full` reads the whole row)."""
        key = self.key
        if exact and self.usable(exact[0], where, origin):
            return exact[0], "exact"
        ranked = []
        for partial in family():
            distance = _distance(partial, key)
            if distance is None:  # a size field is not a positive int: report it invalid
                row = full(partial)
                if row is not None:
                    self.usable(row, where, origin)
                continue
            ranked.append((distance, partial))
        ranked.sort(key=lambda item: (item[0], str(item[1]["key"])))  # ties by key: never by the file's row order
        found = None
        for distance, partial in ranked:
            if found is not None and distance > 0.5:
                break
            stale = stale_reason(partial, self.versions)
            if stale:
                self.notes.add(f"{where} entry {partial['key']} passed over ({stale})")
                continue
            row = full(partial)
            if row is None:
                continue
            if row["layout"] != key.layout and distance == 0.5 and row_problem(row) is None:
                self.other_layouts.append(f"{row['layout']} ({where} entry {row['key']})")
            if found is None and self.usable(row, where, origin):
                found = row
        return found, ("nearest" if found is not None else "")

    def _whole_row(self, partial: dict[str, Any]) -> dict[str, Any] | None:
        rows = self.select(f"SELECT * FROM {TABLE} WHERE rowid = ?", [partial["rowid"]])
        return rows[0] if rows else None

    def local(self) -> tuple[dict[str, Any] | None, str]:
        """The best entry of the cache file, and how it matched ("exact", "nearest" or "")."""
        key, versions = self.key, self.versions
        matches = " AND ".join(f"{f} = ?" for f in FAMILY_FIELDS) + " AND {source} = 'search'"
        family_values = [key.op, key.backend, key.device_kind, key.head_dim, key.dtype, key_columns(key)["features"]]
        brief = ", ".join(("rowid", "key", "layout", *SIZE_FIELDS, *VERSION_FIELDS))
        exact = self.select(f"SELECT * FROM {TABLE} WHERE key = ?", [key.digest])
        current = " AND ".join(f"{f} = ?" for f in VERSION_FIELDS)
        version_values = [versions[f] for f in VERSION_FIELDS]
        row, kind = self.best(exact, lambda: self.select(
            f"SELECT {brief} FROM {TABLE} WHERE {matches} AND {current} AND key != ?",
            [*family_values, *version_values, key.digest]), self._whole_row, "local", self.path)
        if row is None or kind != "exact":
            stale = self.select(f"SELECT count(*) AS n FROM {TABLE} WHERE {matches} AND NOT ({current})",
                                [*family_values, *version_values])
            if stale and stale[0]["n"]:
                self.notes.add(f"{stale[0]['n']} local entr{'y' if stale[0]['n'] == 1 else 'ies'} of this family "
                               f"passed over (measured with other versions)")
        return row, kind

    def shipped(self) -> tuple[dict[str, Any] | None, str]:
        """The best shipped entry, and how it matched ("exact", "nearest" or "")."""
        key = self.key
        shipped = [r for r, _ in read_shipped() if r["source"] == "search"]
        return self.best([r for r in shipped if r["key"] == key.digest], lambda: [
            r for r in shipped if r["key"] != key.digest and row_key(r).family == key.family],
            lambda r: r, "shipped", resources.shipped_dir())

    def compiled(self) -> dict[str, Any] | None:
        """The usable `compiled` row of this very problem in the cache file, or None."""
        rows = self.select(f"SELECT * FROM {TABLE} WHERE key = ?", [row_digest(self.key, "compiled")])
        return rows[0] if rows and self.usable(rows[0], "compiled", self.path) else None

    def result(self) -> Lookup:
        """The entry to use, its source, and the reason: what was passed over, where the entry came from."""
        row, kind = self.local()
        origin, source = f"in {self.path}", kind
        if kind != "exact":
            compiled = self.compiled()
            if compiled is not None:
                parts = [*self.notes.parts(), f"no measured entry for this problem; compiled entry {compiled['key']} "
                         f"{origin}: {compiled['study']} (model {compiled['best_s'] * 1e3:.3g} ms fwd+bwd, not "
                         f"measured: run tuner search on that device to measure)"]
                return Lookup(compiled, "compiled", "; ".join(parts))
        if row is None:
            row, kind = self.shipped()
            origin, source = f"from {resources.shipped_dir()}", "shipped"
        parts = self.notes.parts()
        if row is not None:
            parts.append(f"{'shipped ' if source == 'shipped' else ''}{kind} entry {row['key']} {origin}")
        else:
            source = "default"
            parts.append("no tuned entry for this problem")
        if kind != "exact" and self.other_layouts:
            parts.append(f"a tuned entry exists for this problem with layout {self.other_layouts[0]}: pass that "
                         f"layout to use it")
        return Lookup(row, source, "; ".join(parts))


# Packed documents decide which tiles a ring runs, and they want short tiles: a packed problem's nearest
# neighbours are the packed ones, then the unpacked ones (8: as far as a sequence 16 times as long, 4 doublings
# of the query and of the key length).
PACKING_APART = 8.0


def neighbours(select: Callable[..., list[dict[str, Any]]], key: ProblemKey, versions: dict[str, str],
               limit: int) -> list[tuple[float, dict[str, Any]]]:
    """Up to `limit` (distance, row) of the valid, current search rows tuned for other problems of the same
    op, implementation, device kind and dtype, nearest first: the loader's distance (sizes and layout),
    plus the log2 ratio of the head dims, plus 1 when the features differ, plus `PACKING_APART` when one
    problem packs documents (segment ids) and the other does not. A search starts from their configs (warm
    start)."""
    family = ("op", "backend", "device_kind", "dtype")
    current = " AND ".join(f"{f} = ?" for f in VERSION_FIELDS)
    rows = select(f"SELECT * FROM {TABLE} WHERE {' AND '.join(f'{f} = ?' for f in family)} AND {current} "
                  f"AND {{source}} = 'search' AND key != ?",
                  [*(getattr(key, f) for f in family), *(versions[f] for f in VERSION_FIELDS), key.digest])
    features = key_columns(key)["features"]
    packed = json.loads(features).get("segments")
    ranked = []
    for row in rows:
        distance = _distance(row, key)
        if distance is None or row_problem(row) is not None or not is_int(row["head_dim"]) or row["head_dim"] <= 0:
            continue
        distance += abs(math.log2(row["head_dim"] / key.head_dim))
        distance += 0.0 if row["features"] == features else 1.0
        distance += 0.0 if json.loads(row["features"]).get("segments") == packed else PACKING_APART
        ranked.append((distance, row))
    ranked.sort(key=lambda item: item[0])
    return ranked[:limit]


def find_entry(select: Callable[..., list[dict[str, Any]]], path: Path, key: ProblemKey, versions: dict[str, str],
               accept: Callable[[dict[str, Any]], str | None] | None = None) -> Lookup:
    """The entry to use for `key` among the rows of the cache at `path` (read by `select(sql, params)`)
    and the shipped ones, with versions `versions`; what `accept` rejects (it returns why) is passed over."""
    return _Search(select, path, key, versions, accept).result()
