"""An analytic time model of the pallas_tpu ring on a TPU generation: how `tuner search --dry-run
--target` ranks the variants the TPU compiler accepted, where nothing can be timed. Inside all_to_all,
all_gather and the hybrid over the Pallas kernel it times the kernel's ring on what the exchange gathered
(`tiles.visited` of the strategy, on `registry.tile_shapes`); the exchange itself is not timed.

For every ring step and every device, `tuner.models.tiles.visited` says which tile pairs the kernels
visit; a masked pair costs as much as a full one (the MXU computes the whole tile). A step's kernel
time is the larger of its FLOPs over the chip's peak and its HBM bytes over the chip's bandwidth, plus
a fixed cost per grid iteration (every iteration of the grid runs, visited or not); the step takes the
larger of that and the time the step's transfers need over one ICI link; the ring waits for its
slowest device at every step. Segment ids are not modelled (the schedule is that of the positions
alone: an upper bound when documents would let tiles be skipped).

Rates are the published per-chip figures (`CHIPS`, each with its source); what is assumed rather than
published says so. The model ranks tiles against each other on one chip; its absolute times are
estimates, never measurements, and are stored as such (source `compiled`). A search on a TPU starts
from the model's fastest configs after the neighbours' (`ranked`, `tuner.tuning.warm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from tuner import registry
from tuner.kernels import tpu_memory
from tuner.models import tiles
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem

GRID_STEP_S = 0.35e-6  # assumed cost of one Pallas grid iteration on a TPU (pipeline bookkeeping, DMA issue)
MODELLED = "pallas_tpu"  # the implementation whose kernels the model times
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
    """The model's time of one pass of the ring, and what it is made of: FLOPs and HBM bytes summed
    over the ring's steps for the slowest device of each step, the bytes every device sends, and the
    grid iterations of the kernel calls of every device."""

    seconds: float
    flops: float
    hbm_bytes: float
    ici_bytes: float
    grid_steps: int


@dataclass(frozen=True)
class _Kernel:
    """One kernel over the ring: per (step, device) its FLOPs and HBM bytes, and its grid iterations."""

    flops: np.ndarray
    hbm: np.ndarray
    grid: int

    def seconds(self, chip: Chip, peak: float) -> np.ndarray:
        """Per (step, device): the larger of compute and memory time, plus the grid's fixed cost; 0 on a
        step the ring skips (no visited tile: the kernel is not called)."""
        busy = np.maximum(self.flops / peak, self.hbm / chip.hbm) + self.grid * GRID_STEP_S
        return np.where(self.flops > 0, busy, 0.0)


def predict(problem: Problem, chip: Chip, fwd: FwdParams | None = None, bwd: BwdParams | None = None,
            implementation: str = MODELLED) -> Prediction:
    """The model's time of the forward ring with `fwd` tiles, or of the backward ring with `bwd` tiles
    (exactly one of them), on `problem` over chips of kind `chip`: the ring `implementation` runs over the
    `MODELLED` kernel, on the shapes that kernel runs there (`registry.tile_shapes`). For all_to_all,
    all_gather and the hybrid that is the kernel's ring after the exchange; the exchange's own collectives
    are not timed (they cost the same whatever the tiles)."""
    if (fwd is None) == (bwd is None):
        raise ValueError("predict() takes fwd or bwd params, exactly one of them")
    shapes, strategy = tiles.inside(problem, implementation, MODELLED)
    b, h, hkv, d = shapes.batch, shapes.heads, shapes.kv_heads, shapes.head_dim
    tq, tk = shapes.q_len, shapes.kv_len
    item = jnp.dtype(problem.dtype).itemsize
    peak = chip.flops / (FLOAT32_PASSES if problem.dtype == "float32" else 1)
    steps = tiles.steps(problem, strategy)  # a ring's; one where the exchange gathered the whole sequence
    shard = b * tk * (2 * hkv * d * item + 4) if steps > 1 else 0  # the k and v shards and their positions

    def kernel(block_q: int, block_kv: int, matmuls: int, tile_bytes: int, row_bytes: int, rows: int) -> _Kernel:
        """A kernel of `matmuls` [bq, bk, d] products per visited tile pair and head, reading
        `tile_bytes` per pair and `row_bytes` per token of `rows` (its queries or its keys) and head once."""
        pairs = tiles.visited(problem, block_q, block_kv, strategy) * b * h
        grid = b * h * -(-tq // block_q) * -(-tk // block_kv)
        return _Kernel(pairs * 2.0 * matmuls * block_q * block_kv * d,
                       pairs * float(tile_bytes) + b * h * rows * d * row_bytes, grid)

    if fwd is not None:  # s = q k^T, o += p v: the key tile's k and v per pair; q in, o (float32) out
        bq, bk = min(fwd.block_q, tq), min(fwd.block_kv, tk)
        kernels = [kernel(bq, bk, 2, 2 * bk * d * item, item + 4, tq)]
        ici = shard
    else:  # dK/dV: s, dp, dv, dk (q and do tiles per pair; k, v in, dk, dv out per key); dQ: s, dp, dq
        dkv_q, dkv_kv = min(bwd.block_q_dkv, tq), min(bwd.block_kv_dkv, tk)
        dq_q, dq_kv = min(bwd.block_q_dq, tq), min(bwd.block_kv_dq, tk)
        kernels = [kernel(dkv_q, dkv_kv, 4, 2 * dkv_q * d * item, 2 * (item + 4), tk),
                   kernel(dq_q, dq_kv, 3, 2 * dq_kv * d * item, 2 * item + 4, tq)]
        ici = shard + (b * tk * 2 * hkv * d * 4 if steps > 1 else 0)  # and the dk, dv accumulators, float32
    kernel_s = sum(k.seconds(chip, peak) for k in kernels)
    step_s = np.maximum(kernel_s, ici / chip.ici_link).max(axis=1)  # each step waits for its slowest device
    slowest = kernel_s.argmax(axis=1)
    every = np.arange(steps)
    return Prediction(float(step_s.sum()), float(sum(k.flops[every, slowest].sum() for k in kernels)),
                      float(sum(k.hbm[every, slowest].sum() for k in kernels)), float(ici * steps),
                      sum(k.grid * int((k.flops > 0).sum()) for k in kernels))


def ranked(problem: Problem, device_kind: str, implementation: registry.Implementation, space: registry.Space,
           default: registry.Config, parts: tuple[str, ...]) -> list[tuple[float, registry.Config]]:
    """(predicted seconds, config) of the points of `space` whose `parts` `implementation` admits (their
    other parts `default`'s), fastest first, on chips of `device_kind`; for a forward and backward space,
    the i-th fastest forward with the i-th fastest backward. Empty where the model does not time this
    implementation (it models the rings over the `MODELLED` kernel: its ring and the strategies' rings over it)
    or has no rates for this device kind."""
    chip = CHIPS.get(tpu_memory.CHIPS.get(device_kind, ""))
    if getattr(implementation, "engine", None) != MODELLED or chip is None:
        return []
    shapes, by_part = registry.problem_tile_shapes(implementation, problem), []
    for part in parts:
        admitted = [c for c in space.grid(default, (part,))
                    if implementation.violation(shapes, problem.spec, c, (part,)) is None]
        timed = ((predict(problem, chip, **{part: getattr(c, part)}, implementation=implementation.name).seconds, c)
                 for c in admitted)
        by_part.append(sorted(timed, key=lambda pair: pair[0]))
    if len(by_part) == 1:
        return by_part[0]
    return [(f[0] + b[0], registry.combine(implementation, f[1], b[1])) for f, b in zip(*by_part)]


__all__ = ["CHIPS", "Chip", "GRID_STEP_S", "MODELLED", "Prediction", "predict", "ranked"]
