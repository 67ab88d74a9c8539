"""Laying a sharded sequence out inside `shard_map`, without gathering it.

Arrays come in sharded evenly over the sequence axes in token order: device `d` holds tokens
`[d*T_l, (d+1)*T_l)`, the contiguous layout. `Move.lay_out` sends every token to the device and slot its
layout gives it; `Move.restore` sends it back. Each device only ever holds its own shard and the one
buffer in flight, and each token travels once:

- `contiguous`: nothing moves;
- `zigzag` over one axis: each device's two half-shards go where they belong, two `ppermute`s;
- `striped` over one axis (where `P` divides the shard): one `all_to_all`;
- anything else (the documents layout of packed rows, a fixed layout over two axes or a shard `P` does
  not divide): a permutation of the whole row, known to every device (its `order [B or 1, T]`, 4 bytes
  a token), carried out by one `ragged_all_to_all` where the platform has it (TPU, GPU); XLA:CPU has
  none, so there `P - 1` `ppermute` rounds each send one shard-sized buffer to the device that many
  places on (`ROTATION`: every token still moves once, the buffer carries the padding).

Both directions are differentiable; the gradient of a move is the opposite move.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from tuner.semantics.layouts import global_order

RAGGED = "ragged_all_to_all"
ROTATION = "rotation"
METHODS = (RAGGED, ROTATION)


def method_for(platform: str) -> str:
    """How a permutation moves on `platform`: one ragged all-to-all, except on XLA:CPU, which has none."""
    return ROTATION if platform == "cpu" else RAGGED


@dataclass(frozen=True)
class Move:
    """The move of this device's shards between token order and a layout, inside `shard_map` over `axes`
    (one mesh axis, or the pair a call over two axes shards the sequence over, ring axis outer).

    `how` names the collectives (`contiguous`, `zigzag`, `striped`, `permutation`); a permutation holds the
    laid-out row's token indices `order` and their inverse `slots`, every row's (`[B, T]`) or one for all
    (`[1, T]`)."""

    how: str
    axes: Hashable
    order: jax.Array | None = None
    slots: jax.Array | None = None
    method: str = ROTATION

    def lay_out(self, x, axis: int = 1):
        """This device's shard of `x` (sequence `axis`) in token order -> its shard in the layout."""
        return self._move(x, axis, forward=True)

    def restore(self, x, axis: int = 1):
        """The inverse of `lay_out`: this device's laid-out shard of `x` -> its shard in token order."""
        return self._move(x, axis, forward=False)

    def describe(self) -> str:
        """The collectives, for `explain()`."""
        return {"contiguous": "nothing moves",
                "zigzag": "two collective permutes of half a shard each way",
                "striped": "one all-to-all each way",
                "permutation": f"one {self.method} each way" if self.method == RAGGED else
                f"{ROTATION}: P-1 collective permutes of one shard each way (XLA:CPU has no ragged all-to-all)",
                }[self.how]

    def _move(self, x, axis: int, forward: bool):
        if self.how == "contiguous":
            return x
        x = jnp.moveaxis(x, axis, 1)
        if self.how == "permutation":
            dest, source = (self.slots, self.order) if forward else (self.order, self.slots)
            x = _permute(x, dest, source, self.axes, self.method)
        else:
            x = _fixed(x, self.how, self.axes, forward)
        return jnp.moveaxis(x, 1, axis)


def fixed(layout: str, axes: Hashable, local_length: int, devices: int, *, method: str) -> Move:
    """The move of a fixed layout: its own collectives over one axis, else the general permutation."""
    if layout == "contiguous" or devices == 1:
        return Move("contiguous", axes)
    one_axis = not isinstance(axes, tuple)
    if one_axis and layout == "zigzag":
        return Move("zigzag", axes)
    if one_axis and layout == "striped" and local_length % devices == 0:
        return Move("striped", axes)
    order = global_order(layout, local_length * devices, devices if one_axis else _ring_size(axes))
    return permutation(jnp.asarray(order[None], jnp.int32), axes, method=method)


def permutation(order, axes: Hashable, *, method: str) -> Move:
    """The move that puts global token `order[b, s]` at laid-out slot `s` of row `b` (`order` int32
    `[B or 1, T]`, the same on every device)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    slots = jnp.argsort(order, axis=-1).astype(jnp.int32)
    return Move("permutation", axes, order, slots, method)


def _ring_size(axes: tuple) -> int:
    return lax.axis_size(axes[0])


# ------------------------------------------------------------------------------------------------
# zigzag and striped over one axis


def _fixed(x, layout: str, axis_name: Hashable, forward: bool):
    """`x [B, T_l, ...]` moved between token order and `layout` by that layout's own collectives."""
    size = lax.axis_size(axis_name)
    return (_zigzag if layout == "zigzag" else _striped)(x, axis_name, size, forward)


def _zigzag_home(chunk: int, size: int) -> int:
    """The device that holds half-chunk `chunk` (of 2P) in the zigzag layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _zigzag(x, axis_name: Hashable, size: int, forward: bool):
    """Device r holds half-chunks 2r and 2r+1 in token order and r, 2P-1-r in zigzag. The even half-chunks
    form one permutation of the devices, the odd ones another; a device keeps the half-chunk of its own
    parity first (half-chunk r)."""
    even = [(r, _zigzag_home(2 * r, size)) for r in range(size)]
    odd = [(r, _zigzag_home(2 * r + 1, size)) for r in range(size)]
    first, second = jnp.split(x, 2, axis=1)
    parity_even = lax.axis_index(axis_name) % 2 == 0
    if forward:
        from_even, from_odd = lax.ppermute(first, axis_name, even), lax.ppermute(second, axis_name, odd)
        return jnp.concatenate([jnp.where(parity_even, from_even, from_odd),
                                jnp.where(parity_even, from_odd, from_even)], axis=1)
    evens, odds = jnp.where(parity_even, first, second), jnp.where(parity_even, second, first)
    back = [(b, a) for a, b in even], [(b, a) for a, b in odd]
    return jnp.concatenate([lax.ppermute(evens, axis_name, back[0]), lax.ppermute(odds, axis_name, back[1])], axis=1)


def _striped(x, axis_name: Hashable, size: int, forward: bool):
    """Token t lives on device t mod P: token order `[T_l/P, P]` on each device is dealt by its second
    index; the striped shard is `[P sources, T_l/P]`."""
    batch, length, rest = x.shape[0], x.shape[1], x.shape[2:]
    if forward:
        y = x.reshape(batch, length // size, size, *rest)
        y = lax.all_to_all(y, axis_name, split_axis=2, concat_axis=1, tiled=True)
        return y.reshape(batch, length, *rest)
    y = x.reshape(batch, size, length // size, *rest)
    y = lax.all_to_all(y, axis_name, split_axis=1, concat_axis=1, tiled=True)
    return jnp.swapaxes(y, 1, 2).reshape(batch, length, *rest)


# ------------------------------------------------------------------------------------------------
# any permutation of the rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _permute(x, dest, source, axes: Hashable, method: str):
    """`x [B, T_l, ...]`, this device's shard of a space split evenly over the devices of `axes`, sent to
    the other space: global index `t` of the first lands at `dest[b, t]` of the second; `source` is the
    inverse of `dest`. Only the shards move; `dest` and `source` are every device's."""
    devices, me = lax.axis_size(axes), lax.axis_index(axes)
    batch, length = x.shape[:2]
    flat = x.reshape(batch * length, *x.shape[2:])
    mine = _rows(lax.dynamic_slice_in_dim(dest, me * length, length, axis=1), batch)  # where my tokens go
    wanted = _rows(lax.dynamic_slice_in_dim(source, me * length, length, axis=1), batch)  # what my slots hold
    to_device, to_slot = mine // length, mine % length
    from_device = wanted // length
    row = lax.broadcasted_iota(jnp.int32, (batch, length), 0) * length
    if method == RAGGED:
        counts = _counts(dest, batch, length, devices)
        send = jnp.argsort((to_device * batch * length + row + to_slot).ravel())
        arrival = jnp.argsort((from_device * batch * length + row + lax.iota(jnp.int32, length)).ravel())
        mine_counts, into = counts[me], counts[:, me]
        moved = lax.ragged_all_to_all(flat[send], jnp.zeros_like(flat), _starts(mine_counts), mine_counts,
                                      _starts(counts, axis=0)[me], into, axis_name=axes)
        return moved[_inverse(arrival)].reshape(x.shape)
    out = jnp.zeros_like(flat)
    slot_keys = (row + lax.iota(jnp.int32, length)).ravel()
    for shift in range(devices):
        going = (to_device == (me + shift) % devices).ravel()
        buffer = flat[jnp.argsort(jnp.where(going, (row + to_slot).ravel(), batch * length + slot_keys))]
        if shift:
            buffer = lax.ppermute(buffer, axes, [(d, (d + shift) % devices) for d in range(devices)])
        coming = (from_device == (me - shift) % devices).ravel()  # they arrive in slot order
        out = jnp.where(_expand(coming, out.ndim), buffer[jnp.cumsum(coming) - 1], out)
    return out.reshape(x.shape)


def _permute_forward(x, dest, source, axes, method):
    return _permute(x, dest, source, axes, method), (dest, source)


def _permute_backward(axes, method, residuals, cotangent):
    dest, source = residuals
    return _permute(cotangent, source, dest, axes, method), None, None


_permute.defvjp(_permute_forward, _permute_backward)


def _rows(x, batch: int):
    return jnp.broadcast_to(x, (batch, x.shape[1]))


def _expand(mask, ndim: int):
    return mask.reshape(mask.shape + (1,) * (ndim - 1))


def _counts(dest, batch: int, length: int, devices: int):
    """`[P, P]`: how many tokens device s sends device d (every row's, summed)."""
    source = (lax.iota(jnp.int32, dest.shape[1]) // length)[None]
    pairs = (source * devices + dest // length).ravel()
    counts = jnp.zeros(devices * devices, jnp.int32).at[pairs].add(1).reshape(devices, devices)
    return counts * (batch // dest.shape[0])


def _starts(counts, axis: int = -1):
    """Exclusive running sums of `counts` along `axis`: where each part starts."""
    return jnp.cumsum(counts, axis=axis) - counts


def _inverse(permutation):
    return jnp.zeros_like(permutation).at[permutation].set(lax.iota(permutation.dtype, permutation.shape[0]))


__all__ = ["METHODS", "Move", "RAGGED", "ROTATION", "fixed", "method_for", "permutation"]
