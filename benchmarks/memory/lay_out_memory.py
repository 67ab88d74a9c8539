"""What one device holds while `tuner.layouts.lay_out_batch` lays a sharded batch out on the devices, read
from the compiled program (nothing runs): its temporary bytes, the batch it takes and gives, and the
collectives. The batch is one activation `[B, T, width]` bfloat16 and the segment ids, sharded
`P("dp", "sp")` over a (dp, sp) mesh, so that the data axis stays automatic in the layout's `shard_map`.

    python benchmarks/memory/lay_out_memory.py                                  # 8 simulated CPU devices, 2x4
    python benchmarks/memory/lay_out_memory.py --tpu v5e:4x4 --mesh 2 8 --tokens 131072
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner import layouts  # noqa: E402
from tuner.models import hlo  # noqa: E402

MIB = 2**20


def compile_lay_out(devices, mesh_shape: tuple[int, int], batch: int, tokens: int, width: int, layout: str):
    """The compiled `lay_out_batch` of the batch (module docstring) on `devices` as a (dp, sp) mesh: its
    `memory_analysis()` and `tuner.models.hlo.collective_bytes`."""
    dp, sp = mesh_shape
    mesh = Mesh(np.array(devices[:dp * sp]).reshape(dp, sp), ("dp", "sp"))
    sharding = NamedSharding(mesh, P("dp", "sp"))
    arrays = {"x": jax.ShapeDtypeStruct((batch, tokens, width), jnp.bfloat16, sharding=sharding),
              "segment_ids": jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=sharding)}
    compiled = jax.jit(lambda b: layouts.lay_out_batch(b, sp, layout, mesh=mesh, axis_name="sp")).trace(
        arrays).lower().compile()
    return compiled.memory_analysis(), hlo.collective_bytes(compiled.as_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile for this TPU topology (e.g. v5e:4x4), not the CPU")
    parser.add_argument("--mesh", type=int, nargs=2, default=(2, 4), metavar=("DP", "SP"))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a row (default: 8192)")
    parser.add_argument("--batch", type=int, default=2, help="rows (default: 2)")
    parser.add_argument("--width", type=int, default=1024, help="the activation's last dimension (default: 1024)")
    parser.add_argument("--layout", default="documents", choices=[*layouts.LAYOUTS, layouts.DOCUMENTS])
    args = parser.parse_args(argv)
    if args.tpu:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu).devices)
    else:
        devices = jax.devices()
    dp, sp = args.mesh
    if dp * sp > len(devices):
        parser.error(f"--mesh {dp} {sp} needs {dp * sp} devices, there are {len(devices)}")
    memory, collectives = compile_lay_out(devices, (dp, sp), args.batch, args.tokens, args.width, args.layout)
    print(f"{args.layout} on {'the CPU' if not args.tpu else args.tpu}, mesh {dp}x{sp}, {args.batch} x {args.tokens} "
          f"tokens: a device takes {memory.argument_size_in_bytes / MIB:.1f} MiB, gives "
          f"{memory.output_size_in_bytes / MIB:.1f} MiB, holds {memory.temp_size_in_bytes / MIB:.1f} MiB more; "
          f"collectives (bytes of their results) {collectives}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
