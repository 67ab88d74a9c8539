"""Backend registry: every implementation of the block kernel contract, and how one is chosen."""

from __future__ import annotations

from typing import Any

import jax

from tuner.backends.base import Backend, available
from tuner.backends.pallas_tpu import PallasTpuBackend
from tuner.backends.scan import ScanBackend
from tuner.backends.triton import TritonBackend
from tuner.spec import AttentionSpec

BACKENDS: dict[str, Backend] = {"scan": ScanBackend(), "triton": TritonBackend(),
                                 "pallas_tpu": PallasTpuBackend()}

# `backend="auto"` tries these in order on each platform.
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


def why_not(backend: Backend, spec: AttentionSpec, dtype: Any, head_dim: int, interpret: bool = False
            ) -> str | None:
    """Why `backend` cannot run this problem here (unavailable, or a feature it does not honour)."""
    reason = backend.unavailable_reason(interpret)
    if reason is not None:
        return f"cannot run here: {reason}"
    reason = backend.supports(spec, dtype, head_dim)
    return None if reason is None else f"does not support {reason}"


def resolve_auto(spec: AttentionSpec, dtype: Any, head_dim: int, platform: str | None = None,
                 interpret: bool = False) -> tuple[Backend, list[str]]:
    """The first backend of the platform's preference that can run the problem, and why each one
    before it was passed over."""
    passed_over = []
    for name in PREFERENCE.get(platform or jax.default_backend(), ("scan",)):
        backend = BACKENDS[name]
        reason = why_not(backend, spec, dtype, head_dim, interpret)
        if reason is None:
            return backend, passed_over
        passed_over.append(f"{name} {reason}")
    return BACKENDS["scan"], passed_over


def check_vma(name: str, interpret: bool) -> bool:
    """Whether a `shard_map` around a ring of backend `name` can keep its varying-axes check: Pallas's
    interpreter (jax 0.10) evaluates scalar-prefetch index maps without it, so interpreted pallas_tpu
    kernels need `check_vma=False`."""
    return not (interpret and name == "pallas_tpu")


def choose_backend(name: str, spec: AttentionSpec, dtype: Any, head_dim: int, platform: str | None = None,
                   interpret: bool = False) -> Backend:
    """Resolve `name` ("auto" or a backend name) for this problem.

    A named backend that cannot run here or cannot honour a feature raises `ValueError` saying why;
    "auto" takes the first backend of the platform's preference that can.
    """
    if name == "auto":
        return resolve_auto(spec, dtype, head_dim, platform, interpret)[0]
    backend = get_backend(name)
    reason = why_not(backend, spec, dtype, head_dim, interpret)
    if reason is not None:
        raise ValueError(f"backend {name!r} {reason}; use backend='auto' to fall back to one that can")
    return backend


__all__ = ["BACKENDS", "PREFERENCE", "Backend", "available", "check_vma", "choose_backend", "get_backend", "resolve_auto",
           "why_not"]
