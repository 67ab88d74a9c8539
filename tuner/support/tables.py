"""Plain-text tables, one-line params and one-line errors, shared by the CLI's verbs and reports."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


NUMBER = re.compile(r"^[-+]?[0-9][0-9.,e+-]*(x|%| s)?$|^-$")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numeric columns right-aligned, the others left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [len(cells) > 1 and all(NUMBER.match(row[i]) for row in cells[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def error_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message` (at most `limit` characters of it): how a failure that is
    reported rather than raised is shown; an empty message gives just the type."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:limit] if text else ''}"


def short_params(values: dict[str, Any]) -> str:
    """Settings as `field=value ...`, unset fields left out."""
    return " ".join(f"{k}={v}" for k, v in values.items() if v is not None)


def describe_config(config: Any) -> str:
    """An implementation's config as `fwd(field=value ...) bwd(...)`; "-" when it has nothing to tune."""
    parts = [f"{part}({short_params(values)})" for part, values in config.to_dict().items() if values]
    return " ".join(parts) or "-"
