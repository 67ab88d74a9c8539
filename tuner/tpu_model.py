"""An analytic time model of the pallas_tpu ring on a TPU generation: how `tuner search --dry-run
--target` ranks the variants the TPU compiler accepted, where nothing can be timed.

For every ring step and every device, the tile schedule the kernels run (`tuner.masks.tile_schedule`
on the positions the layout gives that device and the shard visiting it) says which tile pairs are
visited; a masked pair costs as much as a full one (the MXU computes the whole tile). A step's kernel
time is the larger of its FLOPs over the chip's peak and its HBM bytes over the chip's bandwidth, plus
a fixed cost per grid iteration (every iteration of the grid runs, visited or not); the step takes the
larger of that and the time the step's transfers need over one ICI link; the ring waits for its
slowest device at every step. Segment ids are not modelled (the schedule is that of the positions
alone: an upper bound when documents would let tiles be skipped).

Rates are the published per-chip figures (`CHIPS`, each with its source); what is assumed rather than
published says so. The model ranks tiles against each other on one chip; its absolute times are
estimates, never measurements, and are stored as such (source `compiled`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from tuner import layouts, masks
from tuner.params import BwdParams, FwdParams
from tuner.problem import Problem

GRID_STEP_S = 0.35e-6  # assumed cost of one Pallas grid iteration on a TPU (pipeline bookkeeping, DMA issue)
FLOAT32_PASSES = 6  # float32 matmuls at HIGHEST precision run as 6 bf16 passes (jax.lax.Precision docs)


@dataclass(frozen=True)
class Chip:
    """Peak rates of one TPU chip: bf16 FLOP/s, HBM bytes/s, and bytes/s of one ICI link in one
    direction (the ring sends each step's shard to one neighbour)."""

    name: str
    flops: float
    hbm: float
    ici_link: float
    source: str


CHIPS = {
    "v4": Chip("v4", 275e12, 1200e9, 4800e9 / 8 / 6 / 2,
               "cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 1200 GBps HBM; that page gives no ICI rate, so the "
               "link is assumed to be v5p's"),
    "v5e": Chip("v5e", 197e12, 819e9, 400e9 / 4 / 2,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 819 GBps HBM, 400 GBps bidirectional ICI per chip "
                "over 4 ports"),
    "v5p": Chip("v5p", 459e12, 2765e9, 4800e9 / 8 / 6 / 2,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 2765 GBps HBM, 4800 Gbps ICI per chip, taken as "
                "both directions over 6 ports (3-D torus)"),
    "v6e": Chip("v6e", 918e12, 1638e9, 800e9 / 4 / 2,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 1638 GBps HBM, 800 GBps bidirectional ICI per chip "
                "over 4 ports"),
}


@dataclass(frozen=True)
class Prediction:
    """The model's time of one pass of the ring, and what it is made of (summed over the ring's steps,
    for the slowest device of each step)."""

    seconds: float
    flops: float
    hbm_bytes: float
    ici_bytes: float
    grid_steps: int


@functools.lru_cache(maxsize=256)
def _visited(problem: Problem, block_q: int, block_kv: int, by_key: bool) -> np.ndarray:
    """Visited tile pairs per (step, device) of the ring: `[ring_size, ring_size]`."""
    p, t = problem.ring_size, problem.local_len
    positions = [jnp.broadcast_to(layouts.local_positions(problem.layout, t, p, r), (1, t)) for r in range(p)]
    counts = np.zeros((p, p), np.int64)
    for step in range(p):
        for device in range(p):
            schedule = masks.tile_schedule(positions[device], positions[(device - step) % p], None, None,
                                           problem.spec, block_q, block_kv, by_key=by_key)
            counts[step, device] = int(schedule.count.sum())
    return counts


def _ring_time(kernel_s: np.ndarray, ici_s: float) -> float:
    """Steps of the ring: each takes its slowest device's kernel, or its transfer when longer."""
    return float(np.maximum(kernel_s, ici_s).max(axis=1).sum())


def predict(problem: Problem, chip: Chip, fwd: FwdParams | None = None, bwd: BwdParams | None = None) -> Prediction:
    """The model's time of the forward ring with `fwd` tiles, or of the backward ring with `bwd` tiles
    (exactly one of them), on `problem` over chips of kind `chip`."""
    if (fwd is None) == (bwd is None):
        raise ValueError("predict() takes fwd or bwd params, exactly one of them")
    b, h, hkv, d, t = problem.batch, problem.heads, problem.kv_heads, problem.head_dim, problem.local_len
    item = jnp.dtype(problem.dtype).itemsize
    peak = chip.flops / (FLOAT32_PASSES if problem.dtype == "float32" else 1)
    nq = lambda block: -(-t // block)  # noqa: E731 - tiles per local length
    if fwd is not None:
        bq, bk = min(fwd.block_q, t), min(fwd.block_kv, t)
        pairs = _visited(problem, bq, bk, by_key=False) * b * h
        flops = pairs * 4.0 * bq * bk * d
        hbm = pairs * 2.0 * bk * d * item + b * h * nq(bq) * bq * d * (item + 4)
        grid = b * h * nq(bq) * nq(bk)
        ici = b * t * (2 * hkv * d * item + 4)
    else:
        kernels = []
        for bq, bk, by_key, per_pair, tile_bytes, rows in (
                (bwd.block_q_dkv, bwd.block_kv_dkv, True, 8.0, lambda bq, bk: 2 * bq * d * item, 2 * (item + 4)),
                (bwd.block_q_dq, bwd.block_kv_dq, False, 6.0, lambda bq, bk: 2 * bk * d * item, 2 * item + 4)):
            bq, bk = min(bq, t), min(bk, t)
            pairs = _visited(problem, bq, bk, by_key=by_key) * b * h
            kernels.append((pairs * per_pair * bq * bk * d, pairs * tile_bytes(bq, bk) + b * h * t * d * rows,
                            b * h * nq(bq) * nq(bk)))
        flops = sum(k[0] for k in kernels)
        hbm = sum(k[1] for k in kernels)
        grid = sum(k[2] for k in kernels)
        ici = b * t * (2 * hkv * d * item + 4) + b * t * 2 * hkv * d * 4  # k, v, positions; dk, dv in float32
    visits = flops > 0
    kernel_s = np.where(visits, np.maximum(flops / peak, hbm / chip.hbm) + grid * GRID_STEP_S, 0.0)
    ici_s = ici / chip.ici_link
    return Prediction(_ring_time(kernel_s, ici_s), float(np.asarray(flops).max(axis=1).sum()),
                      float(np.asarray(hbm).max(axis=1).sum()), float(ici * problem.ring_size),
                      int(grid * visits.sum()))


__all__ = ["CHIPS", "Chip", "GRID_STEP_S", "Prediction", "predict"]
