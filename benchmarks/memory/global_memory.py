"""The loader's call on global arrays (`mesh=`) against the same ring under `shard_map` on the caller's
shards: per-device memory, the largest all-gather, the collectives, and the output's sharding, read from
the compiled programs (nothing runs).

    python benchmarks/memory/global_memory.py                      # 8 simulated CPU devices, 8192 tokens
    python benchmarks/memory/global_memory.py --tpu v5e:2x2 --tokens 131072 524288
    python benchmarks/memory/global_memory.py --time 21            # and the wall time of both, on the CPU

Per layout (and strategy, mesh, pass): the mesh= program's temp + output bytes a device, the shard_map
program's, their ratio, the largest all-gather in bytes a token of the global batch (segment ids and
positions may travel: at most 8), the collectives by kind, and the output's sharding. With `--json` the
rows are also written to that file. `tests/test_global_sharding.py` holds the rules on a small case.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner import get_tuned_ring_attention, layouts  # noqa: E402
from tuner.models import hlo  # noqa: E402

LAYOUTS = ("contiguous", "zigzag", "striped", "documents")
KINDS = ("all-gather", "all-to-all", "collective-permute", "ragged-all-to-all")


@dataclass(frozen=True)
class Case:
    """One compiled comparison: `mesh` is "R" (one sequence axis of R devices), "DxR" (a data axis D holding
    the batch, the sequence over R) or "RxA" (the hybrid's pair of sequence axes)."""

    layout: str
    strategy: str
    mesh: str
    backward: bool
    tokens: int
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    dim: int = 64
    dtype: str = "bfloat16"

    def moved_bytes(self) -> int:
        """Bytes a device holds of the arrays the layout moves: q, k, v and the output, and in the backward
        as many again (the output's cotangent, dq, dk and dv): what the mesh= program may hold above the
        shard_map one, its laid-out copies."""
        devices = int(np.prod([int(n) for n in self.mesh.split("x")]))
        tokens = self.batch * self.tokens // devices
        arrays = tokens * self.dim * (2 * self.heads + 2 * self.kv_heads) * jnp.dtype(self.dtype).itemsize
        return arrays * (2 if self.backward else 1)


@dataclass(frozen=True)
class Result:
    case: Case
    mesh_bytes: int  # temp + output a device, the mesh= program
    shard_map_bytes: int  # the same ring under shard_map on the caller's shards
    largest_gather_per_token: float  # bytes of the largest all-gather over the global batch's tokens
    shard_map_gather_per_token: float  # the same in the shard_map program (a strategy's own gathers)
    collectives: dict[str, int]  # instructions by kind, the mesh= program
    shard_map_collectives: dict[str, int]  # the same, the shard_map program
    out_spec: str  # the mesh= program's first output's sharding
    in_spec: str  # the query's
    unordered: int  # pairs of one collective kind that may be in flight at once (XLA:CPU cannot run them)
    compile_seconds: tuple[float, float]  # the two programs' compile times (mesh=, shard_map)

    @property
    def ratio(self) -> float:
        return self.mesh_bytes / self.shard_map_bytes


def build_mesh(devices, shape: str) -> tuple[Mesh, object, P]:
    """(the mesh, the call's axis_name, the arrays' sharding spec) for `Case.mesh`."""
    sizes = [int(n) for n in shape.split("x")]
    devices = np.array(devices[:int(np.prod(sizes))])
    if len(sizes) == 1:
        return Mesh(devices, ("sp",)), "sp", P(None, "sp")
    mesh = Mesh(devices.reshape(sizes), ("dp", "sp"))
    return mesh, "sp", P("dp", "sp")


def _programs(case: Case, devices):
    """(the mesh= call, the same ring under shard_map on the caller's shards, the arguments of each as
    `jax.ShapeDtypeStruct`s, the query's spec): functions of (q, k, v, *rows)."""
    hybrid = case.strategy == "hybrid"
    if hybrid:
        ring, group = (int(n) for n in case.mesh.split("x"))
        mesh = Mesh(np.array(devices[:ring * group]).reshape(ring, group), ("r", "a"))
        axis, spec = ("r", "a"), P(None, ("r", "a"))
    else:
        mesh, axis, spec = build_mesh(devices, case.mesh)
    dtype = jnp.dtype(case.dtype)
    sharding = NamedSharding(mesh, spec)
    ids = NamedSharding(mesh, P(*spec[:2]))
    q = jax.ShapeDtypeStruct((case.batch, case.tokens, case.heads, case.dim), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((case.batch, case.tokens, case.kv_heads, case.dim), dtype, sharding=sharding)
    documents = case.layout == "documents"
    row = jax.ShapeDtypeStruct((case.batch, case.tokens), jnp.int32, sharding=ids)
    strategy = "auto" if hybrid else case.strategy
    attn = get_tuned_ring_attention(axis_name=axis, causal=True, mesh=mesh, layout=case.layout, strategy=strategy)

    def global_call(q, k, v, *rows):
        return attn(q, k, v, **({"q_segment_ids": rows[0], "kv_segment_ids": rows[0]} if rows else {}))

    local = get_tuned_ring_attention(axis_name=axis, causal=True, strategy=strategy,
                                     layout="contiguous" if documents else case.layout)

    def local_call(q, k, v, *rows):
        kw = {"q_segment_ids": rows[0], "kv_segment_ids": rows[0], "q_positions": rows[1],
              "kv_positions": rows[1]} if rows else {}
        return local(q, k, v, **kw)

    reference = jax.shard_map(local_call, mesh=mesh, in_specs=(spec,) * 3 + (P(*spec[:2]),) * (2 * documents),
                              out_specs=spec)
    functions = [global_call, reference]
    if case.backward:
        functions = [_gradient(f) for f in functions]
    return functions, [(q, kv, kv, *(row,) * documents), (q, kv, kv, *(row, row) * documents)], spec


def compile_case(case: Case, devices) -> Result:
    """Compile the case's two programs and read them."""
    functions, arguments, spec = _programs(case, devices)
    programs, seconds = [], []
    for f, args in zip(functions, arguments):
        lowered = jax.jit(f).lower(*args)
        start = time.perf_counter()
        programs.append(lowered.compile())
        seconds.append(time.perf_counter() - start)
    text = programs[0].as_text()
    largest = [(gathers[0][1] if gathers else 0) / (case.batch * case.tokens)
               for gathers in (hlo.gathers(p.as_text()) for p in programs)]
    counts = [{kind: n for kind in KINDS if (n := len(re.findall(rf" {kind}(?:-start)?\(", p.as_text())))}
              for p in programs]
    outs = programs[0].output_shardings
    out = outs[0] if isinstance(outs, (tuple, list)) else outs
    return Result(case, _bytes(programs[0]), _bytes(programs[1]), *largest,
                  *counts, str(out.spec), str(spec),
                  sum(len(hlo.unordered_collectives(text, kind)) for kind in KINDS[:3]) if _cpu(devices) else 0,
                  tuple(seconds))


def time_case(case: Case, devices, repeats: int) -> tuple[float, float]:
    """Median seconds of a call of the mesh= program and of the shard_map one, on random arrays (documents:
    16 a row, which the shard_map ring gets laid out as the documents layout lays them out, with their
    positions), run interleaved after one call each."""
    functions, arguments, _ = _programs(case, devices)
    rng = np.random.default_rng(0)

    def real(struct, index):
        if struct.dtype == jnp.int32:
            row = np.sort(rng.integers(0, 16, struct.shape), axis=1) if index == 3 else np.broadcast_to(
                np.arange(struct.shape[1]), struct.shape)
            return jax.device_put(np.asarray(row, np.int32), struct.sharding)
        return jax.device_put(rng.standard_normal(struct.shape).astype(struct.dtype), struct.sharding)

    values = [[real(a, i) for i, a in enumerate(args)] for args in arguments]
    if case.layout == "documents":  # the shard_map ring runs on the rows as the documents layout lays them out
        names = ("q", "k", "v", "segment_ids")
        laid, positions = layouts.lay_out_batch(dict(zip(names, map(np.asarray, values[0]))), int(
            case.mesh.split("x")[-1]), "documents", causal=True)
        values[1] = [jax.device_put(laid[n], a.sharding) for n, a in zip(names, arguments[1])]
        values[1].append(jax.device_put(positions.astype(np.int32), arguments[1][4].sharding))
    calls = []
    for function, args in zip(functions, values):
        compiled = jax.jit(function)
        jax.block_until_ready(compiled(*args))
        calls.append(functools.partial(compiled, *args))
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _gradient(function):
    def loss(q, k, v, *rows):
        return function(q, k, v, *rows).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def _bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    return memory.temp_size_in_bytes + memory.output_size_in_bytes


def _cpu(devices) -> bool:
    return devices[0].platform == "cpu"


@functools.cache
def tpu_devices(topology: str):
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", metavar="TOPOLOGY", help="compile for this TPU topology (e.g. v5e:2x2), not the CPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--strategies", nargs="+", default=["ring"],
                        choices=["ring", "all_to_all", "all_gather", "hybrid"])
    parser.add_argument("--meshes", nargs="+", help="e.g. 8 2x4 (default: the device count, and 2 x a half)")
    parser.add_argument("--heads", type=int, nargs=2, default=None, metavar=("H", "HKV"))
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--time", type=int, default=0, metavar="N",
                        help="also run both programs N times interleaved (CPU) and report the median times")
    args = parser.parse_args(argv)
    devices = tpu_devices(args.tpu) if args.tpu else jax.devices()
    meshes = args.meshes or [str(len(devices)), f"2x{len(devices) // 2}"]
    shape = dict(batch=args.batch or (1 if args.tpu else 2), dim=args.dim or (128 if args.tpu else 64))
    heads = args.heads or ((8, 2) if args.tpu else (4, 2))
    rows, timings = [], []
    print(f"{'layout':<11} {'strategy':<10} {'mesh':<5} {'pass':<8} {'tokens':>7} {'mesh= MiB':>10} "
          f"{'shard_map':>10} {'ratio':>6} {'gather B/tok':>12} {'out':<22} collectives")
    for tokens in args.tokens:
        for strategy in args.strategies:
            for mesh in meshes:
                for layout in args.layouts:
                    for backward in (False, True):
                        data = int(mesh.split("x")[0]) if "x" in mesh and strategy != "hybrid" else 1
                        case = Case(layout, strategy, mesh, backward, tokens, heads=heads[0], kv_heads=heads[1],
                                    dim=shape["dim"], batch=max(shape["batch"], data))
                        result = compile_case(case, devices)
                        rows.append(result)
                        timed = ""
                        if args.time:
                            ours, theirs = time_case(case, devices, args.time)
                            timed = f" time {ours * 1e3:.1f} ms / {theirs * 1e3:.1f} ms = {ours / theirs:.2f}"
                            timings.append({"case": asdict(case), "mesh_s": ours, "shard_map_s": theirs})
                        print(f"{layout:<11} {strategy:<10} {mesh:<5} {'fwd+bwd' if backward else 'fwd':<8} "
                              f"{tokens:>7} {result.mesh_bytes / 2**20:>10.1f} {result.shard_map_bytes / 2**20:>10.1f} "
                              f"{result.ratio:>6.2f} {result.largest_gather_per_token:>12.1f} {result.out_spec:<22} "
                              f"{result.collectives} compile {result.compile_seconds[0]:.1f} s / "
                              f"{result.compile_seconds[1]:.1f} s{timed}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{**asdict(r), "ratio": r.ratio} for r in rows], "timings": timings}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
