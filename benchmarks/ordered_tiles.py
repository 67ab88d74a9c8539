"""An experiment for the search's sampler: tiles offered to TPE as ordered ranks instead of categories.

    python benchmarks/ordered_tiles.py [--seeds 20] [--budget 40] [--files ...]

`tuner search` offers each tile field to optuna as a category (`suggest_categorical`), so TPE learns
nothing about 128 from 64 and 256. This replays TPE (as `benchmarks/replay.py` does, from the defaults
the landscapes were recorded with) twice on every recorded forward and backward landscape: with the
tiles as categories, and with each tile field suggested as its rank among the sorted candidates
(`suggest_int(name, 0, n - 1)`), which TPE models as a number. Prints, per landscape and way, the
median and 90th percentile number of trials until within 5% of the grid's best, and the incumbent's
value after 6, 12 and 24 trials; writes `benchmarks/results/ordered_tiles-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import optuna  # noqa: E402
import replay  # noqa: E402

from tuner.kernels.params import BwdParams, FwdParams  # noqa: E402
from tuner.strategies.implementations import TileConfig, TileSpace  # noqa: E402


class RankedTileSpace(TileSpace):
    """`TileSpace` with every tile field of two or more sizes suggested as its rank among the sorted sizes."""

    def _choices(self, part: str, name: str) -> tuple[int, ...] | None:
        space = self.candidates
        choices = space.fwd.get(name) if part == "fwd" else space.bwd.get(name)
        if part == "bwd" and name in ("block_q_dq", "block_kv_dq"):
            choices = space.dq_tiles
        if choices and len(choices) > 1 and all(isinstance(c, int) for c in choices):
            return tuple(sorted(choices))
        return None

    def _pick(self, trial, part: str, name: str, choices) -> int:
        ranked = self._choices(part, name)
        if ranked is None:
            return trial.suggest_categorical(f"{part}.{name}", choices)
        return ranked[trial.suggest_int(f"{part}.{name}", 0, len(ranked) - 1)]

    def suggest(self, trial, default: TileConfig, parts: tuple[str, ...]) -> TileConfig:
        fwd, bwd = default.fwd, default.bwd
        space = self.candidates
        if "fwd" in parts:
            fwd = FwdParams(**{n: self._pick(trial, "fwd", n, c) for n, c in space.fwd.items()})
        if "bwd" in parts:
            fields = {n: self._pick(trial, "bwd", n, c) for n, c in space.bwd.items()}
            passes = tuple(p for p in space.dq_passes if p == "fused" or space.dq_tiles)
            if trial.suggest_categorical("bwd.dq_pass", passes) == "separate":
                for name in ("block_q_dq", "block_kv_dq"):
                    fields[name] = self._pick(trial, "bwd", name, space.dq_tiles)
            bwd = BwdParams(**fields)
        return TileConfig(fwd, bwd)

    def params(self, config: TileConfig, parts: tuple[str, ...]) -> dict:
        params = super().params(config, parts)
        for key, value in params.items():
            part, name = key.split(".", 1)
            ranked = self._choices(part, name)
            if ranked is not None:
                params[key] = ranked.index(value)
        return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", type=int, default=40, help="trials per replay")
    parser.add_argument("--files", nargs="*", default=None, help="landscape files (default: all recorded)")
    options = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    files = [Path(f) for f in options.files] if options.files else sorted(
        (ROOT / "benchmarks" / "results").glob("landscape-*.json"))
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
            for way, walked in (("categories", space), ("ranks", RankedTileSpace(space.candidates))):
                traces = [replay.replay(landscapes, walked, default, "tpe", seed, options.budget, grid)
                          for seed in range(options.seeds)]
                reached = sorted(r or options.budget + 1 for r in map(replay.trials_to_within, traces))
                p90 = reached[int(0.9 * (len(reached) - 1))]
                row = {"landscape": file.stem.removeprefix("landscape-"), "part": part, "tiles_as": way,
                       "valid_points": sum(v is not None for v in landscapes[part].values.values()),
                       "median_trials": statistics.median(reached), "p90_trials": p90,
                       **{f"best_after_{n}": statistics.median(t[n - 1] for t in traces)
                          for n in replay.CHECKPOINTS if n <= options.budget}}
                rows.append(row)
                after = " / ".join(f"{row[f'best_after_{n}']:.2f}" for n in replay.CHECKPOINTS if n <= options.budget)
                text = [f">{options.budget}" if v > options.budget else f"{v:g}"
                        for v in (row["median_trials"], row["p90_trials"])]
                print(f"| {row['landscape']} | {part} | {row['valid_points']} | {way} | {text[0]} / {text[1]} | "
                      f"{after} |", flush=True)
    out = ROOT / "benchmarks" / "results" / f"ordered_tiles-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "seeds": options.seeds,
                               "budget": options.budget, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
