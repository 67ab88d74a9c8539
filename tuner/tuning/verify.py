"""Verification: a candidate is checked against the scan ring's result before it is timed.

The reference is the scan backend at its default tiles, computed in float32 on fixed random inputs of
the problem's dtype; `Workload.reference` computes it, over two mesh axes too. A candidate runs those
inputs as it is timed, and must reproduce the output (and for backward objectives the gradients):

- float32 problems: within `FWD_TOLERANCE` forward and `GRAD_TOLERANCE` gradients (relative);
- bfloat16 and float16 problems: within twice the scan ring's own error in that dtype, and at least the
  dtype's machine epsilon (DESIGN section 10's rule for low precision, the dense computation being the
  scan ring here).

A candidate that does not, or does not build, is a `TrialFailed` with a reason the search records.

A low-precision candidate is checked in its own dtype, on the program it is timed with. It used to be
compiled a second time at float32 for a tighter check: for a Triton kernel that compile is the exact
`ieee` float32 one, 35 to 41 s a kernel for sm_90 here against 1.5 to 5 s in bf16, and a search on an
H200 spent most of its time in it.

The float32 reference and float32 candidates' checked runs trace under
`jax.default_matmul_precision("highest")`. At jax's default precision, float32 matrix products run in TF32
on NVIDIA GPUs and in bfloat16 passes on TPUs: the scan reference was then about 4e-4 off on an H200, and
every exact candidate failed the 1e-5 check against it. Only where float32 products are exact by default
(`EXACT_PLATFORMS`) is a float32 candidate's timed program also the checked one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

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
    """The scan backend's output (and, with `backward`, gradients) on fixed random inputs of the problem's
    dtype, computed in float32 (`Workload.reference`): what every candidate must reproduce, within `bars`
    (module docstring)."""

    def __init__(self, workload: Workload, *, seed: int, backward: bool):
        self.workload, self.backward = workload, backward
        self.inputs, self.dout = workload.draw(seed=seed)
        dtype = jnp.dtype(workload.problem.dtype)
        with jax.default_matmul_precision(CHECK_PRECISION):
            self.outputs = workload.reference(_float32(self.inputs), self.dout.astype(jnp.float32), backward)
        if dtype == jnp.float32:
            self.bars = {name: FWD_TOLERANCE if name == "out" else GRAD_TOLERANCE for name in self.outputs}
            self.rule = "tolerance"
        else:
            own = workload.reference(self.inputs, self.dout, backward)
            eps = float(jnp.finfo(dtype).eps)
            self.bars = {name: max(2 * relative_error(own[name], want), eps) for name, want in self.outputs.items()}
            self.rule = f"bar (twice the scan ring's own {dtype.name} error, at least {eps:.1e})"
        self.separate = dtype == jnp.float32 and workload.platform not in EXACT_PLATFORMS

    def compile(self, fn: Callable[[Inputs], Any]) -> Compiled:
        """`fn` compiled to run on the reference inputs as the check runs it (float32 traced at
        `CHECK_PRECISION`)."""
        with jax.default_matmul_precision(CHECK_PRECISION) if self.separate else contextlib.nullcontext():
            return self.workload.compile(fn, self.inputs, self.dout, backward=self.backward)

    def run(self, compiled: Compiled) -> dict[str, Any]:
        """`compiled`'s output (and gradients) on the reference inputs."""
        return compiled.results(self.inputs, self.dout, self.backward)

    def mismatch(self, compiled: Compiled) -> str | None:
        """Which result of `compiled` differs from the reference beyond tolerance, and by how much."""
        got = self.run(compiled)
        for name, want in self.outputs.items():
            error = relative_error(got[name], want)
            if not error <= self.bars[name]:
                return (f"{name} differs from the scan reference by {error:.2e} (relative), over the "
                        f"{self.bars[name]:.1e} {self.rule}")
        return None

    def build(self, fn: Callable[[Inputs], Any], inputs: Inputs, dout: Any) -> tuple[Compiled, Compiled]:
        """`fn` compiled for timing on `inputs`, and the program the check runs: the same one, but for float32
        where the platform's default precision is not exact (`compile`). Nothing runs on the device.
        `TrialFailed` with the reason when it does not build."""
        try:
            timed = self.workload.compile(fn, inputs, dout, backward=self.backward)
            return timed, self.compile(fn) if self.separate else timed
        except Exception as error:  # noqa: BLE001 - any build failure is a failed trial, with its reason
            raise TrialFailed(failure_reason(error, "compile"), error_line(error)) from error

    def verify(self, checked: Compiled) -> None:
        """`TrialFailed` with the reason when `checked` errs, runs out of memory or gives a wrong result."""
        try:
            mismatch = self.mismatch(checked)
        except Exception as error:  # noqa: BLE001
            raise TrialFailed(failure_reason(error, "runtime"), error_line(error)) from error
        if mismatch is not None:
            raise TrialFailed("wrong", mismatch)

    def compile_checked(self, fn: Callable[[Inputs], Any], inputs: Inputs, dout: Any) -> tuple[Compiled, float]:
        """`fn` compiled for timing on `inputs`, and its compile seconds, once its result on the reference
        inputs matches the reference (`build`, then `verify`)."""
        timed, checked = self.build(fn, inputs, dout)
        self.verify(checked)
        return timed, compile_seconds(timed, checked)


def compile_seconds(timed: Compiled, checked: Compiled) -> float:
    """The seconds `build` spent compiling its one or two programs."""
    return timed.compile_seconds + (0.0 if checked is timed else checked.compile_seconds)


def _float32(inputs: Inputs) -> Inputs:
    """The floating inputs as float32 (their values unchanged), the others as they are."""
    return {name: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for name, x in inputs.items()}
