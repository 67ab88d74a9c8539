"""What a layout costs beside the ring: forward+backward through the loader, each layout over contiguous.

    python benchmarks/documents/layout_overhead.py            # ring 8 simulated, 4096 tokens
    python benchmarks/documents/layout_overhead.py --runs 11

Contiguous holds the tokens in order, so its permutations are the identity; every other layout permutes
q, k, v (and the segment ids and positions) on the way in and the output on the way out, and the
gradients back. Two cases: packed rows (three packings, told the loader) in the documents layout, and
one causal sequence without segment ids in zigzag and striped. Medians of interleaved runs, as ratios to
contiguous in the same run. Writes `benchmarks/documents/results/layout_overhead-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from documents import declared_row, packings, step_inputs, training_step  # noqa: E402

from tuner import get_tuned_ring_attention  # noqa: E402
from tuner.tuning.timing import time_interleaved  # noqa: E402

PACKINGS = ("one long + 16 short", "16 equal", "64 tiny")


def unpacked_step(attn):
    """Forward+backward of `attn` on one causal sequence: the gradients of `<attn(q, k, v), w>`."""
    return lambda q, k, v, w: jax.grad(lambda q, k, v: jnp.vdot(attn(q, k, v), w), argnums=(0, 1, 2))(q, k, v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args(argv)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("sp",))
    q, k, v, w = step_inputs(args.length)
    db = os.path.join(tempfile.mkdtemp(), "empty.sqlite")

    def loader(layout: str, packing: str | None = None):
        return get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout=layout, packing=packing, db=db)

    cases = {}
    for name in PACKINGS:
        declared, seg = declared_row(packings(args.length)[name])
        cases[name] = ({layout: jax.jit(training_step(loader(layout, declared)))
                        for layout in ("contiguous", "documents")}, (q, k, v, w, seg))
    cases["one sequence, no segment ids"] = ({layout: jax.jit(unpacked_step(loader(layout)))
                                              for layout in ("contiguous", "zigzag", "striped")}, (q, k, v, w))
    results = {}
    for name, (steps, inputs) in cases.items():
        times = time_interleaved(steps, [inputs], runs=args.runs, warmup=1)
        base = times["contiguous"].median
        results[name] = {layout: dict(seconds=t.median, over_contiguous=t.median / base) for layout, t in times.items()}
        print(f"{name}: " + ", ".join(f"{layout} {r['seconds'] * 1e3:.0f} ms ({r['over_contiguous']:.3f})"
                                      for layout, r in results[name].items()), flush=True)
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"layout_overhead-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(ring=DEVICES, length=args.length, runs=args.runs,
                       platform=f"{jax.devices()[0].platform} x{DEVICES} simulated", results=results), f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
