"""Resolve once: a call of attention turned into the plan every implementation runs from.

`resolve` is the one planning step of `ring_attention` and of the runtime loader (its calls and
`explain()`): it checks the arrays, builds the `AttentionSpec` (masks, scale, soft cap, sinks, bias,
the windows clipped to the positions the layout gives), says what one device sees (`LocalShapes`)
and picks the implementation that can honour the call on the target. The loader then adds what the
cache says (`tuner.runtime.measured`, `Cache.lookup`) and records the result as a `Plan`.

The implementations receive the plan's objects -- the spec, the config, the layout -- and not the
user's keywords, so a new mask option is a field of the spec and a rule of `tuner.semantics.masks`; the ring
resolves the mask information of every step once from them (`masks.ring_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from tuner.semantics import layouts
from tuner import registry
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import ProblemKey
from tuner.registry import Config
from tuner.semantics.spec import AttentionSpec, LocalShapes, build_spec, check_inputs, layout_span

MASK_OPTIONS = ("causal", "sliding_window", "chunk_size", "logits_soft_cap", "softmax_scale")
SELECTING = tuple(s for s in registry.STRATEGIES if s != "ring")  # each selects one of its implementations
ARRAY_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "softmax_aux", "bias")


@dataclass(frozen=True)
class Resolved:
    """What a call is, before any cache is read: its spec, one device's shapes, the implementation
    picked for it and, when that is not the platform's first choice, why (`fallback`)."""

    spec: AttentionSpec
    shapes: LocalShapes
    implementation: registry.Implementation
    fallback: str | None


def check_strategy(strategy: str, backend: str, axis_name: Any = None) -> str:
    """The strategy a call runs: `strategy`, or for "auto" with a pair `axis_name` the strategy over two mesh
    axes (`registry.TWO_AXES`). `ValueError` naming `strategy` for a value that is not one, naming `axis_name`
    when it does not fit the strategy or the backend (a pair is for an implementation over two axes, one
    axis for the others), and naming both `strategy` and `backend` when `backend` names an implementation of
    another strategy."""
    if not isinstance(strategy, str) or strategy not in ("auto", *registry.STRATEGIES):
        raise ValueError(f"strategy must be one of {', '.join(('auto', *registry.STRATEGIES))}, got {strategy!r}")
    axes = 2 if isinstance(axis_name, tuple) else 1
    if axes == 2:
        layouts.check_axes(axis_name)
        if strategy == "auto":
            strategy = registry.TWO_AXES[0]
    if strategy != "auto" and (strategy in registry.TWO_AXES) != (axes == 2):
        raise ValueError(f"strategy={strategy!r} runs over {3 - axes} mesh axis(es), got axis_name={axis_name!r}: "
                         f"pass {'axis_name=(ring_axis, group_axis)' if axes == 1 else 'one axis name'}, or "
                         f"another strategy")
    if backend == "auto":
        return strategy
    implementation = registry.get(backend)
    its = registry.strategy_of(implementation)
    if strategy != "auto" and its != strategy:
        raise ValueError(f"backend {backend!r} runs the {its!r} strategy, not strategy={strategy!r}: pass "
                         f"backend='auto' with strategy={strategy!r}, or strategy='auto' with backend={backend!r}")
    if registry.mesh_axes(implementation) != axes:
        raise ValueError(f"backend {backend!r} runs over {registry.mesh_axes(implementation)} mesh axis(es), got "
                         f"axis_name={axis_name!r}: pass "
                         f"{'one axis name' if axes == 2 else 'axis_name=(ring_axis, group_axis)'}")
    return strategy


def resolve(query, key, value, *, ring_size: int, layout: str, backend: str, target: registry.Target,
            mask: dict[str, Any], arrays: dict[str, Any], return_lse: bool = False, strategy: str = "auto",
            axis_name: Any = None, group: int | None = None) -> Resolved:
    """The `Resolved` call of `query`/`key`/`value` (local shards, or `ShapeDtypeStruct`s) on a ring of
    `ring_size` in `layout`, with the mask options `mask` (`MASK_OPTIONS`) and the per-call arrays
    `arrays` (`ARRAY_OPTIONS`, None when absent). `backend` names an implementation, or "auto" for
    the platform's preference; `strategy` ("auto" or one of `registry.STRATEGIES`) "all_to_all",
    "all_gather" or "hybrid" selects one of its implementations (`registry.for_strategy`: over the
    platform's preferred kernel that can run the call), "ring" keeps `backend` to a ring's
    (`check_strategy`). With a pair `axis_name=(ring_axis, group_axis)` the call is over two axes: `ring_size`
    is then every device the sequence is split over (R x A), `group` the second axis's A, and the layout
    applies over the R positions of the ring axis, each holding A shards.
    `ValueError` naming the argument for anything that cannot run, its shapes on this ring included."""
    strategy = check_strategy(strategy, backend, axis_name)
    if (group is None) != (not isinstance(axis_name, tuple)):
        raise ValueError(f"group={group!r} is the size of the second axis of a pair axis_name, got "
                         f"axis_name={axis_name!r}")
    unknown = sorted(set(mask) - set(MASK_OPTIONS)) + sorted(set(arrays) - set(ARRAY_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; mask options are {', '.join(MASK_OPTIONS)}, "
                        f"per-call arrays {', '.join(ARRAY_OPTIONS)}")
    arrays = {name: arrays.get(name) for name in ARRAY_OPTIONS}
    check_inputs(query, key, value, ring_size=ring_size, **arrays)
    for positions, x in (("q_positions", query), ("kv_positions", key)):
        if arrays[positions] is None:
            layouts.check_layout(layout, (group or 1) * x.shape[1])
    spec = build_spec(query, has_segments=arrays["q_segment_ids"] is not None, bias=arrays["bias"],
                      softmax_aux=arrays["softmax_aux"], **mask,
                      position_span=layout_span(ring_size, query.shape[1], key.shape[1], arrays["q_positions"],
                                                arrays["kv_positions"]))
    dtype, head_dim, shapes = jnp.dtype(query.dtype), query.shape[3], LocalShapes.of_shards(query, key, value)
    call = dict(return_lse=return_lse, shapes=shapes, ring_size=ring_size, group=group)
    if strategy in SELECTING or backend != "auto":
        try:
            if backend != "auto":
                implementation, passed_over = registry.choose(backend, spec, dtype, head_dim, target, **call), []
            else:
                implementation, passed_over = registry.for_strategy(strategy, spec, dtype, head_dim, target, **call)
        except ValueError as error:
            raise ValueError(f"axis_name={axis_name!r}: {error}" if group is not None else str(error)) from None
    else:
        implementation, passed_over = registry.resolve_auto(spec, dtype, head_dim, target, **call)
    return Resolved(spec, shapes, implementation, "; ".join(passed_over) or None)


@dataclass(frozen=True)
class Plan:
    """What the loader runs for one problem, and why: the registered implementation `backend` (a ring
    over a block kernel, a gathered mechanism, or one a user registered) with `config`, for the call
    whose spec is `spec` on shards in `layout`; `source` and `reason` say where the config came from,
    `key` is the problem's cache key. `predictions`, where the strategy model has the platform
    (`tuner.runtime.modelled`), are its `(strategy, predicted seconds, measured seconds or None)` of each strategy,
    fastest predicted first: the measured ones are `tuner bench --mechanisms` times."""

    backend: str
    config: Config
    source: str  # one of tuner.runtime.dispatch.SOURCES
    reason: str
    key: ProblemKey
    spec: AttentionSpec
    layout: str
    predictions: tuple[tuple[str, float, float | None], ...] | None = None

    @property
    def packed_default(self) -> bool:
        """Whether this is a packed call's default config with no packing declared: nothing in the cache,
        so the tiles can be chosen from the rows' documents (`tuner.semantics.documents.PACKED_TILES`)."""
        return self.source == "default" and self.spec.has_segments and self.key.packing is None

    @property
    def fwd_params(self) -> FwdParams | None:
        """The forward tiles of a ring's config (None for other implementations)."""
        fwd = getattr(self.config, "fwd", None)
        return fwd if isinstance(fwd, FwdParams) else None

    @property
    def bwd_params(self) -> BwdParams | None:
        """The backward tiles of a ring's config (None for other implementations)."""
        bwd = getattr(self.config, "bwd", None)
        return bwd if isinstance(bwd, BwdParams) else None


__all__ = ["ARRAY_OPTIONS", "MASK_OPTIONS", "SELECTING", "Plan", "Resolved", "check_strategy",
           "resolve"]
