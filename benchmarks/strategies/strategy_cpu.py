"""Does the strategy model rank the strategies as they measure? On P simulated CPU devices, forward+backward
of ring, all_to_all, all_gather and every hybrid split R x A (both > 1) against `strategy_model.predict`
on the "cpu" platform (`measure_cpu()`: numpy matmul FLOP/s, memcpy bytes/s), over a stated grid:

    python benchmarks/strategies/strategy_cpu.py                      # the grid below, ~12 min on 2 cores
    python benchmarks/strategies/strategy_cpu.py --rings 4 --heads-kv 8:4 --seq-lens 2048 --runs 3   # a quick look

Grid (default, 12 problems): ring size P in {4, 8}; (heads, kv heads) in {(4, 1), (8, 1), (8, 4)} (MQA and
GQA); global sequence S in {2048, 4096}; batch 1, head_dim 64, float32, causal, zigzag. all_to_all needs
H % P == 0; where it cannot run, a problem is ranked over the remaining strategies.

Each strategy runs as a user gets it: `ring_attention(..., strategy=...)` with its default tiles under
`jax.shard_map` over a 1-D mesh of P devices (hybrid: a 2-D mesh R x A, the layout over the ring axis), on
arrays already laid out (`layouts.lay_out`). Timed: `jax.value_and_grad` of a fixed random projection of
the output, jitted, compile excluded, one warm-up, the candidates of one problem interleaved round by
round (`tuner.tuning.timing.run_interleaved`), medians. The hybrid is ranked by its best split, measured and
predicted (as `rank` does). Per problem: measured and predicted seconds, both orders, whether the picks
agree, Kendall's tau; a wrong pick within `--noise` of the measured best is reported as within noise.

Writes benchmarks/strategies/results/strategy_cpu-2cpu-<date>.json (records, the grid, the cpu platform's
rates, the jax version, the load average at start and end) and benchmarks/strategies/results/strategy_cpu.md
(a table).

    python benchmarks/strategies/strategy_cpu.py --rescore \
        benchmarks/strategies/results/strategy_cpu-2cpu-2026-11-23.json

re-predicts a recorded run with the current model (the recorded measurements and cpu rates kept) and
rewrites that file and the table, noting the rescore in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEVICES = 8
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from scipy.stats import kendalltau  # noqa: E402

from tuner.semantics import layouts  # noqa: E402
from tuner import ring_attention  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402
from tuner.models.platforms import Platform, measure_cpu  # noqa: E402
from tuner.models.strategy_model import predict  # noqa: E402
from tuner.tuning.timing import attention_flops, compile_timed, run_interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FLAT = ("ring", "all_to_all", "all_gather")
STRATEGIES = (*FLAT, "hybrid")
AXES = ("ring", "a2a")


def splits(ring_size: int) -> list[tuple[int, int]]:
    """Every hybrid split (R, A) of `ring_size` devices with both > 1."""
    return [(ring_size // a, a) for a in range(2, ring_size) if ring_size % a == 0]


def candidates(problem: Problem) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Name -> (strategy, hybrid split) of what runs on `problem`: all_to_all only where H % P == 0, each
    hybrid split only where H % A == 0 (the model's rules too)."""
    p, h = problem.ring_size, problem.heads
    named = {s: (s, None) for s in FLAT if s != "all_to_all" or h % p == 0}
    named.update({f"hybrid {r}x{a}": ("hybrid", (r, a)) for r, a in splits(p) if h % a == 0})
    return named


def step_of(problem: Problem, strategy: str, split: tuple[int, int] | None) -> tuple[Callable, NamedSharding, int]:
    """The timed step (value and q, k, v gradients of a projection of the output), the sharding of its
    operands and the ring size their layout is over."""
    devices = np.array(jax.devices()[:problem.ring_size])
    if split is None:
        mesh, seq, axis_name, ring = Mesh(devices, ("sp",)), P(None, "sp"), "sp", problem.ring_size
    else:
        mesh, seq, axis_name, ring = Mesh(devices.reshape(split), AXES), P(None, AXES), AXES, split[0]

    def local(q, k, v):
        return ring_attention(q, k, v, causal=problem.causal, axis_name=axis_name, layout=problem.layout,
                              strategy=strategy)

    attend = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    grad = jax.value_and_grad(lambda q, k, v, w: jnp.vdot(attend(q, k, v), w), argnums=(0, 1, 2))
    return grad, NamedSharding(mesh, seq), ring


def draw(problem: Problem, sets: int, seed: int) -> list[tuple[np.ndarray, ...]]:
    """`sets` distinct non-zero (q, k, v, w) in token order."""
    rng = np.random.default_rng(seed)
    b, s, d = problem.batch, problem.seq_len, problem.head_dim
    shapes = ((b, s, problem.heads, d), (b, s, problem.kv_heads, d), (b, s, problem.kv_heads, d),
              (b, s, problem.heads, d))
    return [tuple(rng.standard_normal(shape, np.float32) for shape in shapes) for _ in range(sets)]


def measure(problem: Problem, runs: int, sets: int) -> dict[str, dict]:
    """Compiles every candidate of `problem`, then times them interleaved; name -> timing dict."""
    inputs, compiled, compile_s, placed = draw(problem, sets, seed=problem.seq_len + problem.heads), {}, {}, {}
    for name, (strategy, split) in candidates(problem).items():
        fn, sharding, ring = step_of(problem, strategy, split)
        placed[name] = [tuple(jax.device_put(layouts.lay_out(x, problem.layout, ring), sharding) for x in arrays)
                        for arrays in inputs]
        compiled[name], compile_s[name] = compile_timed(fn, placed[name][0])
    thunks = {name: (lambda i, fn=fn, args=placed[name]: fn(*args[i % len(args)])) for name, fn in compiled.items()}
    timings = run_interleaved(thunks, runs=runs, warmup=1, compile_seconds=compile_s)
    return {name: t.to_dict() for name, t in timings.items()}


def order(seconds: dict[str, float]) -> list[str]:
    return sorted(seconds, key=seconds.get)


def tau(measured: dict[str, float], predicted: dict[str, float]) -> float:
    """Kendall's tau-b between the measured and the predicted seconds of the same strategies."""
    names = list(measured)
    return float(kendalltau([measured[n] for n in names], [predicted[n] for n in names]).statistic)


def evaluate(problem: Problem, timings: dict[str, dict], noise: float, platform: Platform) -> dict:
    """One problem's record: per candidate measured and predicted seconds (on `platform`); per strategy
    (hybrid at its best split, measured and predicted apart) both orders, the picks, tau, the pick's
    measured cost."""
    runs = candidates(problem)
    predictions = {name: predict(problem, strategy, platform, axes=split) for name, (strategy, split) in runs.items()}
    flops = attention_flops(problem.batch, problem.heads, problem.seq_len, problem.seq_len, problem.head_dim,
                            causal=problem.causal, objective="fwd+bwd")
    per_candidate = {name: {**timings[name], "predicted_s": predictions[name].seconds,
                            "gflop_per_s": flops / timings[name]["median_s"] / 1e9,
                            "predicted_compute_s": predictions[name].compute_s,
                            "predicted_link_bytes": predictions[name].link_bytes} for name in runs}
    hybrids = [name for name in runs if name.startswith("hybrid")]
    measured = {name: timings[name]["median_s"] for name in runs if name in FLAT}
    predicted = {name: predictions[name].seconds for name in measured}
    best_measured_split = min(hybrids, key=lambda n: timings[n]["median_s"])
    best_predicted_split = min(hybrids, key=lambda n: predictions[n].seconds)
    measured["hybrid"] = timings[best_measured_split]["median_s"]
    predicted["hybrid"] = predictions[best_predicted_split].seconds
    measured_order, predicted_order = order(measured), order(predicted)
    pick, best = predicted_order[0], measured_order[0]
    # The model's pick as it would run: the hybrid at the model's split.
    pick_s = timings[best_predicted_split]["median_s"] if pick == "hybrid" else measured[pick]
    ratio = pick_s / measured[best]
    margin = predicted[predicted_order[1]] / predicted[pick] - 1
    return {"problem": problem.describe(), "ring_size": problem.ring_size, "heads": problem.heads,
            "kv_heads": problem.kv_heads, "seq_len": problem.seq_len, "flops": flops, "candidates": per_candidate,
            "unsupported": [s for s in STRATEGIES if s not in measured],
            "measured_s": measured, "predicted_s": predicted,
            "hybrid_split": {"measured": best_measured_split, "predicted": best_predicted_split},
            "measured_order": measured_order, "predicted_order": predicted_order,
            "measured_pick": best, "model_pick": pick, "model_margin": margin, "agree": pick == best,
            "pick_over_best": ratio, "within_noise": pick != best and ratio < 1 + noise,
            "kendall_tau": tau(measured, predicted)}


def grid(args: argparse.Namespace) -> list[Problem]:
    return [Problem(batch=1, seq_len=s, heads=h, kv_heads=kv, head_dim=args.head_dim, dtype="float32", causal=True,
                    ring_size=p, layout="zigzag")
            for p in args.rings for h, kv in args.heads_kv for s in args.seq_lens]


def heads_kv(text: str) -> tuple[int, int]:
    """"H:Hkv" as a pair of ints."""
    heads, kv = text.split(":")
    return int(heads), int(kv)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def table(records: list[dict], summary: dict, rates: dict, loads: dict) -> str:
    """The markdown table: per problem each strategy's measured / predicted ms, both picks, agreement."""
    lines = ["| P | H | Hkv | S | " + " | ".join(f"{s} ms meas / pred" for s in STRATEGIES)
             + " | measured pick | model pick (margin) | agree | pick / best | tau |",
             "|---|---|---|---|" + "---|" * len(STRATEGIES) + "---|---|---|---|---|"]
    for r in records:
        cells = []
        for s in STRATEGIES:
            if s not in r["measured_s"]:
                cells.append("n/a")
                continue
            split = (f" ({r['hybrid_split']['measured'][7:]} / {r['hybrid_split']['predicted'][7:]})"
                     if s == "hybrid" else "")
            cells.append(f"{ms(r['measured_s'][s])} / {ms(r['predicted_s'][s])}{split}")
        agree = "yes" if r["agree"] else ("no (within noise)" if r["within_noise"] else "no")
        lines.append(f"| {r['ring_size']} | {r['heads']} | {r['kv_heads']} | {r['seq_len']} | {' | '.join(cells)} | "
                     f"{r['measured_pick']} | {r['model_pick']} ({r['model_margin']:.2%}) | {agree} | "
                     f"{r['pick_over_best']:.2f} | {r['kendall_tau']:.2f} |")
    return "\n".join([
        *lines, "",
        f"Picks agree on {summary['agree']} of {summary['problems']} problems ({summary['within_noise']} more "
        f"within {summary['noise']:.0%} noise); mean Kendall tau {summary['mean_tau']:.2f}. Measured: median "
        f"forward+backward ms over {summary['runs']} interleaved runs of P simulated devices on this host's "
        f"cores; predicted: `strategy_model.predict(..., 'cpu')`, per device (absolute times not comparable: "
        f"all simulated devices share the cores). hybrid: best split measured / predicted (R x A). margin: the "
        f"model's runner-up over its pick; pick / best: the measured time of the model's pick over the fastest.",
        f"cpu platform: {rates['flops'] / 1e9:.1f} GFLOP/s, {rates['p2p'] / 1e9:.1f} GB/s; "
        f"load average {loads['start'][0]:.1f} at start, {loads['end'][0]:.1f} at end."])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rings", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--heads-kv", type=heads_kv, nargs="+", default=[(4, 1), (8, 1), (8, 4)],
                        help="H:Hkv pairs")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sets", type=int, default=2, help="distinct input sets, used in turn")
    parser.add_argument("--noise", type=float, default=0.10, help="a wrong pick this close to the best is noise")
    parser.add_argument("--out", type=Path, default=RESULTS / f"strategy_cpu-2cpu-{time.strftime('%Y-%m-%d')}.json")
    parser.add_argument("--table", type=Path, default=RESULTS / "strategy_cpu.md")
    parser.add_argument("--rescore", type=Path, default=None, metavar="JSON",
                        help="re-predict this recorded run with the current model; measures nothing")
    args = parser.parse_args(argv)
    if args.rescore is not None:
        return rescore(args.rescore, args.table, args.noise)

    start, load_start = time.perf_counter(), os.getloadavg()
    cpu = measure_cpu()
    rates = {"flops": cpu.flops, "p2p": cpu.p2p, "all_gather": cpu.all_gather, "all_to_all": cpu.all_to_all}
    print(f"cpu platform: {cpu.flops / 1e9:.1f} GFLOP/s, {cpu.p2p / 1e9:.1f} GB/s; load {load_start[0]:.1f}",
          flush=True)
    records = []
    for problem in grid(args):
        began, load = time.perf_counter(), os.getloadavg()[0]
        record = evaluate(problem, measure(problem, args.runs, args.sets), args.noise, cpu)
        record.update(load_average=load, seconds=time.perf_counter() - began)
        records.append(record)
        shown = "  ".join(f"{n} {ms(c['median_s'])}/{ms(c['predicted_s'])}" for n, c in record["candidates"].items())
        print(f"{problem.describe()}: {shown} ms meas/pred | measured {record['measured_pick']}, model "
              f"{record['model_pick']}, tau {record['kendall_tau']:.2f} ({record['seconds']:.0f} s, load {load:.1f})",
              flush=True)
    loads = {"start": load_start, "end": os.getloadavg()}
    summary = summarize(records, args.noise, args.runs)
    text = table(records, summary, rates, loads)
    print(text)
    result = {"device": f"cpu ({host.processor() or host.machine()}, {os.cpu_count()} cores), {DEVICES} simulated",
              "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "command": " ".join(["python", *sys.argv]),
              "grid": {"ring_sizes": args.rings, "heads_kv": args.heads_kv,
                       "seq_lens": args.seq_lens, "batch": 1, "head_dim": args.head_dim, "dtype": "float32",
                       "causal": True, "layout": "zigzag", "objective": "fwd+bwd", "runs": args.runs,
                       "warmup": 1, "input_sets": args.sets},
              "cpu_platform": rates, "load_average": loads, "total_seconds": time.perf_counter() - start,
              "summary": summary, "records": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.table.write_text(text + "\n")
    print(f"wrote {args.out} and {args.table}")
    return 0


def rescore(path: Path, table_path: Path, noise: float) -> int:
    """Re-predict the run recorded in `path` with the current model, on the cpu platform it recorded."""
    result = json.loads(path.read_text())
    rates = result["cpu_platform"]
    cpu = Platform("cpu", rates["flops"], rates["flops"], 1.0, rates["p2p"], rates["all_gather"], rates["all_to_all"],
                   0.0, None, "recorded by the run")
    records = []
    for old in result["records"]:
        problem = Problem.parse(old["problem"])
        timings = {name: {k: v for k, v in c.items() if not k.startswith("predicted") and k != "gflop_per_s"}
                   for name, c in old["candidates"].items()}
        records.append({**evaluate(problem, timings, noise, cpu), "load_average": old["load_average"],
                        "seconds": old["seconds"]})
    summary = summarize(records, noise, result["grid"]["runs"])
    text = table(records, summary, rates, result["load_average"])
    print(text)
    result.update(records=records, summary=summary,
                  rescored={"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
                            "why": "predictions recomputed by the current strategy model; measurements unchanged"})
    path.write_text(json.dumps(result, indent=2) + "\n")
    table_path.write_text(text + "\n")
    print(f"rewrote {path} and {table_path}")
    return 0


def summarize(records: list[dict], noise: float, runs: int) -> dict:
    """Agreement over the grid: picks that agree, wrong picks within noise, mean tau, the disagreements, and
    per strategy the median measured / predicted ratio."""
    return {"problems": len(records), "agree": sum(r["agree"] for r in records),
            "within_noise": sum(r["within_noise"] for r in records), "noise": noise, "runs": runs,
            "mean_tau": statistics.mean(r["kendall_tau"] for r in records),
            "disagreements": [{"problem": r["problem"], "measured_pick": r["measured_pick"],
                               "model_pick": r["model_pick"], "pick_over_best": r["pick_over_best"],
                               "within_noise": r["within_noise"]} for r in records if not r["agree"]],
            "measured_over_predicted": {s: statistics.median(r["measured_s"][s] / r["predicted_s"][s]
                                                             for r in records if s in r["measured_s"])
                                        for s in STRATEGIES}}


if __name__ == "__main__":
    raise SystemExit(main())
