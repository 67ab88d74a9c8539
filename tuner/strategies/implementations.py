"""The built-in implementations of `tuner.registry`: the ring over each block kernel, and the gathered
mechanisms.

- `scan`, `triton`, `pallas_tpu`, `cudnn`: `tuner.ring_attention` over that block kernel (`tuner.kernels`);
  the config is a `TileConfig` (`tuner.strategies.configs`), forward and backward tiles.
- `dense`, `jax_nn`: every device all-gathers K/V and attends densely (`tuner.strategies.mechanisms`); nothing to
  tune (`NoConfig`), but measured against the rings by `tuner bench --mechanisms`, which can win at
  short lengths. Their strategy is `registry.GATHERED`, none of `strategy=`'s: they run when named by
  `backend=`, or under `auto` by measurement.
- `all_to_all`, `all_gather`, `hybrid` (and `<strategy>_<kernel>` for the other kernels): registered by
  their modules in `tuner.strategies` on `Exchanged`: they exchange shards over the ring's axis, then run
  a block kernel's ring over what they gathered (at ring size 1; the hybrid's over its ring axis); the
  config is that inner ring's `TileConfig`, sized for what it runs (`tile_shapes`).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from tuner.strategies import mechanisms
from tuner import registry
from tuner.kernels import BACKENDS, check_vma
from tuner.kernels.base import Backend, source_hash
from tuner.registry import ChoiceSpace, Target
from tuner.strategies.configs import (NoConfig, TileConfig, TileSpace, capped_where_accepted, kernel_default,
                                      parts_violation)
from tuner.strategies.ring import run_ring
from tuner.semantics import documents
from tuner.semantics.spec import AttentionSpec, LocalShapes


class Ring:
    """Ring attention over one block kernel (`tuner.kernels`): the keys travel, the queries stay. The
    ring driver runs the `kernel` of whichever registered implementation has one."""

    config_type = TileConfig
    gathered = False
    strategy = "ring"

    def __init__(self, backend: Backend):
        self.kernel = backend
        self.name = self.engine = backend.name
        self.summary = f"ring over the {backend.name} block kernel"
        self.packages = ("triton",) if backend.name == "triton" else ()

    def available(self, target: Target) -> str | None:
        return self.kernel.unavailable_reason(target.interpret, target.platform)

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, *, return_lse: bool = False,
                 value_head_dim: int | None = None) -> str | None:
        """The kernel's answer; the value head dim is passed where it differs, so a kernel written before
        values could differ still answers for equal dims."""
        if value_head_dim is None:
            return self.kernel.supports(spec, dtype, head_dim)
        return self.kernel.supports(spec, dtype, head_dim, value_head_dim)

    def default_config(self, shapes: LocalShapes, spec: AttentionSpec, *, packed_tile: int | None = None
                       ) -> TileConfig:
        """The kernel's default tiles: no longer than its `masked_tile` where positions mask tiles out, and
        with segment ids (packed documents) no longer than `packed_tile` (`documents.PACKED_TILE` unless a
        declared packing chose it), where the kernel accepts them, so that the masks can skip the tiles of
        other documents."""
        default = kernel_default(self.kernel, shapes.q_len, shapes.kv_len, shapes.head_dims, spec)
        if not spec.has_segments:
            return default
        return capped_where_accepted(self.kernel, shapes, spec, default,
                                     documents.PACKED_TILE if packed_tile is None else packed_tile)

    def space(self, shapes: LocalShapes, spec: AttentionSpec) -> registry.Space:
        return TileSpace(self.kernel.search_space(shapes, spec))

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, config: TileConfig, parts: tuple[str, ...]
                  ) -> str | None:
        return parts_violation(self.kernel, shapes, spec, config, parts)

    def check(self, config: TileConfig) -> None:
        self.kernel.check_params(config.fwd, config.bwd)

    def code_hash(self) -> str:
        return self.kernel.code_hash()

    def vma_checked(self, target: Target) -> bool:
        return check_vma(self.name, target.interpret)

    def attend(self, query, key, value, *, spec: AttentionSpec, config: TileConfig, axis_name: Hashable | None,
               layout: str, interpret: bool = False, **arrays: Any) -> Any:
        return run_ring(query, key, value, spec=spec, backend=self.name, fwd_params=config.fwd,
                        bwd_params=config.bwd, axis_name=axis_name, layout=layout, interpret=interpret, **arrays)


class Gathered:
    """All-gather K/V over the ring's axis, then dense attention for this device's queries."""

    config_type = NoConfig
    gathered = True
    strategy = registry.GATHERED  # none of `registry.STRATEGIES`: `strategy=` never selects it
    packages = ()

    def __init__(self, name: str, summary: str):
        self.name, self.summary = name, summary

    def available(self, target: Target) -> str | None:
        return "gathered mechanisms have no interpreter mode" if target.interpret else None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, *, return_lse: bool = False,
                 value_head_dim: int | None = None) -> str | None:
        return mechanisms.gathered_unsupported(self.name, spec, return_lse=return_lse, value_head_dim=value_head_dim)

    def default_config(self, shapes: LocalShapes, spec: AttentionSpec, *, packed_tile: int | None = None
                       ) -> NoConfig:
        return NoConfig()

    def space(self, shapes: LocalShapes, spec: AttentionSpec) -> registry.Space:
        return ChoiceSpace(NoConfig)

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, config: NoConfig, parts: tuple[str, ...]
                  ) -> str | None:
        return None

    def check(self, config: NoConfig) -> None:
        if not isinstance(config, NoConfig):
            raise ValueError(f"{self.name} has nothing to tune, got {config!r}")

    def code_hash(self) -> str:
        return source_hash(Path(mechanisms.__file__))

    def vma_checked(self, target: Target) -> bool:
        return True

    def attend(self, query, key, value, *, spec: AttentionSpec, config: NoConfig, axis_name: Hashable | None,
               layout: str, interpret: bool = False, **arrays: Any) -> Any:
        return mechanisms.gathered_attention(query, key, value, mechanism=self.name, spec=spec, axis_name=axis_name,
                                             layout=layout, **arrays)


class Exchanged:
    """The hooks shared by the implementations that exchange shards over the ring's axis and then run a
    block kernel's ring over what they gathered (`all_to_all`, `all_gather`, the hybrid), one registration
    per kernel (`engine`, the kernel's name): its availability, features (less bias: `bias_reason`) and
    tiles. Its tile hooks take what the kernel runs (`tile_shapes`, which each strategy defines; callers
    pass `registry.tile_shapes`), so its default, space and constraints are the kernel's there. Named after
    the strategy for the scan kernel, `<strategy>_<kernel>` for the others; `strategy=` runs the platform's
    preferred kernel that can (`registry.strategy_choice`)."""

    config_type = TileConfig
    gathered = True
    strategy: str
    summary_form: str  # the summary, with "{kernel}" for the kernel's name
    bias_reason: str

    def __init__(self, kernel: Backend | None = None) -> None:
        self.inner = kernel or BACKENDS["scan"]  # not `kernel`: the ring driver would take this for a ring
        self.engine = self.inner.name
        self.name = self.strategy if self.engine == "scan" else f"{self.strategy}_{self.engine}"
        self.summary = self.summary_form.format(kernel=self.engine)
        self.packages = ("triton",) if self.engine == "triton" else ()

    def tile_shapes(self, shapes: LocalShapes, ring_size: int, group: int | None = None) -> LocalShapes:
        """What the kernel runs on each device, for one device's `shapes` on this ring."""
        raise NotImplementedError

    @staticmethod
    def attention(query, key, value, **resolved: Any) -> Any:
        """The strategy's local call (`attend`'s arguments, and `backend`, the kernel)."""
        raise NotImplementedError

    def space(self, shapes: LocalShapes, spec: AttentionSpec) -> registry.Space:
        return TileSpace(self.inner.search_space(shapes, spec))

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, config: TileConfig, parts: tuple[str, ...]
                  ) -> str | None:
        return parts_violation(self.inner, shapes, spec, config, parts)

    def attend(self, query, key, value, *, spec: AttentionSpec, config: TileConfig, axis_name: Hashable | None,
               layout: str, interpret: bool = False, **arrays: Any) -> Any:
        return self.attention(query, key, value, spec=spec, config=config, axis_name=axis_name, layout=layout,
                              interpret=interpret, backend=self.engine, **arrays)

    def available(self, target: Target) -> str | None:
        return self.inner.unavailable_reason(target.interpret, target.platform)

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, *, return_lse: bool = False,
                 value_head_dim: int | None = None) -> str | None:
        if spec.has_bias:
            return self.bias_reason
        if value_head_dim is None:
            return self.inner.supports(spec, dtype, head_dim)
        return self.inner.supports(spec, dtype, head_dim, value_head_dim)

    def default_config(self, shapes: LocalShapes, spec: AttentionSpec, *, packed_tile: int | None = None
                       ) -> TileConfig:
        """The inner kernel's default tiles for what it runs: no longer than its `masked_tile` where
        positions mask tiles out, and with segment ids and a `packed_tile` (a declared packing's, or the
        documents layout's), no longer than it where the kernel accepts them (`capped_where_accepted`)."""
        default = kernel_default(self.inner, shapes.q_len, shapes.kv_len, shapes.head_dims, spec)
        if packed_tile is None or not spec.has_segments:
            return default
        return capped_where_accepted(self.inner, shapes, spec, default, packed_tile)

    def check(self, config: TileConfig) -> None:
        if not isinstance(config, TileConfig):
            raise ValueError(f"{self.name} takes a TileConfig, got {config!r}")
        self.inner.check_params(config.fwd, config.bwd)

    def code_hash(self) -> str:
        """The strategy's module and the kernel's code."""
        own = Path(sys.modules[type(self).__module__].__file__)
        return hashlib.sha256(f"{source_hash(own)} {self.inner.code_hash()}".encode()).hexdigest()[:12]

    def vma_checked(self, target: Target) -> bool:
        return check_vma(self.engine, target.interpret)


for _backend in BACKENDS.values():
    registry.register(Ring(_backend))


registry.register(Gathered("dense", "all-gather K/V, tuner.semantics.reference.dense_attention"))
registry.register(Gathered("jax_nn", "all-gather K/V, jax.nn.dot_product_attention"))


__all__ = ["Exchanged", "Gathered", "Ring"]
