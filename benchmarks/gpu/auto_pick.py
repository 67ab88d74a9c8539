"""Does `backend="auto"` run the faster engine? What a user does, on the GPU session's problems (issue 57).

    python benchmarks/gpu/auto_pick.py --out OUT/auto.json                  # on a CUDA GPU
    python benchmarks/gpu/auto_pick.py --out OUT/auto.json --timings OUT/timings.json
    python benchmarks/gpu/auto_pick.py --engines scan,all_to_all --tokens 64 --hidden 64 --head-dim 16 \
        --seq-lens 32 --out F                                             # CPU: the harness, with CPU engines

For each problem (B*S = `--tokens`, H = `--hidden` / D, one device, bf16, causal and not) it runs what a
user runs to let auto choose: `tuner bench --mechanisms triton,cudnn` (each ring checked against the scan
ring, then both timed interleaved, forward and backward, medians; the run recorded in a cache file of its
own), then `get_tuned_ring_attention(backend="auto", db=that file)` without a mesh, and asks its
`explain` which engine it runs. A row says which engine the bench measured faster and whether auto runs
it. With `--timings` (the session's timings.json, measured by `gpu_attention.py` in the same session)
it also says which of the Triton ring and the cudnn-engine ring that harness timed faster, forward plus
backward medians, and whether the bench ranks them the same way.

`--engines` names other implementations to compare (the CPU rehearsal takes two that run there: auto
follows no measurement of kernels run in their interpreters).

Exit status 1 when auto does not run the engine the bench measured faster on some problem, or a bench
fails; rows are written as they come, so a run stopped by a time limit keeps the problems it finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax

from tuner import get_tuned_ring_attention
from tuner.cache import Cache
from tuner.semantics.problem import Problem
from tuner.tuning.bench import bench_mechanisms
from tuner.tuning.decision import local_structs

sys.path.insert(0, str(Path(__file__).parent))
from gpu_attention import grid, parse_ints  # noqa: E402 - the timing step's problems and its flag parsing

HARNESS = {"triton": "ring", "cudnn": "ring_cudnn"}  # the engines' names in gpu_attention.py's rows


def problems(tokens: int, hidden: int, head_dim: int, seq_lens: list[int]) -> list[Problem]:
    """The timing step's problems (`gpu_attention.grid`), shortest first, not causal before causal."""
    return [Problem(**point, kv_heads=point["heads"], dtype="bfloat16", causal=causal, ring_size=1)
            for point in grid(tokens, hidden, [head_dim], sorted(seq_lens)) for causal in (False, True)]


def harness_order(timings: dict | None, problem: Problem, engines: list[str]) -> dict | None:
    """The harness's forward + backward medians of the two engines' rings on `problem`, and the faster;
    None without timings or when `engines` are not the two the harness times."""
    if timings is None or sorted(engines) != sorted(HARNESS):
        return None
    rows = [r for r in timings["rows"] if (r["seq_len"], r["causal"], r["head_dim"], r["batch"]) ==
            (problem.seq_len, problem.causal, problem.head_dim, problem.batch) and r["objective"] in ("fwd", "bwd")]
    seconds = {}
    for engine, name in HARNESS.items():
        parts = [r.get(name, {}).get("median_s") for r in rows]
        if len(parts) == 2 and None not in parts:
            seconds[engine] = sum(parts)
    if len(seconds) < 2:
        return {"seconds": seconds, "faster": None}
    return {"seconds": seconds, "faster": min(seconds, key=seconds.get)}


def pick(problem: Problem, engines: list[str], *, runs: int, calls: int, folder: Path) -> dict:
    """Bench `engines` on `problem` into a cache file of its own, then ask auto which it runs."""
    db = folder / f"auto-{problem.seq_len}-{'causal' if problem.causal else 'full'}.sqlite"
    device = jax.devices()[0].platform
    report, _ = bench_mechanisms(problem, device=device, objective="fwd+bwd", runs=runs, calls=calls, db=str(db),
                                 names=engines)
    print(report, flush=True)
    measured = {row["backend"]: row["best_s"] for row in Cache(str(db)).rows() if row["source"] == "bench"}
    attn = get_tuned_ring_attention(causal=problem.causal, db=str(db))
    decision = attn.explain(*local_structs(problem))
    faster = min(measured, key=measured.get) if measured else None
    return {"seq_len": problem.seq_len, "batch": problem.batch, "heads": problem.heads,
            "head_dim": problem.head_dim, "causal": problem.causal, "bench_s": measured, "bench_faster": faster,
            "auto_runs": decision.backend, "auto_reason": decision.reason,
            "auto_runs_the_faster": decision.backend == faster}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="B*S of every problem (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="H*D of every problem (default 2048)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-lens", default="4096,16384")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of the bench (median)")
    parser.add_argument("--calls", type=int, default=3, help="back-to-back calls per timed run")
    parser.add_argument("--engines", default="triton,cudnn", help="the implementations compared (default "
                                                                   "triton,cudnn)")
    parser.add_argument("--timings", help="the session's timings.json: also compare with its order of the engines")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    seq_lens = parse_ints(args.seq_lens, "--seq-lens")
    if args.timings is not None and not Path(args.timings).is_file():
        parser.error(f"--timings: no file at {args.timings}")
    timings = json.loads(Path(args.timings).read_text()) if args.timings else None
    for name in ("runs", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    if len(engines) < 2:
        parser.error(f"--engines: name two implementations or more to choose between, got {args.engines!r}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
              "command": " ".join(["python", "benchmarks/gpu/auto_pick.py", *(sys.argv[1:] if argv is None else argv)]),
              "engines": engines, "rows": [], "failed": []}
    status = 0
    with tempfile.TemporaryDirectory() as folder:
        for problem in problems(args.tokens, args.hidden, args.head_dim, seq_lens):
            try:
                row = pick(problem, engines, runs=args.runs, calls=args.calls, folder=Path(folder))
            except (RuntimeError, ValueError) as error:
                result["failed"].append({"seq_len": problem.seq_len, "causal": problem.causal, "error": str(error)})
                print(f"FAILED S={problem.seq_len} causal={problem.causal}: {error}", file=sys.stderr, flush=True)
                status = 1
            else:
                harness = harness_order(timings, problem, engines)
                if harness is not None:
                    row["harness"] = harness
                    row["same_order_as_harness"] = (None if harness["faster"] is None
                                                    else harness["faster"] == row["bench_faster"])
                result["rows"].append(row)
                status = status or (0 if row["auto_runs_the_faster"] else 1)
                print(f"S={problem.seq_len} causal={problem.causal}: bench faster {row['bench_faster']}, "
                      f"auto runs {row['auto_runs']}", flush=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
