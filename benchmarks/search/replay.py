"""optuna's samplers replayed on recorded landscapes: how many trials until within 5% of the grid's best.

    python benchmarks/search/replay.py [--seeds 20] [--samplers tpe,gp,random,qmc,grid] [--budget 40] [--warm]
                                       [--default current|recorded] [--out FILE]

Each landscape (`benchmarks/search/landscape.py`, `benchmarks/search/results/landscape-*.json`) gives every point's
value. A replay runs a real optuna study with the sampler as `tuner search` builds it
(`tuner.tuning.study.make_sampler`; `qmc` is optuna's QMCSampler), and asks for configs through the
backend's own `Space.suggest`, as a search does:

- the first trial is the default: today's on the CPU (a TPU chip's as its recording computed it), or with
  `--default recorded` the one each landscape was recorded with; `grid` walks the grid in a seeded
  random order;
- a config tried before is given back (no trial counted) and an untried grid point is queued, as the
  search's claims do;
- a pruned or failed point counts as a trial, as it does in a search;
- a point's recorded value is what the recording measured for the trial: its median over the default's
  median timed in the same run (`rel`), in seconds at the default's median time over the recording (the
  raw seconds drift with the machine, the default's by up to 1.8x in an hour); where the part was
  re-timed to the end (`landscape.py --retime`), a re-timed point's `rel` is the median of its walk and
  its re-timings;
- a timed point's value is its recorded value times a draw of the recording's noise: a log-normal with
  the spread of the re-timed default and best (`noise` in the landscape).

Per objective: `fwd` and `bwd` replay one part's landscape; `fwd+bwd` (where a problem has both) replays
the product space, each trial's value (fwd s + bwd s) / (default fwd s + default bwd s). After each
trial the replay scores what the search would store if it ended there: its best 3 trials, the default
and (fwd+bwd) the best-forward x best-backward combination, re-timed with the noise of 5 runs, the
fastest of them by that re-timing; scored by its *recorded* value against the grid's best. Reported per sampler and
problem, over the seeds: the median and 90th-percentile number of trials until the incumbent is within
5% of the grid's best (`>B` when the budget of B trials did not reach it), and the incumbent's value
over the best after 6, 12 and 24 trials (median). Writes `benchmarks/search/results/replay-<date>.json` and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import optuna  # noqa: E402
from landscape import part_params  # noqa: E402

from tuner import registry  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402
from tuner.tuning.study import make_sampler  # noqa: E402

WITHIN = 1.05
CHECKPOINTS = (6, 12, 24)


class Landscape:
    """One part's recorded points, by config, and its noise."""

    def __init__(self, part: str, recorded: dict):
        self.part = part
        ok = [p for p in recorded["points"] if p["status"] == "ok"]
        self.default_seconds = statistics.median(p["default_seconds"] for p in ok)
        # A point's value is the trial's: its time over the default's, timed in the same run (`rel`). The raw
        # seconds carry the machine's drift over a recording of an hour (the default's own time drifts by
        # up to 1.8x), so they are not compared across points; `rel` is put back in seconds at the default's
        # median, so that a fwd+bwd sum weighs each part by its time.
        # Where `landscape.py --retime` went through every point that may be the best, those points are
        # valued at the median of their walk and their re-timings (a cut-short re-timing would favour the
        # points it reached, so it is not used).
        retimed = recorded.get("retime", {}).get("complete", False)
        self.values: dict[str, float | None] = {}  # config key -> seconds (None: pruned or failed)
        for p in recorded["points"]:
            if p["status"] != "ok":
                self.values.setdefault(key(p["config"]), None)
                continue
            rel = statistics.median([p["rel"], *(p.get("retimed", []) if retimed else [])])
            self.values.setdefault(key(p["config"]), rel * self.default_seconds)
        noise = recorded["noise"]
        logs = [math.log(r) for r in noise["default_rel"]] + [math.log(r / statistics.median(noise["best_rel"]))
                                                              for r in noise["best_rel"]]
        self.sigma = statistics.pstdev(logs)
        self.best = min(v for v in self.values.values() if v is not None)

    def seconds(self, config: dict) -> float | None:
        return self.values.get(key(config))


def replayable(recorded: dict, part: str) -> bool:
    """Whether a landscape file holds `part` as the search sees it. A part recorded in pieces and composed
    (`landscape.py --max-points`) does not: the composition was measured to be off by 22% to 69%
    (benchmarks/search/README.md). Nor does a walk cut short by `landscape.py --deadline`: a sample of the grid."""
    data = recorded["parts"].get(part)
    return data is not None and "composed" not in data and data.get("complete", True)


def key(part_config: dict) -> str:
    return json.dumps({k: v for k, v in part_config.items() if v is not None}, sort_keys=True)


def replay(landscapes: dict[str, Landscape], space, default, sampler_name: str, seed: int, budget: int,
           grid_order: list, warm: list | None = None) -> list[float]:
    """The incumbent's recorded value over the grid's best after each counted trial (len = budget); `warm`
    configs are queued right after the default, as `tuner.tuning.warm` queues them."""
    parts = tuple(landscapes)
    rng = random.Random(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if sampler_name == "qmc":
            sampler = optuna.samplers.QMCSampler(scramble=True, seed=seed, warn_independent_sampling=False)
        else:
            sampler = make_sampler("random" if sampler_name == "grid" else sampler_name, seed, budget)
        study = optuna.create_study(sampler=sampler, direction="minimize")
    pool = list(grid_order)
    rng.shuffle(pool)
    study.enqueue_trial(space.params(default, parts))
    for config in warm or []:
        study.enqueue_trial(space.params(config, parts))
    if sampler_name == "grid":
        for config in pool:
            study.enqueue_trial(space.params(config, parts))
    base = sum(landscapes[p].default_seconds for p in parts)
    best_total = sum(landscapes[p].best for p in parts) / base
    tried: set[str] = set()
    timed: list[tuple[float, dict]] = []  # (noisy value, recorded seconds per part) of each timed trial
    seen: dict[str, tuple[float, dict]] = {}  # per part: the best (noisy seconds, config) seen
    trace: list[float] = []
    given_back = 0
    retime = math.sqrt(3 / 5)  # the search re-times its finalists with 5 runs where trials had 3
    while len(trace) < budget and given_back < 200:
        trial = study.ask()
        config = space.suggest(trial, default, parts)
        name = json.dumps(space.params(config, parts), sort_keys=True)
        if name in tried:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            given_back += 1
            untried = [c for c in pool if json.dumps(space.params(c, parts), sort_keys=True) not in tried]
            if untried:
                study.enqueue_trial(space.params(untried[0], parts))
            elif given_back >= 10:
                break  # the space is covered
            continue
        tried.add(name)
        given_back = 0
        recorded = {p: landscapes[p].seconds(config.to_dict()[p]) for p in parts}
        if any(v is None for v in recorded.values()):
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            noisy = {p: v * math.exp(rng.gauss(0, landscapes[p].sigma)) for p, v in recorded.items()}
            value = sum(noisy.values()) / base
            study.tell(trial, value)
            timed.append((value, recorded))
            for p in parts:
                if p not in seen or noisy[p] < seen[p][0]:
                    seen[p] = (noisy[p], config.to_dict()[p])
        # What the search would store now: the best 3 trials, the default and the best-forward x
        # best-backward combination re-timed, the fastest of them by that re-timing.
        finalists = [r for _, r in sorted(timed, key=lambda t: t[0])[:3]]
        finalists.append({p: landscapes[p].seconds(default.to_dict()[p]) or landscapes[p].default_seconds
                          for p in parts})
        if len(parts) == 2 and len(seen) == 2:
            finalists.append({p: landscapes[p].seconds(seen[p][1]) for p in parts})
        retimed = [(sum(v * math.exp(rng.gauss(0, landscapes[p].sigma * retime)) for p, v in f.items()),
                    sum(f.values())) for f in finalists]
        trace.append(min(retimed)[1] / base / best_total)
    while len(trace) < budget:  # a covered space: the incumbent stays
        trace.append(trace[-1] if trace else math.inf)
    return trace


def load(file: Path, recorded_default: bool = False) -> tuple[dict, Problem, object, object, object]:
    """A landscape file: (recorded, problem, implementation, space, default). The default is the one a search
    starts from now: on the CPU today's (the recording may predate a change of it), on a TPU chip the one
    the recording computed for that chip; with `recorded_default`, the recording's everywhere."""
    recorded = json.loads(file.read_text())
    problem = Problem(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded["problem"].items()})
    implementation = registry.get(recorded["backend"])
    shapes = registry.tile_shapes(implementation, problem.shapes, problem.ring_size, problem.group)
    space = implementation.space(shapes, problem.spec)
    default = implementation.default_config(shapes, problem.spec)
    for part, landscape in recorded["parts"].items():
        if recorded_default or landscape["device_kind"] != "cpu":
            default = space.config(part_params(part, landscape["default"]), default)
    return recorded, problem, implementation, space, default


def warm_configs(file: Path, files: list[Path], part: str, recorded_default: bool = False) -> list:
    """Leave-one-out: what a warm study of `file`'s problem queues when every other recorded problem is
    tuned by a grid search of `part`: each keeps its grid's best and its near-best points (within
    `tuner.cache.NEAR` of the best, fastest first, at most `NEAR_BEST`), and `tuner.tuning.warm` queues up to
    3 configs from the nearest ones (`tuner.cache.lookup.neighbours`), not the default, in this problem's space."""
    from tuner.cache import NEAR, NEAR_BEST, make_row
    from tuner.cache.lookup import neighbours
    from tuner.tuning.warm import CONSIDERED, winners

    recorded, problem, implementation, space, default = load(file, recorded_default)
    versions = registry.versions(implementation)
    kind = recorded["parts"][part]["device_kind"]
    key = registry.problem_key(problem, implementation.name, kind)
    rows = []
    for other in files:
        theirs, their_problem, their_implementation, their_space, their_default = load(other, recorded_default)
        if other == file or not replayable(theirs, part):
            continue
        valued = Landscape(part, theirs["parts"][part])
        ranked = sorted(((valued.seconds(p["config"]), p["config"]) for p in theirs["parts"][part]["points"]
                         if p["status"] == "ok"), key=lambda point: point[0])
        near = [their_space.config(part_params(part, config), their_default)
                for seconds, config in ranked[:NEAR_BEST] if seconds <= NEAR * valued.best]
        their_key = registry.problem_key(their_problem, their_implementation.name, theirs["parts"][part]["device_kind"])
        rows.append(make_row(their_key, near[0], versions=versions, tool_version="replay", objective=part, best_s=1.0,
                             default_s=1.0, speedup=1.0, trials_run=1, trials_pruned=0, study=other.stem,
                             near_best=near))
    family = [r for r in rows if all(r[f] == getattr(key, f) for f in ("op", "backend", "device_kind", "dtype"))]
    near = neighbours(lambda sql, params: family, key, versions, CONSIDERED)
    return [dataclasses.replace(default, **{part: getattr(config, part)})
            for config, _ in winners(near, implementation, space, default, (part,))]


def trials_to_within(trace: list[float]) -> int | None:
    return next((i + 1 for i, v in enumerate(trace) if v <= WITHIN), None)


def summary(traces: list[list[float]], budget: int) -> dict:
    """Over the seeds' traces: the median and 90th percentile number of trials until within 5% (budget + 1
    where never), how many never got there, and the incumbent's median value after each checkpoint."""
    reached = [trials_to_within(t) for t in traces]
    numbers = sorted(r if r is not None else budget + 1 for r in reached)
    return {"median_trials": statistics.median(numbers), "p90_trials": numbers[int(0.9 * (len(numbers) - 1))],
            "never": sum(r is None for r in reached),
            **{f"best_after_{n}": statistics.median(t[n - 1] for t in traces) for n in CHECKPOINTS if n <= budget}}


def cells(row: dict, budget: int) -> str:
    """A summary's `median / p90 | best after 6 / 12 / 24` table cells (`>budget` where never reached)."""
    median, p90 = (f">{budget}" if v > budget else f"{v:g}" for v in (row["median_trials"], row["p90_trials"]))
    after = " / ".join(f"{row[f'best_after_{n}']:.2f}" for n in CHECKPOINTS if f"best_after_{n}" in row)
    return f"{median} / {p90} | {after}"


def save(out: Path, rows: list[dict], seeds: int, budget: int) -> None:
    """Write the rows with the command that made them."""
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "seeds": seeds, "budget": budget,
                               "rows": rows}, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--samplers", default="tpe,gp,random,qmc,grid")
    parser.add_argument("--budget", type=int, default=40, help="trials per replay")
    parser.add_argument("--files", nargs="*", default=None, help="landscape files (default: all recorded)")
    parser.add_argument("--warm", action="store_true", help="also replay TPE warm, leave-one-out: every other "
                                                            "recorded problem tuned to its grid's best")
    parser.add_argument("--default", choices=("current", "recorded"), default="current",
                        help="the first trial: today's default (a TPU chip's as recorded), or the one each "
                             "landscape recorded (the defaults the samplers were compared from)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON written (default benchmarks/search/results/replay-<date>.json)")
    options = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    files = [Path(f) for f in options.files] if options.files else sorted(
        RESULTS.glob("landscape-*.json"))
    rows = []
    for file in files:
        recorded, problem, implementation, space, default = load(file, options.default == "recorded")
        objectives = [(p,) for p in ("fwd", "bwd") if replayable(recorded, p)]
        if len(objectives) == 2:
            objectives.append(("fwd", "bwd"))
        for parts in objectives:
            landscapes = {p: Landscape(p, recorded["parts"][p]) for p in parts}
            grid = space.grid(default, parts)
            size = math.prod(sum(v is not None for v in landscapes[p].values.values()) for p in parts)
            runs = [(sampler, None) for sampler in options.samplers.split(",")]
            if len(parts) == 1 and options.warm:
                runs.append(("tpe", warm_configs(file, files, parts[0], options.default == "recorded")))
            for sampler, warm in runs:
                traces = [replay(landscapes, space, default, sampler, seed, options.budget, grid, warm)
                          for seed in range(options.seeds)]
                rows.append({
                    "problem": file.stem.removeprefix("landscape-").removeprefix("scan-cpu-"),
                    "objective": "+".join(parts),
                    "sampler": sampler if warm is None else f"{sampler}, warm ({len(warm)} queued)",
                    "valid_points": size, **summary(traces, options.budget)})
                print(rows[-1], file=sys.stderr, flush=True)
    lines = ["| problem | objective | valid points (30%) | sampler | trials to 5% (median / p90) | "
             "best after 6 / 12 / 24 |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['problem']} | {r['objective']} | {r['valid_points']} ({0.3 * r['valid_points']:.0f}) | "
                     f"{r['sampler']} | {cells(r, options.budget)} |")
    print("\n".join(lines))
    out = options.out or RESULTS / f"replay-{datetime.date.today().isoformat()}.json"
    save(out, rows, options.seeds, options.budget)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
