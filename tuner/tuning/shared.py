"""What the workers of a study agree on beyond optuna's own tables, in the study's storage.

Optuna's RDB storage shares the trials. Three small tables beside them, in the same database, make
the rest a single decision that every worker sees:

- `ring_tuner_configs`: which trial times which config. A worker claims a config before it compiles
  it; the claim is a primary key, so two workers never time one config at the same time, and a
  config that was timed is not timed again. A claim whose trial was killed (failed without a reason)
  can be taken over once, by the retry of that trial or by a later sample.
- `ring_tuner_winners`: the winner of a study, decided once per trial total. The first worker to
  insert it wins; every worker then writes that same row to its own cache. A decision made on more
  trials (a search run again with a larger `--trials`) replaces one made on fewer.
- `ring_tuner_problems`: which worker took which problem of `tuner search --from`, so that a fleet
  divides the problems instead of all joining the first.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import time
from typing import Any

import optuna
import sqlalchemy
from sqlalchemy import Column, Integer, MetaData, String, Table, Text

_METADATA = MetaData()
CONFIGS = Table("ring_tuner_configs", _METADATA,
                Column("study", String(255), primary_key=True),
                Column("config", String(64), primary_key=True),  # sha256 of the params, as JSON
                Column("trial", Integer, nullable=False))  # the trial's number in the study
WINNERS = Table("ring_tuner_winners", _METADATA,
                Column("study", String(255), primary_key=True),
                Column("decision", Text, nullable=False),
                Column("trials", Integer, nullable=False),  # the counted trials it was decided on
                Column("worker", String(255), nullable=False),
                Column("decided_at", String(32), nullable=False))
PROBLEMS = Table("ring_tuner_problems", _METADATA,
                 Column("study", String(255), primary_key=True),
                 Column("worker", String(255), nullable=False),
                 Column("claimed_at", String(32), nullable=False))


def worker_name() -> str:
    """This process as the tables name it: `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def config_digest(params: dict[str, Any]) -> str:
    """The claim key of a trial's params (order-free)."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()


class Shared:
    """The three tables in the database of `storage`."""

    def __init__(self, storage: optuna.storages.RDBStorage):
        self.storage = storage
        self.engine: sqlalchemy.engine.Engine = storage.engine
        for attempt in range(3):
            try:
                _METADATA.create_all(self.engine, checkfirst=True)
                break
            except sqlalchemy.exc.DBAPIError:
                # Workers starting together race to create the tables: a worker that checked before
                # another created them fails to create them (PostgreSQL: a unique violation, SQLite:
                # "table ... already exists"). Checking again then finds them.
                if attempt == 2:
                    raise
                time.sleep(0.1 * (attempt + 1))

    def _insert(self, table: Table, **values: Any) -> bool:
        """Insert one row; False when its primary key is taken."""
        try:
            with self.engine.begin() as db:
                db.execute(table.insert().values(**values))
            return True
        except sqlalchemy.exc.IntegrityError:
            return False

    # -- configs -----------------------------------------------------------------------------------

    def claim_config(self, study: str, params: dict[str, Any], number: int, trials: optuna.Study
                     ) -> optuna.trial.FrozenTrial | None:
        """Claim `params` for trial `number` of `trials`; None when it is now this trial's, else the trial
        that holds it (running, or finished and counted). A claim whose trial was killed is taken over,
        unless that trial was itself the retry of a killed one: a config that kills two workers is not
        tried a third time."""
        digest = config_digest(params)
        if self._insert(CONFIGS, study=study, config=digest, trial=number):
            return None
        where = (CONFIGS.c.study == study) & (CONFIGS.c.config == digest)
        with self.engine.begin() as db:
            held_by = db.execute(sqlalchemy.select(CONFIGS.c.trial).where(where)).scalar_one()
        if held_by == number:
            return None
        holder = next(t for t in trials.get_trials(deepcopy=False) if t.number == held_by)
        killed = holder.state == optuna.trial.TrialState.FAIL and "failure" not in holder.user_attrs
        if not killed or "failed_trial" in holder.system_attrs:
            return holder
        with self.engine.begin() as db:
            taken = db.execute(CONFIGS.update().where(where & (CONFIGS.c.trial == held_by))
                               .values(trial=number)).rowcount
        return None if taken == 1 else holder

    def release_config(self, study: str, params: dict[str, Any], number: int) -> None:
        """Give a config back (its trial was interrupted), if trial `number` still holds it."""
        with self.engine.begin() as db:
            db.execute(CONFIGS.delete().where((CONFIGS.c.study == study) & (CONFIGS.c.trial == number)
                                              & (CONFIGS.c.config == config_digest(params))))

    def claimed(self, study: str) -> set[str]:
        """The digests of the configs the trials of `study` hold."""
        with self.engine.begin() as db:
            return set(db.execute(sqlalchemy.select(CONFIGS.c.config).where(CONFIGS.c.study == study)).scalars())

    # -- winners -----------------------------------------------------------------------------------

    def winner(self, study: str) -> dict[str, Any] | None:
        """The decided winner of `study` (`decide`'s dict, with `trials`, `worker` and `decided_at`), or
        None."""
        with self.engine.begin() as db:
            found = db.execute(sqlalchemy.select(WINNERS).where(WINNERS.c.study == study)).mappings().first()
        if found is None:
            return None
        return {**json.loads(found["decision"]), "trials": found["trials"], "worker": found["worker"],
                "decided_at": found["decided_at"]}

    def decide(self, study: str, decision: dict[str, Any], trials: int) -> dict[str, Any]:
        """Record `decision`, made on `trials` counted trials, as the winner of `study` unless one made
        on as many trials or more is recorded; returns the one recorded."""
        values = dict(decision=json.dumps(decision, sort_keys=True), trials=trials, worker=worker_name(),
                      decided_at=_now())
        if not self._insert(WINNERS, study=study, **values):
            with self.engine.begin() as db:
                db.execute(WINNERS.update().where((WINNERS.c.study == study) & (WINNERS.c.trials < trials))
                           .values(**values))
        found = self.winner(study)
        assert found is not None  # inserted now, or by another worker before
        return found

    # -- problems ----------------------------------------------------------------------------------

    def claim_problem(self, study: str) -> bool:
        """Take the problem whose study is `study`; False when another worker took it first."""
        return self._insert(PROBLEMS, study=study, worker=worker_name(), claimed_at=_now())


__all__ = ["CONFIGS", "PROBLEMS", "WINNERS", "Shared", "config_digest", "worker_name"]
