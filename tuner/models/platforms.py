"""The platforms the strategy model ranks on (`tuner.models.strategy_model`): each device's rates, its
memory, and the tiles its ring kernel runs by default.

Rates, per device, one direction (`PLATFORMS`; `Platform` fields override them):
- h100: 989 TFLOP/s dense bf16, 67 TFLOP/s float32 (NVIDIA H100 SXM datasheet); NVLink 4, 900 GB/s
  bidirectional per GPU through NVSwitch, so 450 GB/s to one neighbour and per device in any collective
  (the switch is non-blocking); 80 GB HBM3.
- h200: the H100's rates and links (NVIDIA H200 SXM datasheet: the same 989 TFLOP/s and NVLink 4; its
  faster HBM, 4.8 TB/s against 3.35, is not among these rates); 141 GB HBM3e.
- TPU generations: `tpu_model.CHIPS` (its sources), float32 at 1/6 of the bf16 peak. The ring uses one ICI
  link; an all-gather (or reduce-scatter) uses every port of the torus (bidirectional rings along each
  dimension: 4 ports on the 2-D tori of v5e / v6e, 6 on the 3-D ones of v4 / v5p); an all-to-all injects
  on all of them too but its messages cross about two hops on average (12/7 on a 2x4 torus), so it gets
  half that rate (assumption). HBM: v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB (cloud.google.com/tpu).
- Assumed, not published: efficiency 0.5 of peak for the attention kernels (FlashAttention-2/3 reach
  ~0.35-0.75 of the H100's peak; this repository's kernels 0.4-0.7x cuDNN's), and 10 us (GPU) / 5 us (TPU)
  of latency per collective. cpu: `measure_cpu()`, timed on first use, never at import.
"""

from __future__ import annotations

import dataclasses
import functools
import timeit
from dataclasses import dataclass

import numpy as np

from tuner.kernels import BACKENDS
from tuner.kernels.tpu_memory import GENERATION_TILES
from tuner.kernels.triton import DEFAULTS as TRITON_DEFAULTS
from tuner.models.tpu_model import CHIPS, FLOAT32_PASSES
from tuner.semantics.spec import INT32_MAX

TORUS_PORTS = {"v4": 6, "v5e": 4, "v5p": 6, "v6e": 4}
TPU_MEMORY = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}
EFFICIENCY = 0.5  # assumed fraction of peak the attention kernels reach
_SCAN = BACKENDS["scan"].default_params(INT32_MAX, INT32_MAX, 128)[0]
SCAN_TILES = (_SCAN.block_q, _SCAN.block_kv)  # the scan kernel's, every strategy's where no other kernel runs
SCAN_MASKED_TILE = BACKENDS["scan"].masked_tile  # ... at most this long with a causal, window or chunk mask


@dataclass(frozen=True)
class Platform:
    """Per-device rates of one platform: bf16/fp16 and float32 peak FLOP/s, the fraction of it attention
    reaches, bytes/s to one neighbour and per device in an all-gather (or reduce-scatter) and an
    all-to-all, seconds of latency per collective, device memory in bytes (None: unbounded), and the ring
    kernel's default forward tiles (query, key) there: the granularity at which it skips masked work, and
    the longest of them with a causal, window or chunk mask (the kernel's `masked_tile`; None: the same);
    and whether its compiler builds a reduce-scatter as an all-reduce of the whole buffer (XLA:TPU)."""

    name: str
    flops: float
    flops_f32: float
    efficiency: float
    p2p: float
    all_gather: float
    all_to_all: float
    latency: float = 0.0
    memory: float | None = None
    source: str = ""
    ring_tiles: tuple[int, int] = SCAN_TILES
    ring_masked_tile: int | None = SCAN_MASKED_TILE
    scatter_as_all_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("flops", "flops_f32", "efficiency", "p2p", "all_gather", "all_to_all"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Platform.{name} must be positive, got {getattr(self, name)!r}")
        if not self.latency >= 0 or (self.memory is not None and not self.memory > 0):
            raise ValueError(f"Platform latency must be >= 0 and memory positive or None, got {self!r}")


def _tpu(name: str) -> Platform:
    chip, ports = CHIPS[name], TORUS_PORTS[name]
    fwd = GENERATION_TILES[name][0]
    return Platform(name, chip.flops, chip.flops / FLOAT32_PASSES, EFFICIENCY, chip.ici_link, ports * chip.ici_link,
                    ports * chip.ici_link / 2, 5e-6, TPU_MEMORY[name],
                    f"{chip.source}; collectives over {ports} ports, all-to-all at half (module docstring)",
                    (fwd.block_q, fwd.block_kv), BACKENDS["pallas_tpu"].masked_tile, scatter_as_all_reduce=True)


_H100 = TRITON_DEFAULTS[(90, 128)][0]  # the Triton kernel's sm_90 forward tiles at head dim 128
PLATFORMS = {"h100": Platform("h100", 989e12, 67e12, EFFICIENCY, 450e9, 450e9, 450e9, 10e-6, 80e9,
                              "NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 67 float32, NVLink 4 900 GB/s "
                              f"bidirectional per GPU via NVSwitch, 80 GB; the Triton kernel's sm_90 "
                              f"{_H100.block_q}x{_H100.block_kv} tiles", (_H100.block_q, _H100.block_kv),
                              BACKENDS["triton"].masked_tile),
             **{name: _tpu(name) for name in CHIPS}}
PLATFORMS["h200"] = dataclasses.replace(PLATFORMS["h100"], name="h200", memory=141e9,
                                        source="NVIDIA H200 SXM datasheet: the H100's 989 TFLOP/s dense bf16, 67 "
                                               "float32 and NVLink 4 900 GB/s, 141 GB; the Triton kernel's sm_90 "
                                               f"{_H100.block_q}x{_H100.block_kv} tiles")


@functools.cache
def measure_cpu() -> Platform:
    """This host's rates, measured once (~0.2 s; best of 4 runs each): numpy's float32 matmul FLOP/s
    (512 x 512) as the peak at efficiency 1 for every dtype, and its memcpy bytes/s (32 MiB) as every link,
    since simulated devices exchange by copying within one process. All simulated devices share these
    rates, so absolute times are low by up to the device count; the ranking holds."""
    a = np.ones((512, 512), np.float32)
    flops = 2 * 512**3 / min(timeit.repeat(lambda: a @ a, number=1, repeat=4))
    src = np.ones(8 * 2**20, np.float32)
    dst = np.empty_like(src)
    copy = src.nbytes / min(timeit.repeat(lambda: np.copyto(dst, src), number=1, repeat=4))
    return Platform("cpu", flops, flops, 1.0, copy, copy, copy, 0.0, None, "measured by measure_cpu()")


def get_platform(platform: str | Platform) -> Platform:
    """The `Platform` named `platform` ("h100", "h200", a TPU generation of `tpu_model.CHIPS`, "cpu"), or itself."""
    if isinstance(platform, Platform):
        return platform
    if platform == "cpu":
        return measure_cpu()
    if not isinstance(platform, str) or platform not in PLATFORMS:
        raise ValueError(f"platform must be a Platform or one of {', '.join([*PLATFORMS, 'cpu'])}, got {platform!r}")
    return PLATFORMS[platform]


__all__ = ["EFFICIENCY", "PLATFORMS", "Platform", "get_platform", "measure_cpu"]
