"""Verification: a candidate is checked against the scan ring's result before it is timed.

The reference is the scan backend at its default tiles, on fixed random float32 inputs: every candidate
of every implementation must reproduce its output within `FWD_TOLERANCE` and, for backward objectives,
its gradients within `GRAD_TOLERANCE` (relative); `Workload.reference` computes it, over two mesh axes
too. A candidate that does not, or does not build, is a `TrialFailed` with a reason the search records.

The reference and the candidate's checked run trace under `jax.default_matmul_precision("highest")`. At jax's
default precision, float32 matrix products run in TF32 on NVIDIA GPUs and in bfloat16 passes on TPUs: the
scan reference would then be off by about 4e-4 (measured on an H200), and every exact candidate would fail
the 1e-5 check against it. Only where float32 products are exact by default (`EXACT_PLATFORMS`) is a
float32 problem's timed compile also the checked one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from tuner.support.tables import error_line
from tuner.tuning.workload import Compiled, Inputs, Workload, relative_error

FWD_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
EXACT_PLATFORMS = ("cpu",)  # float32 matrix products are exact there at jax's default precision
CHECK_PRECISION = "highest"


class TrialFailed(Exception):
    """A candidate that compiled badly, ran out of memory or time, or gave a wrong result."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def failure_reason(error: BaseException, otherwise: str) -> str:
    """"oom" for an out-of-memory error, else `otherwise`."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or isinstance(error, MemoryError):
        return "oom"
    return otherwise


class ReferenceCheck:
    """The scan backend's output (and, with `backward`, gradients) on fixed random float32 inputs
    (`Workload.reference`): what every candidate must reproduce, within `FWD_TOLERANCE` forward and
    `GRAD_TOLERANCE` gradients."""

    def __init__(self, workload: Workload, *, seed: int, backward: bool):
        self.workload, self.backward = workload, backward
        with jax.default_matmul_precision(CHECK_PRECISION):
            self.inputs, self.dout, self.outputs = workload.reference(seed=seed, backward=backward)

    def run(self, compiled: Compiled) -> dict[str, Any]:
        """`compiled`'s output (and gradients) on the reference inputs."""
        return compiled.results(self.inputs, self.dout, self.backward)

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

    def compile_checked(self, fn: Callable[[Inputs], Any], inputs: Inputs, dout: Any, *,
                        deadline: float | None, trial_timeout: float) -> tuple[Compiled, float]:
        """`fn` compiled for timing on `inputs`, and its compile seconds, once its result on the reference
        inputs (at float32, traced at `CHECK_PRECISION`) matches the reference. `TrialFailed` with the reason
        when it does not build, runs out of memory, errs, is still compiling past `deadline` or gives a wrong
        result."""
        workload = self.workload
        try:
            timed = workload.compile(fn, inputs, dout, backward=self.backward)
            if workload.problem.dtype == "float32" and workload.platform in EXACT_PLATFORMS:
                checked = timed
            else:
                with jax.default_matmul_precision(CHECK_PRECISION):
                    checked = workload.compile(fn, self.inputs, self.dout, backward=self.backward)
        except Exception as error:  # noqa: BLE001 - any build failure is a failed trial, with its reason
            raise TrialFailed(failure_reason(error, "compile"), error_line(error)) from error
        compile_seconds = timed.compile_seconds + (0.0 if checked is timed else checked.compile_seconds)
        if deadline is not None and time.perf_counter() > deadline:
            raise TrialFailed("timeout", f"compiling took {compile_seconds:.1f} s, over the "
                                         f"{trial_timeout:.0f} s trial timeout")
        try:
            mismatch = self.mismatch(checked)
        except Exception as error:  # noqa: BLE001
            raise TrialFailed(failure_reason(error, "runtime"), error_line(error)) from error
        if mismatch is not None:
            raise TrialFailed("wrong", mismatch)
        return timed, compile_seconds
