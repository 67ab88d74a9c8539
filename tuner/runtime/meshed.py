"""The loader's call on global arrays (`get_tuned_ring_attention(mesh=...)`): lay the sequence out, run
the local call under `shard_map`, put the results back in token order.

The layout is over the ring's positions: the axis's size, or over two axes the ring axis, whose every
position's chunk is then cut evenly over the group axis by the sharding `PartitionSpec(None,
(ring_axis, group_axis))`. Per-call arrays along the sequence (segment ids, positions) are laid out the same
way; a bias `[B, H, Tq, Tk]` is laid out on both sequence axes and sharded over its query axis only.
The documents layout is one permutation per batch row, computed from the row's segment ids. A global
length the layout does not split is padded first, and the padding stripped from the results
(`tuner.semantics.padding`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import registry
from tuner.runtime.plan import ARRAY_OPTIONS
from tuner.semantics import documents, layouts
from tuner.semantics.documents import DOCUMENTS
from tuner.semantics.padding import Padding
from tuner.semantics.spec import AttentionSpec

SEQUENCE_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")
DOCUMENTS_NOTE = ("documents layout: each row laid out from its segment ids, keyed as contiguous (every shard in "
                  "token order, positions given)")


def local_shape(x, size: int, name: str, axis: int = 1) -> jax.ShapeDtypeStruct:
    """One device's shard of the global `x`, split over `size` devices along its sequence `axis`."""
    if x.shape[axis] % size:
        raise ValueError(f"{name} length {x.shape[axis]} is not divisible by the ring size {size}")
    shape = list(x.shape)
    shape[axis] //= size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def padding(query, key, options: dict[str, Any], *, devices: int, layout: str, causal: bool) -> Padding:
    """The padding of a call on global arrays: to lengths `layout` splits over `devices` (the documents
    layout splits as contiguous does)."""
    return Padding.of(query, key, options, devices=devices, causal=causal,
                      layout="contiguous" if layout == DOCUMENTS else layout)


def planned(padding: Padding, query, key, value, options: dict[str, Any], *, layout: str):
    """The global shapes the call runs on (`jax.ShapeDtypeStruct`s): padded, and with the positions the
    documents layout passes, so that a decision made from them is the traced call's."""
    arrays = {n: x for n, x in options.items() if n in ARRAY_OPTIONS and x is not None}
    query, key, value, arrays = jax.eval_shape(padding.pad, query, key, value, arrays)
    options = {**options, **arrays}
    return query, key, value, with_positions(options, query, key) if layout == DOCUMENTS else options


def with_positions(options: dict[str, Any], query, key) -> dict[str, Any]:
    """`options` with the positions the documents layout passes (every token's, unless given), as shapes."""
    options = dict(options)
    for name, x in (("q_positions", query), ("kv_positions", key)):
        if options.get(name) is None:
            options[name] = jax.ShapeDtypeStruct(x.shape[:2], jnp.int32)
    return options


def shards(query, key, value, options: dict[str, Any], size: int):
    """What one device of `size` holds of global arrays of lengths they divide: `(query, key, value,
    options)` as `jax.ShapeDtypeStruct`s (a bias is sharded over its query axis only)."""
    query, key, value = (local_shape(x, size, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    options = {n: local_shape(x, size, n) if n in SEQUENCE_OPTIONS and x is not None else x for n, x in options.items()}
    if options.get("bias") is not None and options["bias"].shape[2] > 1:
        options["bias"] = local_shape(options["bias"], size, "bias", axis=2)
    return query, key, value, options


def run(local: Callable[..., Any], decide: Callable[..., Any], mesh: Mesh, axis_name: Hashable, layout: str,
        ring: int, padding: Padding, query, key, value, options: dict[str, Any], *, causal: bool, window,
        rows_tile: int | None = None):
    """The loader's call on global arrays: padded, laid out, run by `local(q, k, v, options)` on each
    device, back in token order and stripped of the padding. `decide(q, k, v, options)` is the plan of
    the call, whose tiles the documents layout is planned for; `rows_tile` as in `run_documents`."""
    query, key, value, options = padding.pad(query, key, value, options)
    if layout == DOCUMENTS:
        result = run_documents(local, decide, mesh, axis_name, ring, query, key, value, options, causal=causal,
                               window=window, rows_tile=rows_tile)
    else:
        result = call(local, mesh, axis_name, layout, ring, query, key, value, options)
    return padding.strip(result, bool(options.get("return_lse")))


def run_documents(local: Callable[..., Any], decide: Callable[..., Any], mesh: Mesh, axis_name: Hashable, ring: int,
                  query, key, value, options: dict[str, Any], *, causal: bool, window, rows_tile: int | None = None):
    """`call` in the documents layout (`tuner.semantics.documents`): each batch row laid out from its query
    segment ids, planned for the forward tiles of the call's plan; the positions travel with the tokens
    (the row's token indices unless given), so the masks see the global positions and stay exact.

    A packed call with nothing tuned and no packing declared (`Plan.packed_default`) takes its tiles in
    the step: one ring per tile of `documents.PACKED_TILES` (a tile that changes nothing shares the longer
    one's), and `documents.rows_tile_choice` of the rows' segment ids picks the layout plan and the ring
    that run (two `jax.lax.switch`es, so that only the chosen tile's plan is computed and the layout's
    gathers stay outside the rings' switch). Where the rows' values are known before the trace (a call
    outside any trace), `rows_tile` is the tile they chose (`rows_tile`, below): that tile's ring alone is
    compiled, not one per tile. `local` and `decide` take `packed_tile=`, the tile chosen."""
    _check_documents(query, key, options)
    segments = options["q_segment_ids"]
    shaped = with_positions(options, query, key)
    plans = {None: decide(query, key, value, shaped)}
    if plans[None].packed_default:
        tiles = documents.PACKED_TILES if rows_tile is None else (rows_tile,)
        plans = {tile: decide(query, key, value, shaped, packed_tile=tile) for tile in tiles}
    configs, rings, orders, branch_of = [], [], [], []
    for tile, plan in plans.items():
        if plan.config not in configs:
            configs.append(plan.config)
            rings.append(functools.partial(local, packed_tile=tile))
            tiles = registry.forward_tiles(plan.config) or (documents.DEFAULT_TILE,) * 2
            orders.append(functools.partial(layouts.document_order, ring_size=ring, causal=causal, window=window,
                                            tile=tiles))
        branch_of.append(configs.index(plan.config))
    chosen = None
    if len(rings) > 1:
        spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
        chosen = jnp.asarray(branch_of)[documents.rows_tile_choice(segments, spec, ring)]
    order = orders[0](segments) if chosen is None else jax.lax.switch(chosen, orders, segments)
    options = dict(options)
    for name in ("q_positions", "kv_positions"):  # laid out below with the tokens
        if options.get(name) is None:
            options[name] = jnp.broadcast_to(jnp.arange(order.shape[1], dtype=jnp.int32), order.shape)

    def lay_out(x, axis: int = 1):
        return x if x.shape[axis] == 1 else documents.lay_out_rows(x, order, axis=axis)

    def restore(x, axis: int = 1):
        return documents.restore_rows(x, order, axis=axis)

    return _sharded(rings, chosen, mesh, axis_name, lay_out, restore, query, key, value, options)


def rows_tile(padding: Padding, query, key, value, options: dict[str, Any], ring: int, *, causal: bool, window
              ) -> int:
    """The tile of `documents.PACKED_TILES` that the rows of these arrays (values, not shapes) choose in the
    step, as `run_documents` runs them: computed now, in one compiled program."""
    spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
    sequences = {name: options.get(name) for name in SEQUENCE_OPTIONS}
    return documents.PACKED_TILES[int(_rows_tile_index(padding, spec, ring, query, key, value, sequences))]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _rows_tile_index(padding: Padding, spec: AttentionSpec, ring: int, query, key, value, sequences):
    """`documents.rows_tile_choice` of the padded query segment ids (the padding of q, k, v is never
    computed: only the ids are returned from)."""
    segments = padding.pad(query, key, value, sequences)[3]["q_segment_ids"]
    return documents.rows_tile_choice(segments, spec, ring)


def call(local: Callable[..., Any], mesh: Mesh, axis_name: Hashable, layout: str, ring: int, query, key, value,
         options: dict[str, Any]):
    """`local(q, k, v, options)` on each device's shards of the global `query`/`key`/`value` (and per-call
    arrays in `options`), laid out in `layout` over `ring` positions and sharded over `axis_name` (one
    mesh axis, or the hybrid's pair); the output (and lse with `return_lse`) in token order."""

    def lay_out(x, axis: int = 1):
        return x if x.shape[axis] == 1 else layouts.lay_out(x, layout, ring, axis=axis)

    def restore(x, axis: int = 1):
        return layouts.restore(x, layout, ring, axis=axis)

    return _sharded([local], None, mesh, axis_name, lay_out, restore, query, key, value, options)


def _check_documents(query, key, options: dict[str, Any]) -> None:
    if options.get("q_segment_ids") is None:
        raise ValueError("layout='documents' lays out each row from its documents: pass q_segment_ids (and "
                         "kv_segment_ids, or the same ids for both)")
    if query.shape[1] != key.shape[1]:
        raise ValueError(f"layout='documents' lays out queries and keys alike, so they need one length: query "
                         f"length {query.shape[1]}, key length {key.shape[1]}")


def _sharded(rings: list[Callable[..., Any]], chosen, mesh: Mesh, axis_name: Hashable, lay_out, restore, query, key,
             value, options: dict[str, Any]):
    """The shared body of the calls: `lay_out(x, axis)` permutes a global array's sequence axis into
    device-major order, `restore(x, axis)` undoes it; `rings[chosen]` runs on each device's shards (the
    only one where `chosen` is None)."""
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
    sharded = [jax.shard_map(lambda q, k, v, x, local=local: local(q, k, v, {**x, **flags}), mesh=mesh,
                             in_specs=(seq, seq, seq, {n: specs[n] for n in arrays}), out_specs=out_specs)
               for local in rings]
    laid_out = (*(lay_out(x) for x in (query, key, value)), arrays)
    result = sharded[0](*laid_out) if chosen is None else jax.lax.switch(chosen, sharded, *laid_out)
    if flags.get("return_lse"):
        out, lse = result
        return restore(out), restore(lse, axis=2)
    return restore(result)


__all__ = ["DOCUMENTS_NOTE", "SEQUENCE_OPTIONS", "call", "local_shape", "padding", "planned", "rows_tile", "run",
           "run_documents", "shards", "with_positions"]
