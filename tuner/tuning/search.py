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
A storage that stops answering is retried with back-off for `RECONNECT_S`, then the search stops
and writes nothing.
"""

from __future__ import annotations

import dataclasses
import random
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
from tuner.support.checks import check_int
from tuner.semantics.problem import DEVICES, OBJECTIVES, SAMPLERS, Problem, ProblemKey
from tuner.registry import Config
from tuner.tuning.shared import Shared, config_digest, worker_name
from tuner.tuning.study import (DUPLICATE, HEARTBEAT_S, INTERRUPTED, SURPLUS, counted, default_storage, enqueue,
                                finished, make_sampler, open_storage, study_name, surplus, taken)
from tuner.support.tables import describe_config, error_line
from tuner.tuning.timing import Timing, run_interleaved
from tuner.tuning.verify import ReferenceCheck, TrialFailed, failure_reason
from tuner.tuning.workers import reconnecting, run_until_decided
from tuner.tuning.workload import Compiled, Workload

DUPLICATES_IN_A_ROW = 10  # sampled configs already held, in a row, after which the space counts as covered


@dataclass(frozen=True)
class SearchOptions:
    """How to search. `trials` is the total the study should reach (a resumed study runs the rest,
    workers sharing the study run it between them); `timeout` bounds this run in seconds;
    `trial_timeout` bounds one trial (checked between its compile, check and timed runs: a single
    compile that runs longer is not interrupted); `heartbeat` is the seconds between a running trial's
    heartbeats in the storage (a trial silent for twice that belonged to a dead worker)."""

    objective: str = "fwd+bwd"
    trials: int = 12
    timeout: float | None = None
    trial_timeout: float = 120.0
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None
    heartbeat: int = HEARTBEAT_S
    runs: int = 3
    final_runs: int = 5
    calls: int = 1
    top: int = 3
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        for name in ("trials", "runs", "final_runs", "top", "calls", "heartbeat"):
            check_int(name, getattr(self, name))
        for name in ("timeout", "trial_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def tunes_fwd(self) -> bool:
        return self.objective != "bwd"

    @property
    def tunes_bwd(self) -> bool:
        return self.objective != "fwd"


@dataclass
class Measured:
    """A candidate's re-timed seconds per pass (0 for a pass the objective leaves out)."""

    config: Config
    fwd: Timing | None
    bwd: Timing | None

    @property
    def seconds(self) -> float:
        return sum(t.median for t in (self.fwd, self.bwd) if t is not None)

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), **{part: None if t is None else t.to_dict()
                                                    for part, t in (("fwd", self.fwd), ("bwd", self.bwd))}}

    @classmethod
    def from_dict(cls, data: dict, config_type: type) -> Measured:
        """The measurement `to_dict` wrote (another worker's, read from the study's decided winner)."""
        return cls(config_type.from_dict(data["config"]),
                   *(None if data[part] is None else Timing.from_dict(data[part]) for part in ("fwd", "bwd")))


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
    two ("auto": the first registered that can run it), any other an implementation over one."""
    axes = 1 if problem.group is None else 2
    if name != "auto" and registry.mesh_axes(registry.get(name)) != axes:
        raise ValueError(f"backend {name!r} with a2a_size={problem.a2a_size}: it runs over "
                         f"{registry.mesh_axes(registry.get(name))} mesh axis(es); a problem with a2a_size > 1 "
                         f"(--a2a-size) runs over a ring of ring_size / a2a_size positions of a2a_size devices each, "
                         f"on an implementation over two axes, any other on one over one axis")
    return registry.choose(name, problem.spec, jax.numpy.dtype(problem.dtype), problem.head_dim,
                           registry.Target(device, interpret), shapes=problem.shapes, ring_size=problem.ring_size,
                           group=problem.group)


class _Search:
    """State shared by the trials of one search process."""

    def __init__(self, problem: Problem, implementation: registry.Implementation, options: SearchOptions,
                 shared: Shared, name: str):
        self.problem, self.implementation, self.options = problem, implementation, options
        self.shared, self.name = shared, name
        self.parts = registry.OBJECTIVE_PARTS[options.objective]
        self.workload = Workload(problem)
        self.space = implementation.space(problem.shapes, problem.spec)
        self.default = implementation.default_config(problem.shapes, problem.spec)
        self.pool = self.space.grid(self.default, self.parts)  # where a duplicate's replacement comes from
        random.Random(options.seed).shuffle(self.pool)
        self.duplicates, self.exhausted = 0, False
        self.reference = ReferenceCheck(self.workload, seed=10_000 + options.seed, backward=options.tunes_bwd)
        self.time_sets = [self.workload.draw(seed=options.seed + i) for i in range(3)]
        self.built: dict[Config, tuple[Compiled, float]] = {}
        try:
            self.baseline = self._compile(self.default, deadline=None)
        except TrialFailed as failure:
            raise RuntimeError(f"the {implementation.name} backend's default ({describe_config(self.default)}) fails "
                               f"on this problem, so there is nothing to measure against: {failure}") from None
        # Every measurement runs the default beside its candidates: its backward residuals are kept.
        self.default_thunks = self.baseline[0].thunks("default", self.time_sets, forward=options.tunes_fwd)

    def _compile(self, config: Config, deadline: float | None) -> tuple[Compiled, float]:
        """Compile `config` for timing, checked first (at float32) against the reference; a config
        this process already built is reused."""
        if config not in self.built:
            fn = self.workload.attend(self.implementation.name, config, interpret=self.options.interpret)
            self.built[config] = self.reference.compile_checked(fn, *self.time_sets[0], deadline=deadline,
                                                                trial_timeout=self.options.trial_timeout)
        return self.built[config]

    def measure(self, candidates: dict[str, Compiled], runs: int, deadline: float | None
                ) -> dict[str, tuple[Timing | None, Timing | None]]:
        """(fwd, bwd) timings of the candidates and of the default ("default"), run interleaved."""
        thunks = dict(self.default_thunks)
        for name, compiled in candidates.items():
            thunks.update(compiled.thunks(name, self.time_sets, forward=self.options.tunes_fwd))
        timings = run_interleaved(thunks, runs=runs, warmup=1, calls=self.options.calls, deadline=deadline)
        return {name: (timings.get(f"{name}:fwd"), timings.get(f"{name}:bwd"))
                for name in ("default", *candidates)}

    def objective(self, trial: optuna.Trial) -> float:
        if surplus(trial, self.options.trials):
            trial.set_user_attr("failure", SURPLUS)
            trial.study.stop()
            raise TrialFailed(SURPLUS, f"the study had its {self.options.trials} trials when this one began")
        start = time.perf_counter()
        deadline = start + self.options.trial_timeout
        trial.set_user_attr("worker", worker_name())
        config = self.space.suggest(trial, self.default, self.parts)
        holder = self.shared.claim_config(self.name, trial.params, trial.number, trial.study)
        if holder is not None:
            self._duplicate(trial, holder)
        self.duplicates = 0
        try:
            reason = self.implementation.violation(self.problem.shapes, self.problem.spec, config, self.parts)
            if reason is not None:
                trial.set_user_attr("pruned", reason)
                raise optuna.TrialPruned(reason)
            try:
                compiled, compile_seconds = self._compile(config, deadline)
                trial.set_user_attr("compile_s", compile_seconds)
                timings = self.measure({"candidate": compiled}, self.options.runs, deadline)
            except TimeoutError as error:
                raise TrialFailed("timeout", f"{error}, over the {self.options.trial_timeout:.0f} s "
                                             f"trial timeout") from error
            except TrialFailed:
                raise
            except Exception as error:  # noqa: BLE001
                raise TrialFailed(failure_reason(error, "runtime"), error_line(error)) from error
        except TrialFailed as failure:
            trial.set_user_attr("failure", failure.reason)
            trial.set_user_attr("detail", failure.detail)
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("failure", INTERRUPTED)
            self.shared.release_config(self.name, trial.params, trial.number)
            raise
        candidate, default = timings["candidate"], timings["default"]
        for part, cand, base in (("fwd", *[t[0] for t in (candidate, default)]),
                                 ("bwd", *[t[1] for t in (candidate, default)])):
            if cand is not None:
                trial.set_user_attr(f"{part}_s", cand.median)
                trial.set_user_attr(f"{part}_rel", cand.median / base.median)
        total = sum(t.median for t in candidate if t is not None)
        base_total = sum(t.median for t in default if t is not None)
        trial.set_user_attr("seconds", total)
        return total / base_total

    def _duplicate(self, trial: optuna.Trial, holder: optuna.trial.FrozenTrial) -> None:
        """Give back a sampled config another trial holds, and queue an untried point of the grid in its
        place; when the grid has none and the sampler keeps proposing held configs, the space is covered."""
        self.duplicates += 1
        trial.set_user_attr("failure", DUPLICATE)
        claimed = self.shared.claimed(self.name)
        queued = {config_digest(t.system_attrs.get("fixed_params", t.params))
                  for t in trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))}
        untried = (c for c in self.pool if config_digest(self.space.params(c, self.parts)) not in claimed | queued)
        replacement = next(untried, None)
        if replacement is not None:
            trial.study.enqueue_trial(self.space.params(replacement, self.parts))
        elif self.duplicates >= DUPLICATES_IN_A_ROW:
            self.exhausted = True
            trial.study.stop()
        raise TrialFailed(DUPLICATE, f"trial {holder.number} holds this config")


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

    state = _Search(problem, chosen, options, Shared(storage), name)
    configs = [state.default]
    if options.sampler == "grid":
        configs += [c for c in state.space.grid(state.default, state.parts) if c != state.default]
    enqueue(study, configs[:options.trials], state.space, state.parts)
    new_trials = 0

    def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        nonlocal new_trials
        new_trials += counted(trial)
        trials = study.get_trials(deepcopy=False)
        if progress is not None:
            done = finished(trials)
            best = [t for t in done if t.state == optuna.trial.TrialState.COMPLETE]
            status = (f"best {min(t.value for t in best):.2f}x default time" if best else "no result yet")
            failed = sum(t.state == optuna.trial.TrialState.FAIL for t in done)
            progress(min(len(done), options.trials), options.trials,
                     f"{status}, {failed} failed" if failed else status)
        if taken(trials) >= options.trials:
            study.stop()

    deadline = None if options.timeout is None else started + options.timeout
    decision = reconnecting(storage_url, lambda: run_until_decided(
        study, state.objective, after_trial, state.shared, options.trials, deadline, lambda: state.exhausted))
    if decision is None:  # this worker decides: re-time the best candidates of the whole study
        trials = finished(study.get_trials(deepcopy=False))
        counts = Counter(t.user_attrs["failure"] for t in trials if t.state == optuna.trial.TrialState.FAIL)
        pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in trials):
            covered = " (every config of the space was tried)" if state.exhausted else ""
            raise RuntimeError(f"no trial of study {name} completed ({len(trials)} finished{covered}: {pruned} "
                               f"pruned, failed {dict(counts)}); nothing was written to the cache")
        measured, failures = _retime(state, trials)
        default = measured["default"]
        winner = min(measured.values(), key=lambda m: m.seconds)
        row = make_row(key, winner.config, versions=versions, tool_version=__version__,
                       objective=options.objective, best_s=winner.seconds, default_s=default.seconds,
                       speedup=default.seconds / winner.seconds, trials_run=len(trials), trials_pruned=pruned,
                       trials_failed=dict(counts), study=name)
        mine = {"row": row, "default": default.to_dict(), "best": winner.to_dict(), "failures": failures}
        decision = reconnecting(storage_url, lambda: state.shared.decide(name, mine, len(trials)))
    trials = finished(study.get_trials(deepcopy=False))
    counts = Counter(t.user_attrs["failure"] for t in trials if t.state == optuna.trial.TrialState.FAIL)
    row = decision["row"]
    held = cache.put_best(row)
    stored = all(held[f] == row[f] for f in ("measured_at", "speedup", "best_s", "fwd_params", "bwd_params"))
    default, best = (Measured.from_dict(decision[part], chosen.config_type) for part in ("default", "best"))
    return SearchResult(problem, chosen.name, device_kind, key, options.objective, name, storage_url,
                        default, best, len(trials), sum(t.state == optuna.trial.TrialState.PRUNED for t in trials),
                        dict(counts), cache.path, time.perf_counter() - started, new_trials, stored=stored,
                        stored_speedup=held["speedup"], failures=decision["failures"],
                        decided_by="" if decision["worker"] == worker_name() else decision["worker"])


def study_of(problem: Problem, device: str, backend: str, options: SearchOptions
             ) -> tuple[registry.Implementation, str, ProblemKey, dict[str, str], str]:
    """What a search of `problem` tunes, and in which study: (implementation, device kind, key,
    versions, study name). `ValueError` for a device or backend that cannot run here."""
    device_kind = check_device(device)
    chosen = resolve_backend(backend, problem, device, options.interpret)
    versions = registry.versions(chosen)
    key = registry.problem_key(problem, chosen.name, device_kind)
    return chosen, device_kind, key, versions, study_name(key, options.objective, versions)


def _retime(state: _Search, trials: list[optuna.trial.FrozenTrial]
            ) -> tuple[dict[str, Measured], list[str]]:
    """Re-time, interleaved, the default, the best few trials and the best-forward x best-backward
    combination; returns their measurements by name and the candidates that failed to rebuild."""
    options = state.options
    complete = sorted((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE),
                      key=lambda t: t.value)
    configs: dict[Config, str] = {state.default: "default"}
    for t in complete:
        if len(configs) > options.top:
            break
        configs.setdefault(state.space.config(t.params, state.default), f"trial {t.number}")
    if options.objective == "fwd+bwd" and complete:
        best_fwd = min(complete, key=lambda t: t.user_attrs["fwd_rel"])
        best_bwd = min(complete, key=lambda t: t.user_attrs["bwd_rel"])
        combined = registry.combine(state.implementation, state.space.config(best_fwd.params, state.default),
                                    state.space.config(best_bwd.params, state.default))
        configs.setdefault(combined, f"fwd of trial {best_fwd.number} + bwd of trial {best_bwd.number}")
    compiled: dict[str, Compiled] = {}
    failures = []
    names: dict[str, Config] = {"default": state.default}
    for config, name in configs.items():
        if name == "default":
            continue
        try:
            compiled[name] = state._compile(config, deadline=None)[0]
            names[name] = config
        except TrialFailed as failure:
            failures.append(f"{name}: {failure}")
    timings = state.measure(compiled, options.final_runs, deadline=None)
    return {name: Measured(names[name], *timings[name]) for name in names}, failures


__all__ = ["Measured", "SearchOptions", "SearchResult", "check_device", "resolve_backend", "search", "study_of"]
