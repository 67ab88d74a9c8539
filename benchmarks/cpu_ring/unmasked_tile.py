"""The scan kernel's default tiles where nothing masks tiles out, chosen on the recorded landscapes.

    python benchmarks/cpu_ring/unmasked_tile.py [--part fwd|bwd] [--measure REPEATS]

For each recorded CPU landscape of the part (forward: query x key tiles; backward: the dK/dV kernel's
query x key tiles, dQ fused) of the scan backend whose problem has no position mask and no segment ids,
prints the value over the grid's best of today's default (`ScanBackend.default_params`), of the default
before 2026-11-27 (512 x 256) and of a few fixed tile pairs, each cut to the local length. Then
leave-one-out: the pair of 32 to 1024 with the smallest geometric mean over the other landscapes, and its
value on the one left out.

A walk's best point is the least of many noisy values, so it looks better than it is. `--measure` times
two pairs chosen beforehand again on every unmasked problem of `benchmarks/search/landscape.py` with a landscape
of the forward (the part's candidate, and 512 x 256): REPEATS times each, every time a median of 5 runs
interleaved with the default, as a trial is timed; it prints the median of the candidate's time over
512 x 256's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCH = ROOT / "benchmarks" / "search"  # replay.py, landscape.py and the landscapes
sys.path.insert(0, str(ROOT))

from tuner.kernels import BACKENDS  # noqa: E402
from tuner.kernels.params import BwdParams, FwdParams  # noqa: E402

TILES = (32, 64, 128, 256, 512, 1024)
FIELDS = {"fwd": ("block_q", "block_kv"), "bwd": ("block_q_dkv", "block_kv_dkv")}
BEFORE = (512, 256)  # the default of both parts before 2026-11-27
SHOWN = {"fwd": ((128, 256), (128, 512), (512, 512)), "bwd": ((64, 512), (64, 256), (128, 256))}
CANDIDATE = {"fwd": (128, 256), "bwd": (64, 512)}  # what --measure times against BEFORE


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SEARCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


replay, landscape_py = _module("replay"), _module("landscape")


def value(landscape, part: str, local: int, pair: tuple[int, int]) -> float:
    """The recorded value of tiles `pair`, cut to the local length, over the grid's best."""
    seconds = landscape.seconds({field: min(tile, local) for field, tile in zip(FIELDS[part], pair)})
    return seconds / landscape.best


def measure(name: str, part: str, local: int, repeats: int) -> float:
    """The median, over `repeats` timings each, of the part's candidate's time over 512 x 256's on problem
    `name`."""
    trials = landscape_py.trials_for(name, part, runs=5)
    rel: dict[tuple[int, int], list[float]] = {BEFORE: [], CANDIDATE[part]: []}
    for _ in range(repeats):
        for pair in rel:
            block_q, block_kv = (min(tile, local) for tile in pair)
            tiles = FwdParams(block_q, block_kv) if part == "fwd" else BwdParams(block_q, block_kv)
            config = dataclasses.replace(trials.default, **{part: tiles})
            rel[pair].append(landscape_py.point(trials, config, part, 5, keep=True)["rel"])
    return statistics.median(rel[CANDIDATE[part]]) / statistics.median(rel[BEFORE])


def describe(pair: tuple[int, int]) -> str:
    return f"{pair[0]} x {pair[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("fwd", "bwd"), default="fwd")
    parser.add_argument("--measure", type=int, default=0, metavar="REPEATS",
                        help="also time 512 x 256 and the part's candidate again on each problem, REPEATS times each")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one problem's --measure, in its process
    options = parser.parse_args()
    part, candidate = options.part, describe(CANDIDATE[options.part])
    if options.measure < 0:
        parser.error(f"--measure must be a number of repeats, at least 0, got {options.measure}")
    if options.one is not None:
        fields = landscape_py.PROBLEMS[options.one]
        ratio = measure(options.one, part, fields["seq_len"] // fields["ring_size"], options.measure)
        print(f"{options.one} {part}: {candidate} takes {ratio:.3f} of 512 x 256's time (medians of "
              f"{options.measure} timings each)", flush=True)
        return 0
    values: dict[str, dict[tuple[int, int], float]] = {}  # landscape -> pair -> value
    today: dict[str, float] = {}
    unmasked = []  # problems with a forward landscape: the ones --measure times
    for file in sorted((SEARCH / "results").glob("landscape-scan-cpu-*.json")):
        recorded, problem, _, _, _ = replay.load(file)
        if problem.spec.has_position_mask or problem.spec.has_segments:
            continue
        name = file.stem.removeprefix("landscape-scan-cpu-")
        if replay.replayable(recorded, "fwd"):
            unmasked.append(name)
        if not replay.replayable(recorded, part):
            continue
        landscape = replay.Landscape(part, recorded["parts"][part])
        local = problem.shapes.q_len
        values[name] = {pair: value(landscape, part, local, pair) for pair in itertools.product(TILES, TILES)}
        default = BACKENDS["scan"].default_params(local, local, problem.head_dim)[0 if part == "fwd" else 1]
        today[name] = value(landscape, part, local, tuple(getattr(default, f) for f in FIELDS[part]))
    print(f"| {part} landscape | today's default | 512 x 256 | " + " | ".join(map(describe, SHOWN[part])) + " |")
    print("|---" * (len(SHOWN[part]) + 3) + "|")
    for name, row in values.items():
        print(f"| {name} | {today[name]:.3f} | {row[BEFORE]:.3f} | "
              + " | ".join(f"{row[pair]:.3f}" for pair in SHOWN[part]) + " |")
    print()
    for held in values:
        others = [n for n in values if n != held]
        mean = {pair: math.exp(sum(math.log(values[n][pair]) for n in others) / len(others))
                for pair in values[held]}
        pick = min(mean, key=mean.get)
        print(f"left out {held}: picked {describe(pick)} (geometric mean {mean[pick]:.3f} on the others), "
              f"{values[held][pick]:.3f} on it")
    if options.measure:
        print()
        for name in unmasked:  # each in a process of its own, with as many devices as its ring
            ring = landscape_py.PROBLEMS[name]["ring_size"]
            subprocess.run([sys.executable, __file__, "--part", part, "--measure", str(options.measure), "--one",
                            name], check=True,
                           env={**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={ring}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
