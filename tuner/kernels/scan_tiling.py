"""The scan kernel's operands, tiled: the sequence padded to whole tiles and cut into them in place.

`Operands` holds the inputs of one block call so tiled, answers the mask questions of a tile pair, and
turns tiled results back into the caller's shapes. `tuner.kernels.scan_kernel` runs its tile loops over
them.

Keys and values come heads-major, `[B, Hkv, T, D]` (`heads_major`): the layout in which they travel the
ring, made once a ring (`ScanBackend.keys_start`), so that a key tile is a slice of whole rows, read as
XLA:CPU's matmuls take it, however often the loops visit it. The query side (q, the output's cotangent)
stays in the caller's layout and is cut by a reshape, `[B, n, blk, Hkv, G, D]` (tile index second,
queries grouped by kv head): no array of a shard's size is made beside the caller's; a query tile is
moved to `[B, Hkv, G, blk, D]` when read, once per query tile, since the loops run query tile by query
tile. Positions, segment ids and row statistics (a few bytes a token) are tiled with the tile index
first. Only a length that is not a multiple of the tile pads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tuner.semantics import masks
from tuner.semantics.padding import pad_to
from tuner.semantics.spec import AttentionSpec
from tuner.support import vma


def _split(x, axis: int, block: int):
    """`[..., n*block, ...]` -> `[n, ..., block, ...]` (tile index first)."""
    n = x.shape[axis] // block
    x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _merge(x, axis: int):
    """Inverse of `_split`: `[n, ..., block, ...]` -> `[..., n*block, ...]`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _cut(x, block: int):
    """`[B, n*block, ...]` -> `[B, n, block, ...]`: tiles along the sequence, a reshape."""
    return x.reshape((x.shape[0], x.shape[1] // block, block) + x.shape[2:])


def _join(x, length: int):
    """Inverse of `_cut`, the padding dropped: `[B, n, block, ...]` -> `[B, length, ...]`."""
    x = x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
    return x if x.shape[1] == length else x[:, :length]


def untile_query(x, q_len: int):
    """`[B, nq, bq, Hkv, G, D]` query-side tiles -> `[B, q_len, H, D]`."""
    b, _, _, hkv, g, d = x.shape
    return _join(x, q_len).reshape(b, q_len, hkv * g, d)


def untile_row_stat(x, q_len: int):
    """`[nq, B, Hkv, G, bq]` row-statistic tiles -> `[B, H, q_len]`."""
    x = _merge(x, 3)[..., :q_len]
    b, hkv, g, t = x.shape
    return x.reshape(b, hkv * g, t)


def heads_major(x):
    """Keys or values `[B, T, Hkv, D]` -> `[B, Hkv, T, D]`, as the kernel reads them (and back, `caller_major`)."""
    return jnp.moveaxis(x, 2, 1)


def caller_major(x):
    """`[B, Hkv, T, D]` -> `[B, T, Hkv, D]`: a key-side array back in the caller's layout."""
    return jnp.moveaxis(x, 1, 2)


def tile(x, index):
    """Tile `index` of a `[B, n, block, ...]` array: `[B, block, ...]`."""
    return lax.dynamic_index_in_dim(x, index, axis=1, keepdims=False)


def widened() -> bool:
    """On the CPU, matmuls of 16-bit operands run in float32: XLA:CPU cannot execute some
    bf16 x bf16 -> f32 dots ("Unsupported element type for DotThunk"), and there is no 16-bit matmul
    unit to gain speed from. Elsewhere they run in the input dtype, accumulating in float32."""
    return jax.default_backend() == "cpu"


@dataclass(frozen=True)
class Stored:
    """An input as the tile loops read it, in its own dtype.

    Where matmuls are widened (the CPU), a 16-bit float array is kept viewed as uint16: XLA:CPU takes
    a 16-bit float slice in float32 and hoists the widening of the whole array out of the tile loop, a
    float32 copy of the array beside it; an integer slice it takes as it is, and only the tile widens."""

    data: Any
    dtype: Any

    @classmethod
    def of(cls, x, *args):
        if widened() and jnp.dtype(x.dtype).itemsize == 2:
            return cls(lax.bitcast_convert_type(x, jnp.uint16), x.dtype, *args)
        return cls(x, x.dtype, *args)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def _typed(self, x):
        return x if x.dtype == self.dtype else lax.bitcast_convert_type(x, self.dtype)


@dataclass(frozen=True)
class QueryTiles(Stored):
    """A query-side input (q, the output's cotangent) cut into tiles, `[B, n, blk, Hkv, G, D]`."""

    def __getitem__(self, index):
        """Tile `index` with its rows after the heads, `[B, Hkv, G, blk, D]`, the layout XLA:CPU's matmuls
        take as they are (a tile's copy, against a slow path for rows before the heads)."""
        return self._typed(jnp.moveaxis(tile(self.data, index), 1, -2))


@dataclass(frozen=True)
class KeyTiles(Stored):
    """Keys or values heads-major, `[B, Hkv, n*blk, D]`, read `block` rows at a time."""

    block: int

    def __getitem__(self, index):
        """Tile `index`, `[B, Hkv, blk, D]`: a slice of whole rows."""
        return self._typed(lax.dynamic_slice_in_dim(self.data, index * self.block, self.block, axis=2))


def add_key_tile(x, value, index, block: int):
    """`x` (`[B, Hkv, n*block, D]`) with `value` added to its tile `index`, in place."""
    start = index * block
    return lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, start, block, axis=2) + value, start,
                                           axis=2)


def set_tile(x, value, index):
    """`x` with tile `index` (`[B, block, ...]`) replaced by `value`, in place."""
    return lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), index, axis=1)


@dataclass(frozen=True)
class Tiling:
    """Tile sizes and counts of one block call (tiles never longer than the sequence)."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    @classmethod
    def make(cls, q_len: int, kv_len: int, block_q: int, block_kv: int) -> Tiling:
        return cls(q_len, kv_len, min(block_q, q_len), min(block_kv, kv_len))

    @property
    def num_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def num_kv(self) -> int:
        return -(-self.kv_len // self.block_kv)

    @property
    def kv_padded(self) -> bool:
        return self.num_kv * self.block_kv != self.kv_len


class Operands:
    """The inputs of one block call, tiled: q `[B, nq, bq, Hkv, G, D]`; k and v, which come heads-major
    (`[B, Hkv, Tk, D]`), `[B, Hkv, nk*bk, D]`; positions, segment ids and row statistics
    `[nq|nk, B, ...]`."""

    def __init__(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, tiling: Tiling, num_heads: int):
        h, hkv = q.shape[2], k.shape[1]
        self.tiling = tiling
        self.group = h // hkv
        tq, tk = tiling.num_q * tiling.block_q, tiling.num_kv * tiling.block_kv

        self.positions_and_segments = (q_pos, kv_pos, q_seg, kv_seg)
        self.q = self.query_side(q)
        self.k = KeyTiles.of(pad_to(k, 2, tk), tiling.block_kv)  # [B,Hkv,nk*bk,D]
        self.v = KeyTiles.of(pad_to(v, 2, tk), tiling.block_kv)
        self.q_pos = _split(pad_to(q_pos, 1, tq, "edge"), 1, tiling.block_q)  # [nq,B,bq]
        self.kv_pos = _split(pad_to(kv_pos, 1, tk, "edge"), 1, tiling.block_kv)  # [nk,B,bk]
        self.q_seg = None if q_seg is None else _split(pad_to(q_seg, 1, tq, "edge"), 1, tiling.block_q)
        self.kv_seg = None if kv_seg is None else _split(pad_to(kv_seg, 1, tk, "edge"), 1,
                                                         tiling.block_kv)
        self.kv_valid = _split(jnp.arange(tk) < tiling.kv_len, 0, tiling.block_kv)  # [nk,bk]

        self.bias = None
        self.bias_shape = None if bias is None else bias.shape
        if bias is not None:
            bb, bh, bq, bk = bias.shape
            heads = (hkv, self.group) if bh == num_heads else (1, 1)
            grouped = bias.reshape((bb,) + heads + (bq, bk))
            self.bias_q_tiled, self.bias_kv_tiled = bq > 1, bk > 1
            if self.bias_kv_tiled:
                grouped = _split(pad_to(grouped, 4, tk), 4, tiling.block_kv)
            else:
                grouped = grouped[None]
            if self.bias_q_tiled:
                grouped = _split(pad_to(grouped, 4, tq), 4, tiling.block_q)
            else:
                grouped = grouped[None]
            self.bias = grouped  # [nq|1, nk|1, Bb, Hkv|1, G|1, bq|1, bk|1]

    def tile_query(self, x):
        """`[B, T, H, D]` -> `[B, nq, bq, Hkv, G, D]` tiles (pads with zeros)."""
        b, t, h, d = x.shape
        x = pad_to(x, 1, self.tiling.num_q * self.tiling.block_q)
        return _cut(x.reshape(b, x.shape[1], h // self.group, self.group, d), self.tiling.block_q)

    def query_side(self, x) -> QueryTiles:
        """A query-side input (q, the output's cotangent) as `tile_query` tiles it."""
        return QueryTiles.of(self.tile_query(x))

    def row_stat(self, x, pad_value: float):
        """`[B, H, T]` row statistic -> `[nq, B, Hkv, G, bq]` tiles."""
        b, h, t = x.shape
        x = x.reshape(b, h // self.group, self.group, t)
        return _split(pad_to(x, 3, self.tiling.num_q * self.tiling.block_q, value=pad_value), 3,
                      self.tiling.block_q)

    def untile_query(self, x):
        """Inverse of `query_side`: `[B, nq, bq, Hkv, G, D]` tiles -> `[B, Tq, H, D]`."""
        return untile_query(x, self.tiling.q_len)

    def untile_row_stat(self, x):
        """Inverse of `row_stat`: `[nq, B, Hkv, G, bq]` tiles -> `[B, H, Tq]`."""
        return untile_row_stat(x, self.tiling.q_len)

    def untile_key(self, x):
        """`[B, Hkv, nk*bk, D]` (a key-side gradient) -> `[B, Hkv, Tk, D]`, the padding dropped."""
        return x if x.shape[2] == self.tiling.kv_len else x[:, :, :self.tiling.kv_len]

    def untile_bias(self, x):
        """Inverse of the bias tiling: `[nq|1, nk|1, Bb, Hkv|1, G|1, bq|1, bk|1]` -> the bias's own shape."""
        x = _merge(x, 4) if self.bias_q_tiled else x[0]
        x = _merge(x, 4) if self.bias_kv_tiled else x[0]
        bq, bk = self.bias_shape[2:]
        return x[..., :bq, :bk].reshape(self.bias_shape)

    def bias_index(self, i, j):
        return (i if self.bias_q_tiled else 0, j if self.bias_kv_tiled else 0)

    def bias_tile(self, i, j):
        if self.bias is None:
            return None
        return self.bias[self.bias_index(i, j)]

    def segments(self, i, j):
        """Segment ids of query tile i and key tile j (None, None without segments)."""
        if self.q_seg is None:
            return None, None
        return self.q_seg[i], self.kv_seg[j]

    def visits(self, spec: AttentionSpec):
        """int32 `[nq, nk]`, per tile pair: 0 when the masks exclude every pair of it (skipped), 1 when
        they exclude none, 2 when some (the mask is built). The rule is `masks.tile_pairs`'s, from the
        tiles' position and segment ranges, on every batch row."""
        if not spec.has_mask:
            return jnp.ones((self.tiling.num_q, self.tiling.num_kv), jnp.int32)
        possible, every = masks.tile_pairs(*self.positions_and_segments, spec, self.tiling.block_q,
                                           self.tiling.block_kv)
        return jnp.where(possible.any(axis=0), jnp.where(every.all(axis=0), 1, 2), 0).astype(jnp.int32)

    def mask(self, spec: AttentionSpec, i, j, masked):
        """Bool `[B, 1, 1, bq, bk]` of readable pairs of tile (i, j), or None if all are readable.

        `masked` (a traced bool, or False) says whether the spec may exclude pairs of this tile: the
        spec's mask is built only then (under `lax.cond`), else only padding is masked.
        """
        mask = None
        if masked is not False:
            inputs = (self.q_pos[i], self.kv_pos[j], *self.segments(i, j))
            shape = (inputs[0].shape[0], inputs[0].shape[1], inputs[1].shape[1])

            def varying(x):  # the branches of a cond in shard_map vary over the same axes
                for reference in (r for r in inputs if r is not None):
                    x = vma.like(x, reference)
                return x

            mask = lax.cond(masked, lambda: varying(masks.allowed(*inputs, spec)),
                            lambda: varying(jnp.ones(shape, bool)))
        if self.tiling.kv_padded:
            valid = self.kv_valid[j][None, None, :]
            mask = valid if mask is None else mask & valid
        return None if mask is None else mask[:, None, None]
