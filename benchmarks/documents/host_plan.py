"""The documents plan of a NumPy batch on the host (`tuner.layouts.document_order`): its first call and
the median of later ones.

    python benchmarks/documents/host_plan.py [--tokens 32768] [--rows 8] [--ring 8] [--runs 5]

Rows of 16 documents cut at random (seed 0), causal, tiles of 64. A data pipeline calls this on every
batch: the first call is what a new batch shape costs, the median what each later batch costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tuner import layouts  # noqa: E402


def rows_of_documents(tokens: int, rows: int, documents: int = 16, seed: int = 0) -> np.ndarray:
    """int32 segment ids `[rows, tokens]`, each row cut into `documents` at random points."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, tokens), size=documents - 1, replace=False))
        out.append(np.repeat(np.arange(documents), np.diff(np.concatenate([[0], cuts, [tokens]]))))
    return np.stack(out).astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    segments = rows_of_documents(args.tokens, args.rows)
    start = time.perf_counter()
    layouts.document_order(segments, args.ring, tile=64)
    first = time.perf_counter() - start
    later = []
    for _ in range(args.runs):
        start = time.perf_counter()
        layouts.document_order(segments, args.ring, tile=64)
        later.append(time.perf_counter() - start)
    print(f"{args.rows} rows of {args.tokens} tokens on {args.ring} devices: first call {first:.3f} s, "
          f"then median {statistics.median(later):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
