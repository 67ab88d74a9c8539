"""What a packed call pays for choosing its tile in the step (the documents layout, no packing declared).

    python benchmarks/documents/packed_switch.py              # ring 8 simulated, 4096 tokens, three packings
    python benchmarks/documents/packed_switch.py --repeats 9
    python benchmarks/documents/packed_switch.py --parts --repeats 21   # the cost of choosing, piece by piece

For each packing, the loader runs the documents layout told the packing (one ring, its tile chosen on
the host) and not told it (one ring per tile of `documents.PACKED_TILES`, the rows choosing in the step
under `jax.lax.switch`). Both run the same tile, so the difference is the cost of choosing. Reported:
the compiled forward+backward's temporary memory (`memory_analysis()`, one layer and four), the
forward+backward time (medians of interleaved runs) and the choice alone (`documents.rows_tile_choice`).
Writes `benchmarks/documents/results/packed_switch-<date>.json`.

`--parts` builds the undeclared step from its pieces on the one-long row, each added to the one before,
from `ring_attention` in a `shard_map` and the public layout functions: one plan and one ring (tiles of 64,
what a declared packing runs), then the rows' choice computed, then the plans of the three tiles under a
`jax.lax.switch`, then the three rings under one; and the rings alone under a switch. Times only, over
the first; written to `benchmarks/documents/results/packed_switch-parts-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from documents import declared_row, packings, step_inputs, training_step  # noqa: E402

from tuner import BwdParams, FwdParams, get_tuned_ring_attention, ring_attention  # noqa: E402
from tuner.semantics import documents, layouts  # noqa: E402
from tuner.semantics.packing import Packing  # noqa: E402
from tuner.semantics.spec import AttentionSpec  # noqa: E402
from tuner.support.tables import table  # noqa: E402
from tuner.tuning.timing import time_interleaved  # noqa: E402

PACKINGS = ("one long + 16 short", "long-tailed (14)", "64 tiny")
COLUMNS = ["packing", "tile", "memory 1 layer", "memory 4 layers", "fwd+bwd declared", "not declared", "ratio"]


def layers_step(attn, layers: int):
    """Forward+backward of `layers` attention calls in a row (each output, squashed, the next query)."""
    def step(q, k, v, s):
        def loss(q, k, v):
            for _ in range(layers):
                q = jnp.tanh(attn(q, k, v, q_segment_ids=s, kv_segment_ids=s))
            return q.sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return step


def temporary_mib(attn, x, seg, layers: int) -> float:
    """The compiled step's temporary memory, MiB."""
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    compiled = jax.jit(layers_step(attn, layers)).lower(shape, shape, shape, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def choice_ms(length: int, repeats: int) -> float:
    """Median milliseconds of `documents.rows_tile_choice` on one row of `length` tokens, ring 8."""
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    seg = jnp.asarray(Packing.parse("lognormal:14").segment_ids(length, 1))
    choose = jax.jit(documents.rows_tile_choice, static_argnums=(1, 2))
    times = time_interleaved({"choice": lambda s: choose(s, spec, DEVICES)}, [(seg,)], runs=repeats, warmup=1)
    return times["choice"].median * 1e3


def parts_step(mesh: Mesh, spec: AttentionSpec, *, choose: bool, plans_switched: bool, rings_switched: bool):
    """A training step on packed rows in the documents layout planned in the step: the tile index from the
    rows (`choose`) or 0, the plan of that tile under a `jax.lax.switch` (`plans_switched`) or the plan of
    the first tile, and likewise the ring."""
    seq = P(None, "sp")

    def ring(tile: int):
        def local(q, k, v, s, p):
            return ring_attention(q, k, v, causal=True, axis_name="sp", backend="scan",
                                  fwd_params=FwdParams(tile, tile), bwd_params=BwdParams(tile, tile),
                                  q_segment_ids=s, kv_segment_ids=s, q_positions=p, kv_positions=p)
        return jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq)

    rings = [ring(tile) for tile in documents.PACKED_TILES]
    plans = [functools.partial(layouts.document_order, ring_size=DEVICES, tile=(tile, tile))
             for tile in documents.PACKED_TILES]

    def step(q, k, v, w, s):
        chosen = documents.rows_tile_choice(s, spec, DEVICES) if choose else 0 * s[0, 0]  # traced either way
        order = jax.lax.switch(chosen, plans, s) if plans_switched else plans[0](s)

        def loss(q, k, v):
            laid = [documents.lay_out_rows(x, order) for x in (q, k, v, s)]
            out = jax.lax.switch(chosen, rings, *laid, order) if rings_switched else rings[0](*laid, order)
            return jnp.vdot(documents.restore_rows(out, order), w)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(step)


def parts(mesh: Mesh, length: int, repeats: int) -> int:
    """`--parts`: the undeclared step built up piece by piece, timed interleaved."""
    q, k, v, w = step_inputs(length)
    _, seg = declared_row(packings(length)["one long + 16 short"])
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    pieces = {"one plan, one ring": (False, False, False), "+ the rows' choice": (True, False, False),
              "+ the plans under a switch": (True, True, False), "+ the rings under a switch": (True, True, True),
              "one plan, the rings under a switch": (False, False, True)}
    steps = {name: parts_step(mesh, spec, choose=c, plans_switched=p, rings_switched=r)
             for name, (c, p, r) in pieces.items()}
    times = time_interleaved(steps, [(q, k, v, w, seg)], runs=repeats, warmup=1)
    first = times["one plan, one ring"].median
    rows = [[name, f"{times[name].median * 1e3:.1f} ms", f"{times[name].median / first:.3f}x"] for name in pieces]
    print(table(["step", "fwd+bwd", "over the first"], rows))
    out = os.path.join(os.path.dirname(__file__), "results",
                       f"packed_switch-parts-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(ring=DEVICES, length=length, packing="one long + 16 short", repeats=repeats,
                       platform=f"{jax.devices()[0].platform} x{DEVICES} simulated",
                       seconds={name: times[name].median for name in pieces}), f, indent=1)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--parts", action="store_true", help="only the cost of choosing, piece by piece")
    args = parser.parse_args(argv)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("sp",))
    if args.parts:
        return parts(mesh, args.length, args.repeats)
    q, k, v, w = step_inputs(args.length)
    db = os.path.join(tempfile.mkdtemp(), "empty.sqlite")
    results, rows = [], []
    for name in PACKINGS:
        lengths = packings(args.length)[name]
        declared, seg = declared_row(lengths)
        loaders = {label: get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents",
                                                   packing=packing, db=db)
                   for label, packing in (("declared", declared), ("undeclared", None))}
        result = dict(packing=name, lengths=lengths)
        for label, attn in loaders.items():
            result[label] = dict(
                tile=attn.explain(q, k, v, q_segment_ids=seg, kv_segment_ids=seg).config.to_dict()["fwd"]["block_q"],
                memory_mib={str(n): temporary_mib(attn, q, seg, n) for n in (1, 4)})
        times = time_interleaved({label: jax.jit(training_step(attn)) for label, attn in loaders.items()},
                                 [(q, k, v, w, seg)], runs=args.repeats, warmup=1)
        for label in loaders:
            result[label]["seconds"] = times[label].median
        results.append(result)
        d, u = result["declared"], result["undeclared"]
        rows.append([name, f"{d['tile']} / {u['tile']}",
                     f"{d['memory_mib']['1']:.1f} / {u['memory_mib']['1']:.1f} MiB",
                     f"{d['memory_mib']['4']:.1f} / {u['memory_mib']['4']:.1f} MiB",
                     f"{d['seconds'] * 1e3:.0f} ms", f"{u['seconds'] * 1e3:.0f} ms",
                     f"{u['seconds'] / d['seconds']:.3f}"])
        print(table(COLUMNS, rows[-1:]), flush=True)
    choice = {str(n): choice_ms(n, args.repeats) for n in (args.length, 32768, 131072)}
    print(table(COLUMNS, rows))
    print("the choice alone:", ", ".join(f"{n} tokens {ms:.2f} ms" for n, ms in choice.items()))
    out = os.path.join(os.path.dirname(__file__), "results", f"packed_switch-{datetime.date.today().isoformat()}.json")
    with open(out, "w") as f:
        json.dump(dict(ring=DEVICES, length=args.length, platform=f"{jax.devices()[0].platform} x{DEVICES} simulated",
                       results=results, choice_ms=choice), f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
