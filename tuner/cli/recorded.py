"""The verbs of recorded problems: `tuner record` (run a program, keep the attention calls it traces),
`tuner doctor` (what the loader will use for each, and why) and `tuner search --from` (tune them all).

jax is imported only after the options and the file are checked: on the CPU, `search --from` first
sets as many simulated devices as the largest recorded ring needs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tuner.runtime import record
from tuner.cli.options import UsageError, calls_of, check_storage, prepare_output, simulate_cpu_devices
from tuner.semantics.problem import Problem

FROM_FILE = dict(  # flags whose values --from takes from the file (the objective: from each call's gradients)
    objective="fwd+bwd", batch=Problem().batch, seq_len=Problem().seq_len, heads=Problem().heads,
    kv_heads=Problem().kv_heads, head_dim=Problem().head_dim, value_head_dim=None, dtype=Problem().dtype,
    causal=Problem().causal, window=None, chunk=None, segments=0, documents=None, softcap=None, sinks=0,
    ring_size=None, layout=Problem().layout, backend="auto", target=[])


def record_command(args: argparse.Namespace) -> int:
    """Run the command with `TUNER_RECORD` set, then rewrite the file with one line per call; returns
    the command's exit status."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("give the command to record after --, e.g. tuner record --out problems.jsonl -- "
                         "python train.py")
    prepare_output(args.out, "--out")
    path = os.path.abspath(args.out)
    if os.path.exists(path):
        os.remove(path)
    print(f"recording the attention calls of `{' '.join(command)}` into {args.out}", file=sys.stderr)
    try:
        status = subprocess.call(command, env={**os.environ, record.ENV: path})
    except OSError as error:
        raise UsageError(f"cannot run {command[0]!r} ({error.strerror or error}); check the command after --") from None
    recording = record.read(path) if os.path.exists(path) else record.Recording()
    record.write(path, recording.calls)
    for problem in recording.problems:
        print(f"warning: {args.out} {problem}", file=sys.stderr)
    ended = "" if status == 0 else f" (the command exited with status {status}: calls traced before are kept)"
    print(f"recorded {len(recording.calls)} attention call(s) into {args.out}{ended}\n"
          f"  check them: tuner doctor {args.out}\n  tune them:  tuner search --from {args.out} --device DEVICE")
    return status


def _read(path: str) -> record.Recording:
    """The record file's calls; its bad lines are printed as warnings; `UsageError` when it cannot be read
    or holds no valid call."""
    try:
        recording = record.read(path)
    except OSError as error:
        raise UsageError(f"cannot read the record file {path} ({error.strerror or error}); write one with "
                         f"tuner record --out {path} -- python train.py") from None
    for problem in recording.problems:
        print(f"warning: {path} {problem} (skipped)", file=sys.stderr)
    if not recording.calls:
        raise UsageError(f"{path} holds no valid recorded call")
    return recording


def doctor_file(args: argparse.Namespace) -> int:
    from tuner.tuning.autotuning import COVERED, doctor, render_doctor

    recording = _read(args.file)
    checked = doctor(recording.calls, args.db)
    print(render_doctor(checked))
    tunable = [o for o in checked if o.problem is not None]
    covered = sum(o.before in COVERED for o in tunable)
    print(f"\n{covered} of {len(tunable)} tunable problem(s) covered by their own tuned decision"
          + (f"; tune the rest: tuner search --from {args.file} --device DEVICE" if covered < len(tunable) else ""))
    return 0 if covered == len(tunable) else 1


def search_from(args: argparse.Namespace) -> int:
    """`tuner search --from FILE`: tune the recorded problems not tuned yet; 1 when a search failed."""
    given = [f"--{name.replace('_', '-')}" for name, default in FROM_FILE.items()
             if getattr(args, name) != default]
    if given:
        raise UsageError(f"--from takes the problems from {args.from_file}; drop {', '.join(given)}")
    recording = _read(args.from_file)
    if args.storage is not None:
        check_storage(args.storage)
    if args.device == "cpu":
        simulate_cpu_devices(max(c.ring_size for c in recording.calls))
    import dataclasses

    from tuner.tuning.autotuning import COVERED, Report, replay, tune
    from tuner.tuning.search import SearchOptions

    try:
        options = SearchOptions(trials=args.trials, timeout=args.timeout, trial_timeout=args.trial_timeout,
                                sampler=args.sampler, seed=args.seed, storage=args.storage,
                                heartbeat=args.heartbeat, reconnect=args.reconnect, warm_start=args.warm_start,
                                runs=args.runs, calls=calls_of(args), interpret=args.interpret,
                                compile_ahead=args.compile_ahead)
    except ValueError as error:
        raise UsageError(str(error)) from None
    calls = [dataclasses.replace(c, db=args.db or c.db) if c.caller == "loader" else c for c in recording.calls]
    calls = [replay(c) for c in calls]
    outcomes = tune(calls, device=args.device, trials=args.trials, options=options)
    report = Report([dataclasses.replace(o, after=replay(o.call).source) for o in outcomes])
    print(report.render())
    failed = [o for o in report.outcomes if o.note.startswith("search failed")]
    tunable = [o for o in report.outcomes if o.problem is not None]
    covered = sum(o.after in COVERED for o in tunable)
    print(f"\n{covered} of {len(tunable)} tunable problem(s) covered by their own tuned decision"
          + (f"; {len(failed)} search(es) failed" if failed else ""))
    return 1 if failed else 0
