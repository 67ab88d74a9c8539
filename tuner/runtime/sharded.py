"""The body of a call on global arrays: one `shard_map` over the sequence axes that lays each device's
shards out, runs the ring on them and puts the results back, with collectives (`tuner.semantics.moves`).

The arrays arrive sharded over the sequence axes in token order (the caller's sharding, or the one
`shard_map` gives them). The mesh's other axes keep what they hold (`Split`: a batch on a data axis, heads
on a tensor axis), and the output comes back sharded as the query came in. No device holds more of the
sequence than its shard, except the segment ids (and, laid out by the caller, the positions) that the
documents layout plans from, 4 bytes a token each.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner.semantics import documents, layouts, moves
from tuner.semantics.documents import DOCUMENTS
from tuner.semantics.spec import AttentionSpec
from tuner.support import ordering, permutations, placement

SEQUENCE_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")


@dataclass(frozen=True)
class Layout:
    """How the body lays the shards out. `layout`: a fixed layout or `documents`; `laid_out`: the caller
    already did (nothing moves); `platform` and `other_axes` (whether the mesh has axes other than the
    sequence's) choose the collectives (`tuner.semantics.moves.method_for`); for the documents
    layout, `orders[i](rows)` is the layout of the rows of segment ids `[B, T]` for the `i`-th ring, and
    `branch_of` maps the tile index the rows choose (`documents.rows_tile_choice`) to a ring, where there
    are several."""

    layout: str
    ring: int
    platform: str
    other_axes: bool
    laid_out: bool = False
    spec: AttentionSpec | None = None
    orders: tuple[Callable[..., Any], ...] = ()
    branch_of: tuple[int, ...] = ()


@dataclass(frozen=True)
class Split:
    """What the mesh's axes other than the sequence's hold of the arrays: the mesh axes (a `PartitionSpec`
    entry) of the batch, of the query heads and of the key/value heads. `manual`: the body runs manual over
    every axis of the mesh with these entries; else over the sequence axes only, the others left to XLA's
    partitioner, which keeps whatever sharding they have (but cannot partition a Mosaic or Triton kernel)."""

    batch: Any = None
    q_heads: Any = None
    kv_heads: Any = None
    manual: bool = True

    def shard(self, mesh: Mesh, dim: int, entry: Any) -> int:
        """The length of a dimension of `dim` on one device, split over the mesh axes of `entry`."""
        if not self.manual or entry is None:
            return dim
        names = entry if isinstance(entry, tuple) else (entry,)
        return dim // int(np.prod([mesh.shape[n] for n in names]))


def run(rings: list[Callable[..., Any]], how: Layout, split: Split, mesh: Mesh, axis_name: Hashable, query, key,
        value, options: dict[str, Any]):
    """`rings[i](q, k, v, options)` on each device's laid-out shards of the global `query`/`key`/`value`
    (and the per-call arrays in `options`), inside `shard_map` over `axis_name` (one mesh axis or a pair)
    and, as `split` says, the mesh's other axes; the output (and lse with `return_lse`) in token order,
    sharded as the query is."""
    batch, q_heads, kv_heads = split.batch, split.q_heads, split.kv_heads
    seq = P(batch, axis_name)
    specs = {name: seq for name in SEQUENCE_OPTIONS}
    sinks = options.get("softmax_aux")
    specs["softmax_aux"] = P() if sinks is None else P(q_heads, *([None] * (sinks.ndim - 1)))
    arrays = {n: x for n, x in options.items() if n in specs and x is not None}
    if options.get("bias") is not None:
        bias = arrays["bias"] = options["bias"]
        specs["bias"] = P(batch if bias.shape[0] > 1 else None, q_heads if bias.shape[1] > 1 else None,
                          axis_name if bias.shape[2] > 1 else None, None)
    flags = {n: x for n, x in options.items() if n not in specs}
    return_lse = bool(flags.get("return_lse"))
    q_spec, kv_spec = P(batch, axis_name, q_heads, None), P(batch, axis_name, kv_heads, None)
    out_specs = (q_spec, P(batch, q_heads, axis_name)) if return_lse else q_spec
    names = set(layouts.sequence_axes(axis_name))

    def body(q, k, v, arrays):
        move, chosen, arrays = _move_of(how, axis_name, q.shape[1], arrays)
        key_move = _key_move(how, axis_name, move, q.shape[1], k.shape[1])
        moving = [n for n in SEQUENCE_OPTIONS if n in arrays and not _given_by(how, n, options)]
        lay_outs = [(move if name == "query" or name.startswith("q_") else key_move).lay_out
                    for name in ["query", "key", "value", *moving]]
        q, k, v, *moved = _in_order(lay_outs, [q, k, v, *(arrays[n] for n in moving)], after=chosen)
        arrays = {**arrays, **dict(zip(moving, moved))}
        if "bias" in arrays:
            arrays["bias"] = _bias(ordering.ordered(arrays["bias"], moved[-1:] or v), move, how)
        calls = [lambda q, k, v, a, ring=ring: ring(q, k, v, {**a, **flags}) for ring in rings]
        result = calls[0](q, k, v, arrays) if chosen is None else lax.switch(chosen, calls, q, k, v, arrays)
        if return_lse:
            out, lse = _restored(move, [result[0], jnp.swapaxes(result[1], 1, 2)])
            return out, jnp.swapaxes(lse, 1, 2)
        return _restored(move, [result])[0]

    in_specs = (q_spec, kv_spec, kv_spec, {n: specs[n] for n in arrays})
    manual = set(mesh.axis_names) if split.manual else names
    args = placement.for_shard_map(mesh, manual, (query, key, value, arrays), in_specs)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual)(*args)


def describe(how: Layout, axis_name: Hashable, shard: int, devices: int, kv_shard: int | None = None) -> str:
    """What the body moves, for `explain()` (`kv_shard`: the keys' shard, where its length is their own)."""
    if how.laid_out:
        return f"arrays laid out by the caller ({how.layout}): nothing permuted"
    documents_ = how.layout == DOCUMENTS
    what = f"{DOCUMENTS}, each row from its segment ids" if documents_ else how.layout

    def collectives(length: int) -> str:
        kind = "permutation" if documents_ else moves.kind(how.layout, isinstance(axis_name, tuple), length, devices)
        method = moves.method_for(how.platform, how.other_axes, permutation=kind == "permutation")
        return moves.Move(kind, axis_name, method=method).describe()

    queries = collectives(shard)
    keys = queries if kv_shard in (None, shard) else collectives(kv_shard)
    moved = queries if keys == queries else f"queries: {queries}; keys and values: {keys}"
    return f"laid out in the step ({what}): {moved}"


def _in_order(move: Callable[..., Any] | list[Callable[..., Any]], xs: list, after=None) -> list:
    """`move` of each array of `xs` (or `move[i]` of `xs[i]`), one after the other on the CPU, the first after
    `after` (`tuner.support.ordering`)."""
    return ordering.in_order(move, xs, () if after is None else after)


def _restored(move: moves.Move, results: list) -> list:
    """`move.restore` of the ring's results, one after the other on the CPU. Their cotangents wait for the
    forward values of every restore, so that in the backward pass the transposed restores, which start from the
    loss's seed, cannot meet the forward's collectives in flight (`tuner.support.ordering`)."""
    restored = _in_order(move.restore, results)
    return [ordering.ordered(x, restored) for x in restored]


def _given_by(how: Layout, name: str, options: dict[str, Any]) -> bool:
    """Whether the body made this array itself, already laid out (the documents layout's positions)."""
    return how.layout == DOCUMENTS and not how.laid_out and name.endswith("positions") and options.get(name) is None


def _move_of(how: Layout, axis_name: Hashable, shard: int, arrays: dict[str, Any]):
    """(the move of this call's shards, the ring the rows chose or None, the per-call arrays with the
    positions the documents layout passes)."""
    devices = lax.axis_size(axis_name)
    if how.laid_out:
        return moves.Move("contiguous", axis_name), _laid_out_choice(how, axis_name, arrays), arrays
    if how.layout != DOCUMENTS:
        order = layouts.global_order(how.layout, shard * devices, how.ring)
        return moves.fixed(how.layout, axis_name, shard, devices, order, platform=how.platform,
                           other_axes=how.other_axes), None, arrays
    rows = lax.all_gather(arrays["q_segment_ids"], axis_name, axis=1, tiled=True)  # the plan reads whole rows
    chosen = None
    if len(how.orders) > 1:
        chosen = jnp.asarray(how.branch_of)[documents.rows_tile_choice(rows, how.spec, how.ring)]
        order = lax.switch(chosen, list(how.orders), rows)
    else:
        order = how.orders[0](rows)
    arrays = dict(arrays)
    mine = lax.dynamic_slice_in_dim(order, lax.axis_index(axis_name) * shard, shard, axis=1)
    for name in ("q_positions", "kv_positions"):
        if arrays.get(name) is None:
            arrays[name] = mine  # already in the layout: the tokens' indices
    return moves.permutation(order, axis_name, platform=how.platform, other_axes=how.other_axes), chosen, arrays


def _key_move(how: Layout, axis_name: Hashable, move: moves.Move, q_shard: int, kv_shard: int) -> moves.Move:
    """The move of the key side (keys, values, their segment ids and positions): the queries' `move`, unless
    their shards differ in length under a fixed layout, whose permutation or collectives depend on the length
    (the documents layout takes one length; arrays laid out by the caller do not move)."""
    if kv_shard == q_shard or how.laid_out or how.layout == DOCUMENTS:
        return move
    return _move_of(how, axis_name, kv_shard, {})[0]


def _laid_out_choice(how: Layout, axis_name: Hashable, arrays: dict[str, Any]):
    """The ring the rows of a call laid out by the caller choose, where there are several: from their
    segment ids put back in token order by their positions."""
    if len(how.orders) <= 1:
        return None
    ids, positions = ordering.in_order(lambda x: lax.all_gather(x, axis_name, axis=1, tiled=True),
                                       [arrays["q_segment_ids"], arrays["q_positions"]])
    rows = jnp.take_along_axis(ids, permutations.inverse(positions), axis=1)
    return jnp.asarray(how.branch_of)[documents.rows_tile_choice(rows, how.spec, how.ring)]


def _bias(bias, move: moves.Move, how: Layout):
    """A bias `[B, H, Tq/P, Tk]` laid out: its query axis moves with the queries; its key axis, whole on
    every device, is permuted in place."""
    if bias.shape[2] > 1:
        if move.how == "permutation" and bias.shape[0] < move.order.shape[0]:
            bias = jnp.broadcast_to(bias, (move.order.shape[0], *bias.shape[1:]))
        bias = move.lay_out(bias, axis=2)
    if bias.shape[3] == 1 or how.laid_out or how.layout == "contiguous":
        return bias
    if how.layout == DOCUMENTS:
        return documents.lay_out_rows(bias, move.order, axis=3)
    return layouts.lay_out(bias, how.layout, how.ring, axis=3)  # the keys' order, whatever their length


__all__ = ["Layout", "SEQUENCE_OPTIONS", "Split", "describe", "run"]
