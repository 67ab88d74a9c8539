"""What one device holds for a ring, known before it runs (`tuner memory`).

The compiler's count: the problem's ring compiled for a target (the CPU's simulated devices, or a TPU
topology through libtpu, no TPU needed), forward or forward and backward, and its `memory_analysis()`
read per device: the temporaries, the arguments (the q, k, v shards; and the output's cotangent) and the
outputs. Beside it, the analytic floor: what a ring cannot do without beyond the caller's arrays.

    forward    the float32 output accumulator [B, T, H, Dv], the lse [B, H, T] (float32), and the key and
               value shard arriving while the one at hand is computed (with its positions)
    backward   the float32 dq accumulator [B, T, H, D], the float32 dk and dv accumulators at hand and
               arriving, the arriving key and value shard, the lse and delta, and the saved output

(T is the shard's length.) A forward and backward program needs the larger of the two.

Everything a device holds grows with its shard, so the compiled bytes per token of the shard give the
longest sequence a chip's memory holds at a headroom (`Report.longest`): linear in the shard's length,
which `tests/test_memory.py` checks against the compiler at a second length.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tuner import registry
from tuner.semantics.problem import Problem
from tuner.semantics.spec import LocalShapes
from tuner.support.tables import table
from tuner.tuning.workload import Workload, vjp_of

GIB = 2**30
# Memory a chip offers the program: HBM per chip of the TPU generations and of an H100.
HBM_BYTES = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB, "H100": 80 * GIB}
OBJECTIVES = ("fwd", "fwd+bwd")
TOKEN_MULTIPLE = 128  # the longest shard is rounded down to this (a TPU lane's width)


def floor(shapes: LocalShapes, objective: str) -> dict[str, int]:
    """The analytic floor of one device (module docstring), term by term, in bytes."""
    b, t, h, hkv, d = shapes.batch, shapes.q_len, shapes.heads, shapes.kv_heads, shapes.head_dim
    dv = shapes.value_dim
    item = jnp.dtype(shapes.dtype).itemsize
    arriving = b * shapes.kv_len * hkv * (d + dv) * item + 4 * b * shapes.kv_len
    forward = {"float32 output accumulator": 4 * b * t * h * dv, "lse": 4 * b * h * t,
               "key and value shard arriving": arriving}
    if objective == "fwd":
        return forward
    backward = {"float32 dq accumulator": 4 * b * t * h * d,
                "float32 dk and dv accumulators, at hand and arriving": 2 * 4 * b * shapes.kv_len * hkv * (d + dv),
                "key and value shard arriving": arriving, "lse and delta": 8 * b * h * t,
                "saved output": b * t * h * dv * item}
    return backward if sum(backward.values()) >= sum(forward.values()) else forward


@dataclass(frozen=True)
class Report:
    """One compiled program's memory on one device, and the floor beside it."""

    problem: Problem
    target: str
    objective: str
    implementation: str
    temp: int
    arguments: int
    outputs: int
    floor: dict[str, int]

    @property
    def floor_bytes(self) -> int:
        return sum(self.floor.values())

    @property
    def ratio(self) -> float:
        """The temporaries over the floor: 1 would hold nothing the ring does not need."""
        return self.temp / self.floor_bytes

    @property
    def per_token(self) -> float:
        """Bytes a device holds per token of its shard: temporaries, arguments and outputs."""
        return (self.temp + self.arguments + self.outputs) / self.problem.local_len

    def longest(self, hbm_bytes: int, headroom: float) -> int:
        """The longest global sequence whose shards fit `hbm_bytes` with `headroom` (a fraction) left for
        the rest of the model, on this ring; a multiple of `TOKEN_MULTIPLE` tokens a shard."""
        local = int(hbm_bytes * (1 - headroom) / self.per_token) // TOKEN_MULTIPLE * TOKEN_MULTIPLE
        return local * self.problem.ring_size


def compiled_memory(problem: Problem, devices: list, target: str, objective: str,
                    implementation: str = "auto") -> Report:
    """Compile the problem's ring on `devices` (as many as its ring size; a TPU topology's devices compile
    for that chip) with `implementation`'s default config ("auto": the platform's preference), and read
    what one device holds."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    platform = devices[0].platform
    workload = Workload(problem, devices=devices)
    dtype = jnp.dtype(problem.dtype)
    chosen = registry.choose(implementation, problem.spec, dtype, problem.head_dim, registry.Target(platform),
                             shapes=problem.shapes, ring_size=problem.ring_size)
    with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):  # the target chip's default tiles
        config = registry.default_config(chosen, problem.shapes, problem.spec, None)
    fn = workload.attend(chosen.name, config)
    inputs, dout = workload.structs()
    if objective == "fwd":
        lowered = jax.jit(fn).lower(inputs)
    else:
        def forward_and_backward(x, cotangent):
            out, vjp = vjp_of(fn, x)
            return out, vjp(cotangent)
        lowered = jax.jit(forward_and_backward).lower(inputs, dout)
    memory = lowered.compile().memory_analysis()
    return Report(problem, target, objective, chosen.name, memory.temp_size_in_bytes,
                  memory.argument_size_in_bytes, memory.output_size_in_bytes, floor(problem.shapes, objective))


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def render(reports: list[Report], headroom: float) -> str:
    """The table `tuner memory` prints: per objective the compiler's count beside the floor, the floor's
    terms, and the longest sequence each chip of `HBM_BYTES` holds (from the last report)."""
    first, last = reports[0], reports[-1]
    p = first.problem
    lines = [f"memory   {p.describe()}",
             f"         one device, compiled for {first.target} ({first.implementation}, default config)", "",
             table(["objective", "temp", "floor", "temp/floor", "arguments", "outputs", "bytes a token"],
                   [[r.objective, _mib(r.temp), _mib(r.floor_bytes), f"{r.ratio:.2f}x", _mib(r.arguments),
                     _mib(r.outputs), f"{r.per_token:,.0f}"] for r in reports]), ""]
    lines.append(f"floor ({last.objective}): " + ", ".join(f"{name} {_mib(n)}" for name, n in last.floor.items()))
    lines += ["", f"longest sequence with {headroom:.0%} of each chip left for the rest of the model "
                  f"({last.objective}, these heads, a ring of {p.ring_size}; the bytes a token {first.target}'s "
                  f"compiler counts, which another chip's compiler may lay out otherwise):",
              table(["chip", "memory", "tokens a device", "tokens on the ring"],
                    [[chip, f"{hbm // GIB} GiB", f"{last.longest(hbm, headroom) // p.ring_size:,}",
                      f"{last.longest(hbm, headroom):,}"] for chip, hbm in HBM_BYTES.items()])]
    return "\n".join(lines)


__all__ = ["GIB", "HBM_BYTES", "OBJECTIVES", "Report", "compiled_memory", "floor", "render"]
