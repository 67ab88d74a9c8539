"""Plain-text tables, one-line params and one-line errors, shared by the CLI's verbs and reports."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any


MIN_WRAPPED = 24  # the narrowest a wrapped last column gets, whatever the width
NUMBER = re.compile(r"^[-+]?[0-9][0-9.,e+-]*(x|%| s)?$|^-$")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None) -> str:
    """Columns padded to their widest cell; numeric columns right-aligned, the others left-aligned. Given a
    `width`, a text last column that would pass it is wrapped at word boundaries onto lines of its own (at
    least `MIN_WRAPPED` characters wide), so that a long description does not widen the whole table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [len(cells) > 1 and all(NUMBER.match(row[i]) for row in cells[1:]) for i in range(len(headers))]
    room = None if width is None else max(MIN_WRAPPED, width - sum(widths[:-1]) - 2 * (len(headers) - 1))
    if room is not None and widths[-1] > room and not numeric[-1]:
        widths[-1] = room

    def lines(row: Sequence[str]) -> list[str]:
        last = textwrap.wrap(row[-1], widths[-1], break_on_hyphens=False) if len(row[-1]) > widths[-1] else [row[-1]]
        firsts = [c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row[:-1], widths))]
        blank = [" " * w for w in widths[:-1]]
        return ["  ".join([*(firsts if n == 0 else blank), part]).rstrip() for n, part in enumerate(last)]

    header, *body = [lines(row) for row in cells]
    return "\n".join([*header, "  ".join("-" * w for w in widths), *(line for row in body for line in row)])


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


def described_fields(text: str) -> dict[str, str]:
    """The fields `describe_config` wrote, as `{"part.field": "value"}`: a config's settings read back from
    the one line a trial keeps. `ValueError` for text it did not write."""
    if text == "-":
        return {}
    parts = _DESCRIBED_PART.findall(text)
    if not parts or " ".join(f"{part}({body})" for part, body in parts) != text:
        raise ValueError(f"not a config description (part(field=value ...) ...): {text[:80]!r}")
    fields = {}
    for part, body in parts:
        for item in body.split():
            name, equals, value = item.partition("=")
            if not equals:
                raise ValueError(f"not a config description (part(field=value ...) ...): {text[:80]!r}")
            fields[f"{part}.{name}"] = value
    return fields


_DESCRIBED_PART = re.compile(r"(\w+)\(([^()]*)\)")
