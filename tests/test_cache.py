"""The tuning cache: rows are checked, lookups go exact -> nearest -> shipped -> default, stale rows are
never used, exports round-trip, concurrent writers lose nothing, a corrupt file is reported."""

import json
import logging
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from tuner import BwdParams, FwdParams, registry
from tuner.kernels import BACKENDS
from tuner.cache import (Cache, CacheError, current_versions, make_row, read_jsonl, row_params, row_problem,
                         write_jsonl)
from tuner.semantics.problem import Problem

SCAN = BACKENDS["scan"]


def versions():
    return current_versions(SCAN.code_hash())


def row_for(problem: Problem, block_q: int = 64, **overrides):
    row = make_row(registry.problem_key(problem, "scan", "cpu"), FwdParams(block_q, 128), BwdParams(block_q, 128),
                   versions=versions(), tool_version="test", objective="fwd+bwd", best_s=1.0, default_s=2.0,
                   speedup=2.0, trials_run=3, trials_pruned=0, trials_failed={"wrong": 1}, study="s")
    row.update(overrides)
    return row


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr("tuner.support.resources.shipped_dir", lambda: tmp_path / "shipped")
    return Cache(tmp_path / "tuning.sqlite")


def test_put_and_find_round_trip(cache):
    row = row_for(Problem())
    cache.put(row)
    (found,) = cache.find(row["key"][:6])
    assert found == row
    assert row_params(found) == (FwdParams(64, 128), BwdParams(64, 128))


def test_rows_are_checked_before_writing(cache):
    row = row_for(Problem())
    with pytest.raises(ValueError, match="best_s"):
        cache.put({**row, "best_s": "fast"})
    with pytest.raises(ValueError, match="hash to"):
        cache.put({**row, "batch": 2})  # key fields no longer match the key
    with pytest.raises(ValueError, match="missing field"):
        cache.put({k: v for k, v in row.items() if k != "speedup"})
    assert cache.rows() == []


def test_lookup_order_exact_nearest_shipped_default(cache, tmp_path):
    problem = Problem(seq_len=2048)
    key = registry.problem_key(problem, "scan", "cpu")
    assert cache.lookup(key, versions()).source == "default"

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    write_jsonl(shipped / "cpu.jsonl", [row_for(Problem(seq_len=8192), block_q=32)])
    found = cache.lookup(key, versions())
    assert (found.source, row_params(found.row)[0].block_q) == ("shipped", 32)

    cache.put(row_for(Problem(seq_len=4096), block_q=128))  # same family, other shape
    cache.put(row_for(Problem(seq_len=65536), block_q=256))  # farther away
    cache.put(row_for(Problem(seq_len=2048, head_dim=128), block_q=512))  # other family: never borrowed
    found = cache.lookup(key, versions())
    assert (found.source, row_params(found.row)[0].block_q) == ("nearest", 128)

    cache.put(row_for(problem, block_q=64))
    found = cache.lookup(key, versions())
    assert (found.source, row_params(found.row)[0].block_q) == ("exact", 64)


def test_stale_rows_are_kept_but_not_used(cache):
    problem = Problem()
    cache.put(row_for(problem, jax_version="0.0.1"))
    found = cache.lookup(registry.problem_key(problem, "scan", "cpu"), versions())
    assert found.source == "default"
    assert "jax_version 0.0.1 ->" in found.reason
    assert len(cache.rows()) == 1


def test_accept_can_reject_a_row(cache):
    problem = Problem()
    cache.put(row_for(problem))
    found = cache.lookup(registry.problem_key(problem, "scan", "cpu"), versions(), accept=lambda row: "tiles too big")
    assert found.source == "default" and "tiles too big" in found.reason


def test_export_import_round_trip_and_bad_lines(cache, tmp_path):
    rows = [row_for(Problem(seq_len=n)) for n in (1024, 2048, 4096)]
    cache.put_many(rows)
    path = tmp_path / "out.jsonl"
    assert write_jsonl(path, cache.rows()) == 3
    assert sorted(r["key"] for r in read_jsonl(path)) == sorted(r["key"] for r in rows)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        list(read_jsonl(bad))
    bad.write_text(json.dumps({**rows[0], "fwd_params": json.dumps({"block_q": -1, "block_kv": 8})}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*block_q"):
        list(read_jsonl(bad))


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "tuning.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(CacheError, match="move it aside"):
        Cache(path).rows()


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    """Two writers, 40 rows each, one transaction per row, started together: all 80 rows arrive."""
    db = tmp_path / "tuning.sqlite"
    writer = textwrap.dedent(f"""
        import sys
        from tests.test_cache import row_for
        from tuner.cache import Cache
        from tuner.semantics.problem import Problem
        cache = Cache({str(db)!r})
        offset = int(sys.argv[1])
        for i in range(40):
            cache.put(row_for(Problem(batch=offset + i + 1)))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(offset)], cwd=str(_repo_root()),
                              stderr=subprocess.PIPE, text=True) for offset in (0, 1000)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert len(Cache(db).rows()) == 80


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


def test_triton_version_only_matters_to_triton_entries():
    import importlib.metadata

    assert current_versions("abc")["triton_version"] == "-"
    try:
        installed = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        installed = "-"
    assert current_versions("abc", triton=True)["triton_version"] == installed


def test_invalid_rows_are_skipped_with_one_warning_each(cache, caplog):
    """A row the loader would pick, with a params JSON it cannot use: skipped, warned about once (not at
    every lookup), and the next usable row wins."""
    problem = Problem(seq_len=2048)
    good = row_for(Problem(seq_len=4096), block_q=128)
    cache.put(good)
    bad = row_for(problem)
    bad["fwd_params"] = json.dumps({"block_q": 64, "block_kv": 128, "tile": 3})
    with sqlite3.connect(cache.path) as conn:  # written behind the cache's back, as a foreign tool could
        conn.execute(f"INSERT INTO tuned ({', '.join(bad)}) VALUES ({', '.join('?' * len(bad))})", list(bad.values()))
    with caplog.at_level(logging.WARNING, logger="tuner.cache"):
        for _ in range(3):
            found = cache.lookup(registry.problem_key(problem, "scan", "cpu"), versions())
    assert (found.source, found.row["key"]) == ("nearest", good["key"])
    assert "unknown key(s) tile" in found.reason
    warnings = [r.getMessage() for r in caplog.records if bad["key"] in r.getMessage()]
    assert len(warnings) == 1 and str(cache.path) in warnings[0] and "unknown key(s) tile" in warnings[0]


@pytest.mark.parametrize("field, value, message", [
    ("best_s", float("nan"), "finite positive"), ("speedup", -1.0, "finite positive"), ("batch", 0, "positive integer"),
    ("measured_at", "yesterday", "ISO date"), ("bwd_params", "null", "JSON object"),
    ("fwd_params", "[64, 64]", "JSON object"),
    ("features", json.dumps({"causal": "yes"}), "features"), ("trials_failed", "{\"wrong\": -1}", "counts"),
])
def test_row_validation_names_what_is_wrong(field, value, message):
    row = row_for(Problem())
    assert row_problem(row) is None
    assert message in row_problem({**row, field: value})


def test_put_best_keeps_the_better_of_two_results(cache):
    problem = Problem()
    first = row_for(problem, block_q=64, speedup=1.5)
    assert cache.put_best(first)["speedup"] == 1.5
    assert cache.put_best(row_for(problem, block_q=128, speedup=1.2))["fwd_params"] == first["fwd_params"]
    assert cache.put_best(row_for(problem, block_q=256, speedup=1.8))["speedup"] == 1.8
    other = row_for(problem, block_q=32, speedup=1.1, objective="fwd")  # another question: replaces
    assert cache.put_best(other)["objective"] == "fwd"
    (stored,) = cache.rows()
    assert stored["objective"] == "fwd"


def test_listing_pages_and_filters(cache, capsys):
    from tuner.cli import main

    cache.put_many([row_for(Problem(batch=b)) for b in range(1, 8)] +
                   [row_for(Problem(batch=1, head_dim=128))])
    page = cache.listing(limit=3, offset=3)
    assert (len(page.rows), page.total) == (3, 8)
    assert cache.listing(where={"head_dim": 128}).total == 1
    with pytest.raises(ValueError, match="cannot filter on best_s"):
        cache.listing(where={"best_s": 1.0})
    assert main(["list", "--db", str(cache.path), "--limit", "3", "--page", "3"]) == 0
    out = capsys.readouterr().out
    assert "entries 7-8 of 8" in out and len(out.strip().splitlines()) == 2 + 2 + 1
    assert main(["list", "--db", str(cache.path), "--head-dim", "128"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert main(["list", "--db", str(cache.path), "--page", "9"]) == 2
    assert "past the last page" in capsys.readouterr().err
