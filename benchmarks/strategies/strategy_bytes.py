"""Do the strategy model's bytes match what the TPU compiler's programs move? Compiled by the production
TPU compiler on this host (needs libtpu: `pip install -e '.[tpu]'`), nothing runs.

    python benchmarks/strategies/strategy_bytes.py [--topologies v5e:2x2,v5e:2x4]
                                                   [--problems 8:1:8192,8:8:16384,32:8:32768]
                                                   [--strategies ring,all_to_all,all_gather,hybrid] [--out FILE]

For each topology (a ring of all its chips), each problem (H:Hkv:T; bf16, D=128, batch 1, causal, zigzag)
and each strategy -- the hybrid on every 2-D mesh ring x all-to-all with both axes > 1 -- compiles the
forward, and the value and gradient of a weighted sum of the output (a training step), under `jax.jit` of a
`shard_map` over the topology's devices; reads the bytes of each kind of collective from the compiled HLO
(`tuner.models.hlo.collective_bytes`: each collective's result on one device, per execution; the loops' trip counts,
which XLA:TPU does not write, read from the loops themselves; all-reduces counted too) and puts them beside
`tuner.models.strategy_model.predict`'s `bytes`, flagging kinds more than 10% off. Prints the table, writes the
records as JSON (default benchmarks/strategies/results/strategy_bytes.json, rewritten after each compile) and a markdown
table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner.models import hlo
from tuner import registry, ring_attention  # noqa: E402
from tuner.models import strategy_model  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402
from tuner.support.tables import table  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOPOLOGIES = "v5e:2x2,v5e:2x4"
PROBLEMS = "8:1:8192,8:8:16384,32:8:32768"
SHORT = {"collective-permute": "permute", "all-to-all": "a2a", "all-gather": "gather", "reduce-scatter": "scatter",
         "all-reduce": "all-reduce"}
RING_AXIS, A2A_AXIS = "ring", "a2a"
TOLERANCE = 0.1  # issue 17: within 10% of the model
KINDS = (*hlo.COLLECTIVE_KINDS, "all-reduce")  # XLA:TPU builds small all-gathers and reduce-scatters as all-reduces
NEGLIGIBLE = 0.01  # a kind under this share of a program's bytes is not compared


def topology_devices(topology: str) -> list:
    """The devices of the TPU topology `topology` (e.g. "v5e:2x4"), in the topology API's order."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def mesh_shapes(strategy: str, size: int) -> list[tuple[int, int] | None]:
    """The meshes `strategy` is compiled on over `size` devices: one axis (None), or for the hybrid every
    split (Pr, Pa) with both > 1."""
    if strategy != "hybrid":
        return [None]
    return [(size // pa, pa) for pa in range(2, size) if size % pa == 0]


def compiled_bytes(problem: Problem, strategy: str, devices: list, backward: bool,
                   axes: tuple[int, int] | None = None) -> dict[str, int]:
    """`hlo.collective_bytes` (all-reduces too) of `strategy` on `problem` over `devices` (a 1-D mesh; for the
    hybrid a 2-D mesh of `axes` = (ring, all-to-all)), compiled by the devices' compiler: the forward, or the
    value and gradient of `vdot(out, w)` (dout then depends on an input, so no exchange of it folds away)."""
    if axes is None:
        mesh, axis, seq = Mesh(np.array(devices), ("sp",)), "sp", P(None, "sp")
    else:
        mesh = Mesh(np.array(devices).reshape(axes), (RING_AXIS, A2A_AXIS))
        axis, seq = (RING_AXIS, A2A_AXIS), P(None, (RING_AXIS, A2A_AXIS))

    def local(q, k, v):
        return ring_attention(q, k, v, axis_name=axis, layout=problem.layout, strategy=strategy, causal=problem.causal)

    attend = jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    sharding, dtype = NamedSharding(mesh, seq), jnp.dtype(problem.dtype)
    q = jax.ShapeDtypeStruct((problem.batch, problem.seq_len, problem.heads, problem.head_dim), dtype,
                             sharding=sharding)
    kv = jax.ShapeDtypeStruct((problem.batch, problem.seq_len, problem.kv_heads, problem.head_dim), dtype,
                              sharding=sharding)
    if backward:
        step = jax.value_and_grad(lambda q, k, v, w: jnp.vdot(attend(q, k, v).astype(jnp.float32), w),
                                  argnums=(0, 1, 2))
        lowered = jax.jit(step).lower(q, kv, kv, jax.ShapeDtypeStruct(q.shape, jnp.float32, sharding=sharding))
    else:
        lowered = jax.jit(attend).lower(q, kv, kv)
    return hlo.collective_bytes(lowered.compile().as_text(), KINDS)


def model_bytes(problem: Problem, strategy: str, device_kind: str, backward: bool,
                axes: tuple[int, int] | None = None) -> dict[str, int]:
    """`strategy_model.predict`'s bytes per collective kind (the platform's rates do not change them)."""
    platform = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e", "TPU v5": "v5p", "TPU v4": "v4"}[device_kind]
    return strategy_model.predict(problem, strategy, platform, backward=backward, axes=axes).bytes


def disagreements(compiled: dict[str, int], model: dict[str, int]) -> list[str]:
    """The kinds of `hlo.COLLECTIVE_KINDS` whose model bytes are off the compiled program's by more than
    `TOLERANCE` of them. A kind under `NEGLIGIBLE` of both totals is not compared: the ring's position
    bounds (tens of bytes), which XLA:TPU all-reduces, are no check of the model."""
    totals = sum(compiled[k] for k in hlo.COLLECTIVE_KINDS), sum(model.values())
    return [kind for kind in hlo.COLLECTIVE_KINDS
            if abs(model[kind] - compiled[kind]) > TOLERANCE * compiled[kind]
            and (compiled[kind] > NEGLIGIBLE * totals[0] or model[kind] > NEGLIGIBLE * totals[1])]


def scatter_as_all_reduce(compiled: dict[str, int], model: dict[str, int], size: int) -> bool:
    """Whether the program has, instead of the model's reduce-scatters, all-reduces of `size` times their
    bytes (within `TOLERANCE`): XLA:TPU's build of a reduce-scatter, an all-reduce of the whole buffer of
    which each device keeps its slice."""
    want = size * model["reduce-scatter"]
    return compiled["reduce-scatter"] == 0 < want and abs(compiled["all-reduce"] - want) <= TOLERANCE * want


def ratio(compiled: int, model: int) -> str:
    if compiled == model:
        return "1" if compiled else "-"
    return f"{compiled / model:.3f}" if model else "inf"


def mib(counts: dict[str, int]) -> str:
    return " ".join(f"{SHORT[k]} {counts[k] / 2**20:.4g}" for k in SHORT if counts.get(k)) or "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default=TOPOLOGIES)
    parser.add_argument("--problems", default=PROBLEMS, help="heads:kv_heads:seq_len, comma-separated")
    parser.add_argument("--strategies", default=",".join(registry.STRATEGIES))
    parser.add_argument("--out", default=str(RESULTS / "strategy_bytes.json"))
    args = parser.parse_args()
    out = Path(args.out)
    records, rows, skipped = [], [], []
    for topology in args.topologies.split(","):
        devices = topology_devices(topology)
        for spec in args.problems.split(","):
            heads, kv_heads, seq_len = map(int, spec.split(":"))
            problem = Problem(seq_len=seq_len, heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16",
                              causal=True, ring_size=len(devices), layout="zigzag")
            for strategy in args.strategies.split(","):
                for axes in mesh_shapes(strategy, len(devices)):
                    prediction = strategy_model.predict(problem, strategy, "v5e", axes=axes)
                    if prediction.unsupported:
                        skipped.append(f"{strategy} on {topology}, {problem.describe()}: {prediction.unsupported}")
                        continue
                    for backward in (False, True):
                        start = time.perf_counter()
                        compiled = compiled_bytes(problem, strategy, devices, backward, axes)
                        seconds = time.perf_counter() - start
                        model = model_bytes(problem, strategy, devices[0].device_kind, backward, axes)
                        off = disagreements(compiled, model)
                        as_all_reduce = scatter_as_all_reduce(compiled, model, len(devices))
                        verdict = ", ".join(SHORT[k] + (" (TPU: all-reduce)" if k == "reduce-scatter" and as_all_reduce
                                                        else "") for k in off) or "ok"
                        passes = "fwd+bwd" if backward else "fwd"
                        records.append(dict(strategy=strategy, axes=axes, topology=topology,
                                            device_kind=devices[0].device_kind, problem=problem.describe(),
                                            heads=heads, kv_heads=kv_heads, seq_len=seq_len, passes=passes,
                                            compiled=compiled, model=model, over_10pct_off=off, verdict=verdict,
                                            compile_s=round(seconds, 1)))
                        rows.append([strategy + (f" {axes[0]}x{axes[1]}" if axes else ""), topology,
                                     f"H={heads} Hkv={kv_heads} T={seq_len}", passes, mib(compiled), mib(model),
                                     " ".join(f"{SHORT[k]} {ratio(compiled[k], model[k])}"
                                              for k in hlo.COLLECTIVE_KINDS if compiled[k] or model[k]),
                                     verdict, f"{seconds:.0f}"])
                        print(" | ".join(rows[-1]), flush=True)
                        out.write_text(json.dumps(records, indent=1) + "\n")
    headers = ["strategy", "topology", "problem", "passes", "compiled MiB", "model MiB", "compiled / model",
               "> 10% off", "compile s"]
    print(table(headers, rows))
    for line in skipped:
        print(f"skipped {line}")
    markdown = [f"| {' | '.join(headers)} |", f"|{'---|' * len(headers)}", *(f"| {' | '.join(r)} |" for r in rows),
                "", *(f"- skipped {line}" for line in skipped)]
    out.with_suffix(".md").write_text("\n".join(markdown) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
