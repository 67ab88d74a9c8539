"""The example model's packed training step (`examples/long_context_lm.py --packed`) with its packing declared
to the Flax layer (`packing=`) or not: the first step (trace, compile, run) and the later ones.

    python benchmarks/documents/declared_step.py                 # 8 simulated devices, 1024 tokens, 3 processes each
    python benchmarks/documents/declared_step.py --runs 5 --packing lognormal:4,sigma=0.88

Undeclared, each attention layer compiles one ring per default tile and the rows choose one under
`jax.lax.switch` in every step; declared, one ring. Each measurement is a fresh process (compiled programs
are per process), the two ways interleaved. The default packing is what `Packing.fit` reads from the
example's rows at 1024 tokens. Reported: the medians of the first step and of steps 3 to 8, and their
ratios. Writes `benchmarks/documents/results/declared_step-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def measure(packing: str | None) -> dict[str, float]:
    """One process's first step and median later step, in seconds."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT / "examples"))
    import jax
    import numpy as np

    import long_context_lm

    params, opt_state, step, batch = long_context_lm.build(long_context_lm.Config(packed=True, packing=packing))
    rng, key, seconds = np.random.default_rng(0), jax.random.key(0), []
    for i in range(STEPS):
        tokens, targets, weights, *rows = batch(rng)
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens, targets, weights, jax.random.fold_in(key, i), *rows)
        float(loss)
        seconds.append(time.perf_counter() - start)
    return {"first_s": seconds[0], "later_s": statistics.median(seconds[2:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes for each way")
    parser.add_argument("--packing", default="lognormal:4,sigma=0.88", help="the packing declared")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure one way, print JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one or None)))
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be a positive number of processes, got {args.runs}")
    ways = {"undeclared": "", "declared": args.packing}
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for run in range(args.runs):
        for way, packing in ways.items():
            child = subprocess.run([sys.executable, __file__, "--one", packing], capture_output=True, text=True,
                                   check=True)
            runs[way].append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"run {run + 1}/{args.runs} {way}: {runs[way][-1]}", file=sys.stderr)
    medians = {way: {key: statistics.median(r[key] for r in rows) for key in ("first_s", "later_s")}
               for way, rows in runs.items()}
    ratios = {key: medians["declared"][key] / medians["undeclared"][key] for key in ("first_s", "later_s")}
    for way, m in medians.items():
        print(f"{way:>10}: first step {m['first_s']:.2f} s, later steps {m['later_s'] * 1e3:.0f} ms")
    print(f"declared / undeclared: first step {ratios['first_s']:.2f}x, later steps {ratios['later_s']:.2f}x")
    out = ROOT / "benchmarks" / "documents" / "results" / f"declared_step-{datetime.date.today()}.json"
    out.write_text(json.dumps({"packing": args.packing, "runs": runs, "medians": medians, "ratios": ratios},
                              indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
