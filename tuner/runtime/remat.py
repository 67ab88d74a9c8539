"""Activation checkpointing (`jax.checkpoint`, Flax's `nnx.remat`) with the ring: a policy that keeps the
attention's output and lse, so that the backward pass does not run the ring's forward a second time.

Under `jax.checkpoint` the backward pass recomputes what the policy does not save. For a layer with ring
attention in it, that is the whole ring forward again: every hop of the keys and values, every block. The
backward of the ring needs only its output and its lse from the forward (and the queries, keys and values,
which the layer's projections rebuild from the layer's input). Each implementation over a block kernel
(the ring, all-to-all, all-gather, the hybrid) names those two arrays inside its `custom_vjp`
(`tuner.strategies.ring`), so a policy can save them by name: one output and one float32 row statistic a
token and head per layer. The gathered mechanisms (`dense`, `jax_nn`) name
nothing: they recompute their forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import Recompute

from tuner.strategies.ring import LSE_NAME, OUTPUT_NAME

RESIDUAL_NAMES: tuple[str, str] = (OUTPUT_NAME, LSE_NAME)


def save_attention_residuals(policy: Callable[..., Any] | None = None, *, offload: bool = False
                             ) -> Callable[..., Any]:
    """A `jax.checkpoint` policy that keeps the ring's output and lse (`RESIDUAL_NAMES`), so that the
    backward pass skips the ring's forward, and saves whatever `policy` (another `jax.checkpoint_policies`
    policy) saves; without `policy`, everything else is recomputed. `offload=True` keeps the two arrays in
    the host's pinned memory instead of the device's: the device then holds what it holds with nothing
    saved (measured on the TPU compiler, `docs/remat.md`)."""
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be a jax.checkpoint policy (a callable) or None, got {policy!r}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False, got {offload!r}")
    names = list(RESIDUAL_NAMES)
    ours = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[] if offload else names, names_which_can_be_offloaded=names if offload else [],
        offload_src="device", offload_dst="pinned_host")
    if policy is None:
        return ours

    def either(primitive, *args, **params):
        chosen = ours(primitive, *args, **params)
        return policy(primitive, *args, **params) if chosen is Recompute else chosen

    return either


__all__ = ["RESIDUAL_NAMES", "save_attention_residuals"]
