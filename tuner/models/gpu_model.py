"""A roofline model of the Triton kernels on an NVIDIA GPU: how `tuner search --device gpu --dry-run
--target` ranks the variants the compiler builds without spilling, where nothing can be timed.

One kernel launch (forward, dK/dV or dQ) per ring step and device does, for each tile pair it visits
(`tuner.models.tiles.visited`) and each head:

- matrix products: 2 * block_q * block_kv FLOPs per inner dim, the head dims padded to the powers of
  two the kernel computes on (forward q.k and p.v; dK/dV q.k, do.v, p.do, ds.q; dQ q.k, do.v, ds.k);
- one exponential per score (the GPU's special-function units: 16 per clock per SM on sm_80 to
  sm_100, CUDA C++ Programming Guide, "Arithmetic Instructions");
- `ALU_OPS` other float32 operations per score (forward: scale, row max, subtraction, row sum,
  conversion; the backward's kernels subtract the statistics, take the softmax's derivative and convert
  twice; assumed from the kernels' code, whose scale carries log2(e) for `exp2`), and in the forward the
  rescaling of the accumulator, one multiply per value column per row;
- shared-memory traffic: each product's second operand read from shared memory, once per warp that
  holds a slice of the first one's rows for mma.sync, once per warpgroup for wgmma, once per block for
  sm_100's tcgen05 (shared memory serves 128 bytes per clock per SM);
- HBM traffic: the other operand's tiles per pair, and each token's own rows, outputs and statistics
  once;
- a fixed `ITERATION_CYCLES` per tile pair (assumed), and with one stage (no software pipelining of the
  loads) `LOAD_LATENCY_CYCLES` more, both overlapped across the blocks resident on an SM.

The products run at the tensor-core rate when the compiler used the architecture's tensor-core path
(`tensor_core` in the verdict), at `legacy` of it on mma.sync where that is not the path, and at the
CUDA cores' float32 rate for float32 inputs (the kernels compute those at full precision), and no
faster than shared memory feeds them. Compute time is that, plus the exponentials, the other float32
operations and the iterations' fixed cost (Triton's schedule does not overlap them; assumed), divided
by the utilization: the share of the GPU's block slots the grid fills in its last wave, times the
resident warps per SM over `SATURATING_WARPS` (at most 1). A launch takes the larger of its compute
time and its HBM time; the ring waits for its slowest device at every step. Transfers between devices
do not depend on the tiles and are not modelled. Inside all_to_all, all_gather and the hybrid over the
Triton kernel the ring is the kernel's on what the exchange gathered (`tiles.visited` of the strategy).

Rates are the published per-GPU figures (`GPUS`, each with its source); what is assumed says so. The
model ranks variants against each other on one GPU; its times are estimates, never measurements, and
are stored as such (source `compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from tuner.kernels.triton_launch import pow2_at_least
from tuner.models import tiles
from tuner.semantics.problem import Problem

SFU_PER_CLOCK = 16  # exponentials per clock per SM on sm_80, sm_86, sm_89, sm_90, sm_100
SHARED_BYTES_PER_CLOCK = 128  # shared-memory bandwidth per SM: 32 banks of 4 bytes per clock
ITERATION_CYCLES = 200  # assumed: a tile iteration's fixed cost (barriers, MMA waits, pipeline bookkeeping)
LOAD_LATENCY_CYCLES = 600  # assumed: a global load's latency, exposed per tile iteration without pipelining
SATURATING_WARPS = 8  # assumed: resident warps per SM that keep its tensor cores busy
ALU_OPS = {"attention_fwd": 5, "attention_dkv": 7, "attention_dq": 6}  # assumed float32 operations per score
KERNELS = tuple(ALU_OPS)
MODELLED = "triton"  # the kernel the model times, in its ring and in the implementations over it


@dataclass(frozen=True)
class Gpu:
    """One GPU's published rates: dense bf16/fp16 tensor-core FLOP/s, CUDA-core float32 FLOP/s, HBM
    bytes/s, SMs and boost clock; `legacy`: the share of the tensor rate that mma.sync reaches where the
    architecture's own path is another (assumed)."""

    name: str
    arch: int
    device_kind: str
    tensor: float
    fp32: float
    hbm: float
    sms: int
    clock: float
    legacy: float
    source: str

    @property
    def sfu(self) -> float:
        """Exponentials per second."""
        return self.sms * SFU_PER_CLOCK * self.clock

    @property
    def shared(self) -> float:
        """Shared-memory bytes per second over all SMs."""
        return self.sms * SHARED_BYTES_PER_CLOCK * self.clock


GPUS = {
    "a100": Gpu("a100", 80, "NVIDIA A100-SXM4-80GB", 312e12, 19.5e12, 2039e9, 108, 1.41e9, 1.0,
                "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense bf16, 19.5 float32, 2039 GB/s; 108 SMs at "
                "1410 MHz (A100 whitepaper); mma.sync is its tensor-core path"),
    "h100": Gpu("h100", 90, "NVIDIA H100 80GB HBM3", 989e12, 67e12, 3350e9, 132, 1.98e9, 0.6,
                "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 67 float32, 3.35 TB/s; 132 SMs at 1980 MHz "
                "(H100 whitepaper); mma.sync assumed at 0.6 of wgmma"),
    "h200": Gpu("h200", 90, "NVIDIA H200", 989e12, 67e12, 4800e9, 132, 1.98e9, 0.6,
                "NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 67 float32, 4.8 TB/s; the H100's 132 SMs at "
                "1980 MHz; mma.sync assumed at 0.6 of wgmma"),
    "b200": Gpu("b200", 100, "NVIDIA B200", 2250e12, 75e12, 8000e9, 148, 1.965e9, 0.3,
                "NVIDIA HGX B200 datasheet, per GPU: 4.5 PFLOP/s bf16 with sparsity (2.25 dense), 75 TFLOP/s "
                "float32, 8 TB/s; 148 SMs at 1965 MHz; mma.sync assumed at the H100's rate per SM (0.3 of "
                "tcgen05)"),
}


@dataclass(frozen=True)
class Prediction:
    """The model's time of one kernel over the ring, and what it is made of (summed over the steps, for
    the slowest device of each): FLOPs of the products, exponentials, other float32 operations, HBM
    bytes; and the utilization the verdict implies."""

    seconds: float
    flops: float
    exps: float
    alu: float
    hbm_bytes: float
    utilization: float

    @property
    def tflops(self) -> float:
        """The products' TFLOP/s at the model's time."""
        return self.flops / self.seconds / 1e12 if self.seconds else 0.0


def matmul_rate(gpu: Gpu, dtype: str, verdict: dict[str, Any]) -> float:
    """FLOP/s of the products: the CUDA cores for float32 inputs or without any MMA, the tensor cores on
    the architecture's path, `legacy` of them on mma.sync where that is not the path."""
    if dtype == "float32" or verdict.get("mma") in (None, "none"):
        return gpu.fp32
    return gpu.tensor if verdict.get("tensor_core") else gpu.tensor * gpu.legacy


def operand_reads(mma: str | None, warps: int, rows: int) -> int:
    """How many times a product's shared-memory operand is read per tile: once per warp along the
    `rows` of the register operand for mma.sync (16 rows each), once per warpgroup for wgmma (64 rows
    each), once for tcgen05 (and for products without an MMA, which read it as mma.sync would)."""
    if mma is not None and mma.startswith("UTC"):
        return 1
    if mma is not None and mma.endswith("GMMA"):
        return max(1, min(warps // 4, rows // 64))
    return max(1, min(warps, rows // 16))


def utilization(gpu: Gpu, programs: int, verdict: dict[str, Any]) -> float:
    """The share of the GPU's throughput the launch can use: the last wave's fill of the block slots
    (SMs x resident blocks per SM) times resident warps per SM over `SATURATING_WARPS`."""
    blocks = verdict.get("blocks_per_sm") or 0
    if blocks <= 0:
        return 0.0
    slots = gpu.sms * blocks
    fill = programs / (-(-programs // slots) * slots)
    return fill * min(1.0, verdict["warps_per_sm"] / SATURATING_WARPS)


def predict(problem: Problem, gpu: Gpu, kernel: str, block_q: int, block_kv: int, num_warps: int, num_stages: int,
            verdict: dict[str, Any], implementation: str = MODELLED) -> Prediction:
    """The model's time of `kernel` ("attention_fwd", "attention_dkv" or "attention_dq") with tiles
    `block_q` x `block_kv`, `num_warps` warps and `num_stages` stages over the ring of `problem` on `gpu`,
    given the compiler's `verdict` for it (`tuner.kernels.triton_compile.resources`: the MMA family, the
    tensor-core path, resident blocks and warps). The ring is the one `implementation` runs over the
    `MODELLED` kernel, on the shapes that kernel runs there (`registry.tile_shapes`): inside all_to_all,
    all_gather and the hybrid, the kernel's ring on what the exchange gathered."""
    if kernel not in ALU_OPS:
        raise ValueError(f"kernel must be one of {', '.join(ALU_OPS)}, got {kernel!r}")
    shapes, strategy = tiles.inside(problem, implementation, MODELLED)
    b, h, hkv, tq, tk = shapes.batch, shapes.heads, shapes.kv_heads, shapes.q_len, shapes.kv_len
    d, dv = shapes.head_dim, shapes.value_dim
    dp, dvp = pow2_at_least(d), pow2_at_least(dv)
    item = jnp.dtype(problem.dtype).itemsize
    bq, bk = min(block_q, pow2_at_least(tq)), min(block_kv, pow2_at_least(tk))
    pairs = tiles.visited(problem, bq, bk, strategy).astype(np.float64) * b * h
    scores = pairs * bq * bk
    if kernel == "attention_fwd":  # s = q k^T, o += p v; k and v tiles per pair; q in, o (float32) and lse out
        inner, alu = dp + dvp, scores * ALU_OPS[kernel] + pairs * bq * dvp
        shared = pairs * bk * (dp + dvp) * item * operand_reads(verdict.get("mma"), num_warps, bq)
        hbm = pairs * bk * (d + dv) * item + b * h * tq * (d * item + dv * 4 + 4)
        programs = b * h * -(-tq // bq)
    elif kernel == "attention_dkv":  # s, dp, dv += p^T do, dk += ds^T q; q, do, lse, delta per pair; k, v once
        inner, alu = 2 * (dp + dvp), scores * ALU_OPS[kernel]
        shared = pairs * 2 * bq * (dp + dvp) * item * operand_reads(verdict.get("mma"), num_warps, bk)
        hbm = pairs * bq * ((d + dv) * item + 8) + b * hkv * tk * (d + dv) * (item + 4)
        programs = b * hkv * -(-tk // bk)
    else:  # s, dp, dq += ds k; k and v tiles per pair; q, do, lse, delta in and dq (float32) out once
        inner, alu = 2 * dp + dvp, scores * ALU_OPS[kernel]
        shared = pairs * bk * (2 * dp + dvp) * item * operand_reads(verdict.get("mma"), num_warps, bq)
        hbm = pairs * bk * (d + dv) * item + b * h * tq * ((d + dv) * item + 8 + d * 4)
        programs = b * h * -(-tq // bq)
    flops = 2.0 * scores * inner
    use = utilization(gpu, programs, verdict)
    if use <= 0:
        raise ValueError(f"{kernel} {bq}x{bk}: no block fits an SM ({verdict.get('limited_by')}); the "
                         f"model ranks only runnable variants")
    products = np.maximum(flops / matmul_rate(gpu, problem.dtype, verdict), shared / gpu.shared)
    cycles = ITERATION_CYCLES + (LOAD_LATENCY_CYCLES if num_stages < 2 else 0)
    iterations = pairs * cycles / (gpu.clock * gpu.sms * verdict["blocks_per_sm"])
    compute = (products + scores / gpu.sfu + alu / (gpu.fp32 / 2) + iterations) / use
    busy = np.where(pairs > 0, np.maximum(compute, hbm / gpu.hbm), 0.0)
    slowest = busy.argmax(axis=1)
    steps = np.arange(tiles.steps(problem, strategy))
    return Prediction(float(busy.max(axis=1).sum()), float(flops[steps, slowest].sum()),
                      float(scores[steps, slowest].sum()), float(alu[steps, slowest].sum()),
                      float(np.broadcast_to(hbm, busy.shape)[steps, slowest].sum()), use)


__all__ = ["ALU_OPS", "GPUS", "Gpu", "KERNELS", "LOAD_LATENCY_CYCLES", "MODELLED", "Prediction", "SATURATING_WARPS",
           "matmul_rate", "operand_reads", "predict", "utilization"]
