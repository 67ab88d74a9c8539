"""The all-gather KV strategy: every device gathers the whole sequence's keys and values once and attends
its own queries to them.

On each of the P devices of the ring's axis, the query shard `[B, T/P, H, D]` stays where it is; the key
and value shards (only the Hkv heads) are all-gathered with `jax.lax.all_gather` into `[B, T, Hkv, D]`, in
ring order (gathered heads-major, the kernel's layout, so that dK and dV are reduce-scattered from it:
on the CPU up to 18% fewer temporaries, docs/memory.md), and the device attends its queries over them
with a block kernel's ring at ring size 1 (`tuner.strategies.ring.run_ring`; registered once per kernel,
`all_gather` over the scan kernel). One collective instead of P - 1
ring steps, and no condition on the heads: it wins where the ring's transfers cannot hide and the heads
do not split for all_to_all.

- Positions: the queries keep their own GLOBAL positions (the layout's for this device's shard,
  `tuner.layouts.local_positions`, or those given); the gathered keys keep theirs (the layout's global
  order, or the given ones all-gathered), so causal, window and chunk masks are exact in every layout.
  Query segment ids stay, key segment ids are all-gathered.
- Heads: all H query heads are local, so GQA needs no repeat and sinks (`[H]` or `[H, n]`) are used whole.
  No bias: a bias over the laid-out key axis is not taken here; the ring supports it.
- Memory: the gathered K and V hold `2 * B * T * Hkv * D * itemsize` bytes per device (`gathered_bytes`).
  When the device reports a memory limit, a call whose gathered K/V would take more than half of it is
  refused when it is resolved (`shape_violation`: by name, `ValueError`; under `auto`, skipped), and by
  `attend` too; the ring and all_to_all hold only shards.
- Config: the inner ring's `TileConfig`, tuned as a ring's on what it runs (`tile_shapes`: the local
  queries against the whole sequence's keys): its default, space and constraints are the kernel's
  there, with query tiles no longer than the local queries.
- Backward: jax's autodiff through the all-gathers (their transpose is a reduce-scatter of dK and dV: each
  device gets back the summed gradient of its own shard) and the inner ring's `custom_vjp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tuner.semantics import layouts
from tuner.support import ordering
from tuner import registry
from tuner.support import vma
from tuner.kernels.base import SearchSpace
from tuner.kernels import BACKENDS
from tuner.strategies.implementations import Exchanged
from tuner.strategies.configs import TileConfig, TileSpace
from tuner.strategies.ring import ring_geometry, run_ring
from tuner.semantics.spec import AttentionSpec, LocalShapes

BIAS_REASON = "bias: the all-gather does not carry a bias over the key axis; the ring supports it"


def gathered_bytes(shapes: LocalShapes, ring_size: int) -> int:
    """Bytes of the gathered K and V on each device: `B * (ring_size * kv_len) * Hkv * (D + Dv) * itemsize`."""
    itemsize = jnp.dtype(shapes.dtype).itemsize
    return (shapes.batch * ring_size * shapes.kv_len * shapes.kv_heads * (shapes.head_dim + shapes.value_dim)
            * itemsize)


def device_bytes_limit() -> int | None:
    """The memory limit in bytes of this process's first device (a device of another process cannot be asked),
    or None where it reports none (the CPU)."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    return int(limit) if limit else None


def memory_violation(shapes: LocalShapes, ring_size: int) -> str | None:
    """Why the gathered K/V would not fit: over half of the device's memory limit; None where it fits."""
    limit, needed = device_bytes_limit(), gathered_bytes(shapes, ring_size)
    if limit is not None and 2 * needed > limit:
        return (f"all_gather would hold {needed / 2**30:.3g} GiB of gathered K/V per device, over half "
                f"the device's {limit / 2**30:.3g} GiB; use the ring or all_to_all")
    return None


def check_memory(shapes: LocalShapes, ring_size: int) -> None:
    """`ValueError` when the gathered K/V would take more than half of the device's memory limit."""
    reason = memory_violation(shapes, ring_size)
    if reason is not None:
        raise ValueError(reason)


def all_gather_attention(query, key, value, *, spec: AttentionSpec, config: TileConfig, axis_name: Hashable | None,
                         layout: str, interpret: bool = False, backend: str = "scan", q_segment_ids=None,
                         kv_segment_ids=None, q_positions=None, kv_positions=None, softmax_aux=None, bias=None,
                         return_lse: bool = False) -> Any:
    """This device's output (and lse `[B, H, T/P]`) for a call resolved to `spec`, under `shard_map` over
    `axis_name`, on shards in `layout` (module docstring), the inner ring over the block kernel `backend`.
    Arrays as in `tuner.ring_attention`."""
    if bias is not None or spec.has_bias:
        raise ValueError(f"all_gather does not support {BIAS_REASON}")
    size, rank = ring_geometry(axis_name)
    check_memory(LocalShapes.of_shards(query, key), size)
    b, tq = query.shape[:2]
    tk = key.shape[1]

    def gathered(x):  # [B, T/P, ...] -> [B, T, ...], in ring order
        if x is None or axis_name is None:
            return x
        if x.ndim == 2:  # positions, segment ids
            return lax.all_gather(x, axis_name, axis=1, tiled=True)
        # keys and values gathered heads-major, as the kernels read them: the swaps back and forth cancel
        return jnp.swapaxes(lax.all_gather(jnp.swapaxes(x, 1, 2), axis_name, axis=2, tiled=True), 1, 2)

    if q_positions is None:
        q_positions = jnp.broadcast_to(layouts.local_positions(layout, tq, size, rank), (b, tq))
    # On the CPU one gather at a time (`tuner.support.ordering`).
    key, value, kv_positions, kv_segment_ids = ordering.in_order(gathered, [
        key, value, None if kv_positions is None else kv_positions.astype(jnp.int32),
        None if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)])
    if kv_positions is None:
        order = jnp.asarray(layouts.global_order(layout, tk * size, size), jnp.int32)
        kv_positions = jnp.broadcast_to(order, (b, tk * size))

    sinks = softmax_aux
    if sinks is not None and axis_name is not None and axis_name not in vma.varying_axes(sinks):
        sinks = lax.pcast(sinks, (axis_name,), to="varying")  # one set for every device: its gradient sums
    return run_ring(query, key, value, spec=spec, backend=backend, fwd_params=config.fwd,
                    bwd_params=config.bwd, axis_name=None, layout=layout, interpret=interpret,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                    kv_positions=kv_positions, softmax_aux=sinks, return_lse=return_lse)


class AllGather(Exchanged):
    """All-gather K/V over the ring's axis, then a block kernel's ring at ring size 1 of the local queries
    over the whole sequence (module docstring)."""

    summary_form = ("all-gather K/V (refused over half the device memory), "
                    "{kernel} of the local queries over the whole sequence")
    strategy = "all_gather"
    bias_reason = BIAS_REASON

    def shape_violation(self, shapes: LocalShapes, ring_size: int) -> str | None:
        return memory_violation(shapes, ring_size)

    def tile_shapes(self, shapes: LocalShapes, ring_size: int, group: int | None = None) -> LocalShapes:
        """The local queries against the keys of the whole ring."""
        return dataclasses.replace(shapes, kv_len=ring_size * shapes.kv_len)

    def space(self, shapes: LocalShapes, spec: AttentionSpec) -> registry.Space:
        candidates = self.inner.search_space(shapes, spec)

        def cut(tiles: tuple[int, ...]) -> tuple[int, ...]:  # a query tile longer than the shard is the shard
            return tuple(sorted({min(t, shapes.q_len) for t in tiles}))

        return TileSpace(SearchSpace(fwd={**candidates.fwd, "block_q": cut(candidates.fwd["block_q"])},
                                     bwd={**candidates.bwd, "block_q_dkv": cut(candidates.bwd["block_q_dkv"])},
                                     dq_tiles=candidates.dq_tiles, dq_passes=candidates.dq_passes))

    attention = staticmethod(all_gather_attention)


for _kernel in BACKENDS.values():
    registry.register(AllGather(_kernel))

__all__ = ["AllGather", "all_gather_attention", "check_memory", "device_bytes_limit", "gathered_bytes",
           "memory_violation"]
