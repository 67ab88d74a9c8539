"""The scan kernel's default tile where positions mask tiles out, chosen on the recorded landscapes.

    python benchmarks/cpu_ring/masked_tile.py

For each recorded CPU landscape of the scan backend whose problem has a position mask (causal, window,
chunk) and no segment ids (those have their own cap, `documents.PACKED_TILE`), prints the recorded value
over the grid's best of the unmasked default (`ScanBackend.default_params`) and of that default with
every tile cut to 64, 128 or 256. Then leave-one-out: the cap with the smallest geometric mean over the
other landscapes, and its value on the one left out.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCH = ROOT / "benchmarks" / "search"  # replay.py and the landscapes it reads
sys.path.insert(0, str(ROOT))

from tuner.kernels import BACKENDS  # noqa: E402
from tuner.strategies.configs import TileConfig, capped  # noqa: E402

_SPEC = importlib.util.spec_from_file_location("replay", SEARCH / "replay.py")
replay = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay)

CAPS = (None, 64, 128, 256)  # None: the unmasked default


def main() -> int:
    values: dict[str, dict[int | None, float]] = {}
    for file in sorted((SEARCH / "results").glob("landscape-scan-cpu-*.json")):
        recorded, problem, _, _, _ = replay.load(file)
        if not problem.spec.has_position_mask or problem.spec.has_segments:
            continue
        shapes = problem.shapes
        plain = TileConfig(*BACKENDS["scan"].default_params(shapes.q_len, shapes.kv_len, *shapes.head_dims))
        for part, data in recorded["parts"].items():
            if "composed" in data:
                continue
            landscape = replay.Landscape(part, data)
            name = f"{file.stem.removeprefix('landscape-scan-cpu-')} {part}"
            values[name] = {}
            for cap in CAPS:
                config = (plain if cap is None else capped(plain, cap)).to_dict()[part]
                config = {k: min(v, shapes.q_len) if k.startswith("block") and v is not None else v
                          for k, v in config.items()}  # tiles are cut to the local lengths
                values[name][cap] = landscape.seconds(config) / landscape.best
    print("| landscape | " + " | ".join("unmasked default" if c is None else f"tiles <= {c}" for c in CAPS) + " |")
    print("|---" * (len(CAPS) + 1) + "|")
    for name, row in values.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in CAPS) + " |")
    print()
    for held in values:
        others = [n for n in values if n != held]
        mean = {c: math.exp(sum(math.log(values[n][c]) for n in others) / len(others)) for c in CAPS}
        pick = min(mean, key=mean.get)
        print(f"left out {held}: picked {pick or 'unmasked'} (geometric mean {mean[pick]:.3f} on the others), "
              f"{values[held][pick]:.3f} on it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
