"""The Triton defaults per GPU architecture and head dim, chosen from the compiler's verdict (issue 31).

    python benchmarks/gpu/triton_defaults.py [--sweeps FILE,...] [--out FILE]

Reads the sweeps of `benchmarks/gpu/triton_resources.py` (every launch of the search space compiled for
sm_80, sm_90 and sm_100), rules out what `tuner.kernels.triton_compile.ruled_out` rules out (spills, shared
memory, no block per SM), and ranks the rest by the roofline model of `tuner.models.gpu_model` on the
reference problem of each sweep variant: batch 4, the sweep's local length and heads, ring of one, on
the A100 (sm_80), H100 (sm_90) and B200 (sm_100). The chosen forward and backward are those of
`tuner.tuning.compiled_gpu.choose`, restricted to launches on the architecture's tensor-core path
(a default must use it). Prints a table and writes it as JSON (default
`benchmarks/gpu/results/triton_defaults.json`); `tuner.kernels.triton.DEFAULTS` holds these choices and a
test derives them again from the committed sweeps.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tuner.kernels import triton_launch
from tuner.models import gpu_model
from tuner.semantics.problem import Problem
from tuner.strategies.configs import TileConfig
from tuner.support.tables import describe_config, table
from tuner.tuning import compiled_gpu

RESULTS = Path(__file__).parent / "results"
SWEEPS = (RESULTS / "triton_resources-sm_80-sm_90-sm_100-d64-d128-d256-2026-11-25.jsonl",)
GPU_OF = {80: "a100", 90: "h100", 100: "b200"}  # the GPU whose rates rank an architecture's launches


def reference_problem(record: dict) -> Problem:
    """The problem a sweep record's variant is ranked on."""
    features, dtype, *dims = record["variant"].split("/")
    on = set() if features == "full" else set(features.split("+"))
    if on - {"causal"}:
        raise ValueError(f"the defaults are chosen on full or causal variants, got {record['variant']!r}")
    head_dim, value_head_dim = int(dims[0]), int(dims[-1])
    return Problem(batch=4, seq_len=record["local_len"], heads=record["heads"], kv_heads=record["kv_heads"],
                   head_dim=head_dim, value_head_dim=value_head_dim if value_head_dim != head_dim else None,
                   dtype=dtype, causal="causal" in on, ring_size=1, layout="contiguous")


def launches_of(records: list[dict]) -> list[compiled_gpu.Launch]:
    return [compiled_gpu.Launch(r["kernel"], r["block_q"], r["block_kv"], r["num_warps"], r["num_stages"],
                                verdict={k: r[k] for k in r if k not in ("kernel", "block_q", "block_kv")})
            for r in records]


def choose_defaults(records: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (variant, architecture) of the sweep records: the chosen launches, the config, the model's
    prediction of each, and whether the sweep holds every launch of each kernel (`whole`)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["variant"], int(record["target"][3:])), []).append(record)
    chosen = {}
    for (variant, arch), group in sorted(groups.items()):
        if arch not in GPU_OF:
            continue
        gpu = gpu_model.GPUS[GPU_OF[arch]]
        problem = reference_problem(group[0])
        launches = launches_of(group)
        compiled_gpu.predict(problem, gpu, launches)
        on_path = [x if x.verdict.get("tensor_core") else replace(x, predicted=None) for x in launches]
        picked = compiled_gpu.choose(on_path)
        if picked is None:
            chosen[(variant, arch)] = {"variant": variant, "arch": arch, "gpu": gpu.name, "config": None,
                                       "whole": False}
            continue
        config = compiled_gpu.config_of(*picked)
        counts = {kernel: sum(r["kernel"] == kernel for r in group) for kernel in triton_launch.KERNEL_ARGS}
        chosen[(variant, arch)] = {
            "variant": variant, "arch": arch, "gpu": gpu.name, "problem": problem.describe(),
            "whole": len(set(counts.values())) == 1,
            "config": config.to_dict(),
            "launches": {x.kernel: {"tiles": x.label, "registers": x.verdict["registers"],
                                    "shared": x.verdict["shared"], "mma": x.verdict["mma"],
                                    "blocks_per_sm": x.verdict["blocks_per_sm"],
                                    "model_ms": round(x.predicted.seconds * 1e3, 4),
                                    "model_tflops": round(x.predicted.tflops, 1)} for x in picked},
            "admitted": {kernel: sum(x.kernel == kernel and x.ruled_out is None for x in launches)
                         for kernel in triton_launch.KERNEL_ARGS},
            "on_path": {kernel: sum(x.kernel == kernel and x.predicted is not None for x in on_path)
                        for kernel in triton_launch.KERNEL_ARGS}}
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", default=",".join(str(p) for p in SWEEPS))
    parser.add_argument("--out", default=str(RESULTS / "triton_defaults.json"))
    args = parser.parse_args(argv)
    records = []
    for path in args.sweeps.split(","):
        records += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    chosen = choose_defaults(records)
    rows = []
    for (variant, arch), entry in chosen.items():
        if entry["config"] is None:
            rows.append([variant, f"sm_{arch}", entry["gpu"], "no admitted launch on the tensor-core path", "", ""])
            continue
        config = TileConfig.from_dict(entry["config"])
        model = " / ".join(f"{x['model_tflops']:.0f}" for x in entry["launches"].values())
        rows.append([variant + ("" if entry["whole"] else " (part of dQ)"), f"sm_{arch}", entry["gpu"],
                     describe_config(config), model, " / ".join(str(n) for n in entry["on_path"].values())])
    print(table(["variant", "arch", "ranked on", "chosen", "model TFLOP/s fwd / dkv / dq",
                 "admitted on path fwd / dkv / dq"], rows))
    Path(args.out).write_text(json.dumps(list(chosen.values()), indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
