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
    interpreter = triton_backend._Interpreter()
    replies = []

    def ask(request):
        replies.append(triton_backend._Interpreter._ask(interpreter, request))
        return replies[-1]

    monkeypatch.setattr(interpreter, "_ask", ask)
    monkeypatch.setattr(triton_backend, "_INTERPRETER", interpreter)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((1, 16, 2, 16)), jnp.float32) for i in range(3))
    compiled = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True, backend="triton", interpret=True)) \
        .lower(q, k, v).compile()
    variant = triton_backend.variant(AttentionSpec(scale=0.25, causal=True), jnp.float32, 16)
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
