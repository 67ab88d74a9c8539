"""One of the 2 processes of `test_multiprocess.py`: multi-host JAX on the CPU, 2 devices per process.

    python -m tests.multiprocess_worker PORT PROCESS_ID RESULT_JSON   # from the repository root

Every process joins `jax.distributed`, builds the same global problem from a fixed seed, and runs each
strategy of `ring_attention` (forward and gradients under one `jax.jit`) over a mesh of all 4 devices, so
its collectives cross the process boundary. Every process gathers the results; process 0 writes their
relative errors against the float64 dense reference to RESULT_JSON. Last, the loader runs once more from
cache files that disagree (each process's holds another winner for the problem); each process writes
what it ran to RESULT_JSON.<process id>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import traceback
from collections.abc import Callable, Hashable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cases import Arrays, Case, dense_step, make_arrays, rel_err
from tuner import __version__, get_tuned_ring_attention, registry, ring_attention
from tuner.cache import Cache, make_row
from tuner.kernels.params import FwdParams
from tuner.semantics import layouts

CASE = Case(batch=1, length=64, heads=4, kv_heads=2, head_dim=8, layout="zigzag", causal=True, seed=0)
PROCESSES = 2
SEQUENCE_STRATEGIES = ("ring", "all_to_all", "all_gather")


def initialize(port: int, process_id: int) -> None:
    """Join the 2-process cluster. CPU computations that span processes need a cross-process collectives
    implementation (without one XLA answers "Multiprocess computations aren't implemented on the CPU
    backend"); gloo ships with jaxlib. It is jax 0.10's default, set here so an older default cannot bite."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=PROCESSES,
                               process_id=process_id)


def global_array(x: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """A global `jax.Array` of host array `x` (the same in every process) sharded by `spec` over `mesh`."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])


def strategy_step(strategy: str, mesh: Mesh, axis_name: Hashable, seq: P) -> Callable:
    """The jitted value-and-gradient (out and lse as aux) of `ring_attention` with `strategy` under `shard_map`,
    over laid-out global q, k, v and loss weights w [B,T,H,D], u [B,H,T]."""
    lse_spec = P(None, None, seq[1])

    def local(q, k, v):
        return ring_attention(q, k, v, axis_name=axis_name, layout="zigzag", causal=True, strategy=strategy,
                              return_lse=True)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, lse_spec))

    def loss(q, k, v, w, u):
        out, lse = sharded(q, k, v)
        return jnp.vdot(out, w) + jnp.sum(lse * u), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def everywhere(prepare: Callable[[], Callable[[], list[np.ndarray]]]) -> list[np.ndarray] | str:
    """`prepare()` (trace and compile) in every process, then the runner it returns only where it succeeded in all
    of them: a process that failed to trace would leave the others waiting in their collectives for good. Returns
    the runner's results, or why not (the traceback goes to the failing process's stderr)."""
    try:
        run = prepare()
    except Exception:  # reported below, and agreed on with the other process
        traceback.print_exc()
        run = None
    failed = multihost_utils.process_allgather(np.array([run is None]))
    if failed.any():
        return f"failed to compile in process(es) {np.flatnonzero(failed).tolist()}: see their stderr"
    return run()


def prepare_strategy(strategy: str, a: Arrays, mesh: Mesh, axis_name: Hashable, seq: P,
                     ring: int) -> Callable[[], list[np.ndarray]]:
    """Compile `strategy` on `mesh`; the runner returns out, lse, dq, dk, dv gathered to every process, in natural
    token order. The zigzag layout spreads the sequence over the `ring` members of the ring axis."""
    def lay(x: np.ndarray, axis: int = 1) -> np.ndarray:
        return np.asarray(layouts.lay_out(jnp.asarray(x), CASE.layout, ring, axis=axis))

    lse_spec = P(None, None, seq[1])
    args = [global_array(lay(x), mesh, seq) for x in (a.q, a.k, a.v, a.out_weight)]
    args.append(global_array(lay(a.lse_weight, 2), mesh, lse_spec))
    step = strategy_step(strategy, mesh, axis_name, seq).lower(*args).compile()

    def run() -> list[np.ndarray]:
        (_, (out, lse)), (dq, dk, dv) = step(*args)
        gathered = multihost_utils.process_allgather((out, lse, dq, dk, dv), tiled=True)
        return [np.asarray(layouts.restore(jnp.asarray(x), CASE.layout, ring, axis=2 if i == 1 else 1), np.float64)
                for i, x in enumerate(gathered)]

    return run


def prepare_loader(a: Arrays, mesh: Mesh) -> Callable[[], list[np.ndarray]]:
    """Compile the loader with `mesh=` (it lays out and restores itself) on natural-order global arrays; the runner
    returns its out and lse gathered to every process."""
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, strategy="ring")
    args = [global_array(x, mesh, P(None, "sp")) for x in (a.q, a.k, a.v)]
    step = jax.jit(lambda q, k, v: attn(q, k, v, return_lse=True)).lower(*args).compile()
    return lambda: [np.asarray(x, np.float64) for x in multihost_utils.process_allgather(step(*args), tiled=True)]


DISAGREEING_TILES = (FwdParams(8, 8), FwdParams(8, 16))  # the winner in process 0's cache file, in process 1's


def prepare_disagreeing_loader(a: Arrays, mesh: Mesh, db: str, warnings: list[str]) -> Callable[[], list[np.ndarray]]:
    """The loader over cache files that disagree: each process first stores its own winner for the problem
    in `db` (a file of its own); the runner returns the loader's out and lse gathered to every process."""
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, strategy="ring", db=db)
    args = [global_array(x, mesh, P(None, "sp")) for x in (a.q, a.k, a.v)]
    plan = attn.explain(*args)
    config = dataclasses.replace(plan.config, fwd=DISAGREEING_TILES[jax.process_index()])
    Cache(db).put(make_row(plan.key, config, versions=registry.versions(registry.get(plan.backend)),
                           tool_version=__version__, objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0,
                           trials_run=1, trials_pruned=0, study="disagreeing"))

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("tuner.runtime.agreement").addHandler(Collect(logging.WARNING))
    multihost_utils.sync_global_devices("stored")  # no process has traced the call: process 0 decided nothing
    before = attn.explain(*args, return_lse=True)
    multihost_utils.sync_global_devices("explained")  # process 0 traces (and publishes) only after every `before`

    def compiled():
        return jax.jit(lambda q, k, v: attn(q, k, v, return_lse=True)).lower(*args).compile()

    step = compiled() if jax.process_index() == 0 else None  # process 0 publishes its decision
    multihost_utils.sync_global_devices("process 0 traced")
    published = attn.explain(*args, return_lse=True)
    step = step or compiled()
    after = attn.explain(*args, return_lse=True)
    (ran,) = attn.traced
    explained = {name: {"fwd": p.config.to_dict()["fwd"], "source": p.source, "reason": p.reason}
                 for name, p in (("before", before), ("published", published), ("after", after))}
    warnings.append(json.dumps({"ran": ran.config.to_dict()["fwd"], "source": ran.source, "explained": explained}))
    return lambda: [np.asarray(x, np.float64) for x in multihost_utils.process_allgather(step(*args), tiled=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("process_id", type=int)
    parser.add_argument("result", help="JSON file process 0 writes the errors to")
    options = parser.parse_args()
    initialize(options.port, options.process_id)
    assert jax.device_count() == 2 * PROCESSES and jax.local_device_count() == 2, jax.devices()

    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(PROCESSES)]
    line = Mesh(np.array(sum(by_process, [])), ("sp",))  # the ring 0 -> 1 -> 2 -> 3 -> 0 crosses processes twice
    # Rows are processes: the "ring" axis spans the two processes (its ppermute crosses them), while each
    # "a2a" group stays inside one process.
    grid = Mesh(np.array(by_process), ("ring", "a2a"))
    assert [d.process_index for d in grid.devices[:, 0]] == list(range(PROCESSES))

    a = make_arrays(CASE)
    results = {s: everywhere(partial(prepare_strategy, s, a, line, "sp", P(None, "sp"), line.size))
               for s in SEQUENCE_STRATEGIES}
    results["hybrid"] = everywhere(partial(prepare_strategy, "hybrid", a, grid, ("ring", "a2a"),
                                           P(None, ("ring", "a2a")), grid.shape["ring"]))
    results["loader"] = everywhere(partial(prepare_loader, a, line))
    said: list[str] = []
    disagreeing = everywhere(partial(prepare_disagreeing_loader, a, line,
                                     f"{options.result}.{jax.process_index()}.sqlite", said))
    with open(f"{options.result}.{jax.process_index()}", "w") as f:
        json.dump({"said": said, "failed": disagreeing if isinstance(disagreeing, str) else None}, f, indent=1)
    results["disagreeing caches"] = disagreeing

    if jax.process_index() == 0:
        out, lse, grads = dense_step(CASE, a)
        want = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads[:3])))
        errors = {s: values if isinstance(values, str) else {n: rel_err(got, want[n]) for n, got in zip(want, values)}
                  for s, values in results.items()}
        with open(options.result, "w") as f:
            json.dump({"processes": jax.process_count(), "devices": jax.device_count(), "errors": errors}, f,
                      indent=1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
