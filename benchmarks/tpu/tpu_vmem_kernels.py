"""The VMEM each Pallas kernel really uses, over the whole tile space, by the production TPU compiler on
this host (needs libtpu: `pip install -e '.[tpu]'`); nothing runs.

    python benchmarks/tpu/tpu_vmem_kernels.py [--targets v5p:2x2x1,v4:2x2x1] [--problems bfloat16:128,float32:256]
                                              [--local-len 8192] [--min-tile 128] [--out FILE]

For each target chip and problem (dtype:head_dim; B=1, H=8, Hkv=2, causal, `--local-len` tokens per
device), compiles one ring step's kernels alone (`tuner.tuning.compiled.compile_step`) for every forward tile
point of the pallas_tpu search space and every backward tile pair (the dK/dV and dQ kernels with the
same tiles) with no tile under `--min-tile`, those the VMEM constraint rules out included, and records
per kernel the compiler's verdict, the VMEM it reports the kernel uses and the constraint's estimate.
The records are the data `tpu_memory.vmem_bytes` is calibrated on; JSON lines, appended as they come
(default benchmarks/tpu/results/tpu_vmem_kernels.jsonl), so a long run can be stopped and resumed: points
already in the file are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

from tuner.tuning import compiled  # noqa: E402
from tuner.kernels import pallas_tiling, pallas_tpu, tpu_memory  # noqa: E402
from tuner.kernels.params import BwdParams, FwdParams  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402

OUT = Path(__file__).parent / "results" / "tpu_vmem_kernels.jsonl"


def points(problem: Problem, min_tile: int = 0) -> list[FwdParams | BwdParams]:
    """The forward tile points (each a compute slice that divides its key tile) and the backward tile
    pairs of the problem's search space, with no query or key tile under `min_tile`."""
    space = pallas_tpu.PallasTpuBackend().search_space(problem.shapes, problem.spec)
    fwd = [p for p in space.fwd_points() if p.block_kv_compute <= p.block_kv and min(p.block_q, p.block_kv) >= min_tile]
    pairs = sorted({(p.block_q_dkv, p.block_kv_dkv) for p in space.bwd_points()
                    if min(p.block_q_dkv, p.block_kv_dkv) >= min_tile})
    return fwd + [BwdParams(block_q_dkv=q, block_kv_dkv=kv, block_q_dq=q, block_kv_dq=kv) for q, kv in pairs]


def measure(target: str, problem: Problem, params: FwdParams | BwdParams) -> list[dict]:
    shapes, spec = problem.shapes, problem.spec
    forward = isinstance(params, FwdParams)
    result = compiled.compile_step(shapes, spec, target, **{"fwd" if forward else "bwd": params})
    ids = 1 + (spec.chunk_size is not None) + spec.has_segments
    records = []
    for kernel in ("fwd",) if forward else ("dkv", "dq"):
        if forward:
            block_q, block_kv, compute = pallas_tiling.fwd_tiles(params, shapes.q_len, shapes.kv_len)
        else:
            (dkv, dq) = pallas_tiling.bwd_tiles(params, shapes.q_len, shapes.kv_len)
            (block_q, block_kv), compute = (dkv if kernel == "dkv" else dq), None
        asked, used = result[kernel] if isinstance(result, dict) else (None, None)
        records.append(dict(target=target, dtype=problem.dtype, head_dim=problem.head_dim,
                            local_len=shapes.q_len, kernel=kernel, block_q=block_q, block_kv=block_kv,
                            block_kv_compute=compute, compiled=isinstance(result, dict),
                            error=None if isinstance(result, dict) else result, vmem_given=asked, vmem_used=used,
                            vmem_estimate=tpu_memory.vmem_bytes(kernel, block_q, block_kv, shapes.head_dim,
                                                                shapes.dtype, ids, compute)))
    return records


def key(record: dict) -> tuple:
    return (record["target"], record["dtype"], record["head_dim"], record["local_len"], record["kernel"],
            record["block_q"], record["block_kv"], record["block_kv_compute"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="v5p:2x2x1,v4:2x2x1")
    parser.add_argument("--problems", default="bfloat16:128,float32:256", help="dtype:head_dim, comma-separated")
    parser.add_argument("--local-len", type=int, default=8192)
    parser.add_argument("--min-tile", type=int, default=128, help="skip points with a smaller query or key tile")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    out = Path(args.out)
    done = {key(json.loads(line)) for line in out.read_text().splitlines()} if out.exists() else set()
    todo = []
    for target in args.targets.split(","):
        for dtype, head_dim in (p.split(":") for p in args.problems.split(",")):
            problem = Problem(seq_len=args.local_len, heads=8, kv_heads=2, head_dim=int(head_dim), dtype=dtype,
                              causal=True, ring_size=1)
            for params in points(problem, args.min_tile):
                kernel = "fwd" if isinstance(params, FwdParams) else "dkv"
                tiles = ((params.block_q, params.block_kv, params.block_kv_compute) if kernel == "fwd" else
                         (params.block_q_dkv, params.block_kv_dkv, None))
                if (target, dtype, int(head_dim), args.local_len, kernel, *tiles) not in done:  # by its first kernel
                    todo.append((target, problem, params))
    print(f"{len(todo)} points to compile ({len(done)} records already in {out})", flush=True)
    with ThreadPoolExecutor(max_workers=args.workers) as pool, out.open("a") as sink:
        for i, records in enumerate(pool.map(lambda job: measure(*job), todo), 1):
            for record in records:
                sink.write(json.dumps(record) + "\n")
                print(f"[{i}/{len(todo)}] {record['target']} {record['dtype']} D={record['head_dim']} "
                      f"{record['kernel']} {record['block_q']}x{record['block_kv']} "
                      f"used {record['vmem_used']} est {record['vmem_estimate']} {record['error'] or ''}",
                      flush=True)
            sink.flush()


if __name__ == "__main__":
    main()
