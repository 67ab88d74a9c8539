"""The Pallas TPU backend without a TPU: the rendered kernels run in Pallas's interpreter inside the
whole ring (every feature but bias, forward and every gradient, rings of 1, 2 and 4 simulated devices,
float32 at DESIGN tolerances and bf16 within twice dense's error); masked tiles are never read; every
standard variant lowers for the TPU platform; the constraints, the contract and `tuner search --device
tpu [--dry-run]`."""

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from tests.cases import Case, check_case, check_low_precision, pallas_tpu_cases
from tuner import BwdParams, FwdParams, ring_attention
from tuner.kernels import codegen
from tuner.semantics import masks
from tuner import registry
from tuner.kernels import pallas_tiling, pallas_tpu
from tuner.semantics.problem import Problem
from tuner.semantics.reference import dense_attention
from tuner.tuning.search import SearchOptions, search
from tuner.semantics.spec import AttentionSpec

FEW = max(4, settings.default.max_examples // 2)
BACKEND = pallas_tpu.PallasTpuBackend()


def jitted(kernel):
    """`kernel` (a backend's `block_fwd` or `block_bwd`) compiled whole, as in a ring: op by op, every
    small op of its wrapper would be a program. A new wrapper traces again (after a monkeypatch)."""
    return jax.jit(lambda *args, **kwargs: kernel(*args, **kwargs), static_argnames=("spec", "params", "interpret"))


block_fwd, block_bwd = jitted(BACKEND.block_fwd), jitted(BACKEND.block_bwd)


@pytest.mark.slow
@given(pallas_tpu_cases(ring_sizes=(1, 2, 4)))
@settings(max_examples=FEW)
def test_interpreted_kernels_in_the_ring_match_dense(case):
    check_case(case)


@pytest.mark.slow
@given(pallas_tpu_cases(ring_sizes=(1, 2), dtype="bfloat16"))
@settings(max_examples=max(2, FEW // 2))
def test_interpreted_bfloat16_within_twice_dense_error(case):
    check_low_precision(case)


def test_masked_tiles_are_never_read():
    """Causal, 256 queries at positions 0..255 against 512 keys at 0..511: the two key tiles of 128 at
    256..511 are wholly in the future. Filled with NaN, they would poison any product that read them;
    skipped, the outputs match dense attention over the first 256 keys and their gradients are 0."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 256, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 512, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 512, 1, 16)), jnp.float32)
    poisoned_k, poisoned_v = k.at[:, 256:].set(jnp.nan), v.at[:, 256:].set(jnp.nan)
    q_pos = jnp.arange(256, dtype=jnp.int32)[None]
    kv_pos = jnp.arange(512, dtype=jnp.int32)[None]
    spec = AttentionSpec(scale=0.25, causal=True)
    fwd = FwdParams(block_q=64, block_kv=128)
    bwd = BwdParams(block_q_dkv=64, block_kv_dkv=128, block_q_dq=64, block_kv_dq=128)

    out, lse = block_fwd(q, poisoned_k, poisoned_v, q_pos, kv_pos, None, None, None, spec=spec, params=fwd,
                         interpret=True)
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    want, want_lse, want_dq, want_dk, want_dv = dense_block(q, k[:, :256], v[:, :256], np.tri(256, dtype=bool), do)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)

    delta = jnp.einsum("bqhd,bqhd->bhq", do, out)
    dq, dk, dv, _ = block_bwd(q, poisoned_k, poisoned_v, out, lse, do, delta, q_pos, kv_pos, None, None,
                              None, spec=spec, params=bwd, interpret=True)
    np.testing.assert_allclose(dq, want_dq, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dk[:, :256], want_dk, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dv[:, :256], want_dv, rtol=1e-4, atol=1e-5)
    assert np.all(dk[:, 256:] == 0) and np.all(dv[:, 256:] == 0)


@pytest.mark.parametrize("local", [300, 160])
def test_tiles_that_do_not_divide_the_shard_run_past_its_end(local):
    """Nothing is padded to whole tiles: the running output and lse, the running dq, the travelling keys
    and the dk/dv accumulators keep the shard's length, and the last query and key tiles run past its end.
    The interpreter reads NaN there, so a garbage row that reached a sum would show: tiles of 64 queries
    and of 128 and 256 keys, on shards of 300 and 160 (where the dq kernel's key tile is the whole
    shard), match float64 on a ring of 2."""
    fwd = FwdParams(block_q=64, block_kv=256)
    bwd = BwdParams(block_q_dkv=64, block_kv_dkv=128, block_q_dq=64, block_kv_dq=256)
    q, k = jnp.zeros((1, local, 2, 8), jnp.float32), jnp.zeros((1, local, 1, 8), jnp.float32)
    v = k[..., :4]
    assert [x.shape for x in BACKEND.keys_start(k, v, params=bwd)] == [(1, 1, local, 8), (1, 1, local, 4)]
    assert [x.shape for x in BACKEND.fwd_start(q, k, v, params=fwd)] == [(1, 2, local, 4), (1, 2, 1, local)]
    assert BACKEND.dq_start(q, k, params=bwd).shape == (1, 2, local, 8)
    assert [x.shape for x in BACKEND.grads_start(k, v, params=bwd)] == [(1, 1, local, 8), (1, 1, local, 4)]
    check_case(Case(batch=1, length=2 * local, heads=2, kv_heads=1, head_dim=8, value_head_dim=4, ring=2,
                    layout="zigzag", causal=True, fwd=fwd, bwd=bwd, backend="pallas_tpu"))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_schedule_longer_than_smem_holds_runs_in_calls(monkeypatch, rows):
    """A kernel whose tile schedule SMEM cannot hold at once (many tiles, a large batch) runs in calls of
    `rows_per_call` schedule rows, each over its part of the grid. With 1 row a call every (batch row,
    held tile) is a call of its own; with 3, the 4 query tiles of a batch row go in calls of 3 and 1, and
    the 2 key tiles of the dk/dv kernel a batch row a call. Both match float64 on a ring of 2."""
    made = []

    def few(kernel, q_tiles, kv_tiles):
        made.append(kernel)
        return rows

    monkeypatch.setattr(pallas_tiling, "rows_per_call", few)
    check_case(Case(batch=2, length=400, heads=2, kv_heads=1, head_dim=8, ring=2, layout="zigzag", causal=True,
                    segments="packed", fwd=FwdParams(block_q=64, block_kv=128),
                    bwd=BwdParams(block_q_dkv=64, block_kv_dkv=128, block_q_dq=64, block_kv_dq=128),
                    backend="pallas_tpu"))
    assert {"fwd", "dkv", "dq"} <= set(made), made


def run_block(q, k, v, spec, do, kernels=(block_fwd, block_bwd)):
    """Forward and gradients of one block through the interpreted kernels, at 64x128 tiles in all three."""
    block_fwd, block_bwd = kernels
    q_pos = jnp.arange(q.shape[1], dtype=jnp.int32)[None]
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None]
    out, lse = block_fwd(q, k, v, q_pos, kv_pos, None, None, None, spec=spec,
                         params=FwdParams(block_q=64, block_kv=128), interpret=True)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, out)
    dq, dk, dv, _ = block_bwd(q, k, v, out, lse, do, delta, q_pos, kv_pos, None, None, None, spec=spec,
                              params=BwdParams(64, 128, 64, 128), interpret=True)
    return out, lse, dq, dk, dv


@jax.jit
def dense_block(q, k, v, allowed, do):
    """Dense attention under the boolean `allowed [Tq, Tk]`: out, lse and the gradients of `<out, do>`."""
    bias = jnp.where(allowed, 0.0, -jnp.inf)[None, None]
    (out, lse), pullback = jax.vjp(lambda q, k, v: dense_attention(q, k, v, bias=bias, softmax_scale=0.25), q, k, v)
    return (out, lse, *pullback((do, jnp.zeros_like(lse))))


def test_the_mask_free_interior(monkeypatch):
    """192 queries and keys at positions 0..191 in 64x128 tiles (the last key tile runs past the end):
    schedule rows list tiles that need no mask first, then tiles that need one -- for the causal diagonal,
    or, without a causal mask, only for the tile past the end -- and the kernels match dense attention,
    forward and both gradients. Then, at 256 tokens (whole tiles), every visited tile is claimed mask-free
    (`unmasked = count`): the kernels must now compute those tiles whole, future keys included, which
    shows that the first `unmasked` steps of a row take the path without a mask, in all three kernels."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 256, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 256, 1, 16)), jnp.float32) for _ in range(2))
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def mixed_rows(tokens, spec, by_key):
        s = masks.tile_schedule(tokens[None], tokens[None], None, None, spec, 64, 128, by_key=by_key)
        return np.sum((s.unmasked > 0) & (s.count > s.unmasked))

    causal, unmasked = AttentionSpec(scale=0.25, causal=True), AttentionSpec(scale=0.25)
    tokens = np.arange(192)
    assert mixed_rows(tokens, causal, by_key=False) and mixed_rows(tokens, causal, by_key=True)
    assert mixed_rows(tokens, unmasked, by_key=False)
    for spec, allowed in ((causal, tokens[None, :] <= tokens[:, None]), (unmasked, np.ones((192, 192), bool))):
        cut = [x[:, :192] for x in (q, k, v, do)]
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), run_block(*cut[:3], spec, cut[3]),
                                   dense_block(*cut[:3], allowed, cut[3])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name}, causal={spec.causal}")

    def all_unmasked(*args, **kwargs):
        order, count, _ = flat_schedule(*args, **kwargs)
        return order, count, count

    flat_schedule = pallas_tpu._flat_schedule
    monkeypatch.setattr(pallas_tpu, "_flat_schedule", all_unmasked)
    # Whole visited tiles: a query tile reads a key tile when the key tile's first key is not after the
    # query tile's last query.
    tokens = np.arange(256)
    allowed = tokens[None, :] // 128 * 128 <= tokens[:, None] // 64 * 64 + 63
    patched = (jitted(BACKEND.block_fwd), jitted(BACKEND.block_bwd))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), run_block(q, k, v, causal, do, patched),
                               dense_block(q, k, v, allowed, do)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name}, every tile unmasked")


@pytest.mark.parametrize("head_dim, value_head_dim", [(192, 128), (128, 64)])
def test_values_of_another_head_dim_than_queries_and_keys(head_dim, value_head_dim):
    """Multi-head latent attention's dims -- queries and keys `head_dim` wide, values, output and its
    gradient `value_head_dim` -- with 4 query heads on 2 kv heads, causal, 192 tokens in 64x128 tiles
    (the last key tile runs past the end): out, lse, dq, dk and dv match the float64 dense reference in
    value and shape. The backward is given the reference's lse and output, so it is checked on its own."""
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((1, 192, 4, head_dim)), rng.standard_normal((1, 192, 2, head_dim))
    v, do = rng.standard_normal((1, 192, 2, value_head_dim)), rng.standard_normal((1, 192, 4, value_head_dim))
    spec = AttentionSpec(scale=head_dim ** -0.5, causal=True)
    with jax.enable_x64(True):
        @jax.jit
        def reference(q, k, v, do):
            (out, lse), pullback = jax.vjp(lambda q, k, v: dense_attention(q, k, v, causal=True,
                                                                           softmax_scale=spec.scale), q, k, v)
            return out, lse, *pullback((do, jnp.zeros_like(lse)))

        want = [np.asarray(x) for x in reference(q, k, v, do)]
    q, k, v, do, out, lse = (jnp.asarray(x, jnp.float32) for x in (q, k, v, do, *want[:2]))
    positions = jnp.arange(192, dtype=jnp.int32)[None]
    got = block_fwd(q, k, v, positions, positions, None, None, None, spec=spec,
                    params=FwdParams(block_q=64, block_kv=128), interpret=True)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, out)
    got += block_bwd(q, k, v, out, lse, do, delta, positions, positions, None, None, None, spec=spec,
                     params=BwdParams(64, 128, 64, 128), interpret=True)[:3]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, (name, g.shape, g.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


# --------------------------------------------------------------------------------------------------
# Lowering for TPU without a TPU.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", pallas_tpu.standard_variants(), ids=lambda v: v.filename)
def test_every_standard_variant_lowers_for_tpu(variant):
    """The forward and both backward kernels of each standard variant, at the default tiles of a
    4096-token shard, go through Pallas's Mosaic lowering for the TPU platform."""
    shapes, spec = codegen.standard_shapes(variant)
    fwd, bwd = BACKEND.default_params(shapes.q_len, shapes.kv_len, shapes.head_dim)
    assert pallas_tpu.variant(spec, shapes.dtype, shapes.head_dim) == variant
    assert pallas_tpu.lower(shapes, spec, fwd, bwd) == 3


def test_the_lowering_rejects_what_a_tpu_cannot_tile():
    """The check is real: a 12-row query block of a 24-row array (neither a multiple of 8 nor whole)
    fails the Mosaic lowering."""
    module = codegen.load(pallas_tpu.standard_variants()[0])
    s = jax.ShapeDtypeStruct

    def forward(schedule, count, unmasked, q, k, q_ids, kv_ids, out, lse):
        return module.attention_fwd(schedule, count, unmasked, q, k, k, q_ids, kv_ids, out, lse, kv_len=128, block_q=12,
                                    block_kv=128, block_kv_compute=128, scale=0.1, softcap=1.0, window_left=0,
                                    window_right=0, calls=((0, 1, 0, 2),), vmem_limit_bytes=2**24)

    args = (s((2,), jnp.int32), s((2,), jnp.int32), s((2,), jnp.int32), s((1, 1, 24, 64), jnp.bfloat16),
            s((1, 1, 128, 64), jnp.bfloat16), s((1, 24, 1), jnp.int32), s((1, 1, 128), jnp.int32),
            s((1, 1, 24, 64), jnp.float32), s((1, 1, 1, 24), jnp.float32))
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        jax.export.export(jax.jit(forward), platforms=["tpu"])(*args)


# --------------------------------------------------------------------------------------------------
# The backend's contract and constraints.
# --------------------------------------------------------------------------------------------------


def test_what_the_backend_supports_and_rejects():
    spec = AttentionSpec(scale=0.125, causal=True)
    assert BACKEND.supports(spec, jnp.bfloat16, 128) is None
    assert BACKEND.supports(spec, jnp.bfloat16, 192, 128) is None
    assert BACKEND.supports(spec, jnp.float32, 128, 64) is None
    # the value head dim is part of the rendered module (None: the query/key head dim)
    mla = pallas_tpu.variant(spec, jnp.bfloat16, 192, 128)
    assert mla.filename != pallas_tpu.variant(spec, jnp.bfloat16, 192).filename
    assert pallas_tpu.variant(spec, jnp.bfloat16, 128, 128) == pallas_tpu.variant(spec, jnp.bfloat16, 128)
    assert "bias" in BACKEND.supports(AttentionSpec(scale=0.1, has_bias=True), jnp.float32, 64)
    assert "dtype float16" in BACKEND.supports(spec, jnp.float16, 64)
    with pytest.raises(ValueError, match="block_q_dq and block_kv_dq must be set"):
        BACKEND.check_params(FwdParams(128, 128), BwdParams(128, 128))
    with pytest.raises(ValueError, match="fwd_params.num_warps is a GPU launch setting"):
        BACKEND.check_params(FwdParams(128, 128, num_warps=4), BwdParams(128, 128, 128, 128))
    assert BACKEND.unavailable_reason(interpret=True) is None
    assert "no TPU visible" in BACKEND.unavailable_reason()

    q = jnp.ones((1, 256, 2, 16))
    with pytest.raises(ValueError, match="backend 'pallas_tpu' cannot run here: no TPU"):
        ring_attention(q, q, q, backend="pallas_tpu")
    with pytest.raises(ValueError, match="does not support bias"):
        ring_attention(q, q, q, backend="pallas_tpu", interpret=True, bias=jnp.zeros((1, 2, 256, 256)))
    with pytest.raises(ValueError, match=r"fwd_params.block_kv=100 must be a multiple of 128 \(TPU tiling\)"):
        ring_attention(q, q, q, backend="pallas_tpu", interpret=True, fwd_params=FwdParams(128, 100),
                       bwd_params=BwdParams(128, 128, 128, 128))
    longer = jnp.ones((1, 512, 2, 16))
    with pytest.raises(ValueError, match="fwd_params.block_kv_compute=96 must divide the key tile 256"):
        ring_attention(longer, longer, longer, backend="pallas_tpu", interpret=True,
                       fwd_params=FwdParams(128, 256, block_kv_compute=96), bwd_params=BwdParams(128, 128, 128, 128))
    with pytest.raises(ValueError, match="fwd_params.block_kv_compute is a TPU kernel setting"):
        ring_attention(q, q, q, backend="scan", fwd_params=FwdParams(128, 128, block_kv_compute=128))


def test_auto_on_a_tpu_platform_says_why_it_passed_pallas_over():
    spec = AttentionSpec(scale=0.125, causal=True)
    chosen, passed_over = registry.resolve_auto(spec, jnp.bfloat16, 128, registry.Target("tpu"))
    if importlib.util.find_spec("libtpu") is None:  # nothing on this host can build a TPU program
        assert chosen.name == "scan" and passed_over == ["pallas_tpu cannot run here: no TPU visible to jax "
                                                         "(interpret=True runs the kernels on the CPU)"]
    else:  # libtpu compiles for a TPU target on any host (tests/test_tpu_compile.py)
        assert chosen.name == "pallas_tpu" and passed_over == []
    chosen, passed_over = registry.resolve_auto(spec, jnp.float16, 128, registry.Target("tpu", interpret=True))
    assert chosen.name == "scan" and "does not support dtype float16" in passed_over[0]
    tpu_interpreter = registry.Target("tpu", interpret=True)
    assert registry.resolve_auto(spec, jnp.bfloat16, 128, tpu_interpreter)[0].name == "pallas_tpu"


def test_interpreting_under_a_varying_axes_check_is_a_clear_error():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sp",))
    q = np.ones((1, 512, 2, 16), np.float32)

    def local(q):
        return ring_attention(q, q, q, axis_name="sp", backend="pallas_tpu", interpret=True)

    seq = jax.sharding.PartitionSpec(None, "sp")
    with pytest.raises(ValueError, match="pass check_vma=False to jax.shard_map"):
        jax.shard_map(local, mesh=mesh, in_specs=seq, out_specs=seq)(q)


def test_vmem_and_smem_constraints(monkeypatch):
    problem = Problem(seq_len=32768, heads=16, kv_heads=4, head_dim=128, dtype="bfloat16", ring_size=2)
    fwd = FwdParams(block_q=1024, block_kv=2048, block_kv_compute=512)
    bwd = BwdParams(block_q_dkv=1024, block_kv_dkv=1024, block_q_dq=1024, block_kv_dq=1024)
    assert BACKEND.violation(problem.shapes, problem.spec, fwd, bwd) is None  # v5e: 64 MiB asked for
    monkeypatch.setenv("TUNER_TPU_CHIP", "v4")
    reason = BACKEND.violation(problem.shapes, problem.spec, None, bwd)
    assert re.fullmatch(r"dkv kernel needs about \d+\.\d MiB of VMEM with 1024x1024 tiles, over the 8 MiB "
                        r"scoped limit on TPU v4", reason), reason
    assert BACKEND.violation(problem.shapes, problem.spec, FwdParams(block_q=256, block_kv=512), None) is None
    # values wider than the keys take more VMEM: the estimate and the default tiles see the value head dim
    wide_values = dataclasses.replace(problem.shapes, value_head_dim=512)
    half = BwdParams(block_q_dkv=256, block_kv_dkv=512, block_q_dq=256, block_kv_dq=512)
    assert BACKEND.violation(problem.shapes, problem.spec, None, half) is None
    assert "dkv kernel needs about" in BACKEND.violation(wide_values, problem.spec, None, half)
    assert BACKEND.default_params(16384, 16384, 128)[1] == half
    assert BACKEND.default_params(16384, 16384, 128, 512)[1].block_kv_dkv < 512
    monkeypatch.setenv("TUNER_TPU_CHIP", "v3")  # 16 KiB of SMEM: a 128x128-tile schedule of 16k tokens is 64 KiB,
    small = FwdParams(block_q=128, block_kv=128, block_kv_compute=128)  # so it runs in calls of 15 rows (520 B each)
    assert BACKEND.violation(problem.shapes, problem.spec, small, None) is None
    assert pallas_tiling.rows_per_call("fwd", 128, 128) == 8192 // 520
    calls = tuple((0, 1, i, min(15, 128 - i)) for i in range(0, 128, 15))
    assert pallas_tiling.kernel_calls("fwd", 1, 128, 128) == calls
    assert pallas_tiling.kernel_calls("dkv", 2, 128, 2) == ((0, 2, 0, 2),)  # rows of 520 B: both batch rows in one call
    longer = dataclasses.replace(problem.shapes, q_len=2**17, kv_len=2**17)  # rows of 4 KiB: one row a call, 1024 calls
    reason = BACKEND.violation(longer, problem.spec, small, None)
    assert "needs 1024 calls a step" in reason and "take longer tiles" in reason, reason
    longest = dataclasses.replace(problem.shapes, q_len=2**19, kv_len=2**19)  # one row of 4096 key tiles: 16 KiB
    reason = BACKEND.violation(longest, problem.spec, small, None)
    assert "tile schedule needs 16 KiB of SMEM for one row of 128x128 tiles" in reason, reason
    # int32 schedule [B, held, streamed], count and unmasked [B, held]; dk/dv holds key tiles
    row = pallas_tiling.schedule_row_bytes
    assert row("fwd", 3, 5) == row("dq", 3, 5) == 4 * 7 and row("dkv", 3, 5) == 4 * 5
    # the lse and delta rows hold a query tile on lanes: shorter than the shard, a multiple of 128 on a TPU
    reason = BACKEND.violation(problem.shapes, problem.spec, None, BwdParams(128, 128, 136, 128))
    assert reason.startswith("bwd_params.block_q_dq=136 must be a multiple of 128 on a TPU"), reason
    assert "block_q=64 must be a multiple of 128" in BACKEND.violation(problem.shapes, problem.spec,
                                                                       FwdParams(block_q=64, block_kv=128), None)
    q = jnp.zeros((1, 192, 2, 16), jnp.float32)
    k = jnp.zeros((1, 192, 1, 16), jnp.float32)
    pos = jnp.arange(192, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="fwd_params.block_q=64 must be a multiple of 128 on a TPU"):
        block_fwd(q, k, k, pos, pos, None, None, None, spec=AttentionSpec(scale=0.25),
                  params=FwdParams(block_q=64, block_kv=128))
    monkeypatch.setenv("TUNER_TPU_CHIP", "v99")
    with pytest.raises(ValueError, match="TUNER_TPU_CHIP must be one of"):
        BACKEND.violation(problem.shapes, problem.spec, fwd, None)


def test_search_space_and_duplicate_points():
    problem = Problem(seq_len=2048, ring_size=4)  # 512-token shards
    space = BACKEND.search_space(problem.shapes, problem.spec)
    assert space.fwd["block_q"] == (128, 256, 512) and space.fwd["block_kv"] == (128, 256, 512)
    assert space.dq_passes == ("separate",)
    shapes, spec = problem.shapes, problem.spec
    assert "a duplicate" not in (BACKEND.violation(shapes, spec, FwdParams(512, 256, block_kv_compute=256), None) or "")
    assert "block_kv_compute=512 is longer than the key tile" in BACKEND.violation(
        problem.shapes, problem.spec, FwdParams(512, 256, block_kv_compute=512), None)


def test_search_runs_the_pallas_backend_in_the_interpreter(tmp_path):
    tiny = Problem(batch=1, seq_len=512, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2)
    options = SearchOptions(objective="fwd+bwd", trials=2, runs=1, final_runs=1, interpret=True, sampler="random")
    result = search(tiny, device="cpu", backend="pallas_tpu", options=options, db=tmp_path / "t.sqlite")
    assert result.backend == "pallas_tpu" and result.trials_run == 2 and result.failed == {}
    assert result.best.config.fwd.block_kv_compute is not None and not result.best.config.bwd.fused_dq


# --------------------------------------------------------------------------------------------------
# tuner search --device tpu.
# --------------------------------------------------------------------------------------------------


def test_search_on_tpu_without_one_exits_at_once_saying_what_to_do(tmp_path, cli):
    proc = cli("search", "--device", "tpu", home=tmp_path)
    assert proc.returncode == 2
    assert re.search(r"no tpu device here \(this machine has: cpu\).*--dry-run", proc.stderr), proc.stderr
    proc = cli("search", "--device", "cpu", "--dry-run", home=tmp_path)
    assert proc.returncode == 2 and "use it with --device tpu" in proc.stderr


@pytest.mark.slow
def test_dry_run_lowers_the_space_and_checks_samples(tmp_path, cli):
    proc = cli("search", "--device", "tpu", "--dry-run", "--seq-len", "512", "--heads", "2", "--kv-heads", "1",
               "--head-dim", "16", "--ring-size", "2", "--samples", "2", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = re.search(r"checked (\d+) variants: (\d+) lower for TPU \((\d+) Mosaic kernels\), (\d+) ruled out "
                        r"by the constraints, 0 failed to lower; 2 of 2 samples match", proc.stdout)
    assert summary, proc.stdout
    checked, lowered, kernels, ruled_out = map(int, summary.groups())
    # 256-token shards: tiles (128, 256) -> forward 2 x 2 x 2, backward 2 x 2 x 2 x 2 points; compute
    # tiles longer than the key tile are duplicates.
    assert (checked, ruled_out, lowered) == (8 + 16, 2, 22)
    assert kernels == 6 + 2 * 16


@pytest.mark.slow
def test_dry_run_of_all_to_all_checks_the_kernels_space_on_the_whole_sequence(tmp_path, cli):
    """`--backend all_to_all_pallas_tpu`: the variants are the kernel's on what it runs inside all_to_all
    (the whole 256-token sequence of one head, not a device's 128 tokens), and the default runs in the
    interpreter through the exchange, against the scan reference."""
    proc = cli("search", "--device", "tpu", "--dry-run", "--backend", "all_to_all_pallas_tpu", "--seq-len", "256",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--ring-size", "2", "--samples", "1",
               home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "search space in all_to_all_pallas_tpu for" in proc.stderr
    checked = int(re.search(r"checked (\d+) variants: .* 1 of 1 samples match", proc.stdout).group(1))
    problem = Problem(seq_len=256, heads=2, kv_heads=1, head_dim=16, ring_size=2)
    implementation = registry.get("all_to_all_pallas_tpu")
    shapes = registry.tile_shapes(implementation, problem.shapes, problem.ring_size)
    assert (shapes.q_len, shapes.heads) == (256, 1)

    def points(space):
        return len(list(space.fwd_points())) + len(list(space.bwd_points()))

    backend = pallas_tpu.PallasTpuBackend()
    assert checked == points(backend.search_space(shapes, problem.spec))
    assert checked != points(backend.search_space(problem.shapes, problem.spec))
