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
from tuner import BwdParams, FwdParams, autotuning, get_tuned_ring_attention, layouts, record, ring_attention
from tuner.implementations import TileConfig
from tuner.problem import exchanged
from tuner.reference import dense_attention
from tuner.spec import LocalShapes

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
        jax.shard_map(lambda x: ring_attention(x, x, x, axis_name=AXES, strategy="hybrid"),
                      mesh=Mesh(np.array(jax.devices()[:8]).reshape(1, 8), AXES), in_specs=seq, out_specs=seq)(q)


def test_the_loader_runs_it_on_a_2x4_mesh_keyed_by_its_inner_ring_and_replays_the_recorded_call(caplog):
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
    want, want_lse = dense_attention(q, k, v, causal=True, sliding_window=(9, 0))
    assert rel_err(np.asarray(out), np.asarray(want)) <= 1e-5
    assert rel_err(np.asarray(lse), np.asarray(want_lse)) <= 1e-5

    [call] = record.calls_in(step, q, k, v)
    assert (call.strategy, call.ring_size, call.a2a_size, call.decision["key"]) == ("hybrid", 8, 4, key.as_dict())
    assert autotuning.replay(call).decision == call.decision  # explained again with both axes
    with pytest.raises(ValueError, match="tuner search does not search the hybrid strategy yet"):
        call.problem()
    with pytest.raises(ValueError, match=r"hybrid splits the query heads .* heads \(6\) must be a multiple"):
        attn(*(jnp.ones((1, 64, 6, 8)) for _ in range(3)))
