"""The config a decided call runs (`tuner.runtime.dispatch`): the cache's for its problem, else the
implementation's default; and the model's pick, with its config, where no measurement decided.

A cache that cannot be read costs speed only: the default runs, with one warning naming the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from tuner import registry
from tuner.cache import LOADER_BUSY_TIMEOUT_S, Cache, CacheError, row_config, warn_once
from tuner.runtime import modelled
from tuner.runtime.plan import Plan
from tuner.semantics import documents
from tuner.semantics.documents import DOCUMENTS
from tuner.semantics.problem import ProblemKey
from tuner.semantics.spec import AttentionSpec, LocalShapes

TUNED = ("exact", "compiled")  # config sources of a ring tuned for the problem: the model does not override it


class Placement(NamedTuple):
    """One device's shapes of a call on a ring of `ring_size` devices, `group` of them per ring position
    over two mesh axes (None over one): what `registry.tile_shapes` takes."""

    shapes: LocalShapes
    ring_size: int
    group: int | None


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Where a loader reads its configs: the cache file `db`, and the layout the loader was given (None, a
    ring layout, or `DOCUMENTS`), which says how a packed call without a declared packing gets its tiles."""

    db: str | None
    layout: str | None

    def plan(self, problem: ProblemKey, placement: Placement, spec: AttentionSpec, layout: str,
             implementation: registry.Implementation, fallback: str | None,
             unusable: CacheError | OSError | None = None, packed_tile: int | None = None) -> Plan:
        """The plan of `implementation` for `problem` (the call of `placement`), its config from the cache;
        the default, with one warning, when the cache cannot be read (`unusable`: the error reading its
        measurements already met, so a locked file is waited for once per decision, and a broken one warned
        about once). `packed_tile`: the default's tile, as a packed call's rows chose it; else a declared
        packing's."""
        def accept(row: dict[str, Any]) -> str | None:
            try:
                implementation.check(row_config(row))
            except ValueError as error:
                return str(error)
            return None

        shapes, ring_size, _ = placement
        tile = packed_tile or documents.declared_tile(problem.packing, shapes.q_len * ring_size, ring_size, spec)
        default = registry.default_config(implementation, registry.tile_shapes(implementation, *placement), spec,
                                          tile)
        cache = Cache(self.db, busy_timeout=LOADER_BUSY_TIMEOUT_S)
        name = implementation.name
        try:
            if unusable is not None:
                raise unusable
            found = cache.lookup(problem, registry.versions(implementation), accept)
        except (CacheError, OSError) as error:
            warn_once(cache.path, "unusable, using default params", str(error))
            return Plan(name, default, "fallback" if fallback else "default",
                        f"{fallback + '; ' if fallback else ''}cache unusable: {error}", problem, spec, layout)
        config = row_config(found.row) if found.row is not None else default
        reason = found.reason
        if found.row is None and spec.has_segments and problem.packing is None:
            reason += f"; packed rows without packing=: {self.packed_tiles(packed_tile)}"
        if fallback:
            return Plan(name, config, "fallback", f"{fallback}; {name} params: {found.source} ({reason})",
                        problem, spec, layout)
        return Plan(name, config, found.source, reason, problem, spec, layout)

    def by_model(self, verdict: modelled.Verdict, ring: Plan, placement: Placement,
                 unusable: CacheError | OSError | None, packed_tile: int | None) -> Plan:
        """The plan once the model has spoken: the strategy it picked (its config from the cache), unless
        the ring is tuned for this problem; its reason in front either way."""
        if verdict.strategy == "ring":
            return dataclasses.replace(ring, reason=f"{verdict.reason}; {ring.reason}")
        if ring.source in TUNED:
            return dataclasses.replace(ring, reason=f"{verdict.reason}, but {ring.backend} is tuned for this problem "
                                                    f"({ring.source}: {ring.reason}); strategy={verdict.strategy!r} "
                                                    f"runs the other")
        implementation = registry.get(verdict.implementation)
        problem = dataclasses.replace(ring.key, backend=implementation.name)
        plan = self.plan(problem, placement, ring.spec, ring.layout, implementation, None, unusable, packed_tile)
        return dataclasses.replace(plan, reason=f"{verdict.reason}; config: {plan.source} ({plan.reason})")

    def packed_tiles(self, packed_tile: int | None) -> str:
        """How a packed call with no declared packing and nothing tuned gets its tiles, and what to do better."""
        if packed_tile is not None:
            return f"tiles of at most {packed_tile}, as the rows' documents chose"
        declare = "declare the rows' packing (Packing.fit of a few batches' segment ids)"
        if self.layout == DOCUMENTS:
            tiles = ", ".join(map(str, documents.PACKED_TILES[:-1])) + f" or {documents.PACKED_TILES[-1]}"
            return (f"tiles of at most {tiles}, as each step's rows choose, one ring compiled for each; {declare} to "
                    f"compile one")
        return (f"default tiles of at most {documents.PACKED_TILE}; {declare}, or tune them with tuner.autotune, for "
                f"tiles chosen from their documents, or lay them out with layout='documents', which chooses them")


__all__ = ["Lookup", "Placement", "TUNED"]
