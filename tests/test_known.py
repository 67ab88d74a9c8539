"""The positions a ring step pairs, known in the trace (`tuner.semantics.known`)."""

import jax
import jax.numpy as jnp
import numpy as np

from tuner import ring_attention
from tuner.semantics import known, layouts


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
