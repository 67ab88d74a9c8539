"""Fault injection: whatever the tuning cache holds, a training step traces, runs and is exact.

The runtime loader reads the cache while a step is traced, so a bad cache may cost speed only: corrupt
`tuned` and `mechanisms` rows, broken files, locked files and read-only files each mean the step still
matches dense attention, with one WARNING (logger "tuner.cache") naming the file and the row, once per
row and process. Readers never write. The `tuner` command reports the same faults in one line (or
lists invalid rows as such), and export then import is an identity.

Shapes are tiny (B=1, T=32, H=2, Hkv=1, D=8, causal, a ring of 2), the dense reference is computed
once, and every step is traced and lowered afresh (the loader decides while tracing) but compiled once
per distinct program: compiling takes about a second a step, tracing a tenth of that.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sqlite_utils
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.kernels import BACKENDS
from tuner.cache import (COLUMNS, FEATURES, SOURCES, TABLE, VERSION_FIELDS, Cache, current_versions, make_row,
                         parse_jsonl, row_digest, row_key, row_params, write_jsonl)
from tuner.cache.legacy import COLUMNS as MECHANISM_COLUMNS
from tuner.cache.legacy import TABLE as MECHANISM_TABLE
from tuner.semantics.problem import DTYPES, OBJECTIVES, Problem, ProblemKey
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import LAYOUTS

REPO = Path(__file__).resolve().parents[1]
RING = 2
PROBLEM = Problem(batch=1, seq_len=32, heads=2, kv_heads=1, head_dim=8, causal=True, ring_size=RING,
                  layout="zigzag")
DEVICE_KIND = jax.devices()[0].device_kind
KEY = registry.problem_key(PROBLEM, "scan", DEVICE_KIND)
CONFIG_OK = registry.get("scan").default_config(PROBLEM.shapes, PROBLEM.spec).to_dict()
MECHANISM_KEY = ProblemKey.of(PROBLEM.shapes, PROBLEM.spec, backend="auto", device_kind=DEVICE_KIND,
                              ring_size=PROBLEM.ring_size, layout=PROBLEM.layout).digest
SCAN = BACKENDS["scan"]
VERSIONS = current_versions(SCAN.code_hash())
DEFAULTS = SCAN.default_params(KEY.q_len, KEY.kv_len, KEY.head_dim)
TUNED = (FwdParams(8, 8), BwdParams(8, 8))  # the valid exact row's params: neither the defaults ...
NEIGHBOUR = (FwdParams(4, 16), BwdParams(16, 4))  # ... nor the nearest neighbour's
assert DEFAULTS not in (TUNED, NEIGHBOUR)
MESH = Mesh(np.array(jax.devices()[:RING]), ("sp",))
DECISION_BOUND_S = 2.0  # a locked cache must not hold a trace longer than this


def _inputs():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((PROBLEM.batch, PROBLEM.seq_len, PROBLEM.heads, PROBLEM.head_dim), np.float32)
    k, v = (rng.standard_normal((PROBLEM.batch, PROBLEM.seq_len, PROBLEM.kv_heads, PROBLEM.head_dim), np.float32)
            for _ in range(2))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


Q, K, V = _inputs()


def with_grads(attention):
    """A step that returns `attention`'s output and the gradients of the loss sum(sin(output)) over q, k and v,
    from one program (a forward and a gradient program would each compile the forward pass)."""
    def loss_and_out(*args):
        out = attention(*args)
        return jnp.sum(jnp.sin(out)), out

    def step(*args):
        (_, out), grads = jax.value_and_grad(loss_and_out, argnums=(0, 1, 2), has_aux=True)(*args)
        return out, grads
    return step


@functools.cache
def reference():
    """Dense attention in float64 on the float32 inputs: the output and the gradients (`with_grads`)."""
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in (Q, K, V))
        out, grads = jax.jit(with_grads(lambda *a: dense_attention(*a, causal=True)[0]))(q, k, v)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


def _relative_error(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_exact(out, grads=None) -> None:
    want, want_grads = reference()
    assert np.all(np.isfinite(np.asarray(out)))
    assert _relative_error(out, want) <= 1e-5
    for got, expected in zip(grads or (), want_grads):
        assert _relative_error(got, expected) <= 1e-4


def loader(db):
    return get_tuned_ring_attention(axis_name="sp", causal=True, mesh=MESH, db=str(db))


_PROGRAMS: dict[str, Any] = {}


def jit_run(fn, *args) -> tuple[Any, float]:
    """`jax.jit(fn)(*args)` and the seconds its trace took. Every call traces and lowers afresh (the
    loader decides while tracing); a program whose lowered text was compiled before runs that executable
    (XLA compiling the same program again is most of a step's time here, and proves nothing more)."""
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    took = time.perf_counter() - start
    lowered = traced.lower()
    text = lowered.as_text()
    if text not in _PROGRAMS:
        _PROGRAMS[text] = lowered.compile()
    return _PROGRAMS[text](*args), took


def run_step(attention, grad: bool = False) -> None:
    """The jitted step (and its gradient) against dense attention."""
    if grad:
        check_exact(*jit_run(with_grads(attention), Q, K, V)[0])
    else:
        check_exact(jit_run(attention, Q, K, V)[0])


@pytest.fixture(scope="module", autouse=True)
def no_shipped_entries(tmp_path_factory):
    """Lookups in this module never fall through to entries shipped with the package."""
    empty = tmp_path_factory.mktemp("shipped")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tuner.support.resources.shipped_dir", lambda: empty)
        yield


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@contextlib.contextmanager
def cache_warnings():
    """The WARNINGs of logger "tuner.cache" logged inside the block (hypothesis-friendly caplog)."""
    logger = logging.getLogger("tuner.cache")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------
# Building databases behind the cache's back, as a foreign tool or a damaged disk could.
# --------------------------------------------------------------------------------------------------


def valid_row(problem: Problem = PROBLEM, params=TUNED, **measured) -> dict[str, Any]:
    fields = dict(objective="fwd+bwd", best_s=1.0, default_s=1.5, speedup=1.5, trials_run=2, trials_pruned=0,
                  trials_failed={}, study="faults")
    return make_row(registry.problem_key(problem, "scan", DEVICE_KIND), *params, versions=VERSIONS, tool_version="test",
                    **{**fields, **measured})


def create_table(path: Path, schema: str, table: str = TABLE, columns: dict[str, type] | None = None) -> None:
    """`table` with `columns` in a new file: "writer" as `Cache` creates it (WAL, indexes), "typed" with
    the same column types in rollback-journal mode, "untyped" with no column types at all."""
    columns = dict(COLUMNS if table == TABLE else MECHANISM_COLUMNS) if columns is None else columns
    if schema == "writer":
        Cache(path).check_writable()
        assert table == TABLE and columns == COLUMNS
        return
    with contextlib.closing(sqlite3.connect(path)) as conn:
        if schema == "typed":
            sqlite_utils.Database(conn)[table].create(columns, pk="key")
        else:
            conn.execute(f"CREATE TABLE [{table}] ({', '.join(f'[{c}]' for c in columns)})")
        conn.commit()


def insert(path: Path, rows: list[dict[str, Any]], table: str = TABLE) -> None:
    """Raw INSERTs: any value of any type goes in (SQLite keeps what column affinity does not convert)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for row in rows:
            conn.execute(f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in row)}) "
                         f"VALUES ({', '.join('?' * len(row))})", list(row.values()))
        conn.commit()


def fresh_dir(factory) -> Path:
    return factory.mktemp("fault")


def warnings_naming(messages: list[str], *parts: str) -> list[str]:
    return [m for m in messages if all(p in m for p in parts)]


# --------------------------------------------------------------------------------------------------
# 1. Corrupt `tuned` rows for the exact problem the step runs.
# --------------------------------------------------------------------------------------------------


class Fault(NamedTuple):
    """One field of a row set to `value`; `invalid` says whether the row is then invalid."""

    field: str
    value: Any
    invalid: bool
    label: str

    def __repr__(self) -> str:
        return f"Fault({self.label})"


def _fault(field: str, value: Any, invalid: bool = True, label: str | None = None) -> Fault:
    return Fault(field, value, invalid, label or f"{field}={value!r}")


DISTANCE_FIELDS = ("batch", "q_len", "kv_len", "heads", "kv_heads", "ring_size")
SIZE_FIELDS = (*DISTANCE_FIELDS, "head_dim")
FAMILY = ("op", "backend", "device_kind", "head_dim", "dtype", "features")
FEATURES_OK = dict(KEY.features)
ROW_FAULTS = [
    # params: not a JSON object, unknown keys, bad block sizes
    _fault("fwd_params", json.dumps({"block_q": 8, "block_kv": 8, "tile": 3})),
    _fault("bwd_params", json.dumps({"block_q_dkv": 8, "block_kv_dkv": 8, "dropout": 0.1})),
    *(_fault(f, v) for f in ("fwd_params", "bwd_params") for v in (None, "null", "[8, 8]", "64", '"block_q=8"',
                                                                     "{block_q: 8", "", 64, 8.5)),
    _fault("bwd_params", b'{"block_q_dkv": 8, "block_kv_dkv": 8}', label="bwd_params=<blob>"),
    _fault("fwd_params", "[" * 100_000, label="fwd_params=<JSON nested 100000 deep>"),
    _fault("bwd_params", '{"a": ' * 50_000 + "1" + "}" * 50_000, label="bwd_params=<valid JSON nested 50000 deep>"),
    _fault("fwd_params", '{"block_q": ' + "1" * 5000 + ', "block_kv": 8}', label="fwd_params=<5000-digit int>"),
    *(_fault("fwd_params", json.dumps({"block_q": v, "block_kv": 8})) for v in (-8, 0, True, 8.5, 8.0, "8", None)),
    _fault("fwd_params", '{"block_q": NaN, "block_kv": 8}'),
    *(_fault("bwd_params", json.dumps({"block_q_dkv": 8, "block_kv_dkv": v})) for v in (-1, 0, False, 2.5)),
    _fault("bwd_params", json.dumps({"block_q_dkv": 8, "block_kv_dkv": 8, "block_q_dq": 4})),  # half a dq pass
    # odd but valid params: used, and still exact
    _fault("fwd_params", json.dumps({"block_q": 2**40, "block_kv": 2**40}), invalid=False, label="huge fwd blocks"),
    _fault("bwd_params", json.dumps({"block_q_dkv": 2**31, "block_kv_dkv": 3, "block_q_dq": 5, "block_kv_dq": 2**40}),
           invalid=False, label="huge and odd bwd blocks"),
    _fault("fwd_params", json.dumps({"block_q": 3, "block_kv": 5}), invalid=False, label="odd fwd blocks"),
    # sizes (the key still hashes the true ones, so the exact lookup meets the row)
    *(_fault(f, v) for f in SIZE_FIELDS for v in (None, "sixteen", 0, -16, 16.5)),
    _fault("heads", 3),  # not a multiple of kv_heads... and no longer the key's
    # times and counts
    *(_fault(f, v) for f in ("best_s", "default_s", "speedup")
      for v in (float("nan"), float("inf"), float("-inf"), -1.0, 0, "fast", None)),
    *(_fault(f, v) for f in ("trials_run", "trials_pruned") for v in (-1, "three", None, 2.5)),
    *(_fault("trials_failed", v) for v in ("nope", '{"wrong": -1}', '{"wrong": "x"}', None)),
    _fault("best_s", 1e-300, invalid=False), _fault("speedup", 1e300, invalid=False),
    # dates
    *(_fault("measured_at", v) for v in ("yesterday", "", "2024-13-45T00:00:00", None, 1.5, "\x00")),
    _fault("measured_at", "2024-02-29", invalid=False),
    # features
    *(_fault("features", v) for v in ("garbage", "null", "[]", None, json.dumps({"causal": True}),
                                      json.dumps({**FEATURES_OK, "dropout": 0.1}),
                                      json.dumps({**FEATURES_OK, "causal": "yes"}),
                                      json.dumps({**FEATURES_OK, "window": [-1, 4]}),
                                      json.dumps({**FEATURES_OK, "sinks": -2}))),
    # near-best configs: a JSON list of at most 8 valid configs
    *(_fault("near_best", v) for v in ("nope", "{}", "[1]", None, json.dumps([CONFIG_OK] * 9),
                                       json.dumps([{**CONFIG_OK, "fwd": {"block_q": -1, "block_kv": 8}}]))),
    _fault("near_best", json.dumps([CONFIG_OK]), invalid=False, label="near_best of one config"),
    # the key, and the text fields
    *(_fault("key", v) for v in ("0123456789abcdef", "not a key", "")),
    *(_fault(f, None) for f in VERSION_FIELDS),
    *(_fault(f, v) for f, v in (("layout", "spiral"), ("dtype", "float64"), ("objective", "speed"), ("op", None),
                                ("backend", None), ("device_kind", None), ("tool_version", None), ("study", None),
                                ("layout", None), ("dtype", 32))),
]
assert set(COLUMNS) >= {f.field for f in ROW_FAULTS}
assert set(FEATURES) == set(FEATURES_OK)


class Expected(NamedTuple):
    source: str
    params: tuple[FwdParams, BwdParams]
    warned: list[str]  # the keys of the rows warned about, once each


def corrupt_database(path: Path, faults: list[Fault], family: list[tuple[str, Any]], neighbour: bool,
                     schema: str) -> Expected:
    """The exact row with `faults`; rows of other sizes of its family with a corrupt size field (`family`:
    the nearest search meets them); maybe a valid neighbour (batch 2). Returns what the loader must do."""
    create_table(path, schema)
    row = valid_row()
    for fault in faults:
        row[fault.field] = fault.value
    rows, corrupt_family = [row], []
    for batch, (field, value) in enumerate(family, start=3):
        other = valid_row(Problem(**{**PROBLEM.__dict__, "batch": batch}))
        other[field] = value
        rows.append(other)
        corrupt_family.append(other["key"])
    if neighbour:
        rows.append(valid_row(Problem(**{**PROBLEM.__dict__, "batch": 2}), params=NEIGHBOUR))
    insert(path, rows)

    invalid = any(f.invalid for f in faults)
    key_intact = all(f.field != "key" for f in faults)
    # met by its key, else (a foreign key) only by the family search, which needs the family and versions
    met = key_intact or not any(f.field in (*FAMILY, *VERSION_FIELDS) for f in faults)
    if key_intact and not invalid:
        return Expected("exact", row_params(row), [])
    warned = ([row["key"]] if met and invalid else []) + corrupt_family
    return Expected(*(("nearest", NEIGHBOUR) if neighbour else ("default", DEFAULTS)), warned)


def check_decision(path: Path, decision, messages: list[str], expected: Expected) -> None:
    assert (decision.backend, decision.source, (decision.fwd_params, decision.bwd_params)) == \
        ("scan", expected.source, expected.params), decision.reason
    for key in expected.warned:
        assert len(warnings_naming(messages, str(path), f"entry {key!r} skipped")) == 1, (key, messages)
    assert len(messages) == len(expected.warned), messages
    if expected.warned:
        assert decision.source == "default" or "invalid" in decision.reason, decision.reason


@pytest.mark.slow
@settings(max_examples=8)
@given(faults=st.lists(st.sampled_from(ROW_FAULTS), min_size=1, max_size=2, unique_by=lambda f: f.field),
       family=st.lists(st.tuples(st.sampled_from(DISTANCE_FIELDS), st.sampled_from([None, "wide", 2.5, -4])),
                       max_size=2),
       neighbour=st.booleans(), schema=st.sampled_from(["writer", "typed", "untyped"]),
       grad=st.booleans())
def test_corrupt_rows_cost_speed_only(tmp_path_factory, faults, family, neighbour, schema, grad):
    """A row the step would use, with one or two fields corrupted (and maybe rows of other sizes of the
    same family with a corrupt size field): the step is exact; an invalid row the loader meets is
    warned about once, naming the file and the row; a valid one is used."""
    path = fresh_dir(tmp_path_factory) / "tuning.sqlite"
    expected = corrupt_database(path, faults, family, neighbour, schema)
    with cache_warnings() as seen:
        attention = loader(path)
        run_step(attention, grad=grad)
        decision = attention.explain(Q, K, V)
    check_decision(path, decision, seen.messages, expected)

    with cache_warnings() as again:  # another loader, another trace: the same rows are not warned about again
        second = loader(path)
        jax.make_jaxpr(second)(Q, K, V)
        assert second.explain(Q, K, V) == decision
    assert again.messages == []


def test_every_row_fault_is_decided_right(tmp_path):
    """Every fault alone (and with a foreign key, and beside a neighbour), in a typed and an untyped
    table: the loader's decision and warnings (the property test above runs the steps)."""
    cases = [([fault], [], False, schema) for fault in ROW_FAULTS for schema in ("typed", "untyped")]
    cases += [([_fault("key", "0123456789abcdef"), fault], [("q_len", None)], True, "typed")
              for fault in ROW_FAULTS if fault.field != "key"]
    for number, (faults, family, neighbour, schema) in enumerate(cases):
        path = tmp_path / f"{number}.sqlite"
        expected = corrupt_database(path, faults, family, neighbour, schema)
        with cache_warnings() as seen:
            decision = loader(path).explain(Q, K, V)
        try:
            check_decision(path, decision, seen.messages, expected)
        except AssertionError as error:
            raise AssertionError(f"{faults} in a {schema} table: {error}") from None


# --------------------------------------------------------------------------------------------------
# 2. Corrupt `mechanisms` rows.
# --------------------------------------------------------------------------------------------------


def mechanism_row(**overrides) -> dict[str, Any]:
    versions = current_versions("-")
    row = {"key": MECHANISM_KEY, "device_kind": DEVICE_KIND, "problem": PROBLEM.describe(), "objective": "fwd+bwd",
           "winner": "ring/scan", "seconds": json.dumps({"dense": 0.002, "ring/scan": 0.001}, sort_keys=True),
           "jax_version": versions["jax_version"], "jaxlib_version": versions["jaxlib_version"],
           "tool_version": "test", "measured_at": "2025-01-01T00:00:00+00:00"}
    return {**row, **overrides}


class MechanismFault(NamedTuple):
    label: str
    overrides: dict[str, Any]
    outcome: str  # "invalid" (warned, decided as usual: scan defaults), "scan" or "dense" (used, no warning)
    drop: tuple[str, ...] = ()  # columns the table does not have

    def __repr__(self) -> str:
        return f"MechanismFault({self.label})"


DENSE_FASTEST = {"winner": "dense", "seconds": json.dumps({"dense": 0.001, "ring/scan": 0.002})}
MECHANISM_FAULTS = [
    MechanismFault("winner column missing", {}, "invalid", drop=("winner",)),
    MechanismFault("seconds column missing", {}, "invalid", drop=("seconds",)),
    *(MechanismFault(f"winner={v!r}", {"winner": v}, "invalid")
      for v in (None, "", "unknown", "ring/Scan", "ring/", 42)),
    MechanismFault("winner=ring/nonexistent", {"winner": "ring/nonexistent",
                                               "seconds": json.dumps({"ring/nonexistent": 0.001, "dense": 0.002})},
                   "invalid"),
    *(MechanismFault(f"seconds={v!r}"[:60], {"seconds": v}, "invalid") for v in (
        "not json", '{"ring/scan": NaN, "dense": 0.002}', '{"ring/scan": -1, "dense": 0.002}', '{"dense": 0.001}',
        "null", "[1]", '{"ring/scan": "fast"}', '{"warp/drive": 1.0, "ring/scan": 1.0}', None, "[" * 100_000,
        '{"ring/scan": Infinity}', '{"ring/scan": 0}', b'{"ring/scan": 0.001}')),
    *(MechanismFault(f"measured_at={v!r}", {"measured_at": v}, "invalid") for v in ("yesterday", None, 7, "")),
    *(MechanismFault(f"{f}=None", {f: None}, "invalid")
      for f in ("device_kind", "jax_version", "problem", "objective")),
    MechanismFault("winner not the fastest", {"winner": "dense"}, "invalid"),
    MechanismFault("dense measured fastest", DENSE_FASTEST, "dense"),
    MechanismFault("ring/scan measured fastest", {}, "scan"),
    MechanismFault("stale jax version", {"jax_version": "0.0.1", **DENSE_FASTEST}, "scan"),
]


def mechanism_database(path: Path, fault: MechanismFault, schema: str) -> None:
    columns = {c: t for c, t in MECHANISM_COLUMNS.items() if c not in fault.drop}
    create_table(path, schema, table=MECHANISM_TABLE, columns=columns)
    insert(path, [{c: v for c, v in mechanism_row(**fault.overrides).items() if c in columns}], table=MECHANISM_TABLE)


def check_mechanism_decision(path: Path, decision, messages: list[str], fault: MechanismFault) -> None:
    if fault.outcome == "dense":
        assert (decision.backend, decision.source) == ("dense", "measured"), decision.reason
        assert messages == []
        return
    assert (decision.backend, decision.source, (decision.fwd_params, decision.bwd_params)) == \
        ("scan", "default", DEFAULTS), decision.reason
    if fault.outcome == "invalid":
        assert len(warnings_naming(messages, str(path), f"mechanisms row {MECHANISM_KEY} skipped")) == 1, messages
        assert len(messages) == 1, messages
    else:
        assert messages == []


@pytest.mark.slow
@settings(max_examples=6)
@given(fault=st.sampled_from(MECHANISM_FAULTS), schema=st.sampled_from(["typed", "untyped"]), grad=st.booleans())
def test_corrupt_mechanism_rows_cost_speed_only(tmp_path_factory, fault, schema, grad):
    path = fresh_dir(tmp_path_factory) / "tuning.sqlite"
    mechanism_database(path, fault, schema)
    with cache_warnings() as seen:
        attention = loader(path)
        run_step(attention, grad=grad)
        decision = attention.explain(Q, K, V)
    check_mechanism_decision(path, decision, seen.messages, fault)
    with cache_warnings() as again:
        jax.make_jaxpr(loader(path))(Q, K, V)
    assert again.messages == []


def test_every_mechanism_fault_is_decided_right(tmp_path):
    for number, (fault, schema) in enumerate((f, s) for f in MECHANISM_FAULTS for s in ("typed", "untyped")):
        path = tmp_path / f"{number}.sqlite"
        mechanism_database(path, fault, schema)
        with cache_warnings() as seen:
            decision = loader(path).explain(Q, K, V)
        try:
            check_mechanism_decision(path, decision, seen.messages, fault)
        except AssertionError as error:
            raise AssertionError(f"{fault} in a {schema} table: {error}") from None


# --------------------------------------------------------------------------------------------------
# 3. Whole-file faults.
# --------------------------------------------------------------------------------------------------


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint8).tobytes())


def _sqlite_header_then_garbage(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + np.random.default_rng(2).integers(0, 256, 8192, dtype=np.uint8).tobytes())


def _valid_page_then_garbage(path: Path) -> None:
    create_table(path, "typed")
    insert(path, [valid_row()])
    data = path.read_bytes()
    path.write_bytes(data[:4096] + bytes(range(256)) * ((len(data) - 4096) // 256 + 1))


def _table_without(column: str):
    def make(path: Path) -> None:
        create_table(path, "typed", columns={c: t for c, t in COLUMNS.items() if c != column})
        insert(path, [{c: v for c, v in valid_row().items() if c != column}])
    return make


def _table_with_extra_column(path: Path) -> None:
    create_table(path, "typed", columns={**COLUMNS, "comment": str})
    insert(path, [{**valid_row(), "comment": "added by another tool"}])


FILE_FAULTS = {  # name: (make the file, whether the whole file is unusable: one WARNING naming it)
    "random bytes": (_random_bytes, True),
    "an SQLite header, then random bytes": (_sqlite_header_then_garbage, True),
    "a valid first page, then garbage": (_valid_page_then_garbage, True),
    "a folder": (lambda path: path.mkdir(), True),
    "tuned lacks code_hash": (_table_without("code_hash"), False),
    "tuned lacks study": (_table_without("study"), False),
    "tuned has an extra column": (_table_with_extra_column, False),
}


@pytest.mark.parametrize("name", FILE_FAULTS)
def test_a_broken_file_costs_speed_only(tmp_path, name):
    make, unusable = FILE_FAULTS[name]
    path = tmp_path / "tuning.sqlite"
    make(path)
    with cache_warnings() as seen:
        attention = loader(path)
        run_step(attention)
        decision = attention.explain(Q, K, V)
    assert (decision.backend, decision.source, (decision.fwd_params, decision.bwd_params)) == \
        ("scan", "default", DEFAULTS)
    assert seen.messages and all(str(path) in m for m in seen.messages), seen.messages
    assert len(set(seen.messages)) == len(seen.messages)
    if unusable:
        assert len(seen.messages) == 1, seen.messages
        assert "cache unusable" in decision.reason
    with cache_warnings() as again:
        jax.make_jaxpr(loader(path))(Q, K, V)
    assert again.messages == []


def test_an_empty_file_is_an_empty_cache(tmp_path):
    """SQLite reads an empty file as an empty database: nothing tuned, nothing to warn about."""
    path = tmp_path / "tuning.sqlite"
    path.touch()
    with cache_warnings() as seen:
        attention = loader(path)
        run_step(attention)
        decision = attention.explain(Q, K, V)
    assert (decision.source, (decision.fwd_params, decision.bwd_params)) == ("default", DEFAULTS)
    assert len(seen.messages) <= 1 and all(str(path) in m for m in seen.messages)
    assert path.read_bytes() == b""


@functools.cache
def _valid_database() -> bytes:
    """A cache file as `tuner search` leaves it: the exact row and 30 neighbours, several pages."""
    folder = Path(tempfile.mkdtemp())
    try:
        path = folder / "tuning.sqlite"
        Cache(path).put_many([valid_row()] + [valid_row(Problem(**{**PROBLEM.__dict__, "batch": b}), params=NEIGHBOUR)
                                              for b in range(2, 32)])
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return path.read_bytes()
    finally:
        shutil.rmtree(folder)


@settings(max_examples=10)
@given(data=st.data())
def test_a_truncated_file_costs_speed_only(tmp_path_factory, data):
    whole = _valid_database()
    length = data.draw(st.one_of(st.sampled_from([1, 99, 100, 4096, len(whole) // 2, len(whole) - 1]),
                                 st.integers(0, len(whole) - 1)), label="length")
    path = fresh_dir(tmp_path_factory) / "tuning.sqlite"
    path.write_bytes(whole[:length])
    with cache_warnings() as seen:
        attention = loader(path)
        run_step(attention)
        decision = attention.explain(Q, K, V)
    chosen = {"exact": TUNED, "nearest": NEIGHBOUR, "default": DEFAULTS}[decision.source]
    assert (decision.fwd_params, decision.bwd_params) == chosen
    if "cache unusable" in decision.reason:
        assert len(seen.messages) == 1 and str(path) in seen.messages[0], seen.messages
    else:  # what could be read was read: never a row that is not in the file
        assert seen.messages == [] and (decision.source != "default" or length == 0), (decision, seen.messages)


# --------------------------------------------------------------------------------------------------
# 4. Locks held by other processes.
# --------------------------------------------------------------------------------------------------

LOCK_HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    for statement in sys.argv[2:]:
        conn.execute(statement)
    print("holding", flush=True)
    time.sleep(600)
""")


@contextlib.contextmanager
def holding(path: Path, *statements: str):
    """Another process that ran `statements` on `path` (e.g. BEGIN EXCLUSIVE) and holds on."""
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path), *statements], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "holding", proc.stderr.read() if proc.poll() is not None else line
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def rollback_database(path: Path, rows: list[dict[str, Any]]) -> None:
    create_table(path, "typed")
    insert(path, rows)
    assert path.read_bytes()[18:20] == b"\x01\x01"  # rollback journal, not WAL


def wal_database(path: Path, rows: list[dict[str, Any]]) -> None:
    """A WAL-mode database as its last writer leaves it when it closes (no -wal or -shm file)."""
    create_table(path, "typed")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode = WAL").fetchone() == ("wal",)
    insert(path, rows)
    assert path.read_bytes()[18:20] == b"\x02\x02" and not path.with_name(path.name + "-wal").exists()


def test_a_locked_database_holds_a_step_at_most_the_loader_timeout(tmp_path):
    path = tmp_path / "tuning.sqlite"
    rollback_database(path, [valid_row()])
    with cache_warnings() as seen, holding(path, "BEGIN EXCLUSIVE"):
        attention = loader(path)
        out, took = jit_run(attention, Q, K, V)
    assert took < DECISION_BOUND_S, f"the trace waited {took:.2f} s for the lock"
    check_exact(out)
    decision = attention.explain(Q, K, V)
    assert (decision.source, (decision.fwd_params, decision.bwd_params)) == ("default", DEFAULTS)
    assert "locked" in decision.reason
    assert len(seen.messages) == 1 and str(path) in seen.messages[0] and "locked" in seen.messages[0], seen.messages
    assert loader(path).explain(Q, K, V).source == "exact"  # released: the row is there


def test_a_wal_writer_does_not_block_or_disturb_the_loader(tmp_path):
    """A writer in WAL mode holding its write lock with uncommitted changes: readers see the last
    committed rows, at once."""
    path = tmp_path / "tuning.sqlite"
    row = valid_row()
    Cache(path).put(row)
    assert path.read_bytes()[18:20] == b"\x02\x02"  # WAL
    broken = {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 2})), "fwd_params": "garbage"}
    with cache_warnings() as seen, holding(
            path, "BEGIN IMMEDIATE", f"UPDATE tuned SET fwd_params = '{{\"block_q\": 4, \"block_kv\": 4}}' "
                                     f"WHERE key = '{row['key']}'",
            f"INSERT INTO tuned (key, fwd_params) VALUES ('{broken['key']}', 'garbage')"):
        attention = loader(path)
        out, took = jit_run(attention, Q, K, V)
        (_, grads), _ = jit_run(with_grads(attention), Q, K, V)
    assert took < DECISION_BOUND_S, f"the trace waited {took:.2f} s"
    check_exact(out, grads)
    decision = attention.explain(Q, K, V)
    assert (decision.source, (decision.fwd_params, decision.bwd_params)) == ("exact", TUNED)
    assert seen.messages == []


# --------------------------------------------------------------------------------------------------
# 5. Readers never write; a read-only file is readable.
# --------------------------------------------------------------------------------------------------


def _snapshot(path: Path) -> tuple:
    """The file's bytes and mtime, its journal mode (header) and schema, and the files beside it."""
    with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
        schema = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
    return (path.read_bytes(), path.stat().st_mtime_ns, path.read_bytes()[18:20], schema,
            sorted(os.listdir(path.parent)))


def test_readers_never_write(tmp_path):
    path = tmp_path / "tuning.sqlite"
    rollback_database(path, [valid_row(), {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 3})), "batch": None},
                             valid_row(Problem(**{**PROBLEM.__dict__, "batch": 2}), params=NEIGHBOUR)])
    create_table(path, "typed", table=MECHANISM_TABLE)
    insert(path, [mechanism_row()], table=MECHANISM_TABLE)
    bare = tmp_path / "bare.sqlite"  # a database with no tables at all
    with contextlib.closing(sqlite3.connect(bare)) as conn:
        conn.execute("PRAGMA user_version = 3")
    before = {p: _snapshot(p) for p in (path, bare)}
    assert before[path][3] and not before[bare][3]

    run_step(loader(path))
    assert loader(path).explain(Q, K, V).source == "exact"
    assert loader(bare).explain(Q, K, V).source == "default"
    for db, count in ((path, 3), (bare, 0)):
        cache = Cache(db)
        assert len(cache.rows()) == count and cache.listing(limit=2).total == count
        assert len(cache.find(KEY.digest[:6])) == (count > 0)
        assert cache.lookup(KEY, VERSIONS).source == ("exact" if count else "default")
        assert (cache.legacy_run(MECHANISM_KEY) is not None) == (count > 0)
    assert {p: _snapshot(p) for p in (path, bare)} == before


def _reader_python() -> tuple[list[str], dict[str, str], str | None]:
    """An interpreter the unprivileged user can run that imports tuner from this checkout: the command,
    its environment, and None -- or why there is none."""
    paths = os.pathsep.join(dict.fromkeys([str(REPO), sysconfig.get_paths()["purelib"],
                                           sysconfig.get_paths()["platlib"]]))
    env = {"PYTHONPATH": paths, "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": "/tmp",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={RING}"}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    tried = []
    for python in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable),
                                 os.path.realpath(sys.executable), f"/usr/bin/python{version}",
                                 f"/usr/local/bin/python{version}"]):
        try:
            probe = subprocess.run([python, "-c", "import sqlite_utils, tuner.cache"], user="nobody", env=env,
                                   cwd="/tmp", capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as error:
            tried.append(f"{python}: {error}")
            continue
        if probe.returncode == 0:
            return [python], env, None
        tried.append(f"{python}: {probe.stderr.strip().splitlines()[-1:]}")
    return [], env, "no Python " + version + " that user nobody can run imports tuner: " + "; ".join(tried)


READ_ONLY_CHECK = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from tuner import get_tuned_ring_attention
    from tuner.cache import Cache
    from tuner.semantics.problem import ProblemKey
    key, versions = ProblemKey(**json.loads(sys.argv[1])), json.loads(sys.argv[2])
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    shapes = [jax.ShapeDtypeStruct(tuple(s), np.float32) for s in json.loads(sys.argv[3])]
    report = {}
    for path in sys.argv[4:]:
        cache = Cache(path)
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=path)
        report[path] = {"rows": len(cache.rows()), "listed": cache.listing().total,
                        "found": len(cache.find(key.digest[:6])), "lookup": cache.lookup(key, versions).source,
                        "loader": attn.explain(*shapes).source}
    print(json.dumps(report))
""")


def test_a_read_only_file_in_a_read_only_folder_is_readable():
    """As an unprivileged user when the tests run as root (root writes through chmod)."""
    as_root = os.geteuid() == 0
    command, env = [sys.executable], {**os.environ, "JAX_PLATFORMS": "cpu",
                                      "XLA_FLAGS": f"--xla_force_host_platform_device_count={RING}"}
    if as_root:
        command, env, why_not = _reader_python()
        if why_not:
            pytest.skip(why_not)
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        folder.chmod(0o755)
        rollback, wal, open_wal = folder / "rollback.sqlite", folder / "wal.sqlite", folder / "open.sqlite"
        rollback_database(rollback, [valid_row()])
        wal_database(wal, [valid_row()])
        writer = Cache(open_wal)  # a writer that keeps its connection: its -wal and -shm files are there
        writer.put(valid_row())
        for path in folder.iterdir():
            path.chmod(0o444)
        folder.chmod(0o555)
        files = sorted(os.listdir(folder))
        assert files == ["open.sqlite", "open.sqlite-shm", "open.sqlite-wal", "rollback.sqlite", "wal.sqlite"]
        result = subprocess.run([*command, "-c", READ_ONLY_CHECK, json.dumps(KEY.as_dict()), json.dumps(VERSIONS),
                                 json.dumps([Q.shape, K.shape, V.shape]), str(rollback), str(wal), str(open_wal)],
                                user="nobody" if as_root else None, env=env, cwd="/tmp", capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        for path in (rollback, wal, open_wal):
            assert report[str(path)] == {"rows": 1, "listed": 1, "found": 1, "lookup": "exact", "loader": "exact"}, \
                (path, report, result.stderr)
        assert "tuning cache" not in result.stderr, result.stderr
        assert sorted(os.listdir(folder)) == files
        del writer
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


# --------------------------------------------------------------------------------------------------
# 6. The `tuner` command against the same faults, and bad flags.
# --------------------------------------------------------------------------------------------------


def one_line_error(result: subprocess.CompletedProcess, status: int, *named: str) -> None:
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in named:
        assert name in lines[0], lines[0]


def _truncated(path: Path) -> None:
    whole = _valid_database()
    path.write_bytes(whole[:len(whole) // 2])


UNREADABLE = {"random bytes": _random_bytes, "truncated": _truncated}


@pytest.mark.parametrize("name", UNREADABLE)
def test_cli_on_an_unreadable_file_is_one_line(tmp_path, name, cli):
    path = tmp_path / "tuning.sqlite"
    UNREADABLE[name](path)
    for args in (("list",), ("show", KEY.digest[:6]), ("export", str(tmp_path / "out.jsonl"))):
        one_line_error(cli(*args, home=tmp_path), 1, str(path))
    assert not (tmp_path / "out.jsonl").exists()
    info = cli("info", home=tmp_path)
    assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr
    assert "cache: unusable: " in info.stdout and str(path) in info.stdout


def test_cli_on_a_locked_file_is_one_line(tmp_path):
    """Waits its busy timeout (the four commands at once), then says the file is locked."""
    path = tmp_path / "tuning.sqlite"
    rollback_database(path, [valid_row()])
    env = {**os.environ, "TUNER_HOME": str(tmp_path)}
    for name in ("XLA_FLAGS", "TUNER_DB"):
        env.pop(name, None)
    commands = [("list",), ("show", KEY.digest[:6]), ("export", str(tmp_path / "out.jsonl")), ("info",)]
    with holding(path, "BEGIN EXCLUSIVE"):
        procs = [subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO)) for args in commands]
        outputs = [p.communicate(timeout=120) for p in procs]
    results = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    for result in results[:3]:
        one_line_error(result, 1, str(path), "locked")
    info = results[3]
    assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr
    assert "cache: unusable: " in info.stdout and "locked" in info.stdout


def _invalid_rows() -> list[dict[str, Any]]:
    good = valid_row()
    return [good,
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 2})), "fwd_params": "[" * 100_000},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 3})), "best_s": "fast", "measured_at": None},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 4})), "batch": None},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 5})), "bwd_params": b'{"blob": 1}'},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 6})), "features": "garbage"},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 7})), "key": "0123456789abcdef"},
            {**valid_row(Problem(**{**PROBLEM.__dict__, "batch": 8})), "best_s": None}]


def test_cli_lists_shows_exports_invalid_rows(tmp_path, cli):
    path = tmp_path / "tuning.sqlite"
    rows = _invalid_rows()
    rollback_database(path, rows)
    listed = cli("list", home=tmp_path)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    for row in rows:
        assert row["key"] in listed.stdout
    statuses = [line for line in listed.stdout.splitlines() if any(r["key"] in line for r in rows)]
    assert len(statuses) == len(rows)
    assert sum(line.endswith(" ok") for line in statuses) == 1
    assert sum("invalid (" in line for line in statuses) == len(rows) - 1
    assert any("invalid (fwd_params is not JSON" in line for line in statuses), listed.stdout

    bad = rows[2]["key"]
    shown = cli("show", bad[:10], home=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "best_s" in shown.stdout and "fast" in shown.stdout
    assert any(line.startswith("status") and "invalid (field 'best_s' must be float" in line
               for line in shown.stdout.splitlines()), shown.stdout

    out = tmp_path / "out.jsonl"
    exported = cli("export", str(out), home=tmp_path)
    assert exported.returncode == 0 and "Traceback" not in exported.stderr, exported.stderr
    assert f"exported 1 entry to {out}, skipped {len(rows) - 1} invalid" in exported.stdout, exported.stdout
    warned = exported.stderr.strip().splitlines()
    assert len(warned) == len(rows) - 1 and all(line.startswith("WARNING: entry ") for line in warned), warned
    for row in rows[1:]:
        assert any(f"entry {row['key']} not exported: invalid (" in line for line in warned), (row["key"], warned)
    valid, rejected = parse_jsonl(out)
    assert [r["key"] for r in valid] == [rows[0]["key"]] and rejected == []
    imported = cli("import", str(out), home=tmp_path / "other")
    assert imported.returncode == 0 and "imported 1 entry" in imported.stdout, imported.stderr
    assert [r["key"] for r in Cache(tmp_path / "other" / "tuning.sqlite").rows()] == [rows[0]["key"]]

    info = cli("info", home=tmp_path)
    assert info.returncode == 0 and f"({len(rows)} tuned, 0 stale, {len(rows) - 1} invalid)" in info.stdout


def test_cli_lists_a_row_with_deeply_nested_features(tmp_path, cli):
    path = tmp_path / "tuning.sqlite"
    row = {**valid_row(), "features": "[" * 100_000}
    rollback_database(path, [row])
    listed = cli("list", home=tmp_path)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr[-2000:]
    assert row["key"] in listed.stdout and "invalid (features is not JSON" in listed.stdout


def test_cli_import_reports_every_bad_line_and_imports_nothing(tmp_path, cli):
    rows = [valid_row(Problem(**{**PROBLEM.__dict__, "batch": b})) for b in (1, 2)]
    lines = {  # line number: (text, what the rejection says)
        1: (json.dumps(rows[0]), None),
        2: ("{not json", "not JSON"),
        3: ("[1, 2]", "JSON object"),
        4: (json.dumps({k: v for k, v in rows[0].items() if k != "speedup"}), "missing field(s) speedup"),
        5: (json.dumps({**rows[0], "fwd_params": json.dumps({"block_q": -1, "block_kv": 8})}), "block_q"),
        6: (json.dumps({**rows[0], "batch": 9}), "hash to"),
        7: ("[" * 100_000, "not JSON"),
        8: ('{"key": ' + "1" * 5000 + "}", "not JSON"),
        9: ("", None),
        10: (json.dumps(rows[1]), None),
        11: (json.dumps({**rows[1], "best_s": float("nan")}), "finite positive"),
        12: (b'"\xff not UTF-8, then a string"', "JSON object"),
    }
    source = tmp_path / "rows.jsonl"
    source.write_bytes(b"\n".join(t if isinstance(t, bytes) else t.encode() for t, _ in lines.values()) + b"\n")
    home = tmp_path / "home"
    result = cli("import", str(source), home=home)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    reported = result.stderr.strip().splitlines()
    bad = {n: why for n, (_, why) in lines.items() if why}
    assert len(reported) == len(bad) + 1, result.stderr
    for number, why in bad.items():
        assert any(line.startswith(f"{source}:{number}: rejected: ") and why in line for line in reported), \
            (number, result.stderr)
    assert "nothing was imported" in reported[-1]
    assert Cache(home / "tuning.sqlite").rows() == []

    skipping = cli("import", str(source), "--skip-invalid", home=home)
    assert skipping.returncode == 0 and "imported 2 entries" in skipping.stdout, skipping.stderr
    assert f"skipped {len(bad)} invalid" in skipping.stdout
    assert sorted(r["key"] for r in Cache(home / "tuning.sqlite").rows()) == sorted(r["key"] for r in rows)


def _regular_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


SEARCH = ("search", "--device", "cpu", "--seq-len", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
          "--ring-size", "2", "--trials", "2", "--runs", "1")
BAD_FLAGS = {  # name: (arguments, with {file} a regular file; what the one line names)
    "--seed -1": ((*SEARCH, "--seed", "-1"), "--seed"),
    "--softcap nan": ((*SEARCH, "--softcap", "nan"), "--softcap"),
    "--timeout inf": ((*SEARCH, "--timeout", "inf"), "--timeout"),
    "--storage not a url": ((*SEARCH, "--storage", "not a url"), "--storage"),
    "--storage under a file": ((*SEARCH, "--storage", "sqlite:///{file}/x.sqlite"), "--storage"),
    "--heartbeat 0": ((*SEARCH, "--heartbeat", "0"), "--heartbeat"),
    "--reconnect nan": ((*SEARCH, "--reconnect", "nan"), "--reconnect"),
    "dashboard --port 70000": (("dashboard", "--port", "70000"), "--port"),
    "dashboard --storage not a url": (("dashboard", "--storage", "not a url"), "--storage"),
    "search --db under a file": ((*SEARCH, "--db", "{file}/x.sqlite"), "--db"),
    "report --out under a file": (("report", "0123abcd", "--out", "{file}/report.html"), "--out"),
    "export under a file": (("export", "{file}/out.jsonl"), "{file}/out.jsonl"),
}


@pytest.mark.parametrize("name", BAD_FLAGS)
def test_cli_bad_flags_are_one_line_and_exit_2(tmp_path, name, cli):
    args, named = BAD_FLAGS[name]
    file = _regular_file(tmp_path)
    start = time.perf_counter()
    result = cli(*(a.format(file=file) for a in args), home=tmp_path / "home")
    took = time.perf_counter() - start
    one_line_error(result, 2, named.format(file=file))
    assert took < 20, f"{name} took {took:.1f} s: it should fail before any work"


# --------------------------------------------------------------------------------------------------
# 7. Export then import is an identity.
# --------------------------------------------------------------------------------------------------

_positive = st.integers(1, 2**20)
_optional = st.none() | _positive
_text = st.text(max_size=12)
_seconds = st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False)
_dates = st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(2200, 1, 1),
                      timezones=st.none() | st.just(dt.UTC)).map(lambda d: d.isoformat())
_features = st.fixed_dictionaries({
    "causal": st.booleans(), "window": st.none() | st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=2),
    "chunk_size": _optional, "softcap": st.booleans(), "segments": st.booleans(), "bias": st.booleans(),
    "sinks": st.integers(0, 8)})
_fwd = st.builds(FwdParams, block_q=_positive, block_kv=_positive, num_warps=_optional, num_stages=_optional,
                 block_kv_compute=_optional)
_bwd = st.builds(lambda q, kv, dq, warps, stages: BwdParams(q, kv, *(dq or (None, None)), warps, stages),
                 _positive, _positive, st.none() | st.tuples(_positive, _positive), _optional, _optional)


@st.composite
def tuned_rows(draw) -> dict[str, Any]:
    kv_heads = draw(st.integers(1, 16))
    features = draw(_features)
    row = {
        "op": draw(st.sampled_from(["ring_attention"]) | _text),
        "backend": draw(st.sampled_from(sorted(BACKENDS)) | _text),
        "device_kind": draw(st.sampled_from(["cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite"]) | _text),
        "ring_size": draw(_positive), "layout": draw(st.sampled_from(LAYOUTS)), "batch": draw(_positive),
        "q_len": draw(_positive), "kv_len": draw(_positive), "heads": kv_heads * draw(st.integers(1, 8)),
        "kv_heads": kv_heads, "head_dim": draw(_positive), "dtype": draw(st.sampled_from(DTYPES)),
        # the text form varies (key order, spacing): the key hashes the parsed features
        "features": json.dumps(features, sort_keys=draw(st.booleans()), indent=draw(st.none() | st.just(1))),
        "fwd_params": json.dumps(draw(_fwd).to_dict()), "bwd_params": json.dumps(draw(_bwd).to_dict()),
        "near_best": json.dumps([{"fwd": draw(_fwd).to_dict(), "bwd": draw(_bwd).to_dict()}
                                 for _ in range(draw(st.integers(0, 2)))]),
        "objective": draw(st.sampled_from(OBJECTIVES)),
        "best_s": draw(_seconds), "default_s": draw(_seconds), "speedup": draw(_seconds),
        "trials_run": draw(st.integers(0, 2**62)), "trials_pruned": draw(st.integers(0, 2**62)),
        "trials_failed": json.dumps(draw(st.dictionaries(_text, st.integers(0, 2**40), max_size=3))),
        "measured_at": draw(_dates), "tool_version": draw(_text), "study": draw(_text),
        **{f: draw(_text) for f in VERSION_FIELDS}, "source": draw(st.sampled_from(SOURCES)),
    }
    if row["source"] != "search":  # one config timed: no default time, no speedup
        row.update(default_s=None, speedup=None)
    row["key"] = row_digest(row_key(row), row["source"])
    return row


def _canonical(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "features": json.dumps(json.loads(row["features"]), sort_keys=True)}


@settings(max_examples=15)
@given(rows=st.lists(tuned_rows(), min_size=1, max_size=6, unique_by=lambda r: r["key"]))
def test_export_then_import_is_an_identity(tmp_path_factory, rows):
    folder = fresh_dir(tmp_path_factory)
    first, second = Cache(folder / "first.sqlite"), Cache(folder / "second.sqlite")
    assert first.put_many(rows) == len(rows)
    exported = folder / "first.jsonl"
    assert write_jsonl(exported, first.rows()) == len(rows)
    parsed, rejected = parse_jsonl(exported)
    assert rejected == []
    second.put_many(parsed)
    by_key = lambda rs: sorted(rs, key=lambda r: r["key"])  # noqa: E731
    assert by_key(second.rows()) == by_key(first.rows()) == by_key(_canonical(r) for r in rows)
    again = folder / "second.jsonl"
    write_jsonl(again, second.rows())
    assert again.read_bytes() == exported.read_bytes()


def test_cli_export_then_import_is_an_identity(tmp_path, cli):
    rows = [valid_row(Problem(**{**PROBLEM.__dict__, "batch": b}), measured_at=f"2025-01-0{b}T00:00:00+00:00")
            for b in (1, 2, 3)]
    rows.append({**valid_row(Problem(**{**PROBLEM.__dict__, "layout": "striped", "dtype": "bfloat16"})),
                 "best_s": 1e-300, "trials_failed": json.dumps({"wrong: 1e-3": 2, "timeout": 1})})
    Cache(tmp_path / "one" / "tuning.sqlite").put_many(rows)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert cli("export", str(first), home=tmp_path / "one").returncode == 0
    imported = cli("import", str(first), home=tmp_path / "two")
    assert imported.returncode == 0 and "imported 4 entries" in imported.stdout, imported.stderr
    assert cli("export", str(second), home=tmp_path / "two").returncode == 0
    assert second.read_bytes() == first.read_bytes()
    assert sorted(Cache(tmp_path / "two" / "tuning.sqlite").rows(), key=lambda r: r["key"]) == \
        sorted(rows, key=lambda r: r["key"])
