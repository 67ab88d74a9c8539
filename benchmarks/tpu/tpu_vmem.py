"""Does the VMEM constraint admit only what the TPU compiler accepts? Compiled by the production TPU
compiler on this host (needs libtpu: `pip install -e '.[tpu]'`), nothing runs.

    python benchmarks/tpu/tpu_vmem.py [--targets v5e:2x2,v6e:2x2,v5p:2x2x1,v4:2x2x1] [--seq-len 32768]
                                      [--problems bfloat16:128,float32:256] [--space] [--out FILE]

For each target and each problem (dtype:head_dim; by default bf16 with D=128, and float32 with D=256,
the largest VMEM per tile), compiles per kernel (forward, dK/dV, dQ) the two variants on either side
of the VMEM constraint -- the admitted one with the largest estimate, and the one it rules out with
the smallest estimate, compiled anyway -- or with `--space` every variant of the search space, those
the constraint rules out for VMEM included, each as the whole ring; prints the compiler's verdict, the
VMEM it reports the kernel uses, the estimate the constraint rules by and the limit the kernel asks
for, and writes them as JSON (default benchmarks/tpu/results/tpu_vmem.json, or tpu_vmem_space.json with
`--space`), rewritten after each target and problem.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

from tuner.tuning import compiled, compiled_report  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402
from tuner.support.tables import table  # noqa: E402

PROBLEMS = "bfloat16:128,float32:256"
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(compiled.TARGETS))
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--problems", default=PROBLEMS, help="dtype:head_dim, comma-separated")
    parser.add_argument("--space", action="store_true", help="compile every variant, not only the two at the edge")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or RESULTS / ("tpu_vmem_space.json" if args.space else "tpu_vmem.json"))
    problems = [(dtype, int(head_dim)) for dtype, head_dim in (p.split(":") for p in args.problems.split(","))]
    rows, records = [], []
    for target in args.targets.split(","):
        for dtype, head_dim in problems:
            problem = Problem(seq_len=args.seq_len, heads=8, kv_heads=2, head_dim=head_dim, dtype=dtype, causal=True,
                              ring_size=compiled.topology_mesh(target).size)
            start = time.perf_counter()
            report = compiled.compile_target(problem, target, largest=not args.space, over_vmem=args.space)
            print(f"{target} {dtype} D={head_dim}: {time.perf_counter() - start:.0f} s", flush=True)
            for v in (v for v in report.variants if v.ruled_out is None):
                [(asked, used, estimate)] = v.vmem.values() or [(None, None, compiled.estimate(report.problem, v))]
                rows.append([target, f"{dtype} D={head_dim}", v.part, compiled_report.describe_tiles(v),
                             "rules out" if v.forced else "admits",
                             "compiled" if v.compiled else (v.error or v.ruled_out)[:60],
                             f"{used / 2**20:.2f}" if used is not None else "-", f"{estimate / 2**20:.2f}",
                             f"{asked / 2**20:.0f}" if asked is not None else "-"])
                records.append(dict(target=target, device_kind=report.device_kind, dtype=dtype, head_dim=head_dim,
                                    seq_len=args.seq_len, kernel=v.part, tiles=compiled_report.describe_tiles(v),
                                    constraint="rules out" if v.forced else "admits",
                                    compiled=v.compiled, error=v.error, vmem_used=used, vmem_estimate=estimate,
                                    vmem_limit=asked))
            out.write_text(json.dumps(records, indent=1) + "\n")
    print(table(["target", "problem", "kernel", "tiles", "constraint", "TPU compiler", "used MiB", "estimate MiB",
                 "limit MiB"], rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
