"""How many rings a traced documents-layout call plans, and what compiling it costs, on the TPU compiler.

A traced call with packed rows and no declared packing plans one config per default tile the rows may
choose (`tuner.semantics.documents.PACKED_TILES`), and compiles one ring per distinct config. This
compiles the loader's gradient in the documents layout for a TPU topology (libtpu; nothing runs), with
or without a declared packing, and prints the seconds to lower and to compile, the temporaries
(`memory_analysis()`), the number of rings (one per distinct config, as the loader compiles them), and
each plan's implementation, source and forward tiles.

    python benchmarks/suite/documents_rings.py                                  # undeclared packing
    python benchmarks/suite/documents_rings.py --packing lognormal:4,sigma=0.9  # declared
    python benchmarks/suite/documents_rings.py --strategy auto                  # as the strategy model picks
    python benchmarks/suite/documents_rings.py --target v5e:2x2 --tokens 8192

Run each in a fresh process: the loader keeps its plans and jax its programs for the process.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner import get_tuned_ring_attention, registry  # noqa: E402
from tuner.tuning import compiled as tpu  # noqa: E402

from compile_one import compiled_gradient  # noqa: E402 - this folder's script, on sys.path when run

B, H, HKV, D = 1, 8, 2, 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5e:2x2", help="a TPU topology (default: v5e:2x2)")
    parser.add_argument("--tokens", type=int, default=8192, help="the row's length (default: 8192)")
    parser.add_argument("--packing", help="the packing declared to the loader (e.g. lognormal:4,sigma=0.9)")
    parser.add_argument("--strategy", default="ring", help="the loader's strategy= (default: ring; auto lets the "
                                                          "strategy model choose)")
    args = parser.parse_args(argv)
    if args.tokens <= 0:
        parser.error(f"--tokens must be positive, got {args.tokens}")
    if tpu.libtpu_missing():
        parser.error(tpu.libtpu_missing())
    try:
        mesh = tpu.topology_mesh(args.target)
    except ValueError as error:
        parser.error(str(error))
    axis = mesh.axis_names[0]
    sharded = NamedSharding(mesh, P(None, axis))
    q = jax.ShapeDtypeStruct((B, args.tokens, H, D), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct((B, args.tokens, HKV, D), jnp.bfloat16, sharding=sharded)
    ids = jax.ShapeDtypeStruct((B, args.tokens), jnp.int32, sharding=sharded)
    try:
        attn = get_tuned_ring_attention(axis_name=axis, mesh=mesh, causal=True, layout="documents",
                                        packing=args.packing, strategy=args.strategy)
    except ValueError as error:  # a strategy or packing the loader refuses: its one line
        parser.error(str(error))
    program, lower_s, compile_s = compiled_gradient(attn, q, kv, kv, ids)
    temp = program.memory_analysis().temp_size_in_bytes
    plans = attn.traced
    packing = args.packing or "undeclared"
    print(f"{args.target}, {args.tokens} tokens, strategy {args.strategy}, packing {packing}: "
          f"lower {lower_s:.2f} s, compile {compile_s:.2f} s, "
          f"temporaries {temp / 2**20:.1f} MiB")
    print(f"{len(plans)} plan(s), {len({plan.config for plan in plans})} ring(s) (one per distinct config):")
    for plan in plans:
        tiles = registry.forward_tiles(plan.config)
        shown = "none" if tiles is None else f"{tiles[0]} x {tiles[1]}"
        print(f"  {plan.backend} ({plan.source}): forward tiles {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
