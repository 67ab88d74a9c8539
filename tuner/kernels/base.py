"""The contract every backend publishes (DESIGN section 3): one op, several implementations.

A backend computes attention between one block of queries and one block of keys -- it knows nothing
about rings. The ring driver (`tuner.strategies.ring`) calls it once per ring step and merges the results.

    block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret)
        -> o_f32 [B,Tq,H,Dv], lse_f32 [B,H,Tq]     (0 and -inf for a query that reads no key)
    block_bwd(q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret)
        -> dq, dk, dv (float32), dbias (bias's shape and float32, or None without bias)

The ring runs through more, so that a kernel can merge each block into the running softmax, and add
each block's gradients into the running ones, where it keeps them, instead of returning a block's results:

    keys_start(k, v, *, params) -> (k, v)           k and v as they travel the ring, made once a ring for
                                                    the tiles of the part that reads them (Fwd/BwdParams)
    fwd_start(q, k, v, *, params) -> state          nothing read yet, for keys shaped as k and v
    fwd_step(state, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret, fresh)
        -> state                                    fresh: `state` is fwd_start's, the ring's step 0
    fwd_finish(state, q) -> o_f32 [B,Tq,H,Dv], lse_f32 [B,H,Tq]
    bwd_start(q, do, *, params) -> rows               q and do as every step reads them, made once
    dq_start(q, k, *, params) -> dq                   the running dq, zero, as the kernel keeps it
    grads_start(k, v, *, params) -> grads             zero dk, dv accumulators (float32), as they travel
    bwd_step(dq, rows, k, v, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret)
        -> dq (the running dq with this block's added), dbias (the block's), pending
    bwd_idle(k, v) -> pending                         what `bwd_step` leaves for a step that reads nothing
    bwd_accumulate(grads, pending, rows, k, v, lse, delta, q_pos, kv_pos, q_seg, kv_seg, *, spec, params,
                   interpret) -> grads                the block's dk, dv added into the accumulators
    grads_finish(grads, k, v) -> dk, dv               in k's and v's shape and dtype
    dq_finish(dq, q, *, params) -> dq_f32 [B,Tq,H,D]
    knowing(known, *, lse_cotangent) -> kernel        the kernel for what the trace knows of the steps

`knowing` gets a `tuner.semantics.known.KnownBlock` (or None): every pair of positions the step's blocks
may have, when the ring's layout gives them (no explicit positions). A kernel that branches on the
device by positions (cudnn: one cuDNN mask per chunk pair) decides there once, in the trace; a kernel
that decides per tile inside its own loops (`DecidesOnDevice`) returns itself. The positions the steps
get are the same either way. `decides_in_trace` says which of the two a kernel is. `starts_fresh` says
that a kernel makes the state of a `fresh` step from its block alone, without reading `fwd_start`'s (a
merge into nothing still costs a pass over the output). The ring driver keeps the forward's first step
out of its loop only for a kernel that decides in the trace or starts fresh. In a backward,
`lse_cotangent` False says that the caller did not ask for the lse, whose cotangent is then zero: `delta`
is `rowsum(do * o)`, which a kernel that computes it itself (cuDNN) need not reconcile with its own.

The steps' `k` and `v` are `keys_start`'s (`fwd_start`, `grads_start` and the `*_finish` methods get
the caller's). `CallerLayout` gives the layout methods (`keys_start`, `dq_start`, `dq_finish`,
`grads_start`, `bwd_idle`, `grads_finish`) of a kernel that works in the caller's layout.

A backward step has two parts because the dk/dv accumulators travel while the step runs: `bwd_step`
must not read them, so that their transfer can overlap it; `bwd_accumulate` runs once they have
arrived, with whatever `bwd_step` left it (`pending`: the block's dk, dv for a kernel that computes
them with dq, nothing for one that computes them in a kernel of their own). `AddedGrads` adds the
block's dk, dv that a kernel leaves; `BlockGrads` adds `bwd_step` from `block_bwd`; `MergedBlocks` adds
the forward's from `block_fwd` and `merge`.

`q` is `[B,Tq,H,D]`, `k` `[B,Tk,Hkv,D]`, `v` `[B,Tk,Hkv,Dv]`: the value head dim Dv may differ from the
query/key head dim D (multi-head latent attention); `o` and `do` have Dv, each gradient its input's shape.

Positions and segment ids are int32 `[B, T]`; `q_seg`/`kv_seg` are None without segments. `bias` is
the slice for this key block (`[B|1, H|1, Tq|1, Tk|1]`) or None. `lse` and `delta` are those of the
final softmax (all ring steps and sinks), so a block's probabilities are `exp(logits - lse)`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax.numpy as jnp

from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.known import KnownBlock
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support import vma


@dataclass(frozen=True)
class SearchSpace:
    """The tunable choices of one backend for one problem (DESIGN section 6).

    `fwd` maps `FwdParams` fields to their candidate values, `bwd` the `BwdParams` fields other than the
    dq tiles; `dq_tiles` are the candidates for `block_q_dq` and `block_kv_dq` of a separate dq pass
    (empty: dq is always fused); `dq_passes` says whether dq may be "fused" into the dk/dv pass and/or
    run as a "separate" pass. Cross-field constraints are the backend's `violation`.
    """

    fwd: dict[str, tuple[int, ...]]
    bwd: dict[str, tuple[int, ...]]
    dq_tiles: tuple[int, ...] = ()
    dq_passes: tuple[str, ...] = ("fused", "separate")

    def fwd_points(self) -> Iterator[FwdParams]:
        names = list(self.fwd)
        for values in itertools.product(*self.fwd.values()):
            yield FwdParams(**dict(zip(names, values)))

    def bwd_points(self) -> Iterator[BwdParams]:
        names = list(self.bwd)
        dq_options = [(None, None)] if "fused" in self.dq_passes else []
        if "separate" in self.dq_passes:
            dq_options += itertools.product(self.dq_tiles, self.dq_tiles)
        for values in itertools.product(*self.bwd.values()):
            for block_q_dq, block_kv_dq in dq_options:
                yield BwdParams(**dict(zip(names, values)), block_q_dq=block_q_dq, block_kv_dq=block_kv_dq)


def source_hash(*paths: Path) -> str:
    """First 12 hex digits of the sha256 of these files: the version of a backend's kernel code."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


class Backend(Protocol):
    """What `tuner.strategies.ring` and the tuner need from a backend.

    `masked_tile` is the longest default tile where positions mask tiles out (causal, window, chunk),
    whose tiles are then square (each kernel's longer default tile, no longer than this); None where
    `default_params` holds for every mask."""

    name: str
    masked_tile: int | None
    decides_in_trace: bool
    starts_fresh: bool

    def unavailable_reason(self, interpret: bool = False, platform: str | None = None) -> str | None:
        """None when this backend's kernels can be built for `platform` (default: the program being
        traced, `tuner.support.targets.compile_target`), or run in their interpreter with `interpret`; else why
        not."""

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None
                 ) -> str | None:
        """None when every feature of `spec` is honoured at these head dims (`value_head_dim`: the values',
        where it differs from `head_dim`), else the first one that is not."""

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        """Raise `ValueError` naming the field for parameters this backend cannot honour."""

    def default_params(self, q_len: int, kv_len: int, head_dim: int, value_head_dim: int | None = None
                       ) -> tuple[FwdParams, BwdParams]:
        """The heuristic default for a local problem of these lengths and head dims."""

    def search_space(self, shapes: LocalShapes, spec: AttentionSpec) -> SearchSpace:
        """The candidate tiles (and launch settings) worth trying for these local shapes."""

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None
                  ) -> str | None:
        """Why this point cannot run for these shapes (checked before compiling), or None when it can."""

    def code_hash(self) -> str:
        """Version of the code that builds this backend's kernels (template text for generated ones):
        part of every cache entry, so tuned entries go stale when the kernels change."""

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool): ...

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool): ...

    def fwd_start(self, q, k, v, *, params: FwdParams) -> Any: ...

    def fwd_step(self, state: Any, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                 params: FwdParams, interpret: bool, fresh: bool = False) -> Any: ...

    def fwd_finish(self, state: Any, q) -> tuple: ...

    def keys_start(self, k, v, *, params: FwdParams | BwdParams) -> tuple: ...

    def bwd_start(self, q, do, *, params: BwdParams) -> Any: ...

    def dq_start(self, q, k, *, params: BwdParams) -> Any: ...

    def dq_finish(self, dq: Any, q, *, params: BwdParams) -> Any: ...

    def grads_start(self, k, v, *, params: BwdParams) -> Any: ...

    def bwd_step(self, dq, rows: Any, k, v, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                 spec: AttentionSpec, params: BwdParams, interpret: bool) -> tuple: ...

    def bwd_idle(self, k, v) -> Any: ...

    def bwd_accumulate(self, grads: Any, pending: Any, rows: Any, k, v, lse, delta, q_pos, kv_pos, q_seg, kv_seg, *,
                       spec: AttentionSpec, params: BwdParams, interpret: bool) -> Any: ...

    def grads_finish(self, grads: Any, k, v) -> tuple: ...

    def knowing(self, known: KnownBlock | None, *, lse_cotangent: bool = True) -> Backend: ...


class DecidesOnDevice:
    """`knowing` of a kernel that decides per tile on the device, inside its own loops, with no branch
    that knowing the positions in the trace would remove, and that reads `delta` as it comes."""

    decides_in_trace = False

    def knowing(self, known: KnownBlock | None, *, lse_cotangent: bool = True) -> DecidesOnDevice:
        return self


class CallerLayout:
    """The ring's layouts of a kernel that works in the caller's: k and v travel as they are, the running
    dq is float32 `[B, Tq, H, D]`, the dk/dv accumulators float32 arrays of k's and v's shapes."""

    def keys_start(self, k, v, *, params: FwdParams | BwdParams) -> tuple:
        return k, v

    def dq_start(self, q, k, *, params: BwdParams) -> Any:
        return vma.like(jnp.zeros(q.shape, jnp.float32), q)

    def dq_finish(self, dq: Any, q, *, params: BwdParams) -> Any:
        return dq

    def grads_start(self, k, v, *, params: BwdParams | None = None) -> tuple:
        return jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)

    def bwd_idle(self, k, v) -> tuple:
        return self.grads_start(k, v)

    def grads_finish(self, grads: tuple, k, v) -> tuple:
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (k, v)))


class AddedGrads:
    """The second part of a backward step for a kernel whose `bwd_step` leaves the block's dk and dv, in the
    accumulators' layout: they are added to the accumulators."""

    def bwd_accumulate(self, grads: tuple, pending: tuple, rows: Any, k, v, lse, delta, q_pos, kv_pos, q_seg,
                       kv_seg, *, spec: AttentionSpec, params: BwdParams, interpret: bool) -> tuple:
        return tuple(g + p for g, p in zip(grads, pending))


class BlockGrads(CallerLayout, AddedGrads):
    """The backward's steps of a kernel that computes a block's dq, dk and dv together (`block_bwd`):
    `bwd_step` adds the block's dq to the running dq and leaves its dk and dv to be added to the
    travelling accumulators once they arrive."""

    def bwd_start(self, q, do, *, params: BwdParams) -> tuple:
        return q, do

    def bwd_step(self, dq, rows: tuple, k, v, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                 spec: AttentionSpec, params: BwdParams, interpret: bool) -> tuple:
        q, do = rows
        block_dq, dk, dv, dbias = self.block_bwd(q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias,
                                                 spec=spec, params=params, interpret=interpret)
        return dq + block_dq, dbias, (dk, dv)


class MergedBlocks(BlockGrads):
    """The ring's steps of a kernel that returns each block's results: the forward's state is the running
    float32 output `[B, Tq, H, Dv]` and lse `[B, H, Tq]`, into which each block's is merged (`merge`), but
    for a `fresh` step's, which is the state (on one device, the ring's output is then the block's, with
    no pass over it); the backward's are `BlockGrads`'."""

    starts_fresh = True

    def fwd_start(self, q, k, v, *, params: FwdParams) -> tuple:
        b, t, h = q.shape[:3]
        return (vma.like(jnp.zeros((b, t, h, v.shape[3]), jnp.float32), q),
                vma.like(jnp.full((b, h, t), -jnp.inf, jnp.float32), q))

    def fwd_step(self, state: tuple, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                 params: FwdParams, interpret: bool, fresh: bool = False) -> tuple:
        block = self.block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec, params=params,
                               interpret=interpret)
        if fresh:  # merge(fwd_start's state, block) is the block: 0 and -inf where a query reads no key
            return tuple(vma.like(x.astype(jnp.float32), q) for x in block)
        return merge(*state, *block)

    def fwd_finish(self, state: tuple, q) -> tuple:
        return state


def reject_settings(backend: str, fwd: FwdParams, bwd: BwdParams, *, launch: bool, compute_slice: bool) -> None:
    """`ValueError` naming a setting that `backend` cannot honour: the GPU launch settings
    (`num_warps`, `num_stages`) unless it has `launch` ones, `block_kv_compute` unless it computes a
    key tile in slices (`compute_slice`)."""
    if not launch:
        for owner, params in (("fwd_params", fwd), ("bwd_params", bwd)):
            for field in ("num_warps", "num_stages"):
                if getattr(params, field) is not None:
                    raise ValueError(f"{owner}.{field} is a GPU launch setting that the {backend} backend "
                                     f"cannot honour; leave it None")
    if not compute_slice and fwd.block_kv_compute is not None:
        raise ValueError(f"fwd_params.block_kv_compute is a TPU kernel setting that the {backend} backend "
                         f"cannot honour; leave it None")


def merge(out, lse, block_out, block_lse):
    """Two partial softmaxes of the same queries combined exactly, in float32: normalized outputs
    `[B, T, H, Dv]` and their lse `[B, H, T]` (what `block_fwd` returns; -inf for rows that read nothing)."""
    new_lse = jnp.logaddexp(lse, block_lse)
    safe = jnp.where(new_lse == -jnp.inf, 0.0, new_lse)

    def weight(x):
        return jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None]  # [B,H,Tq] -> [B,Tq,H,1]

    return weight(lse) * out + weight(block_lse) * block_out, new_lse
