"""A value head dim other than the query/key head dim (multi-head latent attention: 192/128, 128/64): the
scan ring, the exchanging strategies and the loader against the float64 dense reference, forward and
gradients; the cache key that carries both dims; the problem, the CLI flag and the refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.cases import Case, check_case, check_exchanged, rel_err, replace
from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.cache import Cache, make_row, row_key
from tuner.registry.versions import current_versions
from tuner.semantics.problem import Problem, ProblemKey
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.strategies.configs import TileConfig

TILES = dict(fwd=FwdParams(8, 16), bwd=BwdParams(16, 8, 8, 16))  # several tiles a shard, dq in its own pass
MLA = Case(batch=1, length=32, heads=4, kv_heads=2, head_dim=192, value_head_dim=128, ring=4, layout="zigzag",
           causal=True, **TILES)


@pytest.mark.parametrize("case", [
    MLA,
    replace(MLA, head_dim=128, value_head_dim=64, layout="contiguous", causal=False, window=(5, 3),
            segments="packed", sinks="pair", softcap=8.0),
], ids=["192-128-zigzag-causal", "128-64-contiguous-window-segments-sinks-softcap"])
def test_the_scan_ring_matches_dense(case):
    """Output, lse and dq, dk, dv (each of its own input's head dim) within 1e-5 / 1e-4 of float64 dense."""
    check_case(case)


@pytest.mark.parametrize("name, case, a2a", [
    ("all_to_all", replace(MLA, heads=8, kv_heads=2, head_dim=24, value_head_dim=16), 1),
    ("all_gather", replace(MLA, head_dim=16, value_head_dim=24, segments="random"), 1),
    ("hybrid", replace(MLA, ring=2, head_dim=24, value_head_dim=8), 2),
])
def test_the_exchanging_strategies_match_dense(name, case, a2a):
    check_exchanged(name, case, TileConfig(TILES["fwd"], TILES["bwd"]), a2a)


def test_the_loader_runs_global_arrays_in_the_documents_layout():
    """With `mesh=`, a length the ring does not divide (padded) and packed documents laid out per row."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    rng = np.random.default_rng(0)
    b, t, h, hkv, d, dv = 2, 60, 4, 2, 48, 32
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, hkv, dv)), jnp.float32)
    docs = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents")
    decision = attn.explain(q, k, v, q_segment_ids=docs, kv_segment_ids=docs)
    assert (decision.key.head_dim, decision.key.value_head_dim) == (d, dv)

    def loss(run):
        def value(q, k, v):
            out, lse = run(q, k, v)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True))

    ring = loss(lambda q, k, v: attn(q, k, v, q_segment_ids=docs, kv_segment_ids=docs, return_lse=True))
    (_, (out, lse)), grads = ring(q, k, v)
    with jax.enable_x64(True):
        dense = loss(lambda q, k, v: dense_attention(q, k, v, causal=True, q_segment_ids=docs, kv_segment_ids=docs))
        (_, (want, want_lse)), want_grads = dense(*(x.astype(jnp.float64) for x in (q, k, v)))
    assert out.shape == (b, t, h, dv)
    assert rel_err(np.asarray(out), np.asarray(want)) <= 1e-5
    assert rel_err(np.asarray(lse), np.asarray(want_lse)) <= 1e-5
    for got, wanted, x in zip(grads, want_grads, (q, k, v)):
        assert got.shape == x.shape
        assert rel_err(np.asarray(got), np.asarray(wanted)) <= 1e-4


def test_jax_nn_is_refused_and_auto_passes_it_over():
    spec, target = AttentionSpec(scale=0.1, causal=True), registry.Target("cpu")
    shapes = LocalShapes(1, 16, 16, 4, 2, 192, "float32", value_head_dim=128)
    reason = registry.why_not(registry.get("jax_nn"), spec, jnp.float32, 192, target, shapes=shapes)
    assert reason == "does not support jax.nn.dot_product_attention has no value head dim other than the query/key " \
                     "head dim"
    assert registry.why_not(registry.get("jax_nn"), spec, jnp.float32, 192, target,
                            shapes=LocalShapes(1, 16, 16, 4, 2, 192, "float32")) is None
    assert registry.why_not(registry.get("dense"), spec, jnp.float32, 192, target, shapes=shapes) is None


def test_keys_of_equal_dims_keep_their_digest_and_a_value_dim_makes_another_key():
    """A key of equal dims hashes the fields it always had (cache rows written before stay found); the value
    head dim makes another key, another family, and survives a cache row and back."""
    spec = AttentionSpec(scale=0.1, causal=True)
    common = dict(backend="scan", device_kind="cpu", ring_size=4, layout="zigzag")
    plain = ProblemKey.of(LocalShapes(1, 256, 256, 8, 2, 128, "float32"), spec, **common)
    same = ProblemKey.of(LocalShapes(1, 256, 256, 8, 2, 128, "float32", value_head_dim=128), spec, **common)
    mla = ProblemKey.of(LocalShapes(1, 256, 256, 8, 2, 128, "float32", value_head_dim=64), spec, **common)
    old_fields = dict(batch=1, q_len=256, kv_len=256, heads=8, kv_heads=2, head_dim=128, dtype="float32",
                      **common, features=spec.features(), op="ring_attention")
    assert plain.as_dict() == old_fields and same == plain and same.digest == plain.digest
    assert mla.as_dict()["value_head_dim"] == 64 and mla.digest != plain.digest and mla.family != plain.family
    row = make_row(mla, TILES["fwd"], TILES["bwd"], versions=current_versions("x"), tool_version="t",
                   objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0, trials_run=1, trials_pruned=0, study="s")
    assert json.loads(row["features"])["value_head_dim"] == 64 and row["key"] == mla.digest
    assert row_key(row) == mla


def test_the_cache_finds_the_value_dims_own_row_and_borrows_no_other(tmp_path):
    """An exact lookup of the value dim's row; a problem of equal dims (another family) and one of another
    size (nearest, same family) of the same dims."""
    cache = Cache(tmp_path / "tuned.db")
    versions = registry.versions(registry.get("scan"))
    problem = Problem(seq_len=256, head_dim=32, value_head_dim=16, ring_size=4)
    key, equal_key, longer_key = (registry.problem_key(p, "scan", "cpu") for p in (
        problem, Problem(seq_len=256, head_dim=32, ring_size=4),
        Problem(seq_len=512, head_dim=32, value_head_dim=16, ring_size=4)))
    cache.put_best(make_row(key, TILES["fwd"], TILES["bwd"], versions=versions, tool_version="t", objective="fwd",
                            best_s=1.0, default_s=2.0, speedup=2.0, trials_run=1, trials_pruned=0, study="s"))
    assert cache.lookup(key, versions).source == "exact"
    assert cache.lookup(longer_key, versions).source == "nearest"
    assert cache.lookup(equal_key, versions).row is None


def test_a_problem_describes_and_parses_both_dims():
    problem = Problem(head_dim=192, value_head_dim=128)
    assert " D=192 Dv=128 float32 " in problem.describe()
    assert Problem.parse(problem.describe()) == problem
    assert Problem(head_dim=64, value_head_dim=64) == Problem(head_dim=64)
    assert problem.shapes.value_dim == 128 and problem.spec.scale == 192**-0.5
    with pytest.raises(ValueError, match="value_head_dim must be a positive int"):
        Problem(value_head_dim=0)


def test_the_inputs_are_checked_by_name():
    attn = get_tuned_ring_attention(axis_name=None)
    q, k = jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match=r"key and value must have the same batch, length and heads"):
        attn(q, k, jnp.ones((1, 4, 2, 8)))
    with pytest.raises(ValueError, match="no empty dimension"):
        attn(q, k, jnp.ones((1, 8, 2, 0)))
