"""`tuner demo`: a ring over simulated CPU devices, checked against float64 dense attention and timed
against `jax.nn.dot_product_attention` in the same run (the CLI sets the device count first)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tuner.semantics import layouts
from tuner.runtime.attention import ring_attention
from tuner.semantics.reference import dense_attention
from tuner.support.tables import table
from tuner.tuning.timing import attention_flops, time_interleaved


def demo(args: argparse.Namespace) -> int:
    """Run the ring of `tuner demo`; 0 when it matches float64 dense attention within 1e-5.
    `ValueError` (a usage error) for arguments that cannot work."""
    devices = jax.devices()
    if len(devices) < args.devices:
        raise ValueError(f"--devices {args.devices} needs {args.devices} devices but {len(devices)} are "
                         f"visible; on the CPU run it in a fresh process (XLA_FLAGS is set before jax starts)")
    if args.seq_len % (args.devices * 2):
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2 x --devices "
                         f"({2 * args.devices}) for the zigzag layout")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")

    mesh = Mesh(np.array(devices[:args.devices]), ("sp",))
    seq = P(None, "sp")
    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.seq_len, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seq_len, args.kv_heads, args.head_dim)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in (shape_q, shape_kv, shape_kv))

    def ring_local(q, k, v):
        return ring_attention(q, k, v, causal=args.causal, axis_name="sp", layout=args.layout)

    ring = jax.shard_map(ring_local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    laid = [jax.device_put(layouts.lay_out(jnp.asarray(x), args.layout, args.devices),
                           NamedSharding(mesh, seq)) for x in (q, k, v)]
    out = layouts.restore(jax.jit(ring)(*laid), args.layout, args.devices)
    with jax.enable_x64(True):
        want, _ = dense_attention(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), causal=args.causal)
    want = np.asarray(want)
    error = float(np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want))

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation="xla")

    k_rep = np.repeat(k, args.heads // args.kv_heads, axis=2)
    v_rep = np.repeat(v, args.heads // args.kv_heads, axis=2)
    timings = time_interleaved(
        {"ring": lambda *a: ring(*a[:3]), "dense": lambda *a: dense(*a[3:])},
        [(*laid, jnp.asarray(q), jnp.asarray(k_rep), jnp.asarray(v_rep))], runs=args.runs)
    flops = attention_flops(args.batch, args.heads, args.seq_len, args.seq_len, args.head_dim,
                            causal=args.causal)
    rows = [[name, f"{t.median * 1e3:.1f}", f"{t.spread:.0%}", f"{flops / t.median / 1e9:.1f}",
             f"{timings['dense'].median / t.median:.2f}x"] for name, t in timings.items()]
    print(f"ring attention over {args.devices} simulated CPU devices, layout {args.layout}, "
          f"causal={args.causal}, B={args.batch} T={args.seq_len} H={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} float32")
    print(f"relative error vs dense float64 attention: {error:.2e} "
          f"({'ok' if error <= 1e-5 else 'ABOVE the 1e-5 tolerance'})")
    print(table(["impl", "median ms", "spread", "GFLOP/s", "vs dense"], rows))
    print("dense = jax.nn.dot_product_attention(implementation='xla') on the global arrays, same run.")
    return 0 if error <= 1e-5 else 1
