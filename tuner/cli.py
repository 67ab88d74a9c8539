"""The `tuner` command line.

    tuner demo [--devices 4] [--seq-len 2048] ...   ring over simulated CPU devices, checked and timed
    tuner info                                       devices, backends and why a backend is unavailable

Bad arguments print one line saying what to do and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    line = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _fail(message: str) -> int:
    print(f"tuner: error: {message}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tuner import layouts, ring_attention
    from tuner.reference import dense_attention
    from tuner.timing import attention_flops, time_interleaved

    devices = jax.devices()
    if len(devices) < args.devices:
        return _fail(f"--devices {args.devices} needs {args.devices} devices but {len(devices)} are visible; "
                     f"on the CPU run it in a fresh process (XLA_FLAGS is set before jax starts)")
    if args.seq_len % (args.devices * 2):
        return _fail(f"--seq-len {args.seq_len} must be a multiple of 2 x --devices ({2 * args.devices}) "
                     f"for the zigzag layout")
    if args.heads % args.kv_heads:
        return _fail(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")

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
    print(_table(["impl", "median ms", "spread", "GFLOP/s", "vs dense"], rows))
    print("dense = jax.nn.dot_product_attention(implementation='xla') on the global arrays, same run.")
    return 0 if error <= 1e-5 else 1


def _info(args: argparse.Namespace) -> int:
    import jax

    import tuner
    from tuner.backends import BACKENDS

    print(f"ring-tuner {tuner.__version__}, jax {jax.__version__}, platform {jax.default_backend()}, "
          f"{len(jax.devices())} device(s): {jax.devices()[0].device_kind}")
    rows = [[name, "yes" if backend.unavailable_reason() is None else "no",
             backend.unavailable_reason() or ""] for name, backend in BACKENDS.items()]
    print(_table(["backend", "available", "why not"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tuner", description="Ring flash attention for JAX.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    demo = verbs.add_parser("demo", help="run a ring on simulated CPU devices, check it, time it")
    demo.add_argument("--devices", type=int, default=4, help="ring size (simulated CPU devices)")
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--seq-len", type=int, default=2048, help="global sequence length")
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default="zigzag")
    demo.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    demo.add_argument("--runs", type=int, default=5)
    demo.set_defaults(run=_demo)
    info = verbs.add_parser("info", help="devices, backends, versions")
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    for name in ("devices", "batch", "seq_len", "heads", "kv_heads", "head_dim", "runs"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            return _fail(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.verb == "demo":  # read when jax first starts its CPU client, not at import
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
