"""The `tuner` command line.

    tuner search --device cpu [problem] [--trials N] ...   tune a problem, store the winner in the cache
    tuner search --device tpu --dry-run [problem]          check the TPU kernels without a TPU
    tuner list | show KEY | export FILE | import FILE | clear   the cache
    tuner bench --device cpu [problem]                      tuned vs default vs scan vs dense, one run
    tuner bench --device cpu --mechanisms [problem]         ring vs gathered dense: record the fastest
    tuner generate --backend triton [--compile sm_80,sm_90] render (and compile) the standard variants
    tuner generate --backend pallas_tpu [--lower]           render (and lower for TPU) the standard variants
    tuner report KEY --out FILE                             HTML report of the study behind an entry
    tuner info                                              devices, backends, versions, cache
    tuner demo                                              a ring on simulated CPU devices, checked, timed

Bad arguments print one line saying what to do and exit with status 2; jax is imported only after the
arguments are checked (on the CPU the ring size decides how many devices jax simulates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from tuner.problem import DEVICES, DTYPES, OBJECTIVES, SAMPLERS, Problem
from tuner.spec import LAYOUTS
from tuner.tables import short_params, table


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _fail(message: str, status: int = 2) -> int:
    print(f"tuner: error: {message}", file=sys.stderr)
    return status


def _simulate_cpu_devices(count: int) -> None:
    """Before jax starts: make the CPU client expose `count` devices, and tune on the CPU."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


# --------------------------------------------------------------------------------------------------
# Problem options (search, bench).
# --------------------------------------------------------------------------------------------------


def _window(text: str) -> int | tuple[int, int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT (non-negative ints), got {text!r}") from None
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT (non-negative ints), got {text!r}")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**32 - 1, got {text!r}")
    return value


def _add_problem(parser: argparse.ArgumentParser) -> None:
    d = Problem()
    group = parser.add_argument_group("problem (global shapes; defaults: a small problem)")
    group.add_argument("--device", required=True, choices=DEVICES, help="the hardware to tune on")
    group.add_argument("--batch", type=int, default=d.batch)
    group.add_argument("--seq-len", type=int, default=d.seq_len, help="global sequence length")
    group.add_argument("--heads", type=int, default=d.heads, help="query heads")
    group.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads (GQA)")
    group.add_argument("--head-dim", type=int, default=d.head_dim)
    group.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    group.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal)
    group.add_argument("--window", type=_window, default=None, metavar="W|L,R", help="sliding window")
    group.add_argument("--chunk", type=int, default=None, help="chunked attention: chunk size")
    group.add_argument("--segments", type=int, default=0, metavar="N",
                       help="pack N documents per row (segment ids); 0: none")
    group.add_argument("--softcap", type=_finite, default=None, help="logits soft cap")
    group.add_argument("--sinks", type=int, default=0, metavar="N", help="sink logits per head; 0: none")
    group.add_argument("--ring-size", type=int, default=None,
                       help=f"devices on the ring (CPU: simulated; default {d.ring_size} on the CPU, "
                            f"all devices elsewhere)")
    group.add_argument("--layout", choices=LAYOUTS, default=d.layout)
    group.add_argument("--backend", default="auto", help="auto (the device's best), scan, ...")
    group.add_argument("--db", default=None, help="cache file (default $TUNER_DB, else "
                                                  "$TUNER_HOME/tuning.sqlite)")


def _problem(args: argparse.Namespace) -> Problem:
    ring = args.ring_size if args.ring_size is not None else (Problem().ring_size if args.device == "cpu"
                                                             else None)
    if ring is None:  # gpu / tpu: every device of the platform
        import jax

        ring = len(jax.devices())
    try:
        return Problem(batch=args.batch, seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, window=args.window,
                       chunk_size=args.chunk, segments=args.segments, softcap=args.softcap,
                       sinks=args.sinks, ring_size=ring, layout=args.layout)
    except ValueError as error:  # name the flag, not the field
        message = str(error)
        for field in ("seq_len", "kv_heads", "head_dim", "ring_size", "chunk_size", "batch", "heads",
                      "segments", "sinks", "softcap", "dtype", "layout", "window"):
            flag = "--chunk" if field == "chunk_size" else "--" + field.replace("_", "-")
            message = message.replace(f"{field}=", f"{flag} ").replace(f"{field} must", f"{flag} must")
        raise UsageError(message) from None


CALLS_HELP = ("calls issued back to back per timed run, timed per call: keeps the host's dispatch gap out "
              "of sub-millisecond kernels (default 5 on --device gpu, 1 elsewhere)")


def _calls(args: argparse.Namespace) -> int:
    if args.calls is not None:
        return args.calls
    return 5 if args.device == "gpu" else 1


def _prepare_device(args: argparse.Namespace) -> None:
    if args.device == "cpu":
        _simulate_cpu_devices(args.ring_size or Problem().ring_size)


# --------------------------------------------------------------------------------------------------
# Verbs.
# --------------------------------------------------------------------------------------------------


def _search(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    if args.samples is not None:
        raise UsageError("--samples goes with --dry-run (how many variants to run in the interpreter)")
    from tuner.search import SearchOptions, check_device, resolve_backend, search

    _prepare_device(args)
    problem = _problem(args)
    try:
        options = SearchOptions(objective=args.objective, trials=args.trials, timeout=args.timeout,
                                trial_timeout=args.trial_timeout, sampler=args.sampler, seed=args.seed,
                                storage=args.storage, runs=args.runs, calls=_calls(args),
                                interpret=args.interpret)
        check_device(args.device)
        resolve_backend(args.backend, problem, args.device, args.interpret)
    except ValueError as error:
        raise UsageError(str(error)) from None
    _check_writable_cache(args)
    if args.storage is not None:
        _check_storage(args.storage)

    from tqdm import tqdm

    print(f"tuning {problem.describe()}\n  on {args.device}, objective {args.objective}, "
          f"{args.trials} trials ({args.sampler})", file=sys.stderr)
    bar = tqdm(total=args.trials, desc="search", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def progress(done: int, total: int, status: str) -> None:
        bar.set_postfix_str(status, refresh=False)
        bar.update(done - bar.n)

    try:
        result = search(problem, device=args.device, backend=args.backend, options=options, db=args.db,
                        progress=progress)
    except KeyboardInterrupt:
        bar.close()
        print("\ninterrupted: every finished trial is saved in the study; run the same command again "
              "to resume", file=sys.stderr)
        return 130
    except RuntimeError as error:  # no trial completed
        bar.close()
        return _fail(str(error), status=1)
    bar.close()
    rows = []
    for name, measured in (("default", result.default), ("best", result.best)):
        times = [f"{t.median * 1e3:.1f}" if t is not None else "-" for t in (measured.fwd, measured.bwd)]
        rows.append([name, *times, f"{measured.seconds * 1e3:.1f}",
                     f"{result.default.seconds / measured.seconds:.2f}x",
                     f"fwd({short_params(measured.point.fwd)}) bwd({short_params(measured.point.bwd)})"])
    print(f"{result.backend} backend on {result.device_kind}: {problem.describe()}")
    print(table(["", "fwd ms", "bwd ms", "total ms", "speedup", "params"], rows))
    failed = ", ".join(f"{reason} {count}" for reason, count in sorted(result.failed.items())) or "none"
    print(f"trials   {result.trials_run} in the study ({result.new_trials} run now): "
          f"{result.trials_run - result.trials_pruned - sum(result.failed.values())} complete, "
          f"{result.trials_pruned} pruned, failed: {failed}")
    for failure in result.failures:
        print(f"re-timing skipped {failure}")
    if result.stored:
        print(f"stored   key {result.key.digest} in {result.db_path}")
    else:
        print(f"kept     key {result.key.digest} in {result.db_path}: an earlier result of this study's workers "
              f"({result.stored_speedup:.2f}x) beats this run's ({result.speedup:.2f}x)")
    print(f"study    {result.study} in {result.storage}  ({result.seconds:.0f} s)")
    for line in loader_call(problem):
        print(f"use      {line}")
    print(f"next     `tuner bench` with the same options times them against dense attention; "
          f"`tuner show {result.key.digest[:8]}` prints the entry")
    return 0


def loader_call(problem: Problem) -> list[str]:
    """The runtime loader call that meets `problem`'s cache entry exactly, as lines of Python: the
    mesh, the arrays it takes and the call."""
    ring = problem.ring_size > 1
    options = ['axis_name="sp"'] if ring else []
    options += [text for on, text in ((problem.causal, "causal=True"),
                                      (problem.window is not None, f"sliding_window={problem.window}"),
                                      (problem.chunk_size is not None, f"chunk_size={problem.chunk_size}"),
                                      (problem.softcap is not None, f"logits_soft_cap={problem.softcap}")) if on]
    if ring:
        options += [f'layout="{problem.layout}"', "mesh=mesh"]
    extras, shapes = "", ""
    if problem.segments:
        extras += ", q_segment_ids=segment_ids, kv_segment_ids=segment_ids"
        shapes += f", segment_ids [{problem.batch}, {problem.seq_len}]"
    if problem.sinks:
        extras += ", softmax_aux=sinks"
        shapes += f", sinks [{problem.heads}{'' if problem.sinks == 1 else f', {problem.sinks}'}]"
    lines = []
    if ring:
        lines.append(f'mesh = Mesh(np.array(jax.devices()[:{problem.ring_size}]), ("sp",))')
    lines += [f"attn = get_tuned_ring_attention({', '.join(options)})",
              f"out = attn(q, k, v{extras})  # {problem.dtype} q [{problem.batch}, {problem.seq_len}, {problem.heads}, "
              f"{problem.head_dim}], k/v [{problem.batch}, {problem.seq_len}, {problem.kv_heads}, {problem.head_dim}]"
              f"{shapes}{', global, in token order' if ring else ''}"]
    return lines


def _dry_run(args: argparse.Namespace) -> int:
    if args.device != "tpu":
        raise UsageError(f"--dry-run checks the TPU kernels without a TPU; use it with --device tpu (a "
                         f"--device {args.device} search runs for real here)")
    if args.backend not in ("auto", "pallas_tpu"):
        raise UsageError(f"--dry-run checks the pallas_tpu backend, got --backend {args.backend}")
    args.ring_size = args.ring_size or Problem().ring_size
    _simulate_cpu_devices(args.ring_size)
    problem = _problem(args)
    samples = 3 if args.samples is None else args.samples
    if samples < 0:
        raise UsageError(f"--samples must be zero or more, got {samples}")

    from tqdm import tqdm

    from tuner.backends import pallas_tpu
    from tuner.dryrun import dry_run

    try:
        chip = pallas_tpu.chip()
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(f"dry run of the pallas_tpu search space for {problem.describe()}\n  constraints for TPU "
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
        report = dry_run(problem, samples=samples, seed=args.seed, progress=progress)
    except ValueError as error:
        raise UsageError(str(error)) from None
    finally:
        for bar in bars.values():
            bar.close()
    print(table(["pass", "points", "ruled out", "lower for TPU", "failed to lower"], [
        ["forward", report.fwd_points, report.fwd_points - report.lowered_fwd - report.failed_fwd,
         report.lowered_fwd, report.failed_fwd],
        ["backward", report.bwd_points, report.bwd_points - report.lowered_bwd - report.failed_bwd,
         report.lowered_bwd, report.failed_bwd]]))
    for reason, count in report.ruled_out.most_common():
        print(f"ruled out  {count} x {reason}")
    for failure in report.lowering_failures:
        print(f"failed to lower  {failure}")
    if report.samples:
        print(table(["sample", "params", "vs scan reference", "s"],
                    [["default" if i == 0 else f"random {i}",
                      f"fwd({short_params(s.point.fwd)}) bwd({short_params(s.point.bwd)})",
                      "match" if s.mismatch is None else s.mismatch, f"{s.seconds:.1f}"]
                     for i, s in enumerate(report.samples)]))
    matched = sum(s.mismatch is None for s in report.samples)
    print(f"checked {report.checked} variants: {report.lowered} lower for TPU ({report.kernels} Mosaic kernels), "
          f"{sum(report.ruled_out.values())} ruled out by the constraints, {len(report.lowering_failures)} failed "
          f"to lower; {matched} of {len(report.samples)} samples match the scan reference in the interpreter "
          f"({report.seconds:.0f} s)")
    if report.ok:
        print("next     on a TPU host, the same command without --dry-run is the real search")
    return 0 if report.ok else 1


def _check_writable_cache(args: argparse.Namespace) -> None:
    """Before the first trial: the cache can be written (the default study storage lives in its folder)."""
    from tuner.cache import CacheError

    cache = _cache(args)
    source = "--db" if args.db else ("TUNER_DB" if os.environ.get("TUNER_DB") else "TUNER_HOME")
    try:
        cache.check_writable()
    except CacheError as error:
        raise UsageError(f"{source}: {error}") from None


def _check_output(path: str, flag: str, *, folder: bool = False) -> None:
    """Before the work: `path` (a file, or with `folder` a folder) can be written; else one line
    naming `flag`."""
    target = os.path.abspath(path)
    parent = target if folder else os.path.dirname(target)
    if not folder and os.path.isdir(target):
        raise UsageError(f"{flag} {path} is a folder; give a file path")
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file, not a folder; give a path in a folder")
    if not os.access(probe, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path} is not writable; give a writable path")


def _check_storage(url: str) -> None:
    """`--storage` names a database optuna can use: a well-formed URL with an installed driver, and
    for SQLite a file that can be created."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()
    except sqlalchemy.exc.ArgumentError:
        raise UsageError(f"--storage {url!r} is not a database URL; use e.g. sqlite:///studies.sqlite or "
                         f"postgresql://user@host/db") from None
    except sqlalchemy.exc.NoSuchModuleError:
        raise UsageError(f"--storage {url!r}: no SQLAlchemy driver for {url.split(':')[0]!r}; install it "
                         f"or use sqlite:///PATH") from None
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise UsageError(f"--storage {url!r}: an in-memory study cannot be shared or resumed; give a file, "
                             f"e.g. sqlite:///studies.sqlite")
        folder = os.path.dirname(os.path.abspath(parsed.database)) or "."
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--storage {url!r}: cannot create {folder} ({error.strerror or error})") from None
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--storage {url!r}: {folder} is not writable")


def _cache(args: argparse.Namespace):
    from tuner.cache import Cache

    return Cache(args.db)


def _status(row: dict[str, Any]) -> str:
    """ok, invalid (why: the loader skips it), or stale (which version changed: never used)."""
    from tuner.backends import BACKENDS
    from tuner.cache import current_versions, row_problem, stale_reason

    problem = row_problem(row)
    if problem is not None:
        return f"invalid ({problem})"
    backend = BACKENDS.get(row["backend"])
    if backend is None:
        return f"stale (backend {row['backend']} not in this version)"
    reason = stale_reason(row, current_versions(backend.code_hash(), triton=backend.name == "triton"))
    return f"stale ({reason})" if reason else "ok"


def _features(row: dict[str, Any]) -> str:
    try:
        features = json.loads(row["features"])
        on = [k if v is True else f"{k}={v}" for k, v in features.items() if v not in (None, False, 0)]
    except (TypeError, ValueError, AttributeError, RecursionError):
        return str(row.get("features"))[:40]
    return ",".join(on) or "full"


def _cell(row: dict[str, Any], render) -> str:
    """A table cell of a row that may be invalid: `render(row)`, else "?" (the status column says why)."""
    try:
        return render(row)
    except (TypeError, ValueError, KeyError, AttributeError):
        return "?"


LIST_FILTERS = {"backend": str, "device_kind": str, "layout": str, "dtype": str, "head_dim": int, "ring_size": int}


def _list(args: argparse.Namespace) -> int:
    cache = _cache(args)
    where = {name: getattr(args, name) for name in LIST_FILTERS if getattr(args, name) is not None}
    limit = None if args.all else args.limit
    offset = 0 if args.all else (args.page - 1) * args.limit
    listing = cache.listing(limit=limit, offset=offset, where=where)
    if not listing.rows:
        if listing.total:
            raise UsageError(f"--page {args.page} is past the last page ({listing.total} entries, "
                             f"{args.limit} a page)")
        what = "matching " + " ".join(f"--{n.replace('_', '-')} {v}" for n, v in where.items()) if where else ""
        print(f"no tuned entries {what + ' ' if what else ''}in {cache.path}; run `tuner search --device cpu` "
              f"to add one")
        return 0
    entries = [[_cell(r, lambda r: r["key"]), _cell(r, lambda r: r["backend"]), _cell(r, lambda r: r["device_kind"]),
                _cell(r, lambda r: str(r["ring_size"])), _cell(r, lambda r: r["layout"]),
                _cell(r, lambda r: str(r["batch"])), _cell(r, lambda r: str(r["q_len"])),
                _cell(r, lambda r: f"{r['heads']}/{r['kv_heads']}"), _cell(r, lambda r: str(r["head_dim"])),
                _cell(r, lambda r: r["dtype"]), _features(r), _cell(r, lambda r: r["objective"]),
                _cell(r, lambda r: f"{r['best_s'] * 1e3:.1f}"), _cell(r, lambda r: f"{r['speedup']:.2f}x"),
                _cell(r, lambda r: r["measured_at"][:10]), _status(r)] for r in listing.rows]
    print(table(["key", "backend", "device", "ring", "layout", "B", "Tq", "H/Hkv", "D", "dtype", "features",
                 "objective", "best ms", "speedup", "measured", "status"], entries))
    if limit is not None and listing.total > len(listing.rows):
        last = offset + len(listing.rows)
        more = f"; `tuner list --page {args.page + 1}` for more" if last < listing.total else ""
        print(f"entries {offset + 1}-{last} of {listing.total}{more}, `--all` for every one")
    return 0


def _find_one(args: argparse.Namespace) -> dict[str, Any]:
    rows = _cache(args).find(args.key)
    if not rows:
        raise UsageError(f"no cache entry with a key starting {args.key!r}; `tuner list` shows the keys")
    if len(rows) > 1:
        raise UsageError(f"{len(rows)} entries start with {args.key!r} ({', '.join(str(r['key']) for r in rows[:5])}"
                         f"{', ...' if len(rows) > 5 else ''}); give more of the key")
    return rows[0]


def _show(args: argparse.Namespace) -> int:
    row = _find_one(args)
    width = max(map(len, row))
    for field, value in row.items():
        print(f"{field.ljust(width)}  {value}")
    print(f"{'status'.ljust(width)}  {_status(row)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from tuner.cache import write_jsonl

    _check_output(args.file, "export to")
    rows = _cache(args).find(args.key) if args.key else _cache(args).rows()
    try:
        count = write_jsonl(args.file, rows)
    except OSError as error:
        raise UsageError(f"cannot write {args.file} ({error.strerror or error}); give a writable path") from None
    print(f"exported {count} entr{'y' if count == 1 else 'ies'} to {args.file}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from tuner.cache import parse_jsonl

    try:
        rows, rejected = parse_jsonl(args.file)
    except OSError as error:
        raise UsageError(f"cannot read {args.file} ({error.strerror or error})") from None
    for bad in rejected:
        print(f"{args.file}:{bad.line}: rejected: {bad.reason}", file=sys.stderr)
    if rejected and not args.skip_invalid:
        raise UsageError(f"{len(rejected)} of {len(rows) + len(rejected)} rows of {args.file} are invalid (listed "
                         f"above); nothing was imported; fix them, or pass --skip-invalid to import the "
                         f"{len(rows)} valid rows")
    cache = _cache(args)
    count = cache.put_many(rows)
    skipped = f", skipped {len(rejected)} invalid" if rejected else ""
    print(f"imported {count} entr{'y' if count == 1 else 'ies'} into {cache.path}{skipped}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    cache = _cache(args)
    rows = cache.rows()
    if args.stale:
        rows = [r for r in rows if _status(r) != "ok"]
    count = cache.delete(r["key"] for r in rows)
    print(f"deleted {count} {'stale ' if args.stale else ''}entr{'y' if count == 1 else 'ies'} from {cache.path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tuner.bench import bench, bench_mechanisms

    _prepare_device(args)
    problem = _problem(args)
    if args.mechanisms and args.backend != "auto":
        raise UsageError("--mechanisms times every mechanism that runs here; leave --backend at auto")
    try:
        from tuner.search import check_device

        check_device(args.device)
        if args.mechanisms:
            report = bench_mechanisms(problem, device=args.device, objective=args.objective, runs=args.runs,
                                      calls=_calls(args), db=args.db)[0]
        else:
            report = bench(problem, device=args.device, backend=args.backend, objective=args.objective,
                           runs=args.runs, calls=_calls(args), db=args.db)
    except ValueError as error:
        raise UsageError(str(error)) from None
    except RuntimeError as error:  # no mechanism ran correctly
        return _fail(str(error), status=1)
    print(report)
    return 0


def _report(args: argparse.Namespace) -> int:
    from tuner.search import default_storage, write_report

    _check_output(args.out, "--out")
    if args.storage is not None:
        _check_storage(args.storage)
    row = _find_one(args)
    storage = args.storage or default_storage(_cache(args).path)
    try:
        count = write_report(row["study"], storage, args.out)
    except (KeyError, ValueError, ImportError) as error:
        raise UsageError(str(error)) from None
    print(f"wrote the report of study {row['study']} ({count} trials) to {args.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tuner import codegen
    from tuner.backends import pallas_tpu
    from tuner.backends import triton as triton_backend

    modules = {"triton": triton_backend, "pallas_tpu": pallas_tpu}
    if args.backend not in modules:
        raise UsageError(f"--backend must be one of {', '.join(modules)} (the backends with templates), "
                         f"got {args.backend!r}")
    if args.compile and args.backend != "triton":
        raise UsageError("--compile builds Triton kernels for GPU targets; use it with --backend triton")
    if args.lower and args.backend != "pallas_tpu":
        raise UsageError("--lower exports Pallas kernels for TPU; use it with --backend pallas_tpu")
    _check_output(str(args.out or codegen.generated_dir()), "--out" if args.out else "TUNER_HOME: the folder",
                  folder=True)
    if args.json:
        _check_output(args.json, "--json")
    targets = []
    for target in filter(None, (args.compile or "").split(",")):
        if not re.fullmatch(r"sm_\d{2,3}", target):
            raise UsageError(f"--compile takes targets like sm_80,sm_90, got {target!r}")
        targets.append(int(target[3:]))
    rows, report = [], []
    dtypes = args.dtypes.split(",") if args.dtypes else None
    for variant in modules[args.backend].standard_variants():
        if dtypes is not None and variant.features["dtype"] not in dtypes:
            continue
        path = codegen.render(variant, args.out)
        on = [k for k in ("causal", "window", "chunk", "segments", "softcap") if variant.features[k]]
        rows.append([path.name, variant.features["dtype"], variant.features["head_dim"], ",".join(on) or "full"])
        for capability in targets:
            for entry in triton_backend.standard_resources(variant, capability):
                report.append({"file": path.name, **variant.features, **entry})
        if args.lower:
            problem = codegen.standard_problem(variant)
            fwd, bwd = pallas_tpu.PallasTpuBackend().default_params(problem.local_len, problem.local_len,
                                                                     problem.head_dim)
            report.append({"file": path.name, **variant.features, "local_len": problem.local_len,
                           "fwd_params": fwd.to_dict(), "bwd_params": bwd.to_dict(),
                           "mosaic_kernels": pallas_tpu.lower(problem, fwd, bwd)})
    print(table(["file", "dtype", "D", "features"], rows))
    print(f"rendered {len(rows)} variants into {args.out or codegen.generated_dir()}")
    if targets:
        print(table(["file", "kernel", "target", "tiles", "warps", "stages", "smem KiB", "regs", "stack B", "mma"],
                    [[r["file"], r["kernel"], r["target"], f"{r['block_q']}x{r['block_kv']}", r["num_warps"],
                      r["num_stages"], f"{r['shared'] / 1024:.0f}", r["registers"], r["spill_bytes"], r["mma"]]
                     for r in report]))
    if args.lower:
        print(f"lowered {len(report)} variants for TPU at their default tiles for a {report[0]['local_len']}-token "
              f"shard: {sum(r['mosaic_kernels'] for r in report)} Mosaic kernels" if report else "nothing to lower")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)
    return 0


def _info(args: argparse.Namespace) -> int:
    import jax

    import tuner
    from tuner.backends import BACKENDS
    from tuner.cache import CacheError, current_versions, read_shipped, shipped_dir

    devices = jax.devices()
    print(f"ring-tuner {tuner.__version__}, platform {jax.default_backend()}, {len(devices)} device(s): "
          f"{devices[0].device_kind}")
    versions = current_versions("-", triton=True)
    print("versions: " + ", ".join(f"{k.removesuffix('_version')} {v}" for k, v in versions.items()
                                   if k != "code_hash"))
    rows = [[name, "yes" if backend.unavailable_reason() is None else "no", backend.code_hash(),
             backend.unavailable_reason() or "",
             "yes" if backend.unavailable_reason(interpret=True) is None else "no"]
            for name, backend in BACKENDS.items()]
    print(table(["backend", "available", "code hash", "why not", "interpreter"], rows))
    cache = _cache(args)
    try:
        entries = cache.rows()
        statuses = [_status(r).split(" ")[0] for r in entries]
        print(f"cache: {cache.path} ({len(entries)} tuned, {statuses.count('stale')} stale, "
              f"{statuses.count('invalid')} invalid)")
    except CacheError as error:
        print(f"cache: unusable: {error}")
    shipped = list(read_shipped())
    print(f"shipped: {shipped_dir()} ({len(shipped)} tuned)")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tuner.demo import demo

    _simulate_cpu_devices(args.devices)
    try:
        return demo(args)
    except ValueError as error:
        raise UsageError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tuner", description="Generate, verify, autotune and dispatch ring flash "
                                               "attention for JAX.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)

    search = verbs.add_parser("search", help="tune a problem and store the winner in the cache")
    _add_problem(search)
    tuning = search.add_argument_group("search")
    tuning.add_argument("--objective", choices=OBJECTIVES, default="fwd+bwd")
    tuning.add_argument("--trials", type=int, default=12, help="trials the study should reach (a re-run "
                                                               "resumes and runs the rest)")
    tuning.add_argument("--timeout", type=_finite, default=None, help="seconds for this run's trials")
    tuning.add_argument("--trial-timeout", type=_finite, default=120.0, help="seconds per trial")
    tuning.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    tuning.add_argument("--seed", type=_seed, default=0)
    tuning.add_argument("--runs", type=int, default=3, help="timed runs per trial")
    tuning.add_argument("--calls", type=int, default=None, help=CALLS_HELP)
    tuning.add_argument("--storage", default=None, help="optuna storage URL shared by workers (default: "
                                                        "a SQLite file beside the cache)")
    tuning.add_argument("--interpret", action="store_true", help="run kernel backends in their "
                                                                 "interpreter (CPU checks)")
    tuning.add_argument("--dry-run", action="store_true",
                        help="with --device tpu, without a TPU: enumerate and constrain the search space, "
                             "lower every variant for TPU, run --samples of them in the interpreter")
    tuning.add_argument("--samples", type=int, default=None, help="with --dry-run: variants to run in the "
                                                                  "interpreter against scan (default 3)")
    search.set_defaults(run=_search)

    for name, helptext, run in (("list", "the tuned entries, a page at a time (stale and invalid ones marked)",
                                 _list),
                                ("show", "one entry, every field", _show),
                                ("export", "write entries as JSON lines", _export),
                                ("import", "read entries from JSON lines", _import),
                                ("clear", "delete entries", _clear)):
        verb = verbs.add_parser(name, help=helptext)
        if name == "show":
            verb.add_argument("key", help="the entry's key, or a unique prefix of it")
        if name in ("export", "import"):
            verb.add_argument("file", help="JSON-lines file")
        if name == "export":
            verb.add_argument("--key", default=None, help="only entries whose key starts with this")
        if name == "clear":
            verb.add_argument("--stale", action="store_true", help="only the stale and invalid entries")
        if name == "import":
            verb.add_argument("--skip-invalid", action="store_true",
                              help="import the valid rows when some are invalid (default: import nothing)")
        if name == "list":
            verb.add_argument("--limit", type=int, default=50, help="entries a page (default 50)")
            verb.add_argument("--page", type=int, default=1, help="which page (from 1)")
            verb.add_argument("--all", action="store_true", help="every entry, no paging")
            for field, kind in LIST_FILTERS.items():
                verb.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None,
                                  help=f"only entries with this {field.replace('_', ' ')}")
        verb.add_argument("--db", default=None, help="cache file")
        verb.set_defaults(run=run)

    bench = verbs.add_parser("bench", help="tuned vs default vs scan vs dense attention, side by side")
    _add_problem(bench)
    bench.add_argument("--objective", choices=OBJECTIVES, default="fwd+bwd")
    bench.add_argument("--runs", type=int, default=7)
    bench.add_argument("--calls", type=int, default=None, help=CALLS_HELP)
    bench.add_argument("--mechanisms", action="store_true",
                       help="time the ring backends against gathered dense attention on this ring and record "
                            "the fastest for the problem: get_tuned_ring_attention(backend='auto') follows it")
    bench.set_defaults(run=_bench)

    report = verbs.add_parser("report", help="HTML report of the study behind a cache entry")
    report.add_argument("key", help="the entry's key, or a unique prefix of it")
    report.add_argument("--out", required=True, help="HTML file to write")
    report.add_argument("--storage", default=None, help="optuna storage of the study")
    report.add_argument("--db", default=None, help="cache file")
    report.set_defaults(run=_report)

    generate = verbs.add_parser("generate", help="render the standard kernel variants (and compile them)")
    generate.add_argument("--backend", default="triton", help="whose templates: triton or pallas_tpu")
    generate.add_argument("--out", default=None, help="folder (default: kernels_generated/ of the checkout, "
                                                      "else $TUNER_HOME/kernels_generated)")
    generate.add_argument("--compile", default=None, metavar="sm_80,sm_90",
                          help="also compile every kernel for these targets (no GPU needed) and report "
                               "shared memory, registers, spills and the MMA instructions")
    generate.add_argument("--lower", action="store_true",
                          help="pallas_tpu: also export every variant for TPU (no TPU needed), which runs "
                               "the Mosaic lowering of its kernels")
    generate.add_argument("--dtypes", default=None, metavar="bfloat16,float16",
                          help="only these dtypes (float32 kernels take ptxas about a minute each)")
    generate.add_argument("--json", default=None, help="write the compile or lowering report as JSON")
    generate.set_defaults(run=_generate)

    info = verbs.add_parser("info", help="devices, backends, versions, cache")
    info.add_argument("--db", default=None, help="cache file")
    info.set_defaults(run=_info)

    demo = verbs.add_parser("demo", help="run a ring on simulated CPU devices, check it, time it")
    demo.add_argument("--devices", type=int, default=4, help="ring size (simulated CPU devices)")
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--seq-len", type=int, default=2048, help="global sequence length")
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    demo.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    demo.add_argument("--runs", type=int, default=5)
    demo.set_defaults(run=_demo)
    return parser


POSITIVE = ("devices", "batch", "seq_len", "heads", "kv_heads", "head_dim", "runs", "calls", "trials",
            "ring_size", "chunk", "timeout", "trial_timeout", "limit", "page")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.verb is None:
            parser.print_help()
            return 2
        for name in POSITIVE:
            value = getattr(args, name, None)
            if value is not None and value <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
        return args.run(args)
    except UsageError as error:
        return _fail(str(error))
    except Exception as error:  # the cache and other runtime failures: one line, what to do
        from tuner.cache import CacheError

        if isinstance(error, CacheError):
            return _fail(str(error), status=1)
        if isinstance(error, RuntimeError) and "Unable to initialize backend" in str(error):
            return _fail(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}: {str(error).splitlines()[0]}; "
                         f"unset JAX_PLATFORMS or name a platform this machine has")
        raise


if __name__ == "__main__":
    raise SystemExit(main())
