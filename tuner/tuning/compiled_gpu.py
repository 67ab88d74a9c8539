"""`tuner search --device gpu --dry-run --target h100`: every Triton launch of the problem's search space
compiled for a GPU architecture on a host without a GPU, judged by the compiler's verdict, and ranked
by the roofline model (`tuner.models.gpu_model`). The Triton ring's, or with `--backend
all_to_all_triton` (any implementation over the Triton kernel; `--a2a-size`: the hybrid) that one's: the
kernel's launches on what it runs there.

For each target (a GPU of `gpu_model.GPUS`), each distinct launch of the search space -- the forward at
its points, the dK/dV kernel at the backward points, the dQ kernel at its tiles with the backward's
warps and stages -- is compiled as jax_triton compiles it (`tuner.kernels.triton_compile.resources`). A launch
that does not compile, spills registers, needs more shared memory than a block may use or fits no SM
is ruled out with the compiler's reason (`triton_compile.ruled_out`, the rule a search on that GPU prunes
with). The model times the others; the best forward and the best pair of backward kernels that share
their warps and stages (`BwdParams` holds one of each) make the target's config, written to the cache
as a `compiled` row for that GPU's device kind: the loader uses it there when no measured row exists
for the problem, and says so; nothing treats it as a measurement.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from tuner import registry
from tuner.cache import Cache, make_row
from tuner.kernels import codegen, triton, triton_compile, triton_launch
from tuner.kernels.params import BwdParams, FwdParams
from tuner.models import gpu_model
from tuner.semantics.problem import Problem
from tuner.strategies.configs import TileConfig
from tuner.support.tables import describe_config, error_line, table
from tuner.support.version import __version__

TARGETS = tuple(gpu_model.GPUS)  # `--target all`


@dataclass
class Launch:
    """One kernel launch of the space on one target: the compiler's verdict, the reason it is ruled
    out (None: admitted) and, when admitted, the model's prediction."""

    kernel: str
    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int
    verdict: dict[str, Any] = field(default_factory=dict)
    ruled_out: str | None = None
    predicted: gpu_model.Prediction | None = None

    @property
    def label(self) -> str:
        return f"{self.block_q}x{self.block_kv} w{self.num_warps} s{self.num_stages}"


def _verdict(task: tuple[codegen.Variant, str, dict[str, Any], int, int, int]) -> dict[str, Any]:
    """Compile one launch (in a worker process, or here) and return `triton_compile.resources`' report, or the
    compiler's error."""
    source, kernel, constants, warps, stages, capability = task
    try:
        return triton_compile.resources(source, kernel, constants, num_warps=warps, num_stages=stages,
                                capability=capability)
    except Exception as error:  # noqa: BLE001 - the compiler's refusal is the verdict
        return {"error": error_line(error, limit=300)}


def verdicts(tasks: list[tuple], *, workers: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """The verdict of each task `(variant, kernel, constants, warps, stages, capability)`, in order: in
    `workers` processes (default: one per CPU), or in this process with one worker."""
    workers = workers or os.cpu_count() or 1
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    if workers == 1:
        for i, task in enumerate(tasks):
            results[i] = _verdict(task)
            if progress is not None:
                progress(i + 1, len(tasks))
        return results
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_verdict, task): i for i, task in enumerate(tasks)}
        for done, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            if progress is not None:
                progress(done, len(tasks))
    return results


def predict(problem: Problem, gpu: gpu_model.Gpu, launches: Iterable[Launch],
            implementation: str = gpu_model.MODELLED) -> None:
    """Rule out each launch by its verdict and give the admitted ones the model's prediction, as the kernel
    runs inside `implementation`."""
    for launch in launches:
        launch.ruled_out = triton_compile.ruled_out(launch.verdict, gpu.arch)
        if launch.ruled_out is None:
            launch.predicted = gpu_model.predict(problem, gpu, launch.kernel, launch.block_q, launch.block_kv,
                                                 launch.num_warps, launch.num_stages, launch.verdict, implementation)


def _order(launch: Launch) -> tuple[float, int]:
    return launch.predicted.seconds, launch.verdict["shared"]  # ties: the smaller shared memory


def choose(launches: list[Launch]) -> tuple[Launch, Launch, Launch] | None:
    """The model's best admitted forward, and the best admitted dK/dV and dQ launches that share their
    warps and stages (the sum of their times); None when a kernel has no admitted launch."""
    admitted = [launch for launch in launches if launch.predicted is not None]
    forward = [launch for launch in admitted if launch.kernel == "attention_fwd"]
    pairs = []
    for setting in {(launch.num_warps, launch.num_stages) for launch in admitted}:
        dkv = [x for x in admitted if x.kernel == "attention_dkv" and (x.num_warps, x.num_stages) == setting]
        dq = [x for x in admitted if x.kernel == "attention_dq" and (x.num_warps, x.num_stages) == setting]
        if dkv and dq:
            pairs.append((min(dkv, key=_order), min(dq, key=_order)))
    if not forward or not pairs:
        return None
    dkv, dq = min(pairs, key=lambda pair: (pair[0].predicted.seconds + pair[1].predicted.seconds,
                                           pair[0].verdict["shared"] + pair[1].verdict["shared"]))
    return min(forward, key=_order), dkv, dq


def config_of(fwd: Launch, dkv: Launch, dq: Launch) -> TileConfig:
    """The backend's config of the three chosen launches."""
    return TileConfig(FwdParams(block_q=fwd.block_q, block_kv=fwd.block_kv, num_warps=fwd.num_warps,
                                num_stages=fwd.num_stages),
                      BwdParams(block_q_dkv=dkv.block_q, block_kv_dkv=dkv.block_kv, block_q_dq=dq.block_q,
                                block_kv_dq=dq.block_kv, num_warps=dkv.num_warps, num_stages=dkv.num_stages))


@dataclass
class GpuReport:
    """The launches of one target and the config they lead to (None when a kernel has no admitted
    launch)."""

    target: str
    gpu: gpu_model.Gpu
    problem: Problem
    launches: list[Launch]
    seconds: float
    implementation: str = gpu_model.MODELLED  # the registered implementation compiled, over the Triton kernel

    @property
    def chosen(self) -> tuple[Launch, Launch, Launch] | None:
        return choose(self.launches)

    @property
    def config(self) -> TileConfig | None:
        chosen = self.chosen
        return None if chosen is None else config_of(*chosen)

    @property
    def predicted(self) -> float:
        """The model's seconds of `config`, forward and backward."""
        return sum(launch.predicted.seconds for launch in self.chosen)

    def render(self, top: int = 5) -> str:
        """Per kernel: launches, how many the verdict rules out (by reason), the model's best `top`."""
        rows, reasons = [], Counter()
        for kernel in triton_launch.KERNEL_ARGS:
            mine = [launch for launch in self.launches if launch.kernel == kernel]
            admitted = sorted((launch for launch in mine if launch.predicted is not None), key=_order)
            reasons.update(reason_kind(launch.ruled_out) for launch in mine if launch.ruled_out is not None)
            for rank, launch in enumerate(admitted[:top], 1):
                v, p = launch.verdict, launch.predicted
                rows.append([kernel if rank == 1 else "", f"{len(admitted)}/{len(mine)}" if rank == 1 else "",
                             launch.label, v["registers"], f"{v['shared'] // 1024}", v["mma"],
                             v["blocks_per_sm"], f"{p.utilization:.2f}", f"{p.seconds * 1e3:.3f}", f"{p.tflops:.0f}"])
        inside = "" if self.implementation == gpu_model.MODELLED else f", {self.implementation}"
        lines = [f"{self.target} ({self.gpu.device_kind}, sm_{self.gpu.arch}{inside}): {len(self.launches)} launches "
                 f"compiled in {self.seconds:.0f} s",
                 table(["kernel", "admitted", "best by the model", "regs", "smem KiB", "mma", "blocks/SM", "use",
                        "model ms", "TFLOP/s"], rows)]
        lines += [f"ruled out  {count} x {reason}" for reason, count in reasons.most_common()]
        if self.config is not None:
            lines.append(f"best     {describe_config(self.config)}: {self.predicted * 1e3:.3f} ms fwd+bwd by the "
                         f"model")
        return "\n".join(lines)


def reason_kind(reason: str) -> str:
    """A verdict's reason without its numbers, to count alike reasons together."""
    for words, kind in (("spills", "spills registers"), ("shared memory", "over the shared memory of a block"),
                        ("fits no SM", "fits no SM"), ("does not compile", "does not compile")):
        if words in reason:
            return kind
    return reason


def _sample(launches: list[Launch], sample: int, default: TileConfig) -> list[Launch]:
    """Per kernel, the default's launch and `sample` others spread evenly over the space's order."""
    wanted = {(kernel, bq, bk, params.num_warps, params.num_stages)
              for kernel, bq, bk, params in triton_launch.launches(default.fwd, default.bwd)}
    kept = []
    for kernel in triton_launch.KERNEL_ARGS:
        mine = [launch for launch in launches if launch.kernel == kernel]
        first = [x for x in mine if (x.kernel, x.block_q, x.block_kv, x.num_warps, x.num_stages) in wanted]
        others = [x for x in mine if x not in first]
        step = len(others) / sample if sample and others else 0
        kept += first + ([others[int(i * step)] for i in range(min(sample, len(others)))] if step else [])
    return kept


def compile_gpu_target(problem: Problem, target: str, *, sample: int | None = None, workers: int | None = None,
                       progress: Callable[[int, int], None] | None = None,
                       implementation: str = gpu_model.MODELLED) -> GpuReport:
    """Compile, rule out and rank the Triton launches of `problem` for the GPU `target` (module
    docstring), as the kernel runs inside `implementation` (the Triton ring, or another over the Triton
    kernel: its launches on what the kernel runs there, `registry.tile_shapes`); with `sample`, only the
    default's launches and `sample` others of each kernel. `ValueError` naming the target when the model
    has no such GPU, or when the implementation cannot take the problem."""
    if target not in gpu_model.GPUS:
        raise ValueError(f"--target {target}: no such GPU in the model; GPU targets: {', '.join(TARGETS)}")
    gpu = gpu_model.GPUS[target]
    backend = triton.TritonBackend()
    runs = registry.taking(implementation, problem)
    started = time.perf_counter()
    shapes, spec = registry.problem_tile_shapes(runs, problem), problem.spec
    launches = [Launch(*launch) for launch in triton.space_launches(shapes, spec)]
    if sample is not None:
        default = TileConfig(*backend.default_params(shapes.q_len, shapes.kv_len, *shapes.head_dims,
                                                     capability=gpu.arch))
        launches = _sample(launches, sample, default)
    source = triton_launch.variant(spec, shapes.dtype, shapes.head_dim, shapes.value_dim)
    tasks = [(source, x.kernel, triton_launch.launch_constants(shapes, spec, x.block_q, x.block_kv), x.num_warps,
              x.num_stages, gpu.arch) for x in launches]
    for launch, verdict in zip(launches, verdicts(tasks, workers=workers, progress=progress)):
        launch.verdict = verdict
    predict(problem, gpu, launches, implementation)
    return GpuReport(target, gpu, problem, launches, time.perf_counter() - started, implementation)


def store(report: GpuReport, db=None) -> dict | None:
    """Write the target's config as a `compiled` cache row for its device kind (None when it has none):
    `best_s` is the model's fwd+bwd seconds, never a measurement; the trial fields count the launches
    compiled and ruled out."""
    config = report.config
    if config is None:
        return None
    implementation = registry.get(report.implementation)
    key = registry.problem_key(report.problem, implementation.name, report.gpu.device_kind)
    reasons = Counter(reason_kind(x.ruled_out) for x in report.launches if x.ruled_out is not None)
    row = make_row(key, config, versions=registry.versions(implementation), tool_version=__version__,
                   source="compiled", objective="fwd+bwd", best_s=report.predicted, default_s=None, speedup=None,
                   trials_run=sum(x.ruled_out is None for x in report.launches),
                   trials_pruned=sum(reasons.values()), trials_failed={},
                   study=f"compiled for {report.target} (sm_{report.gpu.arch}), ranked by the model of "
                         f"tuner.models.gpu_model")
    Cache(db).put(row)
    return row


__all__ = ["GpuReport", "Launch", "TARGETS", "choose", "compile_gpu_target", "config_of", "predict",
           "reason_kind", "store", "verdicts"]
