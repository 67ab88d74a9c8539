"""What the compilers build for each kernel at its default tiles, per pair of query/key and value head dims
(multi-head latent attention's 192/128 beside the usual equal dims), on this host: nothing runs.

    python benchmarks/gpu/head_dims.py [--dims 64:64,128:128,128:64,192:128,256:256] [--local-len 8192]
                                       [--gpus 80,90] [--tpus v5e:2x2] [--out FILE]

- Triton (`triton.compile` for sm_XX, no GPU needed): per kernel (forward, dK/dV, dQ) of the causal bf16
  variant at `TritonBackend.default_params`, the shared memory, registers per thread, stack bytes (spills)
  and the matrix-multiply instructions in the SASS (`tuner.kernels.triton_compile.resources`).
- Pallas TPU (the production TPU compiler, through libtpu): per kernel of the causal bf16 variant at the
  target chip's default tiles, the VMEM the compiler says it uses beside the constraint's estimate
  (`tuner.tuning.compiled.compile_step`, `tuner.kernels.tpu_memory.vmem_bytes`).

B=1, H=8, Hkv=2, `--local-len` tokens per device. Writes one JSON object (default
benchmarks/gpu/results/head_dims-<date>.json) and prints the two tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402

from tuner.kernels import pallas_tiling, pallas_tpu, triton, triton_launch  # noqa: E402
from tuner.semantics.spec import AttentionSpec, LocalShapes  # noqa: E402
from tuner.support.tables import table  # noqa: E402
from tuner.tuning import compiled  # noqa: E402

HEADS, KV_HEADS = 8, 2


def triton_rows(head_dim: int, value_head_dim: int, local: int, capability: int) -> list[dict]:
    spec = AttentionSpec(scale=head_dim**-0.5, causal=True)
    source = triton_launch.variant(spec, "bfloat16", head_dim, value_head_dim)
    return [{"dims": f"{head_dim}/{value_head_dim}", **row}
            for row in triton.standard_resources(source, capability, local, HEADS, KV_HEADS)]


def tpu_rows(head_dim: int, value_head_dim: int, local: int, target: str) -> list[dict]:
    shapes = LocalShapes(1, local, local, HEADS, KV_HEADS, head_dim, "bfloat16", value_head_dim=value_head_dim)
    spec = AttentionSpec(scale=head_dim**-0.5, causal=True)
    backend = pallas_tpu.PallasTpuBackend()
    with jax.sharding.use_abstract_mesh(compiled.topology_mesh(target).abstract_mesh):
        fwd, bwd = backend.default_params(local, local, head_dim, value_head_dim)
    used = compiled.compile_step(shapes, spec, target, fwd, bwd)
    estimates = pallas_tiling.vmem_estimates(shapes, spec, fwd, bwd)
    rows = []
    for kernel, (block_q, block_kv, compute) in pallas_tiling.kernel_tiles(fwd, bwd, local, local).items():
        row = {"dims": f"{head_dim}/{value_head_dim}", "target": target, "kernel": kernel,
               "tiles": f"{block_q}x{block_kv}" + (f" ({compute})" if compute else ""), "estimate": estimates[kernel]}
        if isinstance(used, dict):
            row.update(asked=used[kernel][0], used=used[kernel][1])
        else:
            row["error"] = used
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64:64,128:128,128:64,192:128,256:256")
    parser.add_argument("--local-len", type=int, default=8192)
    parser.add_argument("--gpus", default="80,90", help="compute capabilities; empty for none")
    parser.add_argument("--tpus", default="v5e:2x2", help="TPU topologies; empty for none")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    dims = [tuple(int(d) for d in pair.split(":")) for pair in args.dims.split(",")]
    gpus = [int(c) for c in args.gpus.split(",") if c]
    tpus = [t for t in args.tpus.split(",") if t]
    result = {"local_len": args.local_len, "heads": HEADS, "kv_heads": KV_HEADS, "dtype": "bfloat16", "causal": True,
              "triton": [row for d, dv in dims for c in gpus for row in triton_rows(d, dv, args.local_len, c)],
              "pallas_tpu": [row for d, dv in dims for t in tpus for row in tpu_rows(d, dv, args.local_len, t)]}
    out = args.out or Path(__file__).parent / "results" / f"head_dims-{datetime.date.today()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(["dims", "target", "kernel", "tiles", "warps", "stages", "shared KiB", "registers", "spill B", "mma"],
                [[r["dims"], r["target"], r["kernel"], f"{r['block_q']}x{r['block_kv']}", r["num_warps"],
                  r["num_stages"], r["shared"] // 1024,
                  r["registers"], r["spill_bytes"], r["mma"]] for r in result["triton"]]))
    print()
    print(table(["dims", "target", "kernel", "tiles", "used MiB", "estimate MiB", "asked MiB"],
                [[r["dims"], r["target"], r["kernel"], r["tiles"],
                  f"{r['used'] / 2**20:.2f}" if "used" in r else r.get("error", "?"), f"{r['estimate'] / 2**20:.2f}",
                  f"{r['asked'] / 2**20:.0f}" if "asked" in r else "-"] for r in result["pallas_tpu"]]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
