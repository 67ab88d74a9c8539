"""One table of decisions: search and bench rows side by side, a bench run replacing the problem's last
one, and files of the older shape (no `source` column, a `mechanisms` table) read as they decided before
and migrated by the first writer, without changing what the loader runs."""

import contextlib
import json
import logging
import sqlite3

import jax
import numpy as np
import pytest
import sqlite_utils
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from tests.test_dispatch import PROBLEM, RING, arrays
from tuner import get_tuned_ring_attention, registry
from tuner.cache import COLUMNS, TABLE, Cache, make_row, row_digest
from tuner.cache import legacy
from tuner.cache.views import list_text
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem, ProblemKey

DEVICE_KIND = jax.devices()[0].device_kind
TUNED = (FwdParams(8, 8), BwdParams(8, 8))


def search_row(problem: Problem = PROBLEM) -> dict:
    scan = registry.get("scan")
    return make_row(registry.problem_key(problem, "scan", DEVICE_KIND), *TUNED, versions=registry.versions(scan),
                    tool_version="test", objective="fwd+bwd", best_s=0.004, default_s=0.006, speedup=1.5,
                    trials_run=3, trials_pruned=0, study="decisions")


def bench_run(seconds: dict[str, float], problem: Problem = PROBLEM, study: str = "bench 1") -> list[dict]:
    rows = []
    for name, best_s in seconds.items():
        implementation = registry.get(name)
        config = implementation.default_config(problem.shapes, problem.spec)
        rows.append(make_row(registry.problem_key(problem, name, DEVICE_KIND), config,
                             versions=registry.versions(implementation), tool_version="test", source="bench",
                             objective="fwd+bwd", best_s=best_s, default_s=None, speedup=None, trials_run=2,
                             trials_pruned=0, study=study))
    return rows


def legacy_row(winner: str = "dense", seconds: dict | None = None, device_kind: str = DEVICE_KIND) -> dict:
    seconds = seconds or {"dense": 0.001, "ring/scan": 0.004}
    auto = ProblemKey.of(PROBLEM.shapes, PROBLEM.spec, backend="auto", device_kind=DEVICE_KIND,
                         ring_size=PROBLEM.ring_size, layout=PROBLEM.layout)  # a legacy row's key
    return {"key": auto.digest, "device_kind": device_kind, "problem": PROBLEM.describe(),
            "objective": "fwd+bwd", "winner": winner, "seconds": json.dumps(seconds),
            "jax_version": registry.versions(registry.get("scan"))["jax_version"],
            "jaxlib_version": registry.versions(registry.get("scan"))["jaxlib_version"], "tool_version": "old",
            "measured_at": "2026-11-20T00:00:00+00:00"}


def old_file(path, legacy_rows: list[dict]) -> None:
    """A file as the version before one table of decisions wrote it: no `source` column (nor the later
    `near_best`), a `mechanisms` table."""
    old_columns = {c: t for c, t in COLUMNS.items() if c not in ("source", "near_best")}
    with contextlib.closing(sqlite3.connect(path)) as conn:
        db = sqlite_utils.Database(conn)
        db[TABLE].insert({c: v for c, v in search_row().items() if c in old_columns}, pk="key", columns=old_columns)
        db[legacy.TABLE].insert_all(legacy_rows, pk="key", columns=legacy.COLUMNS)
        conn.commit()


def explain(path, backend: str = "auto", **call):
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(path), backend=backend,
                                    mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    return attn.explain(*arrays(PROBLEM), **call)


def test_bench_and_search_rows_live_side_by_side_and_a_run_replaces_the_last(tmp_path):
    path = tmp_path / "tuning.sqlite"
    cache = Cache(path)
    cache.put(search_row())
    cache.put_run(bench_run({"jax_nn": 0.001, "scan": 0.004}))
    rows = cache.rows()
    assert sorted((r["backend"], r["source"]) for r in rows) == [("jax_nn", "bench"), ("scan", "bench"),
                                                                 ("scan", "search")]
    scan_key = registry.problem_key(PROBLEM, "scan", DEVICE_KIND)
    assert {r["key"] for r in rows} == {scan_key.digest, row_digest(scan_key, "bench"),
                                       row_digest(registry.problem_key(PROBLEM, "jax_nn", DEVICE_KIND), "bench")}
    decision = explain(path)
    assert decision.backend == "jax_nn"
    assert decision.reason.startswith("tuner bench --mechanisms measured jax_nn fastest for this problem (1.0 ms; "
                                      "ring/scan 4.0 ms)")
    # jax_nn has no lse: such a call runs the fastest of the run that can, with its search row's config.
    with_lse = explain(path, return_lse=True)
    assert (with_lse.backend, with_lse.source, with_lse.config.to_dict()["fwd"]["block_q"]) == ("scan", "exact", 8)
    assert with_lse.reason.startswith("tuner bench --mechanisms measured ring/scan fastest for this call (the "
                                      "fastest cannot honour it) (4.0 ms; jax_nn 1.0 ms)"), with_lse.reason

    cache.put_run(bench_run({"scan": 0.002}, study="bench 2"))  # a newer run of scan alone: jax_nn's time goes
    assert sorted((r["backend"], r["source"]) for r in cache.rows()) == [("scan", "bench"), ("scan", "search")]
    assert explain(path).backend == "scan"
    listing = list_text(cache, where={}, limit=None, page=1)
    assert sorted(line.split()[2] for line in listing.splitlines()[2:]) == ["bench", "search"], listing
    with pytest.raises(ValueError, match="bench rows of one problem"):
        cache.put_run([search_row()])


def compiled_row(problem: Problem = PROBLEM, tiles=(FwdParams(16, 16), BwdParams(16, 16))) -> dict:
    scan = registry.get("scan")
    return make_row(registry.problem_key(problem, "scan", DEVICE_KIND), *tiles, versions=registry.versions(scan),
                    tool_version="test", source="compiled", objective="fwd+bwd", best_s=0.002, default_s=None,
                    speedup=None, trials_run=7, trials_pruned=2, study="compiled for v5e:2x2, ranked by the model")


def test_a_compiled_row_is_used_only_where_nothing_measured_the_problem(tmp_path):
    """A `compiled` row (a config chosen by compiling and the model, never timed) decides the config of
    its own problem when no search row does, says so, never counts as a measurement for `auto`, is not
    borrowed by a nearby shape, and gives way to a search row of the problem."""
    path = tmp_path / "tuning.sqlite"
    cache = Cache(path)
    cache.put(compiled_row())
    decision = explain(path)
    assert (decision.backend, decision.source, decision.config.to_dict()["fwd"]["block_q"]) == ("scan", "compiled", 16)
    assert "compiled entry" in decision.reason and "not measured" in decision.reason, decision.reason
    with pytest.raises(ValueError, match="must be null in a compiled row"):
        make_row(registry.problem_key(PROBLEM, "scan", DEVICE_KIND), *TUNED,
                 versions=registry.versions(registry.get("scan")), tool_version="test", source="compiled",
                 objective="fwd+bwd", best_s=0.002, default_s=0.003, speedup=1.5,
                 trials_run=1, trials_pruned=0, study="x")
    other = Problem(batch=1, seq_len=128, heads=4, kv_heads=2, head_dim=8, causal=True, ring_size=RING,
                    layout="zigzag")
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(path),
                                    mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    assert attn.explain(*arrays(other)).source == "default"  # a compiled row is for its own problem only
    cache.put(search_row())
    measured = explain(path)
    assert (measured.source, measured.config.to_dict()["fwd"]["block_q"]) == ("exact", 8)
    listing = list_text(cache, where={}, limit=None, page=1)
    assert sorted(line.split()[2] for line in listing.splitlines()[2:]) == ["compiled", "search"], listing


def test_an_old_file_decides_as_before_and_the_first_writer_migrates_it(tmp_path, caplog):
    path = tmp_path / "tuning.sqlite"
    unmigratable = {**legacy_row(device_kind="another kind"), "key": "0123456789abcdef"}
    old_file(path, [legacy_row(), unmigratable])
    before = explain(path)
    assert before.backend == "dense" and before.reason.startswith("tuner bench --mechanisms measured dense fastest")
    assert explain(path, backend="scan").source == "exact"  # the old search row, read without a source column

    with caplog.at_level(logging.WARNING, logger="tuner.cache"):
        Cache(path).check_writable()
    assert any("mechanisms row 0123456789abcdef not migrated" in m for m in caplog.messages), caplog.messages
    rows = Cache(path).rows()
    assert sorted((r["backend"], r["source"], r["best_s"]) for r in rows) == [
        ("dense", "bench", 0.001), ("scan", "bench", 0.004), ("scan", "search", 0.004)]
    assert {r["study"] for r in rows if r["source"] == "bench"} == {f"mechanisms row {legacy_row()['key']}"}
    assert [r["near_best"] for r in rows if r["source"] == "search"] == ["[]"]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        left = [r[0] for r in conn.execute(f"SELECT key FROM {legacy.TABLE}")]
        columns = {c[1] for c in conn.execute(f"PRAGMA table_info({TABLE})")}
    assert left == ["0123456789abcdef"] and {"source", "near_best"} <= columns
    after = explain(path)
    assert (after.backend, after.source, after.reason) == (before.backend, before.source, before.reason)

    # Once every legacy row is gone, so is the table.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"DELETE FROM {legacy.TABLE}")
        conn.commit()
    Cache(path).check_writable()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert legacy.TABLE not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}


def test_a_run_with_a_stale_member_decides_nothing(tmp_path):
    path = tmp_path / "tuning.sqlite"
    dense, scan = bench_run({"dense": 0.001, "scan": 0.004})
    Cache(path).put_run([dense, {**scan, "code_hash": "older"}])  # the scan kernel changed since the run
    decision = explain(path)
    assert (decision.backend, decision.source) == ("scan", "default"), decision.reason
    Cache(path).put_run([dense, scan])
    assert explain(path).backend == "dense"


def test_a_legacy_row_written_after_a_newer_run_does_not_replace_it(tmp_path):
    path = tmp_path / "tuning.sqlite"
    Cache(path).put_run(bench_run({"scan": 0.002, "dense": 0.003}))
    with contextlib.closing(sqlite3.connect(path)) as conn:  # an older ring-tuner writing to the same file
        sqlite_utils.Database(conn)[legacy.TABLE].insert(legacy_row(), pk="key", columns=legacy.COLUMNS)
        conn.commit()
    Cache(path).check_writable()
    assert sorted((r["backend"], r["best_s"]) for r in Cache(path).rows()) == [("dense", 0.003), ("scan", 0.002)]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert legacy.TABLE not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}


def test_a_legacy_winner_that_is_not_its_fastest_is_invalid():
    assert legacy.legacy_problem(legacy_row(winner="ring/scan")) == "winner ring/scan is not the fastest of its seconds"
    assert legacy.legacy_problem(legacy_row()) is None


_problems = st.builds(
    Problem, batch=st.integers(1, 4), seq_len=st.sampled_from([64, 256, 4096]), heads=st.sampled_from([2, 4]),
    kv_heads=st.just(2), head_dim=st.sampled_from([8, 64]), value_head_dim=st.none() | st.just(16),
    dtype=st.sampled_from(["float32", "bfloat16"]), causal=st.booleans(),
    window=st.none() | st.tuples(st.integers(0, 40), st.integers(0, 40)), chunk_size=st.none() | st.integers(1, 64),
    segments=st.integers(0, 3),
    softcap=st.none() | st.floats(0.1, 100.0), sinks=st.integers(0, 2), ring_size=st.sampled_from([1, 2, 4]),
    layout=st.sampled_from(["contiguous", "zigzag", "striped"]))


@settings(max_examples=25)
@given(problem=_problems)
def test_a_problem_description_parses_back_to_the_problem(problem):
    assert Problem.parse(problem.describe()) == problem


@settings(max_examples=25)
@given(problem=_problems)
def test_the_loader_call_a_search_prints_plans_the_searched_problem(problem, tmp_path_factory):
    """What `tuner search` stores an entry under is what the loader call it prints (`usage.loader_call`) looks
    up, for any problem: the same key, so the entry is found. Planned from shapes; nothing is compiled."""
    from tuner.cli.usage import loader_call

    db = str(tmp_path_factory.mktemp("cache") / "t.sqlite")
    scope = {"jax": jax, "np": np, "Mesh": Mesh, "get_tuned_ring_attention": get_tuned_ring_attention}
    lines = loader_call(problem, "scan")  # the mesh (on a ring), the loader, then its call on arrays
    exec("\n".join(lines[:-1]).replace("get_tuned_ring_attention(", f"get_tuned_ring_attention(db={db!r}, "), scope)
    dtype = jax.numpy.dtype(problem.dtype)
    b, t = problem.batch, problem.seq_len
    q = jax.ShapeDtypeStruct((b, t, problem.heads, problem.head_dim), dtype)
    k = jax.ShapeDtypeStruct((b, t, problem.kv_heads, problem.head_dim), dtype)
    v = jax.ShapeDtypeStruct((b, t, problem.kv_heads, problem.value_dim), dtype)
    per_call = {}
    if problem.segments:
        ids = jax.ShapeDtypeStruct((b, t), np.int32)
        per_call.update(q_segment_ids=ids, kv_segment_ids=ids)
    if problem.sinks:
        per_call["softmax_aux"] = jax.ShapeDtypeStruct((problem.heads,) + ((problem.sinks,) if problem.sinks > 1
                                                                           else ()), np.float32)
    plan = scope["attn"].explain(q, k, v, **per_call)
    assert plan.key.digest == registry.problem_key(problem, "scan", plan.key.device_kind).digest, (lines, plan.reason)


@pytest.mark.parametrize("text, message", [
    ("B=1 T=64", "not a problem description"),
    ("B=1 T=64 H=4 Hkv=2 D=8 float32 warp=9 | ring 4 x 16 tokens, zigzag", "unknown feature 'warp=9'"),
    ("B=1 T=64 H=4 Hkv=2 D=8 float32 causal | ring 4 x 99 tokens, zigzag", "does not describe one problem"),
    (None, "not a problem description"),
])
def test_a_bad_description_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        Problem.parse(text)
