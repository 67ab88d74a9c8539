"""The ring's inputs beyond q, k and v: a bias over the whole key axis, of which each step reads the visiting
shard's columns, and softmax sinks, which join the softmax once, after the ring (DESIGN section 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def bias_columns(bias, source, kv_len: int):
    """The columns of a global-key-axis bias that belong to the shard of ring position `source`."""
    if bias is None or bias.shape[-1] == 1:
        return bias
    return lax.dynamic_slice_in_dim(bias, source * kv_len, kv_len, axis=-1)


def add_bias_columns(dbias, block_dbias, source, kv_len: int):
    """`dbias` with a block's gradient added into the columns of the shard of ring position `source`."""
    if dbias.shape[-1] == 1:
        return dbias + block_dbias
    current = lax.dynamic_slice_in_dim(dbias, source * kv_len, kv_len, axis=-1)
    return lax.dynamic_update_slice_in_dim(dbias, current + block_dbias, source * kv_len, axis=-1)


def with_sinks(out, lse, sinks) -> tuple:
    """`(out, lse)` of the ring (float32) with each head's sinks joined to the softmax's denominator."""
    if sinks is None:
        return out, lse
    sinks32 = sinks.astype(F32)
    sink_lse = sinks32 if sinks.ndim == 1 else jax.nn.logsumexp(sinks32, axis=-1)  # [H]
    final_lse = jnp.logaddexp(lse, sink_lse[None, :, None])
    return out * jnp.swapaxes(jnp.exp(lse - final_lse), 1, 2)[..., None], final_lse


def sinks_grad(sinks, lse, delta):
    """d sinks from the final lse and `delta` (the backward's `rowsum(dout * out) - dlse`); None without sinks."""
    if sinks is None:
        return None
    sinks32 = sinks.astype(F32).reshape(sinks.shape[0], -1)
    p_sink = jnp.exp(sinks32[None, :, None, :] - lse[..., None])  # [B,H,Tq,n]
    return -(p_sink * delta[..., None]).sum(axis=(0, 2)).reshape(sinks.shape).astype(sinks.dtype)
