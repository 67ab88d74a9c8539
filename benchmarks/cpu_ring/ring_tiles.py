"""The scan ring's time at two square tile sizes, in one process, calls interleaved: does the masked
default tile (`ScanBackend.masked_tile`) still fit the kernel?

    python benchmarks/cpu_ring/ring_tiles.py --seq-len 4096 8192 16384 --tiles 128 256

A ring of `--ring` simulated CPU devices, causal, `--layout` (default zigzag), H=8, D=64, float32 by
default; for each length the forward and the gradient of a fixed projection, each tile size compiled
once, then `--runs` rounds that call every program once; medians in milliseconds and the ratio of the
second tile size's time over the first's. Writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[8192], help="global sequence lengths")
    parser.add_argument("--tiles", type=int, nargs=2, default=[128, 256], metavar=("FIRST", "SECOND"))
    parser.add_argument("--ring", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "striped"))
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.ring}"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tuner import ring_attention
    from tuner.kernels.params import BwdParams, FwdParams

    mesh = Mesh(np.array(jax.devices()[:args.ring]), ("sp",))
    seq = P(None, "sp")
    rows = []
    print(f"ring of {args.ring}, H={args.heads}, D={args.head_dim}, {args.dtype}, causal, {args.layout}; "
          f"medians of {args.runs}, interleaved; ms")
    print(f"{'tokens':>7} {'program':<8} {args.tiles[0]:>8} {args.tiles[1]:>8}  ratio")
    for length in args.seq_len:
        rng = np.random.default_rng(0)
        shape = (1, length, args.heads, args.head_dim)
        arrays = [jax.device_put(rng.standard_normal(shape, dtype=np.float32).astype(args.dtype),
                                 NamedSharding(mesh, seq)) for _ in range(4)]
        programs = {}
        for tile in args.tiles:
            def attend(q, k, v, tile=tile):
                return ring_attention(q, k, v, causal=True, axis_name="sp", layout=args.layout, backend="scan",
                                      fwd_params=FwdParams(block_q=tile, block_kv=tile),
                                      bwd_params=BwdParams(block_q_dkv=tile, block_kv_dkv=tile))

            ring = jax.shard_map(attend, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)

            def both(q, k, v, w, ring=ring):
                def loss(q, k, v):
                    return jnp.vdot(ring(q, k, v).astype(jnp.float32), w)
                return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

            programs[(tile, "fwd")] = (jax.jit(ring).lower(*arrays[:3]).compile(), arrays[:3])
            programs[(tile, "fwd+bwd")] = (jax.jit(both).lower(*arrays).compile(), arrays)
        seconds = {key: [] for key in programs}
        for _ in range(args.runs):
            for key, (program, inputs) in programs.items():
                start = time.perf_counter()
                jax.block_until_ready(program(*inputs))
                seconds[key].append(time.perf_counter() - start)
        for objective in ("fwd", "fwd+bwd"):
            first, second = (statistics.median(seconds[(tile, objective)]) for tile in args.tiles)
            rows.append({"tokens": length, "objective": objective, "first_ms": first * 1e3,
                         "second_ms": second * 1e3, "ratio": second / first})
            print(f"{length:>7} {objective:<8} {first * 1e3:>8.0f} {second * 1e3:>8.0f}  {second / first:.3f}",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
