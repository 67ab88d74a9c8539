"""The Pallas TPU backend without a TPU: the rendered kernels run in Pallas's TPU interpret mode inside
the whole ring (every feature but bias, forward and every gradient, rings of 1, 2 and 4 simulated
devices, float32 at DESIGN tolerances and bf16 within twice dense's error), and every standard variant
lowers for the TPU platform."""

from hypothesis import given, settings

from tests.cases import check_case, check_low_precision, pallas_tpu_cases

FEW = max(4, settings.default.max_examples // 2)


@given(pallas_tpu_cases(ring_sizes=(1, 2, 4)))
@settings(max_examples=FEW)
def test_interpreted_kernels_in_the_ring_match_dense(case):
    check_case(case)


@given(pallas_tpu_cases(ring_sizes=(1, 2), dtype="bfloat16"))
@settings(max_examples=max(2, FEW // 2))
def test_interpreted_bfloat16_within_twice_dense_error(case):
    check_low_precision(case)
