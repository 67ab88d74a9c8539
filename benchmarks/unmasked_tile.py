"""The scan kernel's default forward tiles where nothing masks tiles out, chosen on the recorded landscapes.

    python benchmarks/unmasked_tile.py [--measure REPEATS]

For each recorded CPU forward landscape of the scan backend whose problem has no position mask and no
segment ids, prints the value over the grid's best of today's default (`ScanBackend.default_params`), of
the default before 2026-11-27 (512 x 256) and of a few fixed (query, key) tile pairs, each cut to the
local length. Then leave-one-out: the pair of 32 to 1024 with the smallest geometric mean over the other
landscapes, and its value on the one left out.

A walk's best point is the least of many noisy values, so it looks better than it is. `--measure` times
the pairs chosen beforehand, 512 x 256 and 128 x 256, again on each problem: REPEATS times each, every
time a median of 5 runs interleaved with the default, as a trial is timed; it prints the median of
128 x 256's time over 512 x 256's.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.kernels import BACKENDS  # noqa: E402

TILES = (32, 64, 128, 256, 512, 1024)
SHOWN = {"before": (512, 256), "128 x 256": (128, 256), "128 x 512": (128, 512), "512 x 512": (512, 512)}
MEASURED = ("before", "128 x 256")  # the two pairs --measure times again


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


replay, landscape_py = _module("replay"), _module("landscape")


def value(landscape, local: int, pair: tuple[int, int]) -> float:
    """The recorded value of (query, key) tiles `pair`, cut to the local length, over the grid's best."""
    seconds = landscape.seconds({"block_q": min(pair[0], local), "block_kv": min(pair[1], local)})
    return seconds / landscape.best


def measure(name: str, local: int, repeats: int) -> float:
    """The median, over `repeats` timings each, of 128 x 256's time over 512 x 256's on problem `name`."""
    trials = landscape_py.trials_for(name, "fwd", runs=5)
    rel: dict[str, list[float]] = {label: [] for label in MEASURED}
    for _ in range(repeats):
        for label in MEASURED:
            block_q, block_kv = SHOWN[label]
            config = trials.space.config({"fwd.block_q": min(block_q, local), "fwd.block_kv": min(block_kv, local)},
                                         trials.default)
            rel[label].append(landscape_py.point(trials, config, "fwd", 5, keep=True)["rel"])
    return statistics.median(rel["128 x 256"]) / statistics.median(rel["before"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=int, default=0, metavar="REPEATS",
                        help="also time 512 x 256 and 128 x 256 again on each problem, REPEATS times each")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one problem's --measure, in its process
    options = parser.parse_args()
    if options.measure < 0:
        parser.error(f"--measure must be a number of repeats, at least 0, got {options.measure}")
    if options.one is not None:
        fields = landscape_py.PROBLEMS[options.one]
        ratio = measure(options.one, fields["seq_len"] // fields["ring_size"], options.measure)
        print(f"{options.one}: 128 x 256 takes {ratio:.3f} of 512 x 256's time (medians of {options.measure} "
              "timings each)", flush=True)
        return 0
    values: dict[str, dict[tuple[int, int], float]] = {}  # landscape -> (block_q, block_kv) -> value
    today: dict[str, float] = {}
    for file in sorted((ROOT / "benchmarks" / "results").glob("landscape-scan-cpu-*.json")):
        recorded, problem, _, _, _ = replay.load(file)
        if problem.spec.has_position_mask or problem.spec.has_segments or not replay.replayable(recorded, "fwd"):
            continue
        landscape = replay.Landscape("fwd", recorded["parts"]["fwd"])
        local = problem.shapes.q_len
        name = file.stem.removeprefix("landscape-scan-cpu-")
        values[name] = {pair: value(landscape, local, pair) for pair in itertools.product(TILES, TILES)}
        fwd = BACKENDS["scan"].default_params(local, local, problem.head_dim)[0]
        today[name] = value(landscape, local, (fwd.block_q, fwd.block_kv))
    print("| landscape | today's default | " + " | ".join(SHOWN) + " |")
    print("|---" * (len(SHOWN) + 2) + "|")
    for name, row in values.items():
        print(f"| {name} | {today[name]:.3f} | " + " | ".join(f"{row[pair]:.3f}" for pair in SHOWN.values()) + " |")
    print()
    for held in values:
        others = [n for n in values if n != held]
        mean = {pair: math.exp(sum(math.log(values[n][pair]) for n in others) / len(others))
                for pair in values[held]}
        pick = min(mean, key=mean.get)
        print(f"left out {held}: picked {pick[0]} x {pick[1]} (geometric mean {mean[pick]:.3f} on the others), "
              f"{values[held][pick]:.3f} on it")
    if options.measure:
        print()
        for name in values:  # each in a process of its own, with as many devices as its ring
            ring = landscape_py.PROBLEMS[name]["ring_size"]
            subprocess.run([sys.executable, __file__, "--measure", str(options.measure), "--one", name], check=True,
                           env={**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={ring}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
