"""Every option and combination, on one device and on rings of 1-8 simulated devices, against the
dense float64 oracle: forward output, lse, and the gradients dq, dk, dv, dbias, dsinks."""

import pytest
from hypothesis import given, settings

from tests.cases import cases, check_case, check_low_precision
from tuner.semantics.layouts import LAYOUTS


@pytest.mark.slow
@given(cases(ring_sizes=(1,)))
def test_one_device_matches_dense(case):
    check_case(case, use_axis=False)


@pytest.mark.slow
@given(cases(ring_sizes=(1, 2, 4, 8), layouts_=LAYOUTS))
def test_ring_matches_dense(case):
    check_case(case)


@pytest.mark.slow
@given(cases(ring_sizes=(1, 2, 4), dtype="bfloat16") | cases(ring_sizes=(1, 2, 4), dtype="float16"))
@settings(max_examples=max(4, settings.default.max_examples // 2))
def test_low_precision_within_twice_dense_error(case):
    check_low_precision(case)
