"""The search machinery, on a tiny problem with a deliberately faulty backend: the default runs first,
constrained points are pruned before compiling, wrong and unbuildable candidates are failed trials with
their reasons, the search goes on, and the winner lands in the cache."""

import dataclasses
import json
import re
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import jax
import optuna
import pytest

from tuner import BwdParams, FwdParams, registry
from tuner.kernels.base import SearchSpace
from tuner.kernels.base import MergedBlocks
from tuner.kernels.scan import ScanBackend
from tuner.cache import Cache, make_row, near_configs, row_config
from tuner.cli.usage import search_summary
from tuner.strategies.implementations import Ring
from tuner.strategies.configs import TileConfig, TileSpace
from tuner.semantics.problem import Problem
from tuner.tuning.search import SearchOptions, search
from tuner.tuning.study import (await_retries, counted, default_storage, fail_stale, open_storage, study_name,
                                surplus)
from tuner.tuning.timing import Timing
from tuner.tuning.trials import Trials

TINY = Problem(batch=1, seq_len=64, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2,
               layout="zigzag")


class Faulty(MergedBlocks, ScanBackend):
    """Scan, except: fwd (8, 8) is wrong, fwd (8, 16) fails to build, (16, 16) breaks a constraint."""

    name = "faulty"
    masked_tile = None  # its defaults hold under the causal mask too

    def default_params(self, q_len, kv_len, head_dim, value_head_dim=None):
        return FwdParams(16, 8), BwdParams(16, 8)

    def search_space(self, shapes, spec):
        return SearchSpace(fwd={"block_q": (8, 16), "block_kv": (8, 16)},
                           bwd={"block_q_dkv": (8, 16), "block_kv_dkv": (8, 16)}, dq_tiles=(8, 16))

    def violation(self, shapes, spec, fwd, bwd):
        if fwd is not None and (fwd.block_q, fwd.block_kv) == (16, 16):
            return "16x16 tiles are ruled out"
        return None

    def block_fwd(self, q, k, v, *args, spec, params, interpret=False):
        if (params.block_q, params.block_kv) == (8, 16):
            raise RuntimeError("this variant does not build")
        out, lse = super().block_fwd(q, k, v, *args, spec=spec, params=params, interpret=interpret)
        if (params.block_q, params.block_kv) == (8, 8):
            out = out * 1.001
        return out, lse


@pytest.fixture
def faulty():
    with registry.registered(Ring(Faulty())):
        yield


ONE_TRIAL = SearchOptions(objective="fwd", trials=1, runs=1, final_runs=1)


@pytest.fixture(scope="module")
def one_trial(tmp_path_factory):
    """A search of TINY on the faulty backend that ran one trial (the default), in a folder of its own (the
    cache and its studies): its result and a function that copies the folder for a test to go on from.
    The tests that start from such a search share this one."""
    folder = tmp_path_factory.mktemp("one_trial")
    with registry.registered(Ring(Faulty())):
        result = search(TINY, device="cpu", backend="faulty", options=ONE_TRIAL, db=folder / "tuning.sqlite")

    def copy_to(path: Path) -> Path:
        shutil.copytree(folder, path, dirs_exist_ok=True)
        return path / "tuning.sqlite"
    return result, copy_to


def test_every_outcome_is_recorded_and_the_search_goes_on(faulty, tmp_path):
    db = tmp_path / "tuning.sqlite"
    options = SearchOptions(objective="fwd", trials=4, sampler="grid", runs=2, final_runs=2)
    result = search(TINY, device="cpu", backend="faulty", options=options, db=db)

    assert result.failed == {"wrong": 1, "compile": 1}
    assert (result.trials_run, result.trials_pruned) == (4, 1)
    assert result.best.config.fwd == FwdParams(16, 8)  # the only correct, buildable point

    study = optuna.load_study(study_name=result.study, storage=default_storage(db))
    trials = sorted(study.trials, key=lambda t: t.number)
    space = TileSpace(Faulty().search_space(TINY.shapes, TINY.spec))
    fwd = {t.number: space.config(t.params, result.default.config).fwd for t in trials}
    assert fwd[trials[0].number] == FwdParams(16, 8)  # default first
    by_point = {(fwd[t.number].block_q, fwd[t.number].block_kv): t for t in trials}
    assert all(t.user_attrs["config"].startswith(f"fwd(block_q={q} block_kv={kv}") for (q, kv), t in by_point.items())
    assert "differs from the scan reference" in by_point[(8, 8)].user_attrs["detail"]
    assert "does not build" in by_point[(8, 16)].user_attrs["detail"]
    assert by_point[(16, 16)].state == optuna.trial.TrialState.PRUNED
    assert by_point[(16, 16)].user_attrs["pruned"] == "16x16 tiles are ruled out"
    assert by_point[(16, 8)].user_attrs["compile_s"] > 0

    (row,) = Cache(db).rows()
    assert row["key"] == registry.problem_key(TINY, "faulty", "cpu").digest
    assert json.loads(row["fwd_params"])["block_q"] == 16
    assert json.loads(row["trials_failed"]) == {"compile": 1, "wrong": 1}
    assert row["best_s"] > 0 and row["default_s"] > 0


def test_a_rerun_resumes_the_study(faulty, tmp_path):
    db = tmp_path / "tuning.sqlite"
    first = search(TINY, device="cpu", backend="faulty", db=db,
                   options=SearchOptions(objective="fwd", trials=2, sampler="grid", runs=1, final_runs=1))
    second = search(TINY, device="cpu", backend="faulty", db=db,
                    options=SearchOptions(objective="fwd", trials=4, sampler="grid", runs=1, final_runs=1))
    assert (first.new_trials, second.new_trials, second.trials_run) == (2, 2, 4)
    assert first.study == second.study


def test_trials_over_the_time_limit_fail_as_timeouts(tmp_path):
    """TINY's forward space holds one config: it times out once and is not tried again."""
    options = SearchOptions(objective="fwd", trials=2, trial_timeout=1e-4, runs=1, final_runs=1)
    with pytest.raises(RuntimeError, match=r"no trial .* completed \(1 finished \(every config of the space was "
                                           r"tried\).*'timeout': 1"):
        search(TINY, device="cpu", backend="scan", options=options, db=tmp_path / "t.sqlite")


def test_backward_objective_checks_gradients(tmp_path):
    class WrongSeparateDq(MergedBlocks, ScanBackend):
        name = "wrong_dq"

        def block_bwd(self, *args, params, **kwargs):
            dq, dk, dv, dbias = super().block_bwd(*args, params=params, **kwargs)
            return (dq if params.fused_dq else dq * 1.01), dk, dv, dbias

    options = SearchOptions(objective="bwd", trials=2, sampler="grid", runs=1, final_runs=1)
    with registry.registered(Ring(WrongSeparateDq())):
        result = search(TINY, device="cpu", backend="wrong_dq", options=options, db=tmp_path / "t.sqlite")
    assert result.failed == {"wrong": 1}
    assert result.best.config.bwd.fused_dq


def test_a_failing_default_stops_the_search_with_a_reason(tmp_path):
    class AlwaysWrong(MergedBlocks, ScanBackend):
        name = "always_wrong"

        def block_fwd(self, *args, **kwargs):
            out, lse = super().block_fwd(*args, **kwargs)
            return out + 1.0, lse

    with registry.registered(Ring(AlwaysWrong())), \
            pytest.raises(RuntimeError, match="default .* fails on this problem.*differs from the scan"):
        search(TINY, device="cpu", backend="always_wrong", db=tmp_path / "t.sqlite",
               options=SearchOptions(objective="fwd", trials=1, runs=1, final_runs=1))


def test_grid_covers_forward_and_backward_spaces_side_by_side():
    space = Faulty().search_space(TINY.shapes, TINY.spec)
    default = Faulty().default_params(32, 32, 16)
    points = TileSpace(space).grid(TileConfig(*default), registry.OBJECTIVE_PARTS["fwd+bwd"])
    assert {p.fwd for p in points} == set(space.fwd_points())
    assert {p.bwd for p in points} == set(space.bwd_points())
    assert len(points) == len(list(space.bwd_points())) == 4 * (1 + 4)


def test_a_space_the_trials_can_walk_is_walked_without_the_points_its_constraints_rule_out(faulty, tmp_path):
    """4 forward points and 4 trials: with the sampler (TPE) the default's 3 siblings are queued as the grid,
    but for the one the constraints rule out (16 x 16): every point that can run is tried, none pruned."""
    options = SearchOptions(objective="fwd", trials=4, runs=1, final_runs=1)
    result = search(TINY, device="cpu", backend="faulty", options=options, db=tmp_path / "tuning.sqlite")
    study = optuna.load_study(study_name=result.study, storage=default_storage(tmp_path / "tuning.sqlite"))
    space = TileSpace(Faulty().search_space(TINY.shapes, TINY.spec))
    grid = {(f.block_q, f.block_kv): t for t in study.trials if t.user_attrs.get("source") == "grid"
            for f in [space.config(t.params, result.default.config).fwd]}
    assert set(grid) == {(8, 8), (8, 16)}, study.trials  # (16, 8) is the default, (16, 16) is ruled out
    assert all(t.state != optuna.trial.TrialState.PRUNED for t in grid.values())
    assert result.failed == {"wrong": 1, "compile": 1} and result.best.config.fwd == FwdParams(16, 8)


def test_study_names_change_with_versions_objective_and_drawn_rows():
    key = registry.problem_key(TINY, "scan", "cpu")
    assert study_name(key, "fwd", {"jax_version": "1"}) != study_name(key, "fwd", {"jax_version": "2"})
    assert study_name(key, "fwd", {"jax_version": "1"}) != study_name(key, "bwd", {"jax_version": "1"})
    assert study_name(key, "fwd", {"jax_version": "1"}, "lognormal:14") != study_name(key, "fwd", {"jax_version": "1"})


def test_engines_searched_in_turn_share_the_timeout_equally():
    assert SearchOptions(timeout=60.0, trials=5).shared_by(3) == SearchOptions(timeout=20.0, trials=5)
    assert SearchOptions().shared_by(2) == SearchOptions()  # no timeout: nothing to share


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="objective"):
        SearchOptions(objective="both")
    with pytest.raises(ValueError, match="trials"):
        SearchOptions(trials=0)
    with pytest.raises(ValueError, match="sampler"):
        SearchOptions(sampler="cmaes")
    with pytest.raises(ValueError, match="kv_heads"):
        Problem(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="ring_size"):
        Problem(seq_len=1001, ring_size=4)
    with pytest.raises(ValueError, match="causal must be True or False, got 1"):
        Problem(causal=1)


def _competitor(db, name: str) -> optuna.Study:
    """Another worker's handle on the study (no heartbeat: its trials stay running until told)."""
    return optuna.load_study(study_name=name, storage=default_storage(db))


def test_a_running_trial_that_never_beat_is_failed_and_retried(tmp_path):
    """A worker that lost the storage between creating its trial and the trial's first heartbeat leaves
    it running without one; optuna's stale check passes over it and the other workers waited for ever.
    Two heartbeats after it started (and `orphan_after`), it is failed and its retry queued; a trial
    that just started is left alone."""
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.sqlite'}", heartbeat=1)
    study = optuna.create_study(study_name="orphans", storage=storage)
    orphan = study.ask()  # `ask` records no heartbeat: only `optimize`'s thread does
    orphan.suggest_int("x", 0, 9)
    time.sleep(2.2)
    fresh = study.ask()
    fail_stale(study, storage, orphan_after=0)
    trials = study.get_trials(deepcopy=False)
    states = {t.number: t.state for t in trials}
    assert states[orphan.number] == optuna.trial.TrialState.FAIL
    assert states[fresh.number] == optuna.trial.TrialState.RUNNING
    (retry,) = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(retry) == orphan.number
    fail_stale(study, storage, orphan_after=0)  # a second worker's check finds nothing more to do
    assert len(study.get_trials(deepcopy=False)) == len(trials)


def test_the_retry_of_a_trial_killed_just_now_takes_its_place_before_a_trial_started_meanwhile(tmp_path):
    """optuna fails a stale trial and queues its retry a moment later; a trial another worker started in
    between is numbered below the retry. It waits for the retry and is surplus: the retry holds the
    killed trial's place (before, it took that place and the retry was left waiting for ever). A killed
    trial that is never retried holds nothing once the wait is over."""
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.sqlite'}", heartbeat=1)
    study = optuna.create_study(study_name="race", storage=storage)
    x = optuna.distributions.IntDistribution(0, 9)
    study.add_trial(optuna.create_trial(params={"x": 0}, distributions={"x": x}, value=1.0))
    killed = study.ask()
    killed.suggest_int("x", 0, 9)
    storage.set_trial_state_values(killed._trial_id, state=optuna.trial.TrialState.FAIL)
    meanwhile = study.ask()
    queue_retry = threading.Timer(0.3, storage.get_heartbeat_stale_trial_callback(),
                                  (study, storage.get_trial(killed._trial_id)))
    queue_retry.start()
    start = time.monotonic()
    assert surplus(meanwhile, total=2)
    assert 0.2 < time.monotonic() - start < 5.0
    (retry,) = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.WAITING]
    assert retry.number > meanwhile.number and retry.system_attrs["failed_trial"] == killed.number

    assert study.ask().number == retry.number  # the retry runs next
    crashed = study.ask()  # failed without a reason and never retried: its worker crashed meanwhile
    crashed.suggest_int("x", 0, 9)
    start = time.monotonic()
    storage.set_trial_state_values(crashed._trial_id, state=optuna.trial.TrialState.FAIL)
    later = study.ask()
    assert len(await_retries(study, later.number, patience=0.5)) == 6
    assert 0.5 <= time.monotonic() - start < 3.0
    start = time.monotonic()
    await_retries(study, later.number, patience=0.5)  # failed longer ago than that: not waited for
    assert time.monotonic() - start < 0.3


def test_workers_sharing_a_study_run_its_total_between_them(faulty, tmp_path, monkeypatch):
    """Another worker starts two trials just before this worker's second: that one is surplus (counted
    nowhere, no failure) and stops this worker while the other's trials run; when they end interrupted,
    this worker goes on and runs the study up to its total, a different config in every counted trial."""
    db = tmp_path / "tuning.sqlite"
    fail_stale = optuna.storages.fail_stale_trials  # optuna calls it right before each trial starts
    competing: list[optuna.Trial] = []

    def other_worker(study: optuna.Study) -> None:
        fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        running = {t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING}
        other = _competitor(db, study.study_name)
        if not competing and any(t.state.is_finished() for t in trials):
            competing.extend(other.ask() for _ in range(2))
        elif any(t.user_attrs.get("failure") == "surplus" for t in trials) and competing[0].number in running:
            for trial in competing:
                trial.set_user_attr("failure", "interrupted")
                other.tell(trial, state=optuna.trial.TrialState.FAIL)

    monkeypatch.setattr(optuna.storages, "fail_stale_trials", other_worker)
    result = search(TINY, device="cpu", backend="faulty", db=db,
                    options=SearchOptions(objective="fwd", trials=3, runs=1, final_runs=1))
    assert (result.new_trials, result.trials_run) == (3, 3)

    trials = optuna.load_study(study_name=result.study, storage=default_storage(db)).trials
    timed = [tuple(sorted(t.params.items())) for t in trials if counted(t)]
    assert len(set(timed)) == len(timed) == 3
    (surplus,) = [t for t in trials if t.user_attrs.get("failure") == "surplus"]
    assert surplus.number == 3  # after the default and the other worker's two
    assert [t.user_attrs.get("failure") for t in trials if t.number in (1, 2)] == ["interrupted"] * 2
    assert len([t for t in trials if t.user_attrs.get("failure") != "duplicate"]) == 1 + 2 + 1 + 2
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in trials}


def test_a_trial_another_worker_failed_while_it_ran_is_dropped_and_the_search_goes_on(faulty, tmp_path,
                                                                                        monkeypatch):
    """Another worker fails this worker's running trial as stale (as after a storage outage that stopped its
    heartbeat): optuna then refuses the trial's result; the search drops it and runs its total without it."""
    from tuner.tuning.trials import Trials

    db = tmp_path / "tuning.sqlite"
    objective = Trials.objective
    dropped = []

    def failed_meanwhile(self, trial: optuna.Trial) -> float:
        value = objective(self, trial)
        if not dropped:  # the first trial that returns a time
            _competitor(db, trial.study.study_name).tell(trial.number, state=optuna.trial.TrialState.FAIL)
            dropped.append(trial.number)
        return value

    monkeypatch.setattr(Trials, "objective", failed_meanwhile)
    result = search(TINY, device="cpu", backend="faulty", db=db,
                    options=SearchOptions(objective="fwd", trials=4, sampler="grid", runs=1, final_runs=1))
    trials = optuna.load_study(study_name=result.study, storage=default_storage(db)).trials
    lost = trials[dropped[0]]
    assert lost.state == optuna.trial.TrialState.FAIL and not counted(lost)
    # 4 counted trials cover the 4 points: the dropped one's config (the only correct one) runs again
    assert sum(counted(t) for t in trials) == 4 and result.best is not None


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning",
                            "ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_dead_workers_trial_does_not_hold_its_place(faulty, one_trial, tmp_path):
    """A running trial whose heartbeat is stale (its worker was killed) is failed by optuna and counts
    nowhere: the search runs the study's total without it."""
    first, copy_to = one_trial
    db = copy_to(tmp_path)
    url = default_storage(db)
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120)
    dead = optuna.load_study(study_name=first.study, storage=storage).ask()
    storage.record_heartbeat(dead._trial_id)
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-1 hour')")

    second = search(TINY, device="cpu", backend="faulty", db=db, options=dataclasses.replace(ONE_TRIAL, trials=2))
    assert (second.new_trials, second.trials_run) == (1, 2)
    stale = optuna.load_study(study_name=first.study, storage=url).trials[dead.number]
    assert stale.state == optuna.trial.TrialState.FAIL and "failure" not in stale.user_attrs


def test_the_cache_keeps_the_best_result_of_the_workers(faulty, one_trial, tmp_path):
    """A search stores its winner unless the cache holds a row of the same objective and versions with a
    higher or equal speedup (another worker's): then it keeps that row and says so."""
    first, copy_to = one_trial
    db, options = copy_to(tmp_path), ONE_TRIAL
    assert first.stored and first.stored_speedup == first.speedup
    cache = Cache(db)
    (row,) = cache.rows()

    cache.put({**row, "speedup": 1e6})  # a better result from another worker
    kept = search(TINY, device="cpu", backend="faulty", options=options, db=db)
    assert (kept.new_trials, kept.stored, kept.stored_speedup) == (0, False, 1e6)
    assert [r["speedup"] for r in cache.rows()] == [1e6]

    cache.put({**row, "speedup": 1e-6})  # a worse one
    replaced = search(TINY, device="cpu", backend="faulty", options=options, db=db)
    assert replaced.stored and replaced.stored_speedup == replaced.speedup
    assert [r["speedup"] for r in cache.rows()] == [replaced.speedup]


def test_the_summary_says_whether_the_re_timing_confirmed_the_best_trial(tmp_path, monkeypatch):
    """The trial times its candidate at half the default's time (the progress bar's 2.00x); the re-timing
    at the end at twice it. The default stays, and the summary says that the bar's best trial was not
    confirmed; where a trial wins, no such line is printed."""
    options = SearchOptions(objective="fwd", trials=2, runs=1, final_runs=2)

    def measure(self, candidates, runs, deadline):
        ratio = 0.5 if runs == options.runs else 2.0
        return {"default": (Timing(1.0, 1.0, 1.0, runs, 0.0), None),
                **{name: (Timing(ratio, ratio, ratio, runs, 0.0), None) for name in candidates}}

    monkeypatch.setattr(Trials, "measure", measure)
    problem = Problem(batch=1, seq_len=128, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2)
    result = search(problem, device="cpu", backend="scan", db=tmp_path / "t.sqlite", options=options)
    default, (trial, then, now) = result.retimed
    assert (then, now, default, result.best_from, result.speedup) == (2.0, 0.5, ("default", None, 1.0), "default", 1.0)
    summary = "\n".join(search_summary(result))
    retimed = rf"^re-timed side by side.*\n +default +1.00x\n +{re.escape(trial)} +0.50x  \(in its trial 2.00x\)$"
    assert re.search(retimed, summary, re.M), summary
    kept = "default  kept: re-timed side by side, no trial beat it; the progress bar's best trial (2.00x)"
    assert kept in summary
    confirmed = dataclasses.replace(result, best_from=trial, retimed=[(trial, 2.0, 2.0), default])
    assert kept not in "\n".join(search_summary(confirmed))


def test_a_timeout_stores_the_best_verified_config_so_far_and_says_where_time_went(tmp_path):
    """`timeout` is the trials' budget, counted once the reference and the default are built, and the
    default's trial runs however short it is: a search of 100 trials with a budget of a millisecond times
    the default and stops. The best verified config so far is stored and the summary says so; the run's
    seconds are split into compiling, checking and timing."""
    problem = Problem(batch=1, seq_len=128, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=2)
    result = search(problem, device="cpu", backend="scan", db=tmp_path / "t.sqlite",
                    options=SearchOptions(trials=100, timeout=1e-3, runs=1, final_runs=1))
    assert result.timed_out and result.trials_run == 1 and result.speedup == 1.0
    assert len(Cache(tmp_path / "t.sqlite").rows()) == 1 and result.stored
    assert set(result.spent) == {"compile", "check", "timing"} and all(v > 0 for v in result.spent.values())
    assert sum(result.spent.values()) <= result.seconds
    summary = "\n".join(search_summary(result))
    assert "stopped  by --timeout with" in summary and "the best verified config so far" in summary
    assert re.search(r"^time     \d+ s: compile \d+ s \(\d+%\), check", summary, re.M), summary


def test_a_warm_study_starts_from_the_nearest_tuned_problems_winner(tmp_path):
    """The cache holds a winner for a problem twice as long: a new study's first trial after the default is
    that config, marked as coming from it; with no neighbour, or `warm_start=False`, the sampler comes next."""
    db = tmp_path / "t.sqlite"
    near = Problem(batch=1, seq_len=256, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=2)
    problem = dataclasses.replace(near, seq_len=128)
    scan = registry.get("scan")
    options = SearchOptions(objective="fwd", trials=2, runs=1, final_runs=1)

    lonely = search(problem, device="cpu", backend="scan", db=db, options=options)
    first = optuna.load_study(study_name=lonely.study, storage=default_storage(db)).trials
    assert [t.user_attrs.get("source") for t in first[:2]] == ["default", "sampler"]
    # The row keeps the winner and every trial's config within 5% of the best trial, for the next warm start.
    (row,) = Cache(db).rows()
    space, default = scan.space(problem.shapes, problem.spec), scan.default_config(problem.shapes, problem.spec)
    timed = sorted((t for t in first if t.value is not None), key=lambda t: t.value)
    within = [space.config(t.params, default) for t in timed if t.value <= 1.05 * timed[0].value]
    assert near_configs(row) == [row_config(row), *(c for c in within if c != row_config(row))]

    winner = TileConfig(FwdParams(32, 64), scan.default_config(near.shapes, near.spec).bwd)
    near_key = registry.problem_key(near, "scan", jax.devices()[0].device_kind)
    Cache(db).put(make_row(near_key, winner, versions=registry.versions(scan), tool_version="test",
                           objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0, trials_run=1, trials_pruned=0,
                           study="near"))
    for warm, expected in ((True, f"nearest {near_key.digest[:8]} (distance 2.0)"), (False, "sampler")):
        db_run = tmp_path / f"{warm}.sqlite"
        Cache(db_run).put(Cache(db).rows()[-1])
        result = search(problem, device="cpu", backend="scan", db=db_run,
                        options=dataclasses.replace(options, warm_start=warm))
        trials = optuna.load_study(study_name=result.study, storage=default_storage(db_run)).trials
        assert trials[1].user_attrs["source"] == expected
        if warm:
            space = scan.space(problem.shapes, problem.spec)
            queued = space.config(trials[1].params, scan.default_config(problem.shapes, problem.spec))
            assert (queued.fwd.block_q, queued.fwd.block_kv) == (32, 64)


def test_a_warm_start_queues_distinct_winners_other_than_the_default():
    """The nearest problem's winner is the default, the next one's tiles are longer than this problem's
    shards, and the next two share theirs: the one queued after it comes from the fifth nearest, so the
    study's first trials are three different configs."""
    from tuner.tuning.warm import winners

    problem = Problem(batch=1, seq_len=256, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=2)
    scan = registry.get("scan")
    space, default = scan.space(problem.shapes, problem.spec), scan.default_config(problem.shapes, problem.spec)
    kind = jax.devices()[0].device_kind
    near = []
    for distance, heads, fwd in ((1.0, 2, default.fwd), (1.2, 6, FwdParams(1024, 1024)),  # not in this space
                                 (1.5, 8, FwdParams(32, 64)), (2.0, 16, FwdParams(32, 64)),
                                 (3.0, 32, FwdParams(64, 32))):
        key = registry.problem_key(dataclasses.replace(problem, heads=heads), "scan", kind)
        near.append((distance, make_row(key, TileConfig(fwd, default.bwd), versions=registry.versions(scan),
                                        tool_version="test", objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0,
                                        trials_run=1, trials_pruned=0, study=str(heads))))
    chosen = winners(near, scan, space, default, ("fwd",))
    assert [(config.fwd.block_q, config.fwd.block_kv) for config, _ in chosen] == [(32, 64), (64, 32)]
    assert [source.split()[-1] for _, source in chosen] == ["1.5)", "3.0)"]


def test_a_config_near_best_on_several_neighbours_is_queued_before_any_ones_winner():
    """The two nearest problems won with different tiles, but both timed 64 x 64 within 5% of their best:
    it comes first, naming both; then their winners, nearest first. The third nearest's winner weighs
    less and the fourth's comes after every vote: neither is queued."""
    from tuner.tuning.warm import winners

    problem = Problem(batch=1, seq_len=256, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=2)
    scan = registry.get("scan")
    space, default = scan.space(problem.shapes, problem.spec), scan.default_config(problem.shapes, problem.spec)
    kind = jax.devices()[0].device_kind
    near = []
    for distance, heads, tiles in ((1.0, 2, [(32, 64), (64, 64)]), (1.5, 8, [(64, 32), (64, 64)]),
                                   (2.0, 16, [(32, 32)]), (3.0, 32, [(128, 32)])):
        configs = [TileConfig(FwdParams(*t), default.bwd) for t in tiles]
        key = registry.problem_key(dataclasses.replace(problem, heads=heads), "scan", kind)
        near.append((distance, make_row(key, configs[0], versions=registry.versions(scan), tool_version="test",
                                        objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0, trials_run=1,
                                        trials_pruned=0, study=str(heads), near_best=configs)))
    chosen = winners(near, scan, space, default, ("fwd",))
    assert [(config.fwd.block_q, config.fwd.block_kv) for config, _ in chosen] == [(64, 64), (32, 64), (64, 32)]
    assert chosen[0][1] == (f"nearest {near[0][1]['key'][:8]} (distance 1.0), "
                            f"{near[1][1]['key'][:8]} (distance 1.5)")


def test_on_a_tpu_the_models_fastest_configs_follow_the_neighbours(tmp_path):
    """A pallas_tpu study on a v5e with no tuned neighbour queues, after the default, the analytic model's two
    fastest admitted forward tiles that it times apart, as it does for all_to_all over Pallas; on the CPU, and
    for the scan backend, there is no model and nothing is queued."""
    from tuner.models import tpu_model
    from tuner.tuning.warm import model_picks, warm_start

    problem = Problem(batch=1, seq_len=4096, heads=8, kv_heads=8, head_dim=128, causal=True, ring_size=4,
                      dtype="bfloat16")
    pallas = registry.get("pallas_tpu")
    space, default = pallas.space(problem.shapes, problem.spec), pallas.default_config(problem.shapes, problem.spec)
    chip = tpu_model.CHIPS["v5e"]
    timed = sorted(((tpu_model.predict(problem, chip, fwd=c.fwd).seconds, c) for c in space.grid(default, ("fwd",))
                    if pallas.violation(problem.shapes, problem.spec, c, ("fwd",)) is None), key=lambda t: t[0])
    fastest = [c for i, (s, c) in enumerate(timed) if c != default and all(s != t for t, _ in timed[:i])][:2]
    study = optuna.create_study()
    key = registry.problem_key(problem, "pallas_tpu", "TPU v5 lite")
    sources = warm_start(study, Cache(tmp_path / "t.sqlite"), problem, key, registry.versions(pallas), pallas, space,
                         default, ("fwd",))
    queued = [space.config(t.system_attrs["fixed_params"], default) for t in study.get_trials(deepcopy=False)]
    assert queued == fastest and all(s.startswith("model (") for s in sources), sources
    assert model_picks(problem, "cpu", pallas, space, default, ("fwd",), [default]) == []
    scan = registry.get("scan")
    scan_default = scan.default_config(problem.shapes, problem.spec)
    assert model_picks(problem, "TPU v5 lite", scan, scan.space(problem.shapes, problem.spec), scan_default, ("fwd",),
                       [scan_default]) == []
    exchange = registry.get("all_to_all_pallas_tpu")  # the model times the Pallas kernel inside it too
    shapes = registry.tile_shapes(exchange, problem.shapes, problem.ring_size)
    exchange_default = exchange.default_config(shapes, problem.spec)
    picks = model_picks(problem, "TPU v5 lite", exchange, exchange.space(shapes, problem.spec), exchange_default,
                        ("fwd",), [exchange_default])
    assert len(picks) == 2 and all(source.startswith("model (") for _, source in picks), picks


def test_a_packed_problem_warms_from_packed_neighbours_before_unpacked_ones_of_its_size():
    """Packed documents want short tiles: for a packed problem the packed neighbour four times as long is
    nearer than the unpacked one of the same size, and for the unpacked problem it is the other way round."""
    from tuner.cache.lookup import PACKING_APART, neighbours

    scan = registry.get("scan")
    kind = jax.devices()[0].device_kind
    versions = registry.versions(scan)
    packed = Problem(batch=1, seq_len=256, heads=4, kv_heads=2, head_dim=16, causal=True, segments=4, ring_size=2)
    unpacked = dataclasses.replace(packed, segments=0)
    longer = dataclasses.replace(packed, seq_len=1024)
    rows = {}
    for name, problem in (("unpacked", unpacked), ("longer packed", longer)):
        key = registry.problem_key(problem, "scan", kind)
        rows[name] = make_row(key, scan.default_config(problem.shapes, problem.spec), versions=versions,
                              tool_version="test", objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0,
                              trials_run=1, trials_pruned=0, study=name)

    def ranked(problem: Problem, candidates: list[str]) -> list[tuple[float, str]]:
        key = registry.problem_key(problem, "scan", kind)
        found = neighbours(lambda sql, params: [rows[c] for c in candidates], key, versions, 10)
        return [(distance, row["study"]) for distance, row in found]

    assert ranked(packed, ["unpacked", "longer packed"]) == [(4.0, "longer packed"), (1.0 + PACKING_APART, "unpacked")]
    assert ranked(dataclasses.replace(unpacked, seq_len=1024), ["unpacked", "longer packed"]) == [
        (4.0, "unpacked"), (1.0 + PACKING_APART, "longer packed")]
