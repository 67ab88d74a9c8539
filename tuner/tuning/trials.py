"""One search process's trials: claim a config, rule it out, compile, check and time it.

`Trials.objective` is what optuna calls per trial (the steps are listed in `tuner.tuning.search`);
`retime` times the study's best candidates again, interleaved with the default, to decide the winner.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

import optuna

from tuner import registry
from tuner.cache import NEAR, NEAR_BEST
from tuner.registry import Config
from tuner.semantics import documents
from tuner.semantics.problem import Problem
from tuner.support.tables import describe_config, error_line
from tuner.tuning.inflight import DeviceGate
from tuner.tuning.options import SearchOptions
from tuner.tuning.shared import Shared, config_digest, worker_name
from tuner.tuning.study import DUPLICATE, INTERRUPTED, SURPLUS, surplus
from tuner.tuning.timing import Timing, run_interleaved, warmup_seconds_on
from tuner.tuning.verify import ReferenceCheck, TrialFailed, compile_seconds, failure_reason
from tuner.tuning.workload import Compiled, Workload

DUPLICATES_IN_A_ROW = 10  # sampled configs already held, in a row, after which the space counts as covered


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


class Trials:
    """The trials of one search process: its workload, reference check, baseline and compiled candidates,
    and the objective optuna calls."""

    def __init__(self, problem: Problem, implementation: registry.Implementation, options: SearchOptions,
                 shared: Shared, name: str, default: Config | None = None):
        """`default` is the config every candidate is timed against and the search starts from: the
        backend's default where None (a landscape re-timed later passes the default it was recorded with)."""
        self.problem, self.implementation, self.options = problem, implementation, options
        self.shared, self.name = shared, name
        self.parts = registry.OBJECTIVE_PARTS[options.objective]
        self.workload = Workload(problem)
        self.tile_shapes = registry.problem_tile_shapes(implementation, problem)
        self.space = implementation.space(self.tile_shapes, problem.spec)
        if default is None:
            tile = documents.declared_tile(problem.packing, problem.seq_len, problem.ring_size, problem.spec)
            default = registry.default_config(implementation, self.tile_shapes, problem.spec, tile)
        self.default = default
        self.pool = self.space.grid(self.default, self.parts)  # where a duplicate's replacement comes from
        # A space the trials can walk whole is walked (`tuner.tuning.search`), each point once, without the
        # points the constraints rule out (the cudnn kernel's non-square chunks are 6 of its 9).
        self.whole = len(self.pool) <= options.trials
        if self.whole:
            self.pool = [c for c in self.pool if self.violation(c) is None]
        random.Random(options.seed).shuffle(self.pool)
        self.duplicates, self.exhausted = 0, False
        self.reference = ReferenceCheck(self.workload, seed=10_000 + options.seed, backward=options.tunes_bwd)
        self.time_sets = [self.workload.draw(seed=options.seed + i) for i in range(3)]
        self.built: dict[Config, tuple[Compiled, float]] = {}
        self.gate = DeviceGate(host_is_device=self.workload.platform == "cpu")
        self.in_flight = 1 + (options.compile_ahead if options.compile_ahead is not None
                              else 0 if self.gate.host_is_device else 1)
        try:
            self.baseline = self.compile(self.default, deadline=None)
        except TrialFailed as failure:
            raise RuntimeError(f"the {implementation.name} backend's default ({describe_config(self.default)}) fails "
                               f"on this problem, so there is nothing to measure against: {failure}") from None
        # Every measurement runs the default beside its candidates: its backward residuals are kept.
        self.default_thunks = self.baseline[0].thunks("default", self.time_sets, forward=options.tunes_fwd)

    @property
    def spent(self) -> Counter[str]:
        """Wall seconds spent compiling, checking and timing (`DeviceGate.spent`)."""
        return self.gate.spent

    def violation(self, config: Config) -> str | None:
        """Why the implementation's constraints rule `config` out for this problem, or None."""
        return self.implementation.violation(self.tile_shapes, self.problem.spec, config, self.parts)

    def compile(self, config: Config, deadline: float | None) -> tuple[Compiled, float]:
        """Compile `config` for timing, checked first (at float32) against the reference; a config
        this process already built is reused. Compiling takes a slot of the gate, the check its device;
        past `deadline` (plus this thread's waits for the gate) the trial fails as timed out."""
        if config not in self.built:
            fn = self.workload.attend(self.implementation.name, config, interpret=self.options.interpret)
            with self.gate.compile():
                timed, checked = self.reference.build(fn, *self.time_sets[0])
            seconds = compile_seconds(timed, checked)
            if deadline is not None and time.perf_counter() > deadline + self.gate.waited():
                raise TrialFailed("timeout", f"compiling took {seconds:.1f} s, over the "
                                             f"{self.options.trial_timeout:.0f} s trial timeout")
            with self.gate.device("check"):
                self.reference.verify(checked)
            self.built[config] = timed, seconds
        return self.built[config]

    def measure(self, candidates: dict[str, Compiled], runs: int, deadline: float | None
                ) -> dict[str, tuple[Timing | None, Timing | None]]:
        """(fwd, bwd) timings of the candidates and of the default ("default"), run interleaved."""
        with self.gate.device("timing"):
            thunks = dict(self.default_thunks)
            for name, compiled in candidates.items():
                thunks.update(compiled.thunks(name, self.time_sets, forward=self.options.tunes_fwd))
            timings = run_interleaved(thunks, runs=runs, warmup=1, calls=self.options.calls,
                                      warmup_seconds=warmup_seconds_on(self.workload.platform),
                                      deadline=None if deadline is None else deadline + self.gate.waited())
        return {name: (timings.get(f"{name}:fwd"), timings.get(f"{name}:bwd"))
                for name in ("default", *candidates)}

    def objective(self, trial: optuna.Trial) -> float:
        if surplus(trial, self.options.trials):
            trial.set_user_attr("failure", SURPLUS)
            trial.study.stop()
            raise TrialFailed(SURPLUS, f"the study had its {self.options.trials} trials when this one began")
        self.gate.begin()
        deadline = time.perf_counter() + self.options.trial_timeout
        trial.set_user_attr("worker", worker_name())
        if "source" not in trial.user_attrs:
            trial.set_user_attr("source", "sampler")
        config = self.space.suggest(trial, self.default, self.parts)
        trial.set_user_attr("config", describe_config(config))  # the sizes, where the parameters are ranks
        holder = self.shared.claim_config(self.name, trial.params, trial.number, trial.study)
        if holder is not None:
            self._duplicate(trial, holder)
        self.duplicates = 0
        try:
            reason = self.violation(config)
            if reason is not None:
                trial.set_user_attr("pruned", reason)
                raise optuna.TrialPruned(reason)
            try:
                compiled, compile_seconds = self.compile(config, deadline)
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
        held = self.shared.claimed(self.name) | {
            config_digest(t.system_attrs.get("fixed_params", t.params))
            for t in trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))}
        untried = (c for c in self.pool if config_digest(self.space.params(c, self.parts)) not in held)
        replacement = next(untried, None)
        if replacement is not None:
            trial.study.enqueue_trial(self.space.params(replacement, self.parts))
        elif self.duplicates >= DUPLICATES_IN_A_ROW:
            self.exhausted = True
            trial.study.stop()
        raise TrialFailed(DUPLICATE, f"trial {holder.number} holds this config")


def retime(state: Trials, trials: list[optuna.trial.FrozenTrial]
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
        configs.setdefault(state.space.config(t.params, state.default),
                           f"trial {t.number} ({t.user_attrs.get('source', 'sampler')})")
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
            compiled[name] = state.compile(config, deadline=None)[0]
            names[name] = config
        except TrialFailed as failure:
            failures.append(f"{name}: {failure}")
    timings = state.measure(compiled, options.final_runs, deadline=None)
    return {name: Measured(names[name], *timings[name]) for name in names}, failures


def trial_speedups(state: Trials, trials: list[optuna.trial.FrozenTrial]) -> dict[Config, float]:
    """The best speedup over the default that a complete trial of each config measured in its trial (the
    progress bar's figure), the default's own trial left out: what the re-timing confirms or not."""
    speedups: dict[Config, float] = {}
    for t in trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            config = state.space.config(t.params, state.default)
            if config != state.default:
                speedups[config] = max(speedups.get(config, 0.0), 1 / t.value)
    return speedups


def near_best(state: Trials, trials: list[optuna.trial.FrozenTrial], winner: Config) -> list[Config]:
    """What the search keeps for warm starts (`tuner.cache.rows`): `winner`, then the configs of the complete
    trials within `NEAR` of the best trial's value, fastest first, at most `NEAR_BEST` in all."""
    complete = sorted((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE), key=lambda t: t.value)
    configs = [winner]
    for t in complete:
        if t.value > NEAR * complete[0].value:
            break
        config = state.space.config(t.params, state.default)
        if config not in configs:
            configs.append(config)
    return configs[:NEAR_BEST]


__all__ = ["DUPLICATES_IN_A_ROW", "Measured", "Trials", "near_best", "retime", "trial_speedups"]
