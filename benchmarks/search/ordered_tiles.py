"""TPE with tiles offered as ordered ranks (as `tuner search` does) against tiles offered as categories.

    python benchmarks/search/ordered_tiles.py [--seeds 20] [--budget 40] [--files ...]

Offered as a category (`suggest_categorical`), a tile tells TPE nothing about its neighbours: 128 says
nothing about 64 and 256. `tuner.strategies.configs.TileSpace` offers each field of two or more
sizes as its rank among the sorted sizes (`suggest_int(name, 0, n - 1)`), which TPE models as a number.
This replays TPE (as `benchmarks/search/replay.py` does, from the defaults the landscapes were recorded with)
both ways on every recorded forward and backward landscape. Prints, per landscape and way, the median
and 90th percentile number of trials until within 5% of the grid's best, and the incumbent's value
after 6, 12 and 24 trials; writes `benchmarks/search/results/ordered_tiles-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

import optuna  # noqa: E402
import replay  # noqa: E402

from tuner.strategies.configs import TileSpace  # noqa: E402


class CategoryTileSpace(TileSpace):
    """`TileSpace` as it was before it offered ranks: every field a category."""

    def _sizes(self, key: str) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", type=int, default=40, help="trials per replay")
    parser.add_argument("--files", nargs="*", default=None, help="landscape files (default: all recorded)")
    options = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    files = [Path(f) for f in options.files] if options.files else sorted(
        RESULTS.glob("landscape-*.json"))
    rows = []
    print("| landscape | part | valid points | tiles as | trials to 5% (median / p90) | best after 6 / 12 / 24 |")
    print("|---|---|---|---|---|---|")
    for file in files:
        recorded, _, _, space, default = replay.load(file, recorded_default=True)
        if not isinstance(space, TileSpace):
            continue
        for part, data in recorded["parts"].items():
            if "composed" in data:
                continue  # not the search's landscape (replay.py leaves it out too)
            landscapes = {part: replay.Landscape(part, data)}
            grid = space.grid(default, (part,))
            for way, walked in (("categories", CategoryTileSpace(space.candidates)), ("ranks", space)):
                traces = [replay.replay(landscapes, walked, default, "tpe", seed, options.budget, grid)
                          for seed in range(options.seeds)]
                row = {"landscape": file.stem.removeprefix("landscape-"), "part": part, "tiles_as": way,
                       "valid_points": sum(v is not None for v in landscapes[part].values.values()),
                       **replay.summary(traces, options.budget)}
                rows.append(row)
                print(f"| {row['landscape']} | {part} | {row['valid_points']} | {way} | "
                      f"{replay.cells(row, options.budget)} |", flush=True)
    out = RESULTS / f"ordered_tiles-{datetime.date.today().isoformat()}.json"
    replay.save(out, rows, options.seeds, options.budget)
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
