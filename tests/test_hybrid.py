"""The 2-D hybrid (USP): exact against the float64 dense reference (forward, lse and every gradient) on 2x4
and 4x2 meshes of simulated devices, in every layout of its ring axis, with GQA whose kv heads do and do not
split over the all-to-all axis; reachable from `ring_attention` and the loader, keyed by its inner ring's
problem, recorded with its axes, refused for what it cannot honour."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import Case, check_exchanged, rel_err, replace
from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry, ring_attention
from tuner.tuning import autotuning
from tuner.semantics import layouts
from tuner.runtime import record
from tuner.strategies.configs import TileConfig
from tuner.semantics.problem import Problem
from tuner.strategies.all_to_all import exchanged
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import LocalShapes

AXES = ("ring", "a2a")
SMALL = TileConfig(FwdParams(8, 16), BwdParams(16, 8))  # several tiles over the chunk
SPLIT_DQ = TileConfig(FwdParams(16, 8), BwdParams(8, 16, 16, 8))
BASE = Case(batch=1, length=32, heads=8, kv_heads=4, head_dim=8, ring=2, layout="zigzag")


def mesh_of(ring: int, a2a: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:ring * a2a]).reshape(ring, a2a), AXES)


def random(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("case, a2a, config", [
    (replace(BASE, causal=True, segments="random", softcap=4.0, sinks="pair"), 4, TileConfig()),
    (replace(BASE, ring=4, heads=4, kv_heads=1, layout="contiguous", window=(5, 2), chunk=12, sinks="head", batch=2),
     2, SPLIT_DQ),
    (replace(BASE, heads=4, kv_heads=1, layout="striped", causal=True, window=(6, 0), explicit_positions=True,
             scale=0.3), 4, TileConfig()),
    (replace(BASE, ring=4, heads=8, kv_heads=2, causal=True, segments="packed", head_dim=4), 2, SMALL),
], ids=["2x4-zigzag-causal-segments-softcap-sinks-kv-split", "4x2-contiguous-window-chunk-sinks-kv-repeated",
        "2x4-striped-positions-window-mqa", "4x2-zigzag-causal-packed-segments"])
def test_hybrid_equals_the_dense_reference(case, a2a, config):
    """DESIGN section 10's float32 tolerances against float64, forward, lse and every gradient; the layout
    is over the ring axis (`case.ring` positions), each position's chunk cut over the `a2a` devices."""
    check_exchanged("hybrid", case, config, a2a)


def test_exchanged_shapes_are_what_the_inner_ring_sees():
    shapes = LocalShapes(1, 8, 8, 8, 2, 16, "float32")
    assert exchanged(shapes, 4) == LocalShapes(1, 32, 32, 2, 1, 16, "float32")  # 2 kv heads, each twice, over 4
    assert exchanged(LocalShapes(1, 8, 8, 8, 8, 16, "float32"), 4).kv_heads == 2
    assert exchanged(LocalShapes(1, 8, 8, 8, 1, 16, "float32"), 2).kv_heads == 1  # MQA: the one head on each
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of the all-to-all group \(4\)"):
        exchanged(LocalShapes(1, 8, 8, 6, 2, 16, "float32"), 4)


def test_ring_attention_runs_the_hybrid_under_the_callers_shard_map_with_its_params():
    q, k, v = random((1, 32, 4, 8), 0), random((1, 32, 2, 8), 1), random((1, 32, 2, 8), 2)
    mesh, seq = mesh_of(4, 2), P(None, AXES)

    def local(q, k, v):
        return ring_attention(q, k, v, causal=True, axis_name=AXES, layout="zigzag", strategy="hybrid",
                              fwd_params=FwdParams(4, 8), bwd_params=BwdParams(8, 4))

    def loss(q, k, v):  # the layout is over the 4 ring positions
        out = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)(
            *(layouts.lay_out(x, "zigzag", 4) for x in (q, k, v)))
        return jnp.sum(layouts.restore(out, "zigzag", 4) ** 2)

    def dense_loss(q, k, v):
        return jnp.sum(dense_attention(q, k, v, causal=True)[0] ** 2)

    got, want = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(dense_loss, (0, 1, 2)))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(np.asarray(g), np.asarray(w)) <= 1e-4, name
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of its size \(8\)"):
        jax.eval_shape(jax.shard_map(  # traced only: run eagerly, shard_map compiles every op before the refusal
            lambda x: ring_attention(x, x, x, axis_name=AXES, strategy="hybrid"),
            mesh=Mesh(np.array(jax.devices()[:8]).reshape(1, 8), AXES), in_specs=seq, out_specs=seq), q)


def test_the_loader_runs_it_on_a_2x4_mesh_keyed_by_its_inner_ring_and_records_the_call(caplog):
    mesh = mesh_of(2, 4)
    attn = get_tuned_ring_attention(axis_name=AXES, causal=True, sliding_window=(9, 0), mesh=mesh)
    q, k, v = random((1, 64, 8, 8), 3), random((1, 64, 2, 8), 4), random((1, 64, 2, 8), 5)
    decision = attn.explain(q, k, v, return_lse=True)
    assert (decision.backend, decision.source) == ("hybrid", "default")
    # What the inner ring runs: 2 positions of 32 tokens, 8 / 4 query heads, 2 kv heads each twice over 4.
    key = decision.key
    assert (key.q_len, key.kv_len, key.heads, key.kv_heads, key.ring_size, key.layout) == (32, 32, 2, 1, 2, "zigzag")
    local = get_tuned_ring_attention(axis_name=AXES, causal=True, sliding_window=(9, 0), layout="zigzag")
    shard = [jax.ShapeDtypeStruct((1, 8, *x.shape[2:]), x.dtype) for x in (q, k, v)]
    assert local.explain(*shard, ring_size=(2, 4), return_lse=True).key == key
    with pytest.raises(ValueError, match=r"ring_size must be the pair \(R, A\)"):
        local.explain(*shard, ring_size=8)

    step = jax.jit(lambda q, k, v: attn(q, k, v, return_lse=True))
    with caplog.at_level(logging.WARNING):
        out, lse = step(q, k, v)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "it must not fall back"
    want, want_lse = jax.jit(lambda *a: dense_attention(*a, causal=True, sliding_window=(9, 0)))(q, k, v)
    assert rel_err(np.asarray(out), np.asarray(want)) <= 1e-5
    assert rel_err(np.asarray(lse), np.asarray(want_lse)) <= 1e-5

    [call] = record.calls_in(step, q, k, v)
    assert (call.strategy, call.ring_size, call.a2a_size, call.decision["key"]) == ("hybrid", 8, 4, key.as_dict())
    assert autotuning.replay(call).decision == call.decision  # explained again with both axes
    assert call.problem() == Problem(batch=1, seq_len=64, heads=8, kv_heads=2, head_dim=8, causal=True,
                                     window=(9, 0), ring_size=8, a2a_size=4)  # what `tuner autotune` searches
    assert registry.problem_key(call.problem(), "hybrid", "cpu") == key
    with pytest.raises(ValueError, match=r"hybrid splits the query heads .* heads \(6\) must be a multiple"):
        attn(*(np.ones((1, 64, 6, 8), np.float32) for _ in range(3)))


def test_tuner_search_tunes_the_hybrid_and_the_loader_call_it_prints_meets_the_entry(tmp_path):
    """A hybrid problem (`a2a_size` > 1, `tuner search --a2a-size`): every trial is checked against the scan
    ring over the same devices as one axis (`verify`), the winner is stored under the hybrid's key, and the
    loader call the search prints runs it (source "exact"), equal to dense attention."""
    from tuner.tuning.bench import bench_mechanisms
    from tuner.tuning.search import SearchOptions, resolve_backend, search
    from tuner.cli.usage import loader_call

    problem = Problem(batch=1, seq_len=128, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=4,
                      a2a_size=2, segments=2, sinks=1)
    assert problem.describe().endswith("| ring 2 x a2a 2 x 32 tokens, zigzag")
    assert Problem.parse(problem.describe()) == problem
    db = str(tmp_path / "tuning.sqlite")
    result = search(problem, backend="hybrid", db=db, options=SearchOptions(
        objective="fwd", trials=2, runs=1, final_runs=1, top=1, sampler="random",
        storage=f"sqlite:///{tmp_path / 'studies.db'}"))
    assert result.stored and result.failed == {} and result.key == registry.problem_key(problem, "hybrid", "cpu")

    lines = loader_call(problem)
    assert lines[0] == 'mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "a2a"))'
    scope = {"jax": jax, "np": np, "Mesh": Mesh, "get_tuned_ring_attention": get_tuned_ring_attention}
    exec("\n".join(lines[:2]).replace("mesh=mesh)", f"mesh=mesh, db={db!r})"), scope)
    q, k, v = random((1, 128, 4, 16), 6), random((1, 128, 2, 16), 7), random((1, 128, 2, 16), 8)
    segments, sinks = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), 64)[None]), random((4,), 9)
    attn = scope["attn"]
    arrays = dict(q_segment_ids=segments, kv_segment_ids=segments, softmax_aux=sinks)
    decision = attn.explain(q, k, v, **arrays)
    assert (decision.backend, decision.source, decision.key) == ("hybrid", "exact", result.key)
    out, want = jax.jit(lambda *a: (attn(*a, **arrays), dense_attention(*a, causal=True, **arrays)[0]))(q, k, v)
    assert rel_err(np.asarray(out), np.asarray(want)) <= 1e-5

    with pytest.raises(ValueError, match="backend 'scan' with a2a_size=2: it runs over 1 mesh axis"):
        resolve_backend("scan", problem, "cpu")
    with pytest.raises(ValueError, match="--mechanisms compares the implementations over one mesh axis"):
        bench_mechanisms(problem, device="cpu", db=db)
    with pytest.raises(ValueError, match="a2a_size=3 must divide ring_size=4"):
        Problem(ring_size=4, heads=4, kv_heads=2, a2a_size=3)
