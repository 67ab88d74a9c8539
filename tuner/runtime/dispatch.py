"""The runtime loader (DESIGN section 9): tuned ring attention, decided at trace time from the cache.

    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)  # zigzag, laid out for you
    out = attn(q, k, v)                                 # global arrays in token order
    attn.explain(q, k, v)                               # what it would run, and why

    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="contiguous")
    out = attn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)   # local shards, inside shard_map over "sp"

At trace time the callable resolves the call once (`tuner.runtime.plan.resolve`: its spec, one device's shapes,
the platform's implementation), builds the problem key from the shapes it sees, picks the implementation
from `tuner.registry` (`auto`: by measurement, `tuner.runtime.measured` -- the one `tuner bench --mechanisms`
measured fastest for this problem, a ring or gathered dense attention when that is faster at this
length, else the one whose tuned entry for this problem is the fastest -- else, on a TPU or an H100, the
strategy model's pick (`tuner.runtime.modelled`: all_to_all or all_gather when predicted 10% faster than an
untuned ring) -- else the platform's preferred ring, else scan when that one is missing, does not support
the features, or fails to build; `strategy=` narrows the choice to one strategy) and its
config (cache lookup: exact, nearest, shipped, else the implementation's default). The result is a
`tuner.runtime.plan.Plan` (`explain()` returns it), and the implementation runs from its spec, config and
layout. It never tunes. Whatever the cache holds, a training step traces, runs and is exact: a missing,
unreadable, corrupt or locked cache file (waited for at most `tuner.cache.LOADER_BUSY_TIMEOUT_S`) and
every invalid row cost speed only, with one WARNING naming the file, the row and what is wrong; a tuned
variant that fails to build falls back to its strategy over the scan kernel, at its defaults
(`registry.fallback_for`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tuner.semantics import layouts
from tuner.semantics.documents import DOCUMENTS
from tuner.semantics.packing import Packing
from tuner.runtime import agreement, configured, measured, meshed, modelled, plan, record
from tuner import registry
from tuner.cache import LOADER_BUSY_TIMEOUT_S, Cache, CacheError, writes
from tuner.support.checks import check_bool, check_int
from tuner.support.jitted import call_jitted
from tuner.runtime.plan import Plan
from tuner.strategies.ring import group_size, ring_geometry
from tuner.semantics.spec import LocalShapes, build_spec, check_call_arrays, normalize_window, optional_positive_float
from tuner.support.targets import compile_target

log = logging.getLogger("tuner.runtime.dispatch")

CALL_OPTIONS = (*plan.ARRAY_OPTIONS, "return_lse", "interpret")
SOURCES = ("exact", "compiled", "nearest", "shipped", "default", "fallback", "measured")
DEFAULT_LAYOUT = "zigzag"  # what `tuner search` tunes by default, and the loader uses with mesh=
LOADER_LAYOUTS = (*layouts.LAYOUTS, DOCUMENTS)


Decision = Plan  # what `explain()` returns: the plan of the call (`tuner.runtime.plan.Plan`)


class TunedRingAttention:
    """`attn(query, key, value, **per_call_options)`: ring attention with tuned params (see the module
    docstring). Per-call options: q/kv segment ids and positions, `softmax_aux`, `bias`, `return_lse`,
    `interpret` -- as in `tuner.ring_attention`."""

    def __init__(self, *, axis_name: Hashable | None, causal: bool, sliding_window, chunk_size,
                 logits_soft_cap, softmax_scale, layout: str, backend: str, db, mesh: Mesh | None,
                 strategy: str = "auto", packing: str | None = None, laid_out: bool = False):
        if layout is not None and (not isinstance(layout, str) or layout not in LOADER_LAYOUTS):
            raise ValueError(f"layout must be one of {', '.join(LOADER_LAYOUTS)} or None, got {layout!r}")
        meshed.check_arguments(mesh, axis_name, layout, laid_out)
        if db is not None and not isinstance(db, (str, os.PathLike)):
            raise ValueError(f"db must be the path of a cache file (a str or os.PathLike) or None, got {db!r}")
        if backend != "auto":
            registry.get(backend)
        strategy = plan.check_strategy(strategy, backend, axis_name)
        if layout is None and mesh is not None:
            layout = DEFAULT_LAYOUT
        self.axis_name, self.layout, self.backend, self.mesh = axis_name, layout, backend, mesh
        self.strategy = strategy
        self.options = dict(causal=causal, sliding_window=normalize_window(sliding_window),
                            chunk_size=chunk_size,
                            logits_soft_cap=optional_positive_float("logits_soft_cap", logits_soft_cap),
                            softmax_scale=optional_positive_float("softmax_scale", softmax_scale))
        build_spec(jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), has_segments=False, bias=None,
                   softmax_aux=None, **self.options)  # the scalar options fail here, not at trace time
        if packing is not None:
            try:
                packing = Packing.parse(packing).describe()
            except ValueError as error:
                raise ValueError(f"packing: {error}") from None
        self.db, self.packing = db, packing
        self._configs = configured.Lookup(db, layout)
        self._decisions: dict[tuple, Decision] = {}
        self._agreed: dict[tuple, Decision] = {}  # the decisions of traced calls, agreed across processes
        self._writes = writes()
        self._global = None if mesh is None else meshed.GlobalCall(
            mesh=mesh, axis_name=axis_name, layout=layout, causal=causal, window=self.options["sliding_window"],
            laid_out=laid_out, packing=packing, local=self._local, decide=self._decide)

    # ----------------------------------------------------------------------------------------------

    def __call__(self, query, key, value, **per_call_options):
        options = _check_call_options(per_call_options)
        if self.mesh is None:
            return self._local(query, key, value, options)
        return self._global(query, key, value, options)

    def explain(self, query, key, value, *, ring_size: int | tuple[int, int] | None = None,
                **per_call_options) -> Decision:
        """The decision `attn(query, key, value, **per_call_options)` would take, without running it.

        Arrays (or `jax.ShapeDtypeStruct`s) are global with `mesh=`, else the local shards; `ring_size`
        defaults to the mesh axis, or 1 without `axis_name`; over two axes it is the pair of their sizes
        `(R, A)`. In the documents layout, a packed call with no packing declared and nothing tuned takes
        its tile in each step from its rows: given their values, the plan is that tile's; given shapes,
        the plan before the choice, whose reason says so.
        """
        options = _check_call_options(per_call_options)
        pair = isinstance(self.axis_name, tuple)
        if self.mesh is not None:
            devices, ring = self._global.sizes()
            given = (ring, devices // ring) if pair else devices
            if ring_size is not None and ring_size != given:
                raise ValueError(f"ring_size={ring_size} does not match mesh axis {self.axis_name!r} of "
                                 f"size {given}")
            ring_size = given
        elif ring_size is None and self.axis_name is not None:
            raise ValueError(f"explain() needs ring_size= when axis_name is set without mesh="
                             f"{' (over two axes: the pair of their sizes, (R, A))' if pair else ''}")
        if pair:
            if not (isinstance(ring_size, tuple) and len(ring_size) == 2):
                raise ValueError(f"ring_size must be the pair (R, A) of the sizes of axis_name={self.axis_name!r}, "
                                 f"got {ring_size!r}")
            for name, n in zip(("ring_size[0]", "ring_size[1]"), ring_size):
                check_int(name, n)
            size, a2a = ring_size[0] * ring_size[1], ring_size[1]
        else:
            size, a2a = check_int("ring_size", 1 if ring_size is None else ring_size), None
        if self.mesh is None:
            return self._decide(query, key, value, size, options, a2a, expect=True)
        return self._global.explain(query, key, value, options, a2a)

    @property
    def traced(self) -> list[Decision]:
        """The plans of the calls this callable has traced, one per problem (and per tile, where a packed
        call's rows choose it in the step): what they run. In a multi-process program these are process
        0's on every process (`tuner.runtime.agreement`)."""
        return list(self._agreed.values())

    # ----------------------------------------------------------------------------------------------

    def _local(self, query, key, value, options: dict[str, Any], *, packed_tile: int | None = None):
        size, group = ring_geometry(self.axis_name)[0], group_size(self.axis_name)
        decision = self._decide(query, key, value, size, options, group, agree=True, packed_tile=packed_tile)
        noted = self._note(query, key, value, size, group or 1, options, decision)
        if record.observing() and options.get("q_segment_ids") is not None and self.packing is None:
            rank, positions = self._shard_place(query.shape[1], options.get("q_positions"), decision)
            record.note_segments(noted, rank, options["q_segment_ids"], positions)
        with record.scope(noted):
            return record.watch(noted, self._attend(query, key, value, options, decision))

    def _shard_place(self, length: int, positions, decision: Decision) -> tuple:
        """(this device's index among every device of the call, its query tokens' global positions or None
        where the layout gives them), for `record.note_segments`."""
        if not isinstance(self.axis_name, tuple):
            return (0 if self.axis_name is None else jax.lax.axis_index(self.axis_name)), positions
        ring_axis, group_axis = self.axis_name
        rank = jax.lax.axis_index(ring_axis) * jax.lax.axis_size(group_axis) + jax.lax.axis_index(group_axis)
        if positions is None:
            positions = layouts.grouped_positions(decision.layout, length, self.axis_name)
        return rank, positions

    def _attend(self, query, key, value, options: dict[str, Any], decision: Decision):
        arrays = {n: v for n, v in options.items() if n in plan.ARRAY_OPTIONS}
        call = dict(spec=decision.spec, axis_name=self.axis_name, layout=decision.layout,
                    interpret=bool(options.get("interpret")), return_lse=bool(options.get("return_lse")))
        try:
            return call_jitted(registry.get(decision.backend).attend, dict(config=decision.config, **call),
                               query, key, value, **arrays)
        except Exception as error:  # noqa: BLE001 - a variant that fails to build falls back (module docstring)
            fallback = registry.fallback_for(registry.get(decision.backend))
            if fallback.name == decision.backend and decision.source in ("default", "fallback"):
                raise
            log.warning("ring attention %s: backend %s with params from %s failed to build (%s: %s); falling back "
                        "to %s with its default params", decision.key.digest, decision.backend, decision.source,
                        type(error).__name__, error, fallback.name)
            placement = configured.Placement(LocalShapes.of_shards(query, key, value),
                                             ring_geometry(self.axis_name)[0], group_size(self.axis_name))
            config = fallback.default_config(registry.tile_shapes(fallback, *placement), decision.spec)
            return call_jitted(fallback.attend, dict(config=config, **call), query, key, value, **arrays)

    def _note(self, query, key, value, ring_size: int, a2a_size: int, options: dict[str, Any], decision: Decision
              ) -> record.Call:
        """The call as `tuner.runtime.record` keeps it: what `tuner autotune`, `record` and `doctor` read."""
        platform, device_kind = compile_target(self.mesh)
        return record.Call(
            caller="loader", query=record.struct_of(query), key=record.struct_of(key), value=record.struct_of(value),
            arrays={n: record.struct_of(x) for n, x in options.items() if n in plan.ARRAY_OPTIONS and x is not None},
            mask=self.options, ring_size=ring_size, layout=decision.layout, backend=self.backend,
            strategy=self.strategy, a2a_size=a2a_size, packing=self.packing,
            return_lse=bool(options.get("return_lse")), interpret=bool(options.get("interpret")),
            db=str(Cache(self.db).path), platform=platform, device_kind=device_kind,
            decision=dict(implementation=decision.backend, source=decision.source, reason=decision.reason,
                          key=decision.key.as_dict()))

    def _decide(self, query, key, value, ring_size: int, options: dict[str, Any], group: int | None = None,
                agree: bool = False, packed_tile: int | None = None, expect: bool = False) -> Decision:
        """The plan of this call on `ring_size` devices (over two axes R x A, with `group` A), decided once
        per problem key; with `agree` (a traced call, which every process of the program traces), the
        plan every process runs; with `expect` (`explain()`), what a traced call runs, said without waiting
        for the other processes (`agreement.expected`). `packed_tile`: a packed call's default tile, as its
        rows chose it."""
        platform, device_kind = compile_target(self.mesh)
        target = registry.Target(platform, bool(options.get("interpret")))
        return_lse = bool(options.get("return_lse"))
        layout = self._layout(ring_size)
        resolved = plan.resolve(query, key, value, ring_size=ring_size, layout=layout, backend=self.backend,
                                target=target, mask=self.options, return_lse=return_lse, strategy=self.strategy,
                                arrays={n: x for n, x in options.items() if n in plan.ARRAY_OPTIONS},
                                axis_name=self.axis_name, group=group)
        spec, shapes, implementation, fallback = (resolved.spec, resolved.shapes, resolved.implementation,
                                                  resolved.fallback)
        if self.packing is not None and not spec.has_segments:
            raise ValueError(f"packing={self.packing!r} describes the documents of packed rows, but this call has no "
                             f"segment ids: pass q_segment_ids and kv_segment_ids, or leave packing None")
        problem = registry.key(implementation, shapes, spec, device_kind=device_kind, ring_size=ring_size,
                               layout=layout, group=group, packing=self.packing)
        if self._writes != writes():  # this process wrote to a cache since: decide again
            self._decisions.clear()
            self._agreed.clear()
            self._writes = writes()
        memo = (problem.digest, fallback, return_lse, packed_tile)
        if memo not in self._decisions:
            chosen, unusable, verdict, rows = None, None, None, []
            dtype, choosing = jnp.dtype(query.dtype), self.backend == "auto" and not target.interpret
            if choosing and self.strategy in ("auto", "ring"):
                try:  # the cache's decisions for this problem, read once for the measurement and the model
                    rows = measured.decisions(Cache(self.db, busy_timeout=LOADER_BUSY_TIMEOUT_S), problem, spec)
                except (CacheError, OSError) as error:  # reported by the lookup, which does not wait again
                    unusable = error
                else:
                    chosen = measured.runnable_choice(rows, problem, spec, dtype, target, return_lse,
                                                      self.strategy)
            if choosing and self.strategy == "auto":
                verdict = modelled.verdict(rows, problem, spec, dtype, target, return_lse)
            if chosen is not None:
                implementation, fallback = registry.get(chosen[0]), None
                problem = dataclasses.replace(problem, backend=implementation.name)
            placement = configured.Placement(shapes, ring_size, group)
            decision = self._configs.plan(problem, placement, spec, layout, implementation, fallback, unusable,
                                          packed_tile)
            if chosen is not None:
                nothing_tuned = decision.source == "default" and decision.config.to_dict() == {"fwd": {}, "bwd": {}}
                decision = dataclasses.replace(decision, source="measured" if nothing_tuned else decision.source,
                                               reason=f"{chosen[1]}; config: {decision.source} ({decision.reason})")
            elif verdict is not None:
                decision = self._configs.by_model(verdict, decision, placement, unusable, packed_tile)
            if verdict is not None:
                decision = dataclasses.replace(decision, predictions=verdict.predictions)
            self._decisions[memo] = decision
            log.info("ring attention %s: %s, config from %s (%s)", decision.key.digest, decision.backend,
                     decision.source, decision.reason)
        if expect:
            return self._agreed[memo] if memo in self._agreed else agreement.expected(self._decisions[memo], memo)
        if not agree:
            return self._decisions[memo]
        if memo not in self._agreed:
            self._agreed[memo] = agreement.agree(self._decisions[memo], memo)
        return self._agreed[memo]

    def _layout(self, ring_size: int) -> str:
        """The layout of the shards: as given, else any on one device (they all hold the tokens in
        order); on local shards of a larger ring it must be given, since only the caller knows how
        their `shard_map` split the sequence."""
        if self.layout == DOCUMENTS:  # each device's shard holds its tokens in token order, positions given
            return "contiguous"
        if self.layout is not None:
            return self.layout
        if ring_size == 1:
            return DEFAULT_LAYOUT
        raise ValueError(f"layout= is needed when attn is called on local shards of a ring of {ring_size} devices: "
                         f"pass the layout the shards are in ('contiguous' for an even split of the sequence, "
                         f"'zigzag' or 'striped' after tuner.layouts.lay_out), or pass mesh= and global arrays "
                         f"in token order, which the loader lays out itself ({DEFAULT_LAYOUT} by default)")


def _check_call_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = [name for name in options if name not in CALL_OPTIONS]
    if unknown:
        raise TypeError(f"unknown per-call option(s) {', '.join(unknown)}; per-call options are "
                        f"{', '.join(CALL_OPTIONS)} (set masks when calling get_tuned_ring_attention)")
    for name in ("return_lse", "interpret"):
        if name in options:
            check_bool(name, options[name])
    check_call_arrays(**{name: options.get(name) for name in plan.ARRAY_OPTIONS})
    return options


def get_tuned_ring_attention(
    *,
    axis_name: Hashable | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    layout: str | None = None,
    backend: str = "auto",
    db: str | os.PathLike | None = None,
    mesh: Mesh | None = None,
    strategy: str = "auto",
    packing: str | None = None,
    laid_out: bool = False,
) -> TunedRingAttention:
    """Ring attention that runs the tuned variant for each problem it is traced with.

    With `mesh`, call it on global arrays in token order (and per-call segment ids, positions and bias
    in token order too), sharded over `axis_name` along the sequence or not: it lays the sequence out in
    `layout` (default "zigzag", which balances causal work and is what `tuner search` tunes by default)
    inside one `shard_map` over `axis_name`, with collectives that move each device's shards and never
    gather the sequence, and puts the output (and lse) back in token order, sharded as the query came in
    (other mesh axes, a batch on a data axis or heads on a tensor axis, keep theirs). That costs one exchange
    of q, k, v and the output in every call; a training step lays its batch out once instead
    (`tuner.layouts.lay_out_batch`) and passes `laid_out=True`: then nothing moves and the output stays
    in the layout. Without `mesh`, call it on local shards inside your `shard_map` over `axis_name`, with
    `layout` saying how your shards hold the sequence (required on a ring of more than one device); without
    `axis_name`, on one device. `db` is the cache file (default `$TUNER_DB`, else
    `$TUNER_HOME/tuning.sqlite`).

    `strategy` says how the devices share the work: "ring", "all_to_all" or "all_gather" runs that one
    ("ring": over the kernel `backend` names, else the platform's); "auto" (the default) lets a
    measurement in the cache pick, else on a TPU or H100 the strategy model (`tuner.runtime.modelled`), else the
    ring. "hybrid" (or "auto" with a pair `axis_name=(ring_axis, a2a_axis)`) runs all-to-all over the
    second axis and the ring over the first (`tuner.strategies.hybrid`): with `mesh`, the sequence is sharded over
    both axes, ring axis outer, and `layout` applies over the ring axis.

    `packing` declares how the documents of the calls' packed rows are drawn, as `tuner search --documents`
    took it (e.g. "lognormal:14"): the calls then run the config tuned for that packing (their segment ids are
    still what decides the masks). Without it, packed calls run the config tuned with `--segments`.
    """
    return TunedRingAttention(axis_name=axis_name, causal=causal, sliding_window=sliding_window,
                              chunk_size=chunk_size, logits_soft_cap=logits_soft_cap,
                              softmax_scale=softmax_scale, layout=layout, backend=backend, db=db, mesh=mesh,
                              strategy=strategy, packing=packing, laid_out=laid_out)
