"""Does every ring step's transfer overlap its kernel on a TPU? Compiled by the production TPU compiler
on this host (needs libtpu: `pip install -e '.[tpu]'`), nothing runs.

    python benchmarks/tpu/tpu_overlap.py [--topology v5e:2x2] [--seq-len 32768] [--full]

Compiles the gradient of the ring (pallas_tpu, zigzag, bf16, D=128) over the topology's chips and
prints, for each loop of the scheduled program (the forward ring, then the backward ring), the order
of its collective-permute starts, the kernel (or the branch that may skip it) and the dones; then the
VMEM each Mosaic kernel asked for and the VMEM the compiler reports it uses.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner.models import hlo
from tuner import ring_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    args = parser.parse_args()
    mesh = Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices),
                ("sp",))
    ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", layout="zigzag",
                                                        causal=not args.full),
                         mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    sharding = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, args.seq_len, 8, 128), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, args.seq_len, 2, 128), jnp.bfloat16, sharding=sharding)
    grad = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    start = time.perf_counter()
    compiled = jax.jit(grad).lower(q, kv, kv).compile()
    print(f"{args.topology}: ring of {mesh.size}, T={args.seq_len}, {'full' if args.full else 'causal'}, "
          f"compiled in {time.perf_counter() - start:.1f} s")
    for name, body in zip(("forward", "backward"), hlo.loop_bodies(compiled.as_text())):
        short = " ".join({"collective-permute-start": "start", "collective-permute-done": "done",
                          "conditional": "[kernel?]", "kernel": "[kernel]"}[op] for op in body)
        print(f"{name:9s} {short}\n          {hlo.overlap_problem(body) or 'every transfer overlaps a kernel'}")
    for kernel, (asked, used) in sorted(hlo.kernel_vmem(compiled.as_text()).items()):
        print(f"{kernel:24s} VMEM asked {asked / 2**20:5.1f} MiB, used {used / 2**20:5.1f} MiB")


if __name__ == "__main__":
    main()
