"""Many workers, one study, on a real PostgreSQL server (`tests/postgres.py` starts a throwaway one).

Every worker is a `tuner search` process with its own `TUNER_HOME` (its own cache), as on separate
hosts; they share only the study storage. The tests read the storage with optuna and the caches with
`tuner.cache.Cache`, and check: the study's total is run exactly, no config is timed twice, a worker
killed mid-trial costs one trial, a restarted server loses nothing, `--from` divides the problems, and
`tuner dashboard` shows the studies. They skip where PostgreSQL or its driver is missing.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from tests import postgres
from cli_run import in_process
from tuner.cache import Cache
from tuner.tuning.shared import CONFIGS, config_digest
from tuner.tuning.study import DUPLICATE, SURPLUS, counted

pytestmark = [pytest.mark.skipif(postgres.missing() is not None, reason=postgres.missing() or ""),
              pytest.mark.slow]  # real worker processes: about 3 minutes in all

ROOT = Path(__file__).resolve().parent.parent
SEARCH = ["search", "--device", "cpu", "--seq-len", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
          "--ring-size", "2", "--runs", "1", "--objective", "fwd"]  # forward only: half the time (9+ configs)
TIMEOUT_S = 300  # a worker that hangs fails its test
SAME_ROW = ("key", "fwd_params", "bwd_params", "speedup", "best_s", "default_s", "measured_at", "study")
_databases = itertools.count()


@pytest.fixture(scope="module")
def server():
    started = postgres.Server().start()
    yield started
    started.destroy()


@pytest.fixture
def url(server) -> str:
    """A fresh database on the module's server."""
    return server.create(f"study{next(_databases)}")


def start(home: Path, *args: str) -> subprocess.Popen:
    """`tuner ARGS` as a worker with its own cache under `home`."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TUNER_HOME": str(home), "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    env.pop("XLA_FLAGS", None)
    env.pop("TUNER_DB", None)
    return subprocess.Popen([sys.executable, "-m", "tuner.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(workers: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Each worker's (exit code, stdout, stderr); a worker still running after `TIMEOUT_S` is aborted
    (SIGABRT: its stderr then ends with every thread's stack, `PYTHONFAULTHANDLER`), then killed."""
    done = []
    for worker in workers:
        try:
            out, err = worker.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out, err = stop(worker, signal.SIGABRT, 10)
            err += f"\n(stopped after {TIMEOUT_S} s)"
        done.append((worker.returncode, out, err))
    return done


def stop(process: subprocess.Popen, sig: int, grace: float) -> tuple[str, str]:
    """Send `sig` to `process`, then kill it if it has not ended `grace` seconds later: its stdout and stderr."""
    process.send_signal(sig)
    try:
        return process.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def the_study(url: str, name: str | None = None) -> optuna.Study:
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    return optuna.load_study(study_name=name or names[0], storage=url)


def counted_at_least(url: str, n: int) -> bool:
    """Whether the study at `url` counts `n` trials yet (False while it does not exist)."""
    try:
        return sum(counted(t) for t in the_study(url).get_trials()) >= n
    except (IndexError, KeyError, sqlalchemy.exc.SQLAlchemyError):
        return False


def rows(home: Path) -> list[dict]:
    return Cache(home / "tuning.sqlite").rows()


def check_no_config_timed_twice_at_once(trials: list[optuna.trial.FrozenTrial]) -> None:
    """Counted trials hold distinct configs, and no two trials that timed one config overlap in time. A
    duplicate or a surplus trial gives its config back before it compiles; a trial failed with no reason
    was cut off (its worker lost the storage or died: the claim it wrote may be lost with the server) and
    its point is run again, so neither timed."""
    configs = [tuple(sorted(t.params.items())) for t in trials if counted(t)]
    assert len(set(configs)) == len(configs), configs
    timed = [t for t in trials if t.params and t.datetime_start and (
             t.state == optuna.trial.TrialState.COMPLETE or t.user_attrs.get("failure") not in (None, DUPLICATE,
                                                                                                SURPLUS))]
    for a, b in itertools.combinations(timed, 2):
        if a.params == b.params and a.datetime_complete and b.datetime_complete:
            assert a.datetime_complete <= b.datetime_start or b.datetime_complete <= a.datetime_start, (a, b)


def check_one_winner(homes: list[Path], outputs: list[str]) -> None:
    """Every worker printed the same winner and holds the same one row in its cache."""
    held = [rows(home) for home in homes]
    assert all(len(r) == 1 for r in held), held
    assert len({tuple(r[0][f] for f in SAME_ROW) for r in held}) == 1, held
    best = {next(line for line in out.splitlines() if line.startswith("best ")) for out in outputs}
    assert len(best) == 1, best


@pytest.fixture(scope="module")
def three_workers(server, tmp_path_factory):
    """3 workers, `--trials 9`, on one study: the storage URL, the homes and what each printed."""
    url = server.create("three")
    tmp = tmp_path_factory.mktemp("three")
    homes = [tmp / f"host{i}" for i in range(3)]
    outcomes = finish([start(home, *SEARCH, "--trials", "9", "--storage", url) for home in homes])
    return url, homes, outcomes


def test_three_workers_run_nine_trials_and_store_one_winner(three_workers):
    url, homes, outcomes = three_workers
    for code, _, err in outcomes:
        assert code == 0, err[-3000:]
    trials = the_study(url).get_trials()
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 9
    assert sum(counted(t) for t in trials) == 9
    check_no_config_timed_twice_at_once(trials)
    assert len({t.user_attrs["worker"] for t in trials if counted(t)}) >= 2  # the work was shared
    check_one_winner(homes, [out for _, out, _ in outcomes])


def test_a_worker_killed_mid_trial_costs_that_trial_only(url, tmp_path):
    """SIGKILL a worker while its trial runs: the others fail it once its heartbeat (1 s) is 2 s old, re-run
    its config, and the study still reaches 9 complete trials; both survivors store the one winner."""
    homes = [tmp_path / f"host{i}" for i in range(3)]
    workers = [start(home, *SEARCH, "--trials", "9", "--heartbeat", "1", "--storage", url) for home in homes]
    pids = {w.pid: w for w in workers}

    engine = sqlalchemy.create_engine(url)

    def victim() -> optuna.trial.FrozenTrial | None:
        """A running trial past the first two that holds its config (so it compiles or times it) and is not
        itself a retry. On a loaded machine a live worker can miss its 1 s heartbeat by 2 s: its trial is
        then failed as stale and retried. A retry that is killed is not retried again (a config that
        kills two workers is not tried a third time), so killing one would test that rule, not this one."""
        try:
            trials = the_study(url).get_trials()
            with engine.connect() as db:
                claims = set(db.execute(sqlalchemy.select(CONFIGS.c.config, CONFIGS.c.trial)).all())
        except (IndexError, KeyError, sqlalchemy.exc.SQLAlchemyError):  # no study or claim yet
            return None
        return next((t for t in trials if t.number >= 2 and t.state == optuna.trial.TrialState.RUNNING
                     and "failed_trial" not in t.system_attrs and (config_digest(t.params), t.number) in claims),
                    None)

    def stopped_while_running() -> tuple[optuna.trial.FrozenTrial, int] | None:
        """A victim's worker stopped (SIGSTOP) while the storage still shows its trial running, so that the
        trial cannot finish between being seen and the kill; else the worker resumed, and None."""
        trial = victim()
        if trial is None:
            return None
        pid = int(trial.user_attrs["worker"].split(":")[1])
        os.kill(pid, signal.SIGSTOP)
        if the_study(url).get_trials()[trial.number].state == optuna.trial.TrialState.RUNNING:
            return trial, pid
        os.kill(pid, signal.SIGCONT)
        return None

    found = postgres.wait_for(stopped_while_running, TIMEOUT_S)
    engine.dispose()
    assert found is not None, "no trial was seen running"
    killed, pid = found
    os.kill(pid, signal.SIGKILL)
    survivors = [w for w in workers if w.pid != pid]
    outcomes = finish(survivors)
    pids[pid].communicate()
    for code, _, err in outcomes:
        assert code == 0, err[-3000:]

    trials = the_study(url).get_trials()
    dead = trials[killed.number]
    assert dead.state == optuna.trial.TrialState.FAIL and "failure" not in dead.user_attrs
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1, [(t.number, t.state.name, t.user_attrs, t.system_attrs) for t in trials]
    (retry,) = retries
    assert retry.state == optuna.trial.TrialState.COMPLETE and retry.params == killed.params
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == sum(counted(t) for t in trials) == 9
    check_no_config_timed_twice_at_once(trials)
    check_one_winner([h for h, w in zip(homes, workers) if w.pid != pid], [out for _, out, _ in outcomes])


def test_a_restarted_server_loses_nothing(tmp_path, capsys):
    """Stop the server under 2 running workers and start it again 3 s later: each worker resumes and
    finishes, or stops with one line saying the storage was lost; every cache holds only valid rows."""
    server = postgres.Server().start()
    try:
        url = server.create("restart")
        homes = [tmp_path / f"host{i}" for i in range(2)]
        workers = [start(home, *SEARCH, "--trials", "9", "--heartbeat", "1", "--storage", url) for home in homes]

        assert postgres.wait_for(lambda: counted_at_least(url, 2), TIMEOUT_S), "the workers never ran two trials"
        server.stop()
        postgres.wait_for(lambda: False, 3)
        server.start()
        outcomes = finish(workers)
        resumed = [code == 0 for code, _, _ in outcomes]
        for (code, _, err), home in zip(outcomes, homes):
            listed = in_process(capsys, "list", "--db", str(home / "tuning.sqlite"), home=home).stdout
            assert "invalid" not in listed, listed
            if code != 0:
                assert err.strip().splitlines()[-1].startswith("tuner: error: lost the study storage"), err[-8000:]
                assert rows(home) == []  # never a partial winner
        if any(resumed):
            trials = the_study(url).get_trials()
            assert sum(counted(t) for t in trials) == 9
            check_no_config_timed_twice_at_once(trials)
            check_one_winner([h for h, ok in zip(homes, resumed) if ok],
                             [out for (code, out, _) in outcomes if code == 0])
    finally:
        server.destroy()


def test_a_server_that_stays_down_stops_the_worker_with_one_line_and_no_row(tmp_path):
    """Stop the server under a running worker for good: after `--reconnect 5` seconds of retries it stops
    with one line saying the storage was lost, exit code 1, and nothing in its cache."""
    server = postgres.Server().start()
    try:
        url = server.create("down")
        home = tmp_path / "host"
        worker = start(home, *SEARCH, "--trials", "30", "--heartbeat", "1", "--reconnect", "5", "--storage", url)

        assert postgres.wait_for(lambda: counted_at_least(url, 1), TIMEOUT_S), "the worker never ran a trial"
        server.stop()
        ((code, out, err),) = finish([worker])
    finally:
        server.destroy()
    assert code == 1, (out, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("tuner: error: lost the study storage 127.0.0.1:") and "for 5 s" in last, err[-3000:]
    assert "nothing was written to the cache" in last
    assert rows(home) == []


PROGRAM = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from tuner import get_tuned_ring_attention
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)
    window = get_tuned_ring_attention(axis_name="sp", causal=True, sliding_window=32, mesh=mesh)
    q = jnp.ones((1, 256, 2, 16))
    jax.jit(attn)(q, q, q).block_until_ready()
    jax.jit(window)(q, q, q).block_until_ready()
""")


def test_search_from_divides_the_problems_among_workers(url, tmp_path):
    """Two recorded problems, two workers with `--from`: each problem is taken by one worker and tuned
    once (one study of 3 trials each), and both workers' caches end with both winners."""
    program, recorded = tmp_path / "train.py", tmp_path / "problems.jsonl"
    program.write_text(PROGRAM)
    code, _, err = finish([start(tmp_path / "recorder", "record", "--out", str(recorded), "--", sys.executable,
                                 str(program))])[0]
    assert code == 0, err[-3000:]
    homes = [tmp_path / f"host{i}" for i in range(2)]
    outcomes = finish([start(home, "search", "--from", str(recorded), "--device", "cpu", "--trials", "3",
                             "--runs", "1", "--db", str(home / "tuning.sqlite"), "--storage", url)
                       for home in homes])
    for code, out, err in outcomes:
        assert code == 0, err[-3000:]
        assert "2 of 2 tunable problem(s) covered" in out, out

    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert len(names) == 2
    for name in names:
        assert sum(counted(t) for t in the_study(url, name).get_trials()) == 3
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as db:
        holders = dict(db.execute(sqlalchemy.text("SELECT study, worker FROM ring_tuner_problems")).all())
    engine.dispose()
    assert set(holders) == set(names) and len(set(holders.values())) == 2, holders  # one problem each
    held = [sorted(tuple(r[f] for f in SAME_ROW) for r in rows(home)) for home in homes]
    assert len(held[0]) == 2 and held[0] == held[1], held


def test_dashboard_lists_the_study_just_run(three_workers, tmp_path):
    """`tuner dashboard --storage URL` serves optuna-dashboard on 127.0.0.1; its HTTP API lists the study the
    three workers ran."""
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is missing: pip install 'ring-tuner[distributed]'")
    url, _, _ = three_workers
    port = postgres.free_port()
    dashboard = start(tmp_path, "dashboard", "--storage", url, "--port", str(port))
    try:
        def studies() -> list | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as answer:
                    return json.load(answer)["study_summaries"]
            except OSError:
                return None

        listed = postgres.wait_for(studies, 60, every=0.5)
        assert listed is not None, dashboard.stderr.read() if dashboard.poll() is not None else "no answer"
        assert [s["study_name"] for s in listed] == [the_study(url).study_name]
    finally:
        out, _ = stop(dashboard, signal.SIGINT, 30)
    assert f"http://127.0.0.1:{port}" in out
