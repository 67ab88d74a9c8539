"""Dense attention, straight from DESIGN section 2: the oracle every backend is tested against.

It materializes the whole `[B, H, Tq, Tk]` logit matrix, so it is for tests and small problems. It
deliberately does not share code with the backends (its mask is written out here again) so that a
mistake in the shared masking rule cannot hide. Call it under `jax.enable_x64` with float64 inputs to
get the float64 oracle of the tests.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _in_window(qp, kp, left: int, right: int):
    """`qp - left <= kp <= qp + right`, exact for positions anywhere in their integer dtype's range.

    Nothing is added to a position: the distance between two of them is taken in the unsigned type of
    the same width, where it is exact whenever it is non-negative (|q - k| < 2**bits).
    """
    dtype = jnp.promote_types(qp.dtype, kp.dtype)
    unsigned = np.dtype(f"uint{jnp.iinfo(dtype).bits}")
    qu, ku = qp.astype(dtype).astype(unsigned), kp.astype(dtype).astype(unsigned)
    reach = np.iinfo(unsigned).max
    behind_ok = (kp >= qp) | (qu - ku <= unsigned.type(min(left, reach)))
    ahead_ok = (kp <= qp) | (ku - qu <= unsigned.type(min(right, reach)))
    return behind_ok & ahead_ok


def dense_attention(
    query,
    key,
    value,
    *,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    bias=None,
    softmax_aux=None,
):
    """Exact attention over global arrays; returns `(out [B,Tq,H,D], lse [B,H,Tq])` in the input dtype.

    Positions default to `arange`; `bias` is `[B, H, Tq, Tk]` or broadcastable; `softmax_aux` is `[H]` or
    `[H, n]`. Fully masked rows without sinks give out 0 and lse -inf.
    """
    b, tq, h, d = query.shape
    tk, hkv = key.shape[1], key.shape[2]
    group = h // hkv
    dtype = query.dtype
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(tq), (b, tq))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(tk), (b, tk))

    k = jnp.repeat(key, group, axis=2)
    v = jnp.repeat(value, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", query, k) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias.astype(dtype)

    qp = q_positions[:, None, :, None]
    kp = kv_positions[:, None, None, :]
    keep = jnp.ones((b, 1, tq, tk), bool)
    if causal:
        keep = keep & (kp <= qp)
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        keep = keep & _in_window(qp, kp, left, right)
    if chunk_size is not None:
        keep = keep & (qp // chunk_size == kp // chunk_size)
    if q_segment_ids is not None:
        keep = keep & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])

    s = jnp.where(keep, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    if softmax_aux is not None:
        sinks = softmax_aux.astype(dtype).reshape(h, -1)
        row_max = jnp.maximum(row_max, sinks.max(axis=-1)[None, :, None, None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(keep, jnp.exp(s - row_max), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.exp(sinks[None, :, None, :] - row_max).sum(axis=-1, keepdims=True)
    has_mass = denom > 0
    safe_denom = jnp.where(has_mass, denom, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / safe_denom, v)
    lse = jnp.where(has_mass, jnp.log(safe_denom) + row_max, -jnp.inf)[..., 0]
    return out.astype(dtype), lse.astype(dtype)
