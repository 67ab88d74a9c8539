"""Integer and flag argument checks, written once for every options class and entry point of the package.

Tile params, problems, search options, layer and loader arguments all take sizes and counts that must
be positive (or non-negative) ints, and flags that must be bools; they all raise the same `ValueError`,
naming the argument.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, non_negative: bool = False, optional: bool = False, numeric: bool = False
              ) -> int | None:
    """`value` as an int (None when it is None and `optional`), or `ValueError` naming `name` unless it
    is a positive int (with `non_negative`, zero too). A bool is never an int here.

    With `numeric`, a NumPy integer and a whole float (`4.0`) count too: for options a user computes.
    Without it only a Python int does: for fields that are stored and written to JSON as they are."""
    if value is None and optional:
        return None
    if numeric:
        whole = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                 or isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer())
    else:
        whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or value < (0 if non_negative else 1):
        kind = "a non-negative int" if non_negative else "a positive int"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """`value` as a bool, or `ValueError` naming `name` unless it is one (a NumPy bool counts): a flag given
    `"no"` or `0` would otherwise pass as whatever its truth is."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)
