"""Launching the Triton backend's kernels: the rendered variant, its compile-time constants, the kernels a
config launches, their grids and tile schedules, and the call.

On a GPU the kernels run through `jax_triton.triton_call`. With `interpret=True` the same rendered
kernels run in Triton's interpreter on the CPU, on torch CPU tensors, in a separate process
(`triton_worker.py`: Triton fixes at import time whether it interprets), reached from JAX through
`jax.pure_callback`; simulated devices call back from several threads, and the interpreter is not
thread-safe, so the calls are serialized. Nothing is imported until it is used: `import tuner` works
without triton, torch or jax-triton.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tuner.kernels import codegen
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics import masks
from tuner.semantics.spec import AttentionSpec, LocalShapes

TEMPLATE = "attention.py.j2"

# The template's kernels and their arguments, in order.
KERNEL_ARGS = {
    "attention_fwd": ("Q", "K", "V", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count", "Full", "Out", "Lse"),
    "attention_dkv": ("Q", "K", "V", "DO", "Lse", "Delta", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count",
                      "Full", "DK", "DV"),
    "attention_dq": ("Q", "K", "V", "DO", "Lse", "Delta", "QPos", "KPos", "QSeg", "KSeg", "Schedule", "Count",
                     "Full", "DQ"),
}


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def pow2_at_least(n: int) -> int:
    """The power of two >= 16 that a tile of `n` rows or columns spans (what `tl.arange` and `tl.dot` take)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def variant(spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None) -> codegen.Variant:
    """The rendered module for these features (window / chunk / softcap values stay compile-time
    parameters, so one module serves every value); `value_head_dim` None means `head_dim`."""
    name = _dtype_name(dtype)
    return codegen.Variant("triton", TEMPLATE, {
        "causal": spec.causal, "window": spec.window is not None, "chunk": spec.chunk_size is not None,
        "segments": spec.has_segments, "softcap": spec.softcap is not None, "dtype": name,
        "head_dim": head_dim, "value_head_dim": value_head_dim or head_dim,
        "precision": "ieee" if name == "float32" else "tf32"})


def _constants(spec: AttentionSpec, q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int,
               block_q: int, block_kv: int, *, value_head_dim: int | None = None) -> dict[str, Any]:
    """The kernels' compile-time parameters: tiles cut to the power-of-two-rounded lengths, head dims with
    their padded tile widths (`value_head_dim` None means `head_dim`)."""
    left, right = spec.window if spec.window is not None else (0, 0)
    block_q, block_kv = min(block_q, pow2_at_least(q_len)), min(block_kv, pow2_at_least(kv_len))
    value_head_dim = value_head_dim or head_dim
    return dict(Q_LEN=q_len, KV_LEN=kv_len, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                V_HEAD_DIM=value_head_dim, HEAD_DIM_PADDED=pow2_at_least(head_dim),
                V_HEAD_DIM_PADDED=pow2_at_least(value_head_dim), SCALE=float(spec.scale),
                SOFTCAP=float(spec.softcap or 0.0), WINDOW_LEFT=left, WINDOW_RIGHT=right, CHUNK=spec.chunk_size or 1,
                BLOCK_Q=block_q, BLOCK_KV=block_kv,
                NUM_Q_TILES=-(-q_len // block_q), NUM_KV_TILES=-(-kv_len // block_kv))


def launch_constants(shapes: LocalShapes, spec: AttentionSpec, block_q: int, block_kv: int) -> dict[str, Any]:
    """The compile-time parameters of a launch with these tiles for one device's shapes."""
    return _constants(spec, shapes.q_len, shapes.kv_len, shapes.heads, shapes.kv_heads, shapes.head_dim, block_q,
                      block_kv, value_head_dim=shapes.value_dim)


def launches(fwd: FwdParams | None, bwd: BwdParams | None) -> list[tuple[str, int, int, FwdParams | BwdParams]]:
    """(kernel, block_q, block_kv, params) of each kernel the given parts launch: the forward with `fwd`, the
    dk/dv and dq kernels with `bwd`."""
    kernels = [] if fwd is None else [("attention_fwd", fwd.block_q, fwd.block_kv, fwd)]
    if bwd is not None:
        kernels += [("attention_dkv", bwd.block_q_dkv, bwd.block_kv_dkv, bwd),
                    ("attention_dq", bwd.block_q_dq, bwd.block_kv_dq, bwd)]
    return kernels


# --------------------------------------------------------------------------------------------------
# Launching: jax_triton on a GPU, or the interpreter through a host callback.
# --------------------------------------------------------------------------------------------------


class _Interpreter:
    """The interpreter process (`triton_worker.py`), started on first use; one request at a time."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            worker = Path(__file__).with_name("triton_worker.py")
            self._process = subprocess.Popen([sys.executable, "-P", str(worker)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env={**os.environ, "TRITON_INTERPRET": "1"})
            atexit.register(self._process.kill)
        return self._process

    def _ask(self, request: dict) -> dict:
        with self._lock:
            process = self._start()
            pickle.dump(request, process.stdin)
            process.stdin.flush()
            try:
                return pickle.load(process.stdout)
            except EOFError:
                raise RuntimeError(f"the Triton interpreter process exited (status {process.wait()})") from None

    def run(self, source: codegen.Variant, module: Path, kernel: str, grid: tuple, arrays: list[np.ndarray],
            out_shapes: list, constants: dict) -> list[np.ndarray]:
        """Run `kernel` of the variant's rendered `module`. The process runs the file only if it holds the
        variant's rendering (by sha256); one that does not (changed or removed since it was rendered) is
        rendered again and the request retried once."""
        packed = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            name = a.dtype.name
            packed.append(((a.view(np.int16) if name == "bfloat16" else a).tobytes(), name if name ==
                           "bfloat16" else a.dtype.str, a.shape))
        request = {"module": str(module.absolute()), "sha256": codegen.sha256(codegen.render_source(source)),
                   "kernel": kernel, "grid": grid, "args": packed, "out_shapes": [tuple(s.shape) for s in out_shapes],
                   "constants": constants}
        reply = self._ask(request)
        if "mismatch" in reply:
            codegen.render(source, module.parent)
            reply = self._ask(request)
        if "mismatch" in reply:
            raise RuntimeError(f"Triton's interpreter refused {kernel}: {reply['mismatch']}")
        if "error" in reply:
            raise RuntimeError(f"{kernel} failed in Triton's interpreter:\n{reply['error']}")
        return reply["outputs"]


_INTERPRETER = _Interpreter()


def _interpret(source: codegen.Variant, kernel: str, grid, inputs, out_shapes, constants):
    module = codegen.render(source)

    def host(*arrays):
        return tuple(_INTERPRETER.run(source, module, kernel, grid, [np.asarray(a) for a in arrays], out_shapes,
                                      constants))

    return jax.pure_callback(host, tuple(out_shapes), *inputs, vmap_method="sequential")


def _launch(kernel_name: str, spec: AttentionSpec, inputs: list, out_shapes: list, grid: tuple,
            constants: dict, num_warps: int | None, num_stages: int | None, interpret: bool, dtype):
    source = variant(spec, dtype, constants["HEAD_DIM"], constants["V_HEAD_DIM"])
    if interpret:
        return _interpret(source, kernel_name, grid, inputs, out_shapes, constants)
    import jax_triton

    kernel = getattr(codegen.load(source), kernel_name)

    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    return jax_triton.triton_call(*inputs, kernel=kernel, out_shape=out_shapes, grid=grid, **launch,
                                  **constants)


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, spec: AttentionSpec, params: FwdParams,
            interpret: bool = False):
    """The forward kernel on one query block against one key block: the output and the log-sum-exp."""
    b, tq, h, d = q.shape
    tk, hkv, d_v = v.shape[1:]
    constants = _constants(spec, tq, tk, h, hkv, d, params.block_q, params.block_kv, value_head_dim=d_v)
    q_seg, kv_seg = (q_pos, kv_pos) if q_seg is None else (q_seg, kv_seg)
    schedule = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, constants["BLOCK_Q"],
                                   constants["BLOCK_KV"])
    out_shapes = [jax.ShapeDtypeStruct((b, tq, h, d_v), jnp.float32), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)]
    grid = (constants["NUM_Q_TILES"], b * h)
    out, lse = _launch("attention_fwd", spec, [q, k, v, q_pos, kv_pos, q_seg, kv_seg, *schedule], out_shapes,
                       grid, constants, params.num_warps, params.num_stages, interpret, q.dtype)
    return out, lse


def backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, *, spec: AttentionSpec, params: BwdParams,
             interpret: bool = False):
    """The dk/dv kernel, then the dq kernel, on one query block against one key block: dq, dk, dv."""
    b, tq, h, d = q.shape
    tk, hkv, d_v = v.shape[1:]
    q_seg, kv_seg = (q_pos, kv_pos) if q_seg is None else (q_seg, kv_seg)
    inputs = [q, k, v, do.astype(q.dtype), lse, delta, q_pos, kv_pos, q_seg, kv_seg]
    dkv = _constants(spec, tq, tk, h, hkv, d, params.block_q_dkv, params.block_kv_dkv, value_head_dim=d_v)
    by_key = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, dkv["BLOCK_Q"], dkv["BLOCK_KV"],
                                 by_key=True)
    kv_shapes = [jax.ShapeDtypeStruct((b, tk, hkv, dim), jnp.float32) for dim in (d, d_v)]
    dk, dv = _launch("attention_dkv", spec, [*inputs, *by_key], kv_shapes, (dkv["NUM_KV_TILES"], b * hkv), dkv,
                     params.num_warps, params.num_stages, interpret, q.dtype)
    dq_constants = _constants(spec, tq, tk, h, hkv, d, params.block_q_dq, params.block_kv_dq,
                              value_head_dim=d_v)
    by_query = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, dq_constants["BLOCK_Q"],
                                   dq_constants["BLOCK_KV"])
    (dq,) = _launch("attention_dq", spec, [*inputs, *by_query], [jax.ShapeDtypeStruct((b, tq, h, d), jnp.float32)],
                    (dq_constants["NUM_Q_TILES"], b * h), dq_constants, params.num_warps,
                    params.num_stages, interpret, q.dtype)
    return dq, dk, dv
