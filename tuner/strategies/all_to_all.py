"""The all-to-all (Ulysses) strategy: trade the sequence split for a head split, attend locally, trade back.

On each of the P devices of the ring's axis, the sequence shards `[B, T/P, H, D]` of q, k and v are
exchanged with `jax.lax.all_to_all` into full-length blocks of a head group, `[B, T, H/P, D]`; the
device attends over the whole sequence with a block kernel's ring at ring size 1
(`tuner.strategies.ring.run_ring`; registered once per kernel, `all_to_all` over the scan kernel), and
the output (and lse `[B, H/P, T]`) is exchanged back to `[B, T/P, H, D]` (`[B, H, T/P]`). Two
all-to-alls each way, instead of P - 1 ring steps: it wins where the ring's transfers cannot hide.

- Positions: the gathered tokens keep their GLOBAL positions (the layout's, all-gathered when given
  per call), so causal, window and chunk masks are exact in every layout; segment ids are
  all-gathered likewise.
- Heads: the H query heads must split over P (`H % P == 0`), else the call is refused when it is resolved
  (`shape_violation`: asked for by name, `ValueError`; under `auto`, skipped), and `attend` raises too.
  Only the Hkv key/value heads travel. When `Hkv % P != 0`, each kv head is repeated `r = P / gcd(Hkv, P)`
  times (the fewest that make the head count a multiple of P; `r` divides the group size H / Hkv because
  P divides H), so that each device's query heads meet exactly their own kv heads; the gradient of the
  copies sums back.
- Sinks (`[H]` or `[H, n]`): each device takes its head group's rows. No bias: a bias over the laid-out
  key axis would have to be exchanged too; the ring supports it.
- Config: the inner ring's `TileConfig`, tuned as a ring's on what it runs (`tile_shapes`, `exchanged`:
  `T` tokens of `H/P` query heads): its default, space and constraints are the kernel's there.
- Backward: jax's autodiff through the all-to-alls (the transpose of one is one) and the inner ring's
  `custom_vjp`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
from jax import lax

from tuner.semantics import layouts
from tuner.support import ordering
from tuner import registry
from tuner.support import vma
from tuner.kernels import BACKENDS
from tuner.strategies.implementations import Exchanged
from tuner.strategies.configs import TileConfig
from tuner.strategies.ring import ring_geometry, run_ring
from tuner.semantics.spec import AttentionSpec, LocalShapes

BIAS_REASON = "bias: the all-to-all exchange does not carry a bias over the key axis; the ring supports it"


def heads_violation(heads: int, ring_size: int) -> str | None:
    """Why `heads` query heads do not split over `ring_size` devices, or None."""
    if heads % ring_size:
        return (f"all_to_all splits the query heads over the ring: heads ({heads}) must be a multiple "
                f"of the ring size ({ring_size})")
    return None


def kv_repeats(heads: int, kv_heads: int, ring_size: int) -> int:
    """How many copies of each kv head make the kv heads split over `ring_size` devices with every
    device's query heads meeting their own kv heads: 1 when `kv_heads % ring_size == 0`, else the
    fewest, `ring_size / gcd(kv_heads, ring_size)`. `ValueError` when the query heads do not split."""
    reason = heads_violation(heads, ring_size)
    if reason is not None:
        raise ValueError(f"{reason}; use a ring backend")
    return ring_size // math.gcd(kv_heads, ring_size)


def exchanged(shapes: LocalShapes, group: int) -> LocalShapes:
    """One device's shapes after an all-to-all over `group` devices trades its sequence shard for a head
    group: `group` times the tokens, `1 / group` of the query heads, and of the kv heads repeated to the
    fewest copies that split (`kv_repeats`). `ValueError` when the query heads do not split."""
    if shapes.heads % group:
        raise ValueError(f"heads ({shapes.heads}) must be a multiple of the all-to-all group ({group})")
    kv_heads = shapes.kv_heads * kv_repeats(shapes.heads, shapes.kv_heads, group) // group
    return dataclasses.replace(shapes, q_len=group * shapes.q_len, kv_len=group * shapes.kv_len,
                               heads=shapes.heads // group, kv_heads=kv_heads)


def all_to_all_attention(query, key, value, *, spec: AttentionSpec, config: TileConfig, axis_name: Hashable | None,
                         layout: str, interpret: bool = False, backend: str = "scan", q_segment_ids=None,
                         kv_segment_ids=None, q_positions=None, kv_positions=None, softmax_aux=None, bias=None,
                         return_lse: bool = False) -> Any:
    """This device's output (and lse) for a call resolved to `spec`, under `shard_map` over
    `axis_name`, on shards in `layout` (module docstring), the inner ring over the block kernel `backend`.
    Arrays as in `tuner.ring_attention`."""
    if bias is not None or spec.has_bias:
        raise ValueError(f"all_to_all does not support {BIAS_REASON}")
    size, rank = ring_geometry(axis_name)
    b, tq, heads, _ = query.shape
    tk, kv_heads = key.shape[1], key.shape[2]
    repeats = kv_repeats(heads, kv_heads, size)
    if repeats > 1:
        key, value = jnp.repeat(key, repeats, axis=2), jnp.repeat(value, repeats, axis=2)

    def to_heads(x):  # [B, T/P, h, D] -> [B, T, h/P, D], tokens in ring order
        return x if axis_name is None else lax.all_to_all(x, axis_name, 2, 1, tiled=True)

    def gathered(x):  # [B, T/P] -> [B, T], in ring order
        if x is None or axis_name is None:
            return x
        return lax.all_gather(x.astype(jnp.int32), axis_name, axis=1, tiled=True)

    def positions(explicit, local: int):  # gathered already, or made here
        if explicit is not None:
            return explicit
        order = jnp.asarray(layouts.global_order(layout, local * size, size), jnp.int32)
        return jnp.broadcast_to(order, (b, local * size))

    sinks = softmax_aux
    if sinks is not None and axis_name is not None:
        if axis_name not in vma.varying_axes(sinks):  # one set for every device: its gradient sums over the ring
            sinks = lax.pcast(sinks, (axis_name,), to="varying")
        group = heads // size
        sinks = lax.dynamic_slice_in_dim(sinks, rank * group, group, axis=0)
    # On the CPU one exchange at a time (`tuner.support.ordering`).
    query, key, value = ordering.in_order(to_heads, [query, key, value])
    q_seg, kv_seg, q_pos, kv_pos = ordering.in_order(gathered, [q_segment_ids, kv_segment_ids, q_positions,
                                                                kv_positions])
    out, lse = run_ring(query, key, value, spec=spec, backend=backend, fwd_params=config.fwd, bwd_params=config.bwd,
                        axis_name=None, layout=layout, interpret=interpret, q_segment_ids=q_seg,
                        kv_segment_ids=kv_seg, q_positions=positions(q_pos, tq), kv_positions=positions(kv_pos, tk),
                        softmax_aux=sinks, return_lse=True)
    if axis_name is not None:
        out = ordering.ordered(lax.all_to_all(out, axis_name, 1, 2, tiled=True), value)  # -> [B, T/P, H, D]
        lse = lax.all_to_all(ordering.ordered(lse, out), axis_name, 2, 1, tiled=True)  # [B, H/P, T] -> [B, H, T/P]
    return (out, lse) if return_lse else out


class AllToAll(Exchanged):
    """Ulysses: all-to-all from sequence shards to head groups, a block kernel's ring at ring size 1 over
    the whole sequence, all-to-all back (module docstring)."""

    summary_form = ("all-to-all to head groups (H % P == 0; kv heads repeated when Hkv % P != 0), "
                    "{kernel} over the whole sequence, all-to-all back")
    strategy = "all_to_all"
    bias_reason = BIAS_REASON

    def shape_violation(self, shapes: LocalShapes, ring_size: int) -> str | None:
        return heads_violation(shapes.heads, ring_size)

    def tile_shapes(self, shapes: LocalShapes, ring_size: int, group: int | None = None) -> LocalShapes:
        """The whole sequence of a head group (`exchanged` over the ring)."""
        return exchanged(shapes, ring_size)

    attention = staticmethod(all_to_all_attention)


for _kernel in BACKENDS.values():
    registry.register(AllToAll(_kernel))

__all__ = ["AllToAll", "all_to_all_attention", "exchanged", "heads_violation", "kv_repeats"]
