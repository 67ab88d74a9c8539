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
and they share the study. `trials` is then the study's total, not each worker's: a trial that starts
once the trials numbered below it reach the total is surplus (it stops its worker and is counted
nowhere), and every worker stores its winner only if it beats the row an earlier worker stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import optuna
import sqlalchemy

import tuner
from tuner.backends import Backend, choose_backend, get_backend
from tuner.backends.base import SearchSpace
from tuner.cache import Cache, current_versions, make_row
from tuner.params import BwdParams, FwdParams
from tuner.problem import DEVICES, OBJECTIVES, SAMPLERS, Problem, ProblemKey
from tuner.tables import error_line
from tuner.timing import Timing, run_interleaved
from tuner.workload import Compiled, Workload, relative_error

log = logging.getLogger("tuner.search")

FWD_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
INTERRUPTED = "interrupted"
SURPLUS = "surplus"


@dataclass(frozen=True)
class SearchOptions:
    """How to search. `trials` is the total the study should reach (a resumed study runs the rest,
    workers sharing the study run it between them); `timeout` bounds this run in seconds;
    `trial_timeout` bounds one trial (checked between its compile, check and timed runs: a single
    compile that runs longer is not interrupted)."""

    objective: str = "fwd+bwd"
    trials: int = 12
    timeout: float | None = None
    trial_timeout: float = 120.0
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None
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
        for name in ("trials", "runs", "final_runs", "top", "calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
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


@dataclass(frozen=True)
class Point:
    """One candidate: forward and backward params."""

    fwd: FwdParams
    bwd: BwdParams

    def describe(self) -> str:
        def short(params) -> str:
            return " ".join(f"{k}={v}" for k, v in params.to_dict().items() if v is not None)
        return f"fwd({short(self.fwd)}) bwd({short(self.bwd)})"


@dataclass
class Measured:
    """A candidate's re-timed seconds per pass (0 for a pass the objective leaves out)."""

    point: Point
    fwd: Timing | None
    bwd: Timing | None

    @property
    def seconds(self) -> float:
        return sum(t.median for t in (self.fwd, self.bwd) if t is not None)


@dataclass
class SearchResult:
    """What a search found, measured and stored. `stored` is False when the cache kept the row it
    already held for the key (same objective and versions, an equal or higher speedup over the
    default: typically another worker's of the same study); `stored_speedup` is the speedup of the row
    the cache holds afterwards, this search's or that one."""

    problem: Problem
    backend: str
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

    @property
    def speedup(self) -> float:
        return self.default.seconds / self.best.seconds


class TrialFailed(Exception):
    """A candidate that compiled badly, ran out of memory or time, or gave a wrong result."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


def resolve_backend(name: str, problem: Problem, device: str, interpret: bool = False) -> Backend:
    """`name` ("auto": the device's best that supports the problem), checked to run here."""
    return choose_backend(name, problem.spec, jax.numpy.dtype(problem.dtype), problem.head_dim,
                          platform=device, interpret=interpret)


def default_storage(db_path: Path) -> str:
    """The optuna storage beside the cache: `<cache stem>.studies.sqlite`."""
    return f"sqlite:///{db_path.parent / (db_path.stem + '.studies.sqlite')}"


def _storage(url: str) -> optuna.storages.BaseStorage:
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):
        try:
            with warnings.catch_warnings():  # heartbeats fail the trials of a killed worker
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=30,
                                                  grace_period=120)
        except sqlalchemy.exc.SQLAlchemyError:
            # Workers that start together race to create a new storage's tables; the loser retries and
            # finds them made.
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def _sampler(options: SearchOptions, trials: int) -> optuna.samplers.BaseSampler:
    if options.sampler == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(seed=options.seed, multivariate=True, group=True,
                                              n_startup_trials=max(3, min(10, trials // 3)))
    if options.sampler == "gp":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("scipy") is None:
            raise ValueError("--sampler gp needs torch and scipy (pip install torch scipy); "
                             "or use --sampler tpe") from None
        return optuna.samplers.GPSampler(seed=options.seed)
    return optuna.samplers.RandomSampler(seed=options.seed)  # random; grid enqueues its points


# --------------------------------------------------------------------------------------------------
# Points <-> optuna parameters.
# --------------------------------------------------------------------------------------------------


def _params_of(point: Point, options: SearchOptions) -> dict[str, Any]:
    """The optuna parameters that name `point` (the fields the objective tunes)."""
    params: dict[str, Any] = {}
    if options.tunes_fwd:
        params.update({f"fwd.{k}": v for k, v in point.fwd.to_dict().items() if v is not None})
    if options.tunes_bwd:
        bwd = point.bwd.to_dict()
        dq = {"bwd.block_q_dq": bwd.pop("block_q_dq"), "bwd.block_kv_dq": bwd.pop("block_kv_dq")}
        params.update({f"bwd.{k}": v for k, v in bwd.items() if v is not None})
        params["bwd.dq_pass"] = "fused" if point.bwd.fused_dq else "separate"
        if not point.bwd.fused_dq:
            params.update(dq)
    return params


def _suggest(trial: optuna.Trial, space: SearchSpace, default: Point, options: SearchOptions) -> Point:
    fwd, bwd = default.fwd, default.bwd
    if options.tunes_fwd:
        fwd = FwdParams(**{n: trial.suggest_categorical(f"fwd.{n}", c) for n, c in space.fwd.items()})
    if options.tunes_bwd:
        fields = {n: trial.suggest_categorical(f"bwd.{n}", c) for n, c in space.bwd.items()}
        passes = tuple(p for p in space.dq_passes if p == "fused" or space.dq_tiles)
        dq_pass = trial.suggest_categorical("bwd.dq_pass", passes)
        if dq_pass == "separate":
            fields["block_q_dq"] = trial.suggest_categorical("bwd.block_q_dq", space.dq_tiles)
            fields["block_kv_dq"] = trial.suggest_categorical("bwd.block_kv_dq", space.dq_tiles)
        bwd = BwdParams(**fields)
    return Point(fwd, bwd)


def _point_of(params: dict[str, Any], default: Point) -> Point:
    fwd = {k[4:]: v for k, v in params.items() if k.startswith("fwd.")}
    bwd = {k[4:]: v for k, v in params.items() if k.startswith("bwd.") and k != "bwd.dq_pass"}
    return Point(FwdParams(**fwd) if fwd else default.fwd, BwdParams(**bwd) if bwd else default.bwd)


def grid_points(space: SearchSpace, default: Point, options: SearchOptions) -> list[Point]:
    """The grid: every forward point and every backward point, walked side by side (forward and
    backward are separate passes, so covering each space once covers every combination that can
    win: the best forward and the best backward are combined at the end)."""
    fwds = list(space.fwd_points()) if options.tunes_fwd else [default.fwd]
    bwds = list(space.bwd_points()) if options.tunes_bwd else [default.bwd]
    return [Point(fwds[i % len(fwds)], bwds[i % len(bwds)]) for i in range(max(len(fwds), len(bwds)))]


# --------------------------------------------------------------------------------------------------
# The search.
# --------------------------------------------------------------------------------------------------


def _reason(error: BaseException, otherwise: str) -> str:
    """"oom" for an out-of-memory error, else `otherwise`."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or isinstance(error, MemoryError):
        return "oom"
    return otherwise


class Reference:
    """The scan backend's output (and, with `backward`, gradients) on fixed random float32 inputs: what
    every candidate must reproduce, within `FWD_TOLERANCE` forward and `GRAD_TOLERANCE` gradients."""

    def __init__(self, workload: Workload, *, seed: int, backward: bool):
        self.backward = backward
        self.inputs, self.dout = workload.draw(seed=seed, dtype="float32")
        local, head_dim = workload.problem.local_len, workload.problem.head_dim
        fwd, bwd = get_backend("scan").default_params(local, local, head_dim)
        self.outputs = self.run(workload.compile(workload.ring("scan", fwd, bwd), self.inputs, self.dout,
                                                 backward=backward))

    def run(self, compiled: Compiled) -> dict[str, Any]:
        """`compiled`'s output (and gradients) on the reference inputs."""
        outputs = {"out": compiled.forward(self.inputs)}
        if self.backward:
            grads = compiled.gradients(self.inputs, self.dout)
            outputs.update({f"d{name}": g for name, g in grads.items()})
        return outputs

    def mismatch(self, compiled: Compiled) -> str | None:
        """Which result of `compiled` differs from the reference beyond tolerance, and by how much."""
        got = self.run(compiled)
        for name, want in self.outputs.items():
            tolerance = FWD_TOLERANCE if name == "out" else GRAD_TOLERANCE
            error = relative_error(got[name], want)
            if not error <= tolerance:
                return (f"{name} differs from the scan reference by {error:.2e} (relative), over the "
                        f"{tolerance:.0e} tolerance")
        return None


class _Search:
    """State shared by the trials of one search process."""

    def __init__(self, problem: Problem, backend: Backend, options: SearchOptions):
        self.problem, self.backend, self.options = problem, backend, options
        self.workload = Workload(problem)
        self.space = backend.search_space(problem)
        local = problem.local_len
        self.default = Point(*backend.default_params(local, local, problem.head_dim))
        self.reference = Reference(self.workload, seed=10_000 + options.seed, backward=options.tunes_bwd)
        self.time_sets = [self.workload.draw(seed=options.seed + i) for i in range(3)]
        self.built: dict[Point, tuple[Compiled, float]] = {}
        try:
            self.baseline = self._compile(self.default, deadline=None)
        except TrialFailed as failure:
            raise RuntimeError(f"the {backend.name} backend's default ({self.default.describe()}) fails "
                               f"on this problem, so there is nothing to measure against: {failure}") from None
        # Every measurement runs the default beside its candidates: its backward residuals are kept.
        self.default_thunks = self.baseline[0].thunks("default", self.time_sets, forward=options.tunes_fwd)

    def _compile(self, point: Point, deadline: float | None) -> tuple[Compiled, float]:
        """Compile `point` for timing, checked first (at float32) against the reference; a point
        this process already built is reused."""
        if point not in self.built:
            self.built[point] = self._build(point, deadline)
        return self.built[point]

    def _build(self, point: Point, deadline: float | None) -> tuple[Compiled, float]:
        fn = self.workload.ring(self.backend.name, point.fwd, point.bwd, interpret=self.options.interpret)
        inputs, dout = self.time_sets[0]
        try:
            timed = self.workload.compile(fn, inputs, dout, backward=self.options.tunes_bwd)
            checked = timed if self.problem.dtype == "float32" else self.workload.compile(
                fn, self.reference.inputs, self.reference.dout, backward=self.options.tunes_bwd)
        except Exception as error:  # noqa: BLE001 - any build failure is a failed trial, with its reason
            raise TrialFailed(_reason(error, "compile"), error_line(error)) from error
        compile_seconds = timed.compile_seconds + (0.0 if checked is timed else checked.compile_seconds)
        if deadline is not None and time.perf_counter() > deadline:
            raise TrialFailed("timeout", f"compiling took {compile_seconds:.1f} s, over the "
                                         f"{self.options.trial_timeout:.0f} s trial timeout")
        try:
            mismatch = self.reference.mismatch(checked)
        except Exception as error:  # noqa: BLE001
            raise TrialFailed(_reason(error, "runtime"), error_line(error)) from error
        if mismatch is not None:
            raise TrialFailed("wrong", mismatch)
        return timed, compile_seconds

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
        if _surplus(trial, self.options.trials):
            trial.set_user_attr("failure", SURPLUS)
            trial.study.stop()
            raise TrialFailed(SURPLUS, f"the study had its {self.options.trials} trials when this one began")
        start = time.perf_counter()
        deadline = start + self.options.trial_timeout
        point = _suggest(trial, self.space, self.default, self.options)
        try:
            reason = self.backend.violation(self.problem, point.fwd if self.options.tunes_fwd else None,
                                            point.bwd if self.options.tunes_bwd else None)
            if reason is not None:
                trial.set_user_attr("pruned", reason)
                raise optuna.TrialPruned(reason)
            try:
                compiled, compile_seconds = self._compile(point, deadline)
                trial.set_user_attr("compile_s", compile_seconds)
                timings = self.measure({"candidate": compiled}, self.options.runs, deadline)
            except TimeoutError as error:
                raise TrialFailed("timeout", f"{error}, over the {self.options.trial_timeout:.0f} s "
                                             f"trial timeout") from error
            except TrialFailed:
                raise
            except Exception as error:  # noqa: BLE001
                raise TrialFailed(_reason(error, "runtime"), error_line(error)) from error
        except TrialFailed as failure:
            trial.set_user_attr("failure", failure.reason)
            trial.set_user_attr("detail", failure.detail)
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("failure", INTERRUPTED)
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


def _counts(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a finished trial counts towards `--trials`: complete, pruned or failed, but not
    interrupted, not surplus and not killed (optuna's heartbeat fails the trial of a worker that died
    mid-trial once another worker starts one; that, or a crash of the search itself, is the one
    failure without a reason, and its point is run again)."""
    if trial.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
        return True
    return trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs.get("failure") not in (
        None, INTERRUPTED, SURPLUS)


def _finished(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The finished trials that count towards `--trials`."""
    return [t for t in trials if _counts(t)]


def _taken(trials: list[optuna.trial.FrozenTrial]) -> int:
    """How many of the study's trials count towards `--trials` or are running (and may yet count)."""
    return sum(t.state == optuna.trial.TrialState.RUNNING or _counts(t) for t in trials)


def _surplus(trial: optuna.Trial, total: int) -> bool:
    """Whether `trial`, just started, is one too many: the trials numbered below it (optuna numbers a
    study's trials in the order they are created, atomically across workers) that count, run or wait to
    run already reach `total`. Running trials of a dead worker are not among them: optuna fails the
    trials whose heartbeat is stale before each trial starts."""
    below = [t for t in trial.study.get_trials(deepcopy=False) if t.number < trial.number]
    return sum(not t.state.is_finished() or _counts(t) for t in below) >= total


def _fail_stale(study: optuna.Study) -> None:
    """Fail the running trials whose heartbeat is stale (their worker died), so they count nowhere."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def _enqueue(study: optuna.Study, points: list[Point], options: SearchOptions) -> None:
    """Queue `points` as the study's next trials, except those a trial already holds that waits, runs
    or counts (an interrupted, surplus or killed trial gives its point back)."""
    held = [t.system_attrs.get("fixed_params", t.params) for t in study.get_trials(deepcopy=False)
            if not t.state.is_finished() or _counts(t)]
    for point in points:
        params = _params_of(point, options)
        if params not in held:
            study.enqueue_trial(params)
            held.append(params)


def study_name(key: ProblemKey, objective: str, versions: dict[str, str]) -> str:
    """One study per problem key, objective and versions (a code change starts a fresh study)."""
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]
    return f"ring-{key.digest}-{objective}-{digest}"


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
    device_kind = check_device(device)
    chosen = resolve_backend(backend, problem, device, options.interpret)
    cache = Cache(db)
    versions = current_versions(chosen.code_hash(), triton=chosen.name == "triton")
    key = problem.key(chosen.name, device_kind)
    storage_url = options.storage or default_storage(cache.path)
    name = study_name(key, options.objective, versions)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name=name, storage=_storage(storage_url),
                                sampler=_sampler(options, options.trials), direction="minimize",
                                load_if_exists=True)
    for attr, value in (("problem", dataclasses.asdict(problem)), ("backend", chosen.name),
                        ("device_kind", device_kind), ("versions", versions)):
        study.set_user_attr(attr, value)

    state = _Search(problem, chosen, options)
    points = [state.default]
    if options.sampler == "grid":
        points += [p for p in grid_points(state.space, state.default, options) if p != state.default]
    _enqueue(study, points[:options.trials], options)
    new_trials = 0

    def after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        nonlocal new_trials
        new_trials += _counts(trial)
        trials = study.get_trials(deepcopy=False)
        if progress is not None:
            finished = _finished(trials)
            best = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
            status = (f"best {min(t.value for t in best):.2f}x default time" if best else "no result yet")
            failed = sum(t.state == optuna.trial.TrialState.FAIL for t in finished)
            progress(min(len(finished), options.trials), options.trials,
                     f"{status}, {failed} failed" if failed else status)
        if _taken(trials) >= options.trials:
            study.stop()

    # Another worker's trial counted as running may end interrupted, or a dead worker's be failed as
    # stale: while the study is short of its total, this worker goes on.
    deadline = None if options.timeout is None else started + options.timeout
    while True:
        _fail_stale(study)
        left = None if deadline is None else deadline - time.perf_counter()
        if _taken(study.get_trials(deepcopy=False)) >= options.trials or (left is not None and left <= 0):
            break
        study.optimize(state.objective, timeout=left, catch=(TrialFailed,), callbacks=[after_trial],
                       gc_after_trial=False)

    trials = _finished(study.get_trials(deepcopy=False))
    counts = Counter(t.user_attrs["failure"] for t in trials
                     if t.state == optuna.trial.TrialState.FAIL)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in trials):
        raise RuntimeError(f"no trial of study {name} completed ({len(trials)} finished: {pruned} pruned, "
                           f"failed {dict(counts)}); nothing was written to the cache")
    measured, failures = _retime(state, trials)
    default = measured["default"]
    winner = min(measured.values(), key=lambda m: m.seconds)
    row = make_row(key, winner.point.fwd, winner.point.bwd, versions=versions, tool_version=tuner.__version__,
                   objective=options.objective, best_s=winner.seconds, default_s=default.seconds,
                   speedup=default.seconds / winner.seconds, trials_run=len(trials), trials_pruned=pruned,
                   trials_failed=dict(counts), study=name)
    held = cache.put_best(row)
    stored = all(held[f] == row[f] for f in ("measured_at", "speedup", "best_s", "fwd_params", "bwd_params"))
    return SearchResult(problem, chosen.name, device_kind, key, options.objective, name, storage_url,
                        default, winner, len(trials), pruned, dict(counts), cache.path,
                        time.perf_counter() - started, new_trials, stored=stored,
                        stored_speedup=held["speedup"], failures=failures)


def _retime(state: _Search, trials: list[optuna.trial.FrozenTrial]
            ) -> tuple[dict[str, Measured], list[str]]:
    """Re-time, interleaved, the default, the best few trials and the best-forward x best-backward
    combination; returns their measurements by name and the candidates that failed to rebuild."""
    options = state.options
    complete = sorted((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE),
                      key=lambda t: t.value)
    points: dict[Point, str] = {state.default: "default"}
    for t in complete:
        if len(points) > options.top:
            break
        points.setdefault(_point_of(t.params, state.default), f"trial {t.number}")
    if options.objective == "fwd+bwd" and complete:
        best_fwd = min(complete, key=lambda t: t.user_attrs["fwd_rel"])
        best_bwd = min(complete, key=lambda t: t.user_attrs["bwd_rel"])
        combined = Point(_point_of(best_fwd.params, state.default).fwd,
                         _point_of(best_bwd.params, state.default).bwd)
        points.setdefault(combined, f"fwd of trial {best_fwd.number} + bwd of trial {best_bwd.number}")
    compiled: dict[str, Compiled] = {}
    failures = []
    names: dict[str, Point] = {"default": state.default}
    for point, name in points.items():
        if name == "default":
            continue
        try:
            compiled[name] = state._compile(point, deadline=None)[0]
            names[name] = point
        except TrialFailed as failure:
            failures.append(f"{name}: {failure}")
    timings = state.measure(compiled, options.final_runs, deadline=None)
    return {name: Measured(names[name], *timings[name]) for name in names}, failures




def write_report(study: str, storage: str, out: str | Path) -> int:
    """Write an HTML report of `study` (optimization history, parameter importances, parallel
    coordinates, from optuna's plotly visualizations) to `out`; returns the number of trials.

    `KeyError` when the storage has no such study, `ImportError` (saying what to install) without
    plotly.
    """
    if importlib.util.find_spec("plotly") is None:
        raise ImportError("tuner report needs plotly: pip install plotly (or pip install "
                          "'ring-tuner[report]')")
    import html

    from optuna import visualization

    names = [s.study_name for s in optuna.get_all_study_summaries(_storage(storage))]
    if study not in names:
        raise KeyError(f"no study {study!r} in {storage} (it has {len(names)}); pass the storage the "
                       f"search used with --storage")
    loaded = optuna.load_study(study_name=study, storage=_storage(storage))
    trials = [t for t in loaded.get_trials(deepcopy=False) if t.user_attrs.get("failure") != SURPLUS]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    figures: list[tuple[str, Any]] = [("Optimization history (time relative to the default)",
                                       visualization.plot_optimization_history(loaded))]
    notes = []
    if len(complete) >= 2:
        figures.append(("Parallel coordinates", visualization.plot_parallel_coordinate(loaded)))
        try:
            figures.append(("Parameter importances", visualization.plot_param_importances(loaded)))
        except (RuntimeError, ValueError) as error:
            notes.append(f"parameter importances unavailable: {error}")
    else:
        notes.append("parallel coordinates and importances need at least two complete trials")
    states = Counter(t.state.name.lower() for t in trials)
    failures = Counter(t.user_attrs.get("failure", "killed") for t in trials
                       if t.state == optuna.trial.TrialState.FAIL)
    summary = ", ".join(f"{n} {s}" for s, n in states.items())
    if failures:
        summary += " (failed: " + ", ".join(f"{r} {n}" for r, n in failures.items()) + ")"
    parts = [f"<h1>Study {html.escape(study)}</h1>",
             f"<p>{html.escape(json.dumps(loaded.user_attrs.get('problem', {})))}</p>",
             f"<p>backend {html.escape(str(loaded.user_attrs.get('backend')))} on "
             f"{html.escape(str(loaded.user_attrs.get('device_kind')))}; trials: {html.escape(summary)}</p>",
             *(f"<p><i>{html.escape(n)}</i></p>" for n in notes)]
    for i, (title, figure) in enumerate(figures):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(figure.to_html(full_html=False, include_plotlyjs=(i == 0)))
    Path(out).write_text("<!doctype html><html><head><meta charset='utf-8'><title>tuner report</title>"
                         "</head><body>" + "\n".join(parts) + "</body></html>", encoding="utf-8")
    return len(trials)


__all__ = ["SAMPLERS", "SearchOptions", "SearchResult", "check_device", "search", "write_report"]
