"""Cache rows as JSON lines: `tuner export` / `tuner import`, and the entries shipped with the package.

A JSON-lines file holds one cache row per line, sorted keys, so that a diff of two exports reviews
well. Reading one validates every line as strictly as the loader validates the database
(`tuner.cache.rows.row_problem`); the shipped files (`cache_db/*.jsonl`, found through
`tuner.support.resources.shipped_dir`) are parsed once per file version, their bad lines warned about once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.support import resources
from tuner.cache.rows import parse_json, row_problem, upgrade, warn_once


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
                row = parse_json(line)
            except ValueError as error:
                rejected.append(Rejected(number, str(error)))
                continue
            if not isinstance(row, dict):
                rejected.append(Rejected(number, "a cache row must be a JSON object"))
                continue
            row = upgrade(row)
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
    folder = resources.shipped_dir()
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
