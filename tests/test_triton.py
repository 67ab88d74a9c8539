"""The Triton backend without a GPU: the rendered kernels run in Triton's interpreter inside the whole
ring (every feature but bias, forward and every gradient, rings of 1, 2 and 4 simulated devices,
float32 at DESIGN tolerances and bf16/fp16 within twice dense's error), and as block kernels with a value
head dim other than the query/key one (multi-head latent attention); every standard variant, and a variant
of head dims 192 and 128, compiles for sm_80, sm_90 or sm_100 as jax_triton compiles it (16-byte aligned
pointers: vectorized loads) with its resources reported."""

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from tests.cases import check_case, check_low_precision, rel_err, triton_cases
from tuner import BwdParams, FwdParams, ring_attention
from tuner.kernels import codegen
from tuner.kernels import triton as triton_backend
from tuner.kernels import triton_compile, triton_launch
from tuner.semantics.problem import Problem
from tuner.semantics.reference import dense_attention
from tuner.tuning.search import SearchOptions, search
from tuner.semantics.spec import AttentionSpec

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (pip install -e '.[test]')")

FEW = max(4, settings.default.max_examples // 2)


@pytest.mark.slow
@given(triton_cases(ring_sizes=(1, 2, 4)))
@settings(max_examples=FEW)
def test_interpreted_kernels_in_the_ring_match_dense(case):
    check_case(case)


@pytest.mark.slow
@given(triton_cases(ring_sizes=(1, 2), dtype="bfloat16") | triton_cases(ring_sizes=(1, 2), dtype="float16"))
@settings(max_examples=max(2, FEW // 2))
def test_interpreted_low_precision_within_twice_dense_error(case):
    check_low_precision(case)


@pytest.mark.parametrize("head_dim, value_head_dim", [(192, 128), (128, 64)])
def test_value_head_dim_other_than_the_query_key_one(head_dim, value_head_dim):
    """Multi-head latent attention: values and the output of another head dim than queries and keys (192
    runs on 256 columns, the padded ones masked), grouped heads, causal, a partial last tile. `block_fwd`
    and `block_bwd` in the interpreter against the dense float64 reference at DESIGN tolerances."""
    b, t, h, hkv = 1, 24, 4, 2
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(shape) for shape in ((b, t, h, head_dim), (b, t, hkv, head_dim),
                                                             (b, t, hkv, value_head_dim), (b, t, h, value_head_dim)))
    with jax.enable_x64(True):
        (out, lse), vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, causal=True), q, k, v)
        dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
        delta = jnp.einsum("bthd,bthd->bht", out, do)
    want = {name: np.asarray(x) for name, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}

    backend, spec = triton_backend.TritonBackend(), AttentionSpec(scale=head_dim**-0.5, causal=True)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q, k, v, do, out, lse, delta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, do, out, lse, delta))
    got = dict(zip(("out", "lse"), backend.block_fwd(q, k, v, pos, pos, None, None, None, spec=spec,
                                                    params=FwdParams(16, 16), interpret=True)))
    got.update(zip(("dq", "dk", "dv"), backend.block_bwd(q, k, v, out, lse, do, delta, pos, pos, None, None, None,
                                                         spec=spec, params=BwdParams(16, 16, 16, 16), interpret=True)))
    for name, tol in (("out", 1e-5), ("lse", 1e-5), ("dq", 1e-4), ("dk", 1e-4), ("dv", 1e-4)):
        assert got[name].shape == want[name].shape, name
        error = rel_err(np.asarray(got[name]), want[name])
        assert error <= tol, f"{name} error {error:.2e}"


def test_queries_that_read_none_of_their_own_keys_start_the_ring_from_nothing():
    """The ring's first step makes the running state from its block alone (`MergedBlocks.starts_fresh`), so
    a query that reads no key there must come out of the kernel as 0 with lse -inf, as from a merge into
    nothing. Keys sit 4 positions after the queries (causal): on each device of a ring of 2 the first 4
    queries read none of their own keys, and on device 0 they read no key at all, as no later step runs
    there. In the interpreter against the dense float64 reference: those 4 rows exactly 0 and -inf, the
    rest and the gradients at DESIGN tolerances."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    n, none = 32, 4
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    q_pos = jnp.arange(2 * n, dtype=jnp.int32)[None]
    kv_pos = q_pos + none
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 2 * n, 2, 16)), jnp.float32) for _ in range(4))

    def local(q, k, v, q_pos, kv_pos):
        return ring_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, causal=True, axis_name="sp",
                              backend="triton", fwd_params=FwdParams(16, 16), bwd_params=BwdParams(16, 16, 16, 16),
                              interpret=True, return_lse=True)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 5,
                         out_specs=(P(None, "sp"), P(None, None, "sp")))
    (out, lse), vjp = jax.vjp(lambda q, k, v: ring(q, k, v, q_pos, kv_pos), q, k, v)
    got = dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv"), vjp((do, jnp.zeros_like(lse))))))
    with jax.enable_x64(True):
        f64 = [np.asarray(x, np.float64) for x in (q, k, v, do)]
        (out, lse), vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, causal=True, q_positions=q_pos,
                                                                  kv_positions=kv_pos), *f64[:3])
        want = dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv"), vjp((f64[3], jnp.zeros_like(lse))))))
    got, want = ({name: np.asarray(x) for name, x in d.items()} for d in (got, want))
    assert np.all(got["out"][:, :none] == 0) and np.all(got["lse"][..., :none] == -np.inf)
    assert np.all(want["lse"][..., :none] == -np.inf) and np.all(np.isfinite(want["lse"][..., none:]))
    got["lse"], want["lse"] = got["lse"][..., none:], want["lse"][..., none:]
    for name, tol in (("out", 1e-5), ("lse", 1e-5), ("dq", 1e-4), ("dk", 1e-4), ("dv", 1e-4)):
        error = rel_err(got[name], want[name])
        assert error <= tol, f"{name} error {error:.2e}"


# --------------------------------------------------------------------------------------------------
# Code generation.
# --------------------------------------------------------------------------------------------------


def test_rendering_reuses_files_and_a_template_edit_makes_a_new_one(tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    shutil.copytree(codegen.TEMPLATES, templates)
    monkeypatch.setattr(codegen, "TEMPLATES", templates)
    variant = triton_backend.standard_variants()[0]
    first = codegen.render(variant, tmp_path / "out")
    text = first.read_text()
    assert text.startswith("# Generated by ring-tuner from templates/triton/attention.py.j2")
    assert f"variant hash {variant.digest}" in text and '"dtype": "bfloat16"' in text
    assert f"template hash {codegen.template_hash('triton', 'attention.py.j2')}" in text
    stamp = first.stat().st_mtime_ns
    assert codegen.render(variant, tmp_path / "out") == first and first.stat().st_mtime_ns == stamp

    template = templates / "triton" / "attention.py.j2"
    template.write_text(template.read_text() + "\n# edited\n")
    second = codegen.render(variant, tmp_path / "out")
    assert second != first and second.is_file()


def test_features_are_compiled_in_or_out():
    causal = codegen.render_source(codegen.Variant("triton", "attention.py.j2", {
        **triton_backend.standard_variants()[0].features, "causal": True}))
    full = codegen.render_source(triton_backend.standard_variants()[0])
    assert "k_pos <= q_pos" in causal and "k_pos <= q_pos" not in full
    assert "q_seg == k_seg" not in full


# --------------------------------------------------------------------------------------------------
# Compiling for real GPU targets without a GPU.
# --------------------------------------------------------------------------------------------------

# In CI: every feature set (bf16, D=128) for sm_90, the causal set in fp16 D=128 for sm_80, the causal bf16
# variant of multi-head latent attention (D=192 padded to 256, Dv=128) for sm_90, and the causal bf16 set at
# D=64 and D=256 for sm_80, sm_90 and sm_100 (B200: tcgen05 MMAs) and at D=128 for sm_100: so each entry of
# `triton.DEFAULTS` (architecture, head-dim class) is compiled at least once (each of the three kernels takes
# ptxas a few seconds; float32 variants, exact `ieee` products on FMA units, about a minute). `tuner generate
# --compile sm_80,sm_90,sm_100` compiles the whole standard set, `benchmarks/gpu/head_dims.py --gpus
# 80,90,100` every pair of head dims at the defaults, `benchmarks/gpu/triton_resources.py` the search space;
# their reports are in benchmarks/gpu/results/.
MMA = {80: "HMMA", 90: "HGMMA", 100: "UTCHMMA"}


def _compiled_in_ci():
    plain_causal = {"causal": True, "window": False, "chunk": False, "segments": False, "softcap": False}
    latent = triton_launch.variant(AttentionSpec(scale=192**-0.5, causal=True), jnp.bfloat16, 192, 128)
    yield pytest.param(latent, 90, id=f"{latent.filename}-sm_90")
    for head_dim, capabilities in ((64, (80, 90, 100)), (128, (100,)), (256, (80, 90, 100))):
        causal = triton_launch.variant(AttentionSpec(scale=head_dim**-0.5, causal=True), jnp.bfloat16, head_dim)
        for capability in capabilities:  # the fast tier keeps the two it had: D=128 on sm_100, D=64 on sm_80
            yield pytest.param(causal, capability, id=f"{causal.filename}-sm_{capability}",
                               marks=[pytest.mark.slow] * ((head_dim, capability) not in ((128, 100), (64, 80))))
    sm_90 = 0
    for variant in triton_backend.standard_variants():
        features = variant.features
        if (features["dtype"], features["head_dim"]) == ("bfloat16", 128):  # the first in the fast tier
            yield pytest.param(variant, 90, id=f"{variant.filename}-sm_90", marks=[pytest.mark.slow] * (sm_90 > 0))
            sm_90 += 1
        if all(features[k] == v for k, v in plain_causal.items()) and (features["dtype"], features["head_dim"]) == (
                "float16", 128):
            yield pytest.param(variant, 80, id=f"{variant.filename}-sm_80")


@pytest.mark.parametrize("variant, capability", list(_compiled_in_ci()))
def test_standard_variants_compile_for_sm80_sm90_and_sm100(variant, capability):
    rows = triton_backend.standard_resources(variant, capability)
    for row in rows:
        print(f"{variant.filename} {row['kernel']} sm_{capability}: {row['shared']} B shared, "
              f"{row['registers']} registers, {row['spill_bytes']} B stack, {row['mma']}, "
              f"{row['blocks_per_sm']} blocks/SM ({row['limited_by']})")
        assert 0 < row["shared"] <= triton_compile.SHARED_MEMORY_BYTES[capability]
        assert row["registers"] is not None and row["registers"] <= 255
        # with a soft cap the sm_90 dK/dV default at D=128 spills 80 bytes (Triton 3.9: docs/gpu.md)
        assert row["spill_bytes"] == 0 or variant.features["softcap"], row
        assert row["mma"] == MMA[capability] and row["tensor_core"]
        assert row["tmem"] <= 512 and (row["tmem"] > 0) == (capability == 100)
        assert row["blocks_per_sm"] >= 1 and row["warps_per_sm"] == row["blocks_per_sm"] * row["num_warps"]


def test_pointers_aligned_as_jax_triton_aligns_them_give_vectorized_loads():
    """The forward (bf16, D=128, the default 128x64 tiles) compiled as jax_triton compiles it: its tiles
    come in 16-byte `cp.async` copies (LDGSTS.E.BYPASS.128) and 16-byte loads (LDG.E.128), none in 2-byte
    ones (LDG.E.U16: what the same kernel compiles to without the alignment, with less shared memory)."""
    variant = triton_backend.standard_variants()[1]
    assert variant.features["dtype"] == "bfloat16" and variant.features["head_dim"] == 128
    _, spec = codegen.standard_shapes(variant, 4096, 16, kv_heads=16)
    constants = triton_launch._constants(spec, 4096, 4096, 16, 16, 128, 128, 64)
    compiled = triton_compile._compiled(variant, "attention_fwd", tuple(sorted(constants.items())), 4, 3, 90)
    assert re.search(r"tt\.divisibility = 16", compiled.asm["ttir"])
    cubin = Path(tempfile.mkdtemp()) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([triton_compile._tool("cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    shutil.rmtree(cubin.parent)
    assert "LDGSTS.E.BYPASS.128" in sass and "LDG.E.128" in sass and "LDG.E.U16" not in sass


def test_it_compiles_after_jax_triton_emptied_the_cache_folder_variable(monkeypatch):
    """jax_triton sets TRITON_CACHE_DIR to "" when imported; `triton.compile` then raised "Could not create or
    locate cache dir" and a search on an H200 ruled out every launch. The compile gets a folder meanwhile."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    variant = triton_backend.standard_variants()[0]
    _, spec = codegen.standard_shapes(variant, 256, 2, kv_heads=2)
    constants = triton_launch._constants(spec, 256, 256, 2, 2, variant.features["head_dim"], 64, 64)
    compiled = triton_compile._compiled.__wrapped__(variant, "attention_fwd", tuple(sorted(constants.items())),
                                                    4, 2, 80)
    assert compiled.asm["cubin"] and os.environ["TRITON_CACHE_DIR"] == ""


# --------------------------------------------------------------------------------------------------
# The backend's contract.
# --------------------------------------------------------------------------------------------------


def test_what_the_backend_supports_and_rejects():
    backend = triton_backend.TritonBackend()
    spec = AttentionSpec(scale=0.125, causal=True)
    assert backend.supports(spec, jnp.bfloat16, 128) is None
    assert backend.supports(spec, jnp.bfloat16, 192, 128) is None and backend.supports(spec, jnp.float32, 48) is None
    assert "bias" in backend.supports(AttentionSpec(scale=0.1, has_bias=True), jnp.float32, 64)
    assert "dtype" in backend.supports(spec, jnp.float64, 64)
    with pytest.raises(ValueError, match="block_q_dq"):
        backend.check_params(FwdParams(64, 64), BwdParams(64, 64))
    with pytest.raises(ValueError, match="fwd_params.block_kv must be a power of two"):
        backend.check_params(FwdParams(64, 48), BwdParams(64, 64, 64, 64))
    assert backend.unavailable_reason(interpret=True) is None
    assert "no CUDA GPU" in backend.unavailable_reason()
    q = jnp.ones((1, 16, 2, 16))
    with pytest.raises(ValueError, match="backend 'triton' cannot run here: no CUDA GPU"):
        ring_attention(q, q, q, backend="triton")
    with pytest.raises(ValueError, match="does not support bias"):
        ring_attention(q, q, q, backend="triton", interpret=True, bias=jnp.zeros((1, 2, 16, 16)))


def test_shared_memory_constraint_compiles_and_compares(monkeypatch):
    """The constraint compiles the kernel for the target (sm_90 here) and compares its real shared
    memory with the target's limit: fine at the real limit, a pruning reason under a tiny one."""
    backend = triton_backend.TritonBackend()
    problem = Problem(seq_len=8192, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", ring_size=2)
    fwd, bwd = backend.default_params(4096, 4096, 128)
    assert backend.violation(problem.shapes, problem.spec, fwd, None) is None
    monkeypatch.setitem(triton_compile.SHARED_MEMORY_BYTES, 90, 16 * 1024)
    reason = backend.violation(problem.shapes, problem.spec, fwd, None)
    assert re.fullmatch(rf"attention_fwd {fwd.block_q}x{fwd.block_kv} \({fwd.num_warps} warps, {fwd.num_stages} "
                        rf"stages\) needs \d+ KiB of shared memory, over the 16 KiB of sm_90", reason), reason


def test_search_runs_the_triton_backend_in_the_interpreter(tmp_path):
    tiny = Problem(batch=1, seq_len=64, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2)
    options = SearchOptions(objective="fwd", trials=2, runs=1, final_runs=1, interpret=True, sampler="random")
    result = search(tiny, device="cpu", backend="triton", options=options, db=tmp_path / "t.sqlite")
    assert result.backend == "triton" and result.trials_run == 2
    assert result.failed == {} and result.best.config.fwd.num_warps is not None
