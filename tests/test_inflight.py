"""Trials in flight share one device: compiles run side by side, device work runs alone, timing apart from
every compile (on the CPU, a check too), the time split never counts a second twice, and a queued trial
is handed to one trial in flight only."""

import collections
import threading
import time

import optuna
import pytest

from tuner.semantics.problem import Problem
from tuner.tuning.inflight import DeviceGate
from tuner.tuning.search import SearchOptions, search
from tuner.tuning.study import default_storage, open_storage

STEP_S = 0.2  # long beside a thread's start-up, on a loaded machine too


def run_side_by_side(gate: DeviceGate, jobs: list[str]) -> dict[str, tuple[float, float]]:
    """Start one thread per job ("compile N", "check N" or "timing N"), all at once; each holds the gate for
    STEP_S. Returns each job's (start, end) inside the gate."""
    spans: dict[str, tuple[float, float]] = {}
    barrier = threading.Barrier(len(jobs))

    def work(job: str) -> None:
        barrier.wait()
        gate.begin()
        with gate.compile() if job.startswith("compile") else gate.device(job.split()[0]):
            start = time.perf_counter()
            time.sleep(STEP_S)
            spans[job] = start, time.perf_counter()

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return spans


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("host_is_device", [True, False])
def test_device_work_runs_alone_timing_apart_from_compiles_and_compiles_side_by_side(host_is_device):
    gate = DeviceGate(host_is_device=host_is_device)
    compiles = run_side_by_side(gate, ["compile 1", "compile 2"])
    assert overlap(compiles["compile 1"], compiles["compile 2"])
    assert gate.compiling == pytest.approx(2 * STEP_S, rel=0.5)  # every compile's own seconds
    assert gate.spent["compile"] < gate.compiling  # a second of two compiles at once is counted once

    gate = DeviceGate(host_is_device=host_is_device)
    spans = run_side_by_side(gate, ["compile 1", "compile 2", "check 1"])
    beside = any(overlap(spans[c], spans["check 1"]) for c in ("compile 1", "compile 2"))
    assert beside is not host_is_device  # on the CPU no compile runs beside a check; elsewhere they do

    gate = DeviceGate(host_is_device=host_is_device)
    started = time.perf_counter()
    spans = run_side_by_side(gate, ["compile 1", "compile 2", "compile 3", "timing 1", "timing 2"])
    wall = time.perf_counter() - started
    assert not overlap(spans["timing 1"], spans["timing 2"])
    compiles = [spans[f"compile {i}"] for i in (1, 2, 3)]
    assert not any(overlap(c, spans[t]) for c in compiles for t in ("timing 1", "timing 2"))

    assert set(gate.spent) <= {"compile", "timing"}
    assert gate.spent["timing"] == pytest.approx(2 * STEP_S, rel=0.5)
    assert sum(gate.spent.values()) <= wall
    assert gate.compiling == pytest.approx(3 * STEP_S, rel=0.5)


def test_a_threads_waits_for_the_gate_are_counted_apart():
    gate = DeviceGate(host_is_device=True)
    held, waited = threading.Event(), []

    def hold() -> None:
        with gate.device("timing"):
            held.set()
            time.sleep(STEP_S)

    def wait_then_compile() -> None:
        gate.begin()
        held.wait()
        with gate.compile():
            pass
        waited.append(gate.waited())

    threads = [threading.Thread(target=hold), threading.Thread(target=wait_then_compile)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert STEP_S / 2 < waited[0] < 10 * STEP_S
    gate.begin()
    assert gate.waited() == 0.0


def test_a_search_with_a_trial_compiling_ahead_overlaps_trials_and_finds_the_same_winner(tmp_path):
    """Two trials in flight: the study's trials overlap in time, every trial counts once, and the winner is
    a verified config; the time split still adds up to at most the run's wall time."""
    problem = Problem(batch=1, seq_len=256, heads=2, kv_heads=1, head_dim=16, causal=True, ring_size=2)
    db = tmp_path / "t.sqlite"
    result = search(problem, device="cpu", backend="scan", db=db,
                    options=SearchOptions(objective="fwd", trials=4, sampler="grid", runs=1, final_runs=1,
                                          compile_ahead=1))
    trials = [t for t in optuna.load_study(study_name=result.study, storage=default_storage(db)).trials
              if t.state == optuna.trial.TrialState.COMPLETE]
    assert result.trials_run == 4 and len(trials) >= 2
    spans = [(t.datetime_start, t.datetime_complete) for t in trials]
    assert any(overlap(a, b) for a in spans for b in spans if a is not b)
    assert sum(result.spent.values()) <= result.seconds
    assert result.best.seconds > 0


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_queued_trial_goes_to_one_of_the_askers_at_once(tmp_path):
    """Four threads ask a SQLite study for its 40 queued trials at once: each trial is handed out once. With
    SQLite's default transactions, several were handed to two threads (8 of 40 in one run), and the second
    to report its result failed the search."""
    study = optuna.create_study(storage=open_storage(f"sqlite:///{tmp_path}/s.sqlite"), study_name="queued")
    for x in range(40):
        study.enqueue_trial({"x": float(x)})
    asked: collections.Counter[int] = collections.Counter()

    def ask() -> None:
        for _ in range(10):
            asked[study.ask({"x": optuna.distributions.FloatDistribution(0, 100)}).number] += 1

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(asked) == list(range(40)) and set(asked.values()) == {1}
