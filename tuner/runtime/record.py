"""Recorded attention calls: what a traced program asks of attention, kept so it can be tuned.

Every call of the loader (`get_tuned_ring_attention`) and of `ring_attention` notes, while it is traced,
a `Call`: one device's shapes and dtypes, the mask options, the per-call arrays present, the ring, the
layout, the implementation asked for, the cache file, the target, and the decision taken (implementation,
config source and reason, cache key). The call's ops are traced inside a name scope that carries the
call's id (`tuner.attention[<id>]`, also visible in profiles and in the HLO's op names), so the calls
of a program are read back from the program itself (`calls_in`): an id whose scope sits under a
`transpose(...)` is one whose gradients the program takes. This works when the program was traced
before (jax reuses the traced jaxpr, and the registry of this process still holds its calls).

With `TUNER_RECORD=<file>` set (what `tuner record` does), each new call is appended to the file as one
JSON line, and once more with `"gradients": true` when its backward is traced. The file is versioned
(`RECORD_VERSION` on every line) and read back line by line (`read`): a bad line is reported and
skipped, lines of one call are merged.

`observe` runs a program once to see the segment ids its packed calls get (each device sends its shard
to the host, `note_segments`), for `tuner.autotune` to tune an undeclared packing on the rows it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import numbers
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tuner.support.version import __version__
from tuner.semantics.problem import Problem
from tuner import registry
from tuner.registry import STRATEGIES, TWO_AXES
from tuner.semantics import layouts
from tuner.semantics.spec import LAYOUTS

RECORD_VERSION = 1
ENV = "TUNER_RECORD"
CALLERS = ("loader", "ring_attention")
SCOPE = "tuner.runtime.attention"
DOCUMENTS = 4  # packed documents per row when a recorded call has segment ids (the key records only that)
Struct = tuple[tuple[int, ...], str]  # an array's shape and dtype name

_SEEN: dict[str, Call] = {}  # every call traced in this process, by id
_WRITTEN: set[tuple[str, str, bool]] = set()  # (file, id, gradients) lines this process appended
_OBSERVED: dict[str, dict[int, tuple[np.ndarray, np.ndarray | None]]] | None = None  # while `observe` runs
_SCOPE_RE = re.compile(re.escape(SCOPE) + r"\[([0-9a-f]{16})\]")


@dataclass(frozen=True)
class Call:
    """One attention call as a trace saw it (module docstring). `decision` is what the loader decided:
    `implementation`, `source`, `reason` and the cache `key` (a dict); `gradients` whether the program
    differentiates through the call. `strategy` is the one the call asked for ("auto" or one of
    `tuner.registry.STRATEGIES`), and `a2a_size` the hybrid's all-to-all axis size (1 otherwise; its
    `ring_size` is then every device of both axes)."""

    caller: str
    query: Struct
    key: Struct
    value: Struct
    arrays: dict[str, Struct]
    mask: dict[str, Any]
    ring_size: int
    layout: str
    backend: str
    return_lse: bool
    interpret: bool
    db: str | None
    platform: str
    device_kind: str
    decision: dict[str, Any]
    gradients: bool = False
    strategy: str = "auto"
    a2a_size: int = 1
    packing: str | None = None

    def __post_init__(self) -> None:
        if self.caller not in CALLERS:
            raise ValueError(f"caller must be one of {', '.join(CALLERS)}, got {self.caller!r}")
        for name in ("query", "key", "value"):
            shape, dtype = _struct(name, getattr(self, name))
            if len(shape) != 4:
                raise ValueError(f"{name} must have 4 dimensions [B, T, H, D], got {list(shape)}")
            object.__setattr__(self, name, (shape, dtype))
        if not isinstance(self.arrays, dict):
            raise ValueError(f"arrays must be an object of name: [shape, dtype], got {self.arrays!r}")
        object.__setattr__(self, "arrays", {n: _struct(f"arrays.{n}", s) for n, s in self.arrays.items()})
        if not isinstance(self.mask, dict):
            raise ValueError(f"mask must be an object of mask options, got {self.mask!r}")
        object.__setattr__(self, "mask", {name: _plain(value) for name, value in self.mask.items()})
        for name in ("ring_size", "a2a_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.strategy not in ("auto", *STRATEGIES):
            raise ValueError(f"strategy must be one of {', '.join(('auto', *STRATEGIES))}, got {self.strategy!r}")
        if (self.a2a_size > 1 and self.strategy not in TWO_AXES) or self.ring_size % self.a2a_size:
            raise ValueError(f"a2a_size={self.a2a_size} must divide ring_size ({self.ring_size}), and be 1 but for "
                             f"a strategy over two axes ({', '.join(TWO_AXES)}); got strategy={self.strategy!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("return_lse", "interpret", "gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        missing = {"implementation", "source", "reason", "key"} - set(self.decision or {})
        if missing:
            raise ValueError(f"decision lacks {', '.join(sorted(missing))}")

    @property
    def id(self) -> str:
        """16 hex digits naming the call (everything but the decision and `gradients`; the strategy fields and
        the packing only where they are not their defaults, so the ids of calls recorded before them stay)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in ("strategy", "a2a_size",
                                                                                      "packing")}
        fields = {k: v for k, v in self.to_json().items() if k not in ("decision", "gradients", "version", "tool")
                  and not (k in defaults and v == defaults[k])}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def source(self) -> str:
        return self.decision["source"]

    def to_json(self) -> dict[str, Any]:
        """The call as one JSON object of the record file."""
        row = dataclasses.asdict(self)
        row["mask"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.mask.items()}
        return {"version": RECORD_VERSION, "tool": __version__, **row}

    @classmethod
    def from_json(cls, row: Any) -> Call:
        """The call a record line holds; `ValueError` saying what is wrong with it."""
        if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        if row.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {row.get('version')!r}: this tuner reads version {RECORD_VERSION} "
                             f"(record the program again with this tuner)")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(row) - names - {"version", "tool"})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in row and f.default is dataclasses.MISSING)
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in row.items() if k in names})

    def problem(self) -> Problem:
        """The `tuner.semantics.problem.Problem` a `tuner search` of this call tunes, whose cache key is the one the
        loader looks up; `ValueError` saying why the call cannot be tuned."""
        if self.caller != "loader":
            raise ValueError("ring_attention runs the params its caller passes and never reads the cache; "
                             "call get_tuned_ring_attention(...) instead to run tuned params")
        if self.interpret:
            raise ValueError("interpret=True runs the kernels in their interpreter: there is nothing to tune")
        (b, tq, h, d), dtype = self.query
        (_, tk, hkv, _), _ = self.key
        dv = self.value[0][3]
        if tq != tk:
            raise ValueError(f"queries and keys have different lengths per device (Tq={tq}, Tk={tk}); "
                             f"tuner search tunes self-attention shards")
        if "bias" in self.arrays:
            raise ValueError("the call has a bias, which tuner search does not tune")
        aux = self.arrays.get("softmax_aux")
        sinks = 0 if aux is None else (1 if len(aux[0]) == 1 else aux[0][1])
        seq_len = tq * self.ring_size
        problem = Problem(batch=b, seq_len=seq_len, heads=h, kv_heads=hkv, head_dim=d, dtype=dtype,
                          causal=bool(self.mask.get("causal")), window=self.mask.get("sliding_window"),
                          chunk_size=self.mask.get("chunk_size"), softcap=self.mask.get("logits_soft_cap"),
                          segments=min(DOCUMENTS, seq_len) if "q_segment_ids" in self.arrays and self.packing is None
                          else 0, packing=self.packing,
                          sinks=sinks, ring_size=self.ring_size, layout=self.layout, a2a_size=self.a2a_size,
                          value_head_dim=dv)
        wanted = self.decision["key"]
        got = registry.problem_key(problem, self.decision["implementation"], self.device_kind).as_dict()
        differ = [f"{name} {got[name]!r} (call: {wanted.get(name)!r})" for name in got if got[name] != wanted.get(name)]
        if differ:
            raise ValueError(f"a search would tune another cache key than the call looks up: {', '.join(differ)}")
        return problem


def _plain(value: Any) -> Any:
    """A mask option as a plain Python value (numpy scalars too; lists as tuples), for JSON and ids."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"mask option {value!r} is not a number, a pair of numbers or null")


def _struct(name: str, value: Any) -> Struct:
    """`(shape, dtype)` from a struct or its JSON `[shape, dtype]`; `ValueError` naming `name`."""
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (list, tuple))
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value[0])
          and isinstance(value[1], str))
    if not ok:
        raise ValueError(f"{name} must be [shape, dtype], got {value!r}")
    return tuple(value[0]), value[1]


def struct_of(x: Any) -> Struct:
    """The recorded shape and dtype of an array, tracer or `ShapeDtypeStruct`."""
    return tuple(int(n) for n in x.shape), jax.numpy.dtype(x.dtype).name


def scope(call: Call):
    """The name scope to trace `call`'s ops in; registers the call, and appends it to the record file
    when `TUNER_RECORD` is set."""
    _SEEN[call.id] = call
    path = os.environ.get(ENV)
    if path:
        append(path, call)
    return jax.named_scope(f"{SCOPE}[{call.id}]")


def watch(call: Call, out):
    """`out` unchanged; with `TUNER_RECORD` set, a backward traced through it appends the call with
    `gradients` true (an identity whose backward only records)."""
    path = os.environ.get(ENV)
    if not path:
        return out

    @jax.custom_vjp
    def identity(x):
        return x

    def backward(_, cotangent):
        append(path, dataclasses.replace(call, gradients=True))
        return (cotangent,)

    identity.defvjp(lambda x: (x, None), backward)
    return identity(out)


def observing() -> bool:
    """Whether `observe` is running a program (its calls then send their segment ids, `note_segments`)."""
    return _OBSERVED is not None


def note_segments(call: Call, rank: Any, segment_ids: Any, positions: Any = None) -> None:
    """While `observe` runs a program, have each device of `call` send the host its shard of the query
    segment ids (`rank`: its ring position; `positions`: the tokens' global positions, where the call
    passes them); at any other time add nothing to the program."""
    if _OBSERVED is None:
        return
    arrays = (segment_ids,) if positions is None else (segment_ids, positions)
    jax.debug.callback(functools.partial(_receive, call.id), rank, *arrays)


def _receive(call_id: str, rank: Any, segment_ids: Any, positions: Any = None) -> None:
    """One device's shard, kept once per call and ring position (every layer of a model sends the same)."""
    if _OBSERVED is not None:
        shard = (np.asarray(segment_ids), None if positions is None else np.asarray(positions))
        _OBSERVED.setdefault(call_id, {}).setdefault(int(rank), shard)


def observe(fn: Callable, *args: Any, calls: Sequence[Call], static_argnums: int | Sequence[int] = ()
            ) -> dict[str, np.ndarray]:
    """Run `fn(*args)` once and return, per call of `calls` whose every ring position reported
    (`note_segments`), the `[B, T]` query segment ids its rows held, in token order: what a program's
    packed calls really get. jax's caches are cleared before the run, so that the program traces again
    with the callbacks in, and after it, so that later runs trace without them."""
    global _OBSERVED
    wanted = {call.id: call for call in calls}
    jax.clear_caches()
    _OBSERVED = {}
    try:
        jax.block_until_ready(jax.jit(fn, static_argnums=static_argnums)(*args))
        jax.effects_barrier()
        seen = _OBSERVED
    finally:
        _OBSERVED = None
        jax.clear_caches()
    rows = {i: _token_order(wanted[i], shards) for i, shards in seen.items() if i in wanted}
    return {i: r for i, r in rows.items() if r is not None}


def _token_order(call: Call, shards: dict[int, tuple[np.ndarray, np.ndarray | None]]) -> np.ndarray | None:
    """The `[B, T]` segment ids of the devices' `shards` put back in token order, by the positions each
    sent or, where it sent none, those of the call's layout; None unless every ring position sent one."""
    (batch, local, _, _), _ = call.query
    if sorted(shards) != list(range(call.ring_size)):
        return None
    rows = np.zeros((batch, call.ring_size * local), np.int64)
    for rank, (ids, positions) in shards.items():
        if positions is None:
            positions = layouts.local_positions_np(call.layout, local, call.ring_size, rank)
        np.put_along_axis(rows, np.broadcast_to(positions, (batch, local)).astype(np.int64),
                          np.broadcast_to(ids, (batch, local)), axis=1)
    return rows


def append(path: str | os.PathLike, call: Call) -> None:
    """Append `call` to the record file at `path`, once per process (one write of one line, so processes
    recording into one file do not interleave)."""
    mark = (str(path), call.id, call.gradients)
    if mark in _WRITTEN:
        return
    _WRITTEN.add(mark)
    line = json.dumps(call.to_json(), sort_keys=True) + "\n"
    with open(path, "a", encoding="utf-8") as file:
        file.write(line)


def write(path: str | os.PathLike, calls: list[Call]) -> None:
    """Write `calls` as a record file, one line each."""
    Path(path).write_text("".join(json.dumps(c.to_json(), sort_keys=True) + "\n" for c in calls), encoding="utf-8")


@dataclass
class Recording:
    """A record file read back: its calls (lines of one call merged) and what was wrong with the other
    lines, as `line N: reason`."""

    calls: list[Call] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read(path: str | os.PathLike) -> Recording:
    """The calls of the record file at `path` (`OSError` if it cannot be read). A line that is not JSON,
    is truncated, has unknown fields or another record version is reported in `problems` and skipped."""
    calls: dict[str, Call] = {}
    problems = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            call = Call.from_json(json.loads(text))
        except json.JSONDecodeError as error:
            problems.append(f"line {number}: not JSON ({error.msg} at column {error.colno}; truncated?)")
            continue
        except (TypeError, ValueError) as error:
            problems.append(f"line {number}: {error}")
            continue
        known = calls.get(call.id)
        calls[call.id] = call if known is None else dataclasses.replace(
            known, gradients=known.gradients or call.gradients)
    return Recording(list(calls.values()), problems)


def calls_in(fn: Callable, *args: Any, static_argnums: int | Sequence[int] = ()) -> list[Call]:
    """The attention calls of `fn(*args)`, read from its traced program (never run): the calls of this
    process whose scope the program holds, with `gradients` set where it sits under a transpose.
    `static_argnums` are the arguments that are not arrays, as `jax.jit` takes them."""
    traced = jax.jit(fn, static_argnums=static_argnums).trace(*args)
    found: dict[str, bool] = {}
    _walk(traced.jaxpr.jaxpr, "", found)
    return [dataclasses.replace(_SEEN[i], gradients=grads) for i, grads in found.items()]


def _walk(jaxpr, outer: str, found: dict[str, bool]) -> None:
    from jax.extend import core

    for eqn in jaxpr.eqns:
        stack = f"{outer}/{eqn.source_info.name_stack}"
        for match in _SCOPE_RE.finditer(stack):
            found[match[1]] = found.get(match[1], False) or "transpose(" in stack[:match.start()]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, core.ClosedJaxpr):
                    _walk(sub.jaxpr, stack, found)
                elif isinstance(sub, core.Jaxpr):
                    _walk(sub, stack, found)


__all__ = ["CALLERS", "ENV", "RECORD_VERSION", "Call", "Recording", "append", "calls_in", "note_segments", "observe",
           "observing", "read", "scope", "struct_of", "watch", "write"]
