"""`tuner search --device tpu --dry-run`: everything a TPU search checks that can be checked without a TPU,
for the Pallas ring or another implementation over the Pallas kernel (`--backend all_to_all_pallas_tpu`,
`--a2a-size` for the hybrid), whose kernel's space is that of what it runs there (`registry.tile_shapes`).

1. enumerate the pallas_tpu search space of the problem (forward and backward points);
2. remove the points the backend's constraints rule out (TPU tiling, VMEM, SMEM), with their reasons;
3. lower every remaining point's kernels for TPU (`jax.export(..., platforms=["tpu"])`);
4. run a sample of them -- the default first, then points drawn at random -- through the whole
   implementation in Pallas's interpreter on simulated CPU devices, checked against the scan backend
   like a search trial (float32, forward and every gradient).

It measures nothing: timing needs the TPU. On a TPU host the same command without `--dry-run` is the
real search.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tuner import registry
from tuner.kernels import pallas_tpu
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.problem import Problem
from tuner.strategies.configs import TileConfig
from tuner.tuning.verify import ReferenceCheck
from tuner.support.tables import describe_config, error_line, table
from tuner.tuning.workload import Workload


@dataclass
class Sample:
    """One config run in the interpreter: None when it matched the reference, else what differed."""

    config: TileConfig
    mismatch: str | None
    seconds: float


@dataclass
class DryRunReport:
    """What `dry_run` found: the points per pass, how many the constraints ruled out (by reason), lowered
    or failed to lower, and the samples run in the interpreter."""

    problem: Problem
    fwd_points: int
    bwd_points: int
    ruled_out: Counter = field(default_factory=Counter)  # reason -> points
    lowered_fwd: int = 0
    lowered_bwd: int = 0
    kernels: int = 0
    lowering_failures: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0

    failed_fwd: int = 0
    failed_bwd: int = 0

    @property
    def checked(self) -> int:
        return self.fwd_points + self.bwd_points

    @property
    def lowered(self) -> int:
        return self.lowered_fwd + self.lowered_bwd

    @property
    def ok(self) -> bool:
        return not self.lowering_failures and all(s.mismatch is None for s in self.samples)

    def render(self) -> str:
        """The report `tuner search --dry-run` prints: points per pass, why points were ruled out or
        failed to lower, the samples against the scan reference, and a closing count."""
        lines = [table(["pass", "points", "ruled out", "lower for TPU", "failed to lower"], [
            ["forward", self.fwd_points, self.fwd_points - self.lowered_fwd - self.failed_fwd,
             self.lowered_fwd, self.failed_fwd],
            ["backward", self.bwd_points, self.bwd_points - self.lowered_bwd - self.failed_bwd,
             self.lowered_bwd, self.failed_bwd]])]
        lines += [f"ruled out  {count} x {reason}" for reason, count in self.ruled_out.most_common()]
        lines += [f"failed to lower  {failure}" for failure in self.lowering_failures]
        if self.samples:
            lines.append(table(["sample", "params", "vs scan reference", "s"],
                               [["default" if i == 0 else f"random {i}", describe_config(s.config),
                                 "match" if s.mismatch is None else s.mismatch, f"{s.seconds:.1f}"]
                                for i, s in enumerate(self.samples)]))
        matched = sum(s.mismatch is None for s in self.samples)
        lines.append(f"checked {self.checked} variants: {self.lowered} lower for TPU ({self.kernels} Mosaic kernels), "
                     f"{sum(self.ruled_out.values())} ruled out by the constraints, {len(self.lowering_failures)} "
                     f"failed to lower; {matched} of {len(self.samples)} samples match the scan reference in the "
                     f"interpreter ({self.seconds:.0f} s)")
        if self.ok:
            lines.append("next     on a TPU host, the same command without --dry-run is the real search")
        return "\n".join(lines)


def reason_kind(reason: str) -> str:
    """A violation reason without its numbers, to count alike reasons together."""
    if "VMEM" in reason:
        return "VMEM over the scoped limit"
    if "SMEM" in reason:
        return "tile schedule over SMEM"
    if "must divide" in reason:
        return "block_kv_compute does not divide block_kv"
    if "is cut to it" in reason:
        return "block_kv_compute longer than block_kv (a duplicate point)"
    return reason


def dry_run(problem: Problem, *, samples: int = 3, seed: int = 0,
            progress: Callable[[str, int, int], None] | None = None, implementation: str = "pallas_tpu"
            ) -> DryRunReport:
    """Check the pallas_tpu variants of `problem` inside `implementation` (the Pallas ring, or another over
    the Pallas kernel) without a TPU (module docstring). `progress(stage, done, total)` is called as points
    are lowered and samples run. `ValueError` when the implementation cannot take the problem."""
    started = time.perf_counter()
    backend = pallas_tpu.PallasTpuBackend()
    runs = registry.taking(implementation, problem)
    shapes = registry.problem_tile_shapes(runs, problem)
    space = backend.search_space(shapes, problem.spec)
    fwd_points, bwd_points = list(space.fwd_points()), list(space.bwd_points())
    report = DryRunReport(problem, len(fwd_points), len(bwd_points))

    candidates: list[tuple[FwdParams | None, BwdParams | None]] = [(p, None) for p in fwd_points]
    candidates += [(None, p) for p in bwd_points]
    good_fwd, good_bwd = [], []
    for done, (fwd, bwd) in enumerate(candidates, 1):
        violation = backend.violation(shapes, problem.spec, fwd, bwd)
        if violation is not None:
            report.ruled_out[reason_kind(violation)] += 1
        else:
            try:
                report.kernels += pallas_tpu.lower(shapes, problem.spec, fwd, bwd)
            except Exception as error:  # noqa: BLE001 - every lowering failure is reported, not raised
                if fwd is not None:
                    report.failed_fwd += 1
                else:
                    report.failed_bwd += 1
                config = TileConfig(fwd or FwdParams(), bwd or BwdParams())
                report.lowering_failures.append(f"{describe_config(config)}: {error_line(error)}")
            else:
                if fwd is not None:
                    report.lowered_fwd += 1
                    good_fwd.append(fwd)
                else:
                    report.lowered_bwd += 1
                    good_bwd.append(bwd)
        if progress is not None:
            progress("lower", done, len(candidates))

    default = TileConfig(*backend.default_params(shapes.q_len, shapes.kv_len, *shapes.head_dims))
    pool = [TileConfig(f, b) for f in good_fwd for b in good_bwd if TileConfig(f, b) != default]
    chosen = [default, *random.Random(seed).sample(pool, min(max(samples - 1, 0), len(pool)))][:samples]
    if chosen:
        workload = Workload(problem)
        reference = ReferenceCheck(workload, seed=10_000 + seed, backward=True)
        for done, config in enumerate(chosen, 1):
            start = time.perf_counter()
            fn = workload.attend(implementation, config, interpret=True)
            try:
                compiled = reference.compile(fn)
                mismatch = reference.mismatch(compiled)
            except Exception as error:  # noqa: BLE001 - a sample that fails to run is a failed sample
                mismatch = error_line(error)
            report.samples.append(Sample(config, mismatch, time.perf_counter() - start))
            if progress is not None:
                progress("interpret", done, len(chosen))
    report.seconds = time.perf_counter() - started
    return report
