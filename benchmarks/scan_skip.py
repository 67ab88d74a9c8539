"""What a skipped tile pair costs the scan kernel: one block, forward and forward+backward, with every
tile pair computed, every pair skipped, and only the diagonal pairs computed.

    python benchmarks/scan_skip.py            # T=512 per block, H=4, D=64, tiles of 64: 64 tile pairs

Segment ids decide the pairs: one segment for all (every pair computed, none masked), different ones
for queries and keys (every pair skipped), one segment per tile (the 8 diagonal pairs computed). Medians
of interleaved runs, in milliseconds. Run it at two commits to compare kernels.
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from tuner.kernels import BACKENDS
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec
from tuner.tuning.timing import compile_timed, run_interleaved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    scan = BACKENDS["scan"]
    t, tile = args.length, args.tile
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, t, 4, 64)), jnp.float32) for _ in range(4))
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    spec = AttentionSpec(scale=0.125, causal=False, has_segments=True)

    def forward(q, k, v, do, q_seg, kv_seg):
        return scan.block_fwd(q, k, v, positions, positions, q_seg, kv_seg, None, spec=spec,
                              params=FwdParams(tile, tile))

    def both(q, k, v, do, q_seg, kv_seg):
        out, lse = forward(q, k, v, do, q_seg, kv_seg)
        return out, scan.block_bwd(q, k, v, out, lse, do, jnp.zeros(lse.shape), positions, positions, q_seg, kv_seg,
                                   None, spec=spec, params=BwdParams(tile, tile))

    one = jnp.ones((1, t), jnp.int32)
    per_tile = jnp.repeat(jnp.arange(t // tile, dtype=jnp.int32), tile)[None]
    cases = {"every pair computed": (one, one), "every pair skipped": (one, 2 * one),
             "diagonal only": (per_tile, per_tile)}
    for name, fn in (("forward", forward), ("forward+backward", both)):
        compiled, _ = compile_timed(fn, (q, k, v, do, one, one))
        times = run_interleaved({case: (lambda i, s=s, c=compiled: c(q, k, v, do, *s)) for case, s in cases.items()},
                                runs=args.runs, warmup=2)
        print(f"{name}: " + ", ".join(f"{case} {times[case].median * 1e3:.2f} ms" for case in cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
