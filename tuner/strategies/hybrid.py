"""The 2-D hybrid strategy (USP): all-to-all to head groups over one mesh axis, a ring over the other.

The devices form a `R x A` mesh with axes `axis_name=(ring_axis, a2a_axis)`; the sequence is sharded over
both, ring axis outer (`PartitionSpec(None, (ring_axis, a2a_axis))`), and the layout applies over the ring
axis: ring position r holds the layout's r-th chunk of `T / R` tokens, cut evenly over the A devices of its
all-to-all group. Each device `[B, T/(R A), H, D]`:

1. exchanges its shards over the a2a axis (`jax.lax.all_to_all`) into its group's whole chunk of a head
   group, `[B, T/R, H/A, D]` (only the Hkv key/value heads travel, repeated as in `tuner.strategies.all_to_all` when
   `Hkv % A != 0`);
2. runs a block kernel's ring over the ring axis on that chunk (`tuner.strategies.ring.run_ring`): R steps, the
   layout's positions for a ring of R, so causal, window and chunk masks are exact in every layout;
3. exchanges the output (and lse) back over the a2a axis.

The all-to-alls stay inside a group (on a GPU node, NVLink) and the ring crosses groups with `1 / A` of the
keys a plain ring over all `R A` devices would send, overlapped with compute.

- Heads: the H query heads split over the a2a axis (`H % A == 0`), else the call is refused when it is
  resolved (its `shape_violation`: a `ValueError` naming `axis_name`).
- Per-call arrays: explicit positions and segment ids are all-gathered over the a2a axis into the chunk's,
  and travel around the ring as the ring's own do. Sinks: each device takes its head group's rows. No
  bias, as for `tuner.strategies.all_to_all`.
- Kernels: registered once per block kernel, as all_to_all is: `hybrid` over the scan kernel,
  `hybrid_<kernel>` over the others; `strategy="hybrid"` runs the platform's preferred one that can run the
  call (`tuner.registry.strategy_choice`: Pallas on a TPU, Triton on a GPU).
- Config: the inner ring's `TileConfig`. Its default, space and constraints are the kernel's on what the
  inner ring runs (`tile_shapes`: one device's shapes after the exchange, `tuner.strategies.all_to_all.
  exchanged`), and the cache key of a hybrid call is the key of that ring (`key_shapes`: those shapes on
  a ring of R), so a tuned config follows the shapes the kernels see.
- Backward: jax's autodiff through the all-to-alls and the inner ring's `custom_vjp`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from tuner.semantics import layouts
from tuner.support import ordering
from tuner import registry
from tuner.support import vma
from tuner.kernels import BACKENDS
from tuner.strategies.all_to_all import AllToAll, exchanged, kv_repeats
from tuner.strategies.configs import TileConfig
from tuner.strategies.ring import run_ring
from tuner.semantics.spec import AttentionSpec, LocalShapes

BIAS_REASON = "bias: the hybrid's all-to-all does not carry a bias over the key axis; the ring supports it"


def heads_violation(heads: int, groups: int) -> str | None:
    """Why `heads` query heads cannot split over an all-to-all axis of `groups` devices, or None."""
    return None if heads % groups == 0 else (
        f"hybrid splits the query heads over its all-to-all axis: heads ({heads}) must be a multiple of its size "
        f"({groups}); swap the axes, or use another strategy")


def hybrid_attention(query, key, value, *, spec: AttentionSpec, config: TileConfig, axis_name: Any, layout: str,
                     interpret: bool = False, backend: str = "scan", q_segment_ids=None, kv_segment_ids=None,
                     q_positions=None, kv_positions=None, softmax_aux=None, bias=None,
                     return_lse: bool = False) -> Any:
    """This device's output (and lse `[B, H, T/(R A)]`) for a call resolved to `spec`, under `shard_map` over
    both axes of `axis_name=(ring_axis, a2a_axis)`, on shards in `layout` over the ring axis (module
    docstring). Arrays as in `tuner.ring_attention`."""
    if bias is not None or spec.has_bias:
        raise ValueError(f"hybrid does not support {BIAS_REASON}")
    ring_axis, a2a_axis = layouts.check_axes(axis_name)
    groups, group_rank = lax.axis_size(a2a_axis), lax.axis_index(a2a_axis)
    heads, kv_heads = query.shape[2], key.shape[2]
    reason = heads_violation(heads, groups)
    if reason is not None:
        raise ValueError(f"axis_name={axis_name!r}: {reason}")
    repeats = kv_repeats(heads, kv_heads, groups)
    if repeats > 1:
        key, value = jnp.repeat(key, repeats, axis=2), jnp.repeat(value, repeats, axis=2)

    def to_heads(x):  # [B, T/(R A), h, D] -> [B, T/R, h/A, D]: the group's chunk, in order
        return lax.all_to_all(x, a2a_axis, 2, 1, tiled=True)

    def chunk(x):  # [B, T/(R A)] -> [B, T/R]
        return None if x is None else lax.all_gather(x.astype(jnp.int32), a2a_axis, axis=1, tiled=True)

    sinks = softmax_aux
    if sinks is not None:
        if a2a_axis not in vma.varying_axes(sinks):  # one set for every device: its gradient sums over the group
            sinks = lax.pcast(sinks, (a2a_axis,), to="varying")
        sinks = lax.dynamic_slice_in_dim(sinks, group_rank * (heads // groups), heads // groups, axis=0)
    # On the CPU one exchange at a time (`tuner.support.ordering`).
    query, key, value = ordering.in_order(to_heads, [query, key, value])
    q_seg, kv_seg, q_pos, kv_pos = ordering.in_order(chunk, [q_segment_ids, kv_segment_ids, q_positions, kv_positions])
    out, lse = run_ring(query, key, value, spec=spec, backend=backend, fwd_params=config.fwd, bwd_params=config.bwd,
                        axis_name=ring_axis, layout=layout, interpret=interpret, q_segment_ids=q_seg,
                        kv_segment_ids=kv_seg, q_positions=q_pos, kv_positions=kv_pos, softmax_aux=sinks,
                        return_lse=True)
    out = ordering.ordered(lax.all_to_all(out, a2a_axis, 1, 2, tiled=True), value)  # -> [B, T/(R A), H, D]
    lse = lax.all_to_all(ordering.ordered(lse, out), a2a_axis, 2, 1, tiled=True)  # [B, H/A, T/R] -> [B, H, T/(R A)]
    return (out, lse) if return_lse else out


class Hybrid(AllToAll):
    """USP: all-to-all over the a2a axis, a block kernel's ring over the ring axis, all-to-all back (module
    docstring)."""

    summary_form = ("all-to-all to head groups over the second axis of axis_name (H % its size == 0), "
                    "the {kernel} ring over the first, all-to-all back")
    strategy = "hybrid"
    bias_reason = BIAS_REASON

    def shape_violation(self, shapes: LocalShapes, ring_size: int, group: int) -> str | None:
        return heads_violation(shapes.heads, group)

    def tile_shapes(self, shapes: LocalShapes, ring_size: int, group: int | None = None) -> LocalShapes:
        """What the inner ring runs on each device: the chunk of a head group (`exchanged` over the group)."""
        if group is None:
            raise ValueError("the hybrid runs over two mesh axes: its tile shapes need the group size")
        return exchanged(shapes, group)

    def key_shapes(self, shapes: LocalShapes, ring_size: int, group: int) -> tuple[LocalShapes, int]:
        return self.tile_shapes(shapes, ring_size, group), ring_size // group

    attention = staticmethod(hybrid_attention)


for _kernel in BACKENDS.values():
    registry.register(Hybrid(_kernel))

__all__ = ["Hybrid", "heads_violation", "hybrid_attention"]
