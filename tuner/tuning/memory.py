"""What one device holds for a ring, known before it runs (`tuner memory`).

The compiler's count: what the loader runs for the problem (its plan, `tuner.tuning.decision`) compiled
for a target (the CPU's simulated devices, a TPU topology through libtpu, no TPU needed, or GPUs
through jax's CUDA plugin, no GPU needed: `tuner.tuning.gpu_topology`), forward or
forward and backward, and its `memory_analysis()` read per device: the temporaries, the arguments (the
q, k, v shards; and the output's cotangent) and the outputs. Beside it, the analytic floor: the
temporaries a ring cannot do without, beyond the program's arguments and outputs.

    forward    the float32 output accumulator [B, T, H, Dv], the lse [B, H, T] (float32), and the key and
               value shards at hand and arriving (with their positions)
    backward   the float32 dq accumulator [B, T, H, D], the float32 dk and dv accumulators at hand and
               arriving, the key and value shards at hand and arriving, and the lse and delta

(T is the shard's length.) A forward and backward program needs the larger of the two. With float32
inputs the output and dq accumulators are not counted: they can be the program's output and dq. The
output saved for the backward is the program's output here (in a training step it is a residual). The
shards at hand and arriving are two from the second step on, on a ring of 3 or more: the one being
computed arrived at the step before and, not being the caller's array, cannot be sent into; one on a
ring of 2 (the shard at hand first is the caller's), none on a ring of 1.

The program's arguments are row-major, as a caller's arrays given to a jitted function are
(`argument_layouts="fixed"`), or laid out by the compiler (`"compiler"`), as where a model makes the
attention's inputs in the same program: on a TPU the kernels' heads-major layout, with no copy of q and
the output's cotangent into it.

What a device holds: on a TPU the compiler's peak (`peak_memory_in_bytes`), the high-water mark of its
HBM buffer assignment, arguments and outputs included. The temporaries it counts (`temp_size_in_bytes`)
are more than those that assignment places in HBM, and the compiler accepts a program whose peak fits a
chip though its temporaries, arguments and outputs together do not (docs/memory.md). XLA:CPU and XLA:GPU
count no peak beyond the arguments and outputs, so there a device holds its temporaries, arguments and
outputs.

What a device holds is affine in its shard's length (the tiles' working set is fixed), so two compiles,
at the shard and at twice it (at half it, where twice does not fit the device), give the bytes each
further token costs and the longest sequence a chip's memory holds at a headroom (`Report.longest`);
`tests/test_memory.py` compiles at that length and finds the budget filled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tuner.semantics.problem import Problem
from tuner.semantics.spec import LocalShapes
from tuner.support.tables import describe_config, table
from tuner.tuning.decision import loader_plan
from tuner.tuning.workload import Workload, vjp_of

GIB = 2**30
# Memory a chip offers the program: HBM per chip of the TPU generations, an H100 and an H200.
HBM_BYTES = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB, "H100": 80 * GIB, "H200": 140 * GIB}
OBJECTIVES = ("fwd", "fwd+bwd")
ARGUMENT_LAYOUTS = {"fixed": "row-major arguments", "compiler": "arguments laid out by the compiler, as inside a model"}
TOKEN_MULTIPLE = 128  # the longest shard is rounded down to this (a TPU lane's width)


def floor(shapes: LocalShapes, objective: str, ring_size: int) -> dict[str, int]:
    """The analytic floor of one device on a ring of `ring_size` (module docstring), term by term, in bytes."""
    b, t, h, hkv, d = shapes.batch, shapes.q_len, shapes.heads, shapes.kv_heads, shapes.head_dim
    dv = shapes.value_dim
    item = jnp.dtype(shapes.dtype).itemsize
    wide = item == 4  # float32 inputs: the output and dq accumulators can be the program's outputs
    shards = min(2, ring_size - 1) * (b * shapes.kv_len * hkv * (d + dv) * item + 4 * b * shapes.kv_len)
    forward = {"float32 output accumulator": 0 if wide else 4 * b * t * h * dv, "lse": 4 * b * h * t,
               "key and value shards at hand and arriving": shards}
    if objective == "fwd":
        return {name: n for name, n in forward.items() if n}
    backward = {"float32 dq accumulator": 0 if wide else 4 * b * t * h * d,
                "float32 dk and dv accumulators, at hand and arriving": 2 * 4 * b * shapes.kv_len * hkv * (d + dv),
                "key and value shards at hand and arriving": shards, "lse and delta": 8 * b * h * t}
    larger = backward if sum(backward.values()) >= sum(forward.values()) else forward
    return {name: n for name, n in larger.items() if n}


@dataclass(frozen=True)
class Report:
    """One compiled program's memory on one device, and the floor beside it. `growth` is what each
    further token of the shard adds (from a second compile at twice the shard)."""

    problem: Problem
    target: str
    objective: str
    implementation: str
    config: str  # the plan's config, described
    source: str  # where the loader took it from (tuner.runtime.dispatch.SOURCES)
    temp: int
    arguments: int
    outputs: int
    floor: dict[str, int]
    growth: float
    argument_layouts: str = "fixed"  # a key of ARGUMENT_LAYOUTS
    peak: int | None = None  # the compiler's peak, where it counts one (a TPU); None on the CPU and GPU
    multiple: int = TOKEN_MULTIPLE  # a shard length the plan's tiles divide is a multiple of this (`tile_multiple`)
    reason: str = ""  # why the loader chose the plan (`Decision.reason`)

    @property
    def floor_bytes(self) -> int:
        return sum(self.floor.values())

    @property
    def ratio(self) -> float:
        """The temporaries over the floor: 1 would hold nothing the ring does not need."""
        return self.temp / self.floor_bytes

    @property
    def held(self) -> int:
        """Everything the device holds (module docstring): the compiler's peak where it counts one, else the
        temporaries, arguments and outputs."""
        return _held(self.temp, self.arguments, self.outputs, self.peak)

    def longest(self, hbm_bytes: int, headroom: float) -> int:
        """The longest global sequence whose shards fit `hbm_bytes` with `headroom` (a fraction) left for
        the rest of the model, on this ring; a multiple of `multiple` tokens a shard."""
        room = hbm_bytes * (1 - headroom) - self.held
        local = int(self.problem.local_len + room / self.growth) // self.multiple * self.multiple
        return max(local, 0) * self.problem.ring_size


class DoesNotFit(RuntimeError):
    """The compiler refused the program: one device's memory does not hold it."""


def analysis(problem: Problem, devices: list, objective: str, implementation: str = "auto", db: str | None = None,
             argument_layouts: str = "fixed"):
    """The loader's plan for the problem on `devices` (`implementation`, "auto" for its own choice; the
    cache `db`), and the `memory_analysis()` of that plan compiled there once, its arguments laid out as
    `argument_layouts` says; `DoesNotFit` where the compiler finds the device's memory too small."""
    from jax.experimental.layout import Format, Layout

    workload = Workload(problem, devices=devices)
    with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):  # the target chip's plan and tiles
        plan = loader_plan(problem, implementation, db)
    fn = workload.attend(plan.backend, plan.config)
    inputs, dout = workload.structs()

    def jit(f, *structs):
        if argument_layouts == "fixed":
            return jax.jit(f)
        return jax.jit(f, in_shardings=jax.tree.map(lambda s: Format(Layout.AUTO, s.sharding), structs))

    if objective == "fwd":
        lowered = jit(fn, inputs).lower(inputs)
    else:
        def forward_and_backward(x, cotangent):
            out, vjp = vjp_of(fn, x)
            return out, vjp(cotangent)
        lowered = jit(forward_and_backward, inputs, dout).lower(inputs, dout)
    try:
        return plan, lowered.compile().memory_analysis()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        said = str(error).strip().splitlines()[0].removeprefix("RESOURCE_EXHAUSTED: ").rstrip(".")
        raise DoesNotFit(f"{problem.describe()} does not fit one device: the compiler says {said!r}") from None


def _halved(problem: Problem, doubled: DoesNotFit) -> Problem:
    """The problem at about half its length, a length its layout splits, for what a token more costs
    where twice the length does not fit (`doubled`, said again where half is no valid problem)."""
    unit = 2 * problem.ring_size  # zigzag halves on every device; a multiple of every layout's unit
    try:
        return dataclasses.replace(problem, seq_len=problem.seq_len // 2 // unit * unit)
    except ValueError as error:
        raise DoesNotFit(f"{doubled}; and half the length is no valid problem ({error}) to measure what a "
                         f"token more costs") from None


def tile_multiple(config) -> int:
    """The shard lengths the tiles of `config` (any implementation's, through `to_dict`) divide, in multiples
    of `TOKEN_MULTIPLE`: a shard of another length costs whole tiles (the scan kernel pads it to them, and
    the Pallas kernels' last tile runs past its end), so the longest sequence is rounded down to them."""
    tiles = [value for part in config.to_dict().values() for name, value in part.items()
             if name.startswith("block_") and isinstance(value, int)]
    return math.lcm(TOKEN_MULTIPLE, *tiles)


def _peak(memory, platform: str) -> int | None:
    """The compiler's peak, on the platforms whose compiler counts one over the whole program (module
    docstring)."""
    return memory.peak_memory_in_bytes if platform == "tpu" else None


def _held(temp: int, arguments: int, outputs: int, peak: int | None) -> int:
    return temp + arguments + outputs if peak is None else peak


def _held_of(memory, platform: str) -> int:
    return _held(memory.temp_size_in_bytes, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                 _peak(memory, platform))


def compiled_memory(problem: Problem, devices: list, target: str, objective: str, implementation: str = "auto",
                    db: str | None = None, argument_layouts: str = "fixed") -> Report:
    """Compile what the loader runs for the problem (`implementation`, "auto" for its own choice; its
    config from the cache `db`, None for the default file, else the default tiles) on `devices` (as many as
    its ring size; a TPU topology's devices compile for that chip), its arguments laid out as
    `argument_layouts` says (module docstring), and read what one device holds; and again at twice the
    length (at half, where twice does not fit), for what a token more costs. `DoesNotFit` where the
    problem itself does not."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if argument_layouts not in ARGUMENT_LAYOUTS:
        raise ValueError(f"argument_layouts must be one of {', '.join(ARGUMENT_LAYOUTS)}, got {argument_layouts!r}")
    plan, memory = analysis(problem, devices, objective, implementation, db, argument_layouts)
    try:
        other = dataclasses.replace(problem, seq_len=2 * problem.seq_len)
        _, second = analysis(other, devices, objective, plan.backend, db, argument_layouts)
    except DoesNotFit as error:  # near the chip's limit: measured at half the length instead
        other = _halved(problem, error)
        _, second = analysis(other, devices, objective, plan.backend, db, argument_layouts)
    platform = devices[0].platform
    growth = (_held_of(second, platform) - _held_of(memory, platform)) / (other.local_len - problem.local_len)
    return Report(problem, target, objective, plan.backend, describe_config(plan.config), plan.source,
                  memory.temp_size_in_bytes, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                  floor(problem.shapes, objective, problem.ring_positions), growth, argument_layouts,
                  _peak(memory, platform), tile_multiple(plan.config), plan.reason)


def _mib(n: float) -> str:
    mib = n / 2**20
    return f"{mib:,.1f} MiB" if mib < 100 else f"{mib:,.0f} MiB"


def render(reports: list[Report], headroom: float) -> str:
    """The table `tuner memory` prints: per objective the compiler's count beside the floor, the floor's
    terms, and the longest sequence each chip of `HBM_BYTES` holds (from the last report)."""
    first, last = reports[0], reports[-1]
    p = first.problem
    lines = [f"memory   {p.describe()}",
             f"         one device, compiled for {first.target}: what the loader runs, {first.implementation} "
             f"{first.config} ({first.source}); {ARGUMENT_LAYOUTS[first.argument_layouts]}"]
    if first.source == "fallback":  # not what was asked for: say why, the kernel asked for cannot build here
        lines.append(f"         fallback: {first.reason}")
    lines += ["",
              table(["objective", "temp", "floor", "temp/floor", "arguments", "outputs", "held", "bytes a token more"],
                    [[r.objective, _mib(r.temp), _mib(r.floor_bytes), f"{r.ratio:.2f}x", _mib(r.arguments),
                      _mib(r.outputs), _mib(r.held), f"{r.growth:,.0f}"] for r in reports]),
              "held: " + ("the compiler's peak (HBM), arguments and outputs included" if first.peak is not None
                          else "temp, arguments and outputs"), ""]
    lines.append(f"floor ({last.objective}): " + ", ".join(f"{name} {_mib(n)}" for name, n in last.floor.items()))
    lines += ["", f"longest sequence with {headroom:.0%} of each chip left for the rest of the model "
                  f"({last.objective}, these heads, a ring of {p.ring_size}; from what {first.target}'s compiler "
                  f"counts, which another chip's compiler may lay out otherwise):",
              f"(a multiple of {last.multiple} tokens a device, which the plan's tiles divide)",
              table(["chip", "memory", "tokens a device", "tokens on the ring"],
                    [[chip, f"{hbm // GIB} GiB", f"{last.longest(hbm, headroom) // p.ring_size:,}",
                      f"{last.longest(hbm, headroom):,}"] for chip, hbm in HBM_BYTES.items()])]
    return "\n".join(lines)


__all__ = ["ARGUMENT_LAYOUTS", "GIB", "HBM_BYTES", "OBJECTIVES", "DoesNotFit", "Report", "compiled_memory", "floor",
           "render", "tile_multiple"]
