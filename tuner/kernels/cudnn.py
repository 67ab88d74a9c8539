"""The cudnn backend: cuDNN's fused flash attention as the engine of each ring step (NVIDIA GPUs).

cuDNN computes a whole block under one of the masks it expresses, chosen when the program is built:
none, or causal on the diagonal (top-left: key j for query i when j <= i), with a sliding window there.
A ring step's block is not always one of those: in the zigzag layout a device's shard is two halves of
the sequence, so a block pairs halves that are wholly visible, wholly hidden, or on the diagonal. So,
under a position mask, the block is cut into `block_q` x `block_kv` chunks (half the shard by default),
and each chunk pair runs the call of its kind (`tuner.kernels.cudnn_pairs`): nothing (SKIP), cuDNN
without a mask (FULL), cuDNN causal with the window's left side (DIAGONAL), or the scan kernel, exact
for every mask and slower (GENERAL: a window cut off the diagonal, a striped shard, positions you
passed; `auto` and the search choose by measurement, so a layout that lands here loses to the Triton
kernels). What the trace knows of the positions (`knowing`) decides as much as it can there; the rest
is decided on the device. A GPU branch waits for its predicate and writes its results out in float32
at its boundary. XLA:GPU copies every slice it feeds to cuDNN, so two cases read none: a step's own keys
under a causal mask without a window are one causal call over the shard (positions rise along it), and
the zigzag halves that run past the first step are one call on prefixes (`cudnn_pairs.halves_as_prefixes`).

Without a position mask a block is one cuDNN call, whatever the tiles. Chunk results merge into the
running output and lse in float32 (cuDNN returns each chunk's output in the input dtype); the backward's
dq, dk and dv add up in float32.

The backward takes the final output and lse, as every kernel's does. cuDNN computes `delta = rowsum(do *
o)` itself, while the ring's delta also holds the lse's cotangent (and was summed before `do` was rounded
to the input dtype). Where the two differ by more than the input dtype's resolution of delta, a second
call adds the difference: cuDNN's backward with zero values, `do` a unit vector and `o` the difference
along it gives exactly `d logits = p * difference`, whose dq and dk are the missing terms. That check is
a branch on the device. Where the caller does not ask for the lse (`return_lse=False`, the default), its
cotangent is zero and the ring says so (`knowing(..., lse_cotangent=False)`): the two deltas then differ
by rounding only (at most half the dtype's resolution, with sinks' float32 output), the check could never
fire, and the backward has neither it nor its branch.

`interpret=True` runs the same code with the XLA twin engine (`cudnn_engine.XlaEngine`): the CPU's
tests run this module's chunking, classification, merges and the lse correction against float64.
Segment ids, a soft cap, bias, chunked attention and a window that looks right are refused
(`supports`); bfloat16 and float16 only (cuDNN's flash attention has no float32); head dims multiples of
8 up to 256 (on Hopper and later; 128 before), values' head dim equal or, with cuDNN 9.10+ on Hopper,
different (192 and 128).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tuner.kernels import cudnn_engine, cudnn_pairs, scan_kernel
from tuner.kernels.cudnn_pairs import (GENERAL, added_at, at, chosen_offsets, chunks, decided, halves_as_prefixes,
                                       known_kind, plan, prefix_lengths, swapped)
from tuner.kernels.base import MergedBlocks, SearchSpace, merge, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.known import KnownBlock
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support import vma
from tuner.support.targets import compile_target

F32 = jnp.float32
GENERAL_TILE = 128  # the scan kernel's tiles on a GENERAL chunk pair
DTYPES = ("bfloat16", "float16")


def _window(spec: AttentionSpec) -> int | None:
    """The keys back from a query that cuDNN's causal mask keeps on a DIAGONAL chunk pair of `spec`."""
    return None if spec.window is None else spec.window[0]


def forward(q, k, v, q_pos, kv_pos, *, spec: AttentionSpec, params: FwdParams, interpret: bool,
            known: KnownBlock | None = None):
    """`(o, lse)` in float32 of one query block against one key block (the kernel contract). A block
    whose every known case is one kind runs as one call, whatever the chunks."""
    engine = cudnn_engine.engine(interpret)
    if not spec.has_position_mask:
        o, lse = engine.forward(q, k, v, scale=spec.scale, causal=False, window=None)
        return o.astype(F32), lse
    window = _window(spec)
    size_q, size_kv = min(params.block_q, q.shape[1]), min(params.block_kv, k.shape[1])
    scan_tiles = dict(block_q=min(GENERAL_TILE, size_q), block_kv=min(GENERAL_TILE, size_kv))

    def cudnn(masked: bool):
        def run(q_, k_, v_, qp, kp):
            o, lse = engine.forward(q_, k_, v_, scale=spec.scale, causal=masked, window=window if masked else None)
            return o.astype(F32), lse
        return run

    def general(q_, k_, v_, qp, kp):
        return scan_kernel.forward(q_, k_, v_, qp, kp, None, None, None, spec=spec, **scan_tiles)

    def skip(q_, k_, v_, qp, kp):
        b, t, h, _ = q_.shape
        return jnp.zeros((b, t, h, v_.shape[3]), F32), jnp.full((b, h, t), -jnp.inf, F32)

    branches = (skip, cudnn(False), cudnn(True), general)
    whole = known_kind(spec, known)
    if whole is not None and whole != GENERAL:
        return decided(whole, spec, branches, q, q_pos, kv_pos, q, k, v)
    kinds, candidates, one = plan(spec, known, q.shape[1], k.shape[1], size_q, size_kv)
    if halves_as_prefixes(kinds, candidates, one, q.shape[1] // size_q, k.shape[1] // size_kv):
        lengths = prefix_lengths(spec, candidates, q_pos, kv_pos, size_q, size_kv)
        o, lse = engine.forward(swapped(q), k, v, scale=spec.scale, causal=False, window=None, lengths=lengths)
        rows = _rows(lengths, q.shape[1])
        return (swapped(jnp.where(rows[:, :, None, None], o.astype(F32), 0.0)),
                swapped(jnp.where(rows[:, None, :], lse, -jnp.inf), axis=2))
    key_chunks = list(zip(chunks(k, size_kv), chunks(v, size_kv), chunks(kv_pos, size_kv)))
    outs, lses = [], []
    for i, (q_, qp) in enumerate(zip(chunks(q, size_q), chunks(q_pos, size_q))):
        row = None  # the running (o, lse) of this query chunk; None while it has read nothing
        for j, (k_, v_, kp) in enumerate(key_chunks):
            if (i, j) in kinds:
                pair = decided(kinds[i, j], spec, branches, q, qp, kp, q_, k_, v_)
                row = pair if row is None else merge(*row, *pair)
        o, lse = row if row is not None else (vma.like(x, q) for x in skip(q_, k, v, qp, kv_pos))
        outs.append(o)
        lses.append(lse)
    o, lse = jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)
    if one is None:
        return o, lse
    at_q, at_kv = chosen_offsets(spec, candidates, size_q, size_kv, q_pos, kv_pos)
    pair = decided(one, spec, branches, q, at(q_pos, at_q, size_q), at(kv_pos, at_kv, size_kv),
                   at(q, at_q, size_q), at(k, at_kv, size_kv), at(v, at_kv, size_kv))
    o_, lse_ = merge(at(o, at_q, size_q), at(lse, at_q, size_q, 2), *pair)
    return (lax.dynamic_update_slice_in_dim(o, o_, at_q, axis=1),
            lax.dynamic_update_slice_in_dim(lse, lse_, at_q, axis=2))


def _rows(lengths: tuple, length: int):
    """`[B, length]`: whether each row lies within the first of a padding mask's `lengths`."""
    return jnp.arange(length)[None] < lengths[0][:, None]


def _engine_backward(engine, spec: AttentionSpec, q, k, v, o, lse, do, delta, *, causal: bool,
                     window: int | None, correct: bool, lengths: tuple | None = None):
    """dq, dk, dv (float32) of one chunk pair by `engine`, with the lse correction where `correct` (module
    docstring); under a padding mask (`lengths`), zero past its lengths."""
    call = dict(scale=spec.scale, causal=causal, window=window, lengths=lengths)
    dq, dk, dv = (x.astype(F32) for x in engine.backward(q, k, v, o, lse, do, **call))
    if not correct:
        return dq, dk, dv
    do32, o32 = do.astype(F32), o.astype(F32)
    difference = jnp.einsum("bqhd,bqhd->bhq", do32, o32) - delta  # [B, H, Tq]: cuDNN's delta less the ring's
    resolution = float(jnp.finfo(q.dtype).eps) * jnp.einsum("bqhd,bqhd->bhq", jnp.abs(do32), jnp.abs(o32))

    def corrected(grads):
        dq, dk = grads
        unit = jnp.zeros(do.shape, do.dtype).at[..., 0].set(1)
        along = jnp.zeros(o.shape, o.dtype).at[..., 0].set(-jnp.swapaxes(difference, 1, 2).astype(o.dtype))
        dq_c, dk_c, _ = engine.backward(q, k, jnp.zeros_like(v), along, lse, unit, **call)
        return dq + dq_c.astype(F32), dk + dk_c.astype(F32)

    dq, dk = lax.cond(jnp.any(jnp.abs(difference) > resolution), corrected, lambda grads: grads, (dq, dk))
    return dq, dk, dv


def _masked_grads(dq, dk, dv, lengths: tuple | None):
    """dq, dk, dv zero past a padding mask's lengths (what cuDNN leaves there is not documented)."""
    if lengths is None:
        return dq, dk, dv
    keys = (jnp.arange(dk.shape[1])[None] < lengths[1][:, None])[:, :, None, None]
    return (jnp.where(_rows(lengths, dq.shape[1])[:, :, None, None], dq, 0.0), jnp.where(keys, dk, 0.0),
            jnp.where(keys, dv, 0.0))


def backward(q, k, v, o, lse, do, delta, q_pos, kv_pos, *, spec: AttentionSpec, params: BwdParams,
             interpret: bool, known: KnownBlock | None = None, lse_cotangent: bool = True):
    """`(dq, dk, dv)` in float32 of one query block against one key block (the kernel contract). A block
    whose every known case is one kind runs as one call, whatever the chunks; without `lse_cotangent`
    (`delta` is `rowsum(do * o)`), no pair has the lse correction."""
    engine = cudnn_engine.engine(interpret)
    if not spec.has_position_mask:
        return _engine_backward(engine, spec, q, k, v, o, lse, do, delta, causal=False, window=None,
                                correct=lse_cotangent)
    window = _window(spec)
    size_q, size_kv = min(params.block_q_dkv, q.shape[1]), min(params.block_kv_dkv, k.shape[1])

    def cudnn(masked: bool):
        def run(q_, k_, v_, o_, lse_, do_, delta_, qp, kp):
            return _engine_backward(engine, spec, q_, k_, v_, o_, lse_, do_, delta_, causal=masked,
                                    window=window if masked else None, correct=lse_cotangent)
        return run

    def general(q_, k_, v_, o_, lse_, do_, delta_, qp, kp):
        dq, dk, dv, _ = scan_kernel.backward(
            q_, k_, v_, lse_, do_, delta_, qp, kp, None, None, None, spec=spec,
            dkv_tiles=(min(GENERAL_TILE, size_q), min(GENERAL_TILE, size_kv)), dq_tiles=None)
        return dq, dk, dv

    def skip(q_, k_, v_, *rest):
        return jnp.zeros(q_.shape, F32), jnp.zeros(k_.shape, F32), jnp.zeros(v_.shape, F32)

    def zeros(x):
        return vma.like(jnp.zeros(x.shape, F32), q)

    branches = (skip, cudnn(False), cudnn(True), general)
    whole = known_kind(spec, known)
    if whole is not None and whole != GENERAL:
        return decided(whole, spec, branches, q, q_pos, kv_pos, q, k, v, o, lse, do, delta)
    kinds, candidates, one = plan(spec, known, q.shape[1], k.shape[1], size_q, size_kv)
    if halves_as_prefixes(kinds, candidates, one, q.shape[1] // size_q, k.shape[1] // size_kv):
        lengths = prefix_lengths(spec, candidates, q_pos, kv_pos, size_q, size_kv)
        dq, dk, dv = _masked_grads(*_engine_backward(
            engine, spec, swapped(q), k, v, swapped(o), swapped(lse, axis=2), swapped(do), swapped(delta, axis=2),
            causal=False, window=None, correct=lse_cotangent, lengths=lengths), lengths)
        return swapped(dq), dk, dv
    key_chunks = list(zip(chunks(k, size_kv), chunks(v, size_kv), chunks(kv_pos, size_kv)))
    dks, dvs = [None] * len(key_chunks), [None] * len(key_chunks)  # None while no pair added into them
    dqs = []
    query_chunks = zip(*(chunks(x, size_q) for x in (q, o, do, q_pos)), chunks(lse, size_q, 2),
                       chunks(delta, size_q, 2))
    for i, (q_, o_, do_, qp, lse_, delta_) in enumerate(query_chunks):
        dq = None
        for j, (k_, v_, kp) in enumerate(key_chunks):
            if (i, j) not in kinds:
                continue
            dq_c, dk_c, dv_c = decided(kinds[i, j], spec, branches, q, qp, kp, q_, k_, v_, o_, lse_, do_, delta_)
            dq = dq_c if dq is None else dq + dq_c
            dks[j] = dk_c if dks[j] is None else dks[j] + dk_c
            dvs[j] = dv_c if dvs[j] is None else dvs[j] + dv_c
        dqs.append(zeros(q_) if dq is None else dq)
    dks = [zeros(k_) if dk is None else dk for dk, (k_, _, _) in zip(dks, key_chunks)]
    dvs = [zeros(v_) if dv is None else dv for dv, (_, v_, _) in zip(dvs, key_chunks)]
    dq, dk, dv = (jnp.concatenate(x, axis=1) for x in (dqs, dks, dvs))
    if one is None:
        return dq, dk, dv
    at_q, at_kv = chosen_offsets(spec, candidates, size_q, size_kv, q_pos, kv_pos)
    q_, o_, lse_, do_, delta_ = (at(x, at_q, size_q, axis) for x, axis in ((q, 1), (o, 1), (lse, 2), (do, 1),
                                                                           (delta, 2)))
    dq_c, dk_c, dv_c = decided(one, spec, branches, q, at(q_pos, at_q, size_q), at(kv_pos, at_kv, size_kv),
                               q_, at(k, at_kv, size_kv), at(v, at_kv, size_kv), o_, lse_, do_, delta_)
    return added_at(dq, dq_c, at_q), added_at(dk, dk_c, at_kv), added_at(dv, dv_c, at_kv)


def cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed: with it, XLA:GPU compiles for a GPU topology on a host
    without one (`jax.experimental.topologies`, `benchmarks/gpu/xla_gpu_compile.py`)."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") is not None for major in (12, 13))


class CudnnBackend(MergedBlocks):
    """cuDNN's flash attention per chunk pair of a ring step (module docstring); `known`, the positions the
    trace knows the steps' blocks have (`knowing`), or None."""

    name = "cudnn"
    masked_tile = None  # the default chunks hold under every mask
    decides_in_trace = True

    def __init__(self, known: KnownBlock | None = None, lse_cotangent: bool = True):
        self.known = known
        self.lse_cotangent = lse_cotangent

    def knowing(self, known: KnownBlock | None, *, lse_cotangent: bool = True) -> CudnnBackend:
        """This kernel for steps whose positions the trace knows: each chunk pair that is one kind in every
        known case runs that kind's call with no branch on the device, and a block that is one kind
        as a whole runs as one call. Without an lse cotangent, the backward has no lse correction."""
        return CudnnBackend(known, lse_cotangent)

    def unavailable_reason(self, interpret: bool = False, platform: str | None = None) -> str | None:
        module, reason = cudnn_engine.private_module()
        if interpret:
            return None  # the XLA twin engine needs none of cuDNN
        if module is None:
            return reason
        # a GPU present compiles for itself; jax's CUDA plugin compiles for a GPU topology on any host
        building_for_gpu = (platform or compile_target()[0]) == "gpu"
        if not building_for_gpu or not (any(d.platform == "gpu" for d in jax.devices()) or cuda_plugin()):
            return "no CUDA GPU visible to jax"
        return None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None
                 ) -> str | None:
        """What a chunk pair's cuDNN call cannot express is refused, so `auto` takes Triton or scan."""
        if spec.has_segments:
            return "segment ids (cuDNN's masks are per block: the Triton kernels skip other documents' tiles)"
        for name, present in (("bias", spec.has_bias), ("a soft cap", spec.softcap is not None),
                              ("chunked attention", spec.chunk_size is not None)):
            if present:
                return f"{name} (cuDNN's flash attention here takes none)"
        if spec.window is not None and not spec.causal and spec.window[1] > 0:
            return "a window that looks right (cuDNN's window keeps the keys before a query)"
        if jnp.dtype(dtype).name not in DTYPES:
            return f"dtype {jnp.dtype(dtype).name} (cuDNN's flash attention takes bfloat16 and float16)"
        for name, dim in (("head_dim", head_dim), ("value_head_dim", value_head_dim or head_dim)):
            if dim % 8 or dim > 256:
                return f"{name} {dim} (cuDNN takes multiples of 8 up to 256)"
        return None

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        reject_settings(self.name, fwd, bwd, launch=False, compute_slice=False)
        if not bwd.fused_dq:
            raise ValueError("bwd_params.block_q_dq / block_kv_dq: the cudnn backend computes dq with dk and dv "
                             "(one cuDNN backward per chunk pair); leave them None")

    def default_params(self, q_len: int, kv_len: int, head_dim: int, value_head_dim: int | None = None
                       ) -> tuple[FwdParams, BwdParams]:
        """Chunks of half the shard (a zigzag shard's halves), or the whole shard where it is odd."""
        half_q = q_len // 2 if q_len % 2 == 0 else q_len
        half_kv = kv_len // 2 if kv_len % 2 == 0 else kv_len
        return FwdParams(block_q=half_q, block_kv=half_kv), BwdParams(block_q_dkv=half_q, block_kv_dkv=half_kv)

    def search_space(self, shapes: LocalShapes, spec: AttentionSpec) -> SearchSpace:
        """Square chunks of the shard, a half, a quarter (under a position mask; without one the block is one
        call and the space one point)."""
        local = min(shapes.q_len, shapes.kv_len)
        if not spec.has_position_mask:
            return SearchSpace(fwd={"block_q": (shapes.q_len,), "block_kv": (shapes.kv_len,)},
                               bwd={"block_q_dkv": (shapes.q_len,), "block_kv_dkv": (shapes.kv_len,)},
                               dq_passes=("fused",))
        sides = tuple(sorted({local // n for n in (1, 2, 4) if local % n == 0}))
        return SearchSpace(fwd={"block_q": sides, "block_kv": sides}, bwd={"block_q_dkv": sides, "block_kv_dkv": sides},
                           dq_passes=("fused",))

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None
                  ) -> str | None:
        """Under a position mask the chunks (cut to the shard) divide it and are square (a diagonal pair
        must be)."""
        if not spec.has_position_mask:
            return None
        pairs = ([("fwd", fwd.block_q, fwd.block_kv)] if fwd is not None else []) + (
            [("bwd", bwd.block_q_dkv, bwd.block_kv_dkv)] if bwd is not None else [])
        for name, block_q, block_kv in pairs:
            block_q, block_kv = min(block_q, shapes.q_len), min(block_kv, shapes.kv_len)
            if shapes.q_len % block_q or shapes.kv_len % block_kv:
                return f"{name} chunks {block_q}x{block_kv} do not divide the shard {shapes.q_len}x{shapes.kv_len}"
            if block_q != block_kv:
                return f"{name} chunks {block_q}x{block_kv} are not square (a diagonal pair must be)"
        return None

    def code_hash(self) -> str:
        return source_hash(Path(__file__), Path(cudnn_pairs.__file__), Path(cudnn_engine.__file__))

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool = False):
        return forward(q, k, v, q_pos, kv_pos, spec=spec, params=params, interpret=interpret, known=self.known)

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        dq, dk, dv = backward(q, k, v, o, lse, do, delta, q_pos, kv_pos, spec=spec, params=params,
                              interpret=interpret, known=self.known, lse_cotangent=self.lse_cotangent)
        return dq, dk, dv, None
