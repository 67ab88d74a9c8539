"""The pallas_tpu default tiles of each TPU generation, chosen from compile results and the analytic model;
nothing runs, nothing is timed.

    python benchmarks/tpu/tpu_defaults.py [--data benchmarks/tpu/results/tpu_vmem_kernels.jsonl]

For each generation with kernel compile results (`benchmarks/tpu/tpu_vmem_kernels.py`: every tile point of
each kernel compiled alone by the production TPU compiler, bf16 at D=128, 8192 tokens per device), the
candidates are the tiles that compiled there and that the VMEM constraint admits for float32 at the same
head dim (so a default never depends on the dtype being bf16). The analytic model (`tuner.models.tpu_model`)
times them on a causal zigzag ring of 4 over 32768 tokens (H=8, Hkv=2): the fastest forward tiles (ties,
which the model cannot tell apart since it ignores the compute slice, go to the larger slice), then
the fastest dK/dV tiles beside the generic dQ tiles, then the fastest dQ tiles beside those. Prints the
ranking and writes benchmarks/tpu/results/tpu_defaults.json; `tpu_memory.GENERATION_TILES` holds the
result.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import jax.numpy as jnp

from tuner.models import tpu_model
from tuner.kernels import tpu_memory
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem

RESULTS = Path(__file__).parent / "results"
PROBLEM = Problem(seq_len=32768, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True, ring_size=4)
TARGETS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
TOP = 5


def candidates(records: list[dict], target: str, kernel: str, limit: int) -> list[dict]:
    """The tile points of `kernel` that compiled on `target` for the problem's dtype and head dim and
    that the VMEM constraint admits for float32 there."""
    return [r for r in records if r["target"] == target and r["kernel"] == kernel and r["compiled"]
            and r["dtype"] == PROBLEM.dtype and r["head_dim"] == PROBLEM.head_dim
            and tpu_memory.vmem_bytes(kernel, r["block_q"], r["block_kv"], PROBLEM.head_dim, jnp.float32, 1,
                                      r["block_kv_compute"]) <= limit]


def tiles(params: FwdParams | BwdParams) -> dict[str, int]:
    return {name: value for name, value in asdict(params).items() if value is not None}


def choose(records: list[dict], chip: str) -> dict:
    """The chip's default tiles and the model's ranking of each kernel's candidates."""
    model, target = tpu_model.CHIPS[chip], TARGETS[chip]
    limit = next(r["vmem_given"] for r in records if r["target"] == target and r["vmem_given"])
    generic_fwd, generic_bwd = tpu_memory.FALLBACK_TILES

    def ranked(kernel: str, params_of) -> list[tuple[float, dict, FwdParams | BwdParams]]:
        timed = []
        for r in candidates(records, target, kernel, limit):
            params = params_of(r)
            seconds = tpu_model.predict(PROBLEM, model, **{"fwd" if kernel == "fwd" else "bwd": params}).seconds
            timed.append((seconds, r, params))
        return sorted(timed, key=lambda t: (t[0], -(t[1]["block_kv_compute"] or 0)))

    fwd = ranked("fwd", lambda r: FwdParams(block_q=r["block_q"], block_kv=r["block_kv"],
                                            block_kv_compute=r["block_kv_compute"]))
    dkv = ranked("dkv", lambda r: replace(generic_bwd, block_q_dkv=r["block_q"], block_kv_dkv=r["block_kv"]))
    dq = ranked("dq", lambda r: replace(dkv[0][2], block_q_dq=r["block_q"], block_kv_dq=r["block_kv"]))

    def top(timed):
        return [dict(tiles=f"{r['block_q']}x{r['block_kv']}" + (f" (compute {r['block_kv_compute']})"
                                                                  if r["block_kv_compute"] else ""),
                     model_ms=round(s * 1e3, 4), vmem_used=r["vmem_used"]) for s, r, _ in timed[:TOP]]

    return dict(chip=chip, target=target, candidates={"fwd": len(fwd), "dkv": len(dkv), "dq": len(dq)},
                fwd=tiles(fwd[0][2]), bwd=tiles(dq[0][2]),
                ranking={"fwd": top(fwd), "dkv": top(dkv), "dq": top(dq)},
                generic_model_ms={"fwd": round(tpu_model.predict(PROBLEM, model, fwd=generic_fwd).seconds * 1e3, 4),
                                  "bwd": round(tpu_model.predict(PROBLEM, model, bwd=generic_bwd).seconds * 1e3, 4)},
                chosen_model_ms={"fwd": round(fwd[0][0] * 1e3, 4), "bwd": round(dq[0][0] * 1e3, 4)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(RESULTS / "tpu_vmem_kernels.jsonl"))
    parser.add_argument("--out", default=str(RESULTS / "tpu_defaults.json"))
    args = parser.parse_args()
    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    chips = [chip for chip, target in TARGETS.items()
             if any(r["target"] == target and r["dtype"] == PROBLEM.dtype and r["head_dim"] == PROBLEM.head_dim
                    for r in records)]
    results = []
    for chip in chips:
        result = choose(records, chip)
        results.append(result)
        print(f"{chip}: fwd {result['fwd']}, bwd {result['bwd']}; model ms fwd {result['chosen_model_ms']['fwd']} "
              f"(generic {result['generic_model_ms']['fwd']}), bwd {result['chosen_model_ms']['bwd']} "
              f"(generic {result['generic_model_ms']['bwd']}); candidates {result['candidates']}", flush=True)
        for kernel, rows in result["ranking"].items():
            print(f"  {kernel}: " + ", ".join(f"{row['tiles']} {row['model_ms']} ms" for row in rows))
    Path(args.out).write_text(json.dumps(dict(problem=PROBLEM.describe(), chips=results), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
