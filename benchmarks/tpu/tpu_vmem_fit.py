"""Fit the temporaries term of the pallas_tpu VMEM estimate to what the production TPU compiler reports.

    python benchmarks/tpu/tpu_vmem_fit.py [--data benchmarks/tpu/results/tpu_vmem_kernels.jsonl]

`tpu_memory.vmem_bytes` counts what a kernel certainly holds -- its double-buffered input and output
blocks and its scratch -- plus the temporaries Mosaic allocates for the tile's arithmetic, as
`TEMPORARIES[(kernel, dtype)]` multiples of three arrays: the float32 `[block_q, block_kv]` tile (in
the forward `[block_q, block_kv_compute]`, one key slice), a float32 `[block_q, head_dim]` row block and
a float32 `[block_kv, head_dim]` column block (in the forward, a slice's). For each kernel and dtype this
finds the smallest multiples (a linear program: least total over-estimate) under which the estimate is
at least the compiler's reported use of every point that compiled, and over the chip's limit for every
point the compiler rejected, over every generation in the data (`benchmarks/tpu/tpu_vmem_kernels.py`).
Prints them rounded up to a quarter, and for each kernel, dtype and chip how often the rounded estimate
agrees with the compiler and by how much it over-estimates.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import linprog

from tuner.kernels import tpu_memory

DATA = Path(__file__).parent / "results" / "tpu_vmem_kernels.jsonl"
RING = Path(__file__).parent / "results" / "tpu_vmem.json"


def ring_records(path: Path) -> list[dict]:
    """The kernels `benchmarks/tpu/tpu_vmem.py` compiled inside the whole ring, as kernel records: in the ring
    program a kernel can report a little more than alone (v5p forward, float32 D=256 1024x2048: 27.0 MiB
    against 22.0), so the bound must hold there too."""
    records = []
    for r in json.loads(path.read_text()) if path.exists() else []:
        tiles = re.match(r"(\d+)x(\d+)(?: \(compute (\d+)\))?", r["tiles"])
        records.append(dict(target=r["target"], dtype=r["dtype"], head_dim=r["head_dim"], kernel=r["kernel"],
                            block_q=int(tiles[1]), block_kv=int(tiles[2]),
                            block_kv_compute=int(tiles[3]) if tiles[3] else None, compiled=r["compiled"],
                            vmem_given=r["vmem_limit"], vmem_used=r["vmem_used"]))
    return records


def load(path: Path, ring: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()] + ring_records(ring)
    limits = {r["target"]: r["vmem_given"] for r in records if r["vmem_given"]}
    for r in records:
        r["limit"] = limits[r["target"]]
    return records


def fit(records: list[dict]) -> tuple[float, ...]:
    """The smallest non-negative multiples (least total over-estimate) that make the estimate an upper
    bound of every compiled point's use and exceed the limit of every rejected one."""
    terms = np.array([tpu_memory.vmem_terms(r["kernel"], r["block_q"], r["block_kv"], r["head_dim"], r["dtype"], 1,
                                            r["block_kv_compute"]) for r in records], float)
    need = np.array([r["vmem_used"] if r["compiled"] else r["limit"] + 1 for r in records], float)
    result = linprog(c=terms.sum(axis=0), A_ub=-terms, b_ub=-need, bounds=[(0, 1)] + [(0, None)] * 3,
                     method="highs")
    if not result.success:
        raise SystemExit(f"no estimate of this form bounds the data: {result.message}")
    held, *temporaries = result.x
    return (math.ceil(held * 20 - 1e-9) / 20, *(math.ceil(x * 4 - 1e-9) / 4 for x in temporaries))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--ring", default=str(RING),
                        help="kernels compiled inside the ring (benchmarks/tpu/tpu_vmem.py)")
    args = parser.parse_args()
    records = load(Path(args.data), Path(args.ring))
    groups = defaultdict(list)
    for r in records:
        groups[(r["kernel"], r["dtype"])].append(r)
    for (kernel, dtype), group in sorted(groups.items()):
        multiples = fit(group)
        print(f'("{kernel}", "{dtype}"): {tuple(round(m, 2) for m in multiples)},')
        for target in sorted({r["target"] for r in group}):
            mine = [r for r in group if r["target"] == target]
            estimates = [tpu_memory.vmem_bytes(kernel, r["block_q"], r["block_kv"], r["head_dim"], dtype, 1,
                                               r["block_kv_compute"], multiples=multiples) for r in mine]
            admitted = [e <= r["limit"] for r, e in zip(mine, estimates)]
            unsafe = sum(a and not r["compiled"] for r, a in zip(mine, admitted))
            strict = sum(r["compiled"] and not a for r, a in zip(mine, admitted))
            ratios = sorted(e / r["vmem_used"] for r, e in zip(mine, estimates) if r["compiled"] and r["vmem_used"])
            print(f"    {target}: {len(mine)} points, {sum(r['compiled'] for r in mine)} compiled; admits "
                  f"{unsafe} the compiler rejects, rules out {strict} that compile; estimate / use "
                  f"min {ratios[0]:.2f} median {ratios[len(ratios) // 2]:.2f} max {ratios[-1]:.2f}")


if __name__ == "__main__":
    main()
