"""Attention problems for the property tests: a hypothesis strategy, the ring runner and the oracle.

A `Case` is a whole problem in natural token order (global arrays). `run_ring` lays it out for a
ring of `case.ring` simulated devices, runs `ring_attention` under `shard_map`, and restores the
results to natural order; `run_reference` runs the dense oracle in float64. Both return the output,
the lse and the gradients of the same scalar loss with respect to query, key, value, bias and sinks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import BwdParams, FwdParams, ring_attention
from tuner.semantics import layouts
from tuner.kernels import check_vma
from tuner.semantics.reference import dense_attention

GRAD_NAMES = ("dq", "dk", "dv", "dbias", "dsinks")


@dataclass(frozen=True)
class Case:
    batch: int
    length: int  # global, for queries and keys
    heads: int
    kv_heads: int
    head_dim: int
    ring: int = 1
    value_head_dim: int | None = None  # None: the values have head_dim too
    layout: str = "contiguous"
    causal: bool = False
    window: int | tuple[int, int] | None = None
    chunk: int | None = None
    softcap: float | None = None
    scale: float | None = None
    segments: str | None = None  # None, "packed" (sorted) or "random"
    bias: str | None = None  # None, "full" [B,H,T,T], "keys" [1,H,1,T], "rows" [B,1,T,1]
    sinks: str | None = None  # None, "head" [H], "pair" [H, 2]
    explicit_positions: bool = False
    fwd: FwdParams = FwdParams()
    bwd: BwdParams = BwdParams()
    dtype: str = "float32"
    seed: int = 0
    backend: str = "scan"
    interpret: bool = True  # kernel backends run in their interpreter unless this is False (on their hardware)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def options(self) -> dict:
        return dict(causal=self.causal, sliding_window=self.window, chunk_size=self.chunk,
                    logits_soft_cap=self.softcap, softmax_scale=self.scale)


@st.composite
def cases(draw, ring_sizes=(1,), layouts_=layouts.LAYOUTS, dtype: str = "float32") -> Case:
    ring = draw(st.sampled_from(ring_sizes))
    layout = draw(st.sampled_from(layouts_))
    local = draw(st.sampled_from([4, 6, 8, 12]))
    length = local * ring
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.one_of(st.none(), st.integers(0, length),
                            st.tuples(st.integers(0, length), st.integers(0, length))))
    fused = draw(st.booleans())
    block = st.integers(2, 2 * local)
    head_dim = draw(st.sampled_from([4, 8, 16]))
    return Case(
        batch=draw(st.sampled_from([1, 2])), length=length, heads=kv_heads * group, kv_heads=kv_heads,
        head_dim=head_dim, value_head_dim=draw(st.sampled_from([None, None, head_dim // 2, 3 * head_dim // 2])),
        ring=ring, layout=layout,
        causal=draw(st.booleans()), window=window,
        chunk=draw(st.one_of(st.none(), st.integers(1, length))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 20.0))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.5))),
        segments=draw(st.sampled_from([None, "packed", "random"])),
        bias=draw(st.sampled_from([None, "full", "keys", "rows"])),
        sinks=draw(st.sampled_from([None, "head", "pair"])),
        explicit_positions=draw(st.booleans()),
        fwd=FwdParams(draw(block), draw(block)),
        bwd=BwdParams(draw(block), draw(block), *( (None, None) if fused else (draw(block), draw(block)))),
        dtype=dtype, seed=draw(st.integers(0, 2**16)),
    )


@dataclass
class Arrays:
    """The inputs of a case in natural token order (NumPy), plus the loss weights."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    bias: np.ndarray | None
    sinks: np.ndarray | None
    q_seg: np.ndarray | None
    kv_seg: np.ndarray | None
    positions: np.ndarray | None
    out_weight: np.ndarray
    lse_weight: np.ndarray


@st.composite
def triton_cases(draw, ring_sizes=(1,), dtype: str = "float32") -> Case:
    """Cases the Triton kernels take: tiles powers of two >= 16, value head dims of their own too (24: padded
    in the kernels), no bias (unsupported), dq in its own kernel; local lengths that need several tiles, or a
    partial one. Kept small (B*H <= 4): the interpreter runs every program of the grid in Python."""
    case = draw(cases(ring_sizes=ring_sizes, dtype=dtype))
    local = draw(st.sampled_from([6, 12, 20, 36]))
    heads = case.kv_heads * draw(st.sampled_from([1, 2]))
    tile = st.sampled_from([16, 32])
    return dataclasses.replace(
        case, backend="triton", length=local * case.ring, head_dim=draw(st.sampled_from([16, 32])),
        value_head_dim=draw(st.sampled_from([None, 16, 24])), bias=None,
        heads=heads, batch=1 if heads > 2 else case.batch,
        fwd=FwdParams(draw(tile), draw(tile)), bwd=BwdParams(draw(tile), draw(tile), draw(tile), draw(tile)))


@st.composite
def pallas_tpu_cases(draw, ring_sizes=(1,), dtype: str = "float32") -> Case:
    """Cases the Pallas TPU kernels take: value head dims of their own too, no bias (unsupported), dq in its
    own kernel, tiles by TPU rules (query tiles multiples of 8, key tiles of 128, else the whole local
    length). Local lengths from a single unaligned tile up to several key tiles, the last running past the end; kept
    small (B*H <= 4)."""
    case = draw(cases(ring_sizes=ring_sizes, dtype=dtype))
    local = draw(st.sampled_from([12, 40, 160, 256]))
    heads = case.kv_heads * draw(st.sampled_from([1, 2]))
    q_tile, kv_tile = st.sampled_from([8, 16, 32, 512]), st.sampled_from([128, 256])
    return dataclasses.replace(
        case, backend="pallas_tpu", length=local * case.ring, head_dim=draw(st.sampled_from([8, 16])),
        value_head_dim=draw(st.sampled_from([None, 8, 24])), bias=None,
        heads=heads, batch=1 if heads > 2 else case.batch,
        fwd=FwdParams(draw(q_tile), draw(kv_tile), block_kv_compute=draw(st.sampled_from([None, 128]))),
        bwd=BwdParams(draw(q_tile), draw(kv_tile), draw(q_tile), draw(kv_tile)))


def make_arrays(case: Case) -> Arrays:
    rng = np.random.default_rng(case.seed)
    b, t, h, hkv, d, dv = case.batch, case.length, case.heads, case.kv_heads, case.head_dim, case.value_dim

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q_seg = kv_seg = None
    if case.segments is not None:
        q_seg = rng.integers(0, 3, (b, t)).astype(np.int32)
        if case.segments == "packed":
            q_seg = np.sort(q_seg, axis=1)
        kv_seg = np.where(q_seg == 2, 1, q_seg).astype(np.int32)  # segment 2 reads no key: empty rows
    bias = {None: None, "full": lambda: normal(b, h, t, t), "keys": lambda: normal(1, h, 1, t),
            "rows": lambda: normal(b, 1, t, 1)}[case.bias]
    sinks = {None: None, "head": lambda: normal(h), "pair": lambda: normal(h, 2)}[case.sinks]
    positions = None
    if case.explicit_positions:  # strictly increasing, with gaps and a per-row offset
        positions = np.cumsum(rng.integers(1, 3, (b, t)), axis=1).astype(np.int32) - 1
    return Arrays(normal(b, t, h, d), normal(b, t, hkv, d), normal(b, t, hkv, dv),
                  bias() if bias else None, sinks() if sinks else None, q_seg, kv_seg, positions,
                  normal(b, t, h, dv), normal(b, h, t))


def _loss(out, lse, arrays_w, arrays_u):
    finite = jnp.isfinite(lse)
    return jnp.vdot(out.astype(jnp.float32), arrays_w) + jnp.sum(jnp.where(finite, lse, 0.0) * arrays_u)


def run_reference(case: Case, a: Arrays, dtype=jnp.float64):
    """The dense oracle (float64 by default) under one `jax.jit` (one compile, not one per operation):
    out, lse and the gradients, NumPy float64."""
    with jax.enable_x64(True):
        def loss(q, k, v, bias, sinks, q_seg, kv_seg, pos, w, u):
            out, lse = dense_attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=q_seg,
                                       kv_segment_ids=kv_seg, bias=bias, softmax_aux=sinks, **case.options)
            finite = jnp.isfinite(lse)
            value = jnp.vdot(out, w) + jnp.sum(jnp.where(finite, lse, 0.0) * u)
            return value.astype(jnp.float64), (out, lse)

        args = [None if x is None else jnp.asarray(x, dtype) for x in (a.q, a.k, a.v, a.bias, a.sinks)]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
        (_, (out, lse)), grads = step(*args, a.q_seg, a.kv_seg, a.positions, jnp.asarray(a.out_weight, dtype),
                                      jnp.asarray(a.lse_weight, dtype))
        as64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
        return as64(out), as64(lse), [as64(g) for g in grads]


def lay_np(x, layout: str, ring: int, axis: int = 1) -> np.ndarray | None:
    """`layouts.lay_out` on the host (NumPy): no device program per shape, as an eager `jnp.take` would be."""
    if x is None:
        return None
    x = np.asarray(x)
    return np.take(x, layouts.global_order(layout, x.shape[axis], ring), axis=axis)


def restore_np(x, layout: str, ring: int, axis: int = 1) -> np.ndarray | None:
    """`layouts.restore` on the host, as float64."""
    if x is None:
        return None
    x = np.asarray(x, np.float64)
    return np.take(x, np.argsort(layouts.global_order(layout, x.shape[axis], ring)), axis=axis)


def run_ring(case: Case, a: Arrays, *, use_axis: bool = True):
    """`ring_attention` on `case.ring` simulated devices: out, lse and gradients in natural order.

    With `use_axis=False` (ring of 1 only) it is called directly, with `axis_name=None`.
    """
    assert use_axis or case.ring == 1
    ring, layout = case.ring, case.layout
    dtype = jnp.dtype(case.dtype)
    interpret = case.interpret and case.backend != "scan"

    def lay(x, axis=1):
        return lay_np(x, layout, ring, axis)

    def back(x, axis=1):
        return restore_np(x, layout, ring, axis)

    bias = a.bias
    if bias is not None:
        bias = lay(bias, 2) if bias.shape[2] > 1 else bias
        bias = lay(bias, 3) if bias.shape[3] > 1 else bias
    seq = P(None, "sp")
    bias_spec = P() if bias is None or bias.shape[2] == 1 else P(None, None, "sp", None)
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def local(q, k, v, bias, sinks, q_seg, kv_seg, pos, w, u):
        out, lse = ring_attention(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=pos, kv_positions=pos,
            softmax_aux=sinks, bias=bias, axis_name="sp" if use_axis else None, layout=layout, fwd_params=case.fwd,
            bwd_params=case.bwd, return_lse=True, backend=case.backend, interpret=interpret,
            **case.options)
        return out, lse

    sharded = jax.shard_map(
        local, mesh=mesh,
        in_specs=(seq, seq, seq, bias_spec, P(), seq, seq, seq, seq, P(None, None, "sp")),
        out_specs=(seq, P(None, None, "sp")),
        check_vma=check_vma(case.backend, interpret)) if use_axis else local

    def loss(q, k, v, bias, sinks, q_seg, kv_seg, pos, w, u):
        out, lse = sharded(q, k, v, bias, sinks, q_seg, kv_seg, pos, w, u)
        return _loss(out, lse, w, u), (out, lse)

    cast = lambda x: None if x is None else jnp.asarray(x, dtype)  # noqa: E731
    args = (cast(lay(a.q)), cast(lay(a.k)), cast(lay(a.v)), cast(bias), cast(a.sinks), lay(a.q_seg),
            lay(a.kv_seg), lay(a.positions), lay(a.out_weight), lay(a.lse_weight, 2))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, (out, lse)), (dq, dk, dv, dbias, dsinks) = step(*args)
    assert out.dtype == dtype, f"output dtype {out.dtype} != query dtype {dtype}"
    assert lse.dtype == jnp.float32, f"lse dtype {lse.dtype} is not float32"
    if dbias is not None:
        dbias = back(dbias, 2) if dbias.shape[2] > 1 else np.asarray(dbias, np.float64)
        dbias = back(dbias, 3) if dbias.shape[3] > 1 else dbias
    return back(out), back(lse, 2), [back(dq), back(dk), back(dv), dbias,
                                      None if dsinks is None else np.asarray(dsinks, np.float64)]


def inner_jaxprs(eqn) -> list:
    """The jaxprs an equation holds in its parameters (a loop's body, a branch, a custom rule's), to walk."""
    from jax.extend import core

    return [getattr(sub, "jaxpr", sub) for param in eqn.params.values()
            for sub in (param if isinstance(param, (list, tuple)) else (param,))
            if isinstance(sub, (core.ClosedJaxpr, core.Jaxpr))]


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Relative Frobenius error; NaN anywhere counts as infinitely wrong."""
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


def grad_error(name: str, got: np.ndarray, want: np.ndarray, a: Arrays, out: np.ndarray, lse: np.ndarray) -> float:
    """A gradient's relative error against float64 (`want`; `out` and `lse` the float64 forward). d sinks is
    a sum over rows of terms of both signs that can cancel to a small fraction of their size (a drawn case
    summed to 4e-4 of its terms, and float32 dense attention itself was then 3.8e-5 off it, relatively): its
    error is measured against the size of its terms (`_sink_terms`), in float32 and low precision alike."""
    if name == "dsinks":
        return float(np.linalg.norm(got - want) / max(_sink_terms(a, out, lse), 1e-12))
    return rel_err(got, want)


def assert_lse_close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    empty = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), empty), "rows without any readable key must have lse -inf"
    assert not np.any(np.isnan(got)), "lse has NaN"
    assert rel_err(got[~empty], want[~empty]) <= tol


def check_case(case: Case, fwd_tol: float = 1e-5, grad_tol: float = 1e-4, *, use_axis: bool = True) -> None:
    """Run a float32 case on the ring and assert DESIGN section 10's tolerances against float64."""
    a = make_arrays(case)
    out_r, lse_r, grads_r = run_reference(case, a)
    out, lse, grads = run_ring(case, a, use_axis=use_axis)
    assert rel_err(out, out_r) <= fwd_tol, f"forward error {rel_err(out, out_r):.2e}"
    assert_lse_close(lse, lse_r, fwd_tol)
    empty_rows = np.isneginf(lse_r)  # [B,H,T]
    assert np.all(out.transpose(0, 2, 1, 3)[empty_rows] == 0.0), "empty rows must output exactly 0"
    for name, got, want in zip(GRAD_NAMES, grads, grads_r):
        assert (got is None) == (want is None), name
        if got is not None:
            error = grad_error(name, got, want, a, out_r, lse_r)
            assert error <= grad_tol, f"{name} error {error:.2e}"


def check_low_precision(case: Case) -> None:
    """bf16 / fp16: at most twice the error of dense attention computed in the same dtype (both
    against float64), and never above the 2e-2 backstop.

    The float64 reference is computed from the inputs rounded to the dtype -- the inputs both
    implementations actually get. Against unrounded inputs, the rounding of the inputs dominates small
    problems, and an exact computation on the rounded inputs can then show 4x the error of a dense
    bf16 one whose own roundings happen to cancel it (seen on a 4-token case).

    d sinks is a sum over rows of terms of both signs, `-p_sink * delta`, that can cancel to a small
    fraction of their size, while both implementations get the output's cotangent rounded to the dtype.
    Its errors are therefore measured against the size of its terms (`_sink_terms`), and a dense
    computation that happens to land close does not set the bar below the dtype's rounding of them.
    """
    rounded = lambda x: None if x is None else np.asarray(jnp.asarray(x, case.dtype), np.float32)  # noqa: E731
    arrays = make_arrays(case)
    a = dataclasses.replace(arrays, **{n: rounded(getattr(arrays, n)) for n in ("q", "k", "v", "bias", "sinks")})
    out_64, lse_64, grads_64 = run_reference(case, a)
    out_lo, _, grads_lo = run_reference(case, a, dtype=jnp.dtype(case.dtype))
    out, _, grads = run_ring(case, a)
    pairs = [("out", out, out_lo, out_64)] + [
        (name, g, g_lo, g_64) for name, g, g_lo, g_64 in zip(GRAD_NAMES, grads, grads_lo, grads_64)
        if g is not None]
    for name, got, dense_lo, want in pairs:
        ours, dense = (grad_error(name, x, want, a, out_64, lse_64) for x in (got, dense_lo))
        if name == "dsinks":
            dense = max(dense, float(jnp.finfo(case.dtype).eps))
        assert ours <= 2e-2, f"{name}: error {ours:.2e} above the 2e-2 backstop"
        assert ours <= 2 * dense, f"{name}: error {ours:.2e} > 2x dense {case.dtype} error {dense:.2e}"


def _sink_terms(a: Arrays, out: np.ndarray, lse: np.ndarray) -> float:
    """The size of d sinks' terms: the norm over sinks of the sum over rows of |p_sink * delta| (float64), with
    `delta = rowsum(dout * out) - dlse` of the loss's weights."""
    sinks = a.sinks.astype(np.float64).reshape(a.sinks.shape[0], -1)  # [H, n]
    finite = np.isfinite(lse)
    p_sink = np.exp(sinks[None, :, None, :] - np.where(finite, lse, np.inf)[..., None])  # [B, H, T, n]
    delta = np.einsum("bthd,bthd->bht", a.out_weight.astype(np.float64), out) - np.where(finite, a.lse_weight, 0.0)
    return float(np.linalg.norm(np.abs(p_sink * delta[..., None]).sum(axis=(0, 2))))


def replace(case: Case, **changes) -> Case:
    return dataclasses.replace(case, **changes)


# --------------------------------------------------------------------------------------------------
# Exchanging implementations (all_to_all, all_gather): one attend under shard_map against float64 dense.
# --------------------------------------------------------------------------------------------------


def exchanged_step(name: str, case: Case, config, a2a: int = 1, interpret: bool = False):
    """The jitted value-and-gradient of the registered implementation `name`'s attend under `shard_map` on
    `case.ring` devices (with `a2a` > 1, the hybrid's `case.ring x a2a` mesh, axes ("ring", "a2a"), the
    sequence over both), over laid-out global arrays (`laid_out_args`): ((loss, (out, lse)), (dq, dk, dv,
    dsinks)). `interpret`: its kernels in their interpreter."""
    from tuner.runtime import plan
    from tuner import registry

    implementation = registry.get(name)
    ring, layout = case.ring, case.layout
    if a2a > 1:
        axis_name = ("ring", "a2a")
        mesh = Mesh(np.array(jax.devices()[:ring * a2a]).reshape(ring, a2a), axis_name)
    else:
        axis_name = "sp"
        mesh = Mesh(np.array(jax.devices()[:ring]), (axis_name,))
    seq, lse_spec = P(None, axis_name), P(None, None, axis_name)

    def local(q, k, v, sinks, q_seg, kv_seg, pos):
        arrays = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=pos, kv_positions=pos,
                      softmax_aux=sinks, bias=None)
        resolved = plan.resolve(q, k, v, ring_size=ring * a2a, layout=layout, backend=name,
                                target=registry.Target.here(interpret), mask=case.options, arrays=arrays,
                                return_lse=True, axis_name=axis_name, group=a2a if a2a > 1 else None)
        assert resolved.implementation is implementation
        return implementation.attend(q, k, v, spec=resolved.spec, config=config, axis_name=axis_name,
                                     layout=layout, interpret=interpret, return_lse=True, **arrays)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(), seq, seq, seq), out_specs=(seq, lse_spec),
                            check_vma=implementation.vma_checked(registry.Target.here(interpret)))

    def loss(q, k, v, sinks, q_seg, kv_seg, pos, w, u):
        out, lse = sharded(q, k, v, sinks, q_seg, kv_seg, pos)
        return _loss(out, lse, w, u), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def laid_out_args(case: Case, a: Arrays) -> tuple:
    """The arguments of `exchanged_step`: the case's arrays laid out for its ring."""
    def lay(x, axis=1):
        return None if x is None else jnp.asarray(lay_np(x, case.layout, case.ring, axis))

    return (lay(a.q), lay(a.k), lay(a.v), None if a.sinks is None else jnp.asarray(a.sinks), lay(a.q_seg),
            lay(a.kv_seg), lay(a.positions), lay(a.out_weight), lay(a.lse_weight, 2))


def dense_step(case: Case, a: Arrays):
    """`run_reference` (the float64 dense oracle) under one `jax.jit`: one compile, not one per operation."""
    with jax.enable_x64(True):
        def loss(q, k, v, sinks, q_seg, kv_seg, pos, w, u):
            out, lse = dense_attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=q_seg,
                                       kv_segment_ids=kv_seg, softmax_aux=sinks, **case.options)
            return jnp.vdot(out, w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (out, lse)

        f64 = [None if x is None else jnp.asarray(x, jnp.float64) for x in (a.q, a.k, a.v, a.sinks)]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, (out, lse)), grads = step(*f64, a.q_seg, a.kv_seg, a.positions, jnp.asarray(a.out_weight, jnp.float64),
                                      jnp.asarray(a.lse_weight, jnp.float64))
        as64 = [None if x is None else np.asarray(x, np.float64) for x in (out, lse, *grads)]
    return as64[0], as64[1], [*as64[2:5], None, as64[5]]


def check_exchanged(name: str, case: Case, config, a2a: int = 1, interpret: bool = False):
    """`name` against float64 dense at DESIGN section 10's float32 tolerances: 1e-5 forward and lse, 1e-4
    gradients; rows that read nothing output exactly 0. `a2a`: the hybrid's all-to-all axis size;
    `interpret`: its kernels in their interpreter. Returns the step it checked (`exchanged_step`)."""
    a = make_arrays(case)
    out_r, lse_r, grads_r = dense_step(case, a)

    def back(x, axis=1):
        return restore_np(x, case.layout, case.ring, axis)

    step = exchanged_step(name, case, config, a2a, interpret)
    (_, (out, lse)), (dq, dk, dv, dsinks) = step(*laid_out_args(case, a))
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    out, lse = back(out), back(lse, 2)
    grads = [back(dq), back(dk), back(dv), None, None if dsinks is None else np.asarray(dsinks, np.float64)]
    assert rel_err(out, out_r) <= 1e-5, f"forward error {rel_err(out, out_r):.2e}"
    assert_lse_close(lse, lse_r, 1e-5)
    assert np.all(out.transpose(0, 2, 1, 3)[np.isneginf(lse_r)] == 0.0), "empty rows must output exactly 0"
    for grad, got, want in zip(GRAD_NAMES, grads, grads_r):
        assert (got is None) == (want is None), grad
        if got is not None:
            error = grad_error(grad, got, want, a, out_r, lse_r)
            assert error <= 1e-4, f"{grad} error {error:.2e}"
    return step


def check_loader_by_name(name: str, ring: int, shape: tuple[int, int, int, int], kv_heads: int, window: int,
                         caplog) -> None:
    """The loader with `backend=name` over a mesh of `ring` devices, causal with a `window`, on queries of
    `shape` `[B, T, H, D]`, returns output and lse equal to dense attention (1e-5), from the
    implementation's defaults, without a warning (no fallback)."""
    import logging

    from tuner import get_tuned_ring_attention

    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, sliding_window=(window, 0), mesh=mesh,
                                    backend=name, layout="zigzag")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((*shape[:2], kv_heads, shape[3])), jnp.float32) for _ in range(2))
    decision = attn.explain(q, k, v, return_lse=True)
    assert (decision.backend, decision.source) == (name, "default")
    with caplog.at_level(logging.WARNING):
        out, lse = jax.jit(lambda q, k, v: attn(q, k, v, return_lse=True))(q, k, v)  # one compile, not op by op
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "it must not fall back"
    want, want_lse = jax.jit(lambda q, k, v: dense_attention(q, k, v, causal=True, sliding_window=(window, 0)))(q, k, v)
    assert rel_err(np.asarray(out), np.asarray(want)) <= 1e-5
    assert rel_err(np.asarray(lse), np.asarray(want_lse)) <= 1e-5
