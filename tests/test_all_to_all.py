"""The all-to-all (Ulysses) implementation: exact against the float64 dense reference (forward, lse and
every gradient) on rings of 2, 4 and 8 simulated devices, in every layout, with GQA whose kv heads do
and do not split over the ring; refused for what it cannot honour."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import Case, check_exchanged, check_loader_by_name, rel_err, replace
from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.strategies.all_to_all import kv_repeats
from tuner.strategies.configs import TileConfig
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec, LocalShapes

IMPL = registry.get("all_to_all")


SMALL = TileConfig(FwdParams(8, 16), BwdParams(16, 8))  # several tiles over the full length
SPLIT_DQ = TileConfig(FwdParams(16, 8), BwdParams(8, 16, 16, 8))
BASE = Case(batch=1, length=32, heads=8, kv_heads=4, head_dim=8, ring=4, layout="zigzag")


@pytest.mark.parametrize("case, config", [
    (replace(BASE, causal=True, segments="random", softcap=4.0, sinks="pair"), TileConfig()),
    (replace(BASE, heads=4, kv_heads=2, layout="contiguous", window=(5, 2), chunk=12, sinks="head", batch=2),
     SPLIT_DQ),
    (replace(BASE, ring=2, heads=4, kv_heads=1, layout="striped", causal=True, window=(6, 0),
             explicit_positions=True, scale=0.3), TileConfig()),
    (replace(BASE, ring=8, heads=8, kv_heads=2, causal=True, segments="packed", head_dim=4), SMALL),
], ids=["ring4-zigzag-causal-segments-softcap-sinks-kv-split", "ring4-contiguous-window-chunk-kv-repeated",
        "ring2-striped-positions-window-mqa", "ring8-zigzag-causal-segments-kv-repeated"])
def test_all_to_all_equals_the_dense_reference(case, config):
    """DESIGN section 10's float32 tolerances against float64, forward, lse and every gradient."""
    check_exchanged("all_to_all", case, config)


def test_kv_heads_repeat_to_the_fewest_copies():
    assert [kv_repeats(8, kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert kv_repeats(12, 6, 4) == 2 and kv_repeats(6, 3, 2) == 2
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of the ring size \(4\)"):
        kv_repeats(6, 2, 4)


def test_the_loader_runs_it_by_name_with_lse(caplog):
    check_loader_by_name("all_to_all", 2, (1, 16, 4, 8), 2, 9, caplog)


def test_unsupported_calls_are_refused_by_name_and_skipped_under_auto():
    spec = AttentionSpec(scale=0.3, causal=True, has_bias=True)
    target = registry.Target("cpu")
    with pytest.raises(ValueError, match="backend 'all_to_all' does not support bias.*the ring supports it"):
        registry.choose("all_to_all", spec, jnp.float32, 8, target)
    assert registry.resolve_auto(spec, jnp.float32, 8, target)[0].name == "scan"
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q = jnp.ones((1, 16, 6, 8), jnp.float32)  # 6 query heads do not split over 4 devices
    named = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, backend="all_to_all")
    with pytest.raises(ValueError, match="does not support bias"):
        named.explain(q, q, q, bias=jnp.zeros((1, 1, 1, 16)))

    # Heads that do not split are refused by attend itself ...
    shapes = LocalShapes(1, 4, 4, 6, 6, 8, "float32")
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of the ring size \(4\)"):
        jax.shard_map(lambda x: IMPL.attend(x, x, x, spec=AttentionSpec(scale=0.3), axis_name="sp",
                                            config=IMPL.default_config(shapes, spec), layout="contiguous"),
                      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
    # ... and, asked for by name, when the call is resolved (its shape_violation hook), before anything runs;
    # `auto` runs the scan ring (exact).
    assert IMPL.shape_violation(shapes, 4) == ("all_to_all splits the query heads over the ring: heads (6) must be "
                                               "a multiple of the ring size (4)")
    assert IMPL.shape_violation(shapes, 2) is None
    with pytest.raises(ValueError, match=r"backend 'all_to_all' cannot run these shapes: .*heads \(6\) must be"):
        named(q, q, q)
    out = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)(q, q, q)
    assert rel_err(np.asarray(out), np.asarray(dense_attention(q, q, q, causal=True)[0])) <= 1e-5


def test_the_config_is_the_kernels_on_what_it_runs():
    """The tile hooks take what the kernel runs (`registry.tile_shapes`): the whole sequence of a head
    group, 4 x 64 tokens of one query head and one kv head (2 kv heads, each twice, over 4)."""
    local = LocalShapes(batch=1, q_len=64, kv_len=64, heads=4, kv_heads=2, head_dim=8, dtype="float32")
    shapes = registry.tile_shapes(IMPL, local, 4)
    assert shapes == LocalShapes(batch=1, q_len=256, kv_len=256, heads=1, kv_heads=1, head_dim=8, dtype="float32")
    spec = AttentionSpec(scale=0.3, causal=True)
    default = IMPL.default_config(shapes, spec)
    assert (default.fwd.block_q, default.fwd.block_kv) == (128, 128)  # causal: the scan's masked tile
    full = IMPL.default_config(shapes, AttentionSpec(scale=0.3)).fwd
    assert (full.block_q, full.block_kv) == (128, 256)  # no mask: the scan's defaults at 4 * 64 tokens
    grid = IMPL.space(shapes, spec).grid(default, ("fwd",))
    assert max(c.fwd.block_q for c in grid) == 256 and all(IMPL.violation(shapes, spec, c, ("fwd",)) is None
                                                           for c in grid)
    IMPL.check(default)
    with pytest.raises(ValueError, match="num_warps"):
        IMPL.check(TileConfig(FwdParams(num_warps=4)))
    assert TileConfig.from_dict(default.to_dict()) == default
    assert IMPL.available(registry.Target("cpu", interpret=True)) is None


def test_over_pallas_a_long_sequence_keeps_the_kernels_default():
    """1,048,576 tokens over 8 chips, H=32: Pallas's default runs 4 query heads over the whole sequence, and
    its tile schedule fits SMEM there. Sized for `H * T/P` tokens (what the hooks took before they were
    given the ring), it did not ("66 calls a step ... over 64"), and the search refused it."""
    pallas = registry.get("all_to_all_pallas_tpu")
    local = LocalShapes(batch=1, q_len=131072, kv_len=131072, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    spec = AttentionSpec(scale=128**-0.5, causal=True)
    shapes = registry.tile_shapes(pallas, local, 8)
    assert (shapes.q_len, shapes.heads, shapes.kv_heads) == (1048576, 4, 1)
    default = pallas.default_config(shapes, spec)
    assert pallas.violation(shapes, spec, default, ("fwd", "bwd")) is None
    bound = dataclasses.replace(shapes, q_len=32 * 131072, kv_len=32 * 131072)
    assert "over 64" in pallas.violation(bound, spec, default, ("fwd", "bwd"))


def test_the_loader_call_a_search_prints_names_it_and_meets_its_entry(tmp_path):
    """`auto` over one axis keeps the ring on the CPU, so the call `tuner search --backend all_to_all` prints
    names the backend, and it runs the stored entry (source "exact"); a ring's call names none."""
    from tuner.cache import Cache, make_row
    from tuner.cli.usage import loader_call
    from tuner.semantics.problem import Problem

    problem = Problem(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=8, causal=True, ring_size=4)
    db, key = str(tmp_path / "t.sqlite"), registry.problem_key(problem, "all_to_all", "cpu")
    tuned = TileConfig(FwdParams(32, 64), BwdParams(64, 32))
    Cache(db).put(make_row(key, tuned, versions=registry.versions(IMPL), tool_version="test", objective="fwd+bwd",
                           best_s=0.001, default_s=0.002, speedup=2.0, trials_run=2, trials_pruned=0, study="test"))
    lines = loader_call(problem, "all_to_all")
    assert 'backend="all_to_all"' in lines[1] and "backend=" not in loader_call(problem, "scan")[1]
    scope = {"jax": jax, "np": np, "Mesh": Mesh, "get_tuned_ring_attention": get_tuned_ring_attention}
    exec("\n".join(lines[:2]).replace("mesh=mesh)", f"mesh=mesh, db={db!r})"), scope)
    q = jax.ShapeDtypeStruct((1, 64, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 8), jnp.float32)
    decision = scope["attn"].explain(q, kv, kv)
    assert (decision.backend, decision.source, decision.config) == ("all_to_all", "exact", tuned)
