"""The block kernels: every implementation of the block contract (`tuner.backends.base`).

Each one computes attention between one block of queries and one block of keys; `tuner.ring` runs one
under its ring driver, and `tuner.implementations` registers that ring as an implementation of the same
name. Choosing among implementations is `tuner.registry`'s job.
"""

from __future__ import annotations

from tuner.backends.base import Backend
from tuner.backends.pallas_tpu import PallasTpuBackend
from tuner.backends.scan import ScanBackend
from tuner.backends.triton import TritonBackend

BACKENDS: dict[str, Backend] = {"scan": ScanBackend(), "triton": TritonBackend(),
                                 "pallas_tpu": PallasTpuBackend()}


def check_vma(name: str, interpret: bool) -> bool:
    """Whether a `shard_map` around a ring of backend `name` can keep its varying-axes check: Pallas's
    interpreter (jax 0.10) evaluates scalar-prefetch index maps without it, so interpreted pallas_tpu
    kernels need `check_vma=False`."""
    return not (interpret and name == "pallas_tpu")


__all__ = ["BACKENDS", "Backend", "check_vma"]
