"""Every option and combination, on one device and on rings of 1-8 simulated devices, against the
dense float64 oracle: forward output, lse, and the gradients dq, dk, dv, dbias, dsinks."""

from hypothesis import given

from tests.cases import cases, check_case
from tuner.layouts import LAYOUTS


@given(cases(ring_sizes=(1,)))
def test_one_device_matches_dense(case):
    check_case(case, use_axis=False)


@given(cases(ring_sizes=(1, 2, 4, 8), layouts_=LAYOUTS))
def test_ring_matches_dense(case):
    check_case(case)
