"""`tuner report`'s page on a study built here trial by trial (no search runs): what each trial shows, why
one failed or was pruned, a study without a winner, escaping, the config line read back; and the page
rendered by a real browser where one is installed. `tests/test_cli.py` reports a real search's study."""

import dataclasses
import html
import re
import shutil
import subprocess

import optuna
import pytest

from tuner.semantics.problem import Problem
from tuner.support.tables import describe_config, described_fields
from tuner.tuning.report import trial_rows, write_report
from tuner.tuning.study import DUPLICATE, open_storage

RANK = optuna.distributions.IntDistribution(0, 3)
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def made_study(tmp_path, problem: Problem):
    """A study as `tuner search` leaves it: the default, two sampled trials, a failed, a pruned and a
    duplicate one; and no winner decided (the search stopped before re-timing)."""
    url = f"sqlite:///{tmp_path / 'studies.sqlite'}"
    study = optuna.create_study(study_name="made", storage=open_storage(url))
    for name, value in (("problem", dataclasses.asdict(problem)), ("backend", "scan"), ("device_kind", "cpu"),
                        ("versions", {"jax_version": "0.10.2"})):
        study.set_user_attr(name, value)

    def add(state, source, q, kv, value=None, **attrs):
        config = f"fwd(block_q={q} block_kv={kv}) bwd(block_q_dkv=64)"  # as describe_config writes it
        ranks = {"fwd.block_q_rank": q.bit_length() - 6, "fwd.block_kv_rank": kv.bit_length() - 6}  # 32 is rank 0
        study.add_trial(optuna.trial.create_trial(
            state=state, value=value, params=ranks, distributions={name: RANK for name in ranks},
            user_attrs={"source": source, "config": config, **attrs}))

    complete = optuna.trial.TrialState.COMPLETE
    add(complete, "default", 128, 128, 0.98, fwd_s=0.0123, fwd_rel=0.98, compile_s=2.5)
    add(complete, "sampler", 64, 256, 0.75, fwd_s=0.0094, fwd_rel=0.75, compile_s=3.0)
    add(complete, "warm", 32, 32, 1.60, fwd_s=0.0201, fwd_rel=1.60, compile_s=1.5)
    add(optuna.trial.TrialState.FAIL, "sampler", 256, 32, failure="mismatch",
        detail="max error 3e-2 over the 1e-5 bound <b>")
    add(optuna.trial.TrialState.PRUNED, "sampler", 256, 256, pruned="block_q 256 does not divide 192")
    add(optuna.trial.TrialState.FAIL, "sampler", 64, 64, failure=DUPLICATE, detail="trial 1 holds this config")
    return study, url


@pytest.fixture
def page(tmp_path):
    problem = Problem(batch=1, seq_len=2048, heads=8, kv_heads=2, head_dim=64, dtype="float32", causal=True,
                      ring_size=4, layout="zigzag")
    study, url = made_study(tmp_path, problem)
    out = tmp_path / "report.html"
    shown = write_report("made", url, out)
    return problem, study, shown, out


def cells(text: str, trial: int) -> list[str]:
    """The cells of the trials table's row of `trial`, unescaped."""
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", text):
        found = [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        if found and found[0] == str(trial) and len(found) == 9:
            return found
    raise AssertionError(f"no row of trial {trial}")


def test_the_page_shows_every_trial_that_measured_or_failed_for_a_reason(page):
    problem, study, shown, out = page
    text = out.read_text()
    assert shown == 5 == len(trial_rows(study.get_trials()))  # the duplicate gave its config back: not shown
    assert problem.describe() in html.unescape(text)
    assert cells(text, 1) == ["1", "sampler", "complete", "9.40", "-", "0.750", "3.0",
                              "fwd(block_q=64 block_kv=256) bwd(block_q_dkv=64)", ""]
    assert re.search(r"<tr class=best><td class=n>1</td>", text)  # the fastest trial is marked, and no other
    assert text.count("<tr class=best>") == 1
    assert cells(text, 3)[2] == "fail" and cells(text, 3)[-1] == "mismatch: max error 3e-2 over the 1e-5 bound <b>"
    assert "bound <b>" not in text and "bound &lt;b&gt;" in text  # a failure's detail is text, not markup
    assert cells(text, 4)[2] == "pruned" and cells(text, 4)[-1] == "block_q 256 does not divide 192"
    assert ("3 complete, 1 fail, 1 pruned (failed: mismatch 1); not shown, as they measured nothing: trial 5 "
            "(a config another trial held, or over the budget)") in text
    assert "No winner was decided" in text
    for title in ("Time over the default, trial by trial", "Tiles tried", "Which settings mattered"):
        assert f"<h2>{title}</h2>" in text
    assert text.count("plotly.js v") == 1  # the script inlined once: the page works offline
    # the tiles' axes: the settings the trials varied, in sizes; the one they all shared has none
    assert '{"label":"fwd.block_q","range":[0,2],"ticktext":["32","64","128"],"tickvals":[0,1,2],"values":[2,1,0]}' \
        in text
    assert '"label":"bwd.block_q_dkv"' not in text


def test_one_complete_trial_says_what_the_figures_need(tmp_path):
    url = f"sqlite:///{tmp_path / 'one.sqlite'}"
    study = optuna.create_study(study_name="one", storage=open_storage(url))
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"config": "fwd(block_q=128 block_kv=128)"}))
    write_report("one", url, tmp_path / "one.html")
    text = (tmp_path / "one.html").read_text()
    assert "Tiles tried" not in text and "need at least two complete trials" in text
    assert "(the study records no problem)" in text  # a study without the search's attributes gets its page


def test_a_config_line_it_cannot_read_leaves_out_the_tiles_figure_and_says_why(tmp_path):
    url = f"sqlite:///{tmp_path / 'odd.sqlite'}"
    study = optuna.create_study(study_name="odd", storage=open_storage(url))
    for value in (1.0, 0.9):
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"config": "fwd(window=(64, 0))"}))
    write_report("odd", url, tmp_path / "odd.html")
    text = html.unescape((tmp_path / "odd.html").read_text())
    assert "<h2>Tiles tried</h2>" not in text
    assert "the tiles tried are not drawn: not a config description" in text
    assert "<h2>Which settings mattered</h2>" not in text  # nothing was sampled: no empty chart
    assert "which settings mattered is unavailable: its trials sampled no settings" in text


def test_a_config_line_reads_back_as_its_fields():
    class Config:
        def to_dict(self):
            return {"fwd": {"block_q": 64, "block_kv": None}, "bwd": {"block_q_dkv": 32, "dq_pass": "separate"}}

    assert described_fields(describe_config(Config())) == {"fwd.block_q": "64", "bwd.block_q_dkv": "32",
                                                       "bwd.dq_pass": "separate"}
    assert described_fields("-") == {}
    for text in ("fwd(block_q=64) extra", "fwd(block_q)", "block_q=64"):
        with pytest.raises(ValueError, match="not a config description"):
            described_fields(text)


def test_a_real_browser_draws_the_three_figures(page):
    """The page as a user opens it: chromium runs plotly's script and draws every figure, with no script
    error on its console. Skipped where no chromium is installed (`apt-get install chromium`)."""
    browser = next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no browser to open the page: none of {', '.join(BROWSERS)} is installed "
                    "(apt-get install chromium)")
    _, _, _, out = page
    done = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=5000", "--dump-dom", out.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    drawn = re.findall(r'class="[^"]*js-plotly-plot', done.stdout)
    assert len(drawn) == 3, done.stdout[:2000]
    errors = [line for line in done.stderr.splitlines()
              if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]
    assert errors == []
