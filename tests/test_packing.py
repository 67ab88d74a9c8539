"""Packed problems tuned for their packing: `Packing` (parse, describe, rows, statistics, fit), the problem and the
key that carry it, the search workload that draws it, the loader's `packing=`, the recorded call."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tuner import get_tuned_ring_attention, registry
from tuner.cache import Cache, make_row, row_key
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics import layouts
from tuner.semantics.packing import Packing
from tuner.semantics.problem import Problem
from tuner.tuning.workload import Workload


@pytest.mark.parametrize("text, lengths", [
    ("2048,128x16", [2048] + [128] * 16),
    ("100x2,56", [100, 100, 56]),
])
def test_fixed_packings_are_their_lengths(text, lengths):
    packing = Packing.parse(text)
    assert packing.row_lengths(sum(lengths)) == lengths and packing.describe() == text
    ids = packing.segment_ids(sum(lengths), batch=2)
    assert ids.shape == (2, sum(lengths)) and Packing.of_segment_ids(ids) == packing
    with pytest.raises(ValueError, match=f"sum to {sum(lengths)} tokens, not the sequence length 4"):
        packing.row_lengths(4)


@pytest.mark.parametrize("text", ["lognormal:14", "lognormal:5,sigma=2,seed=3", "uniform:8,seed=1"])
def test_drawn_packings_fill_each_row_differently_and_reproducibly(text):
    packing = Packing.parse(text)
    rows = [packing.row_lengths(1000, row) for row in range(3)]
    assert all(len(r) == packing.documents and sum(r) == 1000 and min(r) >= 1 for r in rows)
    assert rows[0] != rows[1] and rows == [Packing.parse(text).row_lengths(1000, row) for row in range(3)]
    assert Packing.parse(packing.describe()) == packing


def test_a_long_tail_shows_in_the_statistics():
    tail = Packing.parse("lognormal:14,sigma=2").statistics(4096, batch=4)
    equal = Packing.parse("256x16").statistics(4096)
    assert equal == {"documents": 16.0, "mean_length": 256.0, "longest": 256.0, "longest_work_share": 1 / 16}
    assert tail["documents"] == 14.0 and tail["longest_work_share"] > 4 * equal["longest_work_share"]


def test_a_fitted_packing_is_the_rows_own_or_the_log_normal_they_were_drawn_from():
    """`Packing.fit`: rows that all hold the same lengths are that fixed packing; drawn rows give back the
    drawn count and, over 32 rows, their sigma within 0.15."""
    assert Packing.fit(Packing.parse("2048,128x16").segment_ids(4096, batch=3)) == Packing.parse("2048,128x16")
    assert Packing.fit(np.repeat([1, 2, 3], [5, 1, 2])) == Packing("fixed", (5, 1, 2))
    for drawn in (Packing.parse("lognormal:14,sigma=1.5,seed=2"), Packing.parse("lognormal:40,sigma=0.5")):
        fitted = Packing.fit(drawn.segment_ids(4096, batch=32))
        assert (fitted.kind, fitted.count) == ("lognormal", drawn.count), fitted
        assert abs(fitted.sigma - drawn.sigma) <= 0.15, (fitted, drawn)
        assert Packing.parse(fitted.describe()) == fitted
    near_equal = np.stack([np.repeat(np.arange(8), 8), np.repeat(np.arange(16), 4)])  # equal lengths, counts differ
    assert Packing.fit(near_equal) == Packing("lognormal", count=12, sigma=0.05)
    for bad in (np.zeros((2, 2, 4), np.int32), np.zeros((2, 0), np.int32), np.zeros((0, 4), np.int32),
                np.zeros(4, np.float32)):  # no rows gave an IndexError
        with pytest.raises(ValueError, match="segment_ids must be integer ids of shape"):
            Packing.fit(bad)


def test_drawn_rows_are_a_search_s_own_and_keep_the_undeclared_key():
    """`Problem.drawn`: the search draws its rows, the key stays the one undeclared calls look up, and it
    is refused where the key names a packing or the problem has no segment ids."""
    undeclared = Problem(seq_len=256, heads=2, kv_heads=1, head_dim=8, ring_size=4, segments=4)
    drawn = Problem(seq_len=256, heads=2, kv_heads=1, head_dim=8, ring_size=4, segments=4, drawn="128,16x8")
    assert drawn.documents == Packing.parse("128,16x8") and Problem.parse(drawn.describe()) == drawn
    assert registry.problem_key(drawn, "scan", "cpu") == registry.problem_key(undeclared, "scan", "cpu")
    with pytest.raises(ValueError, match="it needs segments > 0 and packing None"):
        Problem(seq_len=256, ring_size=4, packing="128,16x8", drawn="128,16x8")
    with pytest.raises(ValueError, match="it needs segments > 0 and packing None"):
        Problem(seq_len=256, ring_size=4, drawn="128,16x8")
    with pytest.raises(ValueError, match="drawn='100': the documents' lengths sum to 100"):
        Problem(seq_len=256, ring_size=4, segments=4, drawn="100")


@pytest.mark.parametrize("text, message", [
    ("", "a packing is fixed lengths like"),
    ("lognormal:0", "positive document count"),
    ("uniform:3,sigma=2", "a uniform packing has no sigma"),
    ("lognormal:3,seed=x", "sigma must be a number and seed an int"),
])
def test_bad_packings_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        Packing.parse(text)


def test_a_problem_keeps_its_packing_in_its_description_and_its_key():
    problem = Problem(seq_len=1024, packing="512,32x16")
    assert problem.segments == 17 and "segments=17 packing=512,32x16" in problem.describe()
    assert Problem.parse(problem.describe()) == problem
    unnamed = Problem(seq_len=1024, segments=17)
    key, unnamed_key = (registry.problem_key(p, "scan", "cpu") for p in (problem, unnamed))
    assert key.packing == "512,32x16" and unnamed_key.packing is None and "packing" not in unnamed_key.as_dict()
    assert key.digest != unnamed_key.digest and key.family != unnamed_key.family
    row = make_row(key, FwdParams(64, 64), BwdParams(64, 64), versions=registry.versions(registry.get("scan")),
                   tool_version="t", objective="fwd", best_s=1.0, default_s=1.0, speedup=1.0, trials_run=1,
                   trials_pruned=0, study="s")
    assert json.loads(row["features"])["packing"] == "512,32x16" and row_key(row) == key
    with pytest.raises(ValueError, match="does not match the packing's 17 documents"):
        Problem(seq_len=1024, segments=3, packing="512,32x16")
    with pytest.raises(ValueError, match="packing='1000': the documents' lengths sum to 1000"):
        Problem(seq_len=1024, packing="1000")


def test_the_workload_draws_the_packing_in_the_problems_layout():
    problem = Problem(batch=2, seq_len=256, heads=2, kv_heads=1, head_dim=8, ring_size=4, layout="zigzag",
                      packing="lognormal:5,seed=2")
    inputs, _ = Workload(problem).draw(seed=0)
    natural = np.take(np.asarray(inputs["segment_ids"]), np.argsort(layouts.global_order("zigzag", 256, 4)), axis=1)
    assert np.array_equal(natural, problem.documents.segment_ids(256, 2))


def test_the_loader_runs_the_config_tuned_for_its_declared_packing(tmp_path):
    """A row tuned for a packing is the exact entry of calls that declare it, and of no other call; a declared
    packing without segment ids is refused by name; an undeclared one says how to declare it."""
    db = tmp_path / "tuned.db"
    problem = Problem(seq_len=256, heads=2, kv_heads=1, head_dim=8, ring_size=4, packing="128,16x8")
    key = registry.problem_key(problem, "scan", "cpu")
    Cache(db).put_best(make_row(key, FwdParams(16, 32), BwdParams(32, 16), tool_version="t", objective="fwd",
                                versions=registry.versions(registry.get("scan")), best_s=1.0, default_s=2.0,
                                speedup=2.0, trials_run=1, trials_pruned=0, study="s"))
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q = jax.ShapeDtypeStruct((1, 256, 2, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 256, 1, 8), jnp.float32)
    seg = jnp.asarray(problem.documents.segment_ids(256, 1))
    declared = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(db), packing="128,16x8")
    plain = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(db))
    decision = declared.explain(q, k, k, q_segment_ids=seg, kv_segment_ids=seg)
    assert (decision.source, decision.key) == ("exact", key)
    assert decision.config.fwd == FwdParams(16, 32)
    undeclared = plain.explain(q, k, k, q_segment_ids=seg, kv_segment_ids=seg)
    assert undeclared.source == "default" and "packed rows without packing=" in undeclared.reason
    assert "without packing=" not in decision.reason
    with pytest.raises(ValueError, match="packing='128,16x8' describes the documents of packed rows"):
        declared.explain(q, k, k)
    with pytest.raises(ValueError, match="packing: a packing is fixed lengths"):
        get_tuned_ring_attention(packing="many")


def test_a_recorded_call_keeps_its_packing_and_value_dim_for_the_search(tmp_path):
    """What `tuner.autotune` and `tuner search --from` tune: the recorded call's problem names the declared
    packing and the value head dim, under the key its loader looks up (`problem()` checks it), and a replay of
    the call decides for that same key."""
    from tuner.runtime import record
    from tuner.tuning.autotuning import replay

    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=tmp_path / "db.sqlite",
                                    packing="lognormal:3")
    q, v = jax.ShapeDtypeStruct((1, 64, 2, 24), jnp.float32), jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    (call,) = record.calls_in(lambda q, v, s: attn(q, q, v, q_segment_ids=s, kv_segment_ids=s), q, v, seg)
    problem = call.problem()
    assert (problem.packing, problem.segments, problem.value_head_dim) == ("lognormal:3", 3, 16)
    assert replay(call).decision["key"] == call.decision["key"]
    assert record.Call.from_json(json.loads(json.dumps(call.to_json()))) == call
