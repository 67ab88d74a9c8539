"""`tuner search --device tpu|gpu --dry-run --target T`: the kernel variants compiled for TPU topologies
(the Pallas kernel, in its ring or another implementation over it, by the TPU compiler) or GPUs (triton, by
Triton and ptxas) on this host, ranked by a model, the best stored as `compiled` cache rows."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

from tuner.cli.options import UsageError, check_writable_cache, problem_of
from tuner.semantics.problem import Problem

GPU_TARGETS = ("a100", "h100", "h200", "b200")  # `tuner.models.gpu_model.GPUS`, named here without importing it


def _targets(args: argparse.Namespace, known: tuple[str, ...]) -> list[str]:
    """--target's names in order, `all` expanded, each named once."""
    return list(dict.fromkeys(t for arg in args.target for t in (known if arg == "all" else arg.split(","))))


def _compile_each(args: argparse.Namespace, jobs: dict[str, tuple[Problem, str]], unit: str,
                  compile_one: Callable[..., Any], store: Callable[[Any, str], dict | None],
                  no_config: str, stored: Callable[[Any, dict], str]) -> int:
    """Compile each target's variants under a progress bar, print the report, store its best.

    `jobs` maps a target to its problem and the banner that says what is compiled; 0 when every target stored
    a config, else 1."""
    if args.samples is not None and args.samples < 0:
        raise UsageError(f"--samples must be zero or more, got {args.samples}")
    from tqdm import tqdm

    status = 0
    for target, (problem, banner) in jobs.items():
        print(banner, file=sys.stderr)
        with tqdm(desc=f"compile {target}", unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            try:
                report = compile_one(problem, target, sample=args.samples, progress=progress)
            except ValueError as error:
                raise UsageError(str(error)) from None
        print(report.render())
        row = store(report, args.db)
        if row is None:
            print(f"no config for {target}: {no_config}")
            status = 1
        else:
            print(stored(report, row))
    return status


def over_kernel(args: argparse.Namespace, kernel: str) -> str:
    """The implementation over the block kernel `kernel` that a dry run's --backend and --a2a-size name."""
    from tuner import registry

    try:
        return registry.over_kernel(kernel, args.backend, 2 if args.a2a_size > 1 else 1).name
    except ValueError as error:
        raise UsageError(f"--dry-run checks the {kernel} kernel: {error} (--a2a-size A makes a problem over two "
                         f"mesh axes)") from None


def compile_targets(args: argparse.Namespace) -> int:
    """0 when every target has a config (a forward and a backward variant compiled), else 1."""
    from tuner.tuning import compiled, compiled_report

    missing = compiled.libtpu_missing()
    if missing:
        raise UsageError(f"--target: {missing}")
    implementation = over_kernel(args, "pallas_tpu")
    meshes = {}
    for target in _targets(args, compiled.TARGETS):
        try:
            meshes[target] = compiled.topology_mesh(target)
        except ValueError as error:
            raise UsageError(str(error)) from None
    if args.ring_size is not None and any(m.size != args.ring_size for m in meshes.values()):
        sizes = ", ".join(f"{t}: {m.size}" for t, m in meshes.items())
        raise UsageError(f"--ring-size {args.ring_size} does not match the targets' chips ({sizes}); drop "
                         f"--ring-size, a target's ring is its chips")
    args.ring_size = next(iter(meshes.values())).size
    problem = problem_of(args)
    check_writable_cache(args)

    jobs = {}
    for target, mesh in meshes.items():
        target_problem = dataclasses.replace(problem, ring_size=mesh.size)
        jobs[target] = (target_problem, f"compiling the Pallas kernel's variants in {implementation} of "
                                        f"{target_problem.describe()}\n  for {target} "
                                        f"({mesh.devices.flat[0].device_kind}) with the TPU compiler; nothing runs")
    return _compile_each(
        args, jobs, "program", functools.partial(compiled.compile_target, implementation=implementation),
        compiled_report.store, "no forward or no backward variant compiled",
        lambda report, row: _stored(row, report.device_kind, "TPU", report.chip.source))


def compile_gpu_targets(args: argparse.Namespace) -> int:
    """0 when every GPU target has a config (an admitted forward and backward launch), else 1."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise UsageError("--target: triton is not installed (pip install 'ring-tuner[gpu]'); it compiles for GPUs "
                         "on any host")
    targets = _targets(args, GPU_TARGETS)
    for target in targets:
        if target not in GPU_TARGETS:
            raise UsageError(f"--target {target}: not a GPU target; use one of {', '.join(GPU_TARGETS)} or all")
    implementation = over_kernel(args, "triton")
    problem = problem_of(args)
    check_writable_cache(args)

    from tuner.tuning import compiled_gpu

    jobs = {}
    for target in targets:
        gpu = compiled_gpu.gpu_model.GPUS[target]
        jobs[target] = (problem, f"compiling the triton launches of {implementation} on {problem.describe()}\n  for "
                                 f"{target} ({gpu.device_kind}, sm_{gpu.arch}) with Triton and ptxas; nothing runs")
    return _compile_each(
        args, jobs, "launch", functools.partial(compiled_gpu.compile_gpu_target, implementation=implementation),
        compiled_gpu.store,
        "no forward, or no pair of backward launches, is admitted",
        lambda report, row: _stored(row, report.gpu.device_kind, "GPU", report.gpu.source))


def _stored(row: dict, device_kind: str, device: str, model: str) -> str:
    return (f"stored  compiled entry {row['key']} for {device_kind}: the loader uses it there until tuner search "
            f"measures this problem on the {device}\nmodel    {model}")
