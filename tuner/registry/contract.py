"""The contract of an implementation: the `Implementation` protocol, its `Config` and `Space`, the
plain `ChoiceSpace`, the `Target` a call runs on, and the names of the strategies and passes.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.targets import compile_target

PARTS = ("fwd", "bwd")
OBJECTIVE_PARTS = {"fwd": ("fwd",), "bwd": ("bwd",), "fwd+bwd": PARTS}

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


__all__ = ["GATHERED", "OBJECTIVE_PARTS", "PARTS", "STRATEGIES", "TWO_AXES", "ChoiceSpace", "Config",
           "Implementation", "Space", "Target"]
