"""Compile one program of the kind the suite compiles most, and say how long it took and how large it is:
the gradient of the loader's call on global arrays over 4 simulated CPU devices (2 x 256 tokens, GQA 4/2,
D=16, causal, a window, packed documents), as `tests/test_settings.py` compiles it. `--packing` declares
the rows' packing to the loader (the documents layout then compiles one ring, not one per default tile);
`--devices` sets the ring's size.

    python benchmarks/suite/compile_one.py --layout zigzag
    python benchmarks/suite/compile_one.py --layout documents --packing lognormal:4,sigma=0.9 --devices 8
    XLA_FLAGS=--xla_llvm_disable_expensive_passes=true python benchmarks/suite/compile_one.py --layout documents
    perf record -g python benchmarks/suite/compile_one.py     # where the compile's time goes

Prints the seconds to lower and to compile, the optimized HLO's lines, fusions and loops, and the median of
5 runs of the compiled program.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner import get_tuned_ring_attention  # noqa: E402

B, T, H, HKV, D = 2, 256, 4, 2, 16


def compiled_gradient(attn, q, k, v, ids) -> tuple[jax.stages.Compiled, float, float]:
    """The gradient over q, k and v of the summed output of `attn` (the loader's callable) on these arrays
    (or `jax.ShapeDtypeStruct`s), with `ids` as both segment ids, compiled: the program, and the seconds to
    lower and to compile it."""
    def loss(q, k, v, ids):
        return jnp.sum(attn(q, k, v, q_segment_ids=ids, kv_segment_ids=ids), dtype=jnp.float32)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    lowered = step.lower(q, k, v, ids)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    return compiled, lowered_at - start, time.perf_counter() - lowered_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "striped", "documents"])
    parser.add_argument("--packing", help="the packing declared to the loader (e.g. lognormal:4,sigma=0.9)")
    parser.add_argument("--devices", type=int, default=4, choices=[2, 4, 8], help="the ring's size (default: 4)")
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((args.devices,), ("sp",), devices=jax.devices()[:args.devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    sharded = NamedSharding(mesh, P(None, "sp"))
    q, k, v = (jax.device_put(rng.standard_normal((B, T, h, D)).astype(np.float32), sharded) for h in (H, HKV, HKV))
    cuts = [np.sort(rng.choice(np.arange(1, T), 4, replace=False)) for _ in range(B)]
    ids = jax.device_put(np.asarray([np.searchsorted(c, np.arange(T), side="right") for c in cuts], np.int32), sharded)
    attn = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, sliding_window=(96, 0), layout=args.layout,
                                    packing=args.packing)

    compiled, lower_s, compile_s = compiled_gradient(attn, q, k, v, ids)
    text = compiled.as_text()
    jax.block_until_ready(compiled(q, k, v, ids))
    runs = []
    for _ in range(5):
        begin = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, ids))
        runs.append(time.perf_counter() - begin)
    print(f"{args.layout}: lower {lower_s:.2f} s, compile {compile_s:.2f} s; optimized HLO "
          f"{text.count(chr(10))} lines, {text.count('fusion(')} fusions, {text.count(' while(')} loops; "
          f"run {statistics.median(runs) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
