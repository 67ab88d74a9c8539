"""The gathered implementations: every device all-gathers the keys and values and attends densely.

A ring is not always the fastest way to attend over a sharded sequence: at short lengths, gathering
every device's keys and values and attending densely can win. `tuner.strategies.implementations` registers these
beside the rings, and `tuner bench --mechanisms` times, on the same ring of devices and the same inputs,
every registered implementation that can run the problem here (`ring/<kernel>` for the rings, at the
config the runtime loader would pick):

- `dense`: all-gather K/V (and their positions and segment ids) around the ring, then dense attention
  in XLA (`tuner.semantics.reference.dense_attention`, every feature) for this device's queries;
- `jax_nn`: all-gather, then `jax.nn.dot_product_attention` with the masks as a boolean mask (XLA;
  cuDNN on a GPU); no soft cap, sinks or lse.

Each is checked against the scan ring first (float32, output and gradients), and the fastest correct
one is recorded in the cache for the problem; `get_tuned_ring_attention(backend="auto")` then runs it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tuner.semantics import layouts, masks
from tuner.support import ordering
from tuner.semantics.reference import dense_attention
from tuner.strategies.ring import ring_geometry
from tuner.semantics.spec import AttentionSpec


def gathered_unsupported(mechanism: str, spec: AttentionSpec, *, return_lse: bool = False,
                         value_head_dim: int | None = None) -> str | None:
    """Why a gathered mechanism cannot honour this call (`value_head_dim`: the values' head dim where it
    differs from the query/key one), or None."""
    if mechanism == "jax_nn":
        for present, what in ((spec.softcap is not None, "a logits soft cap"), (spec.num_sinks > 0, "sinks"),
                              (return_lse, "return_lse"),
                              (value_head_dim is not None, "value head dim other than the query/key head dim")):
            if present:
                return f"jax.nn.dot_product_attention has no {what}"
    return None


def gathered_attention(query, key, value, *, mechanism: str, spec: AttentionSpec, axis_name: Hashable | None,
                       layout: str, q_positions=None, kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
                       bias=None, softmax_aux=None, return_lse: bool = False) -> Any:
    """Attention of this device's queries to the whole ring's keys, for a call resolved to `spec`
    (`tuner.runtime.plan.resolve`): K/V (with positions and segment ids) are all-gathered along `axis_name`, in
    ring order -- the global key order a bias is given in. Arrays as in `tuner.ring_attention`."""
    value_head_dim = value.shape[3] if value.shape[3] != key.shape[3] else None
    reason = gathered_unsupported(mechanism, spec, return_lse=return_lse, value_head_dim=value_head_dim)
    if reason is not None:
        raise ValueError(f"mechanism {mechanism!r}: {reason}")
    size, rank = ring_geometry(axis_name)
    b, tq = query.shape[:2]
    tk = key.shape[1]
    if q_positions is None:
        q_positions = jnp.broadcast_to(layouts.local_positions(layout, tq, size, rank), (b, tq))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(layouts.local_positions(layout, tk, size, rank), (b, tk))
    kv = [key, value, kv_positions] + ([kv_segment_ids] if kv_segment_ids is not None else [])
    if size > 1:
        kv = ordering.in_order(lambda x: lax.all_gather(x, axis_name, axis=1, tiled=True), kv)  # one at a time
    key, value, kv_positions = kv[:3]
    kv_segment_ids = kv[3] if kv_segment_ids is not None else None
    if mechanism == "dense":
        out, lse = dense_attention(query, key, value, q_positions=q_positions, kv_positions=kv_positions,
                                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=spec.causal,
                                   sliding_window=spec.window, chunk_size=spec.chunk_size,
                                   logits_soft_cap=spec.softcap, softmax_scale=spec.scale, bias=bias,
                                   softmax_aux=softmax_aux)
        return (out, lse) if return_lse else out
    allowed = masks.allowed(q_positions, kv_positions, q_segment_ids, kv_segment_ids, spec)
    if allowed is None:
        return jax.nn.dot_product_attention(query, key, value, bias=bias, scale=float(spec.scale))
    out = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=allowed[:, None],
                                       scale=float(spec.scale))
    # A row with no readable key outputs exactly 0 (DESIGN section 2), not jax.nn's average.
    return jnp.where(allowed.any(axis=-1)[:, :, None, None], out, 0.0).astype(out.dtype)


__all__ = ["gathered_attention", "gathered_unsupported"]
