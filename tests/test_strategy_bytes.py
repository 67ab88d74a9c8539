"""Issue 17: the strategy model's bytes per collective are what the production TPU compiler's programs move.

Each strategy's training step (forward and backward) on a 4-chip v5e topology, compiled on this CPU host,
its collectives read from the scheduled HLO (`benchmarks/strategies/strategy_bytes.py`, which does the same for 8
chips, larger problems and the forward alone); per kind, the model's bytes (`strategy_model.predict`) are
within 10% of the program's. Kinds under 1% of a program's bytes are not compared (the ring's position
bounds, which XLA:TPU builds as an all-reduce). Each strategy runs over the Pallas kernels on a TPU; over
them, at these 1,024 tokens, XLA:TPU builds all_gather's backward reduce-scatter of dK and dV as a
reduce-scatter (over the scan kernel, and over Pallas from 16,384 tokens, it builds an all-reduce of the
whole dK, dV, which the model times: docs/strategies.md).

Skipped where libtpu is not installed (`pip install -e '.[tpu]'`)."""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed: pip install -e '.[tpu]' compiles for TPU topologies")

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: libtpu's worker list, without a warning
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

from tuner.models import hlo  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402

import scripts  # noqa: E402

bench = scripts.load("benchmarks/strategies/strategy_bytes.py")

TOPOLOGY = "v5e:2x2"
PROBLEM = Problem(seq_len=1024, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True, ring_size=4,
                  layout="zigzag")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, axes", [("ring", None), ("all_to_all", None), ("all_gather", None),
                                            ("hybrid", (2, 2))],
                         ids=["ring", "all_to_all", "all_gather", "hybrid-2x2"])
def test_the_models_bytes_are_what_the_compiled_training_step_moves(strategy, axes):
    devices = bench.topology_devices(TOPOLOGY)
    compiled = bench.compiled_bytes(PROBLEM, strategy, devices, True, axes)
    model = bench.model_bytes(PROBLEM, strategy, devices[0].device_kind, True, axes)
    compared = [k for k in hlo.COLLECTIVE_KINDS if compiled[k] > bench.NEGLIGIBLE * sum(compiled.values())]
    assert compared, compiled  # the program moves bytes the check can see
    off = bench.disagreements(compiled, model)
    assert off == [], (off, compiled, model)
