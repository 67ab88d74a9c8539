"""The mesh axis a call names, looked up in the `shard_map` around it.

jax answers an axis no enclosing `shard_map` binds with a bare `NameError` ("unbound axis name"), which
names neither the argument nor the fix. The calls that take `axis_name` ask here instead.
"""

from __future__ import annotations

from collections.abc import Hashable

from jax import lax


def bound_size(axis_name: Hashable) -> int:
    """The size of `axis_name` (a mesh axis, or a tuple of them) in the enclosing `shard_map`; `ValueError`
    naming `axis_name` where no enclosing `shard_map` binds it."""
    try:
        return lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} names an axis that no enclosing jax.shard_map binds ({e}): "
                         f"call this inside a shard_map over a mesh with that axis, or call "
                         f"get_tuned_ring_attention(..., mesh=mesh) on global arrays, which runs its own "
                         f"shard_map") from None


__all__ = ["bound_size"]
