"""Which array library a rule computes in: NumPy for NumPy arguments, else jax.numpy.

Some rules run in two places: on the host, as a call is traced, on what the trace knows (positions a
layout gives, a declared packing's documents), and on the device, on traced arrays. Written once against
`xp = namespace(...)`, a rule runs in NumPy on the host (no program to compile, no device to run it on,
whatever mesh the caller set) and in jax on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def namespace(*arrays):
    """NumPy where every argument is a NumPy array or scalar (or a Python number), else jax.numpy."""
    numpy_types = (np.ndarray, np.generic, int)  # a bool is an int
    return np if all(isinstance(x, numpy_types) for x in arrays) else jnp


def stable_argsort(x):
    """The indices that sort `x` along its last axis, equal values in index order, in the library of `x`
    (NumPy, which before 2.0 spells stability `kind="stable"`, or jax, which spells it `stable=True`)."""
    if namespace(x) is np:
        return np.argsort(x, axis=-1, kind="stable")
    return jnp.argsort(x, axis=-1, stable=True)


def per_row(fn: Callable, x):
    """`fn` of each row of `x` (its leading axis), stacked: `jax.vmap` in jax, a loop in NumPy."""
    if namespace(x) is np:
        return np.stack([fn(row) for row in x])
    return jax.vmap(fn)(x)


__all__ = ["namespace", "per_row", "stable_argsort"]
