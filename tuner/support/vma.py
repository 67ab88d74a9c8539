"""Keeping `shard_map`'s varying-manual-axes types consistent.

Inside `shard_map`, every value carries the set of mesh axes it varies over, and the branches of a
`lax.cond` or the carry of a `lax.scan` must agree on it. Accumulators start as constants (zeros,
-inf), which vary over nothing; `like` gives them the axes of the data they will accumulate.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside `shard_map`)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax < 0.10 names it `vma`
    if vma is None:
        vma = aval.manual_axis_type.varying
    return frozenset(vma)


def like(x, reference):
    """`x`, marked as varying over every axis that `reference` varies over."""
    missing = tuple(sorted(varying_axes(reference) - varying_axes(x), key=str))
    return lax.pcast(x, missing, to="varying") if missing else x


def shape_like(shape, dtype, reference) -> jax.ShapeDtypeStruct:
    """An output type (for `pallas_call`) varying over the manual mesh axes `reference` varies over."""
    aval = jax.typeof(reference)
    if hasattr(aval, "manual_axis_type"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)  # jax < 0.10
