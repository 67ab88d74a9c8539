"""Every option and combination, on one device and on rings of 1-8 simulated devices, against the
dense float64 oracle: forward output, lse, and the gradients dq, dk, dv, dbias, dsinks."""

import jax.numpy as jnp
from hypothesis import given, settings

from tests.cases import GRAD_NAMES, cases, check_case, make_arrays, rel_err, run_reference, run_ring
from tuner.layouts import LAYOUTS


@given(cases(ring_sizes=(1,)))
def test_one_device_matches_dense(case):
    check_case(case, use_axis=False)


@given(cases(ring_sizes=(1, 2, 4, 8), layouts_=LAYOUTS))
def test_ring_matches_dense(case):
    check_case(case)


@given(cases(ring_sizes=(1, 2, 4), dtype="bfloat16") | cases(ring_sizes=(1, 2, 4), dtype="float16"))
@settings(max_examples=max(4, settings.default.max_examples // 2))
def test_low_precision_within_twice_dense_error(case):
    """bf16 / fp16: at most twice the error of dense attention computed in the same dtype (both
    against float64), and never above the 2e-2 backstop."""
    a = make_arrays(case)
    out_64, _, grads_64 = run_reference(case, a)
    out_lo, _, grads_lo = run_reference(case, a, dtype=jnp.dtype(case.dtype))
    out, _, grads = run_ring(case, a)
    pairs = [("out", out, out_lo, out_64)] + [
        (name, g, g_lo, g_64) for name, g, g_lo, g_64 in zip(GRAD_NAMES, grads, grads_lo, grads_64)
        if g is not None]
    for name, got, dense_lo, want in pairs:
        ours, dense = rel_err(got, want), rel_err(dense_lo, want)
        assert ours <= 2e-2, f"{name}: error {ours:.2e} above the 2e-2 backstop"
        assert ours <= 2 * dense, f"{name}: error {ours:.2e} > 2x dense {case.dtype} error {dense:.2e}"
