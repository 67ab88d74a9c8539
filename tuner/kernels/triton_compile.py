"""Compiling the Triton backend's kernels for a GPU target without a GPU, as jax_triton compiles them, and
reading what the compiler built: shared memory, registers, spills, the matrix-product instructions, the
occupancy those imply, and the rule (`ruled_out`) that keeps a launch from being timed.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tuner.kernels import codegen
from tuner.kernels.triton_launch import KERNEL_ARGS

# Shared memory one block may use (the opt-in maximum, what Triton's launcher asks for) per architecture: the
# CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table ("maximum amount of
# shared memory per thread block"): 163 KiB on 8.0, 99 KiB on 8.6 and 8.9, 227 KiB on 9.0 and on 10.0 (B200:
# 228 KiB per SM, 1 KiB of it reserved per block; the same in CCCL's `cuda/__device/arch_traits.h`).
SHARED_MEMORY_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}

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
