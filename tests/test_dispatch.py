"""The runtime loader: trace-time decisions from the cache, fallbacks with reasons, exact results under
jit, grad and shard_map (its own, with mesh=, or the caller's)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import BwdParams, FwdParams, get_tuned_ring_attention
from tuner.strategies.ring import run_ring
from tuner.runtime import dispatch as dispatch_module
from tuner.strategies import configs, implementations
from tuner import registry
from tuner.kernels import BACKENDS
from tuner.kernels.base import MergedBlocks
from tuner.kernels.scan import ScanBackend
from tuner.cache import Cache, current_versions, make_row
from tuner.semantics.problem import Problem
from tuner.semantics.reference import dense_attention

RING = 4
PROBLEM = Problem(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=8, causal=True, ring_size=RING,
                  layout="zigzag")


def arrays(problem: Problem, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((problem.batch, problem.seq_len, problem.heads, problem.head_dim), np.float32)
    k, v = (rng.standard_normal((problem.batch, problem.seq_len, problem.kv_heads, problem.head_dim),
                                np.float32) for _ in range(2))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def store(db, problem: Problem, fwd: FwdParams, bwd: BwdParams, backend: str = "scan") -> str:
    row = make_row(registry.problem_key(problem, backend, jax.devices()[0].device_kind), fwd, bwd,
                   versions=current_versions(BACKENDS[backend].code_hash(), triton=backend == "triton"),
                   tool_version="test",
                   objective="fwd+bwd", best_s=1.0, default_s=1.5, speedup=1.5, trials_run=2, trials_pruned=0,
                   trials_failed={}, study="test")
    Cache(db).put(row)
    return row["key"]


def explain(attn, problem: Problem, **options):
    q, k, v = arrays(problem)
    return attn.explain(q, k, v, **options)


def test_explain_default_then_exact_then_nearest(tmp_path):
    db = tmp_path / "tuning.sqlite"
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db),
                                    mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    decision = explain(attn, PROBLEM)
    assert (decision.backend, decision.source) == ("scan", "default")
    assert decision.fwd_params == BACKENDS["scan"].default_params(16, 16, 8)[0]

    key = store(db, PROBLEM, FwdParams(8, 4), BwdParams(4, 8, 8, 8))
    fresh = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db),
                                     mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    decision = explain(fresh, PROBLEM)
    assert decision.source == "exact" and key in decision.reason
    assert (decision.fwd_params, decision.bwd_params) == (FwdParams(8, 4), BwdParams(4, 8, 8, 8))
    assert decision.key.digest == key

    longer = Problem(**{**PROBLEM.__dict__, "seq_len": 128})
    decision = explain(fresh, longer)
    assert decision.source == "nearest" and decision.fwd_params == FwdParams(8, 4)


def test_tuned_call_with_mesh_equals_dense_forward_and_gradients(tmp_path, monkeypatch):
    db = tmp_path / "tuning.sqlite"
    store(db, PROBLEM, FwdParams(4, 8), BwdParams(8, 4, 4, 8))
    used = []

    def spy(*args, **kwargs):
        used.append((kwargs["backend"], kwargs["fwd_params"], kwargs["bwd_params"]))
        return run_ring(*args, **kwargs)

    monkeypatch.setattr(implementations, "run_ring", spy)
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db), mesh=mesh)
    q, k, v = arrays(PROBLEM)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))

    out = jax.jit(attn)(q, k, v)  # global arrays in token order: the loader lays them out itself
    grads = jax.jit(jax.grad(lambda *a: loss(attn, *a), argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True):
        q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
        want = jax.jit(lambda *a: dense_attention(*a, causal=True)[0])(q64, k64, v64)
        want_grads = jax.jit(jax.grad(lambda *a: loss(lambda *b: dense_attention(*b, causal=True)[0], *a),
                                      argnums=(0, 1, 2)))(q64, k64, v64)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    for got, expected in zip(grads, want_grads):
        got, expected = np.asarray(got, np.float64), np.asarray(expected)
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-4
    assert set(used) == {("scan", FwdParams(4, 8), BwdParams(8, 4, 4, 8))}


def test_a_call_on_a_mesh_outside_jit_compiles_once_and_again_after_a_cache_write(tmp_path, monkeypatch):
    """Outside any trace the loader on a mesh runs under its own `jax.jit`: the second call of the same
    shapes traces nothing (it used to lay out, `shard_map` and compile the ring at every call), and a
    cache write in the process makes it trace, and decide, again."""
    from tuner.runtime import sharded

    traced = []

    def counting(*args, **kwargs):
        traced.append(1)
        return sharded_run(*args, **kwargs)

    sharded_run = sharded.run
    monkeypatch.setattr(sharded, "run", counting)
    db = tmp_path / "tuning.sqlite"
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(db), mesh=mesh)
    q, k, v = arrays(PROBLEM)
    first = attn(q, k, v)
    second = attn(q, k, v)
    assert len(traced) == 1 and attn.explain(q, k, v).source == "default"
    np.testing.assert_array_equal(first, second)
    with jax.enable_x64(True):
        want = dense_attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True)[0]
    np.testing.assert_allclose(first, want, rtol=0, atol=2e-5)
    out, lse = attn(q, k, v, return_lse=True)  # a static option: its own program
    assert len(traced) == 2 and lse.shape == (PROBLEM.batch, PROBLEM.heads, PROBLEM.seq_len)

    store(db, PROBLEM, FwdParams(4, 8), BwdParams(8, 4, 4, 8))
    attn(q, k, v)
    assert len(traced) == 3 and attn.explain(q, k, v).source == "exact"


def test_inside_callers_shard_map_with_segments(tmp_path):
    """Without mesh=: called on local shards inside the caller's shard_map, per-call segment ids."""
    problem = Problem(**{**PROBLEM.__dict__, "segments": 3, "layout": "contiguous"})
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="contiguous",
                                    db=str(tmp_path / "none.sqlite"))
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    q, k, v = arrays(problem)
    seg = jnp.asarray(np.repeat(np.arange(3), [20, 30, 14])[None].astype(np.int32))
    seq = P(None, "sp")
    fn = jax.shard_map(lambda q, k, v, s: attn(q, k, v, q_segment_ids=s, kv_segment_ids=s), mesh=mesh,
                       in_specs=(seq, seq, seq, seq), out_specs=seq)
    out = jax.jit(fn)(q, k, v, seg)
    with jax.enable_x64(True):
        want = dense_attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True,
                               q_segment_ids=seg, kv_segment_ids=seg)[0]
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    decision = attn.explain(*(x[:, :16] for x in (q, k, v)), ring_size=RING,
                            q_segment_ids=seg[:, :16], kv_segment_ids=seg[:, :16])
    assert decision.key.features["segments"] is True and decision.source == "default"


def test_with_mesh_every_per_call_array_is_in_token_order(tmp_path):
    """mesh= takes segment ids, bias and the lse in token order, whatever the layout."""
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    q, k, v = arrays(PROBLEM, seed=3)
    rng = np.random.default_rng(4)
    seg = jnp.asarray(np.repeat(np.arange(3), [20, 30, 14])[None].astype(np.int32))
    bias = jnp.asarray(rng.standard_normal((1, 1, 64, 64), np.float32))
    with jax.enable_x64(True):
        want, want_lse = dense_attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True,
                                         q_segment_ids=seg, kv_segment_ids=seg, bias=bias.astype(jnp.float64))
    for layout in ("zigzag", "striped", "contiguous"):
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout=layout, mesh=mesh,
                                        db=str(tmp_path / "none.sqlite"))
        out, lse = jax.jit(lambda *a, attn=attn: attn(*a, q_segment_ids=seg, kv_segment_ids=seg, bias=bias,
                                                      return_lse=True))(q, k, v)
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-5, err_msg=layout)
        np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2e-5, err_msg=layout)


def test_local_shards_of_a_ring_need_the_layout(tmp_path):
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, db=str(tmp_path / "none.sqlite"))
    local = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="layout= is needed when attn is called on local shards"):
        attn.explain(local, kv, kv, ring_size=RING)
    assert attn.explain(local, kv, kv, ring_size=1).key.layout == "contiguous"  # one device: any layout
    assert get_tuned_ring_attention(axis_name="sp", mesh=Mesh(np.array(jax.devices()[:2]), ("sp",))).layout \
        == "zigzag"


def test_explain_names_a_tuned_entry_of_another_layout(tmp_path):
    db = tmp_path / "tuning.sqlite"
    key = store(db, PROBLEM, FwdParams(8, 4), BwdParams(4, 8, 8, 8))  # tuned for zigzag
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="striped", db=str(db),
                                    mesh=Mesh(np.array(jax.devices()[:RING]), ("sp",)))
    decision = explain(attn, PROBLEM)
    assert decision.source == "nearest"
    assert f"a tuned entry exists for this problem with layout zigzag (local entry {key})" in decision.reason


def test_auto_on_a_gpu_without_triton_falls_back_to_scan_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch_module, "compile_target", lambda mesh=None: ("gpu", "NVIDIA H100 80GB HBM3"))
    attn = get_tuned_ring_attention(causal=True, db=str(tmp_path / "t.sqlite"))
    decision = explain(attn, Problem(**{**PROBLEM.__dict__, "ring_size": 1}))
    assert (decision.backend, decision.source) == ("scan", "fallback")
    assert "triton" in decision.reason
    assert decision.key.device_kind == "NVIDIA H100 80GB HBM3"


@pytest.fixture
def unbuildable():
    class Unbuildable(MergedBlocks, ScanBackend):
        name = "unbuildable"

        def block_fwd(self, *args, **kwargs):
            raise RuntimeError("kernel does not compile")

    with registry.registered(implementations.Ring(Unbuildable())):
        yield


def test_a_backend_that_fails_to_build_falls_back_to_scan(unbuildable, caplog, tmp_path):
    attn = get_tuned_ring_attention(causal=True, backend="unbuildable", db=str(tmp_path / "t.sqlite"))
    q, k, v = arrays(PROBLEM)
    with caplog.at_level(logging.WARNING, logger="tuner.runtime.dispatch"):
        out = jax.jit(attn)(q, k, v)
    assert "backend unbuildable with params from default failed to build" in caplog.text
    assert "kernel does not compile" in caplog.text
    with jax.enable_x64(True):
        want = dense_attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True)[0]
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)


def test_the_hybrid_over_a_kernel_that_fails_to_build_falls_back_to_the_hybrid_over_scan(unbuildable, caplog,
                                                                                        tmp_path):
    """Over two mesh axes the fallback runs over both too: the hybrid over the scan kernel (the scan ring
    cannot run over a pair `axis_name`); and so does an exchange over one axis keep its strategy."""
    from tuner.strategies.all_to_all import AllToAll
    from tuner.strategies.hybrid import Hybrid

    kernel = registry.get("unbuildable").kernel
    assert registry.fallback_for(registry.get("unbuildable")).name == "scan"
    q, k, v = arrays(Problem(batch=1, seq_len=64, heads=8, kv_heads=2, head_dim=8, causal=True, ring_size=8))
    with jax.enable_x64(True):
        want = dense_attention(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True)[0]
    for implementation, axes, grid in ((Hybrid(kernel), ("ring", "a2a"), (2, 4)), (AllToAll(kernel), ("sp",), (8,))):
        with registry.registered(implementation):
            fallback = registry.fallback_for(implementation)
            assert fallback.name == registry.strategy_of(implementation)  # over the scan kernel
            mesh = Mesh(np.array(jax.devices()[:8]).reshape(grid), axes)
            attn = get_tuned_ring_attention(axis_name=axes if len(axes) == 2 else axes[0], causal=True,
                                            backend=implementation.name, mesh=mesh, db=str(tmp_path / "t.sqlite"))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="tuner.runtime.dispatch"):
                out = jax.jit(attn)(q, k, v)
            assert f"backend {implementation.name} with params from default failed to build" in caplog.text
            assert f"falling back to {fallback.name} with its default params" in caplog.text
            np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)


def test_a_corrupt_cache_means_defaults_and_a_warning(tmp_path, caplog):
    db = tmp_path / "tuning.sqlite"
    db.write_bytes(b"garbage" * 1000)
    attn = get_tuned_ring_attention(causal=True, db=str(db))
    q, k, v = arrays(PROBLEM)
    with caplog.at_level(logging.WARNING, logger="tuner.cache"):
        out = jax.jit(attn)(q, k, v)
    assert f"tuning cache {db}: unusable, using default params" in caplog.text
    assert bool(jnp.all(jnp.isfinite(out)))
    decision = attn.explain(q, k, v)
    assert decision.source == "default" and "cache unusable" in decision.reason


def test_bad_options_are_named():
    with pytest.raises(TypeError, match="unknown per-call option.*causal"):
        get_tuned_ring_attention().explain(*arrays(PROBLEM), causal=True)
    with pytest.raises(ValueError, match="layout"):
        get_tuned_ring_attention(layout="spiral")
    with pytest.raises(ValueError, match="backend"):
        get_tuned_ring_attention(backend="cuda")
    with pytest.raises(ValueError, match="axis_name"):
        get_tuned_ring_attention(mesh=Mesh(np.array(jax.devices()[:2]), ("sp",)))
    with pytest.raises(ValueError, match="chunk_size"):
        get_tuned_ring_attention(chunk_size=0)
    with pytest.raises(ValueError, match="db must be the path of a cache file"):  # failed in the first call
        get_tuned_ring_attention(db=3)
    with pytest.raises(ValueError, match="ring_size"):
        get_tuned_ring_attention(axis_name="sp").explain(*arrays(PROBLEM))
    for flag in ("return_lse", "interpret"):  # a truthy string or 1 would have been taken as True
        with pytest.raises(ValueError, match=f"{flag} must be True or False, got 'yes'"):
            get_tuned_ring_attention()(*arrays(PROBLEM), **{flag: "yes"})


def test_a_position_mask_gives_the_scan_default_its_masked_tile(monkeypatch):
    """Causal, window and chunk masks default the scan kernel to tiles of 128 (its `masked_tile`; the
    unmasked backward's query tiles of 64 too), in the loader's default and in ring_attention's; a full
    mask and the per-architecture kernels keep their defaults."""
    from tuner import ring_attention
    from tuner.semantics.spec import AttentionSpec, LocalShapes

    shapes = LocalShapes(batch=1, q_len=1024, kv_len=1024, heads=4, kv_heads=4, head_dim=64, dtype="float32")
    scan = registry.get("scan")
    plain = configs.TileConfig(*BACKENDS["scan"].default_params(1024, 1024, 64))
    assert max(plain.fwd.block_q, plain.fwd.block_kv) > BACKENDS["scan"].masked_tile == 128
    assert scan.default_config(shapes, AttentionSpec(scale=1.0)) == plain
    for mask in (dict(causal=True), dict(window=(100, 0)), dict(chunk_size=256)):
        config = scan.default_config(shapes, AttentionSpec(scale=1.0, **mask))
        assert config == configs.squared(plain, 128, 1024, 1024), mask
        assert {t for part in config.to_dict().values() for f, t in part.items() if f.startswith("block")} == {
            128, None}, mask
    for name in ("triton", "pallas_tpu"):
        kernel = registry.get(name)
        assert kernel.default_config(shapes, AttentionSpec(scale=1.0, causal=True)) == configs.TileConfig(
            *BACKENDS[name].default_params(1024, 1024, 64)), name

    used = []
    monkeypatch.setattr("tuner.runtime.attention.run_ring", lambda *a, fwd_params, bwd_params, **k: used.append(
        (fwd_params, bwd_params)) or a[0])
    x = jnp.zeros((1, 1024, 4, 64), jnp.float32)
    ring_attention(x, x, x, causal=True, backend="scan")
    ring_attention(x, x, x, backend="scan")
    assert used == [(config.fwd, config.bwd) for config in (configs.squared(plain, 128, 1024, 1024), plain)]


def test_the_scan_default_forward_takes_short_query_tiles_on_short_shards():
    """Up to `SHORT_SHARD` tokens a shard's default forward takes query tiles of 128 (5 to 19% faster there
    on every unmasked landscape, benchmarks/cpu_ring/README.md), beyond it the tall tiles of 512; the backward takes
    query tiles of 64 and key tiles of 512 at every length; every tile is cut to the shard."""
    from tuner.kernels.scan import SHORT_SHARD

    for local, block_q in ((100, 100), (512, 128), (SHORT_SHARD, 128), (2 * SHORT_SHARD, 512), (8192, 512)):
        fwd, bwd = BACKENDS["scan"].default_params(local, local, 64)
        assert (fwd.block_q, fwd.block_kv) == (block_q, min(256, local)), local
        assert (bwd.block_q_dkv, bwd.block_kv_dkv) == (min(64, local), min(512, local)), local
