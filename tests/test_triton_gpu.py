"""The Triton backend on a CUDA GPU: the rendered kernels compiled by Triton and called through
`jax_triton`, held to the dense float64 reference like the interpreter runs of `test_triton.py`.

Skipped without a GPU; the CPU-side equivalents are `test_triton.py` (the same kernels in Triton's
interpreter, in rings of 1, 2 and 4 simulated devices, and compiled for sm_80 / sm_90). One GPU is a
ring of one device, so these cases use `ring=1`: the multi-device ring is the driver's, and it is the
same code whichever backend computes the blocks. On a GPU machine run

    JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/test_triton_gpu.py

(`conftest.py` otherwise pins jax to the CPU).
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cases import Case, check_case, check_low_precision, triton_cases
from tuner.kernels import BACKENDS

WHY_NOT = BACKENDS["triton"].unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs a CUDA GPU with jax-triton: {WHY_NOT}")


def on_gpu(case: Case) -> Case:
    return dataclasses.replace(case, interpret=False)


@given(triton_cases(ring_sizes=(1,)).map(on_gpu))
@settings(max_examples=max(10, settings.default.max_examples))
def test_float32_kernels_on_the_gpu_match_dense(case):
    check_case(case)


@given(st.sampled_from(["bfloat16", "float16"]).flatmap(
    lambda dtype: triton_cases(ring_sizes=(1,), dtype=dtype)).map(on_gpu))
@settings(max_examples=max(10, settings.default.max_examples))
def test_low_precision_kernels_on_the_gpu_within_twice_dense_error(case):
    check_low_precision(case)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_model_sized_problem_with_default_tiles(dtype, head_dim, causal):
    """A length that is no multiple of any tile, grouped heads, the backend's default tiles."""
    fwd, bwd = BACKENDS["triton"].default_params(1000, 1000, head_dim)
    case = Case(batch=2, length=1000, heads=8, kv_heads=2, head_dim=head_dim, causal=causal, dtype=dtype,
                backend="triton", interpret=False, fwd=fwd, bwd=bwd)
    if dtype == "float32":
        check_case(case)
    else:
        check_low_precision(case)
