"""`ring_attention`: the public call of exact attention over a sharded sequence, without the cache.

It resolves the call once (`tuner.runtime.plan.resolve`: the spec, one device's shapes, the implementation the
backend and strategy name), records it (`tuner.runtime.record`, as untunable: it reads no cache) and runs the
strategy: the ring (`tuner.strategies.ring.run_ring` over the named block kernel, with the caller's tiles or the
kernel's defaults), or the implementation of all_to_all, all_gather or the hybrid with its defaults. The
loader (`tuner.runtime.dispatch`) is the same call with the cache's decision.
"""

from __future__ import annotations

from collections.abc import Hashable


from tuner.semantics import layouts
from tuner.runtime import plan, record
from tuner import registry
from tuner.kernels.params import BwdParams, FwdParams
from tuner.support.checks import check_bool
from tuner.strategies.ring import block_kernel, group_size, ring_geometry, run_ring
from tuner.semantics.spec import normalize_window, optional_positive_float
from tuner.support.jitted import call_jitted
from tuner.support.targets import compile_target


def ring_attention(
    query,
    key,
    value,
    *,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    softmax_aux=None,
    bias=None,
    sliding_window: int | tuple[int, int] | None = None,
    chunk_size: int | None = None,
    causal: bool = False,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    axis_name: Hashable | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
    interpret: bool = False,
    return_lse: bool = False,
    strategy: str = "ring",
):
    """Exact attention of `query [B,Tq,H,D]` over `key`/`value [B,Tk,Hkv,D]`, differentiable.

    With `axis_name`, call it under `shard_map` on the local shards: the keys travel around the ring of
    that axis (only the `Hkv` heads travel) and each device gets the exact attention of its queries
    over the whole sequence. Token positions come from `layout` and the device's ring index unless
    `q_positions`/`kv_positions` `[B, T]` are given; masks (causal, sliding window, chunk, segment ids)
    are decided from them. Positions are int32, anywhere in its range; window sides and `chunk_size`
    are at most 2**31 - 1. With positions from the layout, a window at least as long as the sequence
    is no window (the same spec, kernel and cache key). `bias` is `[B, H, Tq, ring_size*Tk]` (or
    broadcastable) over the laid-out global key axis; `softmax_aux` (`[H]` or `[H, n]`) adds sink terms
    to every softmax denominator.

    `backend="auto"` picks the fastest backend that can run here and honours every option;
    `fwd_params`/`bwd_params` override its tiles. `interpret=True` runs kernel backends in their
    interpreter on the CPU (the pure-JAX scan backend runs the same either way). Returns the output in
    the query's dtype, and with `return_lse` also the float32 log-sum-exp `[B, H, Tq]`.

    `strategy="all_to_all"` (Ulysses: H % ring size == 0) or `"all_gather"` (K/V gathered whole) runs that
    strategy instead of the ring, its inner ring over the platform's preferred kernel that can run the call
    (Pallas on a TPU, Triton on a GPU, else scan; `backend="all_to_all_<kernel>"` names one), which takes
    `fwd_params`/`bwd_params`, else its defaults.
    `strategy="hybrid"` takes `axis_name=(ring_axis, group_axis)` under `shard_map` over both axes, the
    sequence sharded over both (ring axis outer) and `layout` over the ring axis: all-to-all over the
    second, a block kernel's ring over the first, the platform's as above (`tuner.strategies.hybrid`).
    ("auto", which picks by measurement, is `get_tuned_ring_attention`'s.)
    """
    if not isinstance(layout, str) or layout not in layouts.LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(layouts.LAYOUTS)}, got {layout!r}")
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string, got {backend!r}")
    if strategy == "auto":
        raise ValueError(f"strategy must be one of {', '.join(registry.STRATEGIES)} (ring_attention reads no "
                         f"cache: strategy='auto' is get_tuned_ring_attention's), got 'auto'")
    interpret, return_lse = check_bool("interpret", interpret), check_bool("return_lse", return_lse)
    for name, params, kind in (("fwd_params", fwd_params, FwdParams), ("bwd_params", bwd_params, BwdParams)):
        if params is not None and not isinstance(params, kind):
            raise ValueError(f"{name} must be a {kind.__name__} or None, got {type(params).__name__}")
    arrays = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                  kv_positions=kv_positions, softmax_aux=softmax_aux, bias=bias)
    mask = dict(causal=causal, sliding_window=sliding_window, chunk_size=chunk_size,
                logits_soft_cap=optional_positive_float("logits_soft_cap", logits_soft_cap),
                softmax_scale=optional_positive_float("softmax_scale", softmax_scale))
    strategy = plan.check_strategy(strategy, backend, axis_name)
    size, group = ring_geometry(axis_name)[0], group_size(axis_name)
    resolved = plan.resolve(query, key, value, ring_size=size, layout=layout, backend=backend, strategy=strategy,
                            target=registry.Target.here(bool(interpret)), mask=mask, arrays=arrays,
                            axis_name=axis_name, group=group)
    sizes = (size, group)
    if strategy in plan.SELECTING:
        return _run_strategy(query, key, value, resolved, arrays, mask, fwd_params, bwd_params, axis_name=axis_name,
                             sizes=sizes, layout=layout, backend=backend, interpret=bool(interpret),
                             return_lse=return_lse)
    chosen = block_kernel(resolved.implementation.name)
    shapes = resolved.shapes
    default = resolved.implementation.default_config(shapes, resolved.spec)
    given = [name for name, params in (("fwd_params", fwd_params), ("bwd_params", bwd_params)) if params is not None]
    fwd_params = fwd_params or default.fwd
    bwd_params = bwd_params or default.bwd
    chosen.check_params(fwd_params, bwd_params)
    noted = _note(query, key, value, arrays, mask, resolved, sizes, layout, backend, bool(interpret), return_lse,
                  reason=f"{' and '.join(given) or 'no params'} given by the caller, the rest "
                         f"{chosen.name}'s defaults; ring_attention does not read the cache")
    with record.scope(noted):
        return record.watch(noted, call_jitted(
            run_ring, dict(spec=resolved.spec, backend=chosen.name, fwd_params=fwd_params, bwd_params=bwd_params,
                           axis_name=axis_name, layout=layout, interpret=interpret, return_lse=return_lse),
            query, key, value, **arrays))


def _run_strategy(query, key, value, resolved: plan.Resolved, arrays: dict, mask: dict, fwd_params: FwdParams | None,
                  bwd_params: BwdParams | None, *, axis_name: Hashable | None, sizes: tuple[int, int], layout: str,
                  backend: str, interpret: bool, return_lse: bool):
    """`ring_attention` of a strategy other than the ring: its implementation's `attend`, with its default
    config where the caller gave no params."""
    implementation = resolved.implementation
    default = implementation.default_config(registry.tile_shapes(implementation, resolved.shapes, *sizes),
                                            resolved.spec).to_dict()
    given = {"fwd": fwd_params, "bwd": bwd_params}
    parts = [default[p] if given[p] is None else given[p].to_dict() for p in registry.PARTS]
    config = registry.config_from_parts(implementation, *parts)
    implementation.check(config)
    named = [f"{p}_params" for p in registry.PARTS if given[p] is not None]
    noted = _note(query, key, value, arrays, mask, resolved, sizes, layout, backend, interpret, return_lse,
                  reason=f"strategy {implementation.name}: {' and '.join(named) or 'no params'} given by the caller, "
                         f"the rest its defaults; ring_attention does not read the cache")
    with record.scope(noted):
        return record.watch(noted, call_jitted(
            implementation.attend, dict(spec=resolved.spec, config=config, axis_name=axis_name, layout=layout,
                                        interpret=interpret, return_lse=return_lse),
            query, key, value, **arrays))


def _note(query, key, value, arrays: dict, mask: dict, resolved: plan.Resolved, sizes: tuple[int, int],
          layout: str, backend: str, interpret: bool, return_lse: bool, reason: str) -> record.Call:
    """A `ring_attention` call on `sizes` = (devices, the second axis's size or None over one axis) as
    `tuner.runtime.record` keeps it (the doctor says it runs untuned params)."""
    platform, device_kind = compile_target()
    (size, group), strategy = sizes, registry.strategy_of(resolved.implementation)
    return record.Call(
        caller="ring_attention", query=record.struct_of(query), key=record.struct_of(key),
        value=record.struct_of(value), arrays={n: record.struct_of(x) for n, x in arrays.items() if x is not None},
        mask={**mask, "sliding_window": normalize_window(mask["sliding_window"])}, ring_size=size, layout=layout,
        backend=backend, return_lse=return_lse, interpret=interpret, db=None, platform=platform,
        device_kind=device_kind, strategy=strategy, a2a_size=group or 1,
        decision=dict(implementation=resolved.implementation.name, source="caller", reason=reason,
                      key=registry.key(resolved.implementation, resolved.shapes, resolved.spec,
                                       device_kind=device_kind, ring_size=size, layout=layout,
                                       group=group).as_dict()))


__all__ = ["ring_attention"]
