"""Calls outside `jax.jit`, this tree against another commit: seconds and programs compiled per call.

    python benchmarks/cpu_ring/eager_calls.py --against 6f48879
    python benchmarks/cpu_ring/eager_calls.py --seq-len 1024 --runs 3

Each side runs in a process of its own (`revisions.py`) on 4 simulated CPU devices, causal zigzag, B=1,
H=4, D=32: `ring_attention` and the loader inside a `shard_map` called outside any jit (forward, gradient),
the loader on global arrays (`mesh=`) under `jax.grad` and `jax.vmap` outside any jit, and one device's
`ring_attention` outside any jit. Seconds are medians of `--runs` calls (every call compiles: a call
outside jit is traced anew); programs are those jax compiled in the first call. Writes
`results/eager_calls-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from revisions import ROOT, check_tree, this_and_against  # noqa: E402

CASES = ("shard_map ring_attention fwd", "shard_map ring_attention grad", "shard_map loader fwd",
         "shard_map loader grad", "mesh loader grad", "mesh loader vmap", "one device ring_attention fwd")


def measure(seq_len: int, runs: int) -> list[dict]:
    """One row per case of `CASES`: median seconds a call and programs compiled by the first."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from tuner import get_tuned_ring_attention, ring_attention

    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kwargs: compiled.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q, k, v = (jax.random.normal(jax.random.key(i), (1, seq_len, 4, 32)) for i in range(3))
    seq = P(None, "sp")
    local = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=None)
    meshed = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", mesh=mesh, db=None)

    def sharded(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)

    direct = sharded(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", causal=True, layout="zigzag"))
    loader = sharded(local)
    calls = {
        CASES[0]: lambda: direct(q, k, v),
        CASES[1]: lambda: jax.grad(lambda q: direct(q, k, v).sum())(q),
        CASES[2]: lambda: loader(q, k, v),
        CASES[3]: lambda: jax.grad(lambda q: loader(q, k, v).sum())(q),
        CASES[4]: lambda: jax.grad(lambda q: meshed(q, k, v).sum())(q),
        CASES[5]: lambda: jax.vmap(lambda v: meshed(q, k, v))(jnp.stack([v, v])),
        CASES[6]: lambda: ring_attention(q, k, v, causal=True),
    }
    rows = []
    for name, call in calls.items():
        seconds = []
        for run in range(runs):
            compiled.clear()
            start = time.perf_counter()
            jax.block_until_ready(call())
            seconds.append(time.perf_counter() - start)
            if run == 0:
                programs = len(compiled)
        rows.append({"case": name, "median_s": statistics.median(seconds), "programs": programs})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git revision to compare with, e.g. HEAD~1")
    parser.add_argument("--seq-len", type=int, default=256, help="global tokens (default 256)")
    parser.add_argument("--runs", type=int, default=3, help="calls per case, median taken (default 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        check_tree()
        for row in measure(args.seq_len, args.runs):
            print(json.dumps(row))
        return
    argv = ["--seq-len", str(args.seq_len), "--runs", str(args.runs)]
    this, other = this_and_against(os.path.abspath(__file__), argv, args.against)
    before = {row["case"]: row for row in other}
    print(f"{'case':32}  {'this s':>7}  {'programs':>8}" + (f"  {'before s':>8}  {'programs':>8}" if other else ""))
    for row in this:
        line = f"{row['case']:32}  {row['median_s']:7.2f}  {row['programs']:8d}"
        if row["case"] in before:
            line += f"  {before[row['case']]['median_s']:8.2f}  {before[row['case']]['programs']:8d}"
        print(line)
    out = os.path.join(ROOT, "benchmarks", "cpu_ring", "results", f"eager_calls-{datetime.date.today()}.json")
    with open(out, "w") as f:
        json.dump({"seq_len": args.seq_len, "runs": args.runs, "against": args.against, "this": this,
                   "before": other, "machine": f"{os.cpu_count()} CPUs"}, f, indent=1)
    print(f"wrote {os.path.relpath(out, ROOT)}")


if __name__ == "__main__":
    main()
