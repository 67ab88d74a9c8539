"""The loader's call on global arrays (`mesh=`) keeps the sequence sharded, read from the compiled programs:

- no all-gather bigger than 8 bytes a token of the global batch (segment ids and positions may travel;
  q, k, v, the output, lse and their gradients may not), beyond what the strategy itself gathers under
  `shard_map`;
- the output (or the gradients) come back sharded as the query came in, the batch on a data axis too;
- per-device memory (temp + output, `memory_analysis()`) above the same ring called under `shard_map`
  on the caller's shards by at most one copy of each array the layout moves (q, k, v and the output;
  in the backward also the output's cotangent and the gradients): its laid-out copies;
- on the CPU, no two collectives of one kind can be in flight at once (XLA:CPU cannot run them).

Every layout, forward and forward+backward (the documents layout's forward+backward only, whose program
holds its forward), on one sequence axis of 4 devices (fewer rounds of the CPU's documents move to compile
than 8) and on a 2x4 mesh with the batch on its data axis; the strategies that take `mesh=` on zigzag. The
TPU compiler's programs are in `tests/test_global_sharding_tpu.py`. `benchmarks/memory/global_memory.py` prints
the table.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scripts


global_memory = scripts.load("benchmarks/memory/global_memory.py")
Case = global_memory.Case

TOKENS = 4096  # q, k, v large enough against the fixed cost of the documents plan; compiles in about a second


def check(result) -> None:
    case = result.case
    allowed = max(8.0, result.shard_map_gather_per_token)  # ids and positions, and what the strategy gathers
    assert result.largest_gather_per_token <= allowed, (case, result.largest_gather_per_token)
    assert result.out_spec == result.in_spec, (case, result.out_spec)
    extra = result.mesh_bytes - result.shard_map_bytes
    assert extra <= case.moved_bytes(), (case, result.mesh_bytes, result.shard_map_bytes, case.moved_bytes())
    assert result.unordered == 0, case


ONE_AXIS = [(layout, backward) for layout in global_memory.LAYOUTS for backward in (False, True)
            if backward or layout != "documents"]  # the documents forward: inside its forward+backward


ONE_AXIS_IDS = [f"{layout}-{'fwd+bwd' if backward else 'fwd'}" for layout, backward in ONE_AXIS]


@pytest.mark.parametrize("layout, backward", ONE_AXIS, ids=ONE_AXIS_IDS)
def test_the_mesh_path_keeps_the_sequence_sharded_on_one_axis(layout, backward):
    result = global_memory.compile_case(Case(layout, "ring", "4", backward, TOKENS), jax.devices())
    check(result)
    moved = sum(result.collectives.values()) - sum(result.shard_map_collectives.values())
    assert moved == 0 if layout == "contiguous" else moved > 0, result  # the layout's own collectives, or none


@pytest.mark.parametrize("layout", ["zigzag", "striped", "documents"])
def test_a_batch_on_a_data_axis_stays_sharded_there(layout):
    """The mesh's other axes stay automatic: no all-to-all (XLA gathers a data axis around one); the
    striped layout and the documents' permutation move by collective permutes (the permutation's pass each
    shard around the ring)."""
    result = global_memory.compile_case(Case(layout, "ring", "2x4", True, TOKENS), jax.devices())
    check(result)
    assert result.out_spec == "P('dp', 'sp')" and "all-to-all" not in result.collectives


@pytest.mark.parametrize("strategy", ["all_to_all", "all_gather", "hybrid"])
def test_the_strategies_that_take_a_mesh_keep_it_sharded(strategy):
    """all_to_all moves heads, all_gather gathers k and v (in its shard_map program as much), the hybrid
    shards the sequence over two axes (the layout's permutation moves by collective permutes)."""
    case = Case("zigzag", strategy, "4x2" if strategy == "hybrid" else "8", True, TOKENS, heads=8)
    check(global_memory.compile_case(case, jax.devices()))


@pytest.mark.parametrize("devices, rows", [(4, 1), (3, 2)], ids=["one-order-for-all-rows", "an-order-a-row"])
def test_the_ragged_exchange_puts_every_token_in_its_slot(devices, rows):
    """The ragged all-to-all's plan (`moves.ragged_exchange`, off the CPU), carried out in NumPy as the
    collective does it: every device's tokens land in the slots of the permutation, for one order shared
    by the rows and for an order a row; where a device sends nothing to another, and where it keeps some
    of its own. XLA:CPU has no ragged all-to-all to run it."""
    from tuner.semantics import moves
    from tuner.support.permutations import inverse

    batch, length = 2, 6
    rng = np.random.default_rng(devices)
    home = np.concatenate([np.arange(length), length + rng.permutation((devices - 1) * length)])
    dest = np.stack([rng.permutation(devices * length), home][:rows]).astype(np.int32)  # home: 0 sends nothing
    source = np.asarray(inverse(dest))
    tokens = np.arange(batch * devices * length).reshape(batch, devices * length)  # each token its own name
    plan = jax.jit(moves.ragged_exchange, static_argnums=(2, 3, 4, 5))
    plans = [jax.tree.map(np.asarray, plan(dest, source, me, batch, length, devices)) for me in range(devices)]
    buffers = [np.full(batch * length, -1) for _ in range(devices)]
    for me, sent in enumerate(plans):
        shard = tokens[:, me * length:(me + 1) * length].ravel()[sent.send]
        for there in range(devices):
            start, size = sent.send_starts[there], sent.send_sizes[there]
            assert plans[there].arrival_sizes[me] == size
            buffers[there][sent.starts_there[there]:sent.starts_there[there] + size] = shard[start:start + size]
    want = np.empty_like(tokens)
    want[np.arange(batch)[:, None], np.broadcast_to(dest, tokens.shape)] = tokens
    for me, received in enumerate(plans):
        np.testing.assert_array_equal(buffers[me][received.arrival].reshape(batch, length),
                                      want[:, me * length:(me + 1) * length])


def test_a_permutation_lowers_for_cuda_to_one_ragged_all_to_all_each_way():
    """Off the CPU a permutation (the documents layout's) moves in one ragged all-to-all: lowered for CUDA
    here (XLA:CPU cannot compile one), forward and back, and its gradient the opposite moves."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from tuner.semantics import moves

    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    order = jnp.asarray(np.random.default_rng(0).permutation(64)[None], jnp.int32)

    def round_trip(x):
        move = moves.permutation(order, "sp", platform="gpu", other_axes=False)
        assert move.method == moves.ONE_COLLECTIVE
        return move.restore(move.lay_out(x) * 2.0)

    call = jax.shard_map(round_trip, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    x = jax.ShapeDtypeStruct((2, 64, 2, 8), jnp.bfloat16)
    forward = jax.jit(call).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert forward.count("@ragged_all_to_all(") == 2
    gradient = jax.jit(jax.grad(lambda x: (call(x).astype(jnp.float32) ** 2).sum())).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert gradient.count("@ragged_all_to_all(") == 4  # the forward's two, and their opposites
    assert "all_gather" not in forward and "stablehlo.all_to_all" not in forward
