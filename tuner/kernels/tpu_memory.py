"""What a TPU chip holds, for the Pallas kernels: the chip a program is built for, the scoped VMEM the
kernels ask for, an estimate of each kernel's VMEM (fitted to the production compiler's reports), and
the default tiles of each generation (chosen from compile results) fitted to the chip's VMEM."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from tuner.kernels.params import BwdParams, FwdParams
from tuner.support.targets import compile_target

LANES, SUBLANES = 128, 8
DEFAULT_CHIP = "v5e"  # what the constraints assume without a TPU; TUNER_TPU_CHIP overrides
# Default tiles where no generation has its own: 512-query tiles against 1024-key tiles computed 512 at a
# time, 512x512 backward tiles -- the range TPU flash kernels use.
FALLBACK_TILES = (FwdParams(block_q=512, block_kv=1024, block_kv_compute=512),
                  BwdParams(block_q_dkv=512, block_kv_dkv=512, block_q_dq=512, block_kv_dq=512))
# Per generation, chosen from compile results by `python benchmarks/tpu/tpu_defaults.py`
# (benchmarks/tpu/results/tpu_defaults.json): among the tiles the production compiler accepted for bf16 at
# D=128 and the VMEM estimate admits for float32, the analytic model's fastest on a causal 32k ring of 4.
# Not measured on a TPU.
GENERATION_TILES: dict[str, tuple[FwdParams, BwdParams]] = {
    "v4": (FwdParams(block_q=512, block_kv=1024, block_kv_compute=256),
           BwdParams(block_q_dkv=256, block_kv_dkv=512, block_q_dq=256, block_kv_dq=512)),
    **{generation: (FwdParams(block_q=1024, block_kv=2048, block_kv_compute=512),
                    BwdParams(block_q_dkv=1024, block_kv_dkv=1024, block_q_dq=1024, block_kv_dq=1024))
       for generation in ("v5e", "v5p", "v6e")},
}
# Each kernel's VMEM estimate as multiples of the terms of `vmem_terms` (held blocks, float32 tile, row
# block, column block), fitted by `python benchmarks/tpu/tpu_vmem_fit.py` so that it bounds what the
# production compiler reports over the tile space of v4, v5e, v5p and v6e, kernels alone and inside the
# ring (benchmarks/tpu/results/tpu_vmem_kernels.jsonl, tpu_vmem.json).
VMEM_MULTIPLES: dict[tuple[str, str], tuple[float, float, float, float]] = {
    ("fwd", "bfloat16"): (0.95, 1.25, 4.25, 0.25), ("fwd", "float32"): (1.0, 3.75, 2.25, 3.0),
    ("dkv", "bfloat16"): (0.0, 1.25, 7.75, 8.5), ("dkv", "float32"): (0.0, 4.25, 12.5, 9.75),
    ("dq", "bfloat16"): (0.0, 0.5, 11.5, 5.75), ("dq", "float32"): (0.0, 3.75, 10.75, 7.25),
}


CHIPS = {"TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v4 lite": "v4i", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
         "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "7x"}  # device kind


def chip() -> Any:
    """`pltpu.TpuInfo` of the TPU the program is built for: the chip of the mesh being traced
    (`tuner.support.targets.compile_target`: a TPU present, or a topology compiled for with libtpu), else
    `$TUNER_TPU_CHIP` (default v5e) -- what the search's constraints assume on a host without one."""
    from jax.experimental.pallas import tpu as pltpu

    platform, device_kind = compile_target()
    if platform == "tpu":
        if jax.default_backend() == "tpu" and jax.devices()[0].device_kind == device_kind:
            return pltpu.get_tpu_info()  # the TPU present
        if device_kind not in CHIPS:
            raise ValueError(f"TPU device kind {device_kind!r} is not one ring-tuner knows ({', '.join(CHIPS)})")
        name = CHIPS[device_kind]
    else:
        name = os.environ.get("TUNER_TPU_CHIP", DEFAULT_CHIP)
    return chip_info(name, "TUNER_TPU_CHIP")


def chip_info(name: str, argument: str = "name") -> Any:
    """`pltpu.TpuInfo` of the chip generation `name` ("v5e", ...); `ValueError` naming `argument`."""
    from jax.experimental.pallas import tpu as pltpu

    try:
        version = pltpu.ChipVersion(name)
    except ValueError:
        known = ", ".join(v.value for v in pltpu.ChipVersion)
        raise ValueError(f"{argument} must be one of {known}, got {name!r}") from None
    return pltpu.get_tpu_info_for_chip(version, 1)


def vmem_limit_bytes(info: Any = None) -> int:
    """The scoped VMEM the kernels ask Mosaic for: half the VMEM of the chip (`info`, default `chip()`);
    the rest stays for Mosaic's own scratch and what the estimate leaves out."""
    return (info or chip()).vmem_capacity_bytes // 2


def _rows(n: int, width: int, itemsize: int) -> int:
    """VMEM bytes of an `[n, width]` buffer: the minor dim pads to 128 lanes, the other to 8 sublanes."""
    return -(-n // SUBLANES) * SUBLANES * -(-width // LANES) * LANES * itemsize


def vmem_terms(kernel: str, block_q: int, block_kv: int, head_dim: int, dtype: Any, ids: int,
               block_kv_compute: int | None = None, *, value_head_dim: int | None = None) -> tuple[int, int, int, int]:
    """The VMEM bytes one kernel's estimate is a combination of (`VMEM_MULTIPLES`): its input and output
    blocks double-buffered with its scratch ("held"; the forward reads and writes the running output and
    lse, the dk/dv kernel reads the running dk and dv in one buffer each); a float32 `[block_q, block_kv]` tile (the
    forward's `[block_q, block_kv_compute]` key slice); a float32 `[block_q, head_dim]` row block; a
    float32 `[block_kv, head_dim]` (the forward: slice) column block.

    With a `value_head_dim` (None: `head_dim`), the held blocks of values, of the output and of its
    gradient are that wide, and the row and column blocks are those of the wider of the two dims: the
    multiples were fitted with equal dims, so each stands for temporaries of either kind. At D=192,
    Dv=128 this bounds the compiler's reports over the tile space of v5e and v4 (bf16 and float32),
    which the mean of the two dims does not."""
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    item = jnp.dtype(dtype).itemsize
    q_rows, kv_rows = _rows(block_q, head_dim, item), _rows(block_kv, head_dim, item)
    do_rows, v_rows = _rows(block_q, value_head_dim, item), _rows(block_kv, value_head_dim, item)
    ids_bytes = _rows(block_q, ids, 4) + _rows(ids, block_kv, 4)
    stats = _rows(1, block_q, 4)  # a row statistic's block, a lane-dense row
    if kernel == "fwd":
        running = _rows(block_q, value_head_dim, 4) + stats  # the running output and lse, in and out
        inputs = q_rows + kv_rows + v_rows + ids_bytes + running
        held = 2 * (inputs + running) + 2 * _rows(block_q, 1, 4)  # and the m and l columns
    else:
        inputs = q_rows + do_rows + kv_rows + v_rows + 2 * stats + ids_bytes
        if kernel == "dkv":
            outputs = _rows(block_kv, head_dim, 4) + _rows(block_kv, value_head_dim, 4)
            held = 2 * (inputs + outputs) + outputs  # the running dk and dv read, one buffer each
        else:
            outputs = _rows(block_q, head_dim, 4)
            inputs += outputs  # the running dq, read and written
            held = 2 * (inputs + outputs)
    cols = (block_kv_compute or block_kv) if kernel == "fwd" else block_kv
    wide = max(head_dim, value_head_dim)
    return held, _rows(block_q, cols, 4), _rows(block_q, wide, 4), _rows(cols, wide, 4)


def vmem_bytes(kernel: str, block_q: int, block_kv: int, head_dim: int, dtype: Any, ids: int,
               block_kv_compute: int | None = None, *, value_head_dim: int | None = None,
               multiples: tuple[float, ...] | None = None) -> int:
    """An estimate of one kernel's VMEM: `multiples` (default `VMEM_MULTIPLES`, fitted to the compiler's
    reports) of the terms of `vmem_terms` (values `value_head_dim` wide; None: `head_dim`)."""
    multiples = multiples if multiples is not None else VMEM_MULTIPLES[(kernel, jnp.dtype(dtype).name)]
    terms = vmem_terms(kernel, block_q, block_kv, head_dim, dtype, ids, block_kv_compute,
                       value_head_dim=value_head_dim)
    return math.ceil(sum(m * t for m, t in zip(multiples, terms)))


def fitted_tiles(kernel: str, block_q: int, block_kv: int, head_dim: int, limit: int,
                 compute: int | None = None, *, value_head_dim: int | None = None) -> tuple[int, int]:
    """`(block_q, block_kv)` halved, the longer first, until the kernel's VMEM estimate for float32 at
    `head_dim` and `value_head_dim` (None: `head_dim`; every id column) fits `limit`, or both are at the
    smallest TPU tile."""
    def estimate(q: int, kv: int) -> int:
        return vmem_bytes(kernel, q, kv, head_dim, jnp.float32, 3, min(compute, kv) if compute else None,
                          value_head_dim=value_head_dim)

    while estimate(block_q, block_kv) > limit and max(block_q, block_kv) > LANES:
        if block_kv >= block_q:
            block_kv //= 2
        else:
            block_q //= 2
    return block_q, block_kv


__all__ = ["CHIPS", "DEFAULT_CHIP", "FALLBACK_TILES", "GENERATION_TILES", "LANES", "SUBLANES", "VMEM_MULTIPLES",
           "chip", "chip_info", "fitted_tiles", "vmem_bytes", "vmem_limit_bytes", "vmem_terms"]
