"""What compiling ahead saves on this machine (`tuner search --compile-ahead 0` against `1`), and what reusing a
program built before saves.

    python benchmarks/search/compile_ahead.py [--measure compiler,reuse,search] [--rounds 2] [--compiles 4]
                                              [--backward-points 6]

Three measurements, all on the default problem of `tuner search --device cpu`:

1. the compiler alone: `--compiles` candidates of the search space compiled (forward with residuals and
   backward, as a trial builds them) one after the other, then `--compiles` others two at a time in two
   threads; wall seconds of each;
2. the whole search: `tuner search --device cpu --compile-ahead A` in a fresh cache, A = 0 then 1, for
   `--rounds` rounds; the wall seconds and the time split each run prints;
3. reuse: `--backward-points` candidates that differ from the default in their backward tiles only,
   compiled after the default with the workload's reuse of programs it built (their forward is the
   default's), and the same compiled in a fresh workload with the reuse turned off.

Writes `benchmarks/search/results/compile_ahead-<cores>cpu-<date>.json`; a run that `--measure`s some of them
replaces those in the day's file and keeps the others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"


def candidates(parts: tuple[str, ...]) -> tuple:
    """The default problem, its scan default config and the other configs of the grid of `parts`."""
    from tuner import registry
    from tuner.semantics.problem import Problem

    problem = Problem()
    scan = registry.get("scan")
    default = scan.default_config(problem.shapes, problem.spec)
    return problem, default, [c for c in scan.space(problem.shapes, problem.spec).grid(default, parts) if c != default]


def compiler_alone(count: int) -> dict:
    """Seconds to compile `count` candidates one after the other, and `count` others two at a time."""
    from tuner.tuning.workload import Workload

    problem, _, grid = candidates(("fwd", "bwd"))
    workload = Workload(problem)
    inputs, dout = workload.draw(seed=0)

    def build(config) -> None:
        workload.compile(workload.attend("scan", config), inputs, dout, backward=True)

    started = time.perf_counter()
    for config in grid[:count]:
        build(config)
    alone = time.perf_counter() - started
    pairs = grid[count:2 * count]
    threads = [threading.Thread(target=lambda part=pairs[i::2]: [build(c) for c in part]) for i in range(2)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    side_by_side = time.perf_counter() - started
    return {"compiles": count, "alone_s": alone, "two_at_a_time_s": side_by_side, "ratio": alone / side_by_side}


def reuse(count: int) -> dict:
    """Seconds to compile `count` backward-only variants after the default, with and without reusing programs."""
    from tuner.tuning.workload import Workload

    problem, default, variants = candidates(("bwd",))
    variants = variants[:count]
    seconds = {}
    for label in ("without", "with"):
        workload = Workload(problem)
        if label == "without":
            workload._compiled = lambda lowered: lowered.compile()
        inputs, dout = workload.draw(seed=0)
        workload.compile(workload.attend("scan", default), inputs, dout, backward=True)
        started = time.perf_counter()
        for config in variants:
            workload.compile(workload.attend("scan", config), inputs, dout, backward=True)
        seconds[label] = time.perf_counter() - started
    return {"points": count, "without_reuse_s": seconds["without"], "with_reuse_s": seconds["with"],
            "ratio": seconds["without"] / seconds["with"]}


def search_run(ahead: int) -> dict:
    """One `tuner search --device cpu --compile-ahead ahead` in a fresh cache: wall seconds and its time line."""
    with tempfile.TemporaryDirectory() as home:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", "import sys; from tuner.cli import main; sys.exit(main())",
                               "search", "--device", "cpu", "--compile-ahead", str(ahead)],
                              env={**os.environ, "TUNER_HOME": home}, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
    line = next(line for line in done.stdout.splitlines() if line.startswith("time "))
    spent = {part: float(seconds) for part, seconds in re.findall(r"(compile|check|timing) (\d+) s", line)}
    ahead_s = re.search(r"(\d+) s more compiling ran ahead", line)
    return {"compile_ahead": ahead, "wall_s": wall, "spent_s": spent,
            "ahead_s": float(ahead_s.group(1)) if ahead_s else 0.0, "time_line": line.strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", default="compiler,reuse,search", help="which of the three to measure")
    parser.add_argument("--rounds", type=int, default=2, help="searches with each setting, alternating")
    parser.add_argument("--compiles", type=int, default=4, help="candidates compiled each way")
    parser.add_argument("--backward-points", type=int, default=6, help="backward-only variants compiled each way")
    options = parser.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # the default problem's ring
    sys.path.insert(0, str(ROOT))

    measure = options.measure.split(",")
    unknown = set(measure) - {"compiler", "reuse", "search"}
    if unknown:
        parser.error(f"--measure takes compiler, reuse and search, got {', '.join(sorted(unknown))}")
    out = RESULTS / f"compile_ahead-{os.cpu_count()}cpu-{datetime.date.today()}.json"
    results = json.loads(out.read_text()) if out.exists() else {"cores": os.cpu_count()}
    command = " ".join(["python", *sys.argv])
    if "compiler" in measure:
        compiler = results["compiler"] = {**compiler_alone(options.compiles), "command": command}
        print(f"compiler: {compiler['compiles']} candidates alone {compiler['alone_s']:.1f} s, two at a time "
              f"{compiler['two_at_a_time_s']:.1f} s ({compiler['ratio']:.2f}x)", file=sys.stderr)
    if "reuse" in measure:
        reused = results["reuse"] = {**reuse(options.backward_points), "command": command}
        print(f"reuse: {reused['points']} backward points compiled in {reused['without_reuse_s']:.1f} s without, "
              f"{reused['with_reuse_s']:.1f} s with ({reused['ratio']:.2f}x)", file=sys.stderr)
    if "search" in measure:
        runs = []
        for round_ in range(options.rounds):
            for ahead in (0, 1):
                runs.append(search_run(ahead))
                print(f"round {round_ + 1}, --compile-ahead {ahead}: {runs[-1]['time_line']}", file=sys.stderr)
        median = {a: statistics.median(r["wall_s"] for r in runs if r["compile_ahead"] == a) for a in (0, 1)}
        print(f"search: median {median[0]:.0f} s with --compile-ahead 0, {median[1]:.0f} s with 1 "
              f"({median[0] / median[1]:.2f}x)", file=sys.stderr)
        results["search"] = {"runs": runs, "median_wall_s": {str(a): s for a, s in median.items()},
                             "speedup_of_ahead": median[0] / median[1], "command": command}
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
