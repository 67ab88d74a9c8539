"""What a skipped tile pair costs the scan kernel: one block, forward and forward+backward, with every
tile pair computed, every pair skipped, and only the diagonal pairs computed.

    python benchmarks/cpu_ring/scan_skip.py                   # T=512 per block, H=4, D=64, tiles of 64: 64 tile pairs
    python benchmarks/cpu_ring/scan_skip.py --against HEAD~1  # the same, beside the kernel of another commit
    python benchmarks/cpu_ring/scan_skip.py --length 1024 --tile 128 --causal --runs 9

Segment ids decide the pairs: one segment for all (every pair computed, none masked), different ones
for queries and keys (every pair skipped), one segment per tile (the diagonal pairs computed). With
`--causal` the first case computes the causal triangle. Medians of interleaved runs, in milliseconds;
with `--against`, the kernel of that commit (`tuner/kernels/scan_kernel.py` and `scan_tiling.py`, read
with `git show`) runs interleaved with this one, and each line gives the ratio this / that.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

from tuner.kernels import scan_kernel
from tuner.semantics.spec import AttentionSpec
from tuner.tuning.timing import compile_timed, run_interleaved

TILING_IMPORT = "from tuner.kernels.scan_tiling import"


def kernel_at(revision: str):
    """The scan kernel module of `revision`, with its own tiling module, imported from a temporary folder."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(__file__)).stdout.strip()
    folder = tempfile.mkdtemp()

    def source(name: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:tuner/kernels/{name}.py"], capture_output=True, text=True,
                              check=True, cwd=root).stdout

    kernel = source("scan_kernel")
    if TILING_IMPORT not in kernel:
        raise SystemExit(f"--against {revision}: its scan_kernel.py does not import its tiling as this tool expects")
    with open(os.path.join(folder, "against_tiling.py"), "w") as f:
        f.write(source("scan_tiling"))
    with open(os.path.join(folder, "against_kernel.py"), "w") as f:
        f.write(kernel.replace(TILING_IMPORT, "from against_tiling import"))
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("against_kernel", os.path.join(folder, "against_kernel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--against", metavar="REVISION", default=None,
                        help="time the scan kernel of this git revision beside this one")
    args = parser.parse_args(argv)
    kernels = {"this": scan_kernel}
    if args.against:
        kernels[args.against] = kernel_at(args.against)
    t, tile = args.length, args.tile
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, t, 4, 64)), jnp.float32) for _ in range(4))
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    spec = AttentionSpec(scale=0.125, causal=args.causal, has_segments=True)

    def pass_of(kernel, backward: bool):
        def run(q, k, v, do, q_seg, kv_seg):
            out, lse = kernel.forward(q, k, v, positions, positions, q_seg, kv_seg, None, spec=spec, block_q=tile,
                                      block_kv=tile)
            if not backward:
                return out, lse
            return out, kernel.backward(q, k, v, lse, do, jnp.zeros(lse.shape), positions, positions, q_seg, kv_seg,
                                        None, spec=spec, dkv_tiles=(tile, tile), dq_tiles=None)
        return run

    one = jnp.ones((1, t), jnp.int32)
    per_tile = jnp.repeat(jnp.arange(t // tile, dtype=jnp.int32), tile)[None]
    cases = {"every pair computed": (one, one), "every pair skipped": (one, 2 * one),
             "diagonal only": (per_tile, per_tile)}
    thunks = {}
    for part, backward in (("forward", False), ("forward+backward", True)):
        for name, kernel in kernels.items():
            compiled, _ = compile_timed(pass_of(kernel, backward), (q, k, v, do, one, one))
            for case, segments in cases.items():
                thunks[(part, case, name)] = lambda i, c=compiled, s=segments: c(q, k, v, do, *s)
    times = run_interleaved(thunks, runs=args.runs, warmup=2)
    for part in ("forward", "forward+backward"):
        cells = []
        for case in cases:
            here = times[(part, case, "this")].median
            cell = f"{case} {here * 1e3:.2f} ms"
            if args.against:
                there = times[(part, case, args.against)].median
                cell += f" ({there * 1e3:.2f} ms at {args.against}, {here / there:.2f}x)"
            cells.append(cell)
        print(f"{part}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
