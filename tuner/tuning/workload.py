"""A `Problem` made runnable: a mesh, random inputs, and compiled forward / backward ring functions.

Shared by the search (candidates, the reference) and `tuner bench`. The ring runs under `shard_map`
over the first `ring_size` devices (a problem over two axes, `a2a_size` > 1: a mesh of
`ring_positions x a2a_size` devices, axes `PAIR_AXES`); inputs are global arrays in the layout's order
over the ring positions, so every device's shard carries the positions of its layout (segment ids are
laid out to match).

The backward is compiled on its own, so that it can be timed on its own: the forward returns the
residuals of `jax.vjp` as plain arrays, and the backward rebuilds the vjp from them. A program whose
lowered text a recent compile had already built is not compiled again: candidates that differ in their
backward tiles only share their forward, and the other way round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tuner.semantics import layouts
from tuner.runtime import plan
from tuner import registry
from tuner.semantics.problem import Problem
from tuner.registry import Config

AXIS = "sp"
PAIR_AXES = ("ring", "a2a")
PROGRAMS_KEPT = 16  # compiled programs a workload keeps for reuse, the most recently used
Inputs = dict[str, Any]


def relative_error(got, want) -> float:
    """Relative Frobenius error in float64; inf when `got` holds NaN or inf."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (norm if norm > 0 else 1.0))


@dataclass
class Compiled:
    """A candidate's compiled forward (and, when built, its backward) and their compile seconds."""

    forward: Callable[[Inputs], Any]
    compile_seconds: float
    forward_with_residuals: Callable[[Inputs], Any] | None = None
    backward: Callable[[Any, Any], Any] | None = None

    def gradients(self, inputs: Inputs, dout) -> Inputs:
        _, residuals = self.forward_with_residuals(inputs)
        return self.backward(residuals, dout)

    def results(self, inputs: Inputs, dout, backward: bool) -> dict[str, Any]:
        """The output (`out`), and with `backward` the gradients (`d<input>`), on `inputs`."""
        results = {"out": self.forward(inputs)}
        if backward:
            results.update({f"d{name}": g for name, g in self.gradients(inputs, dout).items()})
        return results

    def thunks(self, name: str, sets: list[tuple[Inputs, Any]], *, forward: bool = True
               ) -> dict[str, Callable[[int], Any]]:
        """Timing thunks over `(inputs, dout)` sets, run `i` on set `i % len(sets)`: `name:fwd` (unless
        `forward` is False) and, when the backward was built, `name:bwd` -- whose residuals are
        computed here, once per set, so the backward runs alone."""
        thunks: dict[str, Callable[[int], Any]] = {}
        if forward:
            thunks[f"{name}:fwd"] = lambda i: self.forward(sets[i % len(sets)][0])
        if self.backward is not None:
            residuals = [self.forward_with_residuals(inputs)[1] for inputs, _ in sets]
            thunks[f"{name}:bwd"] = lambda i: self.backward(residuals[i % len(sets)], sets[i % len(sets)][1])
        return thunks


def vjp_of(fn: Callable[[Inputs], Any], x: Inputs) -> tuple[Any, Callable[[Any], Any]]:
    """`jax.vjp` of `fn` at the inputs `x`, with respect to every input but the integer segment ids."""
    const = {n: v for n, v in x.items() if n == "segment_ids"}
    return jax.vjp(lambda d: fn({**d, **const}), {n: v for n, v in x.items() if n not in const})


class Workload:
    """Inputs and ring functions of one problem on this machine's first `ring_size` devices."""

    def __init__(self, problem: Problem, devices: list | None = None):
        devices = jax.devices() if devices is None else devices
        if len(devices) < problem.ring_size:
            raise ValueError(f"ring_size={problem.ring_size} needs {problem.ring_size} devices, "
                             f"{len(devices)} {devices[0].platform} device(s) are visible")
        self.problem = problem
        self.pair = problem.group is not None
        self.axis_name = PAIR_AXES if self.pair else AXIS
        grid = np.array(devices[:problem.ring_size]).reshape(problem.ring_positions, problem.a2a_size)
        self.mesh = Mesh(grid, PAIR_AXES) if self.pair else Mesh(grid.reshape(-1), (AXIS,))
        self.platform = devices[0].platform
        seq = P(None, self.axis_name)
        self.specs: Inputs = {"q": seq, "k": seq, "v": seq}
        if problem.segments:
            self.specs["segment_ids"] = seq
        if problem.sinks:
            self.specs["sinks"] = P()
        self._programs: OrderedDict[str, Any] = OrderedDict()  # by the digest of their lowered text
        self._programs_lock = threading.Lock()  # trials in flight compile at once

    def draw(self, seed: int, dtype: str | None = None) -> tuple[Inputs, Any]:
        """Random, non-zero inputs and an output cotangent, placed on the mesh."""
        p = self.problem
        rng = np.random.default_rng(seed)
        dtype = jnp.dtype(dtype or p.dtype)

        def normal(*shape):
            return rng.standard_normal(shape, dtype=np.float32)

        host: Inputs = {"q": normal(p.batch, p.seq_len, p.heads, p.head_dim),
                        "k": normal(p.batch, p.seq_len, p.kv_heads, p.head_dim),
                        "v": normal(p.batch, p.seq_len, p.kv_heads, p.value_dim)}
        if p.documents is not None:  # the rows' documents in token order, laid out as the problem's layout
            order = layouts.global_order(p.layout, p.seq_len, p.ring_positions)
            host["segment_ids"] = p.documents.segment_ids(p.seq_len, p.batch)[:, order]
        if p.sinks:
            host["sinks"] = normal(p.heads, p.sinks) if p.sinks > 1 else normal(p.heads)
        inputs = {name: jax.device_put(jnp.asarray(x, jnp.int32 if name == "segment_ids" else dtype),
                                       NamedSharding(self.mesh, self.specs[name]))
                  for name, x in host.items()}
        dout = jax.device_put(jnp.asarray(normal(p.batch, p.seq_len, p.heads, p.value_dim), dtype),
                              NamedSharding(self.mesh, self.specs["q"]))
        return inputs, dout

    def structs(self) -> tuple[Inputs, Any]:
        """The inputs and output cotangent `draw` makes, as sharded `jax.ShapeDtypeStruct`s: what a
        program for this problem's mesh compiles against (a TPU topology's, on any host)."""
        p = self.problem
        shapes = {"q": ((p.batch, p.seq_len, p.heads, p.head_dim), p.dtype),
                  "k": ((p.batch, p.seq_len, p.kv_heads, p.head_dim), p.dtype),
                  "v": ((p.batch, p.seq_len, p.kv_heads, p.value_dim), p.dtype)}
        if p.segments:
            shapes["segment_ids"] = ((p.batch, p.seq_len), "int32")
        if p.sinks:
            shapes["sinks"] = ((p.heads, p.sinks) if p.sinks > 1 else (p.heads,), p.dtype)

        def struct(shape, dtype, spec):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(self.mesh, spec))

        return ({n: struct(*shapes[n], self.specs[n]) for n in shapes},
                struct((p.batch, p.seq_len, p.heads, p.value_dim), p.dtype, self.specs["q"]))  # the output's

    def attend(self, name: str, config: Config, *, interpret: bool = False) -> Callable[[Inputs], Any]:
        """The global function `inputs -> output` of the registered implementation `name` with `config`,
        on this problem's ring."""
        p = self.problem
        implementation = registry.get(name)

        def local(x: Inputs):
            segments = x.get("segment_ids")
            arrays = dict(q_segment_ids=segments, kv_segment_ids=segments, softmax_aux=x.get("sinks"))
            resolved = plan.resolve(x["q"], x["k"], x["v"], ring_size=p.ring_size, layout=p.layout, backend=name,
                                    target=registry.Target(self.platform, interpret), arrays=arrays,
                                    mask=dict(causal=p.causal, sliding_window=p.window, chunk_size=p.chunk_size,
                                              logits_soft_cap=p.softcap, softmax_scale=None),
                                    axis_name=self.axis_name, group=p.group)
            return implementation.attend(x["q"], x["k"], x["v"], spec=resolved.spec, config=config,
                                         axis_name=self.axis_name, layout=p.layout, interpret=interpret, **arrays)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs,), out_specs=self.specs["q"],
                             check_vma=implementation.vma_checked(registry.Target(self.platform, interpret)))

    def compile(self, fn: Callable[[Inputs], Any], inputs: Inputs, dout, *, backward: bool) -> Compiled:
        """AOT-compile `fn`, or with `backward` its residual-saving forward and its backward (so the
        forward is timed as a training step runs it). Compile seconds are measured together. Nothing runs
        on the device, so a compile can run beside another trial's timed runs."""
        start = time.perf_counter()
        if not backward:
            return Compiled(self._compiled(jax.jit(fn).lower(inputs)), time.perf_counter() - start)
        tree: dict[str, Any] = {}

        def forward_with_residuals(x: Inputs):
            out, vjp = vjp_of(fn, x)
            leaves, tree["vjp"] = jax.tree.flatten(vjp)
            return out, leaves

        def backward_from_residuals(leaves, dout):
            (grads,) = jax.tree.unflatten(tree["vjp"], leaves)(dout)
            return grads

        with_residuals = self._compiled(jax.jit(forward_with_residuals).lower(inputs))
        _, leaves = with_residuals.out_info  # the residuals' shapes and shardings: nothing runs on the device
        backward_fn = self._compiled(jax.jit(backward_from_residuals).lower(leaves, dout))
        return Compiled(lambda x: with_residuals(x)[0], time.perf_counter() - start, with_residuals,
                        backward_fn)

    def _compiled(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """`lowered` compiled, or the program a recent compile built from the same text (module docstring)."""
        key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        with self._programs_lock:
            if key in self._programs:
                self._programs.move_to_end(key)
                return self._programs[key]
        program = lowered.compile()
        with self._programs_lock:
            self._programs[key] = program
            while len(self._programs) > PROGRAMS_KEPT:
                self._programs.popitem(last=False)
        return program

    def reference(self, inputs: Inputs, dout, backward: bool) -> dict[str, Any]:
        """The scan ring's results on `inputs` at its default tiles (with `backward`, its gradients too): what
        every candidate must reproduce. Over two axes the scan ring runs over the same devices as one axis, on
        the same tokens in its own layout, and its results are laid out back."""
        p = self.problem
        scan = registry.get(registry.FALLBACK)
        default = scan.default_config(p.shapes, p.spec)
        if not self.pair:
            return self.compile(self.attend(scan.name, default), inputs, dout,
                                backward=backward).results(inputs, dout, backward)
        line = Workload(dataclasses.replace(p, a2a_size=1), devices=list(self.mesh.devices.flat))

        def relayout(x, source: int, target: int):  # a global array laid out over `source` ring positions
            return layouts.lay_out(layouts.restore(x, p.layout, source), p.layout, target)

        def to_line(x, name: str):
            return jax.device_put(relayout(x, p.ring_positions, p.ring_size),
                                  NamedSharding(line.mesh, line.specs[name]))

        moved, moved_dout = {n: x if n == "sinks" else to_line(x, n) for n, x in inputs.items()}, to_line(dout, "q")
        compiled = line.compile(line.attend(scan.name, default), moved, moved_dout, backward=backward)
        results = compiled.results(moved, moved_dout, backward)
        return {n: x if n == "dsinks" else relayout(x, p.ring_size, p.ring_positions) for n, x in results.items()}

    def dense(self, implementation: str = "xla") -> Callable[[Inputs], Any]:
        """`jax.nn.dot_product_attention` over the global arrays with the problem's causal flag: the
        reference point of `tuner bench`. It is dense attention of the same size and work, not the
        same masks: the layout, windows, chunks, segments, sinks and softcap are not applied."""
        causal = self.problem.causal

        def dense(x: Inputs):
            return jax.nn.dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal,
                                                implementation=implementation)
        return dense
