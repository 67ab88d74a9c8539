"""The whole landscape of a backend's search space for one problem: every valid point timed as `tuner search`
times a trial.

    python benchmarks/search/landscape.py --list
    python benchmarks/search/landscape.py PROBLEM [--part fwd|bwd|both] [--runs 3] [--noise 5] [--max-points 120]
                                                  [--compile-ahead 0] [--deadline SECONDS]
    python benchmarks/search/landscape.py PROBLEM --retime [--part fwd|bwd|both] [--margin 0.10] [--noise 5]

For each point of the part's grid (`Space.grid` with that part alone: every forward point, or every
backward point), the script does what a trial of `tuner search --objective <part>` does, with the same
`tuner.tuning.trials.Trials` machinery: the constraints first (a pruned point keeps its reason), then
compile, check against the scan reference at float32 (a failed point keeps its reason), then time it
interleaved with the default on fresh inputs (`--runs` medians). A point's value is the trial's value:
its median over the default's median from the same run. As in `tuner search`, `--compile-ahead` points
compile while another is checked or timed (compiles side by side, each timed run with no compile beside it).

Forward and backward act on separate passes, so each is its own landscape; `tuner search`'s fwd+bwd
objective is (fwd seconds + bwd seconds) / (default fwd + default bwd), and the best of each part
combine into its best (the search re-times that combination). A backward grid larger than
`--max-points` is a product: dk/dv tiles x (dq fused, or a separate dq pass with its own tiles). Then
every fused point and every dk/dv point (dq at the default's tiles, separate) and every dq point (dk/dv
at the default's tiles) are timed, a separate point's seconds are composed as
t(dkv, dq_ref) + t(dkv_ref, dq) - t(dkv_ref, dq_ref), and 5 composed points are timed for real to
measure the composition's error.

The noise: at the end the default and the best point are each re-timed against the default `--noise`
times (each a `--runs` median), so a replay can draw a trial's value with the spread it really has.

The winner's curse: a walk's best is the least of 25 to 650 noisy values, so it reads low. `--retime`
re-times (`--noise` times each, against the default the part was recorded with) every point walked within
`--margin` of the best value, a point's value being the median of its walk and its re-timings, until no
un-re-timed point is left that close; the default and the walked best take the noise re-timings as theirs.
Each such point keeps its re-timings (`retimed`), and the part says how far it went (`retime`).

A `gpu-` problem (the GPU plan's shapes, ring of one) walks the Triton backend on the machine's GPU, with
5 calls per timed run as `tuner search --device gpu`. `--deadline` bounds the walk: the points are then
walked in a shuffled order (seed 0), so a walk cut short is a uniform sample of the grid, and the file
says how many points of the grid it holds. The file is written after every point.

Writes `benchmarks/search/results/landscape-scan-cpu-<problem>.json`, or `landscape-triton-<gpu>-<problem>.json`
for a `gpu-` problem (one file per problem, a landscape per part; a later run of another part adds to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
PROBLEMS = {  # name: Problem fields; on the CPU local lengths 512 to 4096, rings of 2 to 8
    "causal-d64-gqa4-r4-l512": dict(seq_len=2048, heads=8, kv_heads=2, head_dim=64, ring_size=4),
    "full-d64-gqa4-r4-l512": dict(seq_len=2048, heads=8, kv_heads=2, head_dim=64, ring_size=4, causal=False),
    "window256-d64-gqa4-r4-l512": dict(seq_len=2048, heads=8, kv_heads=2, head_dim=64, ring_size=4,
                                       window=(256, 0)),
    "causal-d128-gqa8-r2-l1024": dict(seq_len=2048, heads=8, kv_heads=1, head_dim=128, ring_size=2),
    "causal-d128-mha-r8-l512": dict(seq_len=4096, heads=4, kv_heads=4, head_dim=128, ring_size=8),
    "causal-d64-gqa2-r2-l2048-bf16": dict(seq_len=4096, heads=4, kv_heads=2, head_dim=64, ring_size=2,
                                          dtype="bfloat16"),
    "causal-d64-gqa2-r2-l4096": dict(seq_len=8192, heads=2, kv_heads=1, head_dim=64, ring_size=2),
    "docs4-d64-gqa4-r4-l512": dict(seq_len=2048, heads=8, kv_heads=2, head_dim=64, ring_size=4, segments=4),
    "causal-d128-gqa4-r4-l1024-bf16": dict(seq_len=4096, heads=8, kv_heads=2, head_dim=128, ring_size=4,
                                           dtype="bfloat16"),
    "full-d64-gqa4-r4-l512-bf16": dict(seq_len=2048, heads=8, kv_heads=2, head_dim=64, ring_size=4, causal=False,
                                       dtype="bfloat16"),
    "docs8-d64-gqa2-r2-l2048": dict(seq_len=4096, heads=4, kv_heads=2, head_dim=64, ring_size=2, segments=8),
    "full-d128-gqa8-r2-l1024": dict(seq_len=2048, heads=8, kv_heads=1, head_dim=128, ring_size=2, causal=False),
    "full-d64-gqa2-r2-l4096": dict(seq_len=8192, heads=2, kv_heads=1, head_dim=64, ring_size=2, causal=False),
    "full-d128-gqa4-r4-l1024-bf16": dict(seq_len=4096, heads=8, kv_heads=2, head_dim=128, ring_size=4,
                                         dtype="bfloat16", causal=False),
    "full-d64-gqa2-r2-l2048-bf16": dict(seq_len=4096, heads=4, kv_heads=2, head_dim=64, ring_size=2,
                                        dtype="bfloat16", causal=False),
    "full-d128-mha-r4-l2048": dict(seq_len=8192, heads=4, kv_heads=4, head_dim=128, ring_size=4, causal=False),
    "causal-d64-gqa2-r2-l512-bf16": dict(seq_len=1024, heads=4, kv_heads=2, head_dim=64, ring_size=2,
                                         dtype="bfloat16"),
    "causal-d128-gqa4-r2-l512": dict(seq_len=1024, heads=8, kv_heads=2, head_dim=128, ring_size=2),
    "full-d64-mha-r8-l512": dict(seq_len=4096, heads=2, kv_heads=2, head_dim=64, ring_size=8, causal=False),
    # The GPU plan's shapes (16k tokens, hidden 2048), one GPU: the Triton backend.
    "gpu-causal-d128-mha-r1-l4096-bf16": dict(batch=4, seq_len=4096, heads=16, kv_heads=16, head_dim=128,
                                              ring_size=1, dtype="bfloat16"),
    "gpu-full-d128-mha-r1-l4096-bf16": dict(batch=4, seq_len=4096, heads=16, kv_heads=16, head_dim=128,
                                            ring_size=1, dtype="bfloat16", causal=False),
}
GPU_CALLS = 5  # calls per timed run on a GPU, as tuner search's --calls there


def point(trials, config, part: str, runs: int, keep: bool = False) -> dict:
    """One point of the landscape, as a trial of `tuner search --objective part` sees it; its compiled
    program is dropped after (memory stays flat over hundreds of points) unless `keep`."""
    from tuner.tuning.verify import TrialFailed

    entry = {"config": config.to_dict()[part]}
    reason = trials.implementation.violation(trials.tile_shapes, trials.problem.spec, config, (part,))
    if reason is not None:
        return {**entry, "status": "pruned", "reason": reason}
    try:
        compiled, compile_seconds = trials.compile(config, deadline=None)
    except TrialFailed as failure:
        return {**entry, "status": "failed", "reason": str(failure)}
    timings = trials.measure({"candidate": compiled}, runs, deadline=None)
    index = 0 if part == "fwd" else 1
    candidate, default = timings["candidate"][index], timings["default"][index]
    if not keep and config != trials.default:
        trials.built.pop(config, None)
    return {**entry, "status": "ok", "seconds": candidate.median, "default_seconds": default.median,
            "rel": candidate.median / default.median, "compile_s": compile_seconds}


def backward_points(trials, max_points: int) -> tuple[list, list | None, object]:
    """The backward configs to time; for a product too large to walk, also the composition plan
    [(composed config, its dk/dv point, its dq point)] and the reference point both share."""
    from tuner.kernels.params import BwdParams

    space, default = trials.space, trials.default
    grid = space.grid(default, ("bwd",))
    if len(grid) <= max_points:
        return grid, None, None
    d = default.bwd
    ref_kv = ref_dq = (d.block_q_dkv, d.block_kv_dkv)
    dkv = sorted({(c.bwd.block_q_dkv, c.bwd.block_kv_dkv) for c in grid})
    dq = sorted({(c.bwd.block_q_dq, c.bwd.block_kv_dq) for c in grid if not c.bwd.fused_dq})

    def config(kv: tuple[int, int], q: tuple[int, int]):
        return dataclasses.replace(default, bwd=BwdParams(*kv, *q))

    timed = [c for c in grid if c.bwd.fused_dq] + [config(kv, ref_dq) for kv in dkv] + [config(ref_kv, q) for q in dq]
    composed = [(config(kv, q), config(kv, ref_dq), config(ref_kv, q)) for kv in dkv for q in dq]
    return list(dict.fromkeys(timed)), composed, config(ref_kv, ref_dq)


def backend_of(name: str) -> str:
    """The backend a problem's landscape walks: Triton for a `gpu-` problem, the scan ring elsewhere."""
    return "triton" if name.startswith("gpu-") else "scan"


def trials_for(name: str, part: str, runs: int, default: dict | None = None):
    """The `tuner.tuning.trials.Trials` of problem `name` for `part`, as `tuner search --objective part`
    builds them: the reference and the default compiled and checked. `default` (a recorded part's config)
    replaces the backend's default of `part` as the config every point is timed against."""
    from tuner import registry
    from tuner.semantics.problem import Problem
    from tuner.tuning.options import SearchOptions
    from tuner.tuning.shared import Shared
    from tuner.tuning.study import open_storage
    from tuner.tuning.trials import Trials

    problem = Problem(**PROBLEMS[name])
    implementation = registry.get(backend_of(name))
    options = SearchOptions(objective=part, runs=runs, calls=GPU_CALLS if backend_of(name) == "triton" else 1)
    against = None
    if default is not None:
        shapes = registry.tile_shapes(implementation, problem.shapes, problem.ring_size, problem.group)
        space = implementation.space(shapes, problem.spec)
        against = space.config(part_params(part, default), implementation.default_config(shapes, problem.spec))
    with tempfile.TemporaryDirectory() as tmp:  # the trials' claims table; nothing is claimed here
        return Trials(problem, implementation, options, Shared(open_storage(f"sqlite:///{tmp}/s.sqlite")), name,
                      default=against)


def part_params(part: str, config: dict) -> dict:
    """A recorded part's config as the space's parameters."""
    return {f"{part}.{k}": v for k, v in config.items() if v is not None}


def config_key(config: dict) -> str:
    return json.dumps({k: v for k, v in config.items() if v is not None}, sort_keys=True)


def value(entry: dict) -> float:
    """A walked point's value: the median of its walk's `rel` and its re-timings (`--retime`)."""
    return statistics.median([entry["rel"], *entry.get("retimed", [])])


def to_retime(points: list[dict], margin: float) -> list[dict]:
    """The timed points not yet re-timed whose walk is within `margin` of the best value, best walk first.
    Re-timing them until none is left gives every point that may be the best the same number of
    measurements, so the best is no longer the luckiest single walk."""
    ok = [p for p in points if p["status"] == "ok"]
    best = min(value(p) for p in ok)
    return sorted((p for p in ok if "retimed" not in p and p["rel"] <= best * (1 + margin)), key=lambda p: p["rel"])


def retime(name: str, part: str, recorded: dict, runs: int, noise: int, margin: float, deadline: float | None,
           save) -> dict:
    """Re-time `noise` times every point of a whole recorded part that may be its best (`to_retime`),
    against the default it was recorded with; the default and the walked best take the recording's noise
    re-timings as theirs. `recorded["retime"]["complete"]` is false where `deadline` cut it short."""
    if "composed" in recorded or not recorded.get("complete", True):
        raise SystemExit(f"{name} {part}: only a whole walked part can be re-timed")
    started = time.perf_counter()
    points = recorded["points"]
    by_key = {config_key(p["config"]): p for p in points if p["status"] == "ok"}
    for config, rels in ((recorded["default"], recorded["noise"]["default_rel"]),
                         (recorded["noise"]["best_config"], recorded["noise"]["best_rel"])):
        if config_key(config) in by_key and len(rels) == noise:
            by_key[config_key(config)].setdefault("retimed", list(rels))
    trials = trials_for(name, part, runs, recorded["default"])

    def status(complete: bool) -> dict:
        return {"margin": margin, "runs_each": noise, "points": sum("retimed" in p for p in points),
                "complete": complete, "seconds_total": time.perf_counter() - started}

    count = 0
    while todo := to_retime(points, margin):
        if deadline is not None and time.perf_counter() - started > deadline:
            break
        entry = todo[0]
        config = trials.space.config(part_params(part, entry["config"]), trials.default)
        entry["retimed"] = [point(trials, config, part, runs, keep=True)["rel"] for _ in range(noise)]
        trials.built.pop(config, None)
        count += 1
        print(f"{name} {part} re-timed {count}: {entry['rel']:.3f} -> {value(entry):.3f}", file=sys.stderr, flush=True)
        recorded["retime"] = status(complete=False)
        save(recorded)
    recorded["retime"] = status(complete=not todo)
    return recorded


def landscape(name: str, part: str, runs: int, noise: int, max_points: int, ahead: int,
              deadline: float | None = None, save=None) -> dict:
    """Walk `part`'s grid for problem `name`; `save(result)` is called after every point with what is
    walked so far (its "complete" false until the end)."""
    import random

    import jax

    trials = trials_for(name, part, runs)
    started = time.perf_counter()
    if part == "fwd":
        configs, composed, ref = trials.space.grid(trials.default, ("fwd",)), None, None
    else:
        configs, composed, ref = backward_points(trials, max_points)
    if deadline is not None:
        configs = random.Random(0).sample(configs, len(configs))
    points = []
    result = {"part": part, "objective": part, "runs": runs, "calls": trials.options.calls, "compile_ahead": ahead,
              "grid": len(trials.space.grid(trials.default, (part,))), "default": trials.default.to_dict()[part],
              "device_kind": jax.devices()[0].device_kind, "complete": False, "points": points}

    def walk(config) -> dict | None:
        if deadline is not None and time.perf_counter() - started > deadline:
            return None
        return point(trials, config, part, runs)

    with ThreadPoolExecutor(1 + ahead) as pool:  # compiles run ahead; the trials' gate times each point alone
        for number, entry in enumerate(pool.map(walk, configs), 1):
            if entry is None:
                continue
            points.append(entry)
            print(f"{name} {part} {number}/{len(configs)}: {entry['status']} "
                  f"{entry.get('rel', entry.get('reason', ''))}", file=sys.stderr, flush=True)
            if save is not None:
                save(result)
    if len(points) < len(configs):
        print(f"{name} {part}: the deadline stopped the walk at {len(points)} of {len(configs)} points",
              file=sys.stderr)
    if composed is not None:
        by_config = {json.dumps(p["config"], sort_keys=True): p for p in points}

        def seconds(config) -> float | None:
            found = by_config.get(json.dumps(config.to_dict()["bwd"], sort_keys=True))
            return found.get("seconds") if found else None

        reference = seconds(ref)
        estimates = []
        for config, kv, q in composed:
            parts = [seconds(kv), seconds(q)]
            if None in parts or reference is None:
                continue
            estimates.append({"config": config.to_dict()["bwd"], "status": "composed",
                              "seconds": parts[0] + parts[1] - reference})
        checks = []
        for config, _, _ in composed[:: max(1, len(composed) // 5)][:5]:
            measured = point(trials, config, part, runs)
            estimate = next((e for e in estimates if e["config"] == config.to_dict()["bwd"]), None)
            if measured["status"] == "ok" and estimate is not None:
                checks.append({"config": measured["config"], "measured_s": measured["seconds"],
                               "composed_s": estimate["seconds"],
                               "error": estimate["seconds"] / measured["seconds"] - 1})
        result["composed"] = estimates
        result["composition_checks"] = checks
    ok = [p for p in points if p["status"] == "ok"]
    best = min(ok, key=lambda p: p["rel"])
    best_config = trials.space.config(part_params(part, best["config"]), trials.default)
    default_rel, best_rel = [], []
    for _ in range(noise):
        default_rel.append(point(trials, trials.default, part, runs)["rel"])
        best_rel.append(point(trials, best_config, part, runs, keep=True)["rel"])
    result["noise"] = {"default_rel": default_rel, "best_rel": best_rel, "best_config": best["config"]}
    result["seconds_total"] = time.perf_counter() - started
    result["complete"] = len(points) == len(configs)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", nargs="?", help="one of --list")
    parser.add_argument("--list", action="store_true", help="print the problems and stop")
    parser.add_argument("--part", choices=("fwd", "bwd", "both"), default="both")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per point, as tuner search's --runs")
    parser.add_argument("--noise", type=int, default=5, help="re-timings of the default and the best")
    parser.add_argument("--max-points", type=int, default=120, help="a larger backward grid is composed")
    parser.add_argument("--compile-ahead", type=int, default=0,
                        help="points that compile while another is checked or timed (tuner search's option; "
                             "0, its CPU default)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for a part's walk: the points go in a shuffled order and the walk stops "
                             "there (the noise re-timings come after)")
    parser.add_argument("--retime", action="store_true",
                        help="do not walk: re-time the recorded part's points that may be its best, --noise times "
                             "each (--deadline bounds it)")
    parser.add_argument("--margin", type=float, default=0.10,
                        help="with --retime, the points walked within this fraction of the best value")
    options = parser.parse_args()
    if options.list or options.problem is None:
        for name, fields in PROBLEMS.items():
            print(f"{name}: {fields}")
        return 0
    if options.problem not in PROBLEMS:
        parser.error(f"problem must be one of {', '.join(PROBLEMS)}, got {options.problem!r}")
    if options.deadline is not None and not options.deadline > 0:
        parser.error(f"--deadline must be a positive number of seconds, got {options.deadline}")
    if not options.margin > 0:
        parser.error(f"--margin must be a positive fraction, got {options.margin}")
    backend = backend_of(options.problem)
    if backend == "scan":
        ring = PROBLEMS[options.problem]["ring_size"]
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ring}"
    sys.path.insert(0, str(ROOT))
    import jax

    from tuner.semantics.problem import Problem

    device = "cpu" if backend == "scan" else gpu_name(jax.devices()[0].device_kind)
    out = RESULTS / f"landscape-{backend}-{device}-{options.problem}.json"
    recorded = json.loads(out.read_text()) if out.exists() else {
        "backend": backend, "device": device, "problem": dataclasses.asdict(Problem(**PROBLEMS[options.problem])),
        "parts": {}}
    for part in ("fwd", "bwd") if options.part == "both" else (options.part,):
        stamp = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
                 "cores": os.cpu_count()}
        if options.retime:
            if part not in recorded["parts"]:
                parser.error(f"--retime: {out.relative_to(ROOT)} has no {part} part; walk it first")

            def keep(part_recorded: dict, stamp: dict = stamp) -> None:
                part_recorded["retime"].update(stamp)
                out.write_text(json.dumps(recorded, indent=1) + "\n")

            keep(retime(options.problem, part, recorded["parts"][part], options.runs, options.noise,
                        options.margin, options.deadline, keep))
            print(f"re-timed {out.relative_to(ROOT)} ({part})", file=sys.stderr)
            continue

        def save(result: dict, part: str = part, stamp: dict = stamp) -> None:
            recorded["parts"][part] = {**result, **stamp}
            out.write_text(json.dumps(recorded, indent=1) + "\n")

        save(landscape(options.problem, part, options.runs, options.noise, options.max_points,
                       options.compile_ahead, options.deadline, save))
        print(f"wrote {out.relative_to(ROOT)} ({part})", file=sys.stderr)
    return 0


def gpu_name(device_kind: str) -> str:
    """A file-name word for a GPU: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    words = device_kind.lower().replace("nvidia", "").split()
    return words[0] if words else "gpu"


if __name__ == "__main__":
    sys.exit(main())
