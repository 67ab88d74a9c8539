"""One collective of a kind at a time on the CPU.

jax 0.10.2 gives every collective of a program the same channel id, and XLA:CPU then joins two
collectives of one kind that are in flight at once into one rendezvous: it aborts, hangs or corrupts
its heap (benchmarks/cpu_ring/README.md). XLA only orders when collectives start, not when the one before ends.
So on the CPU each collective of the ring and the strategies takes an input that waits for the result
of the one before it: `after` in code that runs forward only (the ring's own passes), `ordered` where
jax differentiates through the collectives, so that their transposes run one at a time too.

The wait is a real data dependency that XLA cannot fold: the input plus zero, where the zero says
whether one element of the awaited array is below -inf. On GPU and TPU both return their input.
`ordered` is a custom VJP: like the ring, what it orders cannot be differentiated in forward mode
(`jax.jvp`) on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tuner.support import vma
from tuner.support.targets import compile_target


def _on_cpu() -> bool:
    return compile_target()[0] == "cpu"


def _never(deps) -> jax.Array:
    """False, computed from the first element of each array of `deps`."""
    flags = [jnp.ravel(d)[0].astype(jnp.float32) < -jnp.inf for d in jax.tree.leaves(deps)]
    return functools.reduce(jnp.logical_or, flags)


def _wait(x, deps):
    return x + _never(deps).astype(x.dtype)


def after(x, deps):
    """`x`, computed only once every array of `deps` is (on the CPU; elsewhere `x` itself). For code
    that jax does not differentiate: the dependency has no gradient."""
    if x is None or not jax.tree.leaves(deps) or not _on_cpu():
        return x
    return _wait(x, jax.lax.stop_gradient(deps))


@jax.custom_vjp
def _ordered(x, deps):
    return _wait(x, deps)


def _ordered_fwd(x, deps):
    return _wait(x, deps), (deps, jnp.ravel(x)[:0])  # no bytes: the mesh axes `x` varies over


def _waiting(x, deps):
    """`_wait(x, deps)`, unless that would make `x` vary over more mesh axes than it does."""
    waited = _wait(x, deps)
    return waited if vma.varying_axes(waited) <= vma.varying_axes(x) else x


def _ordered_bwd(residuals, ct):
    # The cotangent of `x` waits for the forward values of `deps`, and the cotangents of `deps` wait for
    # it: the transposed collectives run after the forward ones, one at a time, in the reverse order. A
    # cotangent that varies over fewer mesh axes than `x` (a loss's constant seed) is marked as varying
    # over `x`'s first, so that it can wait too. One that varies over more (an `x` replicated over axes
    # that `deps` vary over, such as a bias broadcast over the queries) is summed over them: `x` was the
    # same on each of their devices, and each device's use of it adds to its gradient.
    deps, like_x = residuals
    ct = vma.like(ct, like_x)
    ct_x = _waiting(ct, deps)
    extra = tuple(sorted(vma.varying_axes(ct_x) - vma.varying_axes(like_x), key=str))
    if extra:
        ct = ct_x = jax.lax.psum(ct_x, extra)  # the cotangents of `deps` then wait for the sum
    return ct_x, jax.tree.map(lambda d: _waiting(jnp.zeros_like(d), ct), deps)


_ordered.defvjp(_ordered_fwd, _ordered_bwd)


def ordered(x, deps):
    """`x`, computed only once every array of `deps` is; in the backward pass the cotangent of `x` only
    once `deps` are, and the cotangents of `deps` only once that of `x` is (on the CPU; elsewhere `x`
    itself). Integer arrays, which have no cotangent, wait in the forward pass only."""
    if x is None or not jax.tree.leaves(deps) or not _on_cpu():
        return x
    if not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in [x, *jax.tree.leaves(deps)]):
        return after(x, deps)
    return _ordered(x, deps)


def in_order(collective, xs: list, after=()) -> list:
    """`collective` applied to each array of `xs` (or, given a list, `collective[i]` to `xs[i]`; None passes
    through), one after the other on the CPU, the first after the arrays of `after`."""
    collectives = collective if isinstance(collective, list) else [collective] * len(xs)
    done, results = after, []
    for apply, x in zip(collectives, xs, strict=True):
        if x is not None:
            x = done = apply(ordered(x, done))
        results.append(x)
    return results


__all__ = ["after", "in_order", "ordered"]
