"""Block kernels: one query block against one key block, forward and backward, for the ring to call
(`scan` in jax, `triton`, `pallas_tpu` rendered from `templates/` by `codegen`, `cudnn` over cuDNN's fused
attention or its XLA twin; the contract is `base`),
with their tiles (`params`), search spaces and constraints. `tuner.strategies.ring` runs one under its
ring driver, registered as an implementation of the same name. Imports `support` and `semantics` only.
"""

from __future__ import annotations

from tuner.kernels.base import Backend
from tuner.kernels.cudnn import CudnnBackend
from tuner.kernels.pallas_tpu import PallasTpuBackend
from tuner.kernels.scan import ScanBackend
from tuner.kernels.triton import TritonBackend

BACKENDS: dict[str, Backend] = {"scan": ScanBackend(), "triton": TritonBackend(),
                                 "pallas_tpu": PallasTpuBackend(), "cudnn": CudnnBackend()}


def check_vma(name: str, interpret: bool) -> bool:
    """Whether a `shard_map` around a ring of backend `name` can keep its varying-axes check: Pallas's
    interpreter (jax 0.10) evaluates scalar-prefetch index maps without it, so interpreted pallas_tpu
    kernels need `check_vma=False`."""
    return not (interpret and name == "pallas_tpu")


__all__ = ["BACKENDS", "Backend", "check_vma"]
