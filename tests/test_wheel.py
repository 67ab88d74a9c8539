"""The wheel is a working package on its own: built from the checkout, it holds every module, the
templates and the shipped configs, and installed into a fresh virtualenv it runs `tuner info`,
`tuner generate`, a small `tuner search` and the tuned loader from an unrelated folder, writing only
under `$TUNER_HOME` (never into site-packages, never into the checkout)."""

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build", reason="needs `build` (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], **kwargs) -> str:
    """Run a command; on failure, fail the test with its output."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited with {result.returncode}\n"
                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}", pytrace=False)
    return result.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """`python -m build --wheel` from the repository root. Its setuptools build folders go to a fresh
    temporary folder (DIST_EXTRA_CONFIG), so a stale `build/lib` never leaks into the wheel and
    concurrent builds in the shared checkout do not collide."""
    config = tmp_path / "setuptools.cfg"
    config.write_text(f"[build]\nbuild_base = {tmp_path / 'build'}\n[egg_info]\negg_base = {tmp_path}\n")
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(ROOT)], cwd=ROOT,
         env={**os.environ, "DIST_EXTRA_CONFIG": str(config)})
    (wheel,) = (tmp_path / "dist").glob("ring_tuner-*.whl")
    return wheel


def _expected_files() -> set[str]:
    """Every module of the `tuner` package and every data file the wheel must carry, as wheel paths."""
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tuner").rglob("*.py")}
    templates = [*(ROOT / "templates").rglob("*.j2"), ROOT / "templates" / "README.md"]
    configs = [*(ROOT / "cache_db").glob("*.jsonl"), ROOT / "cache_db" / "README.md"]
    targets = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tuner" / "models" / "targets").glob("*.txtpb")}
    return modules | targets | {f"tuner/_data/{p.relative_to(ROOT).as_posix()}" for p in templates + configs}


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    packaged = set(zipfile.ZipFile(wheel).namelist())
    assert _expected_files() <= packaged, sorted(_expected_files() - packaged)
    assert not [name for name in packaged if name.startswith(("kernels_generated/", "tests/", "templates/"))]

    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)])
    site_packages = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                         .strip())
    # The fresh venv sees this environment's packages (jax, triton, ...) instead of downloading them
    # again: a path line in a .pth file adds that folder to sys.path, but that folder's own .pth files
    # are not processed, so the editable install of the checkout (a .pth there) stays invisible and
    # `import tuner` finds only the installed wheel.
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site_packages / "test_environment.pth").write_text("\n".join(ours) + "\n")
    installed = _files(site_packages)

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH", "TUNER_DB")}
    env.update(TUNER_HOME=str(home), JAX_PLATFORMS="cpu")
    tuner = [str(environment / "bin" / "tuner")]

    where = _run([str(python), "-c", "import tuner; print(tuner.__file__)"], cwd=elsewhere, env=env).strip()
    assert Path(where) == site_packages / "tuner" / "__init__.py", where

    info = _run(tuner + ["info"], cwd=elsewhere, env=env)
    assert f"shipped: {site_packages / 'tuner' / '_data' / 'cache_db'}" in info, info

    generate = _run(tuner + ["generate"], cwd=elsewhere, env=env)
    rendered = list((home / "kernels_generated").glob("triton_attention_*.py"))
    assert rendered and f"into {home / 'kernels_generated'}" in generate, generate

    tiny = "--seq-len 256 --heads 2 --kv-heads 1 --head-dim 16 --ring-size 2 --trials 2 --runs 1 --objective fwd"
    search = _run(tuner + ["search", "--device", "cpu", *tiny.split()], cwd=elsewhere, env=env)
    assert f"in {home / 'tuning.sqlite'}" in search, search

    script = elsewhere / "use_tuned.py"
    script.write_text(textwrap.dedent("""
        import jax
        import numpy as np
        from jax.sharding import Mesh

        from tuner import get_tuned_ring_attention
        from tuner.semantics.reference import dense_attention

        mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)  # the loader's defaults
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 256, 2, 16), dtype=np.float32)
        k, v = (rng.standard_normal((1, 256, 1, 16), dtype=np.float32) for _ in range(2))
        out = np.asarray(jax.jit(attn)(q, k, v))
        want = np.asarray(dense_attention(q, k, v, causal=True)[0])
        error = np.linalg.norm(out - want) / np.linalg.norm(want)
        assert error < 1e-5, error
        source = attn.explain(q, k, v).source
        assert source == "exact", source
    """))
    _run([str(python), str(script)], cwd=elsewhere,
         env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})

    assert _files(site_packages) == installed, sorted(map(str, _files(site_packages) ^ installed))
