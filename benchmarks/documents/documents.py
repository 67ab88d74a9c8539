"""Packed documents over a ring: each layout's balance, efficiency and CPU wall time, through the loader.

    python benchmarks/documents/documents.py               # ring 8, T=4096, causal, 6 packings, 4 layouts
    python benchmarks/documents/documents.py --no-time     # the work counts only (a minute)
    python benchmarks/documents/documents.py --undeclared  # the loader not told the packing: the rows choose tiles
    python benchmarks/documents/documents.py --tile-cost --repeats 7   # a packing's tile against PACKED_TILE, timed
    python benchmarks/documents/documents.py --packed-tile 0 --undeclared --only long   # before the packed cap
    python benchmarks/documents/documents.py --autotune 6  # undeclared, documents layout: before and after autotune

Every layout runs through `get_tuned_ring_attention(mesh=..., layout=..., packing=...)` on an empty
cache, so with the default tiles a user gets before tuning; the loader is told each row's packing (its
document lengths), from which it picks the tile (`tuner.semantics.documents.declared_tile`), unless
`--undeclared`. Work is counted with `tuner.support.work.count_work` on the forward pass: imbalance =
busiest device / mean device, efficiency = useful work (the sum of the documents' causal triangles) /
(ring size x the busiest device's work). Wall time is forward+backward under `jax.jit` on the simulated
devices, the layouts interleaved, medians: on a CPU of fewer cores than devices it is the total work.
"Parallel" is what a ring of devices that run side by side would take, from measured blocks
(`critical_path`). Writes `benchmarks/documents/results/documents-<ring>x<T>-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from tuner import get_tuned_ring_attention  # noqa: E402
from tuner.kernels import BACKENDS  # noqa: E402
from tuner.kernels.params import BwdParams, FwdParams  # noqa: E402
from tuner.semantics import documents, layouts, masks  # noqa: E402
from tuner.semantics.spec import AttentionSpec  # noqa: E402
from tuner.semantics.packing import Packing  # noqa: E402
from tuner.support.tables import table  # noqa: E402
from tuner.support.work import count_work  # noqa: E402
from tuner.tuning.timing import compile_timed, run_interleaved, time_interleaved  # noqa: E402

LAYOUTS = ("contiguous", "zigzag", "striped", "documents")
AUTOTUNE_COLUMNS = ["packing", "fitted", "tiles before", "after", "efficiency", "imbalance", "fwd+bwd", "speed-up"]


def long_tailed(total: int, count: int, seed: int = 0) -> list[int]:
    """`count` document lengths drawn log-normally, summing to `total`."""
    weights = np.random.default_rng(seed).lognormal(0.0, 1.0, count)
    lengths = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
    lengths[np.argmax(lengths)] += total - lengths.sum()
    return [int(n) for n in lengths]


def packings(total: int) -> dict[str, list[int]]:
    """The packings of the benchmark: document lengths summing to `total`."""
    half, short = total // 2, total // 32
    return {
        "one long + 16 short": [half] + [short] * 16,
        "16 short + one long": [short] * 16 + [half],
        "long-tailed (14)": long_tailed(total, 14),
        "16 equal": [total // 16] * 16,
        "one sequence": [total],
        "64 tiny": [total // 64] * 64,
    }


def step_inputs(length: int, heads: int = 4, head_dim: int = 64) -> tuple:
    """q, k, v and the output's cotangent w of a training step: `[1, length, heads, head_dim]` float32
    normals, the same every run."""
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((1, length, heads, head_dim)), jnp.float32) for _ in range(4))


def declared_row(lengths: list[int]) -> tuple[str, jax.Array]:
    """The packing text that declares a row of documents of these `lengths`, and the row's `[1, T]`
    segment ids."""
    declared = Packing("fixed", tuple(lengths)).describe()
    return declared, jnp.asarray(Packing.parse(declared).segment_ids(sum(lengths), 1))


def critical_path(orders: dict[str, np.ndarray], seg, configs: dict[str, dict], ring: int, inputs: tuple,
                  repeats: int) -> dict[str, dict[str, float]]:
    """Per layout (`orders`: each the token index at every slot, device-major; `configs`: each the
    config its loader chose), the forward+backward seconds of a ring whose devices run in parallel, from
    measured blocks: every (device, step) block of the scan kernel is timed alone on this CPU (medians,
    all blocks interleaved; none for the blocks the ring skips whole), a step waits for its slowest
    device, and the steps add up. Transfers are left out. Also the serial sum of the blocks.

    The blocks' medians are also fitted (least squares over all of them) as a fixed cost per block plus a
    cost per 64 x 64 logits of the visited tile pairs, unmasked and masked (pairs counted on the forward's
    tiles), returned under `"fit"`, with each layout's critical path less that fixed cost
    (`without_fixed`): what the layouts' ratio would be for a kernel with nothing to pay per block."""
    backend = BACKENDS["scan"]
    q, k, v, w = inputs
    spec = AttentionSpec(scale=q.shape[-1] ** -0.5, causal=True, has_segments=True)
    local = q.shape[1] // ring

    def block_of(config: dict):
        fwd, bwd = FwdParams(**config["fwd"]), BwdParams(**config["bwd"])

        def block(q, k, v, do, q_pos, kv_pos, q_seg, kv_seg):
            out, lse = backend.block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, None, spec=spec, params=fwd)
            delta = jnp.zeros(lse.shape, jnp.float32)
            return out, backend.block_bwd(q, k, v, out, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, None,
                                          spec=spec, params=bwd)
        return block

    thunks, compiled, pairs = {}, {}, {}
    for layout, order in orders.items():
        fwd = configs[layout]["fwd"]
        area = fwd["block_q"] * fwd["block_kv"] / 64**2  # the fit counts 64 x 64 tile pairs
        rows = jnp.asarray(order)[None]
        laid = [documents.lay_out_rows(x, rows) for x in (q, k, v, w, seg)]
        shards = [[x[:, r * local:(r + 1) * local] for x in (*laid, rows)] for r in range(ring)]
        for r in range(ring):
            for step in range(ring):
                mine, theirs = shards[r], shards[(r - step) % ring]
                args = (mine[0], theirs[1], theirs[2], mine[3], mine[5], theirs[5], mine[4], theirs[4])
                bounds = [(x.min(), x.max()) for x in (args[4], args[6], args[5], args[7])]
                (q_lo, q_hi), q_seg, (k_lo, k_hi), k_seg = bounds
                if masks.ranges_may_attend(q_lo, q_hi, k_lo, k_hi, (*q_seg, *k_seg), spec):  # else the ring skips it
                    thunks[(layout, r, step)] = args
                    possible, every = masks.tile_pairs(args[4], args[5], args[6], args[7], spec, fwd["block_q"],
                                                       fwd["block_kv"])
                    pairs[(layout, r, step)] = (area * int(possible.sum()), area * int((possible & every).sum()))
        key = json.dumps(configs[layout], sort_keys=True)
        mine = [b for b in thunks if b[0] == layout]
        if key not in compiled:
            compiled[key] = compile_timed(block_of(configs[layout]), thunks[mine[0]])[0]
        for block_key in mine:
            thunks[block_key] = (compiled[key], thunks[block_key])
    times = run_interleaved({key: (lambda i, c=c, a=args: c(*a)) for key, (c, args) in thunks.items()},
                            runs=repeats, warmup=1)
    keys = list(thunks)
    counts = np.array([[1.0, pairs[key][1], pairs[key][0] - pairs[key][1]] for key in keys])
    fixed, unmasked, masked = np.linalg.lstsq(counts, np.array([times[key].median for key in keys]), rcond=None)[0]
    result = {"fit": dict(fixed_per_block=fixed, per_unmasked_pair=unmasked, per_masked_pair=masked)}
    for layout in orders:
        steps = [[times[(layout, r, step)].median if (layout, r, step) in times else 0.0 for r in range(ring)]
                 for step in range(ring)]
        bare = [[max(t - fixed, 0.0) if t else 0.0 for t in row] for row in steps]
        result[layout] = dict(critical_path=sum(max(t) for t in steps), serial=sum(sum(t) for t in steps),
                              without_fixed=sum(max(t) for t in bare))
    return result


def training_step(attn):
    """Forward+backward of the loader `attn` on packed rows: the gradients of `<attn(q, k, v), w>`."""
    def step(q, k, v, w, s):
        return jax.grad(lambda q, k, v: jnp.vdot(attn(q, k, v, q_segment_ids=s, kv_segment_ids=s), w),
                        argnums=(0, 1, 2))(q, k, v)
    return step


def tile_cost(mesh: Mesh, db: str, inputs: tuple, lengths: list[int], repeats: int) -> dict[str, float]:
    """Forward+backward seconds of the contiguous layout on the tile the packing chooses and on
    `PACKED_TILE` (the loader told the packing or not), interleaved: what the shorter tile costs here."""
    q, k, v, w = inputs
    declared, seg = declared_row(lengths)
    steps = {}
    for packing in (declared, None):
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="contiguous", db=db,
                                        packing=packing)
        tile = attn.explain(q, k, v, q_segment_ids=seg, kv_segment_ids=seg).config.to_dict()["fwd"]["block_q"]

        steps[f"tile {tile}"] = training_step(attn)
    times = time_interleaved(steps, [(q, k, v, w, seg)], runs=repeats, warmup=1)
    return {name: t.median for name, t in times.items()}


def measure(attn, inputs: tuple, seg, useful: int, ring: int) -> dict:
    """The loader `attn`'s tiles, and the imbalance and efficiency of its forward on the packed row `seg`,
    counted by the ring (`count_work`)."""
    q, k, v, _ = inputs
    with count_work() as counts:  # a fresh trace inside the context counts
        jax.block_until_ready(jax.jit(lambda q, k, v, s: attn(q, k, v, q_segment_ids=s, kv_segment_ids=s))(q, k, v,
                                                                                                       seg))
    work = counts["tile_area"]
    config = attn.explain(q, k, v, q_segment_ids=seg, kv_segment_ids=seg).config.to_dict()
    return dict(config=config, tiles=[config["fwd"]["block_q"], config["fwd"]["block_kv"]],
                imbalance=max(work.values()) / (sum(work.values()) / ring),
                efficiency=useful / (ring * max(work.values()) * q.shape[2]))


def autotuned(mesh: Mesh, inputs: tuple, lengths: list[int], trials: int, repeats: int) -> dict:
    """The documents layout, the loader not told the packing: its tiles, balance and forward+backward
    seconds on an empty cache and after `tuner.autotune` of its training step (which runs the step once to
    see the rows, fits their packing and tunes on rows drawn from it), timed interleaved."""
    import tuner

    ring = len(mesh.devices)
    _, seg = declared_row(lengths)
    useful = sum(n * (n + 1) // 2 for n in lengths) * inputs[0].shape[2]
    folder = tempfile.mkdtemp()
    loaders = {name: get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents",
                                              db=os.path.join(folder, f"{name}.sqlite"))
               for name in ("before", "after")}
    step = jax.jit(training_step(loaders["after"]))
    report = tuner.autotune(step, *inputs, seg, trials=trials, progress=False)
    [outcome] = report.outcomes
    result = dict(lengths=lengths, drawn=outcome.problem.drawn, note=outcome.note, search_speedup=outcome.speedup)
    for name, attn in loaders.items():
        result[name] = measure(attn, inputs, seg, useful, ring)
    times = time_interleaved({name: jax.jit(training_step(attn)) for name, attn in loaders.items()},
                             [(*inputs, seg)], runs=repeats, warmup=1)
    for name in loaders:
        result[name]["seconds"] = times[name].median
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ring", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-time", action="store_true", help="count the work only")
    parser.add_argument("--packed-tile", type=int, default=documents.PACKED_TILE,
                        help="the longest default tile of a packed call (0: no limit, as before 2026-11-25)")
    parser.add_argument("--undeclared", action="store_true", help="do not tell the loader the packing")
    parser.add_argument("--tile-cost", action="store_true",
                        help="only time the contiguous layout on the packing's tile against PACKED_TILE")
    parser.add_argument("--only", default=None, help="run only the packings whose name contains this")
    parser.add_argument("--autotune", type=int, default=0, metavar="TRIALS",
                        help="only the documents layout, undeclared: before and after tuner.autotune, TRIALS trials")
    args = parser.parse_args(argv)
    suffix = ("" if args.packed_tile == documents.PACKED_TILE else f"-tile{args.packed_tile}") + (
        "-undeclared" if args.undeclared else "") + (f"-autotune{args.autotune}" if args.autotune else "")
    documents.PACKED_TILE = args.packed_tile or 2**31

    mesh = Mesh(np.array(jax.devices()[:args.ring]), ("sp",))
    q, k, v, w = step_inputs(args.length, args.heads, args.head_dim)
    db = os.path.join(tempfile.mkdtemp(), "empty.sqlite")
    results, rows = [], []
    for name, lengths in packings(args.length).items():
        if args.only and args.only not in name:
            continue
        if args.tile_cost:
            cost = tile_cost(mesh, db, (q, k, v, w), lengths, args.repeats)
            print(name, ", ".join(f"{tile}: {seconds * 1e3:.0f} ms" for tile, seconds in cost.items()), flush=True)
            continue
        if args.autotune:
            tuned = autotuned(mesh, (q, k, v, w), lengths, args.autotune, args.repeats)
            results.append(dict(packing=name, **tuned))
            before, after = tuned["before"], tuned["after"]
            rows.append([name, tuned["drawn"] or "-", "x".join(map(str, before["tiles"])),
                         "x".join(map(str, after["tiles"])), f"{before['efficiency']:.2f} -> {after['efficiency']:.2f}",
                         f"{before['imbalance']:.2f} -> {after['imbalance']:.2f}",
                         f"{before['seconds'] * 1e3:.0f} -> {after['seconds'] * 1e3:.0f} ms",
                         f"{before['seconds'] / after['seconds']:.2f}x"])
            print(table(AUTOTUNE_COLUMNS, rows[-1:]), flush=True)
            continue
        declared, seg = declared_row(lengths)
        useful = sum(n * (n + 1) // 2 for n in lengths) * args.heads
        steps = {}
        for layout in LAYOUTS:
            attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout=layout, db=db,
                                            packing=None if args.undeclared else declared)
            result = dict(packing=name, lengths=lengths, layout=layout,
                          **measure(attn, (q, k, v, w), seg, useful, args.ring))
            steps[layout] = (jax.jit(training_step(attn)), result)
            results.append(result)
        if not args.no_time:
            planned = steps["documents"][1]
            orders = {n: layouts.global_order(n, args.length, args.ring) for n in LAYOUTS if n != "documents"}
            orders["documents"] = layouts.document_order(np.asarray(seg), args.ring, tile=tuple(planned["tiles"]))[0]
            configs = {n: result["config"] for n, (_, result) in steps.items()}
            paths = critical_path(orders, seg, configs, args.ring, (q, k, v, w), args.repeats)
            best_path = min(paths[n]["critical_path"] for n in LAYOUTS if n != "documents")
            best_bare = min(paths[n]["without_fixed"] for n in LAYOUTS if n != "documents")
            fit = paths["fit"]
            times = time_interleaved({n: f for n, (f, _) in steps.items()}, [(q, k, v, w, seg)], runs=args.repeats,
                                     warmup=1)
            best_fixed = min(times[n].median for n in LAYOUTS if n != "documents")
            for layout, (_, result) in steps.items():
                result["seconds"] = times[layout].median
                result["speedup_vs_best_fixed"] = best_fixed / times[layout].median
                result["critical_path_seconds"] = paths[layout]["critical_path"]
                result["serial_block_seconds"] = paths[layout]["serial"]
                result["critical_path_speedup_vs_best_fixed"] = best_path / paths[layout]["critical_path"]
                result["block_cost_fit"] = fit
                result["without_fixed_speedup_vs_best_fixed"] = best_bare / paths[layout]["without_fixed"]
        for layout, (_, r) in steps.items():
            rows.append([name, layout, f"{r['imbalance']:.2f}", f"{r['efficiency']:.2f}",
                         "" if args.no_time else f"{r['seconds'] * 1e3:.0f} ms",
                         "" if args.no_time else f"{r['speedup_vs_best_fixed']:.2f}x",
                         "" if args.no_time else f"{r['critical_path_seconds'] * 1e3:.0f} ms",
                         "" if args.no_time else f"{r['critical_path_speedup_vs_best_fixed']:.2f}x"])
        print(table(["packing", "layout", "imbalance", "efficiency", "fwd+bwd", "vs best fixed", "parallel",
                     "vs best fixed"], rows[-4:]),
              flush=True)
        if not args.no_time:
            bare = steps["documents"][1]["without_fixed_speedup_vs_best_fixed"]
            print(f"blocks fitted: {fit['fixed_per_block'] * 1e3:.2f} ms a block, "
                  f"{fit['per_unmasked_pair'] * 1e3:.3f} ms an unmasked 64x64 tile pair, "
                  f"{fit['per_masked_pair'] * 1e3:.3f} ms a masked one; less the block's cost, documents vs best "
                  f"fixed: {bare:.2f}x", flush=True)
    if args.tile_cost:
        return 0
    if args.autotune:
        print(table(AUTOTUNE_COLUMNS, rows))
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"documents-{args.ring}x{args.length}{suffix}-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(ring=args.ring, length=args.length, heads=args.heads, head_dim=args.head_dim,
                       packed_tile=args.packed_tile, declared=not args.undeclared,
                       platform=f"{jax.devices()[0].platform} x{args.ring} simulated", results=results), f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
