"""The `tuner` verbs: each checks its options, calls the API and prints what it returns; the exit status
is 0, 1 when the work ran and failed, 2 for a usage error (a `UsageError`, or a cache request that
cannot be met: `tuner.cache.views.RequestError`), 130 when interrupted.

The modules behind them are imported by the verb that needs them, after its options are checked (on
the CPU the device count must be set before jax starts its client).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from tuner.cache import views
from tuner.cli import recorded
from tuner.cli.options import (UsageError, cache_of, calls_of, check_storage, fail,
                               prepare_device, prepare_output, problem_of, simulate_cpu_devices)


def run_record(args: argparse.Namespace) -> int:
    """`tuner record --out FILE -- COMMAND`: run COMMAND, record its attention calls into FILE."""
    return recorded.record_command(args)


def run_doctor(args: argparse.Namespace) -> int:
    """`tuner doctor FILE`: 0 when every tunable recorded problem has its own tuned decision, else 1."""
    return recorded.doctor_file(args)


def run_list(args: argparse.Namespace) -> int:
    """`tuner list`: a page of the entries matching the filters, with their status."""
    where = {name: getattr(args, name) for name in views.LIST_FILTERS if getattr(args, name) is not None}
    print(views.list_text(cache_of(args), where=where, limit=None if args.all else args.limit, page=args.page))
    return 0


def run_show(args: argparse.Namespace) -> int:
    """`tuner show KEY`: every field of one entry."""
    print(views.show_text(views.find_one(cache_of(args), args.key)))
    return 0


def run_export(args: argparse.Namespace) -> int:
    """`tuner export FILE`: the valid entries (or those under `--key`) as JSON lines; each invalid one named
    on stderr."""
    prepare_output(args.file, "export to")
    print(views.export(cache_of(args), args.file, args.key, warn=lambda line: print(line, file=sys.stderr)))
    return 0


def run_import(args: argparse.Namespace) -> int:
    """`tuner import FILE`: the valid rows of a JSON-lines file into the cache, each rejected line on stderr."""
    print(views.import_file(cache_of(args), args.file, skip_invalid=args.skip_invalid,
                            warn=lambda line: print(line, file=sys.stderr)))
    return 0


def run_clear(args: argparse.Namespace) -> int:
    """`tuner clear`: delete every entry, or the stale and invalid ones."""
    print(views.clear(cache_of(args), stale=args.stale))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """`tuner bench`: the tuned, default, scan and dense attention timed side by side (or the mechanisms)."""
    from tuner.tuning.bench import bench, bench_mechanisms

    prepare_device(args)
    problem = problem_of(args)
    if args.mechanisms is not None and args.backend != "auto":
        raise UsageError("--mechanisms times the mechanisms that run here (or those it names); leave --backend "
                         "at auto")
    try:
        from tuner.tuning.search import check_device

        check_device(args.device)
        if args.mechanisms is not None:
            names = None if args.mechanisms == "all" else [n.strip() for n in args.mechanisms.split(",") if n.strip()]
            report = bench_mechanisms(problem, device=args.device, objective=args.objective, runs=args.runs,
                                      calls=calls_of(args), db=args.db, names=names)[0]
        else:
            report = bench(problem, device=args.device, backend=args.backend, objective=args.objective,
                           runs=args.runs, calls=calls_of(args), db=args.db)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except RuntimeError as error:  # no mechanism could run here, or none ran correctly
        return fail(str(error), status=1)
    print(report)
    return 0


def run_report(args: argparse.Namespace) -> int:
    """`tuner report KEY`: the HTML report of the study behind an entry."""
    from tuner.tuning.report import write_report
    from tuner.tuning.study import default_storage

    if args.out is not None:
        prepare_output(args.out, "--out")  # a bad --out is told before anything is looked up
    if args.storage is not None:
        check_storage(args.storage)
    row = views.find_one(cache_of(args), args.key)
    out = args.out or f"report-{row['key'][:8]}.html"
    if args.out is None:
        prepare_output(out, "--out")  # the default, here: this folder must take it
    storage = args.storage or default_storage(cache_of(args).path)
    try:
        count = write_report(row["study"], storage, out)
    except (KeyError, ValueError, ImportError) as error:
        raise UsageError(str(error)) from None
    print(f"wrote the report of study {row['study']} ({count} trials) to {out}")
    return 0


def run_dashboard(args: argparse.Namespace) -> int:
    """`tuner dashboard`: optuna-dashboard on the study storage, until Ctrl-C."""
    from tuner.tuning.study import DRIVER_HINT, default_storage, open_storage

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be a TCP port (1 to 65535), got {args.port}")
    if args.storage is not None:
        check_storage(args.storage)
    try:
        import optuna_dashboard
    except ImportError:
        raise UsageError(f"tuner dashboard needs optuna-dashboard: {DRIVER_HINT}") from None
    url = args.storage or default_storage(cache_of(args).path)
    print(f"optuna-dashboard on http://{args.host}:{args.port} (studies in {url.split('@')[-1]}); "
          f"Ctrl-C stops it", flush=True)
    try:
        optuna_dashboard.run_server(open_storage(url), host=args.host, port=args.port)
    except KeyboardInterrupt:
        pass
    except OSError as error:
        return fail(f"cannot serve on {args.host}:{args.port} ({error.strerror or error}); pick another --port")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """`tuner generate`: render the standard variants, and compile or lower them."""
    from tuner.kernels import codegen
    from tuner.cli.generate import TEMPLATED, generate

    if args.backend not in TEMPLATED:
        raise UsageError(f"--backend must be one of {', '.join(TEMPLATED)} (the backends with templates), "
                         f"got {args.backend!r}")
    if args.compile and args.backend != "triton":
        raise UsageError("--compile builds Triton kernels for GPU targets; use it with --backend triton")
    if args.lower and args.backend != "pallas_tpu":
        raise UsageError("--lower exports Pallas kernels for TPU; use it with --backend pallas_tpu")
    prepare_output(str(args.out or codegen.generated_dir()), "--out" if args.out else "TUNER_HOME: the folder",
                   folder=True)
    if args.json:
        prepare_output(args.json, "--json")
    targets = []
    for target in filter(None, (args.compile or "").split(",")):
        if not re.fullmatch(r"sm_\d{2,3}", target):
            raise UsageError(f"--compile takes targets like sm_80,sm_90, got {target!r}")
        targets.append(int(target[3:]))
    generated = generate(args.backend, out=args.out, targets=targets, lower=args.lower,
                         dtypes=args.dtypes.split(",") if args.dtypes else None)
    print(generated.render())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(generated.report, out, indent=1)
    return 0


def run_info(args: argparse.Namespace) -> int:
    """`tuner info`: devices, versions, implementations, caches."""
    from tuner.cli.info import info

    for line in info(cache_of(args)):
        print(line)
    return 0


def run_memory(args: argparse.Namespace) -> int:
    """`tuner memory`: one device's memory for a problem, compiled on the spot, beside the ring's floor."""
    import dataclasses

    from tuner.tuning import compiled, memory

    if not 0 <= args.headroom < 1:
        raise UsageError(f"--headroom must be a fraction from 0 to below 1, got {args.headroom}")
    prepare_device(args)
    if args.device == "tpu" and args.target is not None:
        missing = compiled.libtpu_missing()
        if missing:
            raise UsageError(missing)
        try:
            devices = list(compiled.topology_mesh(args.target).devices.flat)
        except ValueError as error:
            raise UsageError(str(error)) from None
        target = args.target
    elif args.device == "gpu" and args.target is not None:
        from tuner.tuning import gpu_topology

        try:
            devices = gpu_topology.devices(args.target)
        except ValueError as error:
            raise UsageError(str(error)) from None
        target = args.target
    else:
        import jax

        if args.target is not None:
            raise UsageError("--target compiles for a TPU topology or a GPU: pass it with --device tpu or gpu")
        devices = [d for d in jax.devices() if d.platform == args.device]
        if not devices:
            raise UsageError(f"no {args.device} device visible to jax: run this where one is, or pass --target "
                             f"(a TPU topology such as v5e:2x2, or a GPU such as h100:8) to compile for it here")
        target = devices[0].device_kind
    problem = problem_of(args)
    if args.ring_size is None:
        problem = dataclasses.replace(problem, ring_size=len(devices))
    if problem.ring_size > len(devices):
        raise UsageError(f"--ring-size {problem.ring_size}: {target} has {len(devices)} devices")
    objectives = memory.OBJECTIVES if args.objective == "both" else (args.objective,)
    try:
        reports = [memory.compiled_memory(problem, devices[:problem.ring_size], target, objective, args.backend,
                                          args.db, args.argument_layouts) for objective in objectives]
    except ValueError as error:
        raise UsageError(str(error)) from None
    except memory.DoesNotFit as error:
        return fail(f"{error}; try a shorter --seq-len or a larger --ring-size", status=1)
    print(memory.render(reports, args.headroom))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """`tuner demo`: a ring on simulated CPU devices, checked and timed."""
    from tuner.cli.demo import demo

    simulate_cpu_devices(args.devices)
    try:
        return demo(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
