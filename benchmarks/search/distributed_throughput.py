"""Trial throughput of one study shared by 1, 2 and 4 workers, and what the storage costs per trial.

    python benchmarks/search/distributed_throughput.py [--workers 1,2,4] [--trials 12]

Each run starts W `tuner search` processes (their own caches, as on separate hosts) on one fresh study
of `--trials` trials of a small CPU problem (fwd+bwd), and times the whole run, from the first start to
the last exit. From the study it reads, per worker, the time inside trials (optuna's start and
completion stamps) and the gaps between one trial's completion and the worker's next start: that gap
is what the storage and the sampler take per trial (asking, telling, the claims and the heartbeat
checks). The same single-worker run on SQLite (the default storage) is the reference.

A throwaway PostgreSQL server is started as the tests start it (`tests/postgres.py`), with a fresh
database per run. Writes JSON to `benchmarks/search/results/distributed_throughput-<cores>cpu-<date>.json` and
prints a table. On a machine with fewer cores than workers, the workers share the cores: the
throughput then measures the storage's overhead and the contention, not the scaling a cluster gets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(ROOT))

from tests import postgres  # noqa: E402 - the throwaway server of the tests
from tuner.tuning.study import counted  # noqa: E402

PROBLEM = ["--seq-len", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--ring-size", "2",
           "--runs", "1"]


def run(url: str, workers: int, trials: int, folder: Path) -> dict:
    """One study of `trials` shared by `workers` processes at `url`: wall time and per-trial figures."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "TUNER_DB")}
    started = time.perf_counter()
    procs = []
    for i in range(workers):
        home = folder / f"w{workers}-{i}"
        home.mkdir(parents=True)
        procs.append(subprocess.Popen([sys.executable, "-m", "tuner.cli", "search", "--device", "cpu", *PROBLEM,
                                       "--trials", str(trials), "--storage", url],
                                      env={**env, "TUNER_HOME": str(home)}, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    failures = [p.communicate()[1][-2000:] for p in procs if p.wait() != 0]
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"a worker failed:\n{failures[0]}")
    (summary,) = optuna.get_all_study_summaries(url)
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    done = [t for t in study.get_trials() if t.datetime_start and t.datetime_complete]
    inside = [(t.datetime_complete - t.datetime_start).total_seconds() for t in done if counted(t)]
    gaps = []
    for worker in {t.user_attrs.get("worker") for t in done}:
        mine = sorted((t for t in done if t.user_attrs.get("worker") == worker), key=lambda t: t.datetime_start)
        gaps += [(b.datetime_start - a.datetime_complete).total_seconds() for a, b in zip(mine, mine[1:])]
    return {"workers": workers, "trials": sum(counted(t) for t in done), "wall_s": wall,
            "trials_per_min": 60 * sum(counted(t) for t in done) / wall,
            "trial_median_s": statistics.median(inside), "between_trials_median_s": statistics.median(gaps),
            "between_trials_max_s": max(gaps), "uncounted": sum(not counted(t) for t in done)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--trials", type=int, default=12)
    options = parser.parse_args()
    missing = postgres.missing()
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    server = postgres.Server().start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            rows.append({"storage": "sqlite", **run(f"sqlite:///{folder / 'ref.sqlite'}", 1, options.trials,
                                                     folder / "sqlite")})
            for number, workers in enumerate(int(w) for w in options.workers.split(",")):
                url = server.create(f"throughput{number}")
                rows.append({"storage": "postgresql", **run(url, workers, options.trials, folder / f"pg{number}")})
                print(rows[-1], file=sys.stderr)
    finally:
        server.destroy()
    header = ["storage", "workers", "trials", "wall_s", "trials_per_min", "trial_median_s", "between_trials_median_s",
              "between_trials_max_s", "uncounted"]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[h]:.2f}" if isinstance(row[h], float) else str(row[h]) for h in header))
    out = RESULTS / f"distributed_throughput-{os.cpu_count()}cpu-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "cores": os.cpu_count(), "problem": PROBLEM,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
