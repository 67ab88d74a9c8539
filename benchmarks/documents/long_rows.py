"""A long packed row's default tile: the tile rule's efficiencies as counted, and counted tile by tile.

    python benchmarks/documents/long_rows.py [--tokens 131072] [--ring 8] [--seed 0]

The rule that picks a packed call's tile (`tuner.semantics.documents.tile_choice`) reads each tile's
efficiency from `documents.efficiency`, which counts a row in at most `COUNTED_TILES` chunks: beyond
that, a short tile is counted as a coarser one. This script counts three packings of a long row both
ways, as shipped and with the cap raised so that every tile of 16 is its own chunk, and says which tile
the rule picks from each. Packings: documents of exponential lengths around 300 and 1000 tokens, and a
long tail (Pareto); the last document fills the row. Writes
`benchmarks/documents/results/long_rows-<tokens>-<date>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402

from tuner.semantics import documents  # noqa: E402
from tuner.semantics.spec import AttentionSpec  # noqa: E402
from tuner.support.tables import table  # noqa: E402


def packings(tokens: int, seed: int) -> dict[str, list[int]]:
    """Document lengths filling a row of `tokens`, per packing."""
    rng = np.random.default_rng(seed)
    drawn = {"about 300": rng.exponential(300, tokens) + 8, "about 1000": rng.exponential(1000, tokens) + 8,
             "long tail": np.minimum(rng.pareto(1.2, tokens) * 200 + 16, tokens // 4)}
    rows = {}
    for name, lengths in drawn.items():
        row = []
        for length in lengths.astype(int):
            if sum(row) + length >= tokens:
                break
            row.append(int(length))
        rows[name] = [*row, tokens - sum(row)]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    shipped = documents.COUNTED_TILES
    results, rows = [], []
    for name, lengths in packings(options.tokens, options.seed).items():
        found = {}
        for how, cap in (("counted", shipped), ("tile by tile", options.tokens // min(documents.PACKED_TILES))):
            documents.COUNTED_TILES = cap
            found[how] = [documents.efficiency(lengths, spec, options.ring, tile) for tile in documents.PACKED_TILES]
        documents.COUNTED_TILES = shipped
        picks = {how: documents.PACKED_TILES[int(documents.tile_choice(jnp.asarray(e)))] for how, e in found.items()}
        results.append({"packing": name, "documents": len(lengths), "efficiency": found, "tile": picks})
        rows.append([name, str(len(lengths)), *(" / ".join(f"{e:.2f}" for e in found[h]) for h in found),
                     *(str(picks[h]) for h in found)])
    tiles = " / ".join(map(str, documents.PACKED_TILES))
    print(table(["packing", "documents", f"counted ({tiles})", f"tile by tile ({tiles})", "tile picked",
                 "picked tile by tile"], rows))
    out = RESULTS / f"long_rows-{options.tokens}-{datetime.date.today()}.json"
    out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "ring": options.ring,
                               "tokens": options.tokens, "counted_tiles": shipped, "rows": results}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
