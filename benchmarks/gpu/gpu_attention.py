"""GPU benchmark: the Triton ring kernels (one device, default params) against cuDNN and XLA attention.

    python benchmarks/gpu/gpu_attention.py                        # the whole grid, on a CUDA GPU
    python benchmarks/gpu/gpu_attention.py --head-dims 128 --seq-lens 4096,16384
    python benchmarks/gpu/gpu_attention.py --tuned tuning.sqlite  # also the tiles `tuner search` stored there
    python benchmarks/gpu/gpu_attention.py --interpret --tokens 64 --hidden 32 --head-dims 16 --seq-lens 32
                                                              # CPU: the harness, kernels interpreted

The grid: B*S = `--tokens` (16k) tokens of hidden size `--hidden` (2048, so H = 2048 / D heads), head
dims 64 and 128, S from 1k to 16k, causal and not, bfloat16. For each point it

1. checks every implementation on two heads of the first batch row against XLA attention on float32
   copies of the same inputs (output and dq/dk/dv of a random projection; relative Frobenius error), and stops with
   exit status 1 if one is off by more than `--max-error`; it records whether a second run of the same
   compiled check gave the same bits (`same_bits_twice`: determinism, docs/determinism.md);
2. times forward, backward alone (the vjp of saved residuals, applied to a fixed cotangent) and both
   (value and gradient), each implementation interleaved with the others in the same runs, each call
   on one of three rotating input sets (together larger than the GPU's L2), `--calls` calls per run
   issued back to back so the host's dispatch gap stays out of sub-millisecond kernels; medians.

Implementations: `ring` is `tuner.ring_attention(backend="triton")` with `axis_name=None` (a ring of
one device: the generated kernels plus the driver's float32 bookkeeping) at the backend's default tiles;
`ring_cudnn` the same ring with the cudnn engine (`backend="cudnn"`, its default chunks: half the shard
under a mask), `ring_cudnn_shard` with the whole shard as one chunk (one cuDNN call a block);
with `--tuned DB`, `tuned` is the same ring at the tiles that `tuner search --device gpu` stored in DB for
the point on this device (a point without such a row is said so and times `ring` alone); `cudnn` and `xla`
are `jax.nn.dot_product_attention` with that implementation. An implementation that cannot run a point
(cuDNN without a GPU, XLA out of memory) is recorded with its error instead of a timing.

TFLOP/s count forward 4*B*H*S^2*D, half when causal, backward 2.5x that (`tuner.tuning.timing.attention_flops`).
The targets of issue 3 are checked and printed: at D=128 and S >= 4k, forward >= 0.6x and backward
>= 0.5x cuDNN's time-based throughput (of `tuned` where it ran, else of `ring`); and issue 57's, of the
faster of the two cudnn-engine rings: forward >= 0.9x and backward >= 0.85x. `--implementations` picks
some, `--dtype float32` checks in float32 (cuDNN refuses it: recorded), `--group G` gives the keys and
values H/G heads (grouped-query attention), `--check-only` checks without timing. JSON goes to `--out` (default
benchmarks/gpu/results/gpu_attention-<device>-<date>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import tuner
from tuner import ring_attention
from tuner.cache import Cache, row_params
from tuner.kernels import BACKENDS
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem, ProblemKey
from tuner.support.tables import error_line
from tuner.tuning.timing import Timing, attention_flops, compile_timed, run_interleaved, warmup_seconds_on

OBJECTIVES = ("fwd", "bwd", "fwd+bwd")
IMPLEMENTATIONS = ("tuned", "ring", "ring_cudnn", "ring_cudnn_shard", "cudnn", "xla")
ENGINES = ("ring_cudnn", "ring_cudnn_shard")  # the ring over the cudnn engine, two chunkings
TARGETS = {"fwd": 0.6, "bwd": 0.5}  # of cuDNN's throughput, at D=128 and S >= TARGET_MIN_SEQ
ENGINE_TARGETS = {"fwd": 0.9, "bwd": 0.85}  # of cuDNN's, for the faster of the ENGINES
TARGET_MIN_SEQ = 4096
CHECK_HEADS = 2  # heads of the first batch row that the correctness check compares


def attention_fn(implementation: str, causal: bool, interpret: bool,
                 params: tuple[FwdParams, BwdParams] | None = None) -> Callable:
    """`fn(q, k, v) -> out` for one implementation, all arrays [B, S, H, D]; `params` are the tiles of
    `tuned`."""
    if implementation in ("ring", "tuned"):
        fwd, bwd = params if implementation == "tuned" else (None, None)
        return lambda q, k, v: ring_attention(q, k, v, causal=causal, backend="triton", interpret=interpret,
                                              fwd_params=fwd, bwd_params=bwd)
    if implementation in ENGINES:
        def engine(q, k, v):
            shard = q.shape[1]
            whole = implementation == "ring_cudnn_shard"
            return ring_attention(q, k, v, causal=causal, backend="cudnn", interpret=interpret,
                                  fwd_params=FwdParams(shard, shard) if whole else None,
                                  bwd_params=BwdParams(shard, shard) if whole else None)
        return engine
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)


def objective_fn(fn: Callable, objective: str) -> Callable:
    """The timed function of an objective, taking (q, k, v, cotangent).

    "fwd" is the forward; "fwd+bwd" the forward and the gradient of <out, cotangent>; "bwd" takes the
    residuals of a forward run beforehand (see `bwd_inputs`) and applies only the backward."""
    if objective == "fwd":
        return lambda q, k, v, g: fn(q, k, v)
    if objective == "fwd+bwd":
        def both(q, k, v, g):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(g)
        return both
    if objective == "bwd":
        return lambda vjp, g: vjp(g)
    raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")


def bwd_inputs(fn: Callable, sets: list[tuple]) -> list[tuple]:
    """(vjp, cotangent) per input set: the forward run once, its residuals kept on the device."""
    forward = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))
    return [(forward(q, k, v)[1], g) for q, k, v, g in sets]


def draw_sets(shape: tuple[int, ...], count: int, seed: int, dtype, group: int = 1) -> list[tuple]:
    """`count` sets of (q, k, v, cotangent), standard normal (never zeros), on the default device; keys and
    values with a `group`-th of the heads."""
    rng = np.random.default_rng(seed)
    b, s, h, d = shape
    shapes = (shape, (b, s, h // group, d), (b, s, h // group, d), shape)
    return [tuple(jnp.asarray(rng.standard_normal(each, dtype=np.float32), dtype) for each in shapes)
            for _ in range(count)]


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(fns: dict[str, Callable], causal: bool, q, k, v, g
          ) -> tuple[dict[str, dict[str, float] | str], dict[str, bool]]:
    """Per implementation, the errors of its output and gradients against XLA on float32 copies of
    the same inputs (pass a slice: the float32 reference materializes the [B, H, S, S] logits), or
    the error it raised; and whether a second run of the same compiled function gave the same bits."""
    def value_and_grads(fn, *args):
        out, vjp = jax.vjp(fn, *args[:3])
        return (out, *vjp(args[3]))

    f32 = [x.astype(jnp.float32) for x in (q, k, v, g)]
    want = jax.jit(lambda *a: value_and_grads(attention_fn("xla", causal, False), *a))(*f32)
    errors: dict[str, dict[str, float] | str] = {}
    repeats: dict[str, bool] = {}
    for name, fn in fns.items():
        try:
            run = jax.jit(lambda *a, fn=fn: value_and_grads(fn, *a))
            got, again = run(q, k, v, g), run(q, k, v, g)
        except Exception as error:  # noqa: BLE001 - recorded; the caller decides what it means
            errors[name] = error_line(error)
            continue
        errors[name] = {label: rel_err(x, w) for label, x, w in zip(("out", "dq", "dk", "dv"), got, want)}
        repeats[name] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, again))
    return errors, repeats


def time_point(fns: dict[str, Callable], sets: list[tuple], objective: str, *, runs: int, calls: int,
               warmup: int) -> tuple[dict[str, Timing], dict[str, str]]:
    """Timings of every implementation that compiles and runs; errors of those that do not."""
    thunks, compile_seconds, errors = {}, {}, {}
    for name, fn in fns.items():
        try:
            timed = objective_fn(fn, objective)
            args = bwd_inputs(fn, sets) if objective == "bwd" else sets
            compiled, compile_seconds[name] = compile_timed(timed, args[0])
            jax.block_until_ready(compiled(*args[0]))
            thunks[name] = lambda i, c=compiled, a=args: c(*a[i % len(a)])
        except Exception as error:  # noqa: BLE001 - recorded per implementation; the others go on
            errors[name] = error_line(error)
    warm = warmup_seconds_on(jax.devices()[0].platform)
    timings = run_interleaved(thunks, runs=runs, warmup=warmup, warmup_seconds=warm, calls=calls,
                              compile_seconds=compile_seconds) if thunks else {}
    return timings, errors


def unavailable(implementation: str, interpret: bool) -> str | None:
    """Why an implementation cannot run here at all, or None."""
    gpu = any(d.platform == "gpu" for d in jax.devices())
    if implementation == "cudnn" and not gpu:
        return "cuDNN needs a CUDA GPU"
    if implementation == "ring":
        return BACKENDS["triton"].unavailable_reason(interpret)
    if implementation in ENGINES:
        return BACKENDS["cudnn"].unavailable_reason(interpret)
    return None


def tuned_params(cache: Cache, point: dict[str, int], causal: bool) -> tuple[FwdParams, BwdParams] | None:
    """The tiles `tuner search` stored in `cache` for this point on this device (Triton, one device, bf16),
    or None."""
    problem = Problem(batch=point["batch"], seq_len=point["seq_len"], heads=point["heads"],
                      kv_heads=point["heads"], head_dim=point["head_dim"], dtype="bfloat16", causal=causal,
                      ring_size=1, layout="contiguous")
    key = ProblemKey.of(problem.shapes, problem.spec, backend="triton", device_kind=jax.devices()[0].device_kind,
                        ring_size=1, layout="contiguous")
    row = cache.entry(key.digest)
    return row_params(row) if row is not None else None


def device_name() -> str:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return device.device_kind


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"error: {name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"error: {name} must list positive integers, got {text!r}")
    return values


def grid(tokens: int, hidden: int, head_dims: list[int], seq_lens: list[int]) -> list[dict[str, int]]:
    """The (B, S, H, D) points: B*S = tokens, H*D = hidden."""
    points = []
    for d in head_dims:
        if hidden % d:
            raise SystemExit(f"error: --hidden {hidden} is not a multiple of head dim {d}")
        for s in seq_lens:
            if tokens % s:
                raise SystemExit(f"error: --tokens {tokens} is not a multiple of sequence length {s}")
            points.append({"batch": tokens // s, "seq_len": s, "heads": hidden // d, "head_dim": d})
    return points


def target_checks(rows: list[dict]) -> list[dict]:
    """Issue 3's targets at D=128 and S >= 4k: ring throughput over cuDNN's, forward and backward."""
    checks = []
    for row in rows:
        want = TARGETS.get(row["objective"])
        of = "tuned" if "tuned_vs_cudnn" in row else "ring"
        ratio = row.get("tuned_vs_cudnn" if of == "tuned" else "ratio_vs_cudnn")
        if want is None or row["head_dim"] != 128 or row["seq_len"] < TARGET_MIN_SEQ or ratio is None:
            continue
        checks.append({"objective": row["objective"], "seq_len": row["seq_len"], "causal": row["causal"],
                       "of": of, "ratio_vs_cudnn": ratio, "target": want, "met": ratio >= want})
    for row in rows:
        want = ENGINE_TARGETS.get(row["objective"])
        ratios = {name: row[f"{name}_vs_cudnn"] for name in ENGINES if f"{name}_vs_cudnn" in row}
        if want is None or row["head_dim"] != 128 or row["seq_len"] < TARGET_MIN_SEQ or not ratios:
            continue
        of = max(ratios, key=ratios.get)
        checks.append({"objective": row["objective"], "seq_len": row["seq_len"], "causal": row["causal"],
                       "of": of, "ratio_vs_cudnn": ratios[of], "target": want, "met": ratios[of] >= want})
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="B*S of every point (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="H*D of every point (default 2048)")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--runs", type=int, default=15, help="timed runs per point (median)")
    parser.add_argument("--calls", type=int, default=5, help="back-to-back calls per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-error", type=float, default=2e-2,
                        help="largest relative error against float32 XLA that passes (bf16 inputs)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the Triton kernels in Triton's interpreter (a CPU check of the harness)")
    parser.add_argument("--tuned", metavar="DB",
                        help="cache file of a `tuner search --device gpu` run: also time its tiles per point")
    parser.add_argument("--out", help="JSON path (default benchmarks/gpu/results/gpu_attention-<device>-<date>.json)")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS),
                        help=f"which of {', '.join(IMPLEMENTATIONS)} (default all that run here)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--group", type=int, default=1, help="query heads per key/value head (default 1)")
    parser.add_argument("--check-only", action="store_true", help="check every implementation, time none")
    args = parser.parse_args(argv)

    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    if bad := [o for o in objectives if o not in OBJECTIVES]:
        parser.error(f"--objectives: unknown {', '.join(bad)} (choose from {', '.join(OBJECTIVES)})")
    for name in ("runs", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    wanted = [n.strip() for n in args.implementations.split(",") if n.strip()]
    if bad := [n for n in wanted if n not in IMPLEMENTATIONS]:
        parser.error(f"--implementations: unknown {', '.join(bad)} (choose from {', '.join(IMPLEMENTATIONS)})")
    if "ring" not in wanted:
        parser.error("--implementations must include ring: the Triton ring is what every row is checked beside")
    if args.group < 1 or any((args.hidden // d) % args.group for d in parse_ints(args.head_dims, "--head-dims")):
        parser.error(f"--group {args.group} must divide the heads of every point (--hidden / head dim)")
    gpu = any(d.platform == "gpu" for d in jax.devices())
    if not gpu and not args.interpret:
        print(f"error: no CUDA GPU visible to jax (platforms: {sorted({d.platform for d in jax.devices()})}); run "
              "this on a GPU machine, or add --interpret with a tiny --tokens/--hidden to check the harness "
              "on the CPU", file=sys.stderr)
        return 2
    points = grid(args.tokens, args.hidden, parse_ints(args.head_dims, "--head-dims"),
                  parse_ints(args.seq_lens, "--seq-lens"))
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    skipped = {name: why for name in wanted if (why := unavailable(name, args.interpret))}
    if args.tuned is not None and not Path(args.tuned).is_file():
        parser.error(f"--tuned: no cache file at {args.tuned}")
    cache = Cache(args.tuned) if args.tuned else None
    if "ring" in skipped:
        print(f"error: the Triton backend cannot run here: {skipped['ring']}", file=sys.stderr)
        return 2

    device = device_name()
    date = time.strftime("%Y-%m-%d")
    out_path = Path(args.out or f"benchmarks/gpu/results/gpu_attention-"
                                f"{re.sub(r'[^A-Za-z0-9]+', '-', device).strip('-')}-{date}.json")
    result = {"device": device, "date": date, "jax": jax.__version__, "tuner": tuner.__version__,
              "triton": _version("triton"),
              "command": " ".join(["python", "benchmarks/gpu/gpu_attention.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "dtype": args.dtype, "group": args.group, "interpret": args.interpret, "runs": args.runs,
              "calls": args.calls,
              "unavailable": skipped, "tuned_from": args.tuned, "tuned": [], "rows": [], "checks": []}
    names = [name for name in wanted if name not in skipped and (name != "tuned" or cache is not None)]
    header = (f"{'D':>4} {'S':>6} {'B':>3} {'H':>3} {'causal':>6} {'objective':>8} "
              + "".join(f" {name + ' ms':>{_width(name)}} {'TFLOP/s':>8}" for name in names)
              + "".join(f" {label:>{width}}" for _, label, width in _ratios(names)))
    print(f"device: {device}; {args.dtype}; {args.runs} runs x {args.calls} calls, medians")
    print(header)
    failed = False
    for point in points:
        b, s, h, d = point["batch"], point["seq_len"], point["heads"], point["head_dim"]
        sets = draw_sets((b, s, h, d), 3, seed=s * d, dtype=jnp.dtype(args.dtype), group=args.group)
        for causal in causals:
            params = tuned_params(cache, point, causal) if cache is not None else None
            if cache is not None and params is None:
                print(f"note: {args.tuned} holds no search row for D={d} S={s} B={b} H={h} causal={causal} "
                      f"on this device; timing the default tiles only")
            fns = {name: attention_fn(name, causal, args.interpret, params) for name in names
                   if name != "tuned" or params is not None}
            if params is not None:
                result["tuned"].append({**point, "causal": causal, "fwd": params[0].to_dict(),
                                        "bwd": params[1].to_dict()})
            heads = [CHECK_HEADS * args.group, CHECK_HEADS, CHECK_HEADS, CHECK_HEADS * args.group]  # GQA kept
            errors, repeats = check(fns, causal, *[x[:1, :, :n] for x, n in zip(sets[0], heads)])
            result["checks"].append({**point, "causal": causal, "errors": errors, "same_bits_twice": repeats})
            # An implementation that cannot run the point is left out of its timings; one that runs
            # and is wrong fails the point, and the ring raising fails it too.
            wrong = {name: e for name, e in errors.items()
                     if isinstance(e, dict) and max(e.values()) > args.max_error}
            if wrong or isinstance(errors["ring"], str):
                failed = True
                print(f"FAILED check at D={d} S={s} causal={causal}: {wrong or errors['ring']}",
                      file=sys.stderr)
                continue
            fns = {name: fn for name, fn in fns.items() if isinstance(errors[name], dict)}
            for objective in [] if args.check_only else objectives:
                timings, run_errors = time_point(fns, sets, objective, runs=args.runs, calls=args.calls,
                                                 warmup=args.warmup)
                flops = attention_flops(b, h, s, s, d, causal=causal, objective=objective)
                row = {**point, "causal": causal, "objective": objective, "flops": flops}
                for name in fns:
                    if name in timings:
                        row[name] = {**timings[name].to_dict(), "tflops": flops / timings[name].median / 1e12}
                    else:
                        row[name] = {"error": run_errors.get(name) or errors[name]}
                if "median_s" in row.get("ring", {}) and "median_s" in row.get("cudnn", {}):
                    row["ratio_vs_cudnn"] = row["cudnn"]["median_s"] / row["ring"]["median_s"]
                for name in ENGINES:
                    if "median_s" in row.get(name, {}) and "median_s" in row.get("cudnn", {}):
                        row[f"{name}_vs_cudnn"] = row["cudnn"]["median_s"] / row[name]["median_s"]
                if "median_s" in row.get("tuned", {}):
                    for other, field in (("cudnn", "tuned_vs_cudnn"), ("ring", "tuned_vs_ring")):
                        if "median_s" in row.get(other, {}):
                            row[field] = row[other]["median_s"] / row["tuned"]["median_s"]
                result["rows"].append(row)
                print(_table_row(row, names), flush=True)
                _write(out_path, result)  # so far: a run stopped by a time limit keeps its rows
        _write(out_path, result)
    result["targets"] = target_checks(result["rows"])
    for target in result["targets"]:
        print(f"target {target['objective']:>3} D=128 S={target['seq_len']:>5} causal={target['causal']!s:5} "
              f"({target['of']}): "
              f"{target['ratio_vs_cudnn']:.2f}x cuDNN (target {target['target']}x) "
              f"{'met' if target['met'] else 'NOT met'}")
    _write(out_path, result)
    print(f"wrote {out_path}")
    return 1 if failed else 0


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def _width(name: str) -> int:
    return max(10, len(name) + 3)


def _ratios(names: list[str]) -> list[tuple[str, str, int]]:
    """(row field, column label, width) of the ratio columns for these implementations."""
    ratios = [("ratio_vs_cudnn", "ring/cudnn")]
    ratios += [(f"{name}_vs_cudnn", f"{name}/cudnn") for name in ENGINES if name in names]
    ratios += [("tuned_vs_cudnn", "tuned/cudnn"), ("tuned_vs_ring", "tuned/ring")] if "tuned" in names else []
    return [(field, label, len(label) + 1) for field, label in ratios]


def _table_row(row: dict, names: list[str]) -> str:
    cells = []
    for name in names:
        entry = row.get(name)
        if entry is None or "error" in entry:
            cells.append(f" {'-':>{_width(name)}} {'-':>8}")
        else:
            cells.append(f" {entry['median_s'] * 1e3:>{_width(name)}.3f} {entry['tflops']:>8.1f}")
    text = "".join(f" {(f'{row[field]:.2f}x' if field in row else '-'):>{width}}"
                   for field, _, width in _ratios(names))
    return (f"{row['head_dim']:>4} {row['seq_len']:>6} {row['batch']:>3} {row['heads']:>3} {row['causal']!s:>6} "
            f"{row['objective']:>8} " + "".join(cells) + text)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
