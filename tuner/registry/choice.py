"""Which implementation runs a call: `backend="auto"`'s preference per platform, `strategy=`'s choice
among the implementations of a strategy, a named backend's check, and the fallback of one that fails to
build. Each says why it passed an implementation over.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from tuner.registry.contract import Implementation, Target
from tuner.registry.table import get, mesh_axes, registered_implementations, shape_violation, strategy_of
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes

# `backend="auto"` without a measurement takes the first of these that can run the call.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "scan"),
    "tpu": ("pallas_tpu", "scan"),
    "cpu": ("scan",),
}
FALLBACK = "scan"  # every platform, every feature
# The rings `backend="auto"` runs on a platform only where a measurement found them faster than its preference
# (`tuner.runtime.measured`); a search with backend auto tunes them too and times the winners side by side.
RIVALS: dict[str, tuple[str, ...]] = {
    "gpu": ("cudnn",),
}


def why_not(implementation: Implementation, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target | None,
            *, return_lse: bool = False, shapes: LocalShapes | None = None, ring_size: int = 1,
            group: int | None = None) -> str | None:
    """Why `implementation` cannot run this call on `target` (unavailable, a feature it lacks -- with
    `shapes`, their value head dim too --, or one device's `shapes` on a ring of `ring_size` it cannot split;
    `group`: `shape_violation`). `target` None asks about the call alone, wherever the implementation runs
    (a program compiled for a device this host lacks)."""
    reason = None if target is None else implementation.available(target)
    if reason is not None:
        return f"cannot run here: {reason}"
    # the value head dim only where it differs: an implementation written before values could differ still
    # answers for equal dims
    differs = {} if shapes is None or shapes.value_head_dim is None else {"value_head_dim": shapes.value_head_dim}
    reason = implementation.supports(spec, dtype, head_dim, return_lse=return_lse, **differs)
    if reason is not None:
        return f"does not support {reason}"
    reason = None if shapes is None else shape_violation(implementation, shapes, ring_size, group)
    return None if reason is None else f"cannot run these shapes: {reason}"


def problem_why_not(implementation: Implementation, problem: Problem, target: Target | None = None) -> str | None:
    """`why_not` of `problem`'s call: its features, dtype and one device's shapes on its ring (on `target`;
    None: wherever `implementation` runs, for a program compiled for a device this host lacks)."""
    return why_not(implementation, problem.spec, jnp.dtype(problem.dtype), problem.head_dim, target,
                   shapes=problem.shapes, ring_size=problem.ring_size, group=problem.group)


def taking(name: str, problem: Problem) -> Implementation:
    """The registered implementation `name`, for a program compiled for `problem` wherever it runs;
    `ValueError` saying why, with the name, where it cannot take the problem (`problem_why_not`)."""
    implementation = get(name)
    reason = problem_why_not(implementation, problem)
    if reason is not None:
        raise ValueError(f"{name} {reason}")
    return implementation


def by_engine(implementations: list[Implementation], platform: str) -> list[Implementation]:
    """`implementations`, those whose optional `engine` comes first in `platform`'s `PREFERENCE` first, in
    the order they were registered among equals (those without an engine, or with one the platform does
    not prefer, last)."""
    preference = PREFERENCE.get(platform, (FALLBACK,))

    def rank(implementation: Implementation) -> int:
        engine = getattr(implementation, "engine", None)
        return preference.index(engine) if engine in preference else len(preference)

    return sorted(implementations, key=rank)  # stable


def _tries(candidates: list[Implementation], spec: AttentionSpec, dtype: Any, head_dim: int, target: Target,
           **placement: Any) -> list[tuple[Implementation, str | None]]:
    """`candidates` in order, each with why it cannot run the call (`why_not`), up to the first that can
    (its reason None)."""
    tries = []
    for implementation in candidates:
        tries.append((implementation, why_not(implementation, spec, dtype, head_dim, target, **placement)))
        if tries[-1][1] is None:
            break
    return tries


def _passed_over(tries: list[tuple[Implementation, str | None]]) -> list[str]:
    """Why each implementation tried before the one that runs was passed over."""
    return [f"{implementation.name} {why}" for implementation, why in tries if why is not None]


def resolve_auto(spec: AttentionSpec, dtype: Any, head_dim: int, target: Target, *, return_lse: bool = False,
                 shapes: LocalShapes | None = None, ring_size: int = 1, group: int | None = None
                 ) -> tuple[Implementation, list[str]]:
    """The first implementation of the platform's preference that can run the call, and why each one
    before it was passed over. Over two mesh axes (`group` given) the candidates are the implementations
    over two axes, those whose `engine` the platform prefers first (`by_engine`); `ValueError` when none can
    run the call."""
    if group is None:
        candidates = [get(name) for name in PREFERENCE.get(target.platform, (FALLBACK,))]
    else:
        candidates = by_engine([i for i in registered_implementations() if mesh_axes(i) == 2], target.platform)
    tries = _tries(candidates, spec, dtype, head_dim, target, return_lse=return_lse, shapes=shapes,
                   ring_size=ring_size, group=group)
    if tries and tries[-1][1] is None:
        return tries[-1][0], _passed_over(tries)
    if group is not None:
        raise ValueError(f"no implementation over two mesh axes can run this call: {'; '.join(_passed_over(tries))}")
    return get(FALLBACK), _passed_over(tries)


def contenders(problem: Problem, target: Target) -> tuple[list[Implementation], list[str]]:
    """What a search with backend "auto" tunes for `problem` on `target`: the implementation auto runs with
    nothing measured (`resolve_auto`), then each of the platform's `RIVALS` that can run the problem; and why
    each rival that cannot was passed over. A problem over two mesh axes has no rivals (they are rings)."""
    dtype = jnp.dtype(problem.dtype)
    placement = dict(shapes=problem.shapes, ring_size=problem.ring_size, group=problem.group)
    preferred = resolve_auto(problem.spec, dtype, problem.head_dim, target, **placement)[0]
    if problem.group is not None:
        return [preferred], []
    chosen, passed_over = [preferred], []
    for rival in (get(name) for name in RIVALS.get(target.platform, ()) if name != preferred.name):
        reason = why_not(rival, problem.spec, dtype, problem.head_dim, target, **placement)
        if reason is None:
            chosen.append(rival)
        else:
            passed_over.append(f"{rival.name} {reason}")
    return chosen, passed_over


def _strategy_tries(strategy: str, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target,
                    **placement: Any) -> list[tuple[Implementation, str | None]]:
    """The implementations of `strategy` as `strategy=` tries them on `target` (`by_engine`), up to the
    first that can run the call (`_tries`)."""
    candidates = by_engine([i for i in registered_implementations() if strategy_of(i) == strategy], target.platform)
    return _tries(candidates, spec, dtype, head_dim, target, **placement)


def _chosen(tries: list[tuple[Implementation, str | None]]) -> tuple[Implementation | None, str | None]:
    """`strategy_choice` of these tries."""
    if not tries:
        return None, "no implementation of it is registered"
    if tries[-1][1] is None:
        return tries[-1][0], None
    return None, next((r for i, r in tries if getattr(i, "engine", None) == FALLBACK), tries[0][1])


def strategy_choice(strategy: str, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target, *,
                    return_lse: bool = False, shapes: LocalShapes | None = None, ring_size: int = 1,
                    group: int | None = None) -> tuple[Implementation | None, str | None]:
    """The implementation `strategy=` runs for this call and None; or None and why none can. Of the
    implementations of `strategy`, the first that can run the call, those whose `engine` comes first in
    the platform's `PREFERENCE` first, then in the order they were registered; the reason given is that of
    the one over the `FALLBACK` kernel (or of the first)."""
    return _chosen(_strategy_tries(strategy, spec, dtype, head_dim, target, return_lse=return_lse, shapes=shapes,
                                   ring_size=ring_size, group=group))


def for_strategy(strategy: str, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target, *,
                 return_lse: bool = False, shapes: LocalShapes | None = None, ring_size: int = 1,
                 group: int | None = None) -> tuple[Implementation, list[str]]:
    """`strategy_choice`'s implementation, and why each one the platform prefers to it was passed over (Pallas
    on a TPU for float16, say); `ValueError` naming `strategy` and saying why where none can run the call."""
    tries = _strategy_tries(strategy, spec, dtype, head_dim, target, return_lse=return_lse, shapes=shapes,
                            ring_size=ring_size, group=group)
    implementation, reason = _chosen(tries)
    if implementation is None:
        fallback = "use strategy='auto' to fall back to one that can" if group is None else \
            "the call is over two mesh axes: fix what is named, or pass one axis name"
        raise ValueError(f"strategy {strategy!r} {reason}; {fallback}")
    return implementation, _passed_over(tries)


def choose(name: str, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target, *,
           return_lse: bool = False, shapes: LocalShapes | None = None, ring_size: int = 1,
           group: int | None = None) -> Implementation:
    """Resolve `name` ("auto" or an implementation's name, as `backend=` gives it) for this call: a named
    one that cannot run it raises `ValueError` saying why, naming `backend`; "auto" takes the platform's
    preference."""
    placement = dict(shapes=shapes, ring_size=ring_size, group=group)
    if name == "auto":
        return resolve_auto(spec, dtype, head_dim, target, return_lse=return_lse, **placement)[0]
    implementation = get(name)
    reason = why_not(implementation, spec, dtype, head_dim, target, return_lse=return_lse, **placement)
    if reason is not None:
        fallback = "use backend='auto' to fall back to one that can" if group is None else \
            "the call is over two mesh axes: fix what is named, or pass one axis name"
        raise ValueError(f"backend {name!r} {reason}; {fallback}")
    return implementation


def over_kernel(kernel: str, backend: str, axes: int) -> Implementation:
    """The implementation over the block kernel `kernel` that `backend` names, over `axes` mesh axes: for
    "auto", the ring over it (over two axes, the first registered over two); `ValueError` naming `backend`
    and saying what would do where it runs another kernel or over the other number of axes."""
    over = [i for i in registered_implementations() if getattr(i, "engine", None) == kernel]
    if backend == "auto":
        fitting = [i for i in over if mesh_axes(i) == axes and (axes == 2 or strategy_of(i) == "ring")]
        if not fitting:
            raise ValueError(f"no implementation over the {kernel} kernel runs over {axes} mesh axes")
        return fitting[0]
    named = next((i for i in over if i.name == backend), None)
    if named is None:
        raise ValueError(f"backend must be auto or one over the {kernel} kernel ({', '.join(i.name for i in over)}), "
                         f"got {backend!r}")
    if mesh_axes(named) != axes:
        raise ValueError(f"backend {backend!r} runs over {mesh_axes(named)} mesh axes, the problem over {axes}")
    return named


def fallback_for(implementation: Implementation) -> Implementation:
    """What a call of `implementation` falls back to when it fails to build: the implementation of its
    strategy over the `FALLBACK` kernel (the scan ring for a ring, `hybrid` for `hybrid_pallas_tpu`, which
    runs over the same mesh axes), else the `FALLBACK` ring."""
    strategy = strategy_of(implementation)
    same = [i for i in registered_implementations()
            if strategy_of(i) == strategy and getattr(i, "engine", None) == FALLBACK]
    return same[0] if same else get(FALLBACK)


__all__ = ["FALLBACK", "PREFERENCE", "RIVALS", "by_engine", "choose", "contenders", "fallback_for", "for_strategy",
           "over_kernel", "problem_why_not", "resolve_auto", "strategy_choice", "taking", "why_not"]
