"""CPU benchmark of the ring: P simulated devices against dense XLA attention on the same arrays.

    python benchmarks/cpu_ring/cpu_ring.py                 # P=4, B=1, T=4096, H=8, D=64, float32
    python benchmarks/cpu_ring/cpu_ring.py --memory-only   # just the T=65536, P=8 memory comparison

Times forward and forward+backward, causal and not, of `ring_attention` (scan backend) under
`shard_map` over P simulated CPU devices and of `jax.nn.dot_product_attention(implementation="xla")`
on the same global arrays, interleaved, medians; prints a table and writes JSON. Then compares the
compiled peak memory (XLA's memory analysis: arguments + outputs + temporaries) of forward+backward
at global T=65536 on 8 devices with that of dense attention.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tuner  # noqa: E402
from tuner import ring_attention  # noqa: E402
from tuner.tuning.timing import attention_flops, time_interleaved  # noqa: E402


def ring_fn(mesh: Mesh, causal: bool, layout: str):
    seq = P(None, "sp")

    def local(q, k, v):
        return ring_attention(q, k, v, causal=causal, axis_name="sp", layout=layout, backend="scan")

    return jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)


def dense_fn(causal: bool):
    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return dense


def with_backward(fn):
    """Forward + backward of `fn`: the gradient of a fixed random projection of its output."""
    def loss(q, k, v, w):
        return jnp.vdot(fn(q, k, v), w)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    return lambda q, k, v, w: grad(q, k, v, w)


def draw_inputs(shape, count: int, seed: int, sharding=None):
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(count):
        arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
        if sharding is not None:
            arrays = [jax.device_put(a, sharding) for a in arrays]
        sets.append(tuple(arrays))
    return sets


def peak_bytes(fn, *shapes) -> int:
    """XLA's compiled memory estimate for one device: arguments + outputs + temporaries."""
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=getattr(s, "sharding", None)) for s in shapes]
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)


def memory_comparison(global_len: int, ring: int, heads: int, head_dim: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    shape = (1, global_len, heads, head_dim)
    sharded = NamedSharding(mesh, P(None, "sp"))
    spec = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharded)
    ring_bytes = peak_bytes(with_backward(ring_fn(mesh, causal=True, layout="zigzag")), spec, spec, spec, spec)
    plain = jax.ShapeDtypeStruct(shape, jnp.float32)
    dense_bytes = peak_bytes(with_backward(dense_fn(causal=True)), plain, plain, plain, plain)
    return {"global_len": global_len, "ring_size": ring, "heads": heads, "head_dim": head_dim,
            "ring_per_device_bytes": ring_bytes, "ring_total_bytes": ring_bytes * ring,
            "dense_bytes": dense_bytes}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--out", default="benchmarks/cpu_ring/results/cpu_ring.local.json")
    args = parser.parse_args(argv)

    result: dict = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                    "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                    "tuner": tuner.__version__, "command": " ".join(["python", *sys.argv])}
    if not args.memory_only:
        mesh = Mesh(np.array(jax.devices()[:args.ring]), ("sp",))
        shape = (1, args.seq_len, args.heads, args.head_dim)
        ring_inputs = draw_inputs(shape, 3, seed=0, sharding=NamedSharding(mesh, P(None, "sp")))
        dense_inputs = draw_inputs(shape, 3, seed=0)
        rows = []
        for objective in ("fwd", "fwd+bwd"):
            for causal in (False, True):
                layout = "zigzag" if causal else "contiguous"
                ring, dense = ring_fn(mesh, causal, layout), dense_fn(causal)
                if objective == "fwd":
                    ring_c = lambda q, k, v, w, f=ring: f(q, k, v)  # noqa: E731
                    dense_c = lambda q, k, v, w, f=dense: f(q, k, v)  # noqa: E731
                else:
                    ring_c, dense_c = with_backward(ring), with_backward(dense)
                # Interleave ring and dense: same run, alternating, each on its own arrays.
                both = {"ring": lambda *a, f=ring_c: f(*a[:4]), "dense": lambda *a, f=dense_c: f(*a[4:])}
                timing = time_interleaved(both, [r + d for r, d in zip(ring_inputs, dense_inputs)],
                                          runs=args.runs)
                flops = attention_flops(1, args.heads, args.seq_len, args.seq_len, args.head_dim,
                                        causal=causal, objective=objective)
                row = {"objective": objective, "causal": causal, "layout": layout,
                       "ring": timing["ring"].to_dict(), "dense": timing["dense"].to_dict(),
                       "ring_gflops": flops / timing["ring"].median / 1e9,
                       "dense_gflops": flops / timing["dense"].median / 1e9,
                       "speedup_vs_dense": timing["dense"].median / timing["ring"].median}
                rows.append(row)
                print(f"{objective:8s} causal={causal!s:5s} {layout:10s} ring {timing['ring'].median*1e3:9.1f} ms "
                      f"({row['ring_gflops']:6.1f} GFLOP/s, spread {timing['ring'].spread:.0%})  dense "
                      f"{timing['dense'].median*1e3:9.1f} ms ({row['dense_gflops']:6.1f} GFLOP/s)  "
                      f"speedup {row['speedup_vs_dense']:.2f}x", flush=True)
        by = {(r["objective"], r["causal"]): r for r in rows}
        causal_ratio = by[("fwd+bwd", True)]["ring"]["median_s"] / by[("fwd+bwd", False)]["ring"]["median_s"]
        print(f"causal / non-causal time, forward+backward: {causal_ratio:.2f}")
        result.update({"problem": {"ring": args.ring, "batch": 1, "seq_len": args.seq_len,
                                   "heads": args.heads, "head_dim": args.head_dim, "dtype": "float32"},
                       "rows": rows, "causal_over_noncausal_fwd_bwd": causal_ratio})

    memory = memory_comparison(65536, DEVICES, args.heads, args.head_dim)
    fits = memory["ring_total_bytes"] < 24 * 2**30
    print(f"T=65536, causal forward+backward: ring of {DEVICES}: {gib(memory['ring_per_device_bytes'])} per "
          f"device, {gib(memory['ring_total_bytes'])} in all ({'fits' if fits else 'does NOT fit'} in 24 GiB); "
          f"dense: {gib(memory['dense_bytes'])}")
    result["memory"] = memory
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
