"""The autotuner (DESIGN section 7): an optuna study per problem, candidates verified before timed.

One study per (problem key, objective, versions). Its first trial is the backend's heuristic default.
Every trial:

1. samples forward and/or backward params from the backend's `SearchSpace` (the objective decides
   which; the others stay at the default);
2. drops points the backend's constraints rule out, *before compiling* (a pruned trial, with reason);
3. compiles (compile seconds kept apart from run time);
4. checks the candidate against the scan backend at float32 on the same random inputs -- forward,
   and the gradients for backward objectives; a wrong candidate is a failed trial with its error;
5. times it interleaved with the default (the reference measured in the same run) on fresh non-zero
   inputs; its value is its time relative to the default's, so a noisy machine hurts every trial alike.

Compile errors, out-of-memory, wrong results and trials over `trial_timeout` are failed trials with a
reason, and the search goes on. Forward and backward params act on separate passes, so the best
forward of any trial and the best backward of any trial are also combined into one candidate. At the
end the best few candidates, the combination and the default are re-timed interleaved and the winner
is written to the cache. Studies live in an optuna storage (by default a SQLite file beside the
cache): run the same search again and it resumes; point several processes or hosts at one storage
and they share the study (`tuner.tuning.shared`). `trials` is then the study's total, not each
worker's: a trial that starts once the trials numbered below it reach the total is surplus (it stops
its worker and is counted nowhere). A trial claims its config before compiling it, so no config is
timed twice, at once or later: a sampled config another trial holds is given back and the next
untried point of the grid queued instead. A worker with nothing left to run waits for the others'
trials, re-runs the config of a worker that died (its heartbeat went stale), and the first worker to
re-time the candidates decides the winner for all: every worker writes that row to its own cache.
A storage that stops answering is retried with back-off for `options.reconnect` seconds, then the
search stops and writes nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import optuna

from tuner.support.version import __version__
from tuner import registry
from tuner.cache import Cache, make_row
from tuner.semantics.problem import DEVICES, Problem, ProblemKey
from tuner.tuning.shared import Shared, worker_name
from tuner.tuning.options import SearchOptions
from tuner.tuning.study import (counted, default_storage, enqueue, finished, make_sampler, open_storage,
                                study_name, taken)
from tuner.tuning.trials import Measured, Trials, near_best, retime, trial_speedups
from tuner.tuning.warm import warm_start
from tuner.tuning.workers import quiet_heartbeats, reconnecting, run_until_decided


@dataclass
class SearchResult:
    """What a search found, measured and stored. `stored` is False when the cache kept the row it
    already held for the key (same objective and versions, an equal or higher speedup over the
    default: typically another worker's of the same study); `stored_speedup` is the speedup of the row
    the cache holds afterwards, this search's or that one."""

    problem: Problem
    backend: str  # the implementation searched
    device_kind: str
    key: ProblemKey
    objective: str
    study: str
    storage: str
    default: Measured
    best: Measured
    trials_run: int
    trials_pruned: int
    failed: dict[str, int]
    db_path: Path
    seconds: float
    new_trials: int
    stored: bool
    stored_speedup: float
    failures: list[str] = field(default_factory=list)
    decided_by: str = ""  # the worker whose re-timing decided the study's winner (`host:pid`)
    spent: dict[str, float] = field(default_factory=dict)  # this run's seconds compiling, checking, timing
    timed_out: bool = False  # `timeout` ended this run before the study counted its `trials`
    best_from: str = ""  # where the winner came from: "default", "trial N (its source)" or a combination
    trials_asked: int = 0  # the study's total, `SearchOptions.trials`
    ahead: float = 0.0  # seconds of compiling that ran beside other work (`SearchOptions.compile_ahead`)
    # the re-timed candidates, fastest first: (name, the speedup its trial measured or None, re-timed speedup)
    retimed: list[tuple[str, float | None, float]] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.default.seconds / self.best.seconds


def check_device(device: str) -> str:
    """The device kind of `device` ("cpu", "gpu" or "tpu") here; `ValueError` saying what is present."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    try:
        devices = jax.devices(device)
    except RuntimeError:
        present = sorted({d.platform for d in jax.devices()})
        hint = {"gpu": "install jax with CUDA (pip install 'jax[cuda12]') on a machine with an NVIDIA GPU",
                "tpu": "run on a TPU host with jax[tpu] installed, check the TPU kernels here with "
                       "--dry-run,"}.get(device, "")
        raise ValueError(f"--device {device}: no {device} device here (this machine has: "
                         f"{', '.join(present)}); {hint} or use --device {present[0]}") from None
    if jax.default_backend() != device:
        raise ValueError(f"--device {device}: jax's default backend is {jax.default_backend()}; set "
                         f"JAX_PLATFORMS={device} to tune on {device}")
    return devices[0].device_kind


def resolve_backend(name: str, problem: Problem, device: str, interpret: bool = False) -> registry.Implementation:
    """The implementation `name` ("auto": the device's preferred one that supports the problem),
    checked to run on `device`; a problem over two mesh axes (`a2a_size` > 1) takes an implementation over
    two ("auto": over the device's preferred kernel that can run it), any other an implementation over one."""
    axes = 1 if problem.group is None else 2
    if name != "auto" and registry.mesh_axes(registry.get(name)) != axes:
        raise ValueError(f"backend {name!r} with a2a_size={problem.a2a_size}: it runs over "
                         f"{registry.mesh_axes(registry.get(name))} mesh axis(es); a problem with a2a_size > 1 "
                         f"(--a2a-size) runs over a ring of ring_size / a2a_size positions of a2a_size devices each, "
                         f"on an implementation over two axes, any other on one over one axis")
    return registry.choose(name, problem.spec, jax.numpy.dtype(problem.dtype), problem.head_dim,
                           registry.Target(device, interpret), shapes=problem.shapes, ring_size=problem.ring_size,
                           group=problem.group)


def contenders(problem: Problem, device: str, backend: str = "auto", interpret: bool = False
               ) -> tuple[list[registry.Implementation], list[str]]:
    """What a search of `problem` with `backend` tunes on `device`, in order: the implementation it names;
    for "auto", the one auto runs with nothing measured, then each of the platform's rivals that can run the
    problem (`registry.contenders`: cudnn beside triton on a GPU), with why each rival that cannot was
    passed over. `ValueError` as `resolve_backend`."""
    if backend != "auto":
        return [resolve_backend(backend, problem, device, interpret)], []
    return registry.contenders(problem, registry.Target(device, interpret))


def search(
    problem: Problem,
    *,
    device: str = "cpu",
    backend: str = "auto",
    options: SearchOptions = SearchOptions(),
    db: str | Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> SearchResult:
    """Tune `problem` on `device` and write the winner to the cache at `db` (DESIGN section 7).

    `progress(done, total, status)` is called after every trial. Workers sharing the study run
    `options.trials` between them; each stores its winner unless the cache holds a better one (see
    `SearchResult.stored`). Raises `ValueError` for a device or backend that cannot run here,
    `KeyboardInterrupt` (after saving the study) when interrupted.
    """
    started = time.perf_counter()
    chosen, device_kind, key, versions, name = study_of(problem, device, backend, options)
    cache = Cache(db)
    storage_url = options.storage or default_storage(cache.path)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = open_storage(storage_url, options.heartbeat)
    study = optuna.create_study(study_name=name, storage=storage,
                                sampler=make_sampler(options.sampler, options.seed, options.trials),
                                direction="minimize", load_if_exists=True)
    for attr, value in (("problem", dataclasses.asdict(problem)), ("backend", chosen.name),
                        ("device_kind", device_kind), ("versions", versions)):
        study.set_user_attr(attr, value)

    shared = Shared(storage)
    decided = reconnecting(storage_url, lambda: shared.winner(name), options.reconnect)
    if decided is not None and (decided["trials"] >= options.trials or decided["covered"]):
        return _result(problem, chosen, device_kind, key, options, storage_url, study, cache, decided, started, 0,
                       None)

    state = Trials(problem, chosen, options, shared, name)
    enqueue(study, [state.default], state.space, state.parts)
    if options.warm_start:
        warm_start(study, cache, problem, key, versions, chosen, state.space, state.default, state.parts)
    if options.sampler == "grid":
        grid = [c for c in state.space.grid(state.default, state.parts) if c != state.default]
        enqueue(study, grid[:options.trials - 1], state.space, state.parts, source="grid")
    elif state.whole:  # the trials can walk the whole space: each point once, and none the constraints rule out
        enqueue(study, [c for c in state.pool if c != state.default], state.space, state.parts, source="grid")
    new_trials = 0

    def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        nonlocal new_trials
        new_trials += counted(trial)
        trials = study.get_trials(deepcopy=False)
        if progress is not None:
            done = finished(trials)
            best = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
            status = (f"best trial {1 / min(t.value for t in best):.2f}x speedup" if best else "no result yet")
            failed = sum(t.state == optuna.trial.TrialState.FAIL for t in done)
            progress(min(len(done), options.trials), options.trials,
                     f"{status}, {failed} failed" if failed else status)
        if taken(trials) >= options.trials:
            study.stop()

    # `timeout` is the trials' budget: it starts once the reference and the default are built (on a GPU
    # those compiles took 80 to 110 s, which a short budget would have spent before any trial).
    deadline = None if options.timeout is None else time.perf_counter() + options.timeout
    with quiet_heartbeats():
        decision = reconnecting(storage_url, lambda: run_until_decided(
            study, state.objective, after_trial, state.shared, options.trials, deadline, lambda: state.exhausted,
            state.in_flight), options.reconnect)
    if decision is None:  # this worker decides: re-time the best candidates of the whole study
        trials = finished(study.get_trials(deepcopy=False))
        counts = Counter(t.user_attrs["failure"] for t in trials if t.state == optuna.trial.TrialState.FAIL)
        pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in trials):
            covered = " (every config of the space was tried)" if state.exhausted else ""
            raise RuntimeError(f"no trial of study {name} completed ({len(trials)} finished{covered}: {pruned} "
                               f"pruned, failed {dict(counts)}); nothing was written to the cache")
        measured, failures = retime(state, trials)
        default = measured["default"]
        fastest = sorted(measured, key=lambda n: measured[n].seconds)  # the winner first
        winner = measured[fastest[0]]
        row = make_row(key, winner.config, versions=versions, tool_version=__version__,
                       objective=options.objective, best_s=winner.seconds, default_s=default.seconds,
                       speedup=default.seconds / winner.seconds, trials_run=len(trials), trials_pruned=pruned,
                       trials_failed=dict(counts), study=name,
                       near_best=near_best(state, trials, winner.config))
        speedups = trial_speedups(state, trials)
        retimed = [[n, speedups.get(measured[n].config), default.seconds / measured[n].seconds] for n in fastest]
        mine = {"row": row, "default": default.to_dict(), "best": winner.to_dict(), "failures": failures,
                "covered": state.exhausted, "best_from": fastest[0], "retimed": retimed}
        decision = reconnecting(storage_url, lambda: shared.decide(name, mine, len(trials)), options.reconnect)
    return _result(problem, chosen, device_kind, key, options, storage_url, study, cache, decision, started,
                   new_trials, state)


def _result(problem: Problem, chosen: registry.Implementation, device_kind: str, key: ProblemKey,
            options: SearchOptions, storage_url: str, study: optuna.Study, cache: Cache, decision: dict,
            started: float, new_trials: int, state: Trials | None) -> SearchResult:
    """Store the study's decided winner in `cache` (unless it holds a better row) and say what happened."""
    trials = finished(study.get_trials(deepcopy=False))
    counts = Counter(t.user_attrs["failure"] for t in trials if t.state == optuna.trial.TrialState.FAIL)
    row = decision["row"]
    held = cache.put_best(row)
    stored = all(held[f] == row[f] for f in ("measured_at", "speedup", "best_s", "fwd_params", "bwd_params"))
    default, best = (Measured.from_dict(decision[part], chosen.config_type) for part in ("default", "best"))
    return SearchResult(problem, chosen.name, device_kind, key, options.objective, study.study_name, storage_url,
                        default, best, len(trials), sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
                        dict(counts), cache.path, time.perf_counter() - started, new_trials, stored=stored,
                        stored_speedup=held["speedup"], failures=decision["failures"],
                        decided_by="" if decision["worker"] == worker_name() else decision["worker"],
                        spent={} if state is None else dict(state.spent),
                        ahead=0.0 if state is None else max(0.0, state.gate.compiling - state.spent["compile"]),
                        timed_out=options.timeout is not None and len(trials) < options.trials
                        and not decision["covered"], trials_asked=options.trials,
                        best_from=decision.get("best_from", ""),
                        retimed=[tuple(r) for r in decision.get("retimed", [])])


def study_of(problem: Problem, device: str, backend: str, options: SearchOptions
             ) -> tuple[registry.Implementation, str, ProblemKey, dict[str, str], str]:
    """What a search of `problem` tunes, and in which study: (implementation, device kind, key,
    versions, study name). `ValueError` for a device or backend that cannot run here."""
    device_kind = check_device(device)
    chosen = resolve_backend(backend, problem, device, options.interpret)
    versions = registry.versions(chosen)
    key = registry.problem_key(problem, chosen.name, device_kind)
    return chosen, device_kind, key, versions, study_name(key, options.objective, versions, problem.drawn)


__all__ = ["Measured", "SearchOptions", "SearchResult", "check_device", "contenders", "resolve_backend", "search",
           "study_of"]
