"""What one device holds under each strategy (the ring, all-to-all, all-gather), this tree against another
commit: the compiler's temporaries beside the ring's analytic floor, forward and forward+backward.

    python benchmarks/memory/strategy_memory.py --tokens 131072 --against 0f8a2c1 --time 16384

Each side (this tree, and a `git worktree` of `--against`) runs in its own process with its own `tuner`,
compiles what the loader runs for each implementation at its default tiles on 4 simulated CPU devices
(`tuner.tuning.memory.analysis`; H=Hkv=8, D=64, causal, zigzag, batch 1) and reads `memory_analysis()`
of one device. With `--time N` it also runs the forward and backward at N tokens, 7 times after a
warm-up, and reports the median. Prints a table and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from revisions import check_tree, this_and_against, write_results  # noqa: E402

IMPLEMENTATIONS = ("scan", "all_to_all", "all_gather")
OBJECTIVES = ("fwd", "fwd+bwd")


def _problem(tokens: int, dtype: str):
    from tuner.semantics.problem import Problem

    return Problem(seq_len=tokens, heads=8, kv_heads=8, head_dim=64, dtype=dtype, causal=True, ring_size=4,
                   layout="zigzag")


def _seconds(implementation: str, tokens: int, dtype: str, devices: list) -> float:
    """The median of 7 runs of the forward and backward, after one."""
    import statistics
    import time

    import jax

    from tuner.tuning.decision import loader_plan
    from tuner.tuning.workload import Workload, vjp_of

    problem = _problem(tokens, dtype)
    workload = Workload(problem, devices=devices)
    with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):
        plan = loader_plan(problem, implementation, None)
    fn = workload.attend(plan.backend, plan.config)
    inputs, dout = workload.structs()

    @jax.jit
    def forward_and_backward(x, cotangent):
        out, vjp = vjp_of(fn, x)
        return out, vjp(cotangent)

    key = jax.random.PRNGKey(0)
    x = jax.tree.map(lambda s: jax.device_put(jax.random.normal(key, s.shape, s.dtype), s.sharding), inputs)
    cotangent = jax.device_put(jax.random.normal(key, dout.shape, dout.dtype), dout.sharding)
    jax.block_until_ready(forward_and_backward(x, cotangent))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        jax.block_until_ready(forward_and_backward(x, cotangent))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    """One JSON line per (implementation, dtype, objective), and per (implementation, dtype) timed."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    check_tree()
    import jax

    from tuner.tuning import memory

    devices = jax.devices()[:4]
    for dtype in args.dtypes:
        for implementation in args.implementations:
            for objective in OBJECTIVES:
                _, analysis = memory.analysis(_problem(args.tokens, dtype), devices, objective, implementation)
                print(json.dumps({"implementation": implementation, "dtype": dtype, "objective": objective,
                                  "temp": analysis.temp_size_in_bytes}), flush=True)
            if args.time:
                print(json.dumps({"implementation": implementation, "dtype": dtype, "objective": "time",
                                  "seconds": _seconds(implementation, args.time, dtype, devices)}), flush=True)


def _value(row: dict | None) -> str:
    if row is None:
        return ""
    return f"{row['seconds']:.3f} s" if "seconds" in row else f"{row['temp'] / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072, help="the global sequence length compiled")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--time", type=int, metavar="TOKENS", help="also time the forward and backward here")
    parser.add_argument("--against", help="a git revision to compare with")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from tuner.tuning.memory import floor

    forwarded = list(argv if argv is not None else sys.argv[1:])
    this, that = ({(r["implementation"], r["dtype"], r["objective"]): r for r in rows}
                  for rows in this_and_against(os.path.abspath(__file__), forwarded, args.against))
    print(f"{args.tokens} tokens, H=Hkv=8, D=64, causal, zigzag, 4 CPU devices; temporaries a device"
          + (f" (time: forward and backward at {args.time} tokens)" if args.time else "")
          + (f"; before: {args.against}" if args.against else ""))
    print(f"{'implementation':<14} {'dtype':<9} {'objective':<8} {'ring floor':>12} {'before':>14} {'after':>14}")
    rows = []
    for key, row in this.items():
        implementation, dtype, objective = key
        low = "" if objective == "time" else \
            f"{sum(floor(_problem(args.tokens, dtype).shapes, objective, 4).values()) / 2**20:,.1f} MiB"
        rows.append({**row, "before": that.get(key)})
        print(f"{implementation:<14} {dtype:<9} {objective:<8} {low:>12} {_value(that.get(key)):>14} "
              f"{_value(row):>14}")
    write_results(args.out, args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
