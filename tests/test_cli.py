"""End to end through the `tuner` command: search -> cache row -> the runtime loader picks it (exact)
-> output equals the dense reference; list / show / export / import / clear / report / bench; resume
after Ctrl-C; two workers on one study; a corrupt cache file; `tuner demo` and `tuner info`; bad input
is one line and exit status 2. A verb runs in this process (`main`, as the `tuner` script calls it) unless
the test is about the process: Ctrl-C, workers side by side, the console script, a user's environment."""

import html
import importlib.util
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tuner import get_tuned_ring_attention
from tuner.cli import main
from tuner.semantics.reference import dense_attention
from tuner.support import libtpu

PROBLEM = ["--seq-len", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--ring-size", "2"]


def tuner(*args: str, home, as_a_user: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """`tuner ARGS` in a subprocess; `as_a_user`: without the suite's JAX_PLATFORMS and the libtpu settings
    this process may hold, as a shell runs it."""
    env = {**os.environ, "TUNER_HOME": str(home)}
    env.pop("XLA_FLAGS", None)
    if as_a_user:
        for name in ("JAX_PLATFORMS", *libtpu.HOST):
            env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, **kwargs)


def stored_key(stdout: str) -> str:
    match = re.search(r"(?:stored|kept)\s+key ([0-9a-f]{16})", stdout)
    assert match, stdout
    return match.group(1)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    result = tuner("search", "--device", "cpu", *PROBLEM, "--trials", "3", "--runs", "1", home=home, as_a_user=True)
    assert result.returncode == 0, result.stderr
    return home, result


def test_search_prints_the_summary_table(searched):
    _, result = searched
    out = result.stdout
    for word in ("default", "best", "speedup", "trials", "failed: none", "stored", "study"):
        assert word in out, out
    assert "3 in the study (3 run now)" in out
    assert "search" in result.stderr  # the progress bar
    assert re.search(r"best trial \d+\.\d\dx speedup", result.stderr), "the bar names its best as a trial's"
    # --device cpu starts no other backend: a TPU runtime installed beside jax (the test extra's libtpu) warns
    assert "TPU" not in result.stderr, result.stderr


def test_the_call_search_prints_hits_the_searched_entry_and_matches_dense(searched, monkeypatch):
    """`tuner search` with its defaults, then the loader call it prints (the loader's defaults and the
    default cache path): the exact entry, and dense attention's result."""
    home, result = searched
    key = stored_key(result.stdout)
    lines = [line.removeprefix("use").strip() for line in result.stdout.splitlines() if line.startswith("use ")]
    assert lines[1] == 'attn = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", mesh=mesh)'
    monkeypatch.setenv("TUNER_HOME", str(home))
    monkeypatch.delenv("TUNER_DB", raising=False)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 128, 4, 16), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 16), np.float32)) for _ in range(2))
    scope = {"jax": jax, "np": np, "Mesh": Mesh, "get_tuned_ring_attention": get_tuned_ring_attention,
             "q": q, "k": k, "v": v}
    exec("\n".join(lines[:2]), scope)
    attn = scope["attn"]
    decision = attn.explain(q, k, v)
    assert (decision.source, decision.key.digest) == ("exact", key)
    out = jax.jit(attn)(q, k, v)
    with jax.enable_x64(True):  # one program, not op by op
        want = np.asarray(jax.jit(lambda *a: dense_attention(*(x.astype(jnp.float64) for x in a), causal=True)[0])(
            q, k, v))
    assert np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want) < 1e-5


def test_list_show_export_clear_import(searched, tmp_path, cli):
    home, result = searched
    key = stored_key(result.stdout)
    listed = cli("list", home=home)
    assert listed.returncode == 0 and key in listed.stdout and " ok" in listed.stdout
    shown = cli("show", key[:6], home=home)
    assert shown.returncode == 0 and "fwd_params" in shown.stdout and "status" in shown.stdout

    other = tmp_path / "other"
    export = tmp_path / "entries.jsonl"
    assert cli("export", str(export), home=home).returncode == 0
    imported = cli("import", str(export), home=other)
    assert imported.returncode == 0 and "imported 1 entry" in imported.stdout
    assert key in cli("list", home=other).stdout
    cleared = cli("clear", home=other)
    assert "deleted 1 entry" in cleared.stdout
    assert "no tuned entries" in cli("list", home=other).stdout

    good = export.read_text()
    export.write_text("{broken\n" + good)
    bad = cli("import", str(export), home=other)
    assert bad.returncode == 2 and "entries.jsonl:1: rejected: not JSON" in bad.stderr
    assert "nothing was imported" in bad.stderr and "Traceback" not in bad.stderr
    assert "no tuned entries" in cli("list", home=other).stdout
    skipping = cli("import", str(export), "--skip-invalid", home=other)
    assert skipping.returncode == 0 and "imported 1 entry" in skipping.stdout and "skipped 1 invalid" in skipping.stdout


def test_report_writes_html(searched, tmp_path, cli, monkeypatch):
    home, result = searched
    key = stored_key(result.stdout)
    assert f"`tuner report {key[:8]}` writes a page on its study" in result.stdout
    monkeypatch.chdir(tmp_path)
    named = cli("report", key[:8], home=home)  # no --out: a file named after the entry, here
    assert named.returncode == 0 and named.stdout.strip().endswith(f"to report-{key[:8]}.html"), named.stderr
    assert (tmp_path / f"report-{key[:8]}.html").stat().st_size > 0
    page = tmp_path / "reports" / "today" / "report.html"  # its folder is created
    done = cli("report", stored_key(result.stdout)[:8], "--out", str(page), home=home)
    assert done.returncode == 0, done.stderr
    text = html.unescape(page.read_text())
    speedup = re.search(r"^best\s+\S+\s+\S+\s+\S+\s+(\d+\.\d\dx)", result.stdout, re.M).group(1)
    winner = re.search(r"<tr class=best><td>best</td>(.*?)</tr>", text).group(1)
    assert f"<td class=n>{speedup}</td>" in winner  # the winner the search printed, as it re-timed it
    trials = re.findall(r"<tr[^>]*><td class=n>(\d+)</td><td>(default|sampler|warm|grid)</td>", text)
    assert [int(n) for n, _ in trials] == [0, 1, 2] and trials[0][1] == "default"  # its 3 trials
    for title in ("Winner", "Trials", "Time over the default, trial by trial", "Tiles tried"):
        assert f"<h2>{title}</h2>" in text


def test_bench_times_tuned_default_scan_and_dense(searched, cli):
    home, _ = searched
    result = cli("bench", "--device", "cpu", *PROBLEM, "--runs", "2", "--calls", "2", home=home)
    assert result.returncode == 0, result.stderr
    assert "tuned (exact)" in result.stdout and "dense xla" in result.stdout
    assert re.search(r"dense xla .* 1\.00x", result.stdout)


# the search's process is started after this process's jax started its threads: subprocess forks only to exec
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_interrupted_search_resumes(tmp_path, cli):
    args = ["search", "--device", "cpu", *PROBLEM, "--trials", "4", "--runs", "1", "--objective", "fwd"]
    env = {**os.environ, "TUNER_HOME": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    # A shell's background job ignores SIGINT, and children inherit that: give the search the default.
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    studies = tmp_path / "tuning.studies.sqlite"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        try:
            with sqlite3.connect(studies, timeout=5) as conn:
                if conn.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0] >= 1:
                    break
        except sqlite3.OperationalError:  # not created yet
            continue
    assert proc.poll() is None, "the search ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err

    again = cli(*args, home=tmp_path)
    assert again.returncode == 0, again.stderr
    done = re.search(r"(\d+) in the study \((\d+) run now\)", again.stdout)
    assert done and int(done.group(1)) == 4 and 1 <= int(done.group(2)) <= 3, again.stdout


def test_two_workers_share_one_study(tmp_path, cli):
    """Two workers on one study run `--trials` between them (a trial started once the study had its
    total is surplus, a sampled config another trial holds is a duplicate: neither counts nor is a
    failure), no config is timed twice, and both print and store the one winner of the study."""
    args = ["search", "--device", "cpu", *PROBLEM, "--trials", "4", "--runs", "1", "--objective", "fwd",
            "--storage", f"sqlite:///{tmp_path / 'shared.sqlite'}"]
    env = {**os.environ, "TUNER_HOME": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    workers = [subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=600) for w in workers]
    for worker, (out, err) in zip(workers, outputs):
        assert worker.returncode == 0, err
        assert "failed: none" in out and "surplus" not in out, out
    runs = [int(re.search(r"\((\d+) run now\)", out).group(1)) for out, _ in outputs]
    totals = [int(re.search(r"(\d+) in the study", out).group(1)) for out, _ in outputs]
    assert sum(runs) == 4 and max(totals) == 4, outputs
    with sqlite3.connect(tmp_path / "shared.sqlite") as conn:
        trials = conn.execute("SELECT t.state, a.value_json, t.trial_id FROM trials t LEFT JOIN "
                              "trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = 'failure'").fetchall()
        params = conn.execute("SELECT trial_id, param_name, param_value FROM trial_params").fetchall()
    assert {state for state, _, _ in trials} <= {"COMPLETE", "PRUNED", "FAIL"}  # none running or waiting
    assert sum(state != "FAIL" for state, _, _ in trials) == 4
    assert {failure for state, failure, _ in trials if state == "FAIL"} <= {'"surplus"', '"duplicate"'}
    timed = [tuple(sorted((n, v) for i, n, v in params if i == trial_id)) for state, _, trial_id in trials
             if state != "FAIL"]
    assert len(set(timed)) == 4, timed

    best = [re.search(r"^best\s.*$", out, re.M).group(0) for out, _ in outputs]
    assert best[0] == best[1], best  # the same winner, with the same measurement, printed by both
    measured = float(re.search(r"(\d+\.\d+)x", best[0]).group(1))
    with sqlite3.connect(tmp_path / "tuning.sqlite") as conn:
        (speedup,) = conn.execute("SELECT speedup FROM tuned").fetchone()
    assert float(f"{speedup:.2f}") == measured, outputs
    assert len(cli("list", home=tmp_path).stdout.strip().splitlines()) == 3  # header, rule, one row


def test_a_postgresql_storage_without_its_driver_is_one_line_naming_the_extra(tmp_path):
    """With the PostgreSQL drivers missing (stand-in packages that fail to import, first on the path),
    `--storage postgresql://...` stops before any work with one line that says which extra to install."""
    for driver in ("psycopg", "psycopg2"):
        (tmp_path / driver).mkdir()
        (tmp_path / driver / "__init__.py").write_text(f"raise ImportError(\"No module named '{driver}'\", "
                                                       f"name='{driver}')\n")
    result = tuner("search", "--device", "cpu", *PROBLEM, "--storage", "postgresql://tuner@127.0.0.1:1/studies",
                   home=tmp_path, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "needs the database driver psycopg" in line and "pip install 'ring-tuner[distributed]'" in line, line


def test_corrupt_cache_file_is_one_line_with_what_to_do(tmp_path, cli):
    db = tmp_path / "tuning.sqlite"
    db.write_bytes(b"not sqlite at all" * 500)
    result = cli("list", "--db", str(db), home=tmp_path)
    assert result.returncode == 1
    assert "move it aside" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (("search", "--device", "fpga"), "argument --device: invalid choice"),
    (("search", "--device", "cpu", "--heads", "6", "--kv-heads", "4"), "--heads 6 must be a multiple of --kv-heads 4"),
    (("search", "--device", "cpu", "--seq-len", "1001"), "--seq-len 1001 must be divisible by --ring-size 4"),
    (("search", "--device", "cpu", "--trials", "0"), "--trials must be positive"),
    (("search", "--device", "cpu", "--compile-ahead", "-1"), "--compile-ahead must be 0 or more"),
    (("search", "--device", "cpu", "--value-head-dim", "0"), "--value-head-dim must be positive"),
    (("search", "--device", "cpu", "--documents", "1000"), "--documents '1000': the documents' lengths sum to 1000"),
    (("bench", "--device", "cpu", "--calls", "0"), "--calls must be positive"),
    (("search", "--device", "tpu"), "no tpu device here"),
    (("search", "--device", "cpu", "--backend", "cuda"), "backend must be one of"),
    (("search",), "required: --device"),
    (("show", "ffff"), "no cache entry"),
    (("demo", "--seq-len", "100"), "must be a multiple of 2 x --devices"),
    (("demo", "--heads", "6", "--kv-heads", "4"), "must be a multiple of --kv-heads"),
    (("demo", "--devices", "0"), "--devices must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    """In this process (`main`, as the `tuner` script calls it); the console entry itself is checked below."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    monkeypatch.delenv("TUNER_DB", raising=False)
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (("search", "--device", "fpga"), "argument --device: invalid choice"),
    (("search", "--device", "cpu", "--trials", "0"), "--trials must be positive"),
])
def test_the_tuner_command_refuses_bad_input_in_one_line_and_exit_2(args, message, tmp_path):
    result = tuner(*args, home=tmp_path)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(libtpu.tpu_chips() != 0, reason="TPU chips on this host, or jax counts them no more")
def test_a_device_this_host_lacks_is_one_line_with_libtpu_installed_and_no_tpu(tmp_path):
    """The test extra installs libtpu (the dry runs' TPU compiler). On a host without TPU chips jax still
    starts it to look for devices, and it printed five lines of failed lookups before the command's own."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: pip install -e '.[tpu]'")
    result = tuner("search", "--device", "tpu", home=tmp_path, as_a_user=True)
    assert result.returncode == 2 and result.stderr.startswith("tuner: error: --device tpu: no tpu device here")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.skipif(libtpu.tpu_chips() != 0, reason="TPU chips on this host, or jax counts them no more")
def test_importing_the_library_quiets_libtpu_on_a_host_without_tpu():
    """The README's example imports jax, then tuner, then asks for the devices: with libtpu installed and no
    chip, jax started libtpu there and it printed its failed lookups, before any line of the user's."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: pip install -e '.[tpu]'")
    env = {name: value for name, value in os.environ.items() if name not in ("JAX_PLATFORMS", *libtpu.HOST)}
    run = subprocess.run([sys.executable, "-c", "import jax, tuner; print(len(jax.devices()))"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert int(run.stdout) >= 1


def test_search_tunes_a_value_head_dim_and_a_packing_under_their_own_key(tmp_path, cli):
    """`--value-head-dim` and `--documents`: the problem line, the loader call and the stored key (the one the
    loader looks up) say both dims and the packing."""
    from tuner import registry
    from tuner.semantics.problem import Problem

    result = cli("search", "--device", "cpu", "--seq-len", "64", "--heads", "2", "--kv-heads", "1", "--head-dim",
                 "24", "--value-head-dim", "16", "--documents", "32,8x4", "--ring-size", "2", "--trials", "2",
                 "--runs", "1", "--objective", "fwd", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "D=24 Dv=16 float32 causal segments=5 packing=32,8x4" in result.stdout
    assert 'packing="32,8x4"' in result.stdout and "k [1, 64, 1, 24], v [1, 64, 1, 16]" in result.stdout
    problem = Problem(seq_len=64, heads=2, kv_heads=1, head_dim=24, value_head_dim=16, ring_size=2, packing="32,8x4")
    assert stored_key(result.stdout) == registry.problem_key(problem, "scan", "cpu").digest


def test_demo_checks_and_times_a_ring(tmp_path, cli):
    result = cli("demo", "--devices", "4", "--seq-len", "256", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--runs", "2", home=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "relative error vs dense float64 attention" in result.stdout and "(ok)" in result.stdout
    assert "ring" in result.stdout and "dense" in result.stdout


def test_info_lists_backends_versions_and_the_cache(searched, cli, monkeypatch):
    home, _ = searched
    monkeypatch.setenv("COLUMNS", "100")
    result = cli("info", home=home)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^scan\s+yes", result.stdout, re.M)
    assert max(len(line) for line in result.stdout.splitlines()[:-2]) <= 100  # the table fits the terminal
    note = re.search(r"^triton\s+no \[(\d)\]", result.stdout, re.M).group(1)  # why not: a note under the table
    assert re.search(rf"^\[{note}\] no CUDA GPU visible to jax$", result.stdout, re.M), result.stdout
    assert "versions: jax" in result.stdout
    assert re.search(r"cache: .*tuning.sqlite \(1 tuned, 0 stale, 0 invalid\)", result.stdout)


def test_gpu_timing_issues_several_calls_per_run_unless_told():
    from tuner.cli import build_parser
    from tuner.cli.options import calls_of

    parser = build_parser()
    assert calls_of(parser.parse_args(["search", "--device", "gpu"])) == 5
    assert calls_of(parser.parse_args(["bench", "--device", "cpu"])) == 1
    assert calls_of(parser.parse_args(["bench", "--device", "gpu", "--calls", "2"])) == 2


def test_a_table_wraps_its_last_column_to_the_width_and_keeps_the_others_aligned():
    from tuner.support.tables import table

    words = "all-to-all to head groups over the second axis, the ring over the first"
    lines = table(["name", "n", "what"], [["a", 1, "short"], ["bb", 22, words]], width=40).splitlines()
    assert lines[:3] == ["name   n  what", "----  --  " + "-" * 30, "a      1  short"]
    assert all(len(line) <= 40 for line in lines) and len(lines) == 6, lines
    assert lines[3].startswith("bb    22  all-to-all") and all(line.startswith(" " * 10) for line in lines[4:])
    assert " ".join(line[10:] for line in lines[3:]) == words  # no word cut or lost
    assert table(["name", "what"], [["a", words]]) == f"name  what\n----  {'-' * len(words)}\na     {words}"


def test_a_reported_error_is_one_line_even_without_a_message():
    from tuner.support.tables import error_line

    assert error_line(ValueError("first\nsecond")) == "ValueError: first"
    assert error_line(AssertionError()) == "AssertionError: "
    assert error_line(RuntimeError("x" * 500), limit=200) == "RuntimeError: " + "x" * 200


def test_target_flags_refuse_what_they_cannot_do(monkeypatch, capsys):
    """`--target` compiles for TPU topologies or GPUs only in a dry run, says how to get libtpu where it
    is missing, names the GPU targets, and is not silently dropped by `--from`."""
    from tuner.tuning import compiled

    assert main(["search", "--device", "cpu", "--target", "v5e:2x2"]) == 2
    assert "use it with --dry-run and --device tpu or gpu" in capsys.readouterr().err
    assert main(["search", "--device", "gpu", "--dry-run", "--target", "v5e:2x2"]) == 2
    assert "--target v5e:2x2: not a GPU target; use one of a100, h100, h200, b200 or all" in capsys.readouterr().err
    assert main(["search", "--device", "gpu", "--dry-run"]) == 2
    assert "name it with --target (a100, h100, h200, b200 or all)" in capsys.readouterr().err
    assert main(["search", "--device", "gpu", "--dry-run", "--target", "h100", "--backend", "scan"]) == 2
    assert "--dry-run checks the triton kernel: backend must be auto or one over the triton kernel (triton, " in \
        capsys.readouterr().err
    assert main(["search", "--device", "gpu", "--dry-run", "--target", "h100", "--samples", "-1"]) == 2
    assert "--samples must be zero or more, got -1" in capsys.readouterr().err
    monkeypatch.setattr(compiled, "libtpu_missing", lambda: "libtpu is not installed: pip install 'ring-tuner[tpu]'")
    assert main(["search", "--device", "tpu", "--dry-run", "--target", "v5e:2x2"]) == 2
    assert "--target: libtpu is not installed: pip install 'ring-tuner[tpu]'" in capsys.readouterr().err
    assert main(["search", "--device", "cpu", "--from", "problems.jsonl", "--target", "v5e:2x2"]) == 2
    assert "drop --target" in capsys.readouterr().err
