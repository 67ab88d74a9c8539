"""One worker's part of a shared study: run trials until the study can be decided, and outlive a
storage that stops answering for a while.

A study is decided when it counts its total of trials, when the search space is covered and no trial
runs, or when this run's time is up and it counts a trial (the default's, queued first, runs however
short the time). Until then a worker with nothing to start waits for the others'
running trials: one of them may die, and then its retry (queued by the heartbeat, see
`tuner.tuning.study.open_storage`) is this worker's to run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import optuna
import sqlalchemy

from tuner.support.tables import error_line
from tuner.tuning.shared import Shared
from tuner.tuning.study import fail_stale, finished, taken
from tuner.tuning.verify import TrialFailed

POLL_S = 1.0  # how often a worker with nothing to start looks at the others' trials
STORAGE_ERRORS = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                  optuna.exceptions.StorageInternalError)

T = TypeVar("T")


def run_until_decided(study: optuna.Study, objective: Callable[[optuna.Trial], float], after_trial: Callable,
                      shared: Shared, total: int, deadline: float | None, covered: Callable[[], bool],
                      in_flight: int = 1) -> dict[str, Any] | None:
    """Run trials of `study`, `in_flight` at once, until it may be decided (module docstring); `covered()`
    says whether this worker found the space covered. Returns the winner another worker decided on `total` trials or
    more, or on the whole space; else None: this worker decides."""
    while True:
        fail_stale(study, shared.storage)
        trials = study.get_trials(deepcopy=False)
        decided = shared.winner(study.study_name)
        if decided is not None and (decided["trials"] >= total or decided["covered"]):
            return decided
        left = None if deadline is None else deadline - time.perf_counter()
        running = any(not t.state.is_finished() for t in trials)
        done = finished(trials)
        over = left is not None and left <= 0
        if len(done) >= total or (over and done) or (covered() and not running):
            return None
        waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)
        if waiting or (not covered() and taken(trials) < total):
            try:  # past the deadline with nothing counted, one trial (the default, queued first) still runs
                study.optimize(objective, n_trials=1 if over else None, timeout=None if over else left,
                               n_jobs=1 if over else in_flight, catch=(TrialFailed,), callbacks=[after_trial],
                               gc_after_trial=False)
            except Exception as error:
                if not _failed_elsewhere(error):
                    raise
        else:
            time.sleep(POLL_S if left is None or over else min(POLL_S, left))  # over: others' trials run


def reconnecting(url: str, step: Callable[[], T], patience: float) -> T:
    """`step()`, retried with back-off (1 s, doubling to 16 s) while the storage at `url` does not answer,
    for at most `patience` seconds; then `RuntimeError` saying that nothing was written."""
    first, pause = None, 1.0
    while True:
        try:
            return step()
        except Exception as error:
            if not _lost_storage(error):
                raise
            first = first or time.monotonic()
            if time.monotonic() - first > patience:
                raise RuntimeError(f"lost the study storage {url.split('@')[-1]} for {patience:.0f} s "
                                   f"({error_line(_first_cause(error))}); nothing was written to the cache: run "
                                   f"the same command again to resume") from None
            time.sleep(min(pause, max(0.0, first + patience - time.monotonic()) + 0.01))
            pause = min(2 * pause, 16.0)


@contextlib.contextmanager
def quiet_heartbeats() -> Iterator[None]:
    """While inside, a background thread (optuna's heartbeat) that fails because the storage does not
    answer ends without printing its traceback: the worker itself says what happened, in one line."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not _lost_storage(args.exc_value):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def _failed_elsewhere(error: BaseException) -> bool:
    """Whether optuna refused to record this worker's result because its trial had been ended meanwhile:
    another worker failed it as stale while this one could not reach the storage to beat its heartbeat
    (and queued its retry). Optuna raises a ValueError, or, when the objective had returned, an assertion
    error while handling it. The result is dropped, as a killed worker's would be, and the worker goes on."""
    return _in_chain(error, lambda e: isinstance(e, ValueError) and str(e).startswith("Cannot tell a "))


def _first_cause(error: BaseException) -> BaseException:
    """The error at the bottom of `error`'s chain: the driver's own, which says what went wrong."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _lost_storage(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or while handling, is the storage not answering
    (optuna can raise another error while it handles the storage's, when its cleanup reads the storage
    too)."""
    return _in_chain(error, lambda e: isinstance(e, STORAGE_ERRORS))


def _in_chain(error: BaseException | None, matches: Callable[[BaseException], bool]) -> bool:
    """Whether `error`, or an error it was raised from or while handling, `matches`."""
    while error is not None:
        if matches(error):
            return True
        error = error.__cause__ or error.__context__
    return False


__all__ = ["POLL_S", "STORAGE_ERRORS", "quiet_heartbeats", "reconnecting", "run_until_decided"]
