"""The check every candidate passes before it is timed (`tuner.tuning.verify`): float32 at DESIGN's
tolerances; bfloat16 within twice the scan ring's own error in bfloat16, on the very program that is timed."""

import jax.numpy as jnp
import pytest

from tuner import BwdParams, FwdParams
from tuner.semantics.problem import Problem
from tuner.strategies.configs import TileConfig
from tuner.tuning import verify
from tuner.tuning.verify import ReferenceCheck, TrialFailed
from tuner.tuning.workload import Workload

SMALL = dict(batch=1, seq_len=128, heads=4, kv_heads=2, head_dim=16, causal=True, ring_size=2)


def _scaled(fn, factor: float):
    """`fn` with its output scaled by `factor`: a candidate off by `factor - 1`, relative."""
    return lambda x: fn(x) * jnp.asarray(factor, fn(x).dtype)


def test_a_bfloat16_candidate_is_checked_in_bfloat16_on_its_timed_program(monkeypatch):
    """The bar is bfloat16's (twice the scan ring's own error, at least its epsilon), not float32's: other
    tiles pass, and so does a candidate off by 1e-3; one off by 5e-2 (4.7e-2 in bfloat16) is wrong. The check runs the
    program that is timed: one compile per candidate, none at float32."""
    workload = Workload(Problem(**SMALL, dtype="bfloat16"))
    check = ReferenceCheck(workload, seed=0, backward=False)
    assert check.inputs["q"].dtype == jnp.bfloat16 and check.outputs["out"].dtype == jnp.float32
    assert jnp.finfo(jnp.bfloat16).eps <= check.bars["out"] < 2e-2
    assert not check.separate

    compiles = []
    compile_ = workload.compile
    monkeypatch.setattr(workload, "compile", lambda *a, **k: compiles.append(a[1]["q"].dtype) or compile_(*a, **k))
    fn = workload.attend("scan", TileConfig(FwdParams(block_q=32, block_kv=32), BwdParams(32, 32)))
    timed, _ = check.compile_checked(fn, *workload.draw(seed=1))
    assert compiles == [jnp.bfloat16]
    assert check.mismatch(timed) is None
    assert check.mismatch(check.compile(_scaled(fn, 1.001))) is None
    with pytest.raises(TrialFailed, match=r"wrong: out differs from the scan reference by 4\.\d+e-02 .* bar "
                                          r"\(twice the scan ring's own bfloat16 error"):
        check.compile_checked(_scaled(fn, 1.05), *workload.draw(seed=1))


def test_float32_is_checked_at_its_tolerances_and_apart_where_products_are_not_exact(monkeypatch):
    """float32: 1e-5 forward, 1e-4 gradients; on a platform whose default float32 products are not exact
    (TF32 on a GPU), the check compiles its own program at precision 'highest'."""
    workload = Workload(Problem(**SMALL, dtype="float32"))
    check = ReferenceCheck(workload, seed=0, backward=True)
    assert check.bars == {"out": 1e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4} and not check.separate
    monkeypatch.setattr(verify, "EXACT_PLATFORMS", ())
    assert ReferenceCheck(workload, seed=0, backward=False).separate
