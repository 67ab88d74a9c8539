"""The loader's call on global arrays (`get_tuned_ring_attention(mesh=...)`): lay the sequence out, run
the local call under `shard_map`, put the results back in token order.

The layout is over the ring's positions: the axis's size, or over two axes the ring axis, whose every
position's chunk is then cut evenly over the group axis by the sharding `PartitionSpec(None,
(ring_axis, group_axis))`. Per-call arrays along the sequence (segment ids, positions) are laid out the same
way; a bias `[B, H, Tq, Tk]` is laid out on both sequence axes and sharded over its query axis only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner.semantics import layouts

SEQUENCE_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")


def local_shape(x, size: int, name: str, axis: int = 1) -> jax.ShapeDtypeStruct:
    """One device's shard of the global `x`, split over `size` devices along its sequence `axis`."""
    if x.shape[axis] % size:
        raise ValueError(f"{name} length {x.shape[axis]} is not divisible by the ring size {size}")
    shape = list(x.shape)
    shape[axis] //= size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def call(local: Callable[..., Any], mesh: Mesh, axis_name: Hashable, layout: str, ring: int, query, key, value,
         options: dict[str, Any]):
    """`local(q, k, v, options)` on each device's shards of the global `query`/`key`/`value` (and per-call
    arrays in `options`), laid out in `layout` over `ring` positions and sharded over `axis_name` (one
    mesh axis, or the hybrid's pair); the output (and lse with `return_lse`) in token order."""

    def lay_out(x, axis: int = 1):
        return x if x.shape[axis] == 1 else layouts.lay_out(x, layout, ring, axis=axis)

    seq = P(None, axis_name)
    specs = {name: seq for name in SEQUENCE_OPTIONS}
    specs["softmax_aux"] = P()
    arrays = {n: x for n, x in options.items() if n in specs and x is not None}
    arrays.update({n: lay_out(x) for n, x in arrays.items() if n in SEQUENCE_OPTIONS})
    if options.get("bias") is not None:  # queries are sharded, the (laid-out) global key axis is not
        bias = lay_out(lay_out(options["bias"], axis=2), axis=3)
        arrays["bias"] = bias
        specs["bias"] = P(None, None, axis_name if bias.shape[2] > 1 else None, None)
    flags = {n: x for n, x in options.items() if n not in specs}
    out_specs = (seq, P(None, None, axis_name)) if flags.get("return_lse") else seq
    sharded = jax.shard_map(lambda q, k, v, x: local(q, k, v, {**x, **flags}), mesh=mesh,
                            in_specs=(seq, seq, seq, {n: specs[n] for n in arrays}),
                            out_specs=out_specs)
    result = sharded(*(lay_out(x) for x in (query, key, value)), arrays)
    if flags.get("return_lse"):
        out, lse = result
        return layouts.restore(out, layout, ring), layouts.restore(lse, layout, ring, axis=2)
    return layouts.restore(result, layout, ring)


__all__ = ["SEQUENCE_OPTIONS", "call", "local_shape"]
