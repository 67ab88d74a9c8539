"""What the loader would run for a problem: its plan, without running it.

`tuner bench` times the plan beside the defaults; `tuner memory` compiles it. Both ask the loader
(`get_tuned_ring_attention(...).explain`) on one device's shards as `jax.ShapeDtypeStruct`s, so the
plan is the one a training step on those shards gets from the same cache.
"""

from __future__ import annotations

import jax

from tuner.runtime.dispatch import Decision, get_tuned_ring_attention
from tuner.semantics.problem import Problem
from tuner.tuning.workload import AXIS, PAIR_AXES


def loader_plan(problem: Problem, backend: str, db: str | None) -> Decision:
    """The loader's plan for `problem` with `backend` ("auto": its own choice) and the cache `db` (None:
    the default one)."""
    pair = problem.group is not None
    return get_tuned_ring_attention(
        axis_name=PAIR_AXES if pair else AXIS, causal=problem.causal, sliding_window=problem.window,
        chunk_size=problem.chunk_size, logits_soft_cap=problem.softcap, layout=problem.layout, backend=backend, db=db,
    ).explain(*local_structs(problem), ring_size=(problem.ring_positions, problem.a2a_size) if pair
              else problem.ring_size, **call_structs(problem))


def local_structs(problem: Problem) -> tuple:
    """One device's q, k, v shards of `problem`."""
    local = problem.local_len
    q = jax.ShapeDtypeStruct((problem.batch, local, problem.heads, problem.head_dim), problem.dtype)
    k = jax.ShapeDtypeStruct((problem.batch, local, problem.kv_heads, problem.head_dim), problem.dtype)
    v = jax.ShapeDtypeStruct((problem.batch, local, problem.kv_heads, problem.value_dim), problem.dtype)
    return q, k, v


def call_structs(problem: Problem) -> dict:
    """The per-call arrays of `problem` beside q, k, v: segment ids, sinks."""
    options = {}
    if problem.segments:
        seg = jax.ShapeDtypeStruct((problem.batch, problem.local_len), "int32")
        options.update(q_segment_ids=seg, kv_segment_ids=seg)
    if problem.sinks:
        shape = (problem.heads,) if problem.sinks == 1 else (problem.heads, problem.sinks)
        options["softmax_aux"] = jax.ShapeDtypeStruct(shape, problem.dtype)
    return options


__all__ = ["call_structs", "local_structs", "loader_plan"]
