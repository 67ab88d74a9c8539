"""How to search: the options of `tuner.tuning.search.search`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tuner.semantics.problem import OBJECTIVES, SAMPLERS
from tuner.support.checks import check_int
from tuner.tuning.study import HEARTBEAT_S


@dataclass(frozen=True)
class SearchOptions:
    """How to search. `trials` is the total the study should reach (a resumed study runs the rest,
    workers sharing the study run it between them); `timeout` bounds this run in seconds;
    `trial_timeout` bounds one trial (checked between its compile, check and timed runs: a single
    compile that runs longer is not interrupted); `heartbeat` is the seconds between a running trial's
    heartbeats in the storage (a trial silent for twice that belonged to a dead worker); `reconnect` is
    how long a storage that stopped answering is retried before the search stops; `warm_start` queues
    the winners of the nearest tuned problems right after the default (`tuner.tuning.warm`);
    `compile_ahead` trials compile while another is checked or timed (`tuner.tuning.inflight`; None: 0 on the
    CPU, whose cores compile and run alike, else 1)."""

    objective: str = "fwd+bwd"
    trials: int = 12
    timeout: float | None = None
    trial_timeout: float = 120.0
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None
    heartbeat: int = HEARTBEAT_S
    reconnect: float = 120.0
    warm_start: bool = True
    runs: int = 3
    final_runs: int = 5
    calls: int = 1
    top: int = 3
    interpret: bool = False
    compile_ahead: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        for name in ("trials", "runs", "final_runs", "top", "calls", "heartbeat"):
            check_int(name, getattr(self, name))
        check_int("compile_ahead", self.compile_ahead, non_negative=True, optional=True)
        for name in ("timeout", "trial_timeout", "reconnect"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def shared_by(self, engines: int) -> SearchOptions:
        """These options for one of `engines` searches of a problem run in turn (each engine auto may run):
        the timeout shared equally, the rest the same."""
        return self if self.timeout is None else replace(self, timeout=self.timeout / engines)

    @property
    def tunes_fwd(self) -> bool:
        return self.objective != "bwd"

    @property
    def tunes_bwd(self) -> bool:
        return self.objective != "fwd"


__all__ = ["SearchOptions"]
