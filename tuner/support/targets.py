"""What a program is being built for: the platform and device kind of the devices it will run on.

They can differ from this host's devices: `jax.jit(...).lower(...).compile()` of a `shard_map` over a
TPU topology (`jax.experimental.topologies`, with libtpu installed) builds a TPU program on a CPU host.
Inside `shard_map` the abstract mesh says which devices the program is for; outside, a mesh given by
the caller does, else jax's default devices.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh


def compile_target(mesh: Mesh | None = None) -> tuple[str, str]:
    """(platform, device kind) the program being traced is for: of `mesh` when given, else of the mesh
    of the enclosing `shard_map`, else of jax's default devices ("cpu", "gpu" or "tpu")."""
    if mesh is not None:
        device = mesh.devices.flat[0]
        return device.platform, device.device_kind
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform:
        return device.platform, device.device_kind
    return jax.default_backend(), jax.devices()[0].device_kind


__all__ = ["compile_target"]
