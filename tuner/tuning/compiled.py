"""`tuner search --device tpu --dry-run --target v5e:2x2`: every variant of the Pallas kernel compiled by the
production TPU compiler for a TPU topology, on a host without a TPU (needs libtpu: `pip install
'ring-tuner[tpu]'`), and ranked by the analytic model (`tuner.models.tpu_model`).

The implementation compiled is the Pallas ring, or another that runs the Pallas kernel (`--backend
all_to_all_pallas_tpu`, `all_gather_pallas_tpu`, or over two mesh axes `hybrid_pallas_tpu`): its variants
are the kernel's tiles on the shapes the kernel runs there (`registry.tile_shapes`). For each target (a
topology name of `jax.experimental.topologies`: the ring is its chips), the variants of the problem's
search space that the kernel's constraints admit for that chip are each compiled as the whole program
over the topology: forward tiles as the forward pass; the tiles of the dK/dV kernel and of the dQ kernel
(varied one kernel at a time, the others at their defaults) as forward and backward. Per variant it
records whether the compiler accepted it (else its first error line), the VMEM the compiler reports each
Mosaic kernel uses beside our estimate, the program's temporary memory, and the model's time
(`tuner.tuning.compiled_report`). The best tiles of each kernel that compiled make the target's config,
written to the cache as a `compiled` row: the loader uses it for that device kind when no measured
(`search`) row exists for the problem, and says so; nothing treats it as a measurement.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tuner.models import hlo, tpu_model
from tuner import registry
from tuner.kernels import pallas_tiling, pallas_tpu, tpu_memory
from tuner.strategies.configs import TileConfig
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.tables import error_line
from tuner.tuning.compiled_report import PARTS, TargetReport, Variant
from tuner.tuning.workload import AXIS, Workload, vjp_of

TARGETS = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1", "v4:2x2x1")  # `--target all`


def libtpu_missing() -> str | None:
    """Why TPU programs cannot be compiled here, or None."""
    if importlib.util.find_spec("libtpu") is None:
        return ("libtpu is not installed: pip install 'ring-tuner[tpu]' (jax[tpu]) compiles for TPU topologies "
                "on any host")
    return None


_TOPOLOGY_LOCK = threading.Lock()  # libtpu's client is created by the first call: never two at once


@functools.cache
def topology_mesh(target: str) -> Mesh:
    """A one-axis mesh over the devices of the TPU topology `target` (e.g. "v5e:2x2"); `ValueError`
    naming it when the topology API does not know it. Safe to call from threads."""
    from jax.experimental import topologies

    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        with _TOPOLOGY_LOCK:
            devices = topologies.get_topology_desc(platform="tpu", topology_name=target).devices
    except Exception as error:  # noqa: BLE001 - libtpu's errors name no argument
        if "lockfile" in str(error):
            raise ValueError(f"--target {target}: another process holds libtpu ({error_line(error, 200)}); to "
                             f"compile beside it, set ALLOW_MULTIPLE_LIBTPU_LOAD=1") from None
        raise ValueError(f"--target {target}: libtpu gives no such topology ({error_line(error, 200)}); known "
                         f"targets: {', '.join(TARGETS)}") from None
    return Mesh(np.array(devices), (AXIS,))


def compile_program(workload: Workload, config: TileConfig, backward: bool,
                    implementation: str = tpu_model.MODELLED) -> tuple[str | None, str, int | None]:
    """Compile `implementation` with `config` for the workload's mesh, the forward pass or (`backward`)
    forward and backward: (the compiler's first error line or None, the compiled HLO text, the temporary
    bytes). A compiler error is returned, not raised."""
    fn = workload.attend(implementation, config)
    inputs, dout = workload.structs()
    if not backward:
        program, args = jax.jit(fn), (inputs,)
    else:
        def forward_and_backward(x, dout):
            out, vjp = vjp_of(fn, x)
            return out, vjp(dout)
        program, args = jax.jit(forward_and_backward), (inputs, dout)
    try:
        compiled = program.lower(*args).compile()
    except Exception as error:  # noqa: BLE001 - every compiler error is the variant's verdict
        return error_line(error, 160), "", None
    return None, compiled.as_text(), getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)


def compile_variant(workload: Workload, variant: Variant, implementation: str = tpu_model.MODELLED,
                    program: tuple[str | None, str, int | None] | None = None) -> Variant:
    """One variant's verdict: its program compiled (`compile_program`: the forward pass for a forward
    variant, forward and backward for a backward kernel's; `program` where it is compiled already) and
    what the compiler reports of the variant's own kernel."""
    if program is None:
        program = compile_program(workload, variant.config, variant.part != "fwd", implementation)
    error, text, temp = program
    if error is not None:
        return replace(variant, error=error)
    vmem = {name.split(".")[0]: (asked, used, estimate(workload.problem, variant, implementation))
            for name, (asked, used) in hlo.kernel_vmem(text).items()
            if name.split(".")[0] == f"ring_attention_{variant.part}"}
    return replace(variant, vmem=vmem, temp_bytes=temp)


def compile_step(shapes: LocalShapes, spec: AttentionSpec, target: str, fwd: FwdParams | None = None,
                 bwd: BwdParams | None = None) -> dict[str, tuple[int, int]] | str:
    """One ring step's kernels alone, compiled for one chip of the topology `target`: per kernel
    ("fwd", "dkv", "dq") the VMEM it was given and the VMEM it uses (`hlo.kernel_vmem`), or the
    compiler's first error line. The quick way to hold the VMEM constraint to the compiler: a
    kernel's VMEM is its own, whatever program it sits in."""
    mesh = Mesh(np.array(topology_mesh(target).devices.flat[:1]), (AXIS,))
    sharding = NamedSharding(mesh, PartitionSpec())
    kernels = {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the kernels ask for the target chip's VMEM
        for program, args in pallas_tpu.step_programs(shapes, spec, fwd, bwd, sharding):
            try:
                text = program.lower(*args).compile().as_text()
            except Exception as error:  # noqa: BLE001 - the compiler's verdict
                return error_line(error, 160)
            kernels.update({name.split(".")[0].removeprefix("ring_attention_"): vmem
                            for name, vmem in hlo.kernel_vmem(text).items()})
    return kernels


def variants_of(problem: Problem, mesh: Mesh, implementation: str = tpu_model.MODELLED
                ) -> tuple[list[Variant], FwdParams, BwdParams]:
    """Every variant of the Pallas kernel's search space on what it runs inside `implementation`, one kernel's
    tiles at a time, with what the constraints of the mesh's chip rule out; and the tiles the other kernels
    keep: the default ones, except that backward variants are compiled beside the default forward tiles
    only when the constraints admit them, else beside the admitted forward tiles with the smallest VMEM
    estimate (a forward that cannot compile would fail every backward variant for a reason not its own)."""
    backend = pallas_tpu.PallasTpuBackend()
    runs = registry.taking(implementation, problem)
    shapes = registry.problem_tile_shapes(runs, problem)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the target chip's default tiles
        default_fwd, default_bwd = backend.default_params(shapes.q_len, shapes.kv_len, *shapes.head_dims)
    space = backend.search_space(shapes, problem.spec)

    def constrain(variants: list[Variant]) -> list[Variant]:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the constraints of the target's chip
            for v in variants:
                fwd, bwd = (v.config.fwd, None) if v.part == "fwd" else (None, v.config.bwd)
                v.ruled_out = backend.violation(shapes, problem.spec, fwd, bwd)
        return variants

    forward = constrain([Variant("fwd", TileConfig(p, default_bwd)) for p in space.fwd_points()])
    admitted = [v for v in forward if v.ruled_out is None]
    if admitted and not any(v.config.fwd == default_fwd for v in admitted):
        default_fwd = min(admitted, key=lambda v: estimate(problem, v, implementation)).config.fwd
    backward = []
    for part, fields in (("dkv", ("block_q_dkv", "block_kv_dkv")), ("dq", ("block_q_dq", "block_kv_dq"))):
        tiles = {tuple(getattr(p, f) for f in fields) for p in space.bwd_points()}
        backward += [Variant(part, TileConfig(default_fwd, replace(default_bwd, **dict(zip(fields, t)))))
                     for t in sorted(tiles)]
    return forward + constrain(backward), default_fwd, default_bwd


def estimate(problem: Problem, variant: Variant, implementation: str = tpu_model.MODELLED) -> int:
    """The VMEM bytes the constraints estimate for the variant's own kernel, on what it runs inside
    `implementation`."""
    fwd, bwd = (variant.config.fwd, None) if variant.part == "fwd" else (None, variant.config.bwd)
    shapes = registry.problem_tile_shapes(registry.get(implementation), problem)
    return pallas_tiling.vmem_estimates(shapes, problem.spec, fwd, bwd)[variant.part]


def compile_target(problem: Problem, target: str, *, sample: int | None = None, largest: bool = False,
                   over_vmem: bool = False, workers: int | None = None, parts: tuple[str, ...] = PARTS,
                   progress: Callable[[int, int], None] | None = None, implementation: str = tpu_model.MODELLED
                   ) -> TargetReport:
    """Constrain, compile and rank the Pallas kernel's variants inside `implementation` (the Pallas ring, or
    another over the Pallas kernel) on `problem` for the topology `target` (module docstring); the problem's
    ring size is set to the topology's chips. With `sample`, only the
    default tiles and `sample` other admitted variants of each kernel are compiled; with `largest`,
    only the admitted variant of each kernel with the largest VMEM estimate (the ones the VMEM
    constraint is there for); with `over_vmem`, also every variant the VMEM constraint alone rules out
    (marked `forced`), to hold the constraint to the compiler over the whole space. `parts` limits the
    kernels whose variants are compiled (the report's `config` then needs all three to be set). Variants
    that are one program (the dK/dV and the dQ kernel's default tiles: the same forward and backward) are
    compiled once; `progress(done, total)` counts programs."""
    if largest and over_vmem:
        raise ValueError("compile_target: largest and over_vmem choose different variants; pass one")
    started = time.perf_counter()
    mesh = topology_mesh(target)
    device_kind = mesh.devices.flat[0].device_kind
    name = tpu_memory.CHIPS.get(device_kind)
    if name not in tpu_model.CHIPS:
        raise ValueError(f"--target {target}: no model of {device_kind} ({name}); model targets: "
                         f"{', '.join(tpu_model.CHIPS)}")
    chip = tpu_model.CHIPS[name]
    problem = replace(problem, ring_size=mesh.size)
    variants, default_fwd, default_bwd = variants_of(problem, mesh, implementation)
    variants = [v for v in variants if v.part in parts]
    admitted = sum(v.ruled_out is None for v in variants)
    if over_vmem:
        variants = [replace(v, ruled_out=None, forced=v.ruled_out) if _over_vmem(v) else v for v in variants]
    if largest:
        variants = _edge(problem, variants, implementation)
    elif sample is not None:
        variants = _sample(variants, sample, default_fwd, default_bwd)
    workload = Workload(problem, devices=list(mesh.devices.flat))
    todo = [v for v in variants if v.ruled_out is None]

    def program_of(variant: Variant) -> tuple[bool, TileConfig]:  # the dK/dV and dQ defaults are one program
        return variant.part != "fwd", variant.config

    programs = list(dict.fromkeys(program_of(v) for v in todo))
    compiled = {}
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        runs = pool.map(lambda key: compile_program(workload, key[1], key[0], implementation), programs)
        for done, (key, result) in enumerate(zip(programs, runs), 1):
            compiled[key] = result
            if progress is not None:
                progress(done, len(programs))
    variants = [compile_variant(workload, v, implementation, compiled[program_of(v)]) if v.ruled_out is None
                else v for v in variants]
    for v in variants:
        if v.compiled:
            v.predicted = tpu_model.predict(problem, chip, **v.params, implementation=implementation)
    return TargetReport(target, device_kind, chip, problem, variants, admitted, time.perf_counter() - started,
                        implementation)


def _over_vmem(variant: Variant) -> bool:
    return variant.ruled_out is not None and "VMEM" in variant.ruled_out


def _edge(problem: Problem, variants: list[Variant], implementation: str) -> list[Variant]:
    """Per kernel, the two variants on either side of the VMEM constraint: the admitted one with the
    largest estimate, and the one it rules out for VMEM with the smallest estimate, to be compiled
    anyway (`forced` keeps the constraint's reason)."""
    edge = []
    for part in PARTS:
        mine = [v for v in variants if v.part == part]
        admitted = [v for v in mine if v.ruled_out is None]
        over = [v for v in mine if _over_vmem(v)]
        if admitted:
            edge.append(max(admitted, key=lambda v: estimate(problem, v, implementation)))
        if over:
            rejected = min(over, key=lambda v: estimate(problem, v, implementation))
            edge.append(replace(rejected, ruled_out=None, forced=rejected.ruled_out))
    return edge


def _sample(variants: list[Variant], sample: int, fwd: FwdParams, bwd: BwdParams) -> list[Variant]:
    """Per kernel, the admitted variant of the default tiles and `sample` others spread evenly over the
    admitted ones (in the space's order); the ruled-out variants stay, to be reported."""
    kept = [v for v in variants if v.ruled_out is not None]
    for part in PARTS:
        admitted = [v for v in variants if v.part == part and v.ruled_out is None]
        default = [v for v in admitted if v.config == TileConfig(fwd, bwd)]
        others = [v for v in admitted if v not in default]
        step = len(others) / sample if sample and others else 0
        kept += default + ([others[int(i * step)] for i in range(min(sample, len(others)))] if step else [])
    return kept


__all__ = ["PARTS", "TARGETS", "compile_program", "compile_step", "compile_target", "compile_variant", "estimate",
           "libtpu_missing", "topology_mesh", "variants_of"]
