"""GPUs to compile for on a host without one (`tuner memory --device gpu --target h100:8`).

XLA:GPU builds for a GPU it is told about: a description of the chip (`tuner/models/targets/<name>.txtpb`,
the GpuTargetConfigProto XLA reads in place of a GPU's), handed to `jax.experimental.topologies` through
jax's CUDA plugin. Nothing runs, but the whole compiler does, cuDNN's custom calls included, and
`memory_analysis()` counts what a device holds. The Triton kernels do not build this way: jax_triton asks
the GPU for its compute capability while it lowers.
"""

from __future__ import annotations

import importlib.resources
import os

from tuner.kernels.cudnn import cuda_plugin

TARGETS = {"h100": "an NVIDIA H100 SXM, 80 GB", "h200": "an NVIDIA H200 SXM, 141 GB"}  # in tuner/models/targets/
MOST_DEVICES = 8  # the GPUs of one node, which a ring spans


def parse(target: str) -> tuple[str, int]:
    """`NAME:COUNT` (e.g. "h100:8") as (name, count); `ValueError` naming `--target` otherwise."""
    name, _, count = target.partition(":")
    if name not in TARGETS:
        raise ValueError(f"--target {target}: no GPU named {name!r}; GPU targets: "
                         + ", ".join(f"{n}:COUNT ({what})" for n, what in TARGETS.items()))
    if not count.isdigit() or not 1 <= int(count) <= MOST_DEVICES:
        raise ValueError(f"--target {target}: write the number of GPUs after the colon, 1 to {MOST_DEVICES} "
                         f"(e.g. {name}:8)")
    return name, int(count)


def plugin_missing() -> str | None:
    """Why a GPU topology cannot be compiled for here, or None."""
    if cuda_plugin():
        return None
    import jax

    return f"compiling for a GPU without one needs jax's CUDA plugin: pip install 'jax[cuda12]=={jax.__version__}'"


def devices(target: str) -> list:
    """The devices of `target` (`parse`) to build a mesh on; `ValueError` saying what to do where they
    cannot be had. The host's own devices are the CPU's: jax is told so before it starts its backends (with
    the plugin and no GPU, it would look for one and fail)."""
    name, count = parse(target)
    missing = plugin_missing()
    if missing is not None:
        raise ValueError(missing)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU, so no driver to check
    import jax
    from jax.experimental import topologies

    jax.config.update("jax_platforms", "cpu")
    description = importlib.resources.files("tuner.models").joinpath("targets", f"{name}.txtpb").read_text()
    try:
        return list(topologies.get_topology_desc(name, "cuda", target_config=description,
                                                 topology=f"1x1x{count}").devices)
    except NotImplementedError:
        raise ValueError(f"--target {target}: jax started its backends, without the CUDA one, before the "
                         f"target was asked for; run with JAX_PLATFORMS=cpu") from None


__all__ = ["MOST_DEVICES", "TARGETS", "devices", "parse", "plugin_missing"]
