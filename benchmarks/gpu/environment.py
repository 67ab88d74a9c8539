"""The environment of a GPU session, as JSON on stdout: what the numbers beside it were measured with.

    python benchmarks/gpu/environment.py > OUT/environment.json

The device, jax and jaxlib (and jaxlib's extension version, which the private cuDNN module follows),
cuDNN's version as jax loaded it, triton, the ring-tuner version, and whether the cudnn kernel can bind
cuDNN's primitives here (`tuner.kernels.cudnn_engine.private_module`).
"""

from __future__ import annotations

import json
import platform
from importlib.metadata import PackageNotFoundError, version

import jax

import tuner
from tuner.kernels import BACKENDS, cudnn_engine


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _cudnn_version() -> int | None:
    """cuDNN's version as jax loaded it (e.g. 91000 for 9.10.0), or None without CUDA."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    return None if cuda_versions is None else cuda_versions.cudnn_get_version()


def environment() -> dict:
    from jax._src.lib import jaxlib_extension_version

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "compute_capability": getattr(device, "compute_capability", None),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "jaxlib_extension_version": jaxlib_extension_version,
        "cudnn": _cudnn_version(),
        "triton": _version("triton"),
        "jax_triton": _version("jax-triton"),
        "ring_tuner": tuner.__version__,
        "cudnn_binding": cudnn_engine.private_module()[1] or "bound",
        "cudnn_tested_jax": list(cudnn_engine.TESTED_JAX),
        "unavailable": {name: backend.unavailable_reason() for name, backend in BACKENDS.items()},
    }


if __name__ == "__main__":
    print(json.dumps(environment(), indent=2))
