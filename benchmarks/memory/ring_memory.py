"""What one device of the ring holds, this tree against another commit: the compilers' temporaries beside
the analytic floor (`tuner.tuning.memory.floor`), forward and forward+backward.

    python benchmarks/memory/ring_memory.py --tpu v5e:2x2 v6e:2x2 --tokens 32768 131072 524288 1048576 \\
        --against 7d97c04
    python benchmarks/memory/ring_memory.py --cpu --tokens 131072 --kv-heads 8 --head-dim 64 \\
        --dtypes float32 bfloat16 --against 7d97c04

Each side (this tree, and a `git worktree` of `--against`) runs in its own process with its own `tuner`,
compiles the ring of the default implementation at its default tiles (TPU: the Pallas kernels through
libtpu for the topology, nothing runs; CPU: the scan ring on simulated devices) and reads
`memory_analysis()` of one device. Causal, zigzag, a ring of 4, batch 1. Prints a table and writes JSON
with `--out`. On a TPU a last column gives what the compiler's peak holds beyond the arguments and
outputs (its HBM temporaries; `tuner.tuning.memory` says why they differ from its temp count).

The program's arguments have the default row-major layouts; with `--argument-layouts compiler` the
compiler chooses them, as it does where the attention's inputs are made inside the same program (a
model's projections): on a TPU the kernels' heads-major layout, without copies of q and the output's
cotangent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from revisions import check_tree, this_and_against, write_results  # noqa: E402

OBJECTIVES = ("fwd", "fwd+bwd")


def worker(args: argparse.Namespace) -> None:
    """One JSON line per (target, tokens, dtype, objective): the temporaries of this process's `tuner`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.cpu:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    else:
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    check_tree()
    import jax
    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout

    from tuner import registry
    from tuner.semantics.problem import Problem
    from tuner.tuning import compiled
    from tuner.tuning.workload import Workload, vjp_of

    targets = ["cpu"] if args.cpu else args.tpu
    for target in targets:
        devices = jax.devices()[:4] if args.cpu else list(compiled.topology_mesh(target).devices.flat)[:4]
        for dtype in args.dtypes:
            for tokens in args.tokens:
                problem = Problem(seq_len=tokens, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                  dtype=dtype, causal=True, ring_size=4, layout="zigzag")
                workload = Workload(problem, devices=devices)
                chosen = registry.choose("auto", problem.spec, jnp.dtype(dtype), problem.head_dim,
                                         registry.Target(devices[0].platform), shapes=problem.shapes, ring_size=4)
                with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):
                    config = registry.default_config(chosen, problem.shapes, problem.spec, None)
                fn = workload.attend(chosen.name, config)
                inputs, dout = workload.structs()

                def forward_and_backward(x, cotangent, fn=fn):
                    out, vjp = vjp_of(fn, x)
                    return out, vjp(cotangent)

                def placed(*structs) -> dict:
                    if args.argument_layouts == "fixed":
                        return {}
                    return {"in_shardings": jax.tree.map(lambda s: Format(Layout.AUTO, s.sharding), structs)}

                for objective in OBJECTIVES:
                    lowered = (jax.jit(fn, **placed(inputs)).lower(inputs) if objective == "fwd"
                               else jax.jit(forward_and_backward, **placed(inputs, dout)).lower(inputs, dout))
                    memory = lowered.compile().memory_analysis()
                    print(json.dumps({"target": target, "tokens": tokens, "dtype": dtype, "objective": objective,
                                      "implementation": chosen.name, "temp": memory.temp_size_in_bytes,
                                      "arguments": memory.argument_size_in_bytes,
                                      "outputs": memory.output_size_in_bytes,
                                      "peak": memory.peak_memory_in_bytes}), flush=True)


def _cell(temp: int | None, low: int) -> str:
    return "" if temp is None else f"{temp / 2**20:8.1f} ({temp / low:4.2f}x)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--tpu", nargs="+", metavar="TOPOLOGY", help="TPU topologies to compile for (v5e:2x2, ...)")
    where.add_argument("--cpu", action="store_true", help="XLA:CPU, 4 simulated devices")
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072], help="global sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--argument-layouts", choices=("fixed", "compiler"), default="fixed",
                        help="the program's arguments row-major (default), or laid out by the compiler")
    parser.add_argument("--against", help="a git revision to compare with")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from tuner.semantics.problem import Problem
    from tuner.tuning.memory import floor

    forwarded = list(argv if argv is not None else sys.argv[1:])
    this, that = ({(r["target"], r["tokens"], r["dtype"], r["objective"]): r for r in rows}
                  for rows in this_and_against(os.path.abspath(__file__), forwarded, args.against))

    rows = []
    print(f"H={args.heads}/{args.kv_heads}, D={args.head_dim}, causal, zigzag, ring of 4, batch 1, "
          f"argument layouts {args.argument_layouts}; "
          f"temp MiB a device (ratio to the floor)" + (f"; before: {args.against}" if args.against else ""))
    print(f"{'target':<9} {'tokens':>8} {'dtype':<9} {'objective':<8} {'floor':>8} "
          f"{'before':>16} {'after':>16}" + ("" if args.cpu else f" {'after, HBM':>16}"))
    for key, row in this.items():
        target, tokens, dtype, objective = key
        problem = Problem(seq_len=tokens, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                          dtype=dtype, causal=True, ring_size=4, layout="zigzag")
        low = sum(floor(problem.shapes, objective, 4).values())
        before = that.get(key, {}).get("temp")
        hbm = None if args.cpu else row["peak"] - row["arguments"] - row["outputs"]
        rows.append({**row, "floor": low, "before": before, "hbm_temp": hbm})
        print(f"{target:<9} {tokens:>8} {dtype:<9} {objective:<8} {low / 2**20:8.1f} {_cell(before, low):>16} "
              f"{_cell(row['temp'], low):>16}" + ("" if args.cpu else f" {_cell(hbm, low):>16}"))
    write_results(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
