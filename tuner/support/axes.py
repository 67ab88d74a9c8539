"""The mesh axis a call names, looked up in the `shard_map` around it.

jax answers an axis nothing binds with a bare `NameError` ("unbound axis name"), and the ring's first
`pcast` under an axis that `jax.vmap(axis_name=...)` binds with a bare `AssertionError`: neither names the
argument or the fix. The calls that take `axis_name` ask here instead.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
from jax import lax

_FIX = ("call this inside a shard_map over a mesh with that axis, or call get_tuned_ring_attention(..., "
        "mesh=mesh) on global arrays, which runs its own shard_map")


def sequence_axes(axis_name: Hashable) -> tuple:
    """The mesh axes a call's `axis_name` shards the sequence over: the one axis, or the pair."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def bound_size(axis_name: Hashable) -> int:
    """The size of `axis_name` (a mesh axis, or a tuple of them) in the enclosing `shard_map`; `ValueError`
    naming `axis_name` where no enclosing `shard_map` binds it (nothing does, or a `jax.vmap` does)."""
    try:
        size = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} names an axis that no enclosing jax.shard_map binds ({e}): "
                         f"{_FIX}") from None
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if not set(sequence_axes(axis_name)) <= set(manual):
        raise ValueError(f"axis_name={axis_name!r} names an axis that no enclosing jax.shard_map binds (a "
                         f"jax.vmap's axis_name does: the ring's collectives run over shard_map's mesh axes): "
                         f"{_FIX}")
    return size


__all__ = ["bound_size", "sequence_axes"]
