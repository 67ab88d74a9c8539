"""The one ring driver every block kernel runs under (the public entry point is `tuner.runtime.attention`).

The driver (DESIGN section 3) owns everything ring-specific; backends only compute one block.

Forward, on each of the P devices of `axis_name`: P steps. At every step the visiting key/value shard
(in the kernel's layout, `keys_start`, made once a ring; with its positions and segment ids, stacked
into one int32 array) is first sent on to the next device, so the transfer can overlap the compute, then
this device's queries attend to it and the block is merged into the running `(out, lse)` in float32. The
kernel keeps that state in its own layout (`fwd_start`, `fwd_step`, `fwd_finish` of the contract,
`tuner.kernels.base`): the scan and Pallas kernels merge each block into it in place; the others return
a block output, merged by `logaddexp`, but for step 0's, which is the state as it comes (`starts_fresh`:
a merge into nothing would cost a pass over the output). There is no send after the last step. A step
whose visiting shard is wholly excluded by the masks is skipped: which ones, `masks.ring_mask` resolves
once before the ring turns, from every shard's position bounds. Where no positions were passed, the
layout's are known in the trace (`tuner.semantics.known`): what every device decides alike at a step is
decided there, with no branch, and the kernel gets them (`knowing`). Sinks join the softmax once, at the
end.

Backward replays the same steps with the final (sink-inclusive) lse and `delta = rowsum(dout * out)`:
dq accumulates here, in the kernel's layout (`dq_start`, `dq_finish`; the kernel adds each block's
into it, `bwd_step`), while dk/dv accumulators, in the kernel's layout (`grads_start`,
`grads_finish`), travel with the keys and, after one last hop, arrive back at the device that owns
those keys. A step has two parts: `bwd_step` reads nothing that travels during the step, so the
accumulators of the keys at hand arrive while it runs; then `bwd_accumulate` adds the block's dk/dv
into them (the Pallas kernel in place, the others by adding what `bwd_step` left). An
`optimization_barrier` on (accumulators, dq) keeps that order: otherwise the TPU scheduler may run the
second part first and wait for the transfer.
`d softmax_aux` is computed once, from lse and delta.

The forward rule names the two residuals the backward needs of the ring's forward, its output and lse
(`OUTPUT_NAME`, `LSE_NAME`), so that a `jax.checkpoint` policy can keep them instead of running the ring
again in the backward pass (`tuner.runtime.remat`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from tuner.semantics import known, layouts, masks
from tuner.support import ordering
from tuner import registry
from tuner.support import axes, vma, work
from tuner.kernels.base import Backend
from tuner.kernels.params import BwdParams, FwdParams
from tuner.strategies.ring_inputs import add_bias_columns, bias_columns, sinks_grad, with_sinks
from tuner.semantics.spec import AttentionSpec
from tuner.support.targets import compile_target

F32 = jnp.float32
OUTPUT_NAME, LSE_NAME = "ring_attention_out", "ring_attention_lse"


@dataclass(frozen=True)
class RingConfig:
    """Everything static about one ring call (a `custom_vjp` non-differentiable argument)."""

    spec: AttentionSpec
    backend: str
    fwd_params: FwdParams
    bwd_params: BwdParams
    axis_name: Hashable | None
    interpret: bool
    layout: str | None  # the layout whose positions every shard holds; None where positions were passed
    returns_lse: bool  # False: the caller drops the lse, so its cotangent is zero (the backward knows it)


def block_kernel(name: str) -> Backend:
    """The block kernel the ring runs for the implementation called `name`."""
    kernel = getattr(registry.get(name), "kernel", None)
    if kernel is None:
        raise ValueError(f"backend {name!r} is not a ring over a block kernel; run it through "
                         f"get_tuned_ring_attention(backend={name!r})")
    return kernel


def ring_geometry(axis_name: Hashable | None) -> tuple[int, Any]:
    """(ring size, this device's index on the ring); (1, 0) without an axis."""
    if axis_name is None:
        return 1, 0
    return axes.bound_size(axis_name), lax.axis_index(axis_name)


def group_size(axis_name: Hashable | None) -> int | None:
    """The size of the second axis of a pair `axis_name` (a call over two mesh axes), else None. Its callers ask
    `ring_geometry` first, which names an unbound `axis_name`."""
    return lax.axis_size(axis_name[1]) if isinstance(axis_name, tuple) else None


def _travelling(k, v, kv_pos, kv_seg) -> tuple:
    """The shards that travel the ring, `(k, v, ids)`, all varying over the axes of the keys (on a 2-D
    mesh the positions vary over the ring axis only, and `tuner.support.ordering` ties each one to
    arrays that vary over both). `ids` holds the key positions, stacked with the segment ids where there
    are any: one transfer a step, not two (on the CPU every collective waits for the one before)."""
    ids = kv_pos if kv_seg is None else jnp.stack([kv_pos, kv_seg])
    return tuple(vma.like(x, k) for x in (k, v, ids))


def _arrived(visiting) -> tuple:
    """`(k, v, kv_pos, kv_seg)` of the shards `_travelling` sent."""
    k, v, ids = visiting
    return (k, v, ids[0], ids[1]) if ids.ndim == 3 else (k, v, ids, None)


def _send_to_next(tree, axis_name: Hashable, size: int, after: tuple = ()):
    """Each array of `tree` sent to the next device on the ring; on the CPU one after the other, the
    first after the arrays of `after` (`tuner.support.ordering`)."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(ordering.in_order(lambda x: lax.ppermute(x, axis_name, perm), leaves, after))


def _group(cfg: RingConfig, backend: Backend, q_len: int, kv_len: int, size: int, steps: range) -> tuple:
    """(the kernel, `known.visited`) of ring steps `steps`, from the positions the trace knows they pair and
    whether the lse has a cotangent (the caller asked for it; only a backward reads that)."""
    block = known.ring_block(cfg.layout, q_len, kv_len, size, steps)
    return backend.knowing(block, lse_cotangent=cfg.returns_lse), known.visited(block, cfg.spec)


def _visits(cfg: RingConfig, ring_mask: masks.RingMask, step, size: int, visited: int | None):
    """Whether step `step`'s kernel runs: False when it never does, else the predicate of the branch
    around it, or None for no branch: `visited` where the trace decided it (`_group`), else the mask's answer.
    A kernel that always runs still goes in a branch, under a predicate the compiler cannot fold: the TPU
    scheduler overlaps the step's transfers with a branch, and ran a bare kernel first on v6e
    (tests/test_tpu_compile.py); XLA:CPU updates the running state in place through a branch (the scan
    ring's forward held 1.69x its floor without, 1.41x with: tests/test_memory.py). Not on a GPU: a GPU
    branch waits on its predicate."""
    if visited is None:
        return ring_mask.visits[step]
    if not visited:
        return False
    if size > 1 and compile_target()[0] != "gpu":
        return lax.optimization_barrier(jnp.asarray(step) < size)
    return None


def _steps(lower: int, upper: int, step, carry):
    """`lax.fori_loop(lower, upper, step, carry)`; on a GPU two ring steps an iteration (an odd one first,
    before the loop). A loop of one step a turn sends the keys it reads while it reads them, and the keys
    that arrive must take their place in the loop's state: XLA:GPU copies every travelling array once a
    step to make room. Two steps a turn, the keys that arrive in the second take the place of those read
    in the first, which are done with: no copy."""
    if compile_target()[0] != "gpu" or upper - lower < 2:
        return lax.fori_loop(lower, upper, step, carry)
    if (upper - lower) % 2:
        carry, lower = step(lower, carry), lower + 1

    def two(turn, carry):
        i = lower + 2 * turn
        return step(i + 1, lax.optimization_barrier(step(i, carry)))

    return lax.fori_loop(0, (upper - lower) // 2, two, carry)


def _idle_together(spec: AttentionSpec) -> bool:
    """Whether every device of the ring can skip the same step: with a window, chunks or segments.
    Without them a step is skipped on a device only while another runs a whole block (causal, contiguous
    layout), so the backward runs a skipped step's second part (`bwd_accumulate`, with `bwd_idle`'s
    pending) instead of branching around it: it costs no wall time there, while the branch costs memory
    (on the TPU, XLA keeps copies of the dk/dv accumulators that a kernel in a branch adds into in place:
    514 against 433 MiB a chip at 131072 tokens on v5e, docs/memory.md)."""
    return spec.window is not None or spec.chunk_size is not None or spec.has_segments


def _forward(cfg: RingConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks):
    backend = block_kernel(cfg.backend)
    size, rank = ring_geometry(cfg.axis_name)
    kv_len = k.shape[1]

    def block(visiting, step, state, steps: range, fresh: bool = False):
        """Step `step` (one of `steps`, whose positions the trace may know) merged into `state`; `fresh`
        for step 0, whose `state` is `fwd_start`'s."""
        k_, v_, kv_pos_, kv_seg_ = _arrived(visiting)
        source = (rank - step) % size
        kernel, visited = _group(cfg, backend, q.shape[1], kv_len, size, steps)

        def compute(state):
            work.record("blocks", 1)
            return kernel.fwd_step(state, q, k_, v_, q_pos, kv_pos_, q_seg, kv_seg_,
                                   bias_columns(bias, source, kv_len), spec=cfg.spec, params=cfg.fwd_params,
                                   interpret=cfg.interpret, fresh=fresh)

        visits = _visits(cfg, ring_mask, step, size, visited)
        if visits is None:
            return compute(state)
        if visits is False:
            return state
        return lax.cond(visits, compute, lambda state: state, state)

    ring_mask = masks.ring_mask(q_pos, kv_pos, q_seg, kv_seg, cfg.spec, cfg.axis_name, size, rank)
    with work.on_device(rank):
        state = backend.fwd_start(q, k, v, params=cfg.fwd_params)
        visiting = _travelling(*backend.keys_start(k, v, params=cfg.fwd_params), kv_pos, kv_seg)
        if size > 1:
            # Step 0 (each device's own keys) apart from the loop for a kernel that decides from known
            # positions, which every device has alike there, or that starts its state from that step's
            # block alone; for the others, only a kernel copy to compile.
            first = 1 if backend.decides_in_trace or backend.starts_fresh else 0
            if first:
                arriving = _send_to_next(visiting, cfg.axis_name, size)
                visiting, state = arriving, block(visiting, 0, state, range(1), fresh=True)

            def step(i, carry):
                visiting, state = carry
                arriving = _send_to_next(visiting, cfg.axis_name, size)
                return arriving, block(visiting, i, state, range(first, size - 1))

            if size - 1 > first:
                visiting, state = _steps(first, size - 1, step, (visiting, state))
        out, lse = backend.fwd_finish(block(visiting, size - 1, state, range(size - 1, size), fresh=size == 1),
                                      q)

    return (*with_sinks(out, lse, sinks), ring_mask)


def _backward(cfg: RingConfig, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks, out, lse, ring_mask = residuals
    dout, dlse = cotangents
    dlse = dlse if cfg.returns_lse else None  # zero where the caller did not ask for the lse
    backend = block_kernel(cfg.backend)
    size, rank = ring_geometry(cfg.axis_name)
    kv_len = k.shape[1]
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(F32), out.astype(F32))
    if dlse is not None:  # d lse folds into delta: d logits = p * (dp - delta + dlse)
        delta = delta - dlse
    dout = dout.astype(q.dtype)

    rows = backend.bwd_start(q, dout, params=cfg.bwd_params)  # q and dout as the kernel reads them, made once
    kernel_args = dict(spec=cfg.spec, params=cfg.bwd_params, interpret=cfg.interpret)

    def varying(tree):
        return jax.tree.map(lambda x: vma.like(x, q), tree)

    group = functools.cache(functools.partial(_group, cfg, backend, q.shape[1], kv_len, size))  # a step's two parts

    def block(visiting, step, dq, dbias, steps: range):
        """A step's first part, which does not read the dk/dv accumulators: dq (and dbias) accumulate here;
        what the kernel leaves for `accumulate` is returned. `steps` as in the forward's `block`."""
        k_, v_, kv_pos_, kv_seg_ = _arrived(visiting)
        source = (rank - step) % size
        kernel, visited = group(steps)

        def compute(carry):
            dq, dbias = carry
            work.record("blocks", 1)
            dq, dbias_b, pending = kernel.bwd_step(dq, rows, k_, v_, out, lse, delta, q_pos, kv_pos_, q_seg,
                                                   kv_seg_, bias_columns(bias, source, kv_len), **kernel_args)
            if dbias is not None:
                dbias = add_bias_columns(dbias, dbias_b, source, kv_len)
            return dq, dbias, varying(pending)

        def idle(carry):
            return (*carry, varying(backend.bwd_idle(k_, v_)))

        visits = _visits(cfg, ring_mask, step, size, visited)
        if visits is None:
            return compute((dq, dbias))
        if visits is False:
            return idle((dq, dbias))
        return lax.cond(visits, compute, idle, (dq, dbias))

    def accumulate(visiting, step, grads, pending, steps: range):
        """A step's second part: the block's dk, dv added into the accumulators of the keys at hand."""
        k_, v_, kv_pos_, kv_seg_ = _arrived(visiting)
        kernel, visited = group(steps)

        def compute(grads, pending):
            return kernel.bwd_accumulate(grads, pending, rows, k_, v_, lse, delta, q_pos, kv_pos_, q_seg, kv_seg_,
                                         **kernel_args)

        visits = _visits(cfg, ring_mask, step, size, visited) if _idle_together(cfg.spec) else None
        if visits is None:
            return compute(grads, pending)
        if visits is False:
            return grads
        return lax.cond(visits, compute, lambda grads, pending: grads, grads, pending)

    def send(tree, after: tuple = ()):
        return _send_to_next(tree, cfg.axis_name, size, after)

    with work.on_device(rank):
        dq = backend.dq_start(q, k, params=cfg.bwd_params)
        dbias = None if bias is None else vma.like(jnp.zeros(bias.shape, F32), q)
        visiting = _travelling(*backend.keys_start(k, v, params=cfg.bwd_params), kv_pos, kv_seg)
        # Step 0, this device's own keys; from step 1 on, the next keys and the accumulators of the keys
        # at hand (from the device that had them a step ago) travel while the step's first part runs:
        # neither transfer waits for this step's kernels, so the scheduler can overlap both with them.
        # On the CPU the first send waits for lse and dout, as the kernel does, so that it cannot meet
        # the forward ring's sends or a later layer's in flight (`tuner.support.ordering`).
        arriving = send(visiting, after=(lse, dout)) if size > 1 else visiting
        dq, dbias, pending = block(visiting, 0, dq, dbias, range(1))
        outgoing = accumulate(visiting, 0, varying(backend.grads_start(k, v, params=cfg.bwd_params)), pending,
                              range(1))
        if size > 1:
            def step(i, carry):
                visiting, outgoing, dq, dbias = carry
                arriving = send(visiting)
                incoming = send(outgoing, after=jax.tree.leaves(arriving)[-1:])
                dq, dbias, pending = block(visiting, i, dq, dbias, range(1, size - 1))
                # the second part after the first, so that the accumulators arrive while the first runs
                incoming, dq = lax.optimization_barrier((incoming, dq))
                return arriving, accumulate(visiting, i, incoming, pending, range(1, size - 1)), dq, dbias

            visiting, outgoing, dq, dbias = _steps(1, size - 1, step, (arriving, outgoing, dq, dbias))
            incoming = send(outgoing, after=jax.tree.leaves(visiting)[-1:])  # a ring of 2 has no loop
            last = range(size - 1, size)
            dq, dbias, pending = block(visiting, size - 1, dq, dbias, last)
            incoming, dq = lax.optimization_barrier((incoming, dq))
            # One last hop brings the finished accumulators home, already in the gradients' dtype.
            finished = backend.grads_finish(accumulate(visiting, size - 1, incoming, pending, last), k, v)
            dk, dv = send(finished, after=jax.tree.leaves(incoming)[-1:])
            # On the CPU dq and dk wait for dv, the last send, so that the ring of an earlier layer,
            # which needs them, cannot start sending while it is in flight (`tuner.support.ordering`).
            dq, outgoing = ordering.after(dq, dv), (ordering.after(dk, dv), dv)
        else:
            outgoing = backend.grads_finish(outgoing, k, v)
    dk, dv = outgoing
    dq = backend.dq_finish(dq, q, params=cfg.bwd_params)

    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None,
            None if bias is None else dbias.astype(bias.dtype), sinks_grad(sinks, lse, delta))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks):
    out, lse, _ = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks)
    return out.astype(q.dtype), lse


def _ring_fwd(cfg: RingConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks):
    out, lse, ring_mask = _forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks)
    # With sinks the residual output stays float32: d sinks sums p_sink * rowsum(dout * out) over every
    # row, and a bf16/fp16-rounded out would put that dtype's rounding error into the sum.
    # The output in the inputs' dtype is made here, before the backward: left to the scheduler, its cast
    # from the float32 state could run at the program's end and keep that state alive through the backward.
    primal = checkpoint_name(lax.optimization_barrier(out.astype(q.dtype)), OUTPUT_NAME)
    lse = checkpoint_name(lse, LSE_NAME)
    saved = checkpoint_name(out, OUTPUT_NAME) if sinks is not None else primal
    return (primal, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, sinks, saved, lse, ring_mask)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_backward(cfg: RingConfig, residuals, cotangents):
    """`_backward`, which refuses to be differentiated itself: its loops run to bounds read from the masks,
    which jax cannot differentiate in reverse (its error would name a `lax.while_loop` of this module), and
    the compiled kernels have no derivatives of their own."""
    return _backward(cfg, residuals, cotangents)


@_first_order_backward.defjvp
def _backward_jvp(cfg: RingConfig, primals, tangents):
    raise NotImplementedError(
        "ring attention has first-order gradients only: a gradient of its gradient (jax.hessian, a gradient "
        "penalty) differentiates its backward pass, which is not differentiable; use "
        "tuner.semantics.reference.dense_attention where second-order derivatives are needed")


_ring.defvjp(_ring_fwd, _first_order_backward)


def _varying(x, axis_name: Hashable | None):
    """Mark an input as varying over the ring axis, so that the gradient of a replicated input
    (one bias or one set of sinks for every device) is summed over the ring by `shard_map`."""
    if x is None or axis_name is None or axis_name in vma.varying_axes(x):
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def _positions(explicit, layout: str, length: int, batch: int, size: int, rank):
    if explicit is not None:
        return explicit.astype(jnp.int32)
    return jnp.broadcast_to(layouts.local_positions(layout, length, size, rank), (batch, length))


def run_ring(query, key, value, *, spec: AttentionSpec, backend: str, fwd_params: FwdParams, bwd_params: BwdParams,
             axis_name: Hashable | None, layout: str, interpret: bool = False, q_segment_ids=None, kv_segment_ids=None,
             q_positions=None, kv_positions=None, softmax_aux=None, bias=None, return_lse: bool = False):
    """The ring of block kernel `backend` with these tiles for a call already resolved to `spec`
    (`tuner.runtime.plan.resolve`; the arrays checked there): what `ring_attention` and the loader run."""
    size, rank = ring_geometry(axis_name)
    passed = q_positions is not None or kv_positions is not None or isinstance(axis_name, tuple)
    cfg = RingConfig(spec, backend, fwd_params, bwd_params, axis_name, bool(interpret), None if passed else layout,
                     bool(return_lse))
    batch = query.shape[0]
    q_pos = _positions(q_positions, layout, query.shape[1], batch, size, rank)
    kv_pos = _positions(kv_positions, layout, key.shape[1], batch, size, rank)
    q_seg = None if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
    kv_seg = None if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
    args = [_varying(x, axis_name) for x in (query, key, value, q_pos, kv_pos, q_seg, kv_seg, bias,
                                             softmax_aux)]
    out, lse = _ring(cfg, *args)
    return (out, lse) if return_lse else out
