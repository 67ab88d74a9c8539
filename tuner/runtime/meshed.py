"""The loader's call on global arrays (`get_tuned_ring_attention(mesh=...)`), in one place: pad the
sequence to a length the layout splits, plan the call from one device's shards, and run it in one
`shard_map` that lays the shards out with collectives and puts the results back
(`tuner.runtime.sharded`). Nothing gathers q, k, v or the output along the sequence.

The layout is over the ring's positions: the axis's size, or over two axes the ring axis, whose every
position's chunk is then cut evenly over the group axis (`PartitionSpec(None, (ring_axis, group_axis))`).
Per-call arrays along the sequence (segment ids, positions) move with the tokens; a bias `[B, H, Tq, Tk]`
is sharded over its query axis, which moves with the queries, while its key axis is permuted in place.
The documents layout is one permutation per batch row, planned from the row's segment ids. A global
length the layout does not split is padded first (`tuner.semantics.padding`; XLA moves the few pad-shifted
tokens between neighbours), and the padding stripped from the results.

With `laid_out=True` the arrays are already in the layout's device-major order (`tuner.layouts.lay_out_batch`
in the data pipeline, once per batch): nothing is permuted, and the output stays in that order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tuner import registry
from tuner.cache import writes
from tuner.runtime import sharded
from tuner.runtime.plan import ARRAY_OPTIONS, Plan
from tuner.runtime.sharded import SEQUENCE_OPTIONS
from tuner.semantics import documents, layouts
from tuner.semantics.documents import DOCUMENTS
from tuner.semantics.padding import Padding
from tuner.semantics.spec import AttentionSpec, check_arrays
from tuner.support.checks import check_bool
from tuner.support.jitted import call_jitted
from tuner.support.targets import compile_target

STATIC = ("return_lse", "interpret", "rows_tile", "split")  # the jitted call's static arguments
DOCUMENTS_NOTE = ("documents layout: each row laid out from its segment ids, keyed as contiguous (every shard in "
                  "token order, positions given)")


class GlobalCall:
    """`call(query, key, value, options)` on global arrays over `mesh`. `local(q, k, v, options,
    packed_tile=)` is the loader's call on one device's shards (under `shard_map`); `decide(q, k, v,
    ring_size, options, group, packed_tile=, expect=)` its plan for one device's shapes."""

    def __init__(self, *, mesh: Mesh, axis_name: Hashable, layout: str, causal: bool, window, laid_out: bool,
                 packing: str | None, local: Callable[..., Any], decide: Callable[..., Plan]):
        self.mesh, self.axis_name, self.layout, self.laid_out = mesh, axis_name, layout, laid_out
        self.packing = packing  # a declared packing plans its tile from the packing: nothing for the rows to choose
        self.causal, self.window = causal, window
        # the masks the documents plan and the rows' tile choice count tiles by
        self._rows_spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
        self._local, self._decide = local, decide
        self._compiled: tuple[int, Any] | None = None  # (cache writes when made, the jitted call)

    def sizes(self) -> tuple[int, int]:
        """(devices the sequence is split over, ring positions the layout is over): the axis's size twice,
        or over two axes R x A and R."""
        if isinstance(self.axis_name, tuple):
            ring, group = (self.mesh.shape[name] for name in self.axis_name)
            return ring * group, ring
        return (self.mesh.shape[self.axis_name],) * 2

    def __call__(self, query, key, value, options: dict[str, Any]):
        check_arrays(query, key, value)  # before the padding and the moves, which would fail on them less clearly
        split = self.split(query, key)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((query, key, value, options))):
            # one jitted call for the caller's transforms, not shard_map's primitives one by one (which jax.jvp and
            # jax.linearize outside any jit fail on inside jax)
            static = {n: v for n, v in options.items() if n in STATIC}
            arrays = {n: v for n, v in options.items() if n not in STATIC}
            return call_jitted(self._traced, dict(split=split, **static), query, key, value, **arrays)
        tile = self.rows_tile(query, key, value, options, split)
        return self._jitted()(query, key, value, rows_tile=tile, split=split, **options)

    def split(self, query, key) -> sharded.Split:
        """What the mesh's other axes hold of these arrays (`sharded.Split`): read from their shardings where
        they have them (arrays, `jax.ShapeDtypeStruct`s, traced arrays of an explicit-sharding mesh). Under a
        trace of auto-sharded arrays XLA decides later: on the CPU the other axes are left to it (every kernel
        there is XLA's to partition); elsewhere, where Mosaic and Triton kernels are not, the batch is taken to
        be split over them (else the heads), as data parallelism (else tensor parallelism) does, and where
        neither divides, replicated over them."""
        names, others = set(layouts.sequence_axes(self.axis_name)), self._other_axes()
        if not others:
            return sharded.Split()
        specs = [_spec(x, self.mesh) for x in (query, key)]
        if None not in specs:
            entries = [[_entry(spec, dim, names) for dim in (0, 2)] for spec in specs]
            return sharded.Split(batch=entries[0][0], q_heads=entries[0][1], kv_heads=entries[1][1])
        if compile_target(self.mesh)[0] == "cpu":
            return sharded.Split(manual=False)
        count, entry = int(np.prod([self.mesh.shape[n] for n in others])), others if len(others) > 1 else others[0]
        if query.shape[0] % count == 0:
            return sharded.Split(batch=entry)
        if query.shape[2] % count == 0 and key.shape[2] % count == 0:
            return sharded.Split(q_heads=entry, kv_heads=entry)
        return sharded.Split()  # replicated over them: each group of devices runs the same ring

    def plan(self, query, key, value, options: dict[str, Any], a2a: int | None = None, *,
             packed_tile: int | None = None, split: sharded.Split | None = None, expect: bool = False) -> Plan:
        """The plan for global arrays (or shapes) of lengths the mesh divides, from one device's shards
        (`expect`: what a traced call runs, in a multi-process program process 0's where known)."""
        size, ring = self.sizes()
        if a2a is None and isinstance(self.axis_name, tuple):
            a2a = size // ring
        split = self.split(query, key) if split is None else split
        query, key, value, options = shards(query, key, value, options, size, split, self.mesh)
        return self._decide(query, key, value, size, options, a2a, packed_tile=packed_tile, expect=expect)

    def explain(self, query, key, value, options: dict[str, Any], a2a: int | None) -> Plan:
        """The plan of the call, with what the layout moves and the padding in its reason."""
        check_arrays(query, key, value)
        padding = self._padding(query, key, options)
        planned_ = planned(padding, query, key, value, options, layout=self.layout)
        split = self.split(query, key)
        decision = self.plan(*planned_, a2a, split=split, expect=True)
        tile = self.rows_tile(query, key, value, options, split) if decision.packed_default else None
        if tile is not None:
            decision = self.plan(*planned_, a2a, packed_tile=tile, split=split, expect=True)
        size, _ = self.sizes()
        moved = sharded.describe(self._how(split), self.axis_name, padding.q_to // size, size, padding.kv_to // size)
        notes = ([DOCUMENTS_NOTE] if self.layout == DOCUMENTS else []) + self._replicated(split) + (
            [padding.describe()] if padding.needed else []) + [moved]
        return dataclasses.replace(decision, reason="; ".join([decision.reason, *notes]))

    def _other_axes(self) -> tuple:
        """The mesh's axes other than the sequence's, in the mesh's order."""
        names = layouts.sequence_axes(self.axis_name)
        return tuple(n for n in self.mesh.axis_names if n not in names)

    def _replicated(self, split: sharded.Split) -> list[str]:
        """The note, for `explain()`, that every device along the mesh's other axes runs the same ring, where
        it holds the whole batch and every head."""
        others = self._other_axes()
        if not others or split != sharded.Split():
            return []
        return [f"batch and heads replicated over {', '.join(map(repr, others))}: every device along "
                f"{'them' if len(others) > 1 else 'it'} runs the same ring"]

    def rows_tile(self, query, key, value, options: dict[str, Any], split: sharded.Split | None = None
                  ) -> int | None:
        """The tile the rows of these global arrays (values, in this process) choose, where a documents
        layout call with nothing tuned and no packing declared takes it from its rows; else None (then,
        under a trace, the rows choose in the step). `split`: `self.split(query, key)`, where known."""
        if self.layout != DOCUMENTS or self.laid_out or self.packing is not None:
            return None
        if options.get("q_segment_ids") is None:
            return None
        leaves = [x for x in jax.tree.leaves((query, key, value, options)) if hasattr(x, "shape")]
        if not all(isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer) for x in leaves):
            return None
        if not all(x.is_fully_addressable for x in leaves if isinstance(x, jax.Array)):
            return None  # rows other processes hold: chosen in the step, where every process sees them
        padding = self._padding(query, key, options)
        split = self.split(query, key) if split is None else split
        if not self.plan(*planned(padding, query, key, value, options, layout=self.layout), split=split).packed_default:
            return None  # tuned for this problem: its tiles are the cache's
        sequences = {name: options.get(name) for name in SEQUENCE_OPTIONS}
        index = _rows_tile_index(padding, self._rows_spec, self.sizes()[1], self.mesh, query, key, value, sequences)
        return documents.PACKED_TILES[int(index)]

    # ----------------------------------------------------------------------------------------------

    def _traced(self, query, key, value, *, split: sharded.Split, rows_tile: int | None = None, **options):
        padding = self._padding(query, key, options)
        if self.laid_out and padding.needed:
            raise ValueError(f"laid_out=True takes arrays already in the {self.layout} layout, of a length it splits "
                             f"over {self.sizes()[0]} devices: query length {query.shape[1]}, key length "
                             f"{key.shape[1]}; lay the batch out with tuner.layouts.lay_out_batch, which pads it")
        if self.laid_out and self.layout == DOCUMENTS and options.get("q_positions") is None:
            raise ValueError("laid_out=True with layout='documents' needs the positions the layout gave the tokens: "
                             "pass q_positions and kv_positions (tuner.layouts.lay_out_batch returns them)")
        query, key, value, options = padding.pad(query, key, value, options)
        rings, how = self._rings(query, key, value, options, rows_tile, split)
        result = sharded.run(rings, how, split, self.mesh, self.axis_name, query, key, value, options)
        return padding.strip(result, bool(options.get("return_lse")))

    def _jitted(self):
        """The call under `jax.jit`, for calls outside any trace: compiled once per shape (and per tile the
        rows choose), made again after a cache write in this process, so that the loader decides again as
        it does under the caller's own trace."""
        if self._compiled is None or self._compiled[0] != writes():
            self._compiled = (writes(), jax.jit(self._traced, static_argnames=STATIC))
        return self._compiled[1]

    def _padding(self, query, key, options: dict[str, Any]) -> Padding:
        size, _ = self.sizes()
        return Padding.of(query, key, options, devices=size, causal=self.causal,
                          layout="contiguous" if self.layout == DOCUMENTS else self.layout)

    def _how(self, split: sharded.Split, orders: tuple = (), branch_of: tuple = ()) -> sharded.Layout:
        automatic = not split.manual and bool(self._other_axes())
        return sharded.Layout(self.layout, self.sizes()[1], compile_target(self.mesh)[0], automatic, self.laid_out,
                              self._rows_spec, orders, branch_of)

    def _rings(self, query, key, value, options: dict[str, Any], rows_tile: int | None, split: sharded.Split):
        """(the rings the step may run, how their shards are laid out). A documents-layout call with nothing
        tuned and no packing declared (`Plan.packed_default`) takes its tile in the step: one ring per tile of
        `documents.PACKED_TILES` (a tile that changes nothing shares the longer one's), of which the rows pick
        one; where the rows were read before the trace, `rows_tile` is their choice, and that ring alone is
        compiled."""
        if self.layout != DOCUMENTS:
            return [self._local], self._how(split)
        _check_documents(query, key, options)
        shaped = with_positions(options, query, key)
        plans = {None: self.plan(query, key, value, shaped, split=split)}
        if plans[None].packed_default:
            tiles = documents.PACKED_TILES if rows_tile is None else (rows_tile,)
            plans = {tile: self.plan(query, key, value, shaped, packed_tile=tile, split=split) for tile in tiles}
        configs, rings, orders, branch_of = [], [], [], []
        size, ring = self.sizes()
        for tile, plan_ in plans.items():
            if plan_.config not in configs:
                configs.append(plan_.config)
                rings.append(functools.partial(self._local, packed_tile=tile))
                tiles = registry.forward_tiles(plan_.config) or (documents.DEFAULT_TILE,) * 2
                orders.append(functools.partial(layouts.document_order, ring_size=ring, causal=self.causal,
                                                window=self.window, tile=tiles))
            branch_of.append(configs.index(plan_.config))
        return rings, self._how(split, tuple(orders), tuple(branch_of))


def check_arguments(mesh: Mesh | None, axis_name: Hashable, layout: str | None, laid_out: bool) -> None:
    """`ValueError` naming the argument, where the loader's `mesh`, `axis_name`, `layout` and `laid_out` do not
    make a call on global arrays (or, without `mesh`, ask for one)."""
    check_bool("laid_out", laid_out)
    if laid_out and mesh is None:
        raise ValueError("laid_out=True says the global arrays given with mesh= are already laid out: pass mesh=; "
                         "on local shards, pass layout= instead")
    if laid_out and layout is None:
        raise ValueError("laid_out=True needs the layout the arrays are in: pass layout= (as given to "
                         "tuner.layouts.lay_out_batch)")
    if layout == DOCUMENTS and mesh is None:
        raise ValueError("layout='documents' lays out global arrays: pass mesh= and call attn on arrays in token "
                         "order; on local shards, lay them out with tuner.layouts.lay_out_batch and pass "
                         "layout='contiguous' with the positions it gives")
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    names = layouts.sequence_axes(axis_name)
    if any(name is None or name not in mesh.shape for name in names):
        raise ValueError(f"with mesh=, axis_name must name {'two' if len(names) > 1 else 'one'} of its "
                         f"axes {tuple(mesh.shape)}, got {axis_name!r}")


def local_shape(x, size: int, name: str, axis: int = 1) -> jax.ShapeDtypeStruct:
    """One device's shard of the global `x`, split over `size` devices along its sequence `axis`."""
    if x.shape[axis] % size:
        raise ValueError(f"{name} length {x.shape[axis]} is not divisible by the ring size {size}")
    shape = list(x.shape)
    shape[axis] //= size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


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


def shards(query, key, value, options: dict[str, Any], size: int, split: sharded.Split, mesh: Mesh):
    """What one device of `size` along the sequence holds of global arrays of lengths they divide: `(query,
    key, value, options)` as `jax.ShapeDtypeStruct`s (a bias is sharded over its query axis only); the batch
    and heads split over the mesh's other axes as `split` says."""
    query, key, value = (local_shape(x, size, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    options = {n: local_shape(x, size, n) if n in SEQUENCE_OPTIONS and x is not None else x for n, x in options.items()}
    if options.get("bias") is not None and options["bias"].shape[2] > 1:
        options["bias"] = local_shape(options["bias"], size, "bias", axis=2)
    def divided(x, heads):
        shape = list(x.shape)
        shape[0] = split.shard(mesh, shape[0], split.batch) if shape[0] > 1 else 1
        if heads is not None and len(shape) > 2:
            shape[2] = split.shard(mesh, shape[2], heads)
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    query, key, value = divided(query, split.q_heads), divided(key, split.kv_heads), divided(value, split.kv_heads)
    options = {n: divided(x, None) if n in SEQUENCE_OPTIONS and x is not None else x for n, x in options.items()}
    return query, key, value, options


def _spec(x, mesh: Mesh) -> P | None:
    """The `PartitionSpec` of `x` over `mesh`, padded to its rank, where it has one to read: an array's or a
    `jax.ShapeDtypeStruct`'s sharding, or a traced array's over explicit mesh axes; else None."""
    sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    axes = getattr(getattr(sharding, "mesh", None), "axis_names", None)
    if spec is None or axes is None or set(axes) != set(mesh.axis_names):
        return None
    if isinstance(x, jax.core.Tracer) and not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
        return None
    return P(*spec, *([None] * (len(x.shape) - len(spec))))


def _entry(spec: P, dim: int, sequence: set) -> Any:
    """The mesh axes `spec` gives dimension `dim`, unless they include a sequence axis (then None: the
    layout's `shard_map` takes the sequence axes for the sequence)."""
    entry = spec[dim]
    names = entry if isinstance(entry, tuple) else (entry,)
    return None if entry is None or set(names) & sequence else entry


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _rows_tile_index(padding: Padding, spec: AttentionSpec, ring: int, mesh: Mesh, query, key, value, sequences):
    """`documents.rows_tile_choice` of the padded query segment ids (the padding of q, k, v is never
    computed: only the ids are returned from). The ids are replicated first (4 bytes a token, as the
    documents plan gathers them anyway): the choice compares every chunk of a row with every other, which
    explicit sharding refuses to shard twice over one axis."""
    segments = padding.pad(query, key, value, sequences)[3]["q_segment_ids"]
    segments = jax.sharding.reshard(segments, NamedSharding(mesh, P()))
    return documents.rows_tile_choice(segments, spec, ring)


def _check_documents(query, key, options: dict[str, Any]) -> None:
    if options.get("q_segment_ids") is None:
        raise ValueError("layout='documents' lays out each row from its documents: pass q_segment_ids (and "
                         "kv_segment_ids, or the same ids for both)")
    if query.shape[1] != key.shape[1]:
        raise ValueError(f"layout='documents' lays out queries and keys alike, so they need one length: query "
                         f"length {query.shape[1]}, key length {key.shape[1]}")


__all__ = ["DOCUMENTS_NOTE", "GlobalCall", "check_arguments", "local_shape", "planned", "shards", "with_positions"]
