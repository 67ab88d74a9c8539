"""`tuner search --device tpu|gpu --dry-run --target T`: the kernel variants compiled for TPU topologies
(pallas_tpu, by the TPU compiler) or GPUs (triton, by Triton and ptxas) on this host, ranked by a model,
the best stored as `compiled` cache rows."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tuner.cli.options import UsageError, check_writable_cache, problem_of

GPU_TARGETS = ("a100", "h100", "h200", "b200")  # `tuner.models.gpu_model.GPUS`, named here without importing it


def compile_targets(args: argparse.Namespace) -> int:
    """0 when every target has a config (a forward and a backward variant compiled), else 1."""
    from tuner.tuning import compiled

    missing = compiled.libtpu_missing()
    if missing:
        raise UsageError(f"--target: {missing}")
    targets = list(dict.fromkeys(t for arg in args.target for t in
                                 (compiled.TARGETS if arg == "all" else arg.split(","))))
    meshes = {}
    for target in targets:
        try:
            meshes[target] = compiled.topology_mesh(target)
        except ValueError as error:
            raise UsageError(str(error)) from None
    if args.ring_size is not None and any(m.size != args.ring_size for m in meshes.values()):
        sizes = ", ".join(f"{t}: {m.size}" for t, m in meshes.items())
        raise UsageError(f"--ring-size {args.ring_size} does not match the targets' chips ({sizes}); drop "
                         f"--ring-size, a target's ring is its chips")
    if args.samples is not None and args.samples < 0:
        raise UsageError(f"--samples must be zero or more, got {args.samples}")
    args.ring_size = next(iter(meshes.values())).size
    problem = problem_of(args)
    check_writable_cache(args)

    from tqdm import tqdm

    status = 0
    for target, mesh in meshes.items():
        target_problem = dataclasses.replace(problem, ring_size=mesh.size)
        print(f"compiling the pallas_tpu variants of {target_problem.describe()}\n  for {target} "
              f"({mesh.devices.flat[0].device_kind}) with the TPU compiler; nothing runs", file=sys.stderr)
        with tqdm(desc=f"compile {target}", unit="variant", file=sys.stderr, dynamic_ncols=True) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            try:
                report = compiled.compile_target(target_problem, target, sample=args.samples, progress=progress)
            except ValueError as error:
                raise UsageError(str(error)) from None
        print(report.render())
        row = compiled.store(report, args.db)
        if row is None:
            print(f"no config for {target}: no forward or no backward variant compiled")
            status = 1
        else:
            print(f"stored  compiled entry {row['key']} for {report.device_kind}: the loader uses it there until "
                  f"tuner search measures this problem on the TPU\nmodel    {report.chip.source}")
    return status


def compile_gpu_targets(args: argparse.Namespace) -> int:
    """0 when every GPU target has a config (an admitted forward and backward launch), else 1."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise UsageError("--target: triton is not installed (pip install 'ring-tuner[gpu]'); it compiles for GPUs "
                         "on any host")
    targets = list(dict.fromkeys(t for arg in args.target for t in
                                 (GPU_TARGETS if arg == "all" else arg.split(","))))
    for target in targets:
        if target not in GPU_TARGETS:
            raise UsageError(f"--target {target}: not a GPU target; use one of {', '.join(GPU_TARGETS)} or all")
    if args.samples is not None and args.samples < 0:
        raise UsageError(f"--samples must be zero or more, got {args.samples}")
    problem = problem_of(args)
    check_writable_cache(args)

    from tqdm import tqdm

    from tuner.tuning import compiled_gpu

    status = 0
    for target in targets:
        gpu = compiled_gpu.gpu_model.GPUS[target]
        print(f"compiling the triton launches of {problem.describe()}\n  for {target} ({gpu.device_kind}, "
              f"sm_{gpu.arch}) with Triton and ptxas; nothing runs", file=sys.stderr)
        with tqdm(desc=f"compile {target}", unit="launch", file=sys.stderr, dynamic_ncols=True) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            try:
                report = compiled_gpu.compile_gpu_target(problem, target, sample=args.samples, progress=progress)
            except ValueError as error:
                raise UsageError(str(error)) from None
        print(report.render())
        row = compiled_gpu.store(report, args.db)
        if row is None:
            print(f"no config for {target}: no forward, or no pair of backward launches, is admitted")
            status = 1
        else:
            print(f"stored  compiled entry {row['key']} for {gpu.device_kind}: the loader uses it there until "
                  f"tuner search measures this problem on the GPU\nmodel    {gpu.source}")
    return status
