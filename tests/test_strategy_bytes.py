"""Issue 17: the strategy model's bytes per collective are what the production TPU compiler's programs move.

Each strategy's training step (forward and backward) on a 4-chip v5e topology, compiled on this CPU host,
its collectives read from the scheduled HLO (`benchmarks/strategy_bytes.py`, which does the same for 8
chips, larger problems and the forward alone); per kind, the model's bytes (`strategy_model.predict`) are
within 10% of the program's. Kinds under 1% of a program's bytes are not compared (the ring's position
bounds, which XLA:TPU builds as an all-reduce). The all_gather's backward reduce-scatter is the
exception: XLA:TPU builds it as an all-reduce of the whole dK, dV, so its bytes are checked as that.

Skipped where libtpu is not installed (`pip install -e '.[tpu]'`)."""

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed: pip install -e '.[tpu]' compiles for TPU topologies")

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: libtpu's worker list, without a warning
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

from tuner import hlo, registry  # noqa: E402
from tuner.problem import Problem  # noqa: E402

_SPEC = importlib.util.spec_from_file_location("strategy_bytes",
                                               Path(__file__).parent.parent / "benchmarks" / "strategy_bytes.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)

TOPOLOGY = "v5e:2x2"
PROBLEM = Problem(seq_len=4096, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True, ring_size=4,
                  layout="zigzag")
HYBRID = pytest.mark.skipif(registry.find("hybrid") is None, reason="hybrid not registered yet")


@pytest.mark.parametrize("strategy, axes", [("ring", None), ("all_to_all", None), ("all_gather", None),
                                            pytest.param("hybrid", (2, 2), marks=HYBRID)],
                         ids=["ring", "all_to_all", "all_gather", "hybrid-2x2"])
def test_the_models_bytes_are_what_the_compiled_training_step_moves(strategy, axes):
    devices = bench.topology_devices(TOPOLOGY)
    compiled = bench.compiled_bytes(PROBLEM, strategy, devices, True, axes)
    model = bench.model_bytes(PROBLEM, strategy, devices[0].device_kind, True, axes)
    compared = [k for k in hlo.COLLECTIVE_KINDS if compiled[k] > bench.NEGLIGIBLE * sum(compiled.values())]
    assert compared, compiled  # the program moves bytes the check can see
    off = bench.disagreements(compiled, model)
    if strategy == "all_gather":  # dK, dV: an all-reduce of the whole buffer, each device keeping its slice
        assert off == ["reduce-scatter"] and bench.scatter_as_all_reduce(compiled, model, PROBLEM.ring_size), \
            (compiled, model)
    else:
        assert off == [], (off, compiled, model)


LOOP = """HloModule m

%cond (p: (s32[], f32[2])) -> pred[] {
  %p = (s32[], f32[2]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(5)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %p = (s32[], f32[2]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %c = s32[]{:T(128)} copy(%i)
  %one = s32[]{:T(128)} constant(1)
  %x = f32[2]{0} get-tuple-element(%p), index=1
  %done = f32[2]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %next = s32[]{:T(128)} add(%c, %one)
  ROOT %t = (s32[], f32[2]{0}) tuple(%next, %done)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %start = s32[]{:T(128)} constant(1)
  %init = (s32[], f32[2]{0}) tuple(%start, %x)
  %w = (s32[], f32[2]{0}) while(%init), condition=%cond, body=%body, backend_config={"flag_configs":[]}
  ROOT %r = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_trip_counts_the_tpu_compiler_leaves_out_are_read_from_the_loop():
    """XLA:TPU writes no `known_trip_count` on its loops; `with_trip_counts` reads `for i = 1; i < 5; i++`
    as 4 trips, and refuses a loop it cannot read rather than count it once."""
    assert bench.collective_bytes(LOOP)["collective-permute"] == 4 * 2 * 4
    with pytest.raises(ValueError, match="cannot read the trip count"):
        bench.with_trip_counts(LOOP.replace("direction=LT", "direction=NE"))
