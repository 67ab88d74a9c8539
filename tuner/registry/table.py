"""The table of registered implementations: register, look up, and the questions every caller asks of
one through its optional hooks (its strategy, its mesh axes, the shapes it tunes and keys), and the cache
key of a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tuner.registry.contract import GATHERED, TWO_AXES, Config, Implementation
from tuner.registry.versions import current_versions
from tuner.semantics.problem import Problem, ProblemKey
from tuner.semantics.spec import AttentionSpec, LocalShapes


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


def registered_implementations() -> tuple[Implementation, ...]:
    """The registered implementations, in registration order."""
    return tuple(_REGISTRY.values())


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


def problem_tile_shapes(implementation: Implementation, problem: Problem) -> LocalShapes:
    """`tile_shapes` of `problem`: what `implementation`'s kernel runs on each device."""
    return tile_shapes(implementation, problem.shapes, problem.ring_size, problem.group)


def problem_key(problem: Problem, name: str, device_kind: str) -> ProblemKey:
    """The cache key of `problem` run by the implementation `name` on `device_kind`."""
    return key(get(name), problem.shapes, problem.spec, device_kind=device_kind, ring_size=problem.ring_size,
               layout=problem.layout, group=problem.group, packing=problem.packing)


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


__all__ = ["combine", "config_from_parts", "default_config", "find", "forward_tiles", "get", "key", "label",
           "mesh_axes", "names", "problem_key", "problem_tile_shapes", "register", "registered",
           "registered_implementations", "shape_violation", "strategy_of", "tile_shapes", "unregister", "versions"]
