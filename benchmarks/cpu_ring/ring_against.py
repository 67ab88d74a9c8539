"""The ring on the CPU, this tree against another commit: forward and forward+backward time, interleaved.

    python benchmarks/cpu_ring/ring_against.py --against HEAD~1
    python benchmarks/cpu_ring/ring_against.py --against HEAD~1 --seq-len 16384 --dtype bfloat16 --runs 15
    python benchmarks/cpu_ring/ring_against.py --against HEAD~1 --loader --no-causal   # the loader's mesh= call

Two worker processes, one importing this tree's `tuner` and one a checkout of `--against` (a `git worktree`
in a temporary folder), each compile the same programs: `ring_attention` (scan backend, the default
tiles) under `shard_map` over P simulated CPU devices, the forward and the gradient of a fixed projection
of the output; with `--loader`, the loader's call on global arrays (`get_tuned_ring_attention(mesh=)`,
nothing tuned: an empty cache). Then the parent asks them for one timed call at a time, alternating, and
reports the medians and the ratio this / that per program, with each side's compiled temporaries
(`memory_analysis()`). Prints a table and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from revisions import ROOT, check_tree, checkout, environment  # noqa: E402

PROGRAMS = ("fwd", "fwd+bwd")


def worker(args: argparse.Namespace) -> None:
    """Compile both programs, print their temporaries, then answer each line `fwd` / `fwd+bwd` on stdin with
    the seconds of one call."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.ring}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    check_tree()
    from tuner import get_tuned_ring_attention, ring_attention
    mesh = Mesh(np.array(jax.devices()[:args.ring]), ("sp",))
    seq = P(None, "sp")

    def attend(q, k, v):
        return ring_attention(q, k, v, causal=args.causal, axis_name="sp", layout=args.layout, backend="scan")

    if args.loader:
        os.environ["TUNER_HOME"] = tempfile.mkdtemp()  # nothing tuned, on both sides
        ring = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=args.causal, layout=args.layout)
    else:
        ring = jax.shard_map(attend, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)

    def both(q, k, v, w):
        return jax.grad(lambda q, k, v: jnp.vdot(ring(q, k, v).astype(jnp.float32), w), argnums=(0, 1, 2))(q, k, v)

    sharding = NamedSharding(mesh, seq)
    rng = np.random.default_rng(0)
    shape = (1, args.seq_len, args.heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    inputs = [jax.device_put(rng.standard_normal(shape, dtype=np.float32).astype(dtype), sharding) for _ in range(3)]
    weight = jax.device_put(rng.standard_normal(shape, dtype=np.float32), sharding)
    compiled = {"fwd": (jax.jit(ring).lower(*inputs).compile(), inputs),
                "fwd+bwd": (jax.jit(both).lower(*inputs, weight).compile(), (*inputs, weight))}
    temps = {name: fn.memory_analysis().temp_size_in_bytes for name, (fn, _) in compiled.items()}
    print(json.dumps(temps), flush=True)
    for line in sys.stdin:
        fn, call_args = compiled[line.strip()]
        start = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        print(time.perf_counter() - start, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a git revision to compare with, e.g. HEAD~1")
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16384, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--loader", action="store_true", help="time the loader's call on global arrays (mesh=)")
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    forwarded = list(argv if argv is not None else sys.argv[1:])
    with checkout(args.against) as other:
        workers = {}
        for side, tree in (("this", ROOT), ("that", other)):
            workers[side] = subprocess.Popen([sys.executable, os.path.abspath(__file__), *forwarded, "--worker"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             env=environment(tree), cwd=tree)
        temps = {side: json.loads(w.stdout.readline()) for side, w in workers.items()}
        times = {(side, name): [] for side in workers for name in PROGRAMS}
        for run in range(args.warmup + args.runs):
            for name in PROGRAMS:
                for side, w in (workers.items() if run % 2 == 0 else reversed(list(workers.items()))):
                    w.stdin.write(name + "\n")
                    w.stdin.flush()
                    seconds = float(w.stdout.readline())
                    if run >= args.warmup:
                        times[(side, name)].append(seconds)
        for w in workers.values():
            w.stdin.close()
            w.wait()

    rows = []
    print(f"ring of {args.ring}, T={args.seq_len}, H={args.heads}, D={args.head_dim}, {args.dtype}, "
          f"{'causal' if args.causal else 'not causal'}, {args.layout}{', the loader' if args.loader else ''}; "
          f"medians of {args.runs}, interleaved; this tree / {args.against}")
    print(f"{'program':<8} {'this ms':>9} {'that ms':>9} {'ratio':>6} {'this temp MiB':>14} {'that temp MiB':>14}")
    for name in PROGRAMS:
        this, that = (statistics.median(times[(side, name)]) for side in ("this", "that"))
        rows.append({"program": name, "this_s": this, "that_s": that, "ratio": this / that,
                     "this_temp": temps["this"][name], "that_temp": temps["that"][name]})
        print(f"{name:<8} {this * 1e3:>9.1f} {that * 1e3:>9.1f} {this / that:>6.3f} "
              f"{temps['this'][name] / 2**20:>14.1f} {temps['that'][name] / 2**20:>14.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows,
                       "times": {f"{side} {name}": t for (side, name), t in times.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
