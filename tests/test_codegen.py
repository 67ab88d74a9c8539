"""Generated code runs only if it is what the codegen renders: `codegen.load` executes the rendered
text (never a file planted or edited under the generated-kernel folder), `inspect` sees that text, and
Triton's interpreter process refuses a module file that is not the rendering, which the backend then
renders again."""

import importlib.util
import inspect
import linecache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tuner.kernels import codegen
from tuner import ring_attention
from tuner.kernels import pallas_tpu
from tuner.kernels import triton as triton_backend
from tuner.kernels import triton_compile, triton_launch
from tuner.semantics.spec import AttentionSpec

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (pip install -e '.[test]')")


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """A private generated-kernel folder (never the checkout's shared one: a planted module must not
    reach anyone else's process)."""
    folder = tmp_path / "kernels_generated"
    monkeypatch.setattr(codegen, "generated_dir", lambda: folder)
    return folder


def _planted(marker) -> str:
    """A module that leaves `marker` behind and fails if it ever runs."""
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "raise RuntimeError('planted module ran')\n")


def test_a_planted_module_is_never_executed(generated, tmp_path):
    variant = pallas_tpu.standard_variants()[0]
    marker = tmp_path / "marker"
    generated.mkdir()
    path = generated / variant.filename
    path.write_text(_planted(marker))

    module = codegen.load(variant)
    assert not marker.exists()
    assert callable(module.attention_fwd) and module.__file__ == str(path)
    assert path.read_text() == codegen.render_source(variant)


def test_a_module_edited_after_rendering_is_rendered_again(generated):
    variant = triton_backend.standard_variants()[0]
    path = codegen.render(variant)
    rendered = path.read_bytes()
    path.write_bytes(rendered.replace(b"def attention_fwd", b"def attention_fwd_edited"))
    assert codegen.render(variant) == path and path.read_bytes() == rendered

    path.write_bytes(rendered[:100])  # truncated
    codegen.render(variant)
    assert path.read_bytes() == rendered
    assert [p.name for p in generated.iterdir()] == [variant.filename]  # no temporary file left


@needs_triton
def test_inspect_sees_the_executed_text_not_the_file(generated):
    """`@triton.jit` reads its function's source with `inspect`: it gets the text that was executed,
    even after the file changes and `linecache.checkcache` runs."""
    variant = triton_backend.standard_variants()[1]
    module = codegen.load(variant)
    path = generated / variant.filename
    path.write_text(path.read_text().replace("def attention_fwd", "def attention_fwd_edited"))
    linecache.checkcache()
    source = inspect.getsource(module.attention_fwd.fn)
    assert source.lstrip().startswith("@triton.jit") and "def attention_fwd(" in source
    assert source in codegen.render_source(variant)
    assert "def attention_fwd(" in module.attention_fwd.src


@needs_triton
def test_the_interpreter_process_refuses_a_changed_module_and_the_backend_renders_it_again(
        generated, tmp_path, monkeypatch):
    """A module file replaced between tracing and running is refused by a fresh interpreter process;
    the backend renders it again and the kernel runs, the planted code never."""
    interpreter = triton_launch._Interpreter()
    replies = []

    def ask(request):
        replies.append(triton_launch._Interpreter._ask(interpreter, request))
        return replies[-1]

    monkeypatch.setattr(interpreter, "_ask", ask)
    monkeypatch.setattr(triton_launch, "_INTERPRETER", interpreter)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((1, 16, 2, 16)), jnp.float32) for i in range(3))
    compiled = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True, backend="triton", interpret=True)) \
        .lower(q, k, v).compile()
    variant = triton_launch.variant(AttentionSpec(scale=0.25, causal=True), jnp.float32, 16)
    path = generated / variant.filename
    assert [p.name for p in generated.iterdir()] == [path.name]  # rendered when traced
    marker = tmp_path / "marker"

    path.write_text(_planted(marker))
    render = codegen.render
    monkeypatch.setattr(codegen, "render", lambda variant, out_dir=None: path)
    with pytest.raises(Exception, match="refused attention_fwd.*not running it"):
        jax.block_until_ready(compiled(q, k, v))
    assert [set(r) for r in replies] == [{"mismatch"}, {"mismatch"}]

    monkeypatch.setattr(codegen, "render", render)
    replies.clear()
    out = compiled(q, k, v)
    assert [set(r) for r in replies] == [{"mismatch"}, {"outputs"}]
    assert not marker.exists()
    assert path.read_text() == codegen.render_source(variant)
    expected = ring_attention(q, k, v, causal=True, backend="scan")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# What `tuner generate --compile` reports: the kernels compiled as jax_triton compiles them, the MMA
# family and the architecture's tensor-core path, the occupancy (no GPU needed).
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, registers, shared, warps, tmem, blocks, limited_by", [
    # 255 regs: 8160 -> 8192 a warp, 2 warps in each of 4 sub-partitions = 8 warps = 2 blocks of 4;
    # 98564 + 1024 reserved -> 99712 (128-byte units), 228 KiB // 99712 = 2
    (90, 255, 98564, 4, 0, 2, "registers,shared"),
    # 64 regs: 2048 a warp, 8 a sub-partition = 32 warps = 8 blocks; 12864 + 1024 -> 13952, 164 KiB // it = 12
    (80, 64, 12864, 4, 0, 8, "registers"),
    # 32 regs: 16 warps a sub-partition = 64 warps, 16 blocks; 64 warps an SM also allow 16 blocks of 4
    (80, 32, 0, 4, 0, 16, "registers,warps"),
    # 168 regs: 5376 a warp, 3 a sub-partition = 12 warps: one block of 8
    (90, 168, 0, 8, 0, 1, "registers"),
    # sm_86: 48 warps an SM, 6 blocks of 8 (registers would allow 8)
    (86, 32, 0, 8, 0, 6, "warps"),
    # sm_100: 128 regs allow 4 blocks of 4, shared 51024 -> 51072 allows 4; 256 of 512 tensor-memory columns 2
    (100, 128, 50000, 4, 256, 2, "tmem"),
    (100, 128, 50000, 4, 200, 2, "tmem"),  # 200 columns are allocated as 256
    (100, 100, 1000, 4, 640, 0, "tmem"),  # over 512 columns: Triton compiles a trap, jax_triton refuses it
    (90, 64, 227 * 1024 + 1, 4, 0, 0, "shared"),  # over the 227 KiB a block may have
    (90, 64, 227 * 1024, 4, 0, 1, "shared"),  # at it: 228 KiB hold one block and its reserved KiB
    (80, 256, 0, 4, 0, 0, "registers"),  # over 255 a thread
    (80, 64, 0, 32, 0, 1, "registers"),  # 32 warps of 64 registers take the whole register file
])
def test_occupancy_counts_what_the_occupancy_calculator_counts(arch, registers, shared, warps, tmem, blocks,
                                                               limited_by):
    assert triton_compile.occupancy(arch, registers, shared, warps, tmem) == {
        "blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limited_by": limited_by}


def test_mma_family_and_the_architectures_tensor_core_path():
    """The instruction families as cuobjdump prints them (sm_100's tcgen05.mma is UTCHMMA for bf16, fp16 and
    tf32 operands, UTCQMMA for fp8)."""
    sass = {"HMMA": "HMMA.16816.F32.BF16 R4, R8, R12, R4 ;", "HGMMA": "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;",
            "UTCHMMA": "UTCHMMA gdesc[UR12], gdesc[UR14], tmem[UR20], tmem[UR10], idesc[UR11], !UPT ;",
            "none": "FFMA R1, R2, R3, R1 ;\nEXIT ;"}
    assert {family: triton_compile.mma_family(text) for family, text in sass.items()} == {f: f for f in sass}
    assert triton_compile.mma_family(sass["HMMA"] + "\n" + sass["HGMMA"]) == "HGMMA"
    assert triton_compile.mma_family("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;") == "QGMMA"  # fp8
    assert triton_compile.uses_tensor_cores("QGMMA", 90) and triton_compile.uses_tensor_cores("UTCQMMA", 100)
    path = {(mma, arch): triton_compile.uses_tensor_cores(mma, arch) for mma in sass for arch in (80, 90, 100)}
    assert [key for key, yes in path.items() if yes] == [("HMMA", 80), ("HGMMA", 90), ("UTCHMMA", 100)]


@needs_triton
def test_pointers_are_marked_aligned_as_jax_triton_marks_them():
    """jax_triton (`get_or_create_triton_kernel`) assumes every array 16-byte aligned: it specializes each
    with Triton's `native_specialize_impl` on a pointer whose address is 16 and hands `backend.parse_attr`
    of the result to `ASTSource(attrs=...)`. The installed Triton gives `ALIGNED_POINTER` for each of our
    pointer types."""
    import types

    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    for kind in ("bf16", "fp16", "fp32", "i32"):
        _, key = libtriton.native_specialize_impl(backend, types.SimpleNamespace(data_ptr=lambda: 16, dtype=kind),
                                                  False, True, True)
        assert backend.parse_attr(key) == triton_compile.ALIGNED_POINTER, kind


@needs_triton
def test_generate_compiles_for_sm_100_and_reports_the_tensor_core_path_and_occupancy(tmp_path, monkeypatch,
                                                                                     capsys):
    """`tuner generate --compile sm_100` (B200) for one variant (causal bf16, D=64): tcgen05 MMAs (UTCHMMA)
    in every kernel, the occupancy in the table and the JSON."""
    import json

    from tuner.cli import main

    variant = triton_launch.variant(AttentionSpec(scale=0.125, causal=True), jnp.bfloat16, 64)
    monkeypatch.setattr(triton_backend, "standard_variants", lambda: [variant])
    report = tmp_path / "report.json"
    assert main(["generate", "--backend", "triton", "--out", str(tmp_path / "kernels"), "--compile", "sm_100",
                 "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "tensor core" in printed and "blocks/SM" in printed
    rows = json.loads(report.read_text())
    assert [row["kernel"] for row in rows] == ["attention_fwd", "attention_dkv", "attention_dq"]
    for row in rows:
        assert row["target"] == "sm_100" and row["mma"] == "UTCHMMA" and row["tensor_core"], row
        assert 0 < row["shared"] <= triton_compile.SHARED_MEMORY_BYTES[100] and 0 < row["tmem"] <= 512, row
        assert row["blocks_per_sm"] >= 1 and row["warps_per_sm"] == row["blocks_per_sm"] * row["num_warps"], row
