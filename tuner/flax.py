"""Flax NNX layers built on tuned ring attention (`pip install 'ring-tuner[flax]'`).

`RingSelfAttention` is a drop-in self-attention layer: query / key / value projections (grouped-query
heads), rotary position embeddings on the **global** positions of the tokens (from the ring layout,
so a token gets the same rotation whichever device holds it), the tuned ring attention of
`get_tuned_ring_attention`, and an output projection. Inside `shard_map` over `axis_name` it takes
each device's shard of the sequence; with `axis_name=None` it is ordinary attention on one device. With
`mesh=` it takes global arrays under `jax.jit` (the loader's `mesh=` path): in token order, laid out in
every call, or laid out once per batch by the data pipeline (`laid_out=True`, `tuner.layouts.lay_out_batch`,
its positions passed).
`strategy` is the loader's ("auto", "ring", "all_to_all", "all_gather", or "hybrid" with
`axis_name=(ring_axis, a2a_axis)`, the layout then over the ring axis).
`attention="dense"` swaps the ring for dense attention over the same inputs (one device): the
reference the layer is tested against. `sinks=n` gives every query head n learned sink logits (attention
sinks, as in gpt-oss): they add to the softmax's denominator and attend to nothing. `packing` declares how
the documents of packed rows are drawn, as the loader takes it: the layer then runs the tiles tuned for that
packing, and in the documents layout compiles one ring, not one per default tile.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tuner.semantics import layouts
from tuner.support.checks import check_bool, check_int
from tuner.runtime.dispatch import Decision, get_tuned_ring_attention
from tuner.semantics.reference import dense_attention
from tuner.strategies.ring import ring_geometry

ATTENTIONS = ("ring", "dense")


def rotary(x, positions, base: float = 10_000.0):
    """Rotary position embedding of `x [B, T, H, D]` (D even) at integer `positions [B, T]`: each pair
    of channels (i, i + D/2) is rotated by `position * base ** (-2i / D)`, in float32."""
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None, None] * frequencies[None, None, None]  # [B, T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RingSelfAttention(nnx.Module):
    """Multi-head self-attention over a sequence sharded around a ring (module docstring).

    `x [B, T_local, embed_dim]` -> `[B, T_local, embed_dim]`. Query and key heads have `head_dim` channels
    (default `embed_dim // num_heads`), value heads `value_head_dim` (default `head_dim`; multi-head latent
    attention uses 192 and 128). `positions` default to the layout's global positions of this device's
    tokens; pass them (int `[B, T_local]`) for packed or shifted sequences, with `segment_ids` for packed
    documents.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, value_head_dim: int | None = None,
                 axis_name: Hashable | None = None, layout: str = "contiguous",
                 causal: bool = True, sliding_window: int | tuple[int, int] | None = None,
                 chunk_size: int | None = None, logits_soft_cap: float | None = None,
                 softmax_scale: float | None = None, sinks: int = 0, use_rope: bool = True,
                 rope_base: float = 10_000.0, backend: str = "auto", attention: str = "ring",
                 strategy: str = "auto", dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, db=None,
                 mesh: Mesh | None = None, laid_out: bool = False, packing: str | None = None, rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            check_int(name, value)
        check_int("sinks", sinks, non_negative=True)
        check_bool("use_rope", use_rope)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim={embed_dim} must be a multiple of num_heads={num_heads}, or pass "
                                 f"head_dim")
            head_dim = embed_dim // num_heads
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        check_int("value_head_dim", value_head_dim)
        if use_rope and head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        if attention == "dense" and axis_name is not None:
            raise ValueError("attention='dense' is the one-device reference; use it with axis_name=None")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.value_head_dim = value_head_dim
        self.axis_name, self.layout, self.use_rope, self.rope_base = axis_name, layout, use_rope, rope_base
        self.on_mesh, self.laid_out = mesh is not None, laid_out
        self.attention_kind = attention
        self.options = dict(causal=causal, sliding_window=sliding_window, chunk_size=chunk_size,
                            logits_soft_cap=logits_soft_cap, softmax_scale=softmax_scale)

        def linear(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.query = linear(embed_dim, num_heads * head_dim)
        self.key = linear(embed_dim, num_kv_heads * head_dim)
        self.value = linear(embed_dim, num_kv_heads * value_head_dim)
        self.out = linear(num_heads * value_head_dim, embed_dim)
        # zero-initialised: each sink starts as one more logit of 0 in its head's softmax
        self.sinks = nnx.Param(jnp.zeros((num_heads, sinks), param_dtype)) if sinks else None
        self.ring = get_tuned_ring_attention(axis_name=axis_name, layout=layout, backend=backend, db=db,
                                             strategy=strategy, mesh=mesh, laid_out=laid_out, packing=packing,
                                             **self.options)

    def positions(self, batch: int, length: int):
        """Global positions `[batch, length]` of this device's tokens under the layout (over two axes: over the
        ring axis, each position's chunk cut over the group axis); with `mesh=`, of global arrays in token
        order."""
        if self.on_mesh:
            return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if isinstance(self.axis_name, tuple):
            return jnp.broadcast_to(layouts.grouped_positions(self.layout, length, self.axis_name), (batch, length))
        size, rank = ring_geometry(self.axis_name)
        return jnp.broadcast_to(layouts.local_positions(self.layout, length, size, rank), (batch, length))

    def explain(self, x, *, positions=None, segment_ids=None, ring_size: int | tuple[int, int] | None = None
                ) -> Decision:
        """The loader's decision for the attention of `self(x, positions=, segment_ids=)`, without running the
        attention: which implementation and tiles it runs, and why (`TunedRingAttention.explain`). `x` is global
        with `mesh=`, else one device's shard, with `ring_size` as the loader takes it. Given arrays, the
        projections run, so that in the documents layout the plan names the tile the rows choose; given a
        `jax.ShapeDtypeStruct`, the plan before that choice."""
        if self.attention_kind == "dense":
            raise ValueError("attention='dense' runs dense attention, not the loader: there is nothing to explain")
        b, t, _ = x.shape
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            q, k, v = self._heads(x)
        else:
            q, k, v = jax.eval_shape(self._heads, x)
        if positions is None:
            self._check_positions_given()
            positions = self.positions(b, t) if self.on_mesh else jax.ShapeDtypeStruct((b, t), jnp.int32)
        return self.ring.explain(q, k, v, ring_size=ring_size, **self._per_call(positions, segment_ids))

    def _check_positions_given(self) -> None:
        if self.laid_out:
            raise ValueError("laid_out=True takes the positions the layout gave the tokens: pass positions= (the "
                             "ones tuner.layouts.lay_out_batch returned)")

    def _heads(self, x):
        """The query, key and value heads of `x`, before the rotary embeddings."""
        b, t, _ = x.shape
        return (self.query(x).reshape(b, t, self.num_heads, self.head_dim),
                self.key(x).reshape(b, t, self.num_kv_heads, self.head_dim),
                self.value(x).reshape(b, t, self.num_kv_heads, self.value_head_dim))

    def _per_call(self, positions, segment_ids) -> dict[str, Any]:
        """The attention's per-call arrays: the tokens' positions and segment ids, and the sinks."""
        tokens = dict(q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids,
                      kv_segment_ids=segment_ids, softmax_aux=None if self.sinks is None else self.sinks[...])
        return {n: a for n, a in tokens.items() if a is not None}

    def __call__(self, x, *, positions=None, segment_ids=None):
        b, t, _ = x.shape
        if positions is None:
            self._check_positions_given()
            positions = self.positions(b, t)
        q, k, v = self._heads(x)
        if self.use_rope:
            q, k = rotary(q, positions, self.rope_base), rotary(k, positions, self.rope_base)
        per_call = self._per_call(positions, segment_ids)
        if self.attention_kind == "dense":
            attended = dense_attention(q, k, v, **per_call, **self.options)[0]
        else:
            attended = self.ring(q, k, v, **per_call)
        return self.out(attended.reshape(b, t, self.num_heads * self.value_head_dim))


__all__ = ["RingSelfAttention", "rotary"]
