"""The optuna study of a search: its storage, sampler, name, and the accounting of its trials.

One study per (problem key, objective, versions), in an optuna storage (by default a SQLite file beside
the cache), so a search resumes and several workers share it. `--trials` is the study's total: a trial
counts when it completes, is pruned or fails with a reason; an interrupted, surplus or killed trial
counts nowhere and gives its config back.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy

from tuner import registry
from tuner.semantics.problem import ProblemKey
from tuner.registry import Config

INTERRUPTED = "interrupted"
SURPLUS = "surplus"
DUPLICATE = "duplicate"  # a config another trial of the study holds: given back to the sampler
HEARTBEAT_S = 30  # seconds between a running trial's heartbeats
ORPHAN_S = 30.0  # seconds after which a running trial that never beat is failed (`fail_stale`)
RETRY_WAIT_S = 5.0  # the longest a starting trial waits for the retry of a trial failed as stale just now
# Running trials of a study without a heartbeat row, started before a time (optuna's RDB schema).
_ORPHANS = sqlalchemy.text(
    "SELECT t.trial_id FROM trials t LEFT JOIN trial_heartbeats h ON h.trial_id = t.trial_id "
    "WHERE t.study_id = :study AND t.state = 'RUNNING' AND h.trial_id IS NULL AND t.datetime_start < :before")


def default_storage(db_path: Path) -> str:
    """The optuna storage beside the cache: `<cache stem>.studies.sqlite`."""
    return f"sqlite:///{db_path.parent / (db_path.stem + '.studies.sqlite')}"


DRIVER_HINT = "pip install 'ring-tuner[distributed]'"  # psycopg 3 (PostgreSQL) and optuna-dashboard


def check_driver(url: str) -> None:
    """`ImportError` saying what to install when `url` needs a database driver that is missing."""
    try:
        sqlalchemy.engine.make_url(url).get_dialect().import_dbapi()
    except ImportError as error:
        name = error.name or str(error)
        where = url.split("@")[-1]
        if name == "psycopg":
            raise ImportError(f"storage {where!r} needs the database driver psycopg: {DRIVER_HINT}") from None
        raise ImportError(f"storage {where!r} needs the database driver {name}: pip install {name}, or "
                          f"{DRIVER_HINT} and write the URL as postgresql+psycopg://...") from None


def open_storage(url: str, heartbeat: int = HEARTBEAT_S) -> optuna.storages.RDBStorage:
    """The optuna storage at `url`. Running trials beat every `heartbeat` seconds; one whose beat is
    `2 * heartbeat` old belonged to a dead worker: it is failed, and its config queued once more (a
    retry), so a killed worker costs one trial. Connections are checked before use, so a restarted
    server costs a reconnect, not the study."""
    check_driver(url)
    engine_kwargs: dict = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine_kwargs["connect_args"] = {"timeout": 60}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):
        try:
            with warnings.catch_warnings():  # heartbeats and retries are experimental in optuna
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat, grace_period=2 * heartbeat,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
            if url.startswith("sqlite"):
                _write_locked_transactions(storage.engine)
            return storage
        except sqlalchemy.exc.SQLAlchemyError:
            # Workers that start together race to create a new storage's tables; the loser retries and
            # finds them made.
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def _write_locked_transactions(engine: sqlalchemy.engine.Engine) -> None:
    """Make every transaction on the SQLite `engine` take the database's write lock when it begins (`BEGIN
    IMMEDIATE`). SQLite's default transaction reads without the lock, so two workers, or two trials in
    flight, could both read a queued trial as waiting and both run it (optuna's row lock, `SELECT ... FOR
    UPDATE`, is a no-op on SQLite); the one that reported second then failed the search."""

    @sqlalchemy.event.listens_for(engine, "connect")
    def connect(connection, record) -> None:
        connection.isolation_level = None  # the driver leaves BEGIN to SQLAlchemy (below)

    @sqlalchemy.event.listens_for(engine, "begin")
    def begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners are dropped


def make_sampler(sampler: str, seed: int, trials: int) -> optuna.samplers.BaseSampler:
    """optuna's sampler called `sampler` ("grid" samples at random from the points queued for it). TPE
    counts the running trials (of this worker's other threads, or of other workers) as bad, so trials
    asked at once spread out."""
    if sampler == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                              n_startup_trials=max(3, min(10, trials // 3)))
    if sampler == "gp":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("scipy") is None:
            raise ValueError("--sampler gp needs torch and scipy (pip install torch scipy); "
                             "or use --sampler tpe") from None
        return optuna.samplers.GPSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # random; grid enqueues its points


def counted(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a finished trial counts towards `--trials`: complete, pruned or failed, but not
    interrupted, not surplus and not killed (optuna's heartbeat fails the trial of a worker that died
    mid-trial once another worker starts one; that, or a crash of the search itself, is the one
    failure without a reason, and its point is run again)."""
    if trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
        return True
    return trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs.get("failure") not in (
        None, INTERRUPTED, SURPLUS, DUPLICATE)


def finished(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The finished trials that count towards `--trials`."""
    return [t for t in trials if counted(t)]


def taken(trials: list[optuna.trial.FrozenTrial]) -> int:
    """How many of the study's trials count towards `--trials` or are running (and may yet count)."""
    return sum(t.state == optuna.trial.TrialState.RUNNING or counted(t) for t in trials)


def surplus(trial: optuna.Trial, total: int) -> bool:
    """Whether `trial`, just started, is one too many: the trials numbered below it (optuna numbers a
    study's trials in the order they are created, atomically across workers) that count, run or wait to
    run already reach `total`. Running trials of a dead worker are not among them: optuna fails the
    trials whose heartbeat is stale before each trial starts. The retry of a killed trial stands in the
    killed trial's place, whatever its own number; a trial that starts between the kill being recorded
    and its retry being queued waits for the retry first (`await_retries`)."""
    trials = await_retries(trial.study, trial.number)
    below = [t for t in trials if t.number < trial.number]
    numbers = {t.number for t in below}
    stand_ins = [t for t in trials if t.number > trial.number and t.system_attrs.get("failed_trial") in numbers]
    return sum(not t.state.is_finished() or counted(t) for t in below + stand_ins) >= total


def await_retries(study: optuna.Study, number: int, patience: float = RETRY_WAIT_S
                  ) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, once every trial numbered below `number` that was failed as stale in the last
    `patience` seconds has its retry queued, or `patience` seconds from now.

    optuna fails a stale trial first and queues its retry a moment later. Two workers look for stale
    trials as each of their trials starts: the one that fails the trial queues the retry, the other
    finds the trial failed already and creates its next trial at once, numbered below the retry. Counted
    before the retry exists, that trial took the killed trial's place, the study reached its total,
    and the retry was left waiting, its config never run again."""
    deadline = time.monotonic() + patience
    while True:
        trials = study.get_trials(deepcopy=False)
        if time.monotonic() >= deadline or not _retry_due(trials, number, patience):
            return trials
        time.sleep(0.05)


def _retry_due(trials: list[optuna.trial.FrozenTrial], number: int, patience: float) -> bool:
    """Whether a trial numbered below `number` was failed as stale in the last `patience` seconds (failed
    without a reason, `counted`) and has no retry yet. A retry is not retried again (`open_storage`)."""
    retried = {t.system_attrs.get("failed_trial") for t in trials}
    recently = datetime.datetime.now() - datetime.timedelta(seconds=patience)
    return any(t.number < number and t.state == optuna.trial.TrialState.FAIL and "failure" not in t.user_attrs
               and "failed_trial" not in t.system_attrs and t.number not in retried
               and t.datetime_complete is not None and t.datetime_complete > recently for t in trials)


def fail_stale(study: optuna.Study, storage: optuna.storages.RDBStorage, orphan_after: float = ORPHAN_S) -> None:
    """Fail the running trials whose heartbeat is stale (their worker died), so they count nowhere, and
    queue their retry; and so too the orphans, running trials that never beat, `orphan_after` seconds
    (at least two heartbeats) after they started.

    optuna's own check passes over a trial without a heartbeat. A worker that loses the storage after
    `study.ask` created its trial and before the trial's first beat (the sampler reads the storage in
    between) leaves such a trial running for ever, and the other workers would wait for it (after a
    restart of the server in CI, a worker hung with 8 of 9 trials counted, likely so)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
        interval = storage.get_heartbeat_interval()
        if interval is None:
            return
        started_before = datetime.datetime.now() - datetime.timedelta(seconds=max(orphan_after, 2 * interval))
        with storage.engine.connect() as db:
            orphans = db.execute(_ORPHANS, {"study": storage.get_study_id_from_name(study.study_name),
                                            "before": started_before}).scalars().all()
        retry = storage.get_heartbeat_stale_trial_callback()
        for trial_id in orphans:
            try:
                if not storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # finished meanwhile, or failed by another worker
            if retry is not None:
                retry(study, storage.get_trial(trial_id))


def enqueue(study: optuna.Study, configs: list[Config], space: registry.Space, parts: tuple[str, ...],
            source: str = "default") -> None:
    """Queue `configs` as the study's next trials, each saying where it came from (user attribute
    `source`), except those a trial already holds that waits, runs or counts (an interrupted, surplus or
    killed trial gives its config back)."""
    held = [t.system_attrs.get("fixed_params", t.params) for t in study.get_trials(deepcopy=False)
            if not t.state.is_finished() or counted(t)]
    for config in configs:
        params = space.params(config, parts)
        if params not in held:
            study.enqueue_trial(params, user_attrs={"source": source})
            held.append(params)


def study_name(key: ProblemKey, objective: str, versions: dict[str, str], drawn: str | None = None) -> str:
    """One study per problem key, objective and versions (a code change starts a fresh study), and per
    packing the rows are `drawn` from where the key names none (trials timed on other rows do not mix)."""
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]
    rows = "" if drawn is None else "-drawn-" + hashlib.sha256(drawn.encode()).hexdigest()[:8]
    return f"ring-{key.digest}-{objective}-{digest}{rows}"


__all__ = ["DRIVER_HINT", "DUPLICATE", "HEARTBEAT_S", "INTERRUPTED", "RETRY_WAIT_S", "SURPLUS",
           "await_retries", "check_driver", "counted",
           "default_storage", "enqueue", "fail_stale", "finished", "make_sampler", "open_storage", "study_name",
           "surplus", "taken"]
