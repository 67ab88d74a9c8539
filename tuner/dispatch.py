"""The runtime loader (DESIGN section 9): tuned ring attention, decided at trace time from the cache.

    attn = get_tuned_ring_attention(axis_name="sp", causal=True)
    out = attn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)   # inside shard_map over "sp"
    attn.explain(q, k, v, ring_size=8)                             # what it would run, and why

At trace time the callable builds the problem key from the shapes it sees, picks the backend
(`auto`: the mechanism `tuner bench --mechanisms` measured fastest for this problem -- a ring backend,
or gathered dense attention when that is faster at this length -- else the platform's fast backend,
else scan when that one is missing, does not support the features, or fails to build) and the params
(cache lookup: exact, nearest, shipped, else the backend's default). It never tunes; a missing or
unreadable cache means defaults and a logged warning, never a failed training step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import layouts
from tuner.backends import BACKENDS, Backend, choose_backend, get_backend, resolve_auto, why_not
from tuner.cache import Cache, CacheError, current_versions, row_params
from tuner.mechanisms import GATHERED, gathered_attention, gathered_unsupported
from tuner.params import BwdParams, FwdParams
from tuner.problem import ProblemKey
from tuner.ring import ring_attention, ring_geometry
from tuner.spec import build_spec, check_inputs, normalize_window

log = logging.getLogger("tuner.dispatch")

CALL_OPTIONS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "softmax_aux", "bias",
                "return_lse", "interpret")
SOURCES = ("exact", "nearest", "shipped", "default", "fallback", "measured")


@dataclass(frozen=True)
class Decision:
    """What the loader runs for one problem, and why. `backend` is a ring backend, or a gathered
    mechanism of `tuner.mechanisms` ("dense", "jax_nn"; no params) that `tuner bench --mechanisms`
    measured faster for this problem (source "measured")."""

    backend: str
    fwd_params: FwdParams | None
    bwd_params: BwdParams | None
    source: str  # one of SOURCES
    reason: str
    key: ProblemKey


class TunedRingAttention:
    """`attn(query, key, value, **per_call_options)`: ring attention with tuned params (see the module
    docstring). Per-call options: q/kv segment ids and positions, `softmax_aux`, `bias`, `return_lse`,
    `interpret` -- as in `tuner.ring_attention`."""

    def __init__(self, *, axis_name: Hashable | None, causal: bool, sliding_window, chunk_size,
                 logits_soft_cap, softmax_scale, layout: str, backend: str, db, mesh: Mesh | None):
        if not isinstance(layout, str) or layout not in layouts.LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(layouts.LAYOUTS)}, got {layout!r}")
        if backend != "auto":
            get_backend(backend)
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
            if axis_name is None or axis_name not in mesh.shape:
                raise ValueError(f"with mesh=, axis_name must name one of its axes {tuple(mesh.shape)}, "
                                 f"got {axis_name!r}")
        self.axis_name, self.layout, self.backend, self.mesh = axis_name, layout, backend, mesh
        self.options = dict(causal=causal, sliding_window=normalize_window(sliding_window),
                            chunk_size=chunk_size, logits_soft_cap=logits_soft_cap,
                            softmax_scale=softmax_scale)
        build_spec(jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32), has_segments=False, bias=None,
                   softmax_aux=None, **self.options)  # the scalar options fail here, not at trace time
        self.db = db
        self._decisions: dict[tuple, Decision] = {}

    # ----------------------------------------------------------------------------------------------

    def __call__(self, query, key, value, **per_call_options):
        options = _check_call_options(per_call_options)
        if self.mesh is None:
            return self._local(query, key, value, options)
        seq = P(None, self.axis_name)
        specs = {name: seq for name in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")}
        specs["softmax_aux"] = P()
        if options.get("bias") is not None:  # the query axis is sharded, the global key axis is not
            specs["bias"] = P(None, None, self.axis_name if options["bias"].shape[2] > 1 else None, None)
        arrays = {n: x for n, x in options.items() if n in specs and x is not None}
        flags = {n: x for n, x in options.items() if n not in specs}
        out_specs = (seq, P(None, None, self.axis_name)) if flags.get("return_lse") else seq
        sharded = jax.shard_map(lambda q, k, v, x: self._local(q, k, v, {**x, **flags}), mesh=self.mesh,
                                in_specs=(seq, seq, seq, {n: specs[n] for n in arrays}),
                                out_specs=out_specs)
        return sharded(query, key, value, arrays)

    def explain(self, query, key, value, *, ring_size: int | None = None, **per_call_options) -> Decision:
        """The decision `attn(query, key, value, **per_call_options)` would take, without running it.

        Arrays (or `jax.ShapeDtypeStruct`s) are global with `mesh=`, else the local shards; `ring_size`
        defaults to the mesh axis, or 1 without `axis_name`.
        """
        options = _check_call_options(per_call_options)
        if self.mesh is not None:
            size = self.mesh.shape[self.axis_name]
            if ring_size is not None and ring_size != size:
                raise ValueError(f"ring_size={ring_size} does not match mesh axis {self.axis_name!r} of "
                                 f"size {size}")
            query, key, value = (_local_shape(x, size, name) for x, name in
                                 ((query, "query"), (key, "key"), (value, "value")))
        elif ring_size is None:
            if self.axis_name is not None:
                raise ValueError("explain() needs ring_size= when axis_name is set without mesh=")
            size = 1
        else:
            size = ring_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"ring_size must be a positive int, got {ring_size!r}")
        return self._decide(query, key, value, size, options)

    # ----------------------------------------------------------------------------------------------

    def _local(self, query, key, value, options: dict[str, Any]):
        size, _ = ring_geometry(self.axis_name)
        decision = self._decide(query, key, value, size, options)
        call = dict(**self.options, **options, axis_name=self.axis_name, layout=self.layout)
        if decision.backend in GATHERED:
            return gathered_attention(query, key, value, mechanism=decision.backend,
                                      **{n: v for n, v in call.items() if n != "interpret"})
        try:
            return ring_attention(query, key, value, backend=decision.backend,
                                  fwd_params=decision.fwd_params, bwd_params=decision.bwd_params, **call)
        except Exception as error:  # noqa: BLE001 - a kernel that fails to build falls back to scan
            if decision.backend == "scan":
                raise
            log.warning("ring attention: backend %s failed to build (%s: %s); falling back to scan",
                        decision.backend, type(error).__name__, error)
            return ring_attention(query, key, value, backend="scan", **call)

    def _decide(self, query, key, value, ring_size: int, options: dict[str, Any]) -> Decision:
        check_inputs(query, key, value, ring_size=ring_size,
                     **{n: options.get(n) for n in CALL_OPTIONS if n not in ("return_lse", "interpret")})
        spec = build_spec(query, has_segments=options.get("q_segment_ids") is not None,
                          bias=options.get("bias"), softmax_aux=options.get("softmax_aux"), **self.options)
        dtype = jnp.dtype(query.dtype)
        platform, device_kind = _platform()
        backend, fallback = self._choose(spec, dtype, query.shape[3], platform, bool(options.get("interpret")))
        b, tq, h, d = query.shape
        problem = ProblemKey(backend=backend.name, device_kind=device_kind, ring_size=ring_size,
                             layout=self.layout, batch=b, q_len=tq, kv_len=key.shape[1], heads=h,
                             kv_heads=key.shape[2], head_dim=d, dtype=dtype.name, features=spec.features())
        memo = (problem.digest, fallback, bool(options.get("return_lse")))
        if memo not in self._decisions:
            measured = None
            if self.backend == "auto" and not options.get("interpret"):
                measured = self._measured(dataclasses.replace(problem, backend="auto"), spec,
                                          bool(options.get("return_lse")), dtype)
            if measured is not None and measured[0] in GATHERED:
                decision = Decision(measured[0], None, None, "measured", measured[1], problem)
            else:
                if measured is not None:
                    backend, fallback = BACKENDS[measured[0].removeprefix("ring/")], None
                    problem = dataclasses.replace(problem, backend=backend.name)
                decision = self._lookup(problem, backend, fallback)
                if measured is not None:
                    decision = dataclasses.replace(decision, reason=f"{measured[1]}; params: {decision.source} "
                                                                    f"({decision.reason})")
            self._decisions[memo] = decision
            log.info("ring attention %s: backend %s, params from %s (%s)", problem.digest, decision.backend,
                     decision.source, decision.reason)
        return self._decisions[memo]

    def _choose(self, spec, dtype, head_dim: int, platform: str, interpret: bool) -> tuple[Backend, str | None]:
        """The backend, and why it is a fallback (None when it is the platform's first choice)."""
        if self.backend != "auto":
            return choose_backend(self.backend, spec, dtype, head_dim, platform, interpret), None
        backend, passed_over = resolve_auto(spec, dtype, head_dim, platform, interpret)
        return backend, "; ".join(passed_over) or None

    def _measured(self, key: ProblemKey, spec, return_lse: bool, dtype) -> tuple[str, str] | None:
        """The mechanism `tuner bench --mechanisms` measured fastest for `key` (a current measurement
        that can honour this call), and the reason to give; None to decide as usual."""
        try:
            row = Cache(self.db).mechanism(key.digest)
        except (CacheError, OSError) as error:
            log.warning("ring attention: tuning cache unusable, not reading mechanisms: %s", error)
            return None
        if row is None:
            return None
        versions = current_versions("-")
        if (row["jax_version"], row["jaxlib_version"]) != (versions["jax_version"], versions["jaxlib_version"]):
            log.info("ring attention %s: mechanism measurement is stale (jax %s, jaxlib %s)", key.digest,
                     row["jax_version"], row["jaxlib_version"])
            return None
        winner = row["winner"]
        if winner in GATHERED:
            if gathered_unsupported(winner, spec, return_lse=return_lse) is not None:
                return None
        else:
            backend = BACKENDS.get(winner.removeprefix("ring/"))
            if backend is None or why_not(backend, spec, dtype, key.head_dim) is not None:
                return None
        seconds = json.loads(row["seconds"])
        others = ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in sorted(seconds.items(), key=lambda i: i[1])
                           if name != winner)
        return winner, (f"tuner bench --mechanisms measured {winner} fastest for this problem "
                        f"({seconds[winner] * 1e3:.1f} ms; {others or 'nothing else ran'}) on "
                        f"{row['measured_at'][:10]}")

    def _lookup(self, problem: ProblemKey, backend: Backend, fallback: str | None) -> Decision:
        def accept(row: dict[str, Any]) -> str | None:
            try:
                backend.check_params(*row_params(row))
            except ValueError as error:
                return str(error)
            return None

        defaults = backend.default_params(problem.q_len, problem.kv_len, problem.head_dim)
        try:
            found = Cache(self.db).lookup(problem, current_versions(backend.code_hash(), triton=backend.name == "triton"), accept)
        except (CacheError, ValueError, OSError) as error:
            log.warning("ring attention: tuning cache unusable, using default params: %s", error)
            return Decision(backend.name, *defaults, "fallback" if fallback else "default",
                            f"{fallback + '; ' if fallback else ''}cache unusable: {error}", problem)
        fwd, bwd = row_params(found.row) if found.row is not None else defaults
        if fallback:
            return Decision(backend.name, fwd, bwd, "fallback",
                            f"{fallback}; {backend.name} params: {found.source} ({found.reason})", problem)
        return Decision(backend.name, fwd, bwd, found.source, found.reason, problem)


def _platform() -> tuple[str, str]:
    """This process's jax platform ("cpu", "gpu", "tpu") and device kind."""
    return jax.default_backend(), jax.devices()[0].device_kind


def _check_call_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = [name for name in options if name not in CALL_OPTIONS]
    if unknown:
        raise TypeError(f"unknown per-call option(s) {', '.join(unknown)}; per-call options are "
                        f"{', '.join(CALL_OPTIONS)} (set masks when calling get_tuned_ring_attention)")
    return options


def _local_shape(x, size: int, name: str) -> jax.ShapeDtypeStruct:
    if x.shape[1] % size:
        raise ValueError(f"{name} length {x.shape[1]} is not divisible by the ring size {size}")
    return jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // size, *x.shape[2:]), x.dtype)


def get_tuned_ring_attention(
    *,
    axis_name: Hashable | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    softmax_scale: float | None = None,
    layout: str = "contiguous",
    backend: str = "auto",
    db: str | None = None,
    mesh: Mesh | None = None,
) -> TunedRingAttention:
    """Ring attention that runs the tuned variant for each problem it is traced with.

    Without `mesh`, call it on local shards inside `shard_map` over `axis_name` (or, without
    `axis_name`, on one device). With `mesh`, call it on global arrays (sequence axis in the layout's
    order, see `tuner.layouts.lay_out`) and it applies `shard_map` over `axis_name` itself. `db` is the
    cache file (default `$TUNER_DB`, else `$TUNER_HOME/tuning.sqlite`).
    """
    return TunedRingAttention(axis_name=axis_name, causal=causal, sliding_window=sliding_window,
                              chunk_size=chunk_size, logits_soft_cap=logits_soft_cap,
                              softmax_scale=softmax_scale, layout=layout, backend=backend, db=db, mesh=mesh)
