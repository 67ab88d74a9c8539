"""The Triton backend: generated Triton kernels (`templates/triton/attention.py.j2`) for NVIDIA GPUs.

This module is the backend's side of the contract: availability, support, params, the defaults per
architecture, the search space and its constraint, and the block entry points. `triton_launch` runs the
kernels (through jax_triton on a GPU, or in Triton's interpreter on the CPU); `triton_compile` compiles
them for a GPU target without a GPU and reads what they need.

The backward is two kernels: dk/dv (a key tile against every query tile of its head group, so grouped
heads need no atomics) and dq. dq is therefore never fused (`BwdParams.block_q_dq/block_kv_dq` are
required), and bias is not supported (`backend="auto"` takes scan for it).

The value head dim may differ from the query/key one (multi-head latent attention, e.g. 192 and 128).
Any head dim runs: the kernels' tiles are the head dims rounded up to powers of two >= 16 (what
`tl.arange` and `tl.dot` take), zero-filled past the real dim, which costs the padded columns' products
(192 computes q.k on 256 columns).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import jax

from tuner.kernels import codegen, triton_compile, triton_launch
from tuner.kernels.base import DecidesOnDevice, MergedBlocks, SearchSpace, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.kernels.triton_compile import resources, ruled_out
from tuner.kernels.triton_launch import (TEMPLATE, _constants, _dtype_name, launch_constants, launches,
                                         pow2_at_least, variant)
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.targets import compile_target
from tuner.support.tables import error_line

TILES = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8, 16)
WIDTHS = (64, 128, 256)  # the head-dim classes of `DEFAULTS`: up to 64, up to 128, over 128


def _fwd(block_q: int, block_kv: int, warps: int, stages: int) -> FwdParams:
    return FwdParams(block_q=block_q, block_kv=block_kv, num_warps=warps, num_stages=stages)


def _bwd(dkv: tuple[int, int], dq: tuple[int, int], warps: int, stages: int) -> BwdParams:
    return BwdParams(block_q_dkv=dkv[0], block_kv_dkv=dkv[1], block_q_dq=dq[0], block_kv_dq=dq[1], num_warps=warps,
                     num_stages=stages)


# The default tiles per (architecture, head-dim class): among the launches of the whole search space that the
# compiler builds without spilling, within shared memory and on the architecture's tensor-core path, the best by
# the roofline model (`tuner.models.gpu_model`) for a causal bf16 problem of 4096 tokens a device and 16 heads
# on the A100 (80), H100 (90) and B200 (100): `benchmarks/gpu/triton_defaults.py` over the sweeps of
# `benchmarks/gpu/triton_resources.py` (Triton 3.9), written to `benchmarks/gpu/results/triton_defaults.json`;
# `tests/test_gpu_model.py` derives them again. Over 128 the sweep (D=256) is whole for the forward and dK/dV
# kernels only: their tiles are the model's best there; dQ's 64x32 (with dK/dV's warps and stages) was
# compiled apart, spill-free on the tensor-core path at 256/256 and 192/128. Modelled, not timed.
DEFAULTS: dict[tuple[int, int], tuple[FwdParams, BwdParams]] = {
    (80, 64): (_fwd(128, 128, 8, 2), _bwd((64, 64), (64, 64), 4, 2)),
    (80, 128): (_fwd(128, 128, 8, 2), _bwd((128, 64), (128, 64), 8, 2)),
    (80, 256): (_fwd(64, 16, 4, 2), _bwd((32, 64), (64, 32), 8, 2)),
    (90, 64): (_fwd(128, 128, 8, 2), _bwd((32, 128), (128, 64), 4, 2)),
    (90, 128): (_fwd(128, 32, 4, 2), _bwd((64, 128), (128, 32), 8, 2)),
    (90, 256): (_fwd(128, 16, 8, 2), _bwd((16, 64), (64, 32), 8, 2)),
    (100, 64): (_fwd(64, 128, 4, 2), _bwd((128, 128), (128, 64), 8, 2)),
    (100, 128): (_fwd(128, 128, 8, 2), _bwd((64, 128), (128, 128), 8, 2)),
    (100, 256): (_fwd(128, 64, 8, 2), _bwd((16, 64), (64, 32), 8, 2)),
}


def standard_variants() -> list[codegen.Variant]:
    """The feature sets `tuner generate` renders: full, causal, causal + segments, causal + window,
    causal + chunk, causal + softcap; in bfloat16, float16 and float32; head dims 64 and 128 (values of
    the same dim)."""
    return [codegen.Variant("triton", TEMPLATE, {**f, "dtype": dtype, "head_dim": d, "value_head_dim": d,
                                                 "precision": "ieee" if dtype == "float32" else "tf32"})
            for f in codegen.STANDARD_FEATURES for dtype in ("bfloat16", "float16", "float32") for d in (64, 128)]


class TritonBackend(DecidesOnDevice, MergedBlocks):
    """Generated Triton kernels; NVIDIA GPUs (or Triton's interpreter on the CPU for checks)."""

    name = "triton"
    masked_tile = None  # its defaults are tuned per architecture for every mask

    def unavailable_reason(self, interpret: bool = False, platform: str | None = None) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'ring-tuner[gpu]')"
        if interpret:
            if importlib.util.find_spec("torch") is None:
                return "Triton's interpreter needs torch CPU tensors (pip install torch)"
            return None
        if (platform or compile_target()[0]) != "gpu" or not any(d.platform == "gpu" for d in jax.devices()):
            return "no CUDA GPU visible to jax"
        try:
            importlib.import_module("jax_triton")
        except ImportError as error:
            return f"jax-triton cannot be imported ({error})"
        return None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None
                 ) -> str | None:
        """Every head dim runs (padded to a power of two in the kernels); bias and dtypes other than
        bfloat16, float16 and float32 do not."""
        if spec.has_bias:
            return "bias (the scan backend supports it)"
        if _dtype_name(dtype) not in ("bfloat16", "float16", "float32"):
            return f"dtype {dtype}"
        return None

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        tiles = [("fwd_params.block_q", fwd.block_q), ("fwd_params.block_kv", fwd.block_kv),
                 ("bwd_params.block_q_dkv", bwd.block_q_dkv), ("bwd_params.block_kv_dkv", bwd.block_kv_dkv)]
        if bwd.fused_dq:
            raise ValueError("bwd_params.block_q_dq and block_kv_dq must be set: the triton backend "
                             "computes dq in its own kernel")
        tiles += [("bwd_params.block_q_dq", bwd.block_q_dq), ("bwd_params.block_kv_dq", bwd.block_kv_dq)]
        for name, tile in tiles:
            if tile < 16 or tile & (tile - 1):
                raise ValueError(f"{name} must be a power of two >= 16 for Triton tiles, got {tile}")
        reject_settings(self.name, fwd, bwd, launch=True, compute_slice=False)
        for owner, params in (("fwd_params", fwd), ("bwd_params", bwd)):
            if params.num_warps is not None and params.num_warps not in WARPS:
                raise ValueError(f"{owner}.num_warps must be one of {WARPS}, got {params.num_warps}")

    def default_params(self, q_len: int, kv_len: int, head_dim: int, value_head_dim: int | None = None, *,
                       capability: int | None = None) -> tuple[FwdParams, BwdParams]:
        """`DEFAULTS` of the architecture (`capability`; None: this GPU's, sm_90 without one) and the
        width class of the larger head dim, tiles cut to the (power-of-two-rounded) local lengths."""
        family = arch_family(_capability() if capability is None else capability)
        width = max(head_dim, value_head_dim or head_dim)
        fwd, bwd = DEFAULTS[(family, next(w for w in WIDTHS if width <= w or w == WIDTHS[-1]))]
        q, kv = pow2_at_least(q_len), pow2_at_least(kv_len)
        return (dataclasses.replace(fwd, block_q=min(fwd.block_q, q), block_kv=min(fwd.block_kv, kv)),
                dataclasses.replace(bwd, block_q_dkv=min(bwd.block_q_dkv, q), block_kv_dkv=min(bwd.block_kv_dkv, kv),
                                    block_q_dq=min(bwd.block_q_dq, q), block_kv_dq=min(bwd.block_kv_dq, kv)))

    def code_hash(self) -> str:
        return source_hash(codegen.template_path("triton", TEMPLATE), Path(__file__), Path(triton_launch.__file__),
                           Path(triton_compile.__file__))

    def search_space(self, shapes: LocalShapes, spec: AttentionSpec) -> SearchSpace:
        tiles = tuple(t for t in TILES if t <= pow2_at_least(max(shapes.q_len, shapes.kv_len)))
        return SearchSpace(
            fwd={"block_q": tiles, "block_kv": tiles, "num_warps": (4, 8), "num_stages": (2, 3, 4)},
            bwd={"block_q_dkv": tiles, "block_kv_dkv": tiles, "num_warps": (4, 8), "num_stages": (1, 2, 3)},
            dq_tiles=tiles, dq_passes=("separate",))

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None,
                  *, capability: int | None = None) -> str | None:
        """The compiler's verdict (`ruled_out`) on each kernel the parts launch, compiled with
        `triton.compile` for `sm_<capability>` (None: this GPU's architecture, sm_90 when there is none):
        a kernel that does not compile, needs more shared memory than a block may use, spills registers
        or fits no SM is not timed."""
        capability = _capability() if capability is None else capability
        source = variant(spec, shapes.dtype, shapes.head_dim, shapes.value_dim)
        for kernel, block_q, block_kv, params in launches(fwd, bwd):
            constants = launch_constants(shapes, spec, block_q, block_kv)
            warps, stages = params.num_warps or 4, params.num_stages or 2
            try:
                report = resources(source, kernel, constants, num_warps=warps, num_stages=stages,
                                   capability=capability)
            except Exception as error:  # noqa: BLE001 - a point the compiler rejects cannot run
                report = {"error": error_line(error, limit=200)}
            if (reason := ruled_out(report, capability)) is not None:
                return f"{kernel} {block_q}x{block_kv} ({warps} warps, {stages} stages) {reason}"
        return None

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool = False):
        return triton_launch.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec=spec, params=params,
                                     interpret=interpret)

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        dq, dk, dv = triton_launch.backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, spec=spec,
                                            params=params, interpret=interpret)
        return dq, dk, dv, None


def arch_family(capability: int) -> int:
    """The architecture whose `DEFAULTS` a compute capability takes: 80 below Hopper (sm_86 and sm_89 too,
    whose shared memory per block is smaller: not checked), 90 for Hopper, 100 from Blackwell on."""
    return 80 if capability < 90 else 90 if capability < 100 else 100


def _capability() -> int:
    """Compute capability of the first GPU as an int (90 for sm_90); 90 without a GPU."""
    for device in jax.devices():
        if device.platform == "gpu" and getattr(device, "compute_capability", None):
            major, minor = str(device.compute_capability).split(".")[:2]
            return int(major) * 10 + int(minor)
    return 90


def space_launches(shapes: LocalShapes, spec: AttentionSpec) -> list[tuple[str, int, int, int, int]]:
    """Each distinct (kernel, block_q, block_kv, num_warps, num_stages) the search space launches: the
    forward at its points, dK/dV at the backward points, dQ at the dq tiles with the backward's warps and
    stages."""
    space = TritonBackend().search_space(shapes, spec)
    seen: dict[tuple, None] = {}
    for fwd in space.fwd_points():
        seen[("attention_fwd", fwd.block_q, fwd.block_kv, fwd.num_warps, fwd.num_stages)] = None
    for bwd in space.bwd_points():
        seen[("attention_dkv", bwd.block_q_dkv, bwd.block_kv_dkv, bwd.num_warps, bwd.num_stages)] = None
    for bwd in space.bwd_points():
        seen[("attention_dq", bwd.block_q_dq, bwd.block_kv_dq, bwd.num_warps, bwd.num_stages)] = None
    return list(seen)


def standard_resources(source_variant: codegen.Variant, capability: int, local_len: int = 4096,
                       heads: int = 16, kv_heads: int | None = None) -> list[dict[str, Any]]:
    """Resources of the three kernels of a variant at the architecture's default params for a local length and
    head counts (`kv_heads` None: `heads`), compiled for `sm_<capability>` (what `tuner generate --compile`
    reports)."""
    head_dim, value_head_dim = source_variant.features["head_dim"], source_variant.features["value_head_dim"]
    kv_heads = heads if kv_heads is None else kv_heads
    _, spec = codegen.standard_shapes(source_variant, local_len, heads, kv_heads=kv_heads)
    fwd, bwd = TritonBackend().default_params(local_len, local_len, head_dim, value_head_dim, capability=capability)
    rows = []
    for kernel, block_q, block_kv, params in launches(fwd, bwd):
        constants = _constants(spec, local_len, local_len, heads, kv_heads, head_dim, block_q, block_kv,
                               value_head_dim=value_head_dim)
        report = resources(source_variant, kernel, constants, num_warps=params.num_warps,
                           num_stages=params.num_stages, capability=capability)
        rows.append({"kernel": kernel, "target": f"sm_{capability}", "block_q": block_q, "block_kv": block_kv,
                     "num_warps": params.num_warps, "num_stages": params.num_stages, **report})
    return rows
