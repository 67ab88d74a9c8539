"""Where ring-tuner's files live, in a source checkout and in an installed wheel.

A source checkout keeps `templates/`, `cache_db/` and `kernels_generated/` at the repository root,
beside the `tuner` package. A wheel ships the templates and the shipped configs inside the package
(`tuner/_data/templates`, `tuner/_data/cache_db`, mapped from the repository's folders by
`pyproject.toml`), and never writes into site-packages: its rendered kernels, like the tuning cache,
go to the per-user `$TUNER_HOME` (default `~/.cache/tuner`).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # the `tuner` package
PACKAGED_DATA = PACKAGE / "_data"


def checkout_root() -> Path | None:
    """The repository root when `tuner` runs from a source checkout (an editable install included),
    else None."""
    root = PACKAGE.parent
    if (root / "pyproject.toml").is_file() and (root / "templates").is_dir():
        return root
    return None


def _data(name: str) -> Path:
    root = checkout_root()
    return root / name if root is not None else PACKAGED_DATA / name


def templates_dir() -> Path:
    """The kernel templates: `templates/` of the checkout, else the copy inside the installed package."""
    return _data("templates")


def shipped_dir() -> Path:
    """Tuned entries the project measured on real hardware: `cache_db/` of the checkout, else the copy
    inside the installed package."""
    return _data("cache_db")


def tuner_home() -> Path:
    """`$TUNER_HOME`, else `~/.cache/tuner`: the per-user folder of the cache and rendered kernels."""
    return Path(os.environ.get("TUNER_HOME") or Path.home() / ".cache" / "tuner")


def generated_dir() -> Path:
    """Where rendered kernel modules go: `kernels_generated/` of a source checkout, else
    `$TUNER_HOME/kernels_generated` (an installed package never writes into site-packages)."""
    root = checkout_root()
    if root is not None:
        checkout = root / "kernels_generated"
        if checkout.is_dir() and os.access(checkout, os.W_OK):
            return checkout
    return tuner_home() / "kernels_generated"
