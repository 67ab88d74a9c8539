"""The Triton backend: generated Triton kernels (`templates/triton/attention.py.j2`) for NVIDIA GPUs.

On a GPU the kernels run through `jax_triton.triton_call`. With `interpret=True` the same rendered
kernels run in Triton's interpreter on the CPU, on torch CPU tensors, in a separate process
(`triton_worker.py`: Triton fixes at import time whether it interprets), reached from JAX through
`jax.pure_callback`; simulated devices call back from several threads, and the interpreter is not
thread-safe, so the calls are serialized. Nothing is imported until it is used: `import tuner` works
without triton, torch or jax-triton.

The backward is two kernels: dk/dv (a key tile against every query tile of its head group, so grouped
heads need no atomics) and dq. dq is therefore never fused (`BwdParams.block_q_dq/block_kv_dq` are
required), and bias is not supported (`backend="auto"` takes scan for it).

The value head dim may differ from the query/key one (multi-head latent attention, e.g. 192 and 128).
Any head dim runs: the kernels' tiles are the head dims rounded up to powers of two >= 16 (what
`tl.arange` and `tl.dot` take), zero-filled past the real dim, which costs the padded columns' products
(192 computes q.k on 256 columns).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tuner.kernels import codegen
from tuner.semantics import masks
from tuner.kernels.base import SearchSpace, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.targets import compile_target
from tuner.support.tables import error_line

TEMPLATE = "attention.py.j2"
TILES = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8, 16)
# Shared memory one block may use (the opt-in maximum, what Triton's launcher asks for) per architecture: the
# CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table ("maximum amount of
# shared memory per thread block"): 163 KiB on 8.0, 99 KiB on 8.6 and 8.9, 227 KiB on 9.0 and on 10.0 (B200:
# 228 KiB per SM, 1 KiB of it reserved per block; the same in CCCL's `cuda/__device/arch_traits.h`).
SHARED_MEMORY_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}


WIDTHS = (64, 128, 256)  # the head-dim classes of `DEFAULTS`: up to 64, up to 128, over 128


def _fwd(block_q: int, block_kv: int, warps: int, stages: int) -> FwdParams:
    return FwdParams(block_q=block_q, block_kv=block_kv, num_warps=warps, num_stages=stages)


def _bwd(dkv: tuple[int, int], dq: tuple[int, int], warps: int, stages: int) -> BwdParams:
    return BwdParams(block_q_dkv=dkv[0], block_kv_dkv=dkv[1], block_q_dq=dq[0], block_kv_dq=dq[1], num_warps=warps,
                     num_stages=stages)


# The default tiles per (architecture, head-dim class): among the launches of the whole search space that the
# compiler builds without spilling, within shared memory and on the architecture's tensor-core path, the best by
# the roofline model (`tuner.models.gpu_model`) for a causal bf16 problem of 4096 tokens a device and 16 heads
# on the A100 (80), H100 (90) and B200 (100): `benchmarks/triton_defaults.py` over the sweeps of
# `benchmarks/triton_resources.py` (Triton 3.9), written to `benchmarks/results/triton_defaults.json`;
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


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def pow2_at_least(n: int) -> int:
    """The power of two >= 16 that a tile of `n` rows or columns spans (what `tl.arange` and `tl.dot` take)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def variant(spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None) -> codegen.Variant:
    """The rendered module for these features (window / chunk / softcap values stay compile-time
    parameters, so one module serves every value); `value_head_dim` None means `head_dim`."""
    name = _dtype_name(dtype)
    return codegen.Variant("triton", TEMPLATE, {
        "causal": spec.causal, "window": spec.window is not None, "chunk": spec.chunk_size is not None,
        "segments": spec.has_segments, "softcap": spec.softcap is not None, "dtype": name,
        "head_dim": head_dim, "value_head_dim": value_head_dim or head_dim,
        "precision": "ieee" if name == "float32" else "tf32"})


def standard_variants() -> list[codegen.Variant]:
    """The feature sets `tuner generate` renders: full, causal, causal + segments, causal + window,
    causal + chunk, causal + softcap; in bfloat16, float16 and float32; head dims 64 and 128 (values of
    the same dim)."""
    return [codegen.Variant("triton", TEMPLATE, {**f, "dtype": dtype, "head_dim": d, "value_head_dim": d,
                                                 "precision": "ieee" if dtype == "float32" else "tf32"})
            for f in codegen.STANDARD_FEATURES for dtype in ("bfloat16", "float16", "float32") for d in (64, 128)]


def _constants(spec: AttentionSpec, q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int,
               block_q: int, block_kv: int, *, value_head_dim: int | None = None) -> dict[str, Any]:
    """The kernels' compile-time parameters: tiles cut to the power-of-two-rounded lengths, head dims with
    their padded tile widths (`value_head_dim` None means `head_dim`)."""
    left, right = spec.window if spec.window is not None else (0, 0)
    block_q, block_kv = min(block_q, pow2_at_least(q_len)), min(block_kv, pow2_at_least(kv_len))
    value_head_dim = value_head_dim or head_dim
    return dict(Q_LEN=q_len, KV_LEN=kv_len, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                V_HEAD_DIM=value_head_dim, HEAD_DIM_PADDED=pow2_at_least(head_dim),
                V_HEAD_DIM_PADDED=pow2_at_least(value_head_dim), SCALE=float(spec.scale),
                SOFTCAP=float(spec.softcap or 0.0), WINDOW_LEFT=left, WINDOW_RIGHT=right, CHUNK=spec.chunk_size or 1,
                BLOCK_Q=block_q, BLOCK_KV=block_kv,
                NUM_Q_TILES=-(-q_len // block_q), NUM_KV_TILES=-(-kv_len // block_kv))


def launch_constants(shapes: LocalShapes, spec: AttentionSpec, block_q: int, block_kv: int) -> dict[str, Any]:
    """The compile-time parameters of a launch with these tiles for one device's shapes."""
    return _constants(spec, shapes.q_len, shapes.kv_len, shapes.heads, shapes.kv_heads, shapes.head_dim, block_q,
                      block_kv, value_head_dim=shapes.value_dim)


# --------------------------------------------------------------------------------------------------
# Launching: jax_triton on a GPU, or the interpreter through a host callback.
# --------------------------------------------------------------------------------------------------


class _Interpreter:
    """The interpreter process (`triton_worker.py`), started on first use; one request at a time."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            worker = Path(__file__).with_name("triton_worker.py")
            self._process = subprocess.Popen([sys.executable, "-P", str(worker)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env={**os.environ, "TRITON_INTERPRET": "1"})
            atexit.register(self._process.kill)
        return self._process

    def _ask(self, request: dict) -> dict:
        with self._lock:
            process = self._start()
            pickle.dump(request, process.stdin)
            process.stdin.flush()
            try:
                return pickle.load(process.stdout)
            except EOFError:
                raise RuntimeError(f"the Triton interpreter process exited (status {process.wait()})") from None

    def run(self, source: codegen.Variant, module: Path, kernel: str, grid: tuple, arrays: list[np.ndarray],
            out_shapes: list, constants: dict) -> list[np.ndarray]:
        """Run `kernel` of the variant's rendered `module`. The process runs the file only if it holds the
        variant's rendering (by sha256); one that does not (changed or removed since it was rendered) is
        rendered again and the request retried once."""
        packed = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            name = a.dtype.name
            packed.append(((a.view(np.int16) if name == "bfloat16" else a).tobytes(), name if name ==
                           "bfloat16" else a.dtype.str, a.shape))
        request = {"module": str(module.absolute()), "sha256": codegen.sha256(codegen.render_source(source)),
                   "kernel": kernel, "grid": grid, "args": packed, "out_shapes": [tuple(s.shape) for s in out_shapes],
                   "constants": constants}
        reply = self._ask(request)
        if "mismatch" in reply:
            codegen.render(source, module.parent)
            reply = self._ask(request)
        if "mismatch" in reply:
            raise RuntimeError(f"Triton's interpreter refused {kernel}: {reply['mismatch']}")
        if "error" in reply:
            raise RuntimeError(f"{kernel} failed in Triton's interpreter:\n{reply['error']}")
        return reply["outputs"]


_INTERPRETER = _Interpreter()


def _interpret(source: codegen.Variant, kernel: str, grid, inputs, out_shapes, constants):
    module = codegen.render(source)

    def host(*arrays):
        return tuple(_INTERPRETER.run(source, module, kernel, grid, [np.asarray(a) for a in arrays], out_shapes,
                                      constants))

    return jax.pure_callback(host, tuple(out_shapes), *inputs, vmap_method="sequential")


def _launch(kernel_name: str, spec: AttentionSpec, inputs: list, out_shapes: list, grid: tuple,
            constants: dict, num_warps: int | None, num_stages: int | None, interpret: bool, dtype):
    source = variant(spec, dtype, constants["HEAD_DIM"], constants["V_HEAD_DIM"])
    if interpret:
        return _interpret(source, kernel_name, grid, inputs, out_shapes, constants)
    import jax_triton

    kernel = getattr(codegen.load(source), kernel_name)

    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    return jax_triton.triton_call(*inputs, kernel=kernel, out_shape=out_shapes, grid=grid, **launch,
                                  **constants)


# --------------------------------------------------------------------------------------------------
# Resources: compile for a GPU target without a GPU, read shared memory and registers.
# --------------------------------------------------------------------------------------------------


KERNEL_ARGS = {
    "attention_fwd": ("Q", "K", "V", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count", "Full", "Out", "Lse"),
    "attention_dkv": ("Q", "K", "V", "DO", "Lse", "Delta", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count",
                      "Full", "DK", "DV"),
    "attention_dq": ("Q", "K", "V", "DO", "Lse", "Delta", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count",
                     "Full", "DQ"),
}

# What jax_triton tells Triton about each array argument (`get_or_create_triton_kernel` in jax_triton 0.3.1
# and 0.4.0): "We assume that all arrays are aligned to 16 bytes" -- it specializes every array argument
# with `native_specialize_impl(backend, SimpleNamespace(data_ptr=lambda: 16, ...), False, True, True)`
# and passes `backend.parse_attr` of the result to `ASTSource(attrs=...)`: this attribute, on every
# pointer. Scalar arguments get none (the kernels take none: everything else is a constexpr).
ALIGNED_POINTER = [["tt.divisibility", 16]]


def _pointer_type(arg: str, dtype: str) -> str:
    if arg in ("QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count", "Full"):
        return "*i32"
    if arg in ("Q", "K", "V", "DO"):
        return {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}[dtype]
    return "*fp32"


@contextlib.contextmanager
def _triton_file_cache():
    """A Triton file cache for `triton.compile` while the block runs. jax_triton sets `TRITON_CACHE_DIR` to ""
    when imported (it keeps the kernels it compiles itself), and `triton.compile` then stops with "Could not
    create or locate cache dir": on an H200 every launch of a search was ruled out so. The variable is set
    to Triton's own default folder meanwhile, and put back after."""
    if os.environ.get("TRITON_CACHE_DIR") != "":
        yield
        return
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(home, ".triton", "cache")
    try:
        yield
    finally:
        os.environ["TRITON_CACHE_DIR"] = ""


@functools.lru_cache(maxsize=256)
def _compiled(source_variant: codegen.Variant, kernel_name: str, constants: tuple, num_warps: int,
              num_stages: int, capability: int):
    """`triton.compile` for `sm_<capability>` as jax_triton compiles the launch on a GPU: every pointer
    16-byte aligned (`ALIGNED_POINTER`), the constants as constexprs, one CTA, fp fusion on. Triton picks
    its ptxas itself (`ptxas` below sm_90, `ptxas-blackwell` from sm_90 on, sm_100 included)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, made explicit
    import triton
    from triton.backends.compiler import GPUTarget

    module = codegen.load(source_variant)
    kernel = getattr(module, kernel_name)
    dtype = source_variant.features["dtype"]
    args = KERNEL_ARGS[kernel_name]
    signature = {arg: _pointer_type(arg, dtype) for arg in args}
    signature.update({name: "constexpr" for name, _ in constants})
    attrs = {(i,): ALIGNED_POINTER for i in range(len(args))}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=dict(constants), attrs=attrs)
    with _triton_file_cache():
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1,
                                       "enable_fp_fusion": True})


def tensor_core_family(capability: int) -> str:
    """The SASS opcodes (a shell pattern) of the architecture's own tensor-core matrix product: `*GMMA`
    (wgmma: HGMMA for f16/bf16/tf32 operands, QGMMA for fp8) on sm_90, `UTC*MMA` (tcgen05.mma: UTCHMMA for
    f16/bf16/tf32, UTCQMMA for fp8) on sm_100..sm_119, `?MMA` (mma.sync: HMMA, ...) on the others."""
    if capability == 90:
        return "*GMMA"
    if 100 <= capability < 120:
        return "UTC*MMA"
    return "?MMA"


def mma_family(sass: str) -> str:
    """The matrix-product opcode in a SASS listing, the newest kind seen: sm_100's tcgen05 (`UTC*MMA`), then
    sm_90's warpgroup MMA (`*GMMA`), then mma.sync (`?MMA`: HMMA, ...); "none" without any."""
    opcodes = set(re.findall(r"\b([A-Z]+MMA)(?=[.\s])", sass))
    for kind in ("UTC*MMA", "*GMMA", "?MMA"):
        if found := sorted(o for o in opcodes if fnmatch.fnmatchcase(o, kind)):
            return found[0]
    return "none"


def uses_tensor_cores(mma: str, capability: int) -> bool:
    """Whether the product runs on the architecture's tensor-core path (`tensor_core_family`): HMMA on an
    sm_90 or sm_100 is the older mma.sync, slower there, and "none" is FMA units."""
    return mma != "none" and fnmatch.fnmatchcase(mma, tensor_core_family(capability))


# Per-SM limits of each architecture, from the CUDA C++ Programming Guide's "Technical Specifications per
# Compute Capability" table and CCCL's `cuda/__device/arch_traits.h` (the same numbers): shared memory per
# SM, resident warps and resident blocks per SM. Every one of them has 64K 32-bit registers per SM (and
# per block), at most 255 per thread, allocated per warp in units of 256 over 4 sub-partitions, shared
# memory allocated in units of 128 bytes with 1 KiB reserved by the driver per block (the rules of
# `cuda_occupancy.h`, the occupancy calculator of the CUDA toolkit).
SM_LIMITS = {80: {"shared": 164 * 1024, "warps": 64, "blocks": 32},
             86: {"shared": 100 * 1024, "warps": 48, "blocks": 16},
             89: {"shared": 100 * 1024, "warps": 48, "blocks": 24},
             90: {"shared": 228 * 1024, "warps": 64, "blocks": 32},
             100: {"shared": 228 * 1024, "warps": 64, "blocks": 32}}
REGISTERS_PER_SM, MAX_REGISTERS_PER_THREAD, REGISTER_UNIT, SUB_PARTITIONS = 65536, 255, 256, 4
SHARED_UNIT, SHARED_RESERVED = 128, 1024
# sm_100's tensor memory: 128 lanes x 512 columns of 32 bits per SM, taken by `tcgen05.alloc` in powers of two
# from 32 columns (PTX ISA, tcgen05 "Tensor Memory"). jax_triton refuses a kernel that asks for more
# (`_TMEM_MAX_SIZE = 512`: Triton compiles it to a single `trap`).
TMEM_COLUMNS = 512


def occupancy(arch: int, registers: int, shared: int, warps: int, tmem: int = 0) -> dict[str, Any]:
    """Blocks and warps of a kernel resident on one SM of `sm_<arch>`, from its registers per thread, its
    shared memory per block (bytes) and its warps per block, the way the CUDA occupancy calculator
    (`cuda_occupancy.h`: `cudaOccMaxActiveBlocksPerMultiprocessor`) counts them:

    - registers: a warp takes `registers * 32` rounded up to 256; each of the 4 sub-partitions of the
      65536-register file holds `16384 // that` warps; no block fits over 255 per thread or over 65536 per
      block (its warps rounded up to a multiple of 4);
    - shared memory: a block takes its bytes plus the 1 KiB the driver reserves, rounded up to 128; the SM
      holds `SM_LIMITS[arch]["shared"]` (164 KiB on sm_80, 228 KiB on sm_90 and sm_100); none fits over
      the per-block maximum `SHARED_MEMORY_BYTES[arch]` (227 KiB on sm_90 and sm_100);
    - warps: 64 per SM (48 on sm_86/sm_89); blocks: 32 per SM (16 on sm_86, 24 on sm_89);
    - tensor memory (sm_100, `tmem` columns of Triton's `tmem_size`, 0 elsewhere): a block takes them rounded
      up to a power of two from 32, the SM has 512 (blocks past that wait in `tcgen05.alloc`); none runs
      over 512.

    Returns `blocks_per_sm`, `warps_per_sm` (blocks x warps) and `limited_by`: the limits that bind
    ("registers", "shared", "warps", "blocks", "tmem"; several on a tie), or that make a block not fit."""
    sm = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    if registers > MAX_REGISTERS_PER_THREAD or per_warp * -(-warps // SUB_PARTITIONS) * SUB_PARTITIONS > \
            REGISTERS_PER_SM:
        by_registers = 0
    else:
        by_registers = (REGISTERS_PER_SM // SUB_PARTITIONS // per_warp * SUB_PARTITIONS // warps if per_warp
                        else sm["blocks"])
    allocated = -(-(shared + SHARED_RESERVED) // SHARED_UNIT) * SHARED_UNIT
    by_shared = 0 if shared > SHARED_MEMORY_BYTES[arch] else sm["shared"] // allocated
    limits = {"registers": by_registers, "shared": by_shared, "warps": sm["warps"] // warps, "blocks": sm["blocks"]}
    if tmem:
        limits["tmem"] = TMEM_COLUMNS // max(32, 1 << (tmem - 1).bit_length()) if tmem <= TMEM_COLUMNS else 0
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "limited_by": ",".join(name for name, limit in limits.items() if limit == blocks)}


def _tool(name: str) -> str:
    return str(Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / name)


def resources(source_variant: codegen.Variant, kernel_name: str, constants: dict, *, num_warps: int = 4,
              num_stages: int = 2, capability: int = 90) -> dict[str, Any]:
    """Compile one kernel for `sm_<capability>` as jax_triton does (no GPU needed; `_compiled`) and report:

    - `shared`: bytes per block that Triton launches it with;
    - `registers` per thread and `spill_bytes` (the stack frame): `cuobjdump -res-usage` on the cubin;
    - `mma`: the matrix-product family in the SASS (`mma_family`: "HMMA", "HGMMA", sm_100's "UTCHMMA", "none");
    - `tensor_core`: whether that is the architecture's tensor-core path (`uses_tensor_cores`);
    - `tmem`: sm_100's tensor-memory columns per block (0 elsewhere; over 512 the kernel is a `trap`, which
      jax_triton refuses to launch);
    - where the architecture is in `SM_LIMITS`, the `occupancy` those imply: `blocks_per_sm`,
      `warps_per_sm`, `limited_by`."""
    compiled = _compiled(source_variant, kernel_name, tuple(sorted(constants.items())), num_warps,
                         num_stages, capability)
    report: dict[str, Any] = {"shared": compiled.metadata.shared, "registers": None, "spill_bytes": None,
                              "mma": None}
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        if not sass.strip():  # a cubin this cuobjdump cannot list: nvdisasm reads the raw ELF
            sass = subprocess.run([_tool("nvdisasm"), str(cubin)], capture_output=True, text=True).stdout
    function = usage[usage.index("Function"):] if "Function" in usage else usage
    for key, field in (("REG", "registers"), ("STACK", "spill_bytes")):
        if match := re.search(rf"\b{key}:(\d+)", function):
            report[field] = int(match.group(1))
    report["mma"] = mma_family(sass)
    report["tensor_core"] = uses_tensor_cores(report["mma"], capability)
    report["tmem"] = getattr(compiled.metadata, "tmem_size", 0) or 0
    if capability in SM_LIMITS and report["registers"] is not None:
        report.update(occupancy(capability, report["registers"], report["shared"], num_warps, report["tmem"]))
    return report


def launches(fwd: FwdParams | None, bwd: BwdParams | None) -> list[tuple[str, int, int, FwdParams | BwdParams]]:
    """(kernel, block_q, block_kv, params) of each kernel the given parts launch: the forward with `fwd`, the
    dk/dv and dq kernels with `bwd`."""
    kernels = [] if fwd is None else [("attention_fwd", fwd.block_q, fwd.block_kv, fwd)]
    if bwd is not None:
        kernels += [("attention_dkv", bwd.block_q_dkv, bwd.block_kv_dkv, bwd),
                    ("attention_dq", bwd.block_q_dq, bwd.block_kv_dq, bwd)]
    return kernels


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


def ruled_out(report: dict[str, Any], capability: int) -> str | None:
    """Why the compiler's verdict on one launch for `sm_<capability>` (`resources`, or `{"error": ...}`)
    keeps it from being timed, or None: it does not compile, needs more shared memory than a block may
    use there, spills registers (any stack bytes: Triton's kernels keep no stack otherwise), or no block
    of it fits an SM (registers, or sm_100's tensor memory)."""
    if "error" in report:
        return f"does not compile for sm_{capability}: {report['error']}"
    limit = SHARED_MEMORY_BYTES.get(capability, 99 * 1024)
    if report["shared"] > limit:
        return f"needs {report['shared'] // 1024} KiB of shared memory, over the {limit // 1024} KiB of sm_{capability}"
    if report.get("spill_bytes"):
        return f"spills registers on sm_{capability} ({report['spill_bytes']} bytes of stack)"
    if report.get("blocks_per_sm") == 0:
        return f"fits no SM of sm_{capability} (by {report['limited_by']})"
    return None


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


# --------------------------------------------------------------------------------------------------
# The backend.
# --------------------------------------------------------------------------------------------------


class TritonBackend:
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
        return source_hash(codegen.template_path("triton", TEMPLATE), Path(__file__))

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
        b, tq, h, d = q.shape
        tk, hkv, d_v = v.shape[1:]
        constants = _constants(spec, tq, tk, h, hkv, d, params.block_q, params.block_kv, value_head_dim=d_v)
        q_seg, kv_seg = (q_pos, kv_pos) if q_seg is None else (q_seg, kv_seg)
        schedule = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, constants["BLOCK_Q"],
                                       constants["BLOCK_KV"])
        out_shapes = [jax.ShapeDtypeStruct((b, tq, h, d_v), jnp.float32), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)]
        grid = (constants["NUM_Q_TILES"], b * h)
        out, lse = _launch("attention_fwd", spec, [q, k, v, q_pos, kv_pos, q_seg, kv_seg, *schedule], out_shapes,
                           grid, constants, params.num_warps, params.num_stages, interpret, q.dtype)
        return out, lse

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        b, tq, h, d = q.shape
        tk, hkv, d_v = v.shape[1:]
        q_seg, kv_seg = (q_pos, kv_pos) if q_seg is None else (q_seg, kv_seg)
        inputs = [q, k, v, do.astype(q.dtype), lse, delta, q_pos, kv_pos, q_seg, kv_seg]
        dkv = _constants(spec, tq, tk, h, hkv, d, params.block_q_dkv, params.block_kv_dkv, value_head_dim=d_v)
        by_key = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, dkv["BLOCK_Q"], dkv["BLOCK_KV"],
                                     by_key=True)
        kv_shapes = [jax.ShapeDtypeStruct((b, tk, hkv, dim), jnp.float32) for dim in (d, d_v)]
        dk, dv = _launch("attention_dkv", spec, [*inputs, *by_key], kv_shapes, (dkv["NUM_KV_TILES"], b * hkv), dkv,
                         params.num_warps, params.num_stages, interpret, q.dtype)
        dq_constants = _constants(spec, tq, tk, h, hkv, d, params.block_q_dq, params.block_kv_dq,
                                  value_head_dim=d_v)
        by_query = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, dq_constants["BLOCK_Q"],
                                       dq_constants["BLOCK_KV"])
        (dq,) = _launch("attention_dq", spec, [*inputs, *by_query], [jax.ShapeDtypeStruct((b, tq, h, d), jnp.float32)],
                        (dq_constants["NUM_Q_TILES"], b * h), dq_constants, params.num_warps,
                        params.num_stages, interpret, q.dtype)
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
