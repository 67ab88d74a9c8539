"""How a global sequence is spread over a ring of P devices (DESIGN section 4).

A layout only decides which global token positions each device holds:

- `contiguous`: device r holds tokens [r*T, (r+1)*T) -- a causal ring leaves low ranks idle;
- `zigzag`: the sequence is cut into 2P chunks and device r holds chunks r and 2P-1-r -- every device
  gets one early and one late chunk, so causal work is balanced;
- `striped`: token t lives on device t mod P -- balanced at the tile level.

`lay_out` permutes a global array so that an even split along the sequence axis (what `shard_map`
does) hands every device its layout's tokens; `restore` undoes it. The attention itself only sees
positions, from `local_positions`.

`document_order` is the documents layout of packed rows (`tuner.semantics.documents`): one permutation
per batch row, computed from its segment ids, applied by `lay_out_rows` and undone by `restore_rows`,
with the token indices passed as positions.

`Padding` pads global arrays to a length a layout splits evenly (`padded_length`), with pad tokens no
query reads, and strips the result (`tuner.semantics.padding`).

`lay_out_batch` lays a whole training batch out once, in the data pipeline, for any layout: on the host
(NumPy) or on the devices (sharded over the ring, no array gathered: `tuner.semantics.moves`);
`restore_batch` undoes it. Attention then runs on the laid-out arrays with nothing to permute
(`get_tuned_ring_attention(..., laid_out=True)`), and the per-token loss does not care about the order.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tuner.semantics import documents, moves
from tuner.semantics.documents import DEFAULT_TILE, DOCUMENTS, lay_out_rows, restore_rows
from tuner.semantics.padding import Padding, padded_length
from tuner.support import arrays, axes, ordering, permutations, placement
from tuner.support.axes import sequence_axes
from tuner.support.checks import check_bool, check_int
from tuner.support.targets import compile_target
from tuner.semantics.spec import LAYOUTS, AttentionSpec, check_int_dtype, normalize_window


def check_layout(layout: str, local_length: int, *, name: str = "layout") -> None:
    """Raise `ValueError` if `layout` is unknown or cannot split a local length of `local_length`."""
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "zigzag" and local_length % 2:
        raise ValueError(
            f"the zigzag layout splits each device's tokens into two chunks, so the local sequence "
            f"length must be even, got {local_length}: pad the global sequence to "
            f"tuner.layouts.padded_length(length, devices, 'zigzag') tokens with tuner.layouts.Padding (the "
            f"loader with mesh= does it)"
        )


def global_order(layout: str, global_length: int, ring_size: int) -> np.ndarray:
    """Global token index held at each slot of the laid-out sequence (device-major order)."""
    ring_size = check_int("ring_size", ring_size, numeric=True)
    if global_length % ring_size:
        raise ValueError(f"the global length ({global_length}) must be a multiple of ring_size ({ring_size})")
    local = global_length // ring_size
    check_layout(layout, local)
    return np.concatenate([local_positions_np(layout, local, ring_size, r) for r in range(ring_size)])


def local_positions_np(layout: str, local_length: int, ring_size: int, rank: int) -> np.ndarray:
    """Global positions of the `local_length` tokens held by device `rank` (NumPy, for host code)."""
    t = np.arange(local_length)
    if layout == "contiguous":
        return rank * local_length + t
    if layout == "striped":
        return t * ring_size + rank
    half = local_length // 2
    first = rank * half + t[:half]
    second = (2 * ring_size - 1 - rank) * half + t[:half]
    return np.concatenate([first, second])


def local_positions(layout: str, local_length: int, ring_size: int, rank) -> jnp.ndarray:
    """Global positions (int32 `[local_length]`) of the tokens device `rank` holds; `rank` may be traced."""
    check_layout(layout, local_length)
    t = lax.iota(jnp.int32, local_length)
    if layout == "contiguous":
        return rank * local_length + t
    if layout == "striped":
        return t * ring_size + rank
    half = local_length // 2
    chunk = jnp.where(t < half, rank, 2 * ring_size - 1 - rank)
    return chunk * half + t % half


def check_axes(axis_name) -> tuple:
    """`axis_name` as a pair `(ring_axis, group_axis)` of two different mesh axes, the sharding of a call over
    two axes; `ValueError` naming it otherwise."""
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2 and None not in axis_name
            and axis_name[0] != axis_name[1]):
        raise ValueError(f"axis_name={axis_name!r}: a call over two mesh axes takes (ring_axis, group_axis), two "
                         f"different mesh axes (the layout over the first, each position's chunk cut over the second)")
    return axis_name


def grouped_positions(layout: str, length: int, axis_name: tuple) -> jnp.ndarray:
    """Global positions (int32 `[length]`) of this device's `length` tokens when the sequence is sharded over two
    axes `(ring_axis, group_axis)`, inside `shard_map` over both: its group index's cut of its ring position's
    chunk of `layout` (`PartitionSpec(None, (ring_axis, group_axis))`)."""
    ring_axis, group_axis = check_axes(axis_name)
    devices = axes.bound_size(axis_name)  # ring positions x groups; ValueError naming axis_name where unbound
    groups = lax.axis_size(group_axis)
    check_layout(layout, groups * length)
    chunk = local_positions(layout, groups * length, devices // groups, lax.axis_index(ring_axis))
    return lax.dynamic_slice_in_dim(chunk, lax.axis_index(group_axis) * length, length)


def lay_out(x, layout: str, ring_size: int, *, axis: int = 1):
    """Permute the sequence `axis` of a global array into the layout's device-major order."""
    return documents.permute(x, jnp.asarray(global_order(layout, x.shape[axis], ring_size)), axis)


def restore(x, layout: str, ring_size: int, *, axis: int = 1):
    """Inverse of `lay_out`: put the sequence `axis` back into natural token order."""
    order = global_order(layout, x.shape[axis], ring_size)
    return documents.permute(x, jnp.asarray(np.argsort(order)), axis)


def document_order(segment_ids, ring_size: int, *, causal: bool = True, window: tuple[int, int] | None = None,
                   tile: int | tuple[int, int] = DEFAULT_TILE):
    """The documents layout of packed rows `segment_ids [B, T]`: int32 `[B, T]`, the token index held at
    each slot of a laid-out row, device-major (device r holds slots `[r*T/P, (r+1)*T/P)`).

    Each row gets the layout, among the documents plan and the fixed layouts, whose busiest device
    computes the fewest logit tiles of size `tile` (the kernel's `(query, key)` tile; on rows of more than
    `documents.COUNTED_TILES` tiles, counted in that many coarser tiles to bound the cost) under the masks
    `causal` and `window` `(left, right)`. Lay the arrays out with `lay_out_rows(x, order)`, pass the order
    as `q_positions`/`kv_positions` (lay given positions out instead), and `restore_rows` the output.
    Works on traced segment ids inside `jax.jit`. NumPy in gives NumPy out, computed in NumPy on the host
    (no program compiled, no device used), for a data pipeline."""
    ring_size = check_int("ring_size", ring_size, numeric=True)
    check_bool("causal", causal)
    tiles = (tile, tile) if isinstance(tile, int) else tuple(tile)
    if len(tiles) != 2:
        raise ValueError(f"tile must be an int or a (query, key) pair of ints, got {tile!r}")
    for t in tiles:
        check_int("tile", t, numeric=True)
    if np.ndim(segment_ids) != 2:
        raise ValueError(f"segment_ids must be [batch, length], got shape {np.shape(segment_ids)}")
    check_int_dtype("segment_ids", segment_ids if hasattr(segment_ids, "dtype") else np.asarray(segment_ids))
    window = normalize_window(window, name="window")
    length = np.shape(segment_ids)[1]
    if length % ring_size:
        raise ValueError(f"segment_ids: the documents layout splits each row evenly, so its length ({length}) must "
                         f"be a multiple of ring_size ({ring_size})")
    spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
    if isinstance(segment_ids, np.ndarray):
        return _document_order(segment_ids.astype(np.int32), ring_size, spec, tiles)
    return _document_order_program(jnp.asarray(segment_ids, jnp.int32), ring_size, spec, tiles)


def _document_order(segment_ids, ring_size: int, spec: AttentionSpec, tiles: tuple[int, int]):
    """`document_order`'s choice, in the library of `segment_ids` (`tuner.support.arrays`)."""
    xp = arrays.namespace(segment_ids)
    length = segment_ids.shape[1]
    local = length // ring_size
    counted = tuple(max(t, -(-length // documents.COUNTED_TILES)) for t in tiles)  # coarser on long rows
    fixed = [global_order(name, length, ring_size) for name in LAYOUTS if name != "zigzag" or local % 2 == 0]
    fixed = xp.asarray(np.stack(fixed), xp.int32)
    chunk = documents.chunk_size(length, ring_size, tiles)

    def row_order(segments):
        candidates = xp.concatenate([fixed, documents.plan(segments, ring_size, spec, chunk)[None]])
        work = arrays.per_row(lambda order: documents.busiest(order, segments, ring_size, spec, counted), candidates)
        return candidates[xp.argmin(work)]  # ties: the first, a fixed layout

    return arrays.per_row(row_order, segment_ids)


# one compiled program per shape and masks (called eagerly, the plan's many small operations would each be
# dispatched, and compiled, apart)
_document_order_program = jax.jit(_document_order, static_argnums=(1, 2, 3))


def lay_out_batch(batch: Mapping[str, Any], ring_size: int, layout: str = DOCUMENTS, *,
                  segment_ids: str | None = "segment_ids", causal: bool = True, window: tuple[int, int] | None = None,
                  tile: int | tuple[int, int] = DEFAULT_TILE, mesh=None, axis_name: Hashable | None = None
                  ) -> tuple[dict[str, Any], Any]:
    """A training batch laid out for a ring of `ring_size` positions, once: `(laid_out, positions)`.

    Every array of `batch` (`[B, T, ...]` in token order: tokens, labels, loss weights, segment ids, your
    own positions; a value may be a pytree of them, as a nested mapping) has its axis 1 put in the
    layout's device-major order, as the loader would in every call; `positions [B, T]` int32 is the token
    index each slot now holds. Pass `positions` as `q_positions`/`kv_positions` (and to rotary embeddings)
    and the laid-out segment ids to attention made with `laid_out=True`. `layout` is a fixed layout or
    `"documents"`, planned per row from `batch[segment_ids]` for the masks `causal` and `window` and the
    kernel's `tile` (`document_order`).

    Without `mesh`, on the host: NumPy in, NumPy out (jax arrays work too, gathered where they are). With
    `mesh` and `axis_name` (its sequence axis, or the pair of a call over two axes), on the devices: the
    arrays sharded over `axis_name` along the sequence stay so, each device sending its tokens where they
    belong (`tuner.semantics.moves`); only the segment ids are gathered whole, for the plan."""
    ring_size = check_int("ring_size", ring_size, numeric=True)
    check_bool("causal", causal)
    if layout not in (*LAYOUTS, DOCUMENTS):
        raise ValueError(f"layout must be one of {', '.join((*LAYOUTS, DOCUMENTS))}, got {layout!r}")
    leaves, tree = _batch_leaves(batch)
    rows, length = np.shape(leaves[0])[:2]
    devices = ring_size if mesh is None else _mesh_devices(mesh, axis_name, ring_size)
    multiple = devices * (2 if layout == "zigzag" else 1)
    if length % multiple:
        raise ValueError(f"batch: the {layout} layout over {devices} devices needs a length that is a multiple of "
                         f"{multiple}, got {length}: pack rows of padded_length({length}, {devices}, {layout!r}) "
                         f"tokens")
    if layout == DOCUMENTS and (segment_ids is None or segment_ids not in batch or np.ndim(batch[segment_ids]) != 2):
        raise ValueError(f"segment_ids: the documents layout plans each row from its segment ids, but batch has no "
                         f"[B, T] array {segment_ids!r}: pass the key of its [B, T] segment ids")
    plan = functools.partial(_batch_order, layout=layout, ring_size=ring_size, causal=causal, window=window,
                             tile=tile)
    if mesh is None:
        order = plan(batch[segment_ids] if layout == DOCUMENTS else None, length)
        return tree.unflatten([_take_rows(x, order) for x in leaves]), _every_row(order, rows)
    ids = next(i for i, x in enumerate(leaves) if x is batch[segment_ids]) if layout == DOCUMENTS else None
    laid, positions = _lay_out_sharded(leaves, plan, mesh, axis_name, layout, ids)
    return tree.unflatten(laid), positions


def _batch_leaves(batch: Mapping[str, Any]) -> tuple[list[Any], Any]:
    """The arrays of `batch` (a mapping whose values are arrays or pytrees of arrays) and its tree structure;
    `ValueError` naming every leaf that is not `[B, T, ...]` with the first leaf's B and T."""
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(f"batch must be a mapping of arrays [B, T, ...] (pytrees of them allowed), got {batch!r:.80}")
    paths, tree = jax.tree_util.tree_flatten_with_path(dict(batch))
    for path, x in paths:
        if not hasattr(x, "shape"):
            raise ValueError(f"batch{jax.tree_util.keystr(path)} is of type {type(x).__name__}, not an array: "
                             f"every leaf of batch must be an array [B, T, ...] (a list is a tree of leaves to jax: "
                             f"np.asarray it)")
    shapes = {jax.tree_util.keystr(path): np.shape(x) for path, x in paths}
    first = next(iter(shapes.values()))
    if any(len(s) < 2 or len(first) < 2 or s[:2] != first[:2] for s in shapes.values()):
        raise ValueError(f"every array of batch must be [B, T, ...] with one B and T, got {shapes}")
    return [x for _, x in paths], tree


def _every_row(order, rows: int):
    """`order [B or 1, T]` as `[B, T]`: a fixed layout's one order given to every row, as attention takes
    positions."""
    if order.shape[0] == rows:
        return order
    if isinstance(order, np.ndarray):
        return np.repeat(order, rows, axis=0)
    return jnp.broadcast_to(order, (rows, order.shape[1]))


def restore_batch(batch: Mapping[str, Any], positions, *, mesh=None, axis_name: Hashable | None = None
                  ) -> dict[str, Any]:
    """`lay_out_batch` undone: every array of `batch` (`[B, T, ...]`, laid out) back in token order, from the
    `positions` it returned. With `mesh` and `axis_name`, on the devices, as `lay_out_batch` does."""
    leaves, tree = _batch_leaves(batch)
    shape, given = np.shape(leaves[0]), np.shape(positions)
    if len(given) != 2 or given[1] != shape[1] or given[0] not in (1, shape[0]):
        raise ValueError(f"positions must be [B, T] (or [1, T]) for the arrays of batch [B, T, ...] = "
                         f"{shape[:2]}, got {given}")
    if mesh is None:
        back = permutations.inverse(positions)
        return tree.unflatten([_take_rows(x, back) for x in leaves])
    return tree.unflatten(_restore_sharded(leaves, positions, mesh, axis_name))


def _batch_order(segment_ids, length: int, *, layout: str, ring_size: int, causal: bool, window, tile):
    """The laid-out rows' token indices: `[B, T]` for the documents layout, `[1, T]` for a fixed one."""
    if layout == DOCUMENTS:
        return document_order(segment_ids, ring_size, causal=causal, window=window, tile=tile)
    order = global_order(layout, length, ring_size)[None].astype(np.int32)
    return order if segment_ids is None or isinstance(segment_ids, np.ndarray) else jnp.asarray(order)


def _take_rows(x, order):
    """`x [B, T, ...]` with its axis 1 taken at `order [B or 1, T]`, row by row."""
    index = order.reshape(order.shape + (1,) * (np.ndim(x) - 2))
    if isinstance(x, np.ndarray) and isinstance(order, np.ndarray):
        return np.take_along_axis(x, np.broadcast_to(index, (x.shape[0], *index.shape[1:])), axis=1)
    index = jnp.broadcast_to(jnp.asarray(index), (x.shape[0], *index.shape[1:]))
    return jnp.take_along_axis(jnp.asarray(x), index, axis=1)


def _mesh_devices(mesh, axis_name, ring_size: int) -> int:
    names = sequence_axes(axis_name)
    if axis_name is None or any(n not in mesh.shape for n in names):
        raise ValueError(f"with mesh=, axis_name must name the sequence's mesh axis (or the pair of a call over two "
                         f"axes) among {tuple(mesh.shape)}, got {axis_name!r}")
    if mesh.shape[names[0]] != ring_size:
        raise ValueError(f"ring_size={ring_size} does not match mesh axis {names[0]!r} of size {mesh.shape[names[0]]}")
    return int(np.prod([mesh.shape[n] for n in names]))


def _on_devices(body, mesh, axis_name, arrays: dict, *extra):
    """`body(move_of, arrays, *extra)` inside `shard_map` over the sequence axes of `mesh` (the other axes
    left to XLA's partitioner), every array sharded over `axis_name` along its axis 1, and so its results.
    `move_of(order)` is the move of the permutation `order [B or 1, T]` on this mesh."""
    names = set(sequence_axes(axis_name))
    platform, other_axes = compile_target(mesh)[0], bool(set(mesh.axis_names) - names)
    seq = jax.sharding.PartitionSpec(None, axis_name)

    def move_of(order, layout: str = DOCUMENTS, shard: int = 0):
        if layout == DOCUMENTS:
            return moves.permutation(order, axis_name, platform=platform, other_axes=other_axes)
        return moves.fixed(layout, axis_name, shard, lax.axis_size(axis_name), order, platform=platform,
                           other_axes=other_axes)

    in_specs = ([seq] * len(arrays), *(seq,) * len(extra))
    args = placement.for_shard_map(mesh, names, (arrays, *extra), in_specs)
    return jax.shard_map(functools.partial(body, move_of), mesh=mesh, in_specs=in_specs, out_specs=seq,
                         axis_names=names)(*args)


def _lay_out_sharded(arrays: list, plan, mesh, axis_name, layout: str, segment_ids: int | None):
    """The laid-out `arrays` and the positions; `segment_ids`: the index of the segment ids among them."""
    def body(move_of, arrays):
        shard = arrays[0].shape[1]
        total = shard * lax.axis_size(axis_name)
        rows = None
        if layout == DOCUMENTS:  # the plan reads whole rows of segment ids: 4 bytes a token
            rows = lax.all_gather(arrays[segment_ids], axis_name, axis=1, tiled=True)
        order = jnp.asarray(plan(rows, total))
        move = move_of(order, layout, shard)
        mine = lax.dynamic_slice_in_dim(order, lax.axis_index(axis_name) * shard, shard, axis=1)
        positions = jnp.broadcast_to(mine, (arrays[0].shape[0], shard)).astype(jnp.int32)
        return ordering.in_order(move.lay_out, arrays), positions

    return _on_devices(body, mesh, axis_name, arrays)


def _restore_sharded(arrays: list, positions, mesh, axis_name):
    def body(move_of, arrays, positions):
        move = move_of(lax.all_gather(positions, axis_name, axis=1, tiled=True))  # 4 bytes a token
        return ordering.in_order(move.restore, arrays)

    return _on_devices(body, mesh, axis_name, arrays, jnp.asarray(positions, jnp.int32))


__all__ = ["DOCUMENTS", "LAYOUTS", "Padding", "check_axes", "check_layout", "document_order", "global_order",
           "grouped_positions", "lay_out", "lay_out_batch", "lay_out_rows", "local_positions", "local_positions_np",
           "padded_length", "restore", "restore_batch", "restore_rows", "sequence_axes"]
