"""The all-gather KV implementation: exact against the float64 dense reference (forward, lse and every
gradient) on rings of 2, 4 and 8 simulated devices, in every layout, with GQA and MQA; its backward
reduce-scatters dK and dV; refused for a bias and for gathered K/V over half the device's memory."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import Case, check_exchanged, check_loader_by_name, exchanged_step, laid_out_args, make_arrays, replace
from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.strategies import all_gather
from tuner.strategies.configs import TileConfig
from tuner.semantics.spec import AttentionSpec, LocalShapes

IMPL = registry.get("all_gather")


SMALL = TileConfig(FwdParams(8, 16), BwdParams(16, 8))  # several tiles over the local queries and the full keys
SPLIT_DQ = TileConfig(FwdParams(16, 32), BwdParams(8, 16, 16, 8))
BASE = Case(batch=1, length=64, heads=4, kv_heads=2, head_dim=16, ring=4, layout="zigzag")


@pytest.mark.parametrize("case, config", [
    (replace(BASE, causal=True, segments="random", softcap=4.0, sinks="pair"), SMALL),
    (replace(BASE, layout="contiguous", window=(9, 3), chunk=24, sinks="head", batch=2), SPLIT_DQ),
    (replace(BASE, ring=2, kv_heads=1, layout="striped", causal=True, window=(12, 0), explicit_positions=True,
             scale=0.3), TileConfig()),
    (replace(BASE, length=128, ring=8, causal=True, segments="packed"), SMALL),
], ids=["ring4-zigzag-causal-segments-softcap-sinks", "ring4-contiguous-window-chunk",
        "ring2-striped-positions-window-mqa", "ring8-zigzag-causal-segments"])
def test_all_gather_equals_the_dense_reference(case, config):
    """DESIGN section 10's float32 tolerances against float64, forward, lse and every gradient."""
    check_exchanged("all_gather", case, config)


def collectives(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(primitive, output shape) of every reduce-scatter, psum and all-gather in a jaxpr's text."""
    found = []
    for lhs, primitive in re.findall(r"^\s*(.*?)\s*=\s*(reduce_scatter|psum\w*|all_gather\w*)\[", text, re.M):
        found += [(primitive, tuple(int(n) for n in dims.split(",") if n))
                  for dims in re.findall(r":f32\[([\d,]*)\]", lhs)]
    return found


def test_the_backward_reduce_scatters_dk_and_dv():
    """K and V are gathered heads-major, as the kernels read them, and dK and dV reduce-scattered so: one
    collective each, no psum of them."""
    case = replace(BASE, causal=True, sinks="head")
    args = laid_out_args(case, make_arrays(case))
    text = str(jax.make_jaxpr(exchanged_step("all_gather", case, SMALL))(*args))
    found = collectives(text)
    b, t, hkv, d, ring = case.batch, case.length, case.kv_heads, case.head_dim, case.ring
    shard, full = (b, hkv, t // ring, d), (b, hkv, t, d)
    assert [p for p, shape in found if p == "reduce_scatter" and shape == shard] == ["reduce_scatter"] * 2, found
    assert [p for p, shape in found if p.startswith("all_gather") and shape == full] == ["all_gather"] * 2, found
    assert not [p for p, shape in found if p.startswith("psum") and shape in (shard, full)], found
    assert [p for p, shape in found if p.startswith("psum")] == ["psum_invariant"], found  # d sinks, summed
    assert ("psum_invariant", (case.heads,)) in found


def test_the_loader_runs_it_by_name_with_lse(caplog):
    check_loader_by_name("all_gather", 4, (1, 64, 4, 16), 1, 17, caplog)


def test_a_bias_is_refused_by_name_and_skipped_under_auto():
    spec = AttentionSpec(scale=0.3, causal=True, has_bias=True)
    target = registry.Target("cpu")
    with pytest.raises(ValueError, match="backend 'all_gather' does not support bias.*the ring supports it"):
        registry.choose("all_gather", spec, jnp.float32, 16, target)
    assert registry.resolve_auto(spec, jnp.float32, 16, target)[0].name == "scan"
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q = jnp.ones((1, 64, 4, 16), jnp.float32)
    named = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, backend="all_gather")
    with pytest.raises(ValueError, match="does not support bias"):
        named.explain(q, q, q, bias=jnp.zeros((1, 1, 1, 64)))
    with pytest.raises(ValueError, match="all_gather does not support bias"):
        IMPL.attend(q, q, q, spec=spec, config=TileConfig(), axis_name=None, layout="contiguous",
                    bias=jnp.zeros((1, 1, 1, 64)))


def test_gathered_bytes_and_the_memory_refusal(monkeypatch):
    shapes = LocalShapes(batch=2, q_len=16, kv_len=32, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16")
    assert all_gather.gathered_bytes(shapes, 4) == 2 * 2 * 128 * 2 * 64 * 2  # K and V, B, T, Hkv, D, bytes
    if jax.devices()[0].platform == "cpu":
        assert all_gather.device_bytes_limit() is None  # the CPU reports no limit: nothing is refused

    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    needed = 2 * 1 * 64 * 2 * 16 * 4
    spec = AttentionSpec(scale=0.25, causal=True)

    def trace(limit: int):  # a fresh function each time: jax would reuse the trace of the last one
        monkeypatch.setattr(all_gather, "device_bytes_limit", lambda: limit)
        attend = jax.shard_map(lambda q, k, v: IMPL.attend(q, k, v, spec=spec, config=TileConfig(), axis_name="sp",
                                                           layout="zigzag"),
                               mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
        return jax.eval_shape(attend, q, kv, kv)

    assert trace(2 * needed).shape == q.shape  # exactly half: accepted
    with pytest.raises(ValueError, match=r"all_gather would hold .* GiB of gathered K/V per device, over half the "
                                         r"device's .* GiB; use the ring or all_to_all"):
        trace(2 * needed - 1)


def test_the_config_is_the_kernels_on_the_local_queries_and_the_whole_keys():
    local = LocalShapes(batch=1, q_len=64, kv_len=64, heads=4, kv_heads=2, head_dim=8, dtype="float32")
    shapes = registry.tile_shapes(IMPL, local, 4)  # what the kernel runs: 64 queries against 4 x 64 keys
    assert shapes == dataclasses.replace(local, kv_len=256)
    spec = AttentionSpec(scale=0.3, causal=True)
    default = IMPL.default_config(shapes, spec)
    assert (default.fwd.block_q, default.fwd.block_kv) == (64, 128)  # local queries; causal: the masked tile
    full = IMPL.default_config(shapes, AttentionSpec(scale=0.3)).fwd
    assert (full.block_q, full.block_kv) == (64, 256)  # no mask: the scan's defaults at 4 * 64 keys
    grid = IMPL.space(shapes, spec).grid(default, ("fwd", "bwd"))
    assert max(c.fwd.block_kv for c in grid) == 256 and max(c.fwd.block_q for c in grid) == 64
    assert max(c.bwd.block_q_dkv for c in grid) == 64
    assert all(IMPL.violation(shapes, spec, c, ("fwd", "bwd")) is None for c in grid)
    # 64 devices of 4 keys make a 256-key tile: 4 B * 16 * 32 * 1024 * 256 is 512 MiB.
    wide = registry.tile_shapes(IMPL, LocalShapes(batch=16, q_len=1024, kv_len=4, heads=32, kv_heads=8, head_dim=64,
                                                  dtype="float32"), 64)
    assert "512 MiB, over the 256 MiB tile limit" in IMPL.violation(wide, spec, TileConfig(FwdParams(1024, 256)),
                                                                    ("fwd",))
    assert IMPL.violation(dataclasses.replace(wide, kv_len=128), spec, TileConfig(FwdParams(1024, 256)),
                          ("fwd",)) is None  # 32 devices: the key tile is the 128 keys
    IMPL.check(default)
    with pytest.raises(ValueError, match="num_warps"):
        IMPL.check(TileConfig(FwdParams(num_warps=4)))
    assert TileConfig.from_dict(default.to_dict()) == default
    assert IMPL.available(registry.Target("cpu", interpret=True)) is None
