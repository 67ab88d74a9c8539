"""One registry of attention implementations: the ring over each block kernel, the gathered mechanisms,
and whatever a user registers, as peers behind one contract.

An implementation is one way to compute exact attention of sharded queries over a sharded sequence
(`tuner.strategies.implementations` holds the built-in ones). It publishes its name, a frozen `Config` type of its
own, and the hooks the tools need; the tuner, the cache, the loader and the CLI reach implementations
only through this module, and treat configs as opaque data (`to_dict` / `from_dict`), so a new
implementation is one `register()` call and no change anywhere else.

A config holds the settings of each pass, `{"fwd": {...}, "bwd": {...}}`: the tuner tunes the passes an
objective times, combines the best forward of one trial with the best backward of another, and the
cache stores the two parts (its `fwd_params` and `bwd_params` columns).

The layer imports `support` and `semantics` only; `versions` holds the rule that makes a measurement
current, which the cache reads from here.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


from tuner.registry.versions import current_versions
from tuner.semantics.problem import Problem, ProblemKey
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.targets import compile_target

PARTS = ("fwd", "bwd")
OBJECTIVE_PARTS = {"fwd": ("fwd",), "bwd": ("bwd",), "fwd+bwd": PARTS}

# `backend="auto"` without a measurement takes the first of these that can run the call.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "scan"),
    "tpu": ("pallas_tpu", "scan"),
    "cpu": ("scan",),
}
FALLBACK = "scan"  # every platform, every feature

# How an implementation parallelizes over the ring's devices (`strategy_of`; `tuner.models.strategy_model` ranks them).
STRATEGIES = ("ring", "all_to_all", "all_gather", "hybrid")
# The strategies over two mesh axes, `axis_name=(ring_axis, group_axis)`: the layout is over the ring axis and
# each of its positions' chunk is cut evenly over the group axis (`mesh_axes`). Every other runs over one axis.
TWO_AXES = ("hybrid",)
GATHERED = "gathered"  # the gathered dense mechanisms: no strategy of their own, reachable only by `backend=`


@dataclass(frozen=True)
class Target:
    """Where a program will run: the jax platform, and whether kernels run in their interpreter."""

    platform: str
    interpret: bool = False

    @classmethod
    def here(cls, interpret: bool = False) -> Target:
        """The platform of the program being traced (`tuner.support.targets.compile_target`): the mesh of the
        enclosing `shard_map`, else this process's default jax platform."""
        return cls(compile_target()[0], bool(interpret))


class Config(Protocol):
    """An implementation's tunable settings: a frozen (hashable) dataclass that validates itself."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{"fwd": {...}, "bwd": {...}}` of JSON values; `from_dict` of it gives an equal config."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """The config of `to_dict`'s form; `ValueError` naming the part and the field that is wrong."""


class Space(Protocol):
    """The candidates of one implementation for one problem, as optuna parameters."""

    def suggest(self, trial: Any, default: Config, parts: tuple[str, ...]) -> Config:
        """A config sampled by an optuna `trial`: the `parts` tuned, the others as in `default`."""

    def params(self, config: Config, parts: tuple[str, ...]) -> dict[str, Any]:
        """The optuna parameters `suggest` names `config` by (to queue it as a trial)."""

    def config(self, params: dict[str, Any], default: Config) -> Config:
        """The config of a trial's parameters; parts it did not tune come from `default`."""

    def grid(self, default: Config, parts: tuple[str, ...]) -> list[Config]:
        """Every candidate of the tuned parts, for a grid search."""


@dataclass(frozen=True)
class ChoiceSpace:
    """The plain `Space`: each tuned field of each part takes one of its candidates (optuna parameter
    `"<part>.<field>"`); fields without candidates keep the default's value."""

    config_type: type
    fwd: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    bwd: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def choices(self, part: str) -> dict[str, tuple[Any, ...]]:
        return self.fwd if part == "fwd" else self.bwd

    def suggest(self, trial: Any, default: Config, parts: tuple[str, ...]) -> Config:
        values = default.to_dict()
        for part in parts:
            values[part].update({name: trial.suggest_categorical(f"{part}.{name}", candidates)
                                 for name, candidates in self.choices(part).items()})
        return self.config_type.from_dict(values)

    def params(self, config: Config, parts: tuple[str, ...]) -> dict[str, Any]:
        values = config.to_dict()
        return {f"{part}.{name}": values[part][name] for part in parts for name in self.choices(part)}

    def config(self, params: dict[str, Any], default: Config) -> Config:
        values = default.to_dict()
        for name, value in params.items():
            part, _, setting = name.partition(".")
            values[part][setting] = value
        return self.config_type.from_dict(values)

    def grid(self, default: Config, parts: tuple[str, ...]) -> list[Config]:
        """Each part's candidates walked side by side (the passes are separate, so covering each part's
        candidates once covers every combination that can win: the best of each are combined)."""
        values = default.to_dict()
        walks = {part: [dict(zip(self.choices(part), combo)) for combo in
                        itertools.product(*self.choices(part).values())] for part in parts}
        length = max((len(w) for w in walks.values()), default=1)
        return [self.config_type.from_dict({part: {**values[part], **(walks[part][i % len(walks[part])]
                                                                     if part in walks else {})}
                                            for part in PARTS}) for i in range(length)]


class Implementation(Protocol):
    """What the tools need from an implementation.

    Five members are optional, read through `strategy_of`, `strategy_choice`, `shape_violation`,
    `tile_shapes` and `key` (hasattr-guarded):

    - `strategy: str`, one of `STRATEGIES` or `GATHERED` (default: "ring" unless `gathered`), what
      `strategy=` selects it by; a strategy of `TWO_AXES` runs over two mesh axes (`mesh_axes`);
    - `engine: str`, the name of the block kernel it runs: where several implementations share a strategy,
      `strategy=` runs the one whose engine the platform prefers (`strategy_choice`, `PREFERENCE`);
    - `shape_violation(shapes, ring_size) -> str | None` (over two axes: `(shapes, ring_size, group)`),
      why one device's shapes on a ring of `ring_size` devices (of which `group` share each ring position)
      cannot run, checked when a call is resolved, so a call asking for it by name fails there and `auto`
      skips it;
    - `tile_shapes(shapes, ring_size, group) -> shapes`: the shapes its tile hooks (`default_config`,
      `space`, `violation`) take, when they are not one device's own: what its kernel runs, where it
      exchanges the shards first (all_to_all's whole sequence of a head group); read through `tile_shapes`;
    - `key_shapes(shapes, ring_size, group) -> (shapes, ring_size)`: the shapes and ring its config is
      tuned for, when they are not the call's own (the hybrid's: what its inner ring runs).
    """

    name: str
    summary: str  # one line: what it does, for tables
    config_type: type
    gathered: bool  # True when it gathers the whole sequence instead of running a ring
    packages: tuple[str, ...]  # packages besides jax whose version its measurements depend on ("triton")

    def available(self, target: Target) -> str | None:
        """None when it can run on `target`, else why not."""

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, *, return_lse: bool = False,
                 value_head_dim: int | None = None) -> str | None:
        """None when every feature of the call is honoured, else the first one that is not.
        `value_head_dim` is the values' head dim, passed only where it differs from `head_dim`."""

    def default_config(self, shapes: LocalShapes, spec: AttentionSpec, *, packed_tile: int | None = None) -> Config:
        """The heuristic default for one device's shapes. `packed_tile`: with segment ids, the longest tile
        the declared packing's documents want (`tuner.semantics.documents.declared_tile`); None where no
        packing is declared. An implementation without tiles has none to shorten."""

    def space(self, shapes: LocalShapes, spec: AttentionSpec) -> Space:
        """The candidates worth trying."""

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, config: Config, parts: tuple[str, ...]
                  ) -> str | None:
        """Why the `parts` of `config` cannot run for these shapes (checked before compiling), or None."""

    def check(self, config: Config) -> None:
        """`ValueError` naming a setting of `config` that this implementation cannot honour."""

    def code_hash(self) -> str:
        """Version of the code that builds it: part of every cache entry, so entries go stale when it
        changes (as they do when jax, or a package of `packages`, changes version)."""

    def vma_checked(self, target: Target) -> bool:
        """Whether a `shard_map` around it may keep its varying-axes check."""

    def attend(self, query: Any, key: Any, value: Any, *, spec: AttentionSpec, config: Config,
               axis_name: Hashable | None, layout: str, interpret: bool = False, **arrays: Any) -> Any:
        """The local shards' attention under `shard_map` over `axis_name`, for a call resolved to `spec`
        (`tuner.runtime.plan.resolve`: the masks, scale, soft cap, sinks and bias it has), on shards in
        `layout`; `arrays` are the per-call arrays of `tuner.runtime.plan.ARRAY_OPTIONS` (each may be None) and
        `return_lse`. Returns the output, and with `return_lse` the lse too."""


_REGISTRY: dict[str, Implementation] = {}


def register(implementation: Implementation, *, replace: bool = False) -> Implementation:
    """Add `implementation` under its name; `ValueError` when the name is taken (unless `replace`)."""
    name = implementation.name
    if not isinstance(name, str) or not name.isidentifier() or name == "auto":
        raise ValueError(f"implementation name must be an identifier other than 'auto', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"an implementation named {name!r} is registered already; pass replace=True to "
                         f"replace it")
    _REGISTRY[name] = implementation
    return implementation


@contextlib.contextmanager
def registered(implementation: Implementation) -> Iterator[Implementation]:
    """`implementation` registered for the duration of a `with` block (tests, experiments)."""
    register(implementation)
    try:
        yield implementation
    finally:
        unregister(implementation.name)


def unregister(name: str) -> None:
    """Remove the implementation `name` (`KeyError` when none is registered under it)."""
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered implementations' names, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Implementation:
    """The implementation called `name`; `ValueError` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {', '.join(['auto', *_REGISTRY])}, got {name!r}") from None


def find(name: str) -> Implementation | None:
    """The implementation called `name`, or None."""
    return _REGISTRY.get(name)


def strategy_of(implementation: Implementation) -> str:
    """How `implementation` parallelizes: its `strategy`, else "ring" unless it is `gathered` (`GATHERED`)."""
    declared = getattr(implementation, "strategy", None)
    if declared is not None:
        return declared
    return GATHERED if implementation.gathered else "ring"


def mesh_axes(implementation: Implementation) -> int:
    """The number of mesh axes `implementation` runs over: 2 for a strategy of `TWO_AXES`, else 1."""
    return 2 if strategy_of(implementation) in TWO_AXES else 1


def shape_violation(implementation: Implementation, shapes: LocalShapes, ring_size: int,
                    group: int | None = None) -> str | None:
    """Why `implementation` cannot run one device's `shapes` on a ring of `ring_size` devices (its optional
    hook); `group` is the size of the second mesh axis of a call over two (None over one axis)."""
    if (group is not None) != (mesh_axes(implementation) == 2):
        return (f"it runs over {mesh_axes(implementation)} mesh axis(es), this call over "
                f"{1 if group is None else 2}")
    hook = getattr(implementation, "shape_violation", None)
    if hook is None:
        return None
    return hook(shapes, ring_size) if group is None else hook(shapes, ring_size, group)


def tile_shapes(implementation: Implementation, shapes: LocalShapes, ring_size: int, group: int | None = None
                ) -> LocalShapes:
    """The shapes `implementation`'s tile hooks (`default_config`, `space`, `violation`) take for a call on
    one device's `shapes` on a ring of `ring_size` devices (`group` of them per ring position over two axes):
    its optional hook's, what its kernel runs; else `shapes`."""
    hook = getattr(implementation, "tile_shapes", None)
    return shapes if hook is None else hook(shapes, ring_size, group)


def key(implementation: Implementation, shapes: LocalShapes, spec: AttentionSpec, *, device_kind: str,
        ring_size: int, layout: str, group: int | None = None, packing: str | None = None) -> ProblemKey:
    """The cache key of a call of `implementation` on one device's `shapes`, on a ring of `ring_size` devices
    (`group` of them per ring position over two axes), with documents packed as `packing` says where the call
    declares it: the one place a key is built, by the search and the loader alike. It keys what the
    implementation's config is tuned for (its optional `key_shapes`)."""
    hook = getattr(implementation, "key_shapes", None)
    if hook is not None and group is not None:
        shapes, ring_size = hook(shapes, ring_size, group)
    return ProblemKey.of(shapes, spec, backend=implementation.name, device_kind=device_kind, ring_size=ring_size,
                         layout=layout, packing=packing)


def problem_key(problem: Problem, name: str, device_kind: str) -> ProblemKey:
    """The cache key of `problem` run by the implementation `name` on `device_kind`."""
    return key(get(name), problem.shapes, problem.spec, device_kind=device_kind, ring_size=problem.ring_size,
               layout=problem.layout, group=problem.group, packing=problem.packing)


def why_not(implementation: Implementation, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target,
            *, return_lse: bool = False, shapes: LocalShapes | None = None, ring_size: int = 1,
            group: int | None = None) -> str | None:
    """Why `implementation` cannot run this call on `target` (unavailable, a feature it lacks -- with
    `shapes`, their value head dim too --, or one device's `shapes` on a ring of `ring_size` it cannot split;
    `group`: `shape_violation`)."""
    reason = implementation.available(target)
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
        candidates = by_engine([i for i in _REGISTRY.values() if mesh_axes(i) == 2], target.platform)
    tries = _tries(candidates, spec, dtype, head_dim, target, return_lse=return_lse, shapes=shapes,
                   ring_size=ring_size, group=group)
    if tries and tries[-1][1] is None:
        return tries[-1][0], _passed_over(tries)
    if group is not None:
        raise ValueError(f"no implementation over two mesh axes can run this call: {'; '.join(_passed_over(tries))}")
    return get(FALLBACK), _passed_over(tries)


def _strategy_tries(strategy: str, spec: AttentionSpec, dtype: Any, head_dim: int, target: Target,
                    **placement: Any) -> list[tuple[Implementation, str | None]]:
    """The implementations of `strategy` as `strategy=` tries them on `target` (`by_engine`), up to the
    first that can run the call (`_tries`)."""
    candidates = by_engine([i for i in _REGISTRY.values() if strategy_of(i) == strategy], target.platform)
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


def fallback_for(implementation: Implementation) -> Implementation:
    """What a call of `implementation` falls back to when it fails to build: the implementation of its
    strategy over the `FALLBACK` kernel (the scan ring for a ring, `hybrid` for `hybrid_pallas_tpu`, which
    runs over the same mesh axes), else the `FALLBACK` ring."""
    strategy = strategy_of(implementation)
    same = [i for i in _REGISTRY.values() if strategy_of(i) == strategy and getattr(i, "engine", None) == FALLBACK]
    return same[0] if same else get(FALLBACK)


def label(name: str) -> str:
    """How tables and `tuner bench --mechanisms` name the implementation `name`: `ring/<kernel>` for a
    ring over a block kernel, else its name."""
    implementation = find(name)
    return name if implementation is None or implementation.gathered else f"ring/{name}"


def config_from_parts(implementation: Implementation, fwd: dict[str, Any], bwd: dict[str, Any]) -> Config:
    """`implementation`'s config from its two parts."""
    return implementation.config_type.from_dict({"fwd": fwd, "bwd": bwd})


def versions(implementation: Implementation) -> dict[str, str]:
    """The versions a measurement of `implementation` taken now carries (`tuner.cache` rows)."""
    return current_versions(implementation.code_hash(), triton="triton" in implementation.packages)


def default_config(implementation: Implementation, shapes: LocalShapes, spec: AttentionSpec,
                   packed_tile: int | None) -> Config:
    """`implementation`'s default config; `packed_tile` is passed only where a declared packing set it, so
    that an implementation written before packings were declared still answers."""
    if packed_tile is None:
        return implementation.default_config(shapes, spec)
    return implementation.default_config(shapes, spec, packed_tile=packed_tile)


def combine(implementation: Implementation, fwd_from: Config, bwd_from: Config) -> Config:
    """The config running the forward pass of `fwd_from` and the backward pass of `bwd_from`."""
    return config_from_parts(implementation, fwd_from.to_dict()["fwd"], bwd_from.to_dict()["bwd"])


def forward_tiles(config: Config) -> tuple[int, int] | None:
    """The (query, key) tile of the forward pass of `config`, where its forward part names them
    `block_q` and `block_kv` (the block kernels' `FwdParams`); None for a config without tiles. The
    documents layout plans for these tiles."""
    fwd = config.to_dict().get("fwd", {})
    tiles = fwd.get("block_q"), fwd.get("block_kv")
    return tiles if all(isinstance(t, int) and t > 0 for t in tiles) else None


__all__ = ["FALLBACK", "GATHERED", "OBJECTIVE_PARTS", "PARTS", "PREFERENCE", "STRATEGIES", "ChoiceSpace", "Config",
           "Implementation", "Space", "TWO_AXES", "Target", "by_engine", "choose", "combine",
           "config_from_parts", "default_config", "fallback_for", "find", "for_strategy", "forward_tiles",
           "get", "key", "label", "mesh_axes", "names", "problem_key", "register", "registered",
           "resolve_auto", "shape_violation", "strategy_choice", "strategy_of", "tile_shapes", "unregister",
           "versions", "why_not"]
