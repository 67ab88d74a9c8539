"""What workers of one study share (`tuner.tuning.shared`), on a SQLite storage: claimed configs, the decided
winner and claimed problems. `tests/test_distributed.py` runs the same through real workers on PostgreSQL."""

from __future__ import annotations

import optuna
import pytest
import sqlalchemy

from tuner.tuning.shared import PROBLEMS, Shared, worker_name
from tuner.tuning.study import open_storage

PARAMS = {"fwd.block_q": 64, "fwd.block_kv": 32}
pytestmark = pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")


@pytest.fixture
def study(tmp_path) -> tuple[optuna.Study, Shared]:
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.sqlite'}", heartbeat=1)
    return optuna.create_study(study_name="s", storage=storage), Shared(storage)


def test_a_config_is_held_by_one_trial(study):
    """The first trial to claim a config holds it; a second trial, running or later, gets the holder back;
    an interrupted trial gives its config back."""
    s, shared = study
    first, second = s.ask(), s.ask()
    assert shared.claim_config("s", PARAMS, first.number, s) is None
    assert shared.claim_config("s", PARAMS, first.number, s) is None  # claiming again is harmless
    assert shared.claim_config("s", PARAMS, second.number, s).number == first.number
    assert shared.claim_config("s", {**PARAMS, "fwd.block_kv": 64}, second.number, s) is None
    shared.release_config("s", PARAMS, first.number)
    third = s.ask()
    assert shared.claim_config("s", PARAMS, third.number, s) is None


def test_a_killed_trials_config_is_taken_over_once(study):
    """A trial that failed without a reason (its worker was killed) leaves its config to the next trial;
    when that trial was itself the retry of a killed one, the config stays held."""
    s, shared = study
    killed = s.ask()
    shared.claim_config("s", PARAMS, killed.number, s)
    s.tell(killed, state=optuna.trial.TrialState.FAIL)
    retry = s.ask()
    s._storage.set_trial_system_attr(retry._trial_id, "failed_trial", killed.number)
    assert shared.claim_config("s", PARAMS, retry.number, s) is None
    s.tell(retry, state=optuna.trial.TrialState.FAIL)  # killed again
    assert shared.claim_config("s", PARAMS, s.ask().number, s).number == retry.number


def test_the_winner_is_decided_once_per_trial_total(study):
    """The first decision on a total of trials stands; one made on more trials replaces it, one on fewer
    does not."""
    _, shared = study
    assert shared.winner("s") is None
    first = shared.decide("s", {"row": {"speedup": 1.5}, "covered": False}, trials=4)
    again = shared.decide("s", {"row": {"speedup": 9.0}, "covered": False}, trials=4)
    assert again == first and first["row"]["speedup"] == 1.5 and first["trials"] == 4
    more = shared.decide("s", {"row": {"speedup": 2.0}, "covered": False}, trials=8)
    assert more["row"]["speedup"] == 2.0 and shared.winner("s") == more
    assert shared.decide("s", {"row": {"speedup": 7.0}, "covered": False}, trials=2) == more


def test_a_problem_is_taken_by_one_worker(study):
    _, shared = study
    assert shared.claim_problem("ring-a") and not shared.claim_problem("ring-a")
    assert shared.claim_problem("ring-b")
    with shared.engine.connect() as db:
        holders = dict(db.execute(sqlalchemy.select(PROBLEMS.c.study, PROBLEMS.c.worker)).all())
    assert holders == {"ring-a": worker_name(), "ring-b": worker_name()}


def test_workers_that_race_to_create_the_tables_both_open_them(tmp_path, monkeypatch):
    """A worker that checked for the tables before another created them fails to create them; it checks
    again instead of stopping (CI once lost a two-worker search to this on SQLite)."""
    storage = open_storage(f"sqlite:///{tmp_path / 'studies.sqlite'}", heartbeat=1)
    Shared(storage)  # the other worker created the tables
    dialect = storage.engine.dialect
    has_table = dialect.has_table
    missed = []

    def stale_check(connection, name, *args, **kwargs):
        if not missed:  # this worker's first check ran before the other worker's create
            missed.append(name)
            return False
        return has_table(connection, name, *args, **kwargs)

    monkeypatch.setattr(dialect, "has_table", stale_check)
    shared = Shared(storage)
    assert missed, "the race was not simulated: create_all did not ask whether a table exists"
    assert shared.claim_config("s", PARAMS, 0, optuna.create_study(study_name="s", storage=storage)) is None
