"""Backend registry: every implementation of the block kernel contract, and how one is chosen."""

from __future__ import annotations

from typing import Any

import jax

from tuner.backends.base import Backend, available
from tuner.backends.scan import ScanBackend
from tuner.spec import AttentionSpec

BACKENDS: dict[str, Backend] = {"scan": ScanBackend()}

# `backend="auto"` tries these in order on each platform; names not registered yet are passed over.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "scan"),
    "tpu": ("pallas_tpu", "scan"),
    "cpu": ("scan",),
}


def get_backend(name: str) -> Backend:
    """The backend called `name`; `ValueError` naming the known ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"backend must be one of {known}, got {name!r}") from None


def choose_backend(name: str, spec: AttentionSpec, dtype: Any, platform: str | None = None) -> Backend:
    """Resolve `name` ("auto" or a backend name) for this problem.

    A named backend that cannot run here or cannot honour a feature raises `ValueError` saying why;
    "auto" takes the first backend of the platform's preference that can.
    """
    if name == "auto":
        platform = platform or jax.default_backend()
        for candidate in PREFERENCE.get(platform, ("scan",)):
            backend = BACKENDS.get(candidate)
            if backend is not None and available(backend) and backend.supports(spec, dtype) is None:
                return backend
        return BACKENDS["scan"]
    backend = get_backend(name)
    reason = backend.unavailable_reason()
    if reason is not None:
        raise ValueError(f"backend {name!r} cannot run here: {reason}; use backend='auto' or 'scan'")
    reason = backend.supports(spec, dtype)
    if reason is not None:
        raise ValueError(f"backend {name!r} does not support this problem: {reason}; "
                         f"use backend='auto' to fall back to one that does")
    return backend


__all__ = ["BACKENDS", "Backend", "available", "choose_backend", "get_backend"]
