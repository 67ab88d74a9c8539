"""What the TPU dry run found (`tuner.tuning.compiled`): each variant's verdict, one target's report and
the config it leads to, and that config stored as a `compiled` cache row."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from tuner import registry
from tuner.cache import Cache, make_row
from tuner.kernels.params import BwdParams, FwdParams
from tuner.models import tpu_model
from tuner.semantics.problem import Problem
from tuner.strategies.configs import TileConfig
from tuner.support.tables import describe_config, table
from tuner.support.version import __version__
from tuner.tuning.dryrun import reason_kind

PARTS = ("fwd", "dkv", "dq")  # one kernel each: a part's variants change its tiles, the others keep the default


@dataclass
class Variant:
    """One forward or backward variant on one target: the constraint that ruled it out, or the
    compiler's verdict (`error` None: compiled) with the VMEM per kernel (asked, used by the compiler's
    report, our estimate), the program's temporary bytes and the model's seconds."""

    part: str
    config: TileConfig
    ruled_out: str | None = None
    error: str | None = None
    vmem: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    temp_bytes: int | None = None
    predicted: tpu_model.Prediction | None = None
    forced: str | None = None  # compiled although the constraints rule it out (why), to test them

    @property
    def compiled(self) -> bool:
        return self.ruled_out is None and self.error is None

    @property
    def params(self) -> dict[str, FwdParams | BwdParams]:
        """The keyword `tpu_model.predict` takes for this variant's pass."""
        return {"fwd": self.config.fwd} if self.part == "fwd" else {"bwd": self.config.bwd}


@dataclass
class TargetReport:
    """The variants of one target and the config they lead to (None when no forward or no backward
    variant compiled)."""

    target: str
    device_kind: str
    chip: tpu_model.Chip
    problem: Problem
    variants: list[Variant]
    admitted: int  # variants the constraints admitted (all compiled, unless sampled)
    seconds: float
    implementation: str = tpu_model.MODELLED  # the registered implementation compiled, over the Pallas kernel

    def best(self, part: str) -> Variant | None:
        done = [v for v in self.variants if v.part == part and v.compiled and v.forced is None]
        return min(done, key=lambda v: v.predicted.seconds) if done else None

    @property
    def config(self) -> TileConfig | None:
        """The best forward tiles with the best dK/dV and the best dQ tiles, when each part compiled."""
        fwd, dkv, dq = (self.best(part) for part in PARTS)
        if fwd is None or dkv is None or dq is None:
            return None
        return TileConfig(fwd.config.fwd, replace(dkv.config.bwd, block_q_dq=dq.config.bwd.block_q_dq,
                                                  block_kv_dq=dq.config.bwd.block_kv_dq))

    @property
    def predicted(self) -> float:
        """The model's seconds of `config`, forward and backward."""
        chip, problem, config, name = self.chip, self.problem, self.config, self.implementation
        return tpu_model.predict(problem, chip, fwd=config.fwd, implementation=name).seconds + \
            tpu_model.predict(problem, chip, bwd=config.bwd, implementation=name).seconds

    def render(self) -> str:
        rows = []
        tried = [v for v in self.variants if v.ruled_out is None]
        for v in sorted(tried, key=lambda v: (PARTS.index(v.part), not v.compiled,
                                              v.predicted.seconds if v.predicted else 0.0)):
            vmem = [f"{used / 2**20:.2f} / {estimate / 2**20:.2f}" for used, estimate in
                    ((used, estimate) for _, used, estimate in v.vmem.values())]
            verdict = "compiled" if v.compiled else v.error[:80]
            rows.append([v.part, describe_tiles(v), verdict + (" (ruled out by the estimate)" if v.forced else ""),
                         ", ".join(vmem) or "-",
                         f"{v.temp_bytes / 2**20:.1f}" if v.temp_bytes is not None else "-",
                         f"{v.predicted.seconds * 1e3:.3f}" if v.predicted else "-"])
        reasons = Counter(reason_kind(v.ruled_out) for v in self.variants if v.ruled_out is not None)
        compiled = sum(v.compiled for v in self.variants)
        ruled_out = len(self.variants) - len(tried)
        sampled = f" (a sample of the {self.admitted} admitted)" if len(tried) < self.admitted else ""
        chips = self.problem.ring_size
        runs = f"ring of {chips}" if self.implementation == tpu_model.MODELLED else \
            f"{self.implementation} on {chips} chips"
        lines = [f"{self.target} ({self.device_kind}, {runs}): {ruled_out} variants ruled out by the constraints, "
                 f"{compiled} of {len(tried)} compiled{sampled}, in {self.seconds:.0f} s",
                 table(["kernel", "tiles", "TPU compiler", "VMEM MiB: compiler / estimate", "temp MiB", "model ms"],
                       rows)]
        lines += [f"ruled out  {count} x {reason}" for reason, count in reasons.most_common()]
        if self.config is not None:
            lines.append(f"best     {describe_config(self.config)}: {self.predicted * 1e3:.3f} ms fwd+bwd by the "
                         f"model")
        return "\n".join(lines)


def describe_tiles(variant: Variant) -> str:
    """The tiles a variant sets for its own kernel, as the report prints them."""
    if variant.part == "fwd":
        f = variant.config.fwd
        return f"{f.block_q}x{f.block_kv} (compute {f.block_kv_compute})"
    b = variant.config.bwd
    return f"{b.block_q_dkv}x{b.block_kv_dkv}" if variant.part == "dkv" else f"{b.block_q_dq}x{b.block_kv_dq}"


def store(report: TargetReport, db=None) -> dict | None:
    """Write the target's config as a `compiled` cache row (None when it has none): `best_s` is the
    model's fwd+bwd seconds, never a measurement; the trial fields count the variants compiled, ruled
    out and rejected by the compiler."""
    config = report.config
    if config is None:
        return None
    implementation = registry.get(report.implementation)
    key = registry.problem_key(report.problem, implementation.name, report.device_kind)
    predicted = report.predicted
    rejected = sum(v.error is not None for v in report.variants)
    row = make_row(key, config, versions=registry.versions(implementation), tool_version=__version__,
                   source="compiled", objective="fwd+bwd", best_s=predicted, default_s=None, speedup=None,
                   trials_run=sum(v.compiled for v in report.variants),
                   trials_pruned=sum(v.ruled_out is not None for v in report.variants),
                   trials_failed={"compiler error": rejected} if rejected else {},
                   study=f"compiled for {report.target}, ranked by the model of tuner.models.tpu_model")
    Cache(db).put(row)
    return row


__all__ = ["PARTS", "TargetReport", "Variant", "describe_tiles", "store"]
