"""The compiler's verdict on every point of the Triton search space, per GPU target, without a GPU (issue 31).

    python benchmarks/gpu/triton_resources.py [--variants causal/bfloat16/128] [--local-len 4096] [--heads 16]
                                              [--kv-heads 16] [--targets sm_80,sm_90,sm_100] [--jobs 2]
                                              [--limit N] [--only REGEX] [--out FILE] [--summary]

For each variant (`features/dtype/head_dim[/value_head_dim]`, features `full` or joined by `+` from causal,
window, chunk, segments, softcap), each kernel and each point of `TritonBackend().search_space` for
`--local-len` tokens a device -- the forward points, the dK/dV kernel at the backward points, the dQ kernel
at the dq tiles with the backward's warps and stages; each distinct launch once -- and each target, compiles
the kernel as jax_triton does (16-byte aligned pointers; `tuner.kernels.triton_compile.resources`) and appends one
JSON line: the point, shared memory, registers, spill (stack) bytes, the MMA instruction family, whether it
is the architecture's tensor-core path, sm_100's tensor-memory columns, the occupancy those imply (blocks
and warps per SM, the binding limit), whether it fits the target's shared memory per block, and the seconds
the compile took (or the compiler's error). Default file:
`benchmarks/gpu/results/triton_resources-<targets>-<date>.jsonl`. Records already in the file are skipped, so a
run can be stopped and resumed; `--limit` and `--only` (a regex over a point's label, e.g.
`attention_fwd .* sm_100`) run a slice. The compiles run in `--jobs` processes. Every run ends with the
summary of the whole file (`--summary`: only that; and `size_rule`, what a pruning rule fitted on tile
sizes would cost instead of the compiler's verdict): per target and kernel, the points, how many spill, how
many lack the tensor-core path, how many exceed the shared memory of a block, how many cannot run at
all (zero blocks per SM: shared memory, registers or sm_100's tensor memory), and how many the search's
pruning rule (`tuner.kernels.triton_compile.ruled_out`) rules out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import multiprocessing
import re
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import jax.numpy as jnp

from tuner.kernels import triton, triton_compile, triton_launch
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.tables import error_line, table

RESULTS = Path(__file__).parent / "results"
FEATURES = ("causal", "window", "chunk", "segments", "softcap")
KEY = ("variant", "local_len", "heads", "kv_heads", "kernel", "block_q", "block_kv", "num_warps", "num_stages",
       "target")


def parse_variant(text: str) -> tuple[AttentionSpec, str, int, int]:
    """`causal+window/bfloat16/128[/64]` -> the spec (placeholder window, chunk and cap values: they are
    compile-time constants that do not change the code's shape), dtype, head dim and value head dim."""
    features, dtype, *dims = text.split("/")
    on = set() if features == "full" else set(features.split("+"))
    if on - set(FEATURES) or len(dims) not in (1, 2):
        raise SystemExit(f"--variants takes features/dtype/head_dim[/value_head_dim], features 'full' or "
                         f"from {'+'.join(FEATURES)}; got {text!r}")
    head_dim = int(dims[0])
    spec = AttentionSpec(scale=head_dim**-0.5, causal="causal" in on, window=(256, 0) if "window" in on else None,
                         chunk_size=1024 if "chunk" in on else None, has_segments="segments" in on,
                         softcap=50.0 if "softcap" in on else None)
    return spec, dtype, head_dim, int(dims[-1])


def measure(task: dict) -> dict:
    """Compile one launch for one target (in a worker process) and return its record."""
    spec, dtype, head_dim, value_head_dim = parse_variant(task["variant"])
    source = triton_launch.variant(spec, jnp.dtype(dtype), head_dim, value_head_dim)
    constants = triton_launch._constants(spec, task["local_len"], task["local_len"], task["heads"], task["kv_heads"],
                                  head_dim, task["block_q"], task["block_kv"], value_head_dim=value_head_dim)
    capability = int(task["target"][3:])
    start = time.perf_counter()
    try:
        report = triton_compile.resources(source, task["kernel"], constants, num_warps=task["num_warps"],
                                  num_stages=task["num_stages"], capability=capability)
    except Exception as error:  # noqa: BLE001 - the compiler's refusal is the record
        report = {"error": error_line(error, limit=300)}
    report["compile_s"] = round(time.perf_counter() - start, 2)
    if "shared" in report:
        report["fits_shared"] = report["shared"] <= triton_compile.SHARED_MEMORY_BYTES[capability]
    return {**task, "file": source.filename, "triton": importlib.metadata.version("triton"), **report}


def label(task: dict) -> str:
    return (f"{task['variant']} {task['kernel']} {task['block_q']}x{task['block_kv']} w{task['num_warps']} "
            f"s{task['num_stages']} {task['target']}")


def summary(records: list[dict]) -> str:
    """Per target and kernel: points, compile errors, spills, no tensor-core path, over the shared memory of a
    block, no block fits an SM (any reason), sm_100's tensor memory over 512 columns, ruled out by the
    search's pruning rule."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["variant"], int(record["target"][3:]), record["kernel"])].append(record)
    rows = []
    for (variant, capability, kernel), group in sorted(groups.items(), key=lambda item: (
            item[0][:2], list(triton_launch.KERNEL_ARGS).index(item[0][2]))):
        ok = [r for r in group if "error" not in r]
        rows.append([variant, f"sm_{capability}", kernel, len(group), len(group) - len(ok),
                     sum(r["spill_bytes"] > 0 for r in ok), sum(not r["tensor_core"] for r in ok),
                     sum(not r["fits_shared"] for r in ok), sum(r.get("blocks_per_sm", 1) == 0 for r in ok),
                     sum(r.get("tmem", 0) > triton_compile.TMEM_COLUMNS for r in ok),
                     sum(triton_compile.ruled_out(r, capability) is not None for r in group)])
    return table(["variant", "target", "kernel", "points", "errors", "spill", "no tensor core", "over shared",
                  "0 blocks/SM", "tmem > 512", "ruled out"], rows)


def live_elements(record: dict) -> float:
    """A size rule's measure of a launch's register pressure: the float32 elements each thread holds in
    its accumulators and score tile (forward: o and s; dK/dV: dk, dv and s; dQ: dq and s)."""
    head_dim, value_head_dim = (int(d) for d in (record["variant"].split("/")[2:] * 2)[:2])
    bq, bk = record["block_q"], record["block_kv"]
    held = {"attention_fwd": bq * value_head_dim, "attention_dkv": bk * (head_dim + value_head_dim),
            "attention_dq": bq * head_dim}[record["kernel"]]
    return (held + bq * bk) / (32 * record["num_warps"])


def size_rule(records: list[dict]) -> str:
    """Why the pruning rule is the compiler's verdict and not a fitted size rule: per target and kernel,
    the loosest threshold on `live_elements` (and shared memory) that admits no launch the compiler
    spills, and how many spill-free launches that threshold rules out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        if "error" not in record:
            groups[(record["variant"], record["target"], record["kernel"])].append(record)
    rows = []
    for (variant, target, kernel), group in sorted(groups.items()):
        spilled = [r for r in group if r["spill_bytes"] > 0]
        clean = [r for r in group if r["spill_bytes"] == 0 and r["fits_shared"]]
        limit = min((live_elements(r) for r in spilled), default=float("inf"))
        lost = sum(live_elements(r) >= limit for r in clean)
        rows.append([variant, target, kernel, len(spilled), len(clean), f"< {limit:g}", lost,
                     f"{lost / max(len(clean), 1):.0%}"])
    return table(["variant", "target", "kernel", "spill", "spill-free", "size rule: elements/thread",
                  "spill-free ruled out", "share"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="causal/bfloat16/128", help="comma-separated "
                        "features/dtype/head_dim[/value_head_dim]")
    parser.add_argument("--local-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--targets", default="sm_80,sm_90,sm_100")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument("--limit", type=int, default=None, help="compile at most this many new records")
    parser.add_argument("--only", default=None, help="only the points whose label this regex matches")
    parser.add_argument("--out", default=None)
    parser.add_argument("--summary", action="store_true", help="only print the summary of --out")
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    for target in targets:
        if not re.fullmatch(r"sm_\d{2,3}", target) or int(target[3:]) not in triton_compile.SHARED_MEMORY_BYTES:
            raise SystemExit(f"--targets takes sm_XX of {sorted(triton_compile.SHARED_MEMORY_BYTES)}, got {target!r}")
    out = Path(args.out or RESULTS / f"triton_resources-{'-'.join(targets)}-{datetime.date.today()}.jsonl")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if args.summary:
        print(summary(records))
        print(size_rule(records))
        return 0
    done = {tuple(r[k] for k in KEY) for r in records}
    todo = []
    for text in args.variants.split(","):
        spec, dtype, head_dim, value_head_dim = parse_variant(text)
        shapes = LocalShapes(1, args.local_len, args.local_len, args.heads, args.kv_heads, head_dim, dtype,
                             value_head_dim=value_head_dim)
        for kernel, block_q, block_kv, warps, stages in triton.space_launches(shapes, spec):
            for target in targets:
                task = dict(variant=text, local_len=args.local_len, heads=args.heads, kv_heads=args.kv_heads,
                            kernel=kernel, block_q=block_q, block_kv=block_kv, num_warps=warps, num_stages=stages,
                            target=target)
                if tuple(task[k] for k in KEY) not in done and (args.only is None or re.search(args.only,
                                                                                             label(task))):
                    todo.append(task)
    todo = todo[:args.limit]
    print(f"{len(todo)} launches to compile into {out} ({len(records)} records already there), "
          f"{args.jobs} jobs", file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool, \
            out.open("a") as sink:
        futures = [pool.submit(measure, task) for task in todo]
        for i, future in enumerate(as_completed(futures), 1):
            record = future.result()
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            records.append(record)
            verdict = record.get("error") or (f"{record['shared'] // 1024} KiB, {record['registers']} regs, "
                                              f"{record['spill_bytes']} B stack, {record['mma']}, "
                                              f"{record.get('blocks_per_sm')} blocks/SM")
            print(f"[{i}/{len(todo)} {time.perf_counter() - start:.0f}s] {label(record)}: {verdict} "
                  f"({record['compile_s']}s)", file=sys.stderr, flush=True)
    print(f"compiled {len(todo)} launches in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(summary(records))
    print(size_rule(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
