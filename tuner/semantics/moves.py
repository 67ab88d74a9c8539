"""Laying a sharded sequence out inside `shard_map`, without gathering it.

Arrays come in sharded evenly over the sequence axes in token order: device `d` holds tokens
`[d*T_l, (d+1)*T_l)`, the contiguous layout. `Move.lay_out` sends every token to the device and slot its
layout gives it; `Move.restore` sends it back. Each device only ever holds its own shard and the one
buffer in flight, and with one collective each token travels once:

- `contiguous`: nothing moves;
- `zigzag` over one axis: each device's two half-shards go where they belong, two `ppermute`s;
- `striped` over one axis (where `P` divides the shard): one `all_to_all`;
- anything else (the documents layout of packed rows, a fixed layout over two axes or a shard `P` does
  not divide): a permutation of the whole row, known to every device (its `order [B or 1, T]`, 4 bytes
  a token), carried out by one `ragged_all_to_all` where the platform has it (TPU, GPU).

XLA:CPU has no ragged all-to-all, and where the mesh has axes left to XLA's partitioner (automatic, not
manual in the `shard_map`) it gathers their shards around an all-to-all. There (`ROTATION`) a permutation
passes each device's shard around the ring, as the ring attention passes keys: `P - 1` rounds of a
`ppermute` to the next device, in a loop, each device keeping the tokens that belong to it as the shards
go by (one shard in flight, `P - 1` shards sent by each device; the program holds one round, whatever
`P`). The striped layout sends in round s, to the device s places on, the 1/P of a shard that belongs
there.

Both directions are differentiable; the gradient of a move is the opposite move. On the CPU each
collective waits for the one before it (`tuner.support.ordering`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tuner.support import counting, ordering, permutations

ONE_COLLECTIVE = "one collective"
ROTATION = "rotation"
METHODS = (ONE_COLLECTIVE, ROTATION)


def method_for(platform: str, other_axes: bool, *, permutation: bool) -> str:
    """How a striped layout (`permutation=False`) or a permutation moves: in one collective (an all-to-all;
    for a permutation, a ragged all-to-all, which XLA:CPU does not have), unless the mesh has `other_axes`
    left automatic, whose shards XLA's partitioner would gather around an all-to-all (a batch on a data
    axis, whole): then by `ppermute` rounds, row by row."""
    if other_axes or (permutation and platform == "cpu"):
        return ROTATION
    return ONE_COLLECTIVE


@dataclass(frozen=True)
class Move:
    """The move of this device's shards between token order and a layout, inside `shard_map` over `axes`
    (one mesh axis, or the pair a call over two axes shards the sequence over, ring axis outer).

    `how` names the collectives (`contiguous`, `zigzag`, `striped`, `permutation`) and `method` how
    (`METHODS`); a permutation holds the laid-out row's token indices `order` and their inverse `slots`,
    every row's (`[B, T]`) or one for all (`[1, T]`)."""

    how: str
    axes: Hashable
    order: jax.Array | None = None
    slots: jax.Array | None = None
    method: str = ONE_COLLECTIVE

    def lay_out(self, x, axis: int = 1):
        """This device's shard of `x` (sequence `axis`) in token order -> its shard in the layout."""
        return self._move(x, axis, forward=True)

    def restore(self, x, axis: int = 1):
        """The inverse of `lay_out`: this device's laid-out shard of `x` -> its shard in token order."""
        return self._move(x, axis, forward=False)

    def describe(self) -> str:
        """The collectives, for `explain()`."""
        if self.how == "contiguous":
            return "nothing moves"
        if self.how == "zigzag":
            return "two collective permutes of half a shard each way"
        one = self.method == ONE_COLLECTIVE
        if self.how == "striped":
            return "one all-to-all each way" if one else "P-1 collective permutes of 1/P of a shard each way"
        return ("one ragged all-to-all each way" if one else
                "P-1 collective permutes of one shard each way, passed around the ring (no ragged all-to-all here)")

    def _move(self, x, axis: int, forward: bool):
        if self.how == "contiguous":
            return x
        x = jnp.moveaxis(x, axis, 1)
        if self.how == "permutation":
            dest, source = (self.slots, self.order) if forward else (self.order, self.slots)
            x = _permute(x, dest, source, self.axes, self.method)
        elif self.how == "zigzag":
            x = _zigzag(x, self.axes, lax.axis_size(self.axes), forward)
        elif self.method == ONE_COLLECTIVE:
            x = _striped(x, self.axes, lax.axis_size(self.axes), forward)
        else:
            x = _striped_rounds(x, self.axes, lax.axis_size(self.axes), forward)
        return jnp.moveaxis(x, 1, axis)


def kind(layout: str, two_axes: bool, local_length: int, devices: int) -> str:
    """Which collectives move `layout` (`Move.how`): a fixed layout's own over one axis, else a permutation."""
    if layout == "contiguous" or devices == 1:
        return "contiguous"
    if not two_axes and (layout == "zigzag" or layout == "striped" and local_length % devices == 0):
        return layout
    return "permutation"


def fixed(layout: str, axes: Hashable, local_length: int, devices: int, order, *, platform: str, other_axes: bool
          ) -> Move:
    """The move of a fixed layout inside `shard_map` (`kind`), on `platform`, in a mesh with or without
    `other_axes` than the sequence's. `order` is the layout's `global_order`, the permutation it is where it
    has no collectives of its own."""
    how = kind(layout, isinstance(axes, tuple), local_length, devices)
    if how != "permutation":
        return Move(how, axes, method=method_for(platform, other_axes, permutation=False))
    return permutation(jnp.asarray(order, jnp.int32).reshape(1, -1), axes, platform=platform, other_axes=other_axes)


def permutation(order, axes: Hashable, *, platform: str, other_axes: bool) -> Move:
    """The move that puts global token `order[b, s]` at laid-out slot `s` of row `b` (`order` int32
    `[B or 1, T]`, the same on every device), on `platform`, in a mesh with or without `other_axes` than
    the sequence's."""
    slots = permutations.inverse(jnp.asarray(order, jnp.int32))
    return Move("permutation", axes, order, slots, method_for(platform, other_axes, permutation=True))


# ------------------------------------------------------------------------------------------------
# zigzag and striped over one axis


def _zigzag_home(chunk: int, size: int) -> int:
    """The device that holds half-chunk `chunk` (of 2P) in the zigzag layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _zigzag(x, axis_name: Hashable, size: int, forward: bool):
    """Device r holds half-chunks 2r and 2r+1 in token order and r, 2P-1-r in zigzag. The even half-chunks
    form one permutation of the devices, the odd ones another; a device keeps the half-chunk of its own
    parity first (half-chunk r)."""
    even = [(r, _zigzag_home(2 * r, size)) for r in range(size)]
    odd = [(r, _zigzag_home(2 * r + 1, size)) for r in range(size)]
    half = x.shape[1] // 2
    odd_first = lax.axis_index(axis_name) % 2  # where a device's even half-chunk sits in its zigzag shard
    if forward:
        first, second = lax.slice_in_dim(x, 0, half, axis=1), lax.slice_in_dim(x, half, 2 * half, axis=1)
        from_even = _sent(first, axis_name, even)
        from_odd = _sent(ordering.ordered(second, from_even), axis_name, odd)  # one at a time on the CPU
        out = lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), from_even, odd_first * half, axis=1)
        return lax.dynamic_update_slice_in_dim(out, from_odd, (1 - odd_first) * half, axis=1)
    evens = lax.dynamic_slice_in_dim(x, odd_first * half, half, axis=1)
    odds = lax.dynamic_slice_in_dim(x, (1 - odd_first) * half, half, axis=1)
    back = [(b, a) for a, b in even], [(b, a) for a, b in odd]
    evens = _sent(evens, axis_name, back[0])
    return jnp.concatenate([evens, _sent(ordering.ordered(odds, evens), axis_name, back[1])], axis=1)


def _sent(x, axis_name: Hashable, pairs: list[tuple[int, int]]):
    """`ppermute` over `pairs`, or `x` itself where every device keeps its own (a ring of 2's even
    half-chunks): no transfer, no buffer."""
    return x if all(a == b for a, b in pairs) else lax.ppermute(x, axis_name, pairs)


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


def _striped_rounds(x, axis_name: Hashable, size: int, forward: bool):
    """`_striped` by P-1 `ppermute`s, row by row: in round s, device r sends device r+s what it holds for it
    (every P-th token of its shard in token order; one source's block of its striped shard)."""
    batch, length, rest = x.shape[0], x.shape[1], x.shape[2:]
    me, part = lax.axis_index(axis_name), length // size
    by_device, into = (part, size), (size, part)  # token order [T_l/P, P]; striped [P sources, T_l/P]
    if not forward:
        by_device, into = into, by_device
    blocks = x.reshape(batch, *by_device, *rest)
    take, put = (2, 1) if forward else (1, 2)
    out = jnp.zeros((batch, *into, *rest), x.dtype)
    for shift in range(size):
        block = lax.dynamic_index_in_dim(blocks, (me + shift) % size, take, keepdims=False)
        if shift:  # each round after the one before, on the CPU
            block = lax.ppermute(ordering.ordered(block, out), axis_name, _shifted(size, shift))
        out = lax.dynamic_update_index_in_dim(out, block, (me - shift) % size, put)
    return out.reshape(x.shape)


# ------------------------------------------------------------------------------------------------
# any permutation of the rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _permute(x, dest, source, axes: Hashable, method: str):
    """`x [B, T_l, ...]`, this device's shard of a space split evenly over the devices of `axes`, sent to
    the other space: global index `t` of the first lands at `dest[b, t]` of the second; `source` is the
    inverse of `dest`. Only the shards move; `dest` and `source` are every device's."""
    devices, me = lax.axis_size(axes), lax.axis_index(axes)
    batch, length = x.shape[:2]
    if method == ONE_COLLECTIVE:
        return _ragged(x, dest, source, axes, devices, me)
    wanted = _mine(source, me, batch, length)  # what my slots hold
    from_device, kept = wanted // length, wanted % length  # where each of my slots' tokens sits

    def keep(passes, visiting, out):
        """`out` with the tokens of `visiting`, the shard of the device `passes` places back, that are mine."""
        from_there = _expand(from_device == (me - passes) % devices, x.ndim)
        return jnp.where(from_there, _take(visiting, kept), out)

    def round_(passes, carry):
        visiting, out = carry
        visiting = lax.ppermute(ordering.after(visiting, out), axes, _shifted(devices, 1))
        return visiting, keep(passes, visiting, out)

    return lax.fori_loop(1, devices, round_, (x, keep(0, x, jnp.zeros_like(x))))[1]


def _ragged(x, dest, source, axes: Hashable, devices: int, me):
    """`_permute` in one ragged all-to-all (`ragged_exchange`)."""
    batch, length = x.shape[:2]
    flat = x.reshape(batch * length, *x.shape[2:])
    plan = ragged_exchange(dest, source, me, batch, length, devices)
    moved = lax.ragged_all_to_all(flat[plan.send], jnp.zeros_like(flat), plan.send_starts, plan.send_sizes,
                                  plan.starts_there, plan.arrival_sizes, axis_name=axes)
    return moved[plan.arrival].reshape(x.shape)


class RaggedExchange(NamedTuple):
    """What one device does in a permutation's ragged all-to-all: it sends its tokens in the order `send`
    (`[B * T_l]` indices into its flattened shard), device d's part `send_sizes[d]` long from
    `send_starts[d]`, to land at `starts_there[d]` of d's buffer; the `arrival_sizes[s]` tokens from
    device s arrive in sender order; slot i of its laid-out shard takes token `arrival[i]` of them."""

    send: jax.Array
    send_starts: jax.Array
    send_sizes: jax.Array
    starts_there: jax.Array
    arrival_sizes: jax.Array
    arrival: jax.Array


def ragged_exchange(dest, source, me, batch: int, length: int, devices: int) -> RaggedExchange:
    """Device `me`'s part of `_permute` (`dest`, `source` its arguments, `[1 or B, T]`) in one ragged
    all-to-all of `batch` rows of `length` tokens a device: every token sent in the order of the (device,
    row, slot) it goes to, so that the tokens arrive in the order of the (device, row, slot) they come
    from. Both orders are counted (`_send_positions`, `_arrival_positions`), not sorted."""
    mine = _mine(dest, me, batch, length)  # where my tokens go
    wanted = _mine(source, me, batch, length)  # what my slots hold
    counts = _counts(dest, batch, length, devices)
    arrival_starts = _starts(counts, axis=0)  # [s, d]: where device s's tokens start in device d's buffer
    send = permutations.inverse(_send_positions(source, me, batch, length, devices, mine // length,
                                                mine % length))
    arrival = _arrival_positions(wanted // length, arrival_starts[:, me], devices)
    return RaggedExchange(send, _starts(counts[me]), counts[me], arrival_starts[me], counts[:, me], arrival)


def _send_positions(source, me, batch: int, length: int, devices: int, to_device, to_slot):
    """`[B * T_l]`: where each token of this device's shard sits among those it sends, ordered by the
    (device, row, slot) each goes to; counted from the slots of the whole row that this device fills
    (`source [1 or B, T]`, the token of each slot, is every device's)."""
    rows = source.shape[0]
    filled = (source // length == me).astype(jnp.int32).reshape(rows, devices, length)
    earlier_in_row = counting.counted_before(filled, axis=2)  # my tokens before a slot, in its device's row
    per_row = jnp.broadcast_to(filled.sum(axis=2), (batch, devices))  # what I send each device, row by row
    before = _starts(per_row.sum(axis=0))[None] + _starts(per_row, axis=0)  # [B, P]: earlier devices and rows
    row = lax.broadcasted_iota(jnp.int32, to_device.shape, 0)
    return (before[row, to_device] + earlier_in_row[row % rows, to_device, to_slot]).ravel()


def _arrival_positions(from_device, starts, devices: int):
    """`[B * T_l]`: where each slot of this device's shard (`from_device [B, T_l]`, the device its token
    comes from) finds its token among those that arrive: sender by sender from `starts [P]`, each sender's
    in the order of the (row, slot) they fill here."""
    senders = from_device.ravel()
    one_hot = (senders[:, None] == lax.iota(jnp.int32, devices)[None]).astype(jnp.int32)
    earlier = jnp.take_along_axis(counting.counted_before(one_hot, axis=0), senders[:, None], axis=1)[:, 0]
    return starts[senders] + earlier


def _permute_forward(x, dest, source, axes, method):
    return _permute(x, dest, source, axes, method), (dest, source)


def _permute_backward(axes, method, residuals, cotangent):
    dest, source = residuals
    return _permute(cotangent, source, dest, axes, method), None, None


_permute.defvjp(_permute_forward, _permute_backward)


def _shifted(devices: int, shift: int) -> list[tuple[int, int]]:
    return [(d, (d + shift) % devices) for d in range(devices)]


def _take(x, index):
    """`x [B, T, ...]` at `index [B, T]` along its sequence axis, row by row."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _mine(indices, me, batch: int, length: int):
    """`[B, T_l]`: device `me`'s part of every device's `indices [1 or B, T]`, for each of its `batch` rows."""
    return jnp.broadcast_to(lax.dynamic_slice_in_dim(indices, me * length, length, axis=1), (batch, length))


def _expand(mask, ndim: int):
    return mask.reshape(mask.shape + (1,) * (ndim - 2))


def _counts(dest, batch: int, length: int, devices: int):
    """`[P, P]`: how many tokens device s sends device d (every row's, summed)."""
    source = (lax.iota(jnp.int32, dest.shape[1]) // length)[None]
    pairs = (source * devices + dest // length).ravel()
    counts = jnp.zeros(devices * devices, jnp.int32).at[pairs].add(1).reshape(devices, devices)
    return counts * (batch // dest.shape[0])


def _starts(counts, axis: int = -1):
    """Exclusive running sums of `counts` along `axis`: where each part starts."""
    return jnp.cumsum(counts, axis=axis) - counts


__all__ = ["METHODS", "Move", "ONE_COLLECTIVE", "ROTATION", "RaggedExchange", "fixed", "kind", "method_for",
           "permutation", "ragged_exchange"]
