"""`tuner search`: tune a problem and store the winner; with `--dry-run`, check the TPU kernels in the
interpreter or compile for a TPU or GPU target without one.

With backend auto, a platform whose `auto` may run another engine by measurement (`tuner.registry.RIVALS`:
cudnn beside triton on a GPU) has each engine searched in turn, and their winners timed side by side, so that
`get_tuned_ring_attention(backend="auto")` runs the faster one.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING, Any

from tuner.cli import recorded, targets
from tuner.cli.options import (UsageError, calls_of, check_storage, check_writable_cache, fail, prepare_device,
                               problem_of, simulate_cpu_devices)
from tuner.semantics.problem import Problem

if TYPE_CHECKING:
    from tuner.tuning.search import SearchOptions, SearchResult


def run_search(args: argparse.Namespace) -> int:
    """`tuner search`: tune the problem (or with `--dry-run`, check the TPU kernels) and print the summary."""
    if args.dry_run:
        if args.from_file is not None:
            raise UsageError("--from tunes recorded problems on this machine; it does not go with --dry-run")
        return _dry_run(args)
    if args.from_file is not None:
        return recorded.search_from(args)
    if args.samples is not None:
        raise UsageError("--samples goes with --dry-run (how many variants to run in the interpreter)")
    if args.target:
        raise UsageError("--target compiles for a TPU topology or a GPU without one: use it with --dry-run and "
                         "--device tpu or gpu")
    from tuner.tuning.search import SearchOptions, check_device, contenders

    prepare_device(args)
    problem = problem_of(args)
    try:
        options = SearchOptions(objective=args.objective, trials=args.trials, timeout=args.timeout,
                                trial_timeout=args.trial_timeout, sampler=args.sampler, seed=args.seed,
                                storage=args.storage, heartbeat=args.heartbeat, reconnect=args.reconnect,
                                warm_start=args.warm_start, runs=args.runs, calls=calls_of(args),
                                interpret=args.interpret, compile_ahead=args.compile_ahead)
        check_device(args.device)
        engines, passed_over = contenders(problem, args.device, args.backend, args.interpret)
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_writable_cache(args)
    if args.storage is not None:
        check_storage(args.storage)

    several = len(engines) > 1
    options = options.shared_by(len(engines))
    print(f"tuning {problem.describe()}\n  on {args.device}, objective {args.objective}, "
          f"{args.trials} trials ({args.sampler})", file=sys.stderr)
    if several:
        share = "" if options.timeout is None else f", {options.timeout:.0f} s of --timeout each"
        print(f"  auto searches each engine it may run here in turn ({', '.join(e.name for e in engines)}{share}), "
              f"then times their winners side by side", file=sys.stderr)
    for note in passed_over:
        print(f"  not searched: {note}", file=sys.stderr)

    searched, failed = [], []
    for engine in engines:
        if engine is not engines[0]:
            print()
        try:
            searched.append(_search_one(args, problem, engine.name, options, label=several))
        except KeyboardInterrupt:
            print("\ninterrupted: every finished trial is saved in the study; run the same command again "
                  "to resume", file=sys.stderr)
            return 130
        except RuntimeError as error:  # no trial completed
            if len(engines) == 1:
                return fail(str(error), status=1)
            failed.append(engine.name)
            print(f"{engine.name}: {error}", file=sys.stderr)
    if len(searched) > 1:
        _time_side_by_side(args, problem, [result.backend for result in searched], options)
    return 1 if failed else 0


def _search_one(args: argparse.Namespace, problem: Problem, backend: str, options: SearchOptions, *, label: bool
                ) -> SearchResult:
    """One engine's search with a progress bar (named for the engine where `label`); prints its summary and
    returns its `SearchResult`. The first Ctrl-C stops it after the running trial (`KeyboardInterrupt`)."""
    from tqdm import tqdm

    from tuner.cli.usage import search_summary
    from tuner.tuning.search import search

    bar = tqdm(total=args.trials, desc=backend if label else "search", unit="trial", file=sys.stderr,
               dynamic_ncols=True)
    interrupted = []

    def on_interrupt(signum: int, frame: Any) -> None:
        # The first Ctrl-C stops the search after the running trial: raised anywhere inside optuna's trial,
        # a KeyboardInterrupt can leave its heartbeat thread running or a SQLite lock held, and the
        # process then never exits. A second Ctrl-C stops at once.
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(signum)
        print("\ninterrupt: stopping after this trial (press Ctrl-C again to stop at once)", file=sys.stderr)

    def progress(done: int, total: int, status: str) -> None:
        bar.set_postfix_str(status, refresh=False)
        bar.update(done - bar.n)
        if interrupted:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        result = search(problem, device=args.device, backend=backend, options=options, db=args.db,
                        progress=progress)
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
    print("\n".join(search_summary(result)))
    return result


def _time_side_by_side(args: argparse.Namespace, problem: Problem, names: list[str], options: SearchOptions
                       ) -> None:
    """The engines' winners timed side by side on the same inputs (`tuner bench --mechanisms`), which records
    the faster for `backend="auto"`; a bench that cannot run is said, and leaves the search rows to decide."""
    from tuner.tuning.bench import time_winners

    print(f"\ntiming the winners of {', '.join(names)} side by side", file=sys.stderr)
    try:
        report = time_winners(problem, names, device=args.device, options=options, db=args.db)[0]
    except (RuntimeError, ValueError) as error:
        print(f"\nnot timed side by side ({error}): auto takes the fastest search row", file=sys.stderr)
        return
    print(f"\n{report}")


def _dry_run(args: argparse.Namespace) -> int:
    """`tuner search --device tpu --dry-run`: 0 when every variant lowers and every sample matches;
    `--device gpu --dry-run --target`: 0 when every target has a config."""
    if args.device == "gpu":
        if not args.target:
            raise UsageError(f"--device gpu --dry-run compiles the Triton kernels for a GPU without one: name it "
                             f"with --target ({', '.join(targets.GPU_TARGETS)} or all)")
        return targets.compile_gpu_targets(args)
    if args.device != "tpu":
        raise UsageError(f"--dry-run checks the TPU or GPU kernels without the device; use it with --device tpu "
                         f"or --device gpu --target (a --device {args.device} search runs for real here)")
    if args.target:
        return targets.compile_targets(args)
    implementation = targets.over_kernel(args, "pallas_tpu")
    args.ring_size = args.ring_size or Problem().ring_size
    simulate_cpu_devices(args.ring_size)
    problem = problem_of(args)
    samples = 3 if args.samples is None else args.samples
    if samples < 0:
        raise UsageError(f"--samples must be zero or more, got {samples}")

    from tqdm import tqdm

    from tuner.kernels import tpu_memory
    from tuner.tuning.dryrun import dry_run

    try:
        chip = tpu_memory.chip()
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(f"dry run of the pallas_tpu search space in {implementation} for {problem.describe()}\n  constraints for TPU "
          f"{chip.chip_version.value} ({chip.vmem_capacity_bytes // 2**20} MiB VMEM, kernels ask for half; "
          f"TUNER_TPU_CHIP picks another); samples run on {problem.ring_size} simulated CPU devices",
          file=sys.stderr)
    bars: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in bars:
            for bar in bars.values():
                bar.close()
            label = "lower for TPU" if stage == "lower" else "interpret"
            bars[stage] = tqdm(total=total, desc=label, unit="variant" if stage == "lower" else "sample",
                               file=sys.stderr, dynamic_ncols=True)
        bars[stage].update(done - bars[stage].n)

    try:
        report = dry_run(problem, samples=samples, seed=args.seed, progress=progress, implementation=implementation)
    except ValueError as error:
        raise UsageError(str(error)) from None
    finally:
        for bar in bars.values():
            bar.close()
    print(report.render())
    return 0 if report.ok else 1

