"""Multi-host JAX: 2 processes joined by `jax.distributed.initialize` on the CPU, 2 devices each.

Multi-host JAX is the distributed engine users already run. The worker (`tests/multiprocess_worker.py`)
runs the ring, all_to_all, all_gather, hybrid and the loader over all 4 devices, so their collectives
cross the process boundary, and process 0 writes their errors against the float64 dense reference. The
loader runs once more with cache files that disagree between the processes: both must run process 0's
decision, and neither may hang (the timeout below).
Both processes run once per session (module fixture); each strategy is checked by its own case.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240  # a hung collective must fail the test, not hang CI
FWD_TOL, GRAD_TOL = 1e-5, 1e-4
FORWARD = ("out", "lse")
GRADIENTS = ("dq", "dk", "dv")


def free_port() -> int:
    """A TCP port nothing listens on now, for the coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker_env(process_id: int, home: Path) -> dict[str, str]:
    """The environment of one worker: the CPU platform with 2 devices (any inherited device count replaced)
    and its own `TUNER_HOME`, so the two processes never share a cache file."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["TUNER_HOME"] = str(home / f"home{process_id}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process; kill the rest as soon as one fails (they would wait on its collectives) or
    when `timeout` runs out."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    """Run the 2 workers; the JSON process 0 wrote, and a report of both processes (exit codes, stderr)."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    result, port = tmp / "result.json", free_port()
    logs = [tmp / f"stderr{i}.txt" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.multiprocess_worker", str(port), str(i), str(result)], cwd=ROOT,
                env=worker_env(i, tmp), stdout=subprocess.DEVNULL, stderr=err))
    start = time.monotonic()
    wait_all(procs, TIMEOUT_S)
    elapsed = time.monotonic() - start
    report = "\n".join(
        f"--- process {i}: exit code {p.returncode} after {elapsed:.0f}s (timeout {TIMEOUT_S}s), stderr tail:\n"
        + "\n".join(log.read_text().splitlines()[-60:]) for i, (p, log) in enumerate(zip(procs, logs)))
    ok = all(p.returncode == 0 for p in procs) and result.exists()
    said = [json.loads(Path(f"{result}.{i}").read_text()) if ok else None for i in range(2)]
    return {"ok": ok, "report": report, "result": json.loads(result.read_text()) if ok else None, "said": said}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_to_all", "all_gather", "hybrid", "loader", "disagreeing caches"])
def test_two_processes_match_dense(outcome: dict, strategy: str) -> None:
    """Over 2 processes x 2 CPU devices, `strategy` (or the loader, forward only) matches float64 dense
    attention: 1e-5 on the output and lse, 1e-4 on dq, dk, dv."""
    assert outcome["ok"], f"the workers failed:\n{outcome['report']}"
    assert outcome["result"]["processes"] == 2 and outcome["result"]["devices"] == 4
    errors = outcome["result"]["errors"].get(strategy)
    assert errors is not None, f"the workers did not run {strategy}:\n{outcome['report']}"
    assert not isinstance(errors, str), f"{strategy} {errors}:\n{outcome['report']}"
    expected = FORWARD if strategy in ("loader", "disagreeing caches") else FORWARD + GRADIENTS
    assert set(errors) == set(expected), errors
    bad = {name: err for name, err in errors.items() if not err <= (FWD_TOL if name in FORWARD else GRAD_TOL)}
    assert not bad, f"{strategy}: errors above tolerance {bad} (all: {errors})"


@pytest.mark.slow
def test_processes_whose_caches_disagree_run_process_0s_decision(outcome: dict) -> None:
    """Process 0's cache holds forward tiles (8, 8) for the loader's problem, process 1's (8, 16): both run
    (8, 8), from the cache ("exact"), and process 1 says once that its own cache said otherwise."""
    assert outcome["ok"], f"the workers failed:\n{outcome['report']}"
    ran = [json.loads(said["said"][-1]) for said in outcome["said"]]
    assert [(r["ran"]["block_q"], r["ran"]["block_kv"], r["source"]) for r in ran] == [(8, 8, "exact")] * 2, ran
    assert outcome["said"][0]["said"][:-1] == []  # process 0 decides: nothing to say
    (warning,) = outcome["said"][1]["said"][:-1]
    assert "this process (1, on " in warning and "process 0 (on " in warning and "running process 0's" in warning, \
        warning


@pytest.mark.slow
def test_explain_on_every_process_says_what_runs_and_from_where(outcome: dict) -> None:
    """Before any process traces the call, process 1's explain() gives its own cache's (8, 16) and says that
    a traced call runs process 0's; once process 0 has traced it (published), and once process 1 has too
    (after), it gives process 0's (8, 8) and says whose it is. Process 0 explains its own decision throughout."""
    assert outcome["ok"], f"the workers failed:\n{outcome['report']}"
    explained = [json.loads(said["said"][-1])["explained"] for said in outcome["said"]]
    whens = ("before", "published", "after")
    tiles = [[(e[when]["fwd"]["block_q"], e[when]["fwd"]["block_kv"]) for when in whens] for e in explained]
    assert tiles == [[(8, 8)] * 3, [(8, 16), (8, 8), (8, 8)]], explained
    assert not any("process 0" in explained[0][when]["reason"] for when in whens), explained[0]
    assert "process 1 of 2: this process's cache's decision, which may not be what runs: a traced call runs " \
           "process 0's" in explained[1]["before"]["reason"], explained[1]
    for when in ("published", "after"):
        assert explained[1][when]["reason"].startswith("process 0's decision ("), explained[1]
        assert explained[1][when]["source"] == "exact", explained[1]
