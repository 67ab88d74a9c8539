"""Positions anywhere in the int32 range, and windows and chunks up to 2**31 - 1, give exact attention
(ring, dense reference and kernels) or a ValueError naming the argument; with positions from the
layout, a window at least as long as the sequence is no window.

Attention with causal, window and chunk masks depends on positions only through their differences
(and, for chunks, on which multiple of the chunk size they fall between): shifting every position by
the same amount (a multiple of the chunk size) gives the same result. The shifted tests put three
copies of one problem in one batch -- at small positions, shifted to the top of the int32 range and to
its bottom -- so one compiled call compares them.
"""

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.cases import GRAD_NAMES, Case, assert_lse_close, make_arrays, rel_err, run_reference, run_ring
from tuner import BwdParams, FwdParams, registry, ring_attention
from tuner.semantics import masks
from tuner.semantics.problem import Problem
from tuner.semantics.spec import INT32_MAX, INT32_MIN, AttentionSpec, build_spec

LOCAL = 16
BASE = Case(batch=1, length=2 * LOCAL, heads=2, kv_heads=1, head_dim=8, ring=2, layout="contiguous",
            fwd=FwdParams(8, 8), bwd=BwdParams(8, 8))


def _assert_close(got, want, tol: float = 1e-6) -> None:
    """`run_ring` / `run_reference` results (out, lse, grads) equal within `tol` (relative)."""
    (out, lse, grads), (out_w, lse_w, grads_w) = got, want
    assert rel_err(out, out_w) <= tol, f"forward error {rel_err(out, out_w):.2e}"
    assert_lse_close(lse, lse_w, tol)
    for name, g, g_w in zip(GRAD_NAMES, grads, grads_w):
        assert (g is None) == (g_w is None), name
        if g is not None:
            assert rel_err(g, g_w) <= tol, f"{name} error {rel_err(g, g_w):.2e}"


def _within_design_tolerance(got, want) -> None:
    """float32 against the float64 oracle: DESIGN section 10's 1e-5 forward and 1e-4 gradients."""
    (out, lse, grads), (out_w, lse_w, grads_w) = got, want
    assert rel_err(out, out_w) <= 1e-5, f"forward error {rel_err(out, out_w):.2e}"
    assert_lse_close(lse, lse_w, 1e-5)
    for name, g, g_w in zip(GRAD_NAMES[:3], grads, grads_w):
        assert rel_err(g, g_w) <= 1e-4, f"{name} error {rel_err(g, g_w):.2e}"


# --------------------------------------------------------------------------------------------------
# A window at least as long as the sequence.
# --------------------------------------------------------------------------------------------------


def test_a_window_as_long_as_the_sequence_is_no_window():
    """Windows of 2**31 - T and 2**31 - 1 with causal: the ring (positions from the layout) gives the
    no-window result; the dense reference, on the same positions as explicit int32, agrees."""
    plain = dataclasses.replace(BASE, causal=True)
    a = make_arrays(plain)
    want = run_ring(plain, a)
    explicit = dataclasses.replace(a, positions=np.arange(plain.length, dtype=np.int32)[None])
    oracle = run_reference(plain, explicit)
    _within_design_tolerance(want, oracle)
    for window in (2**31 - LOCAL, INT32_MAX):
        case = dataclasses.replace(plain, window=window)
        _assert_close(run_ring(case, a), want)
        _assert_close(run_reference(case, explicit), oracle, tol=1e-12)


def test_build_spec_clips_the_window_to_the_position_span():
    def spec(window, causal=False, span=63):
        return build_spec(jnp.zeros((1, 1, 1, 8)), causal=causal, sliding_window=window, chunk_size=None,
                          logits_soft_cap=None, softmax_scale=None, has_segments=False, bias=None,
                          softmax_aux=None, position_span=span)

    assert spec(63).window is None and spec((10**6, 63)).window is None
    assert spec((INT32_MAX, 0), causal=True) == spec(None, causal=True)  # causal already excludes the right
    assert spec((INT32_MAX, 0), causal=True).features() == spec(None, causal=True).features()
    assert spec((5, 10**6)).window == (5, 63) and spec((63, 0)).window == (63, 0)
    assert spec(62).window == (62, 62) and spec(0, span=0).window is None
    assert spec(63, span=None).window == (63, 63)  # explicit positions: no span, the window stays


def test_problem_treats_a_window_as_long_as_the_sequence_as_none():
    small = dict(batch=1, seq_len=64, heads=2, kv_heads=1, head_dim=8, ring_size=2, layout="zigzag")
    assert Problem(**small, causal=True, window=(64, 0)).window is None
    assert Problem(**small, causal=False, window=63).window is None
    assert Problem(**small, causal=False, window=(10**6, 3)).window == (63, 3)
    assert (registry.problem_key(Problem(**small, causal=True, window=INT32_MAX), "scan", "cpu")
            == registry.problem_key(Problem(**small, causal=True), "scan", "cpu"))


def test_a_chunk_as_long_as_the_sequence_is_no_chunk_and_the_loader_meets_the_search():
    """A chunk holding every layout position is no chunk, for the spec, the search's problem and the
    loader's key; a window as long as the sequence likewise (the loader builds the key the search
    stored)."""
    from tuner import get_tuned_ring_attention

    small = dict(batch=1, seq_len=64, heads=2, kv_heads=1, head_dim=8, ring_size=2, layout="zigzag", causal=True)
    assert Problem(**small, chunk_size=64).chunk_size is None and Problem(**small, chunk_size=63).chunk_size == 63
    spec = build_spec(jnp.zeros((1, 1, 1, 8)), causal=True, sliding_window=None, chunk_size=64, logits_soft_cap=None,
                      softmax_scale=None, has_segments=False, bias=None, softmax_aux=None, position_span=63)
    assert spec.chunk_size is None
    local = jax.ShapeDtypeStruct((1, 32, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 32, 1, 8), jnp.float32)
    for option in (dict(chunk_size=2**20), dict(sliding_window=(INT32_MAX, 0))):
        attn = get_tuned_ring_attention(axis_name="sp", layout="zigzag", causal=True, backend="scan", **option)
        decision = attn.explain(local, kv, kv, ring_size=2)
        assert decision.key.features == Problem(**small).spec.features(), option


# --------------------------------------------------------------------------------------------------
# Positions at the ends of the int32 range.
# --------------------------------------------------------------------------------------------------


def _shifted_rows(case: Case):
    """The arrays of `case` (batch 1, explicit positions p) repeated over three rows that differ only in
    their positions: p, p shifted so that its largest is within a chunk of INT32_MAX, and p shifted so
    that its smallest is within a chunk of INT32_MIN (shifts are multiples of the chunk size)."""
    one = make_arrays(dataclasses.replace(case, batch=1, explicit_positions=True))
    p = one.positions[0].astype(np.int64)
    step = case.chunk or 1
    top = (INT32_MAX - p.max()) // step * step
    bottom = -((p.min() - INT32_MIN) // step * step)
    positions = np.stack([p, p + top, p + bottom]).astype(np.int32)
    assert positions[1].max() > INT32_MAX - step and positions[2].min() < INT32_MIN + step
    rows = {name: np.repeat(getattr(one, name), 3, axis=0) for name in ("q", "k", "v", "out_weight", "lse_weight")}
    return dataclasses.replace(one, positions=positions, **rows)


def _row(results, b: int):
    out, lse, grads = results
    return out[b], lse[b], [None if g is None else g[b] for g in grads]


@pytest.mark.parametrize("options", [
    dict(causal=True, window=(5, 3)),
    dict(causal=False, window=(INT32_MAX, 3)),
    dict(causal=True, chunk=8),
    dict(causal=False, chunk=8, window=(2, 2)),
], ids=["causal-window", "two-sided-window", "causal-chunk", "chunk-window"])
def test_positions_at_the_ends_of_int32_give_the_same_attention(options):
    """Ring (scan backend, 2 devices) and dense reference: the rows shifted to either end of the int32
    range equal the row at small positions, and match the float64 oracle."""
    case = dataclasses.replace(BASE, batch=3, **options)
    a = _shifted_rows(case)
    ring, oracle = run_ring(case, a), run_reference(case, a)
    for shifted in (1, 2):
        _assert_close(_row(ring, shifted), _row(ring, 0))
        _assert_close(_row(oracle, shifted), _row(oracle, 0), tol=1e-12)
    _within_design_tolerance(ring, oracle)


def test_mask_rules_are_exact_at_the_ends_of_int32():
    """`masks.allowed` and the range rules against the same conditions computed in int64 (no wrap)."""
    ends = np.array([INT32_MIN, INT32_MIN + 1, INT32_MIN + 5, -3, 0, 4, INT32_MAX - 5, INT32_MAX - 1, INT32_MAX])
    pos = jnp.asarray(ends[None], jnp.int32)
    q_lo, q_hi, k_lo, k_hi = (ends.reshape([-1 if axis == i else 1 for axis in range(4)]) for i in range(4))
    real = (q_lo <= q_hi) & (k_lo <= k_hi)  # only ranges with lo <= hi are ever asked about
    for left, right in [(0, 0), (3, 5), (INT32_MAX, 0), (0, INT32_MAX), (INT32_MAX, INT32_MAX), (2**30, 7)]:
        spec = AttentionSpec(scale=1.0, window=(left, right))
        q, k = ends[:, None], ends[None, :]
        assert np.array_equal(np.asarray(masks.allowed(pos, pos, None, None, spec))[0],
                              (k >= q - left) & (k <= q + right)), (left, right)
        ranges = [jnp.asarray(x, jnp.int32) for x in (q_lo, q_hi, k_lo, k_hi)]
        some = np.asarray(masks.ranges_may_attend(*ranges, None, spec))
        every = np.asarray(masks.ranges_fully_allowed(*ranges, None, spec))
        some_want = (q_lo - left <= k_hi) & (k_lo <= q_hi + right)
        every_want = (k_lo >= q_hi - left) & (k_hi <= q_lo + right)
        assert np.array_equal(some[real], np.broadcast_to(some_want, real.shape)[real])
        assert np.array_equal(every[real], np.broadcast_to(every_want, real.shape)[real])


# --------------------------------------------------------------------------------------------------
# Values int32 cannot hold.
# --------------------------------------------------------------------------------------------------


def test_window_and_chunk_beyond_int32_raise_naming_the_argument():
    x = jnp.zeros((1, 8, 2, 8))
    for options, name in ((dict(sliding_window=2**31), "sliding_window"),
                          (dict(sliding_window=(0, 2**31)), "sliding_window"),
                          (dict(chunk_size=2**31), "chunk_size")):
        with pytest.raises(ValueError, match=f"{name} must .*2\\*\\*31 - 1"):
            ring_attention(x, x, x, **options)
        with pytest.raises(ValueError, match=f"{name} must"):
            build_spec(x, causal=False, logits_soft_cap=None, softmax_scale=None, has_segments=False, bias=None,
                       softmax_aux=None, **{"sliding_window": None, "chunk_size": None, **options})
    small = dict(batch=1, seq_len=64, heads=2, kv_heads=1, head_dim=8, ring_size=2)
    with pytest.raises(ValueError, match="^window must"):
        Problem(**small, window=(2**31, 0))
    with pytest.raises(ValueError, match="^chunk_size must"):
        Problem(**small, chunk_size=2**31)
    with pytest.raises(ValueError, match="^seq_len must"):
        Problem(**{**small, "seq_len": 2**31 + 2}, layout="contiguous")


def test_layout_positions_beyond_int32_raise_naming_the_length():
    long = jax.ShapeDtypeStruct((1, 2**31 + 2, 1, 8), jnp.float32)
    short = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"global sequence length 1 x 2147483650 .* pass q_positions"):
        jax.eval_shape(lambda q, k: ring_attention(q, k, k), long, short)
    with pytest.raises(ValueError, match=r"global sequence length 1 x 2147483650 .* pass kv_positions"):
        jax.eval_shape(lambda q, k: ring_attention(q, k, k), short, long)


def test_concrete_positions_beyond_int32_raise():
    x = jnp.zeros((1, 4, 2, 8))
    with jax.enable_x64(True):
        pos = jnp.asarray([[0, 1, 2, 2**31]], jnp.int64)
        with pytest.raises(ValueError, match="kv_positions must be int32 positions"):
            ring_attention(x, x, x, q_positions=pos - 2**31, kv_positions=pos)


# --------------------------------------------------------------------------------------------------
# The kernel backends, interpreted.
# --------------------------------------------------------------------------------------------------


KERNEL_CASE = dataclasses.replace(BASE, batch=2, head_dim=16, causal=False, window=(5, 3), chunk=8)


def _kernel_matches_scan(case: Case) -> None:
    """Rows at the top and the bottom of the int32 range (window and chunk): the kernels equal the scan
    backend's ring."""
    a = _shifted_rows(case)
    a = dataclasses.replace(a, **{n: getattr(a, n)[1:] for n in ("q", "k", "v", "positions", "out_weight",
                                                                 "lse_weight")})
    got = run_ring(case, a)
    _assert_close(got, run_ring(dataclasses.replace(case, backend="scan"), a), tol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="needs triton and torch (pip install -e '.[test]')")
def test_triton_kernels_at_the_ends_of_int32():
    _kernel_matches_scan(dataclasses.replace(KERNEL_CASE, backend="triton", fwd=FwdParams(16, 16),
                                             bwd=BwdParams(16, 16, 16, 16)))


@pytest.mark.slow
def test_pallas_tpu_kernels_at_the_ends_of_int32():
    _kernel_matches_scan(dataclasses.replace(KERNEL_CASE, backend="pallas_tpu", head_dim=8, fwd=FwdParams(8, 128),
                                             bwd=BwdParams(8, 128, 8, 128)))
