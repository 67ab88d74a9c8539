"""The positions a ring step pairs, known in the trace (`tuner.semantics.known`)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from tuner import ring_attention
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics import known, layouts
from tuner.semantics.spec import AttentionSpec
from tuner.strategies.ring import run_ring

import scripts

first_trace = scripts.load("benchmarks/suite/first_trace.py")


def test_a_ring_block_lists_every_device_at_every_step_of_its_group():
    block = known.ring_block("zigzag", 4, 4, 2, range(2))
    cases = [(rank, step) for rank in range(2) for step in range(2)]
    assert block.q.shape == block.kv.shape == (4, 4) and block.q.dtype == np.int32
    for row, (rank, step) in enumerate(cases):
        assert block.q[row].tolist() == layouts.local_positions_np("zigzag", 4, 2, rank).tolist()
        assert block.kv[row].tolist() == layouts.local_positions_np("zigzag", 4, 2, (rank - step) % 2).tolist()
    assert block.chunk(2, 2, 0, 2).q.tolist() == block.q[:, 2:].tolist()


def test_nothing_is_known_without_a_layout_steps_or_past_the_limit():
    assert known.ring_block(None, 4, 4, 2, range(1)) is None  # positions were passed
    assert known.ring_block("zigzag", 4, 4, 2, range(1, 1)) is None
    length = known.LIMIT // 8 + 2
    assert known.ring_block("contiguous", length, length, 8, range(1)) is None
    assert known.ring_block("contiguous", length - 2, length - 2, 8, range(1)) is not None


def test_a_rule_is_agreed_only_when_every_case_gives_the_same_value():
    block = known.ring_block("contiguous", 4, 4, 2, range(1, 2))  # rank 0 meets keys after its own, rank 1 before
    assert block.agreed(lambda q, kv: q.min(axis=1) > kv.max(axis=1)) is None
    assert block.agreed(lambda q, kv: q.min(axis=1) != kv.min(axis=1)) == 1
    assert block.agreed(lambda q, kv: q.shape[1] + 0 * q.min(axis=1)) == 4


def test_the_trace_s_decisions_pass_a_transfer_guard_that_refuses_every_transfer():
    """Deciding in the trace runs the rules on the layout's positions, constants of the program: a caller's
    `jax.transfer_guard("disallow")` has nothing to refuse there."""
    q = jnp.ones((1, 64, 2, 16), jnp.bfloat16)
    attend = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True, backend="cudnn", interpret=True))
    with jax.transfer_guard("disallow"):
        out = attend(q, q, q)
    assert out.shape == q.shape


def test_an_eager_shard_map_gives_the_jitted_results():
    """Outside `jax.jit`, `shard_map` runs its body op by op. The rules, in NumPy, still decide there what the
    trace knows (as jax programs they could not, and the ring decided on the device), and the result is the
    jitted program's. The cudnn kernel's twin, which asks the trace the most (a step's visit, each chunk
    pair's kind, the pair each device chooses)."""
    ring = 2
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    spec = AttentionSpec(scale=0.25, causal=True)

    def local(q, k, v):
        return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(8, 8), bwd_params=BwdParams(8, 8),
                        axis_name="sp", layout="zigzag", interpret=True)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    q, k, v = (jax.random.normal(key, (1, 32, 2, 16), jnp.bfloat16) for key in jax.random.split(jax.random.key(3), 3))
    eager, jitted = sharded(q, k, v), jax.jit(sharded)(q, k, v)
    np.testing.assert_allclose(np.asarray(eager, np.float32), np.asarray(jitted, np.float32), rtol=2e-2, atol=2e-2)


def test_tracing_a_cudnn_ring_compiles_nothing():
    """The trace runs the rules on the known positions in NumPy (`KnownBlock.agreed`): lowering a causal zigzag
    ring of 4 over the cudnn kernel's twin (2 chunks a half, every step's pairs decided in the trace;
    `benchmarks/suite/first_trace.py`'s ring) compiles no program. As jax programs, one a rule and shape, the
    rules compiled 15 on jax 0.10.2 (47 op by op). The listener counts: a jitted function compiled after the
    trace is its one program."""
    with first_trace.compiles_counted() as compiles:
        first_trace.lower_ring_gradient("cudnn")
        traced = len(compiles)
        jax.jit(lambda x: x + 1)(np.arange(3.0))
    assert traced == 0, f"the trace compiled {traced} programs"
    assert len(compiles) == 1, compiles
