"""What makes a measurement current: the versions of jax, jaxlib, triton and an implementation's own code.

Every cache row carries the versions it was measured with; a row whose versions differ from these is
stale. The registry asks this rule for an implementation (`registry.versions`), the cache checks rows
against it; both import it from here.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

VERSION_FIELDS = ("jax_version", "jaxlib_version", "triton_version", "code_hash")


def current_versions(code_hash: str, *, triton: bool = False) -> dict[str, str]:
    """The versions an entry measured now would carry, for a backend whose code hash is `code_hash`;
    the triton version only for a backend built on Triton ("-" otherwise, so that installing or
    upgrading triton does not make scan entries stale)."""
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    return {"jax_version": version("jax"), "jaxlib_version": version("jaxlib"),
            "triton_version": version("triton") if triton else "-", "code_hash": code_hash}


def stale_reason(row: dict[str, Any], versions: dict[str, str]) -> str | None:
    """Which version of `row` differs from `versions`, or None when the row is current."""
    changed = [f"{f} {row.get(f)} -> {versions[f]}" for f in VERSION_FIELDS if row.get(f) != versions[f]]
    return ", ".join(changed) or None
