"""The mask information of every ring step, resolved once (`masks.ring_mask`), says of each step what
`masks.tile_pairs` says of the shard that visits at that step, as one tile: the same rule, from the
all-gathered bounds instead of the travelling shard."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner.semantics import masks
from tuner.semantics.spec import AttentionSpec

RING, BATCH, LOCAL = 4, 2, 8
SPECS = [AttentionSpec(scale=1.0, causal=True), AttentionSpec(scale=1.0, window=(3, 0)),
         AttentionSpec(scale=1.0, chunk_size=5), AttentionSpec(scale=1.0, causal=True, has_segments=True),
         AttentionSpec(scale=1.0, window=(2, 4), has_segments=True), AttentionSpec(scale=1.0)]


def steps_both_ways(spec: AttentionSpec, q_pos, kv_pos, q_seg, kv_seg):
    """Per device and step: (`ring_mask`'s visit, `tile_pairs` on the shard of that step, one tile each)."""
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))

    def local(q_pos, kv_pos, q_seg, kv_seg):
        rank = lax.axis_index("sp")
        resolved = masks.ring_mask(q_pos, kv_pos, q_seg, kv_seg, spec, "sp", RING, rank).visits
        every_kv = lax.all_gather(kv_pos, "sp")
        every_seg = lax.all_gather(kv_seg, "sp")
        direct = jnp.stack([masks.tile_pairs(q_pos, every_kv[(rank - s) % RING], q_seg, every_seg[(rank - s) % RING],
                                             spec, LOCAL, LOCAL)[0].any() for s in range(RING)])
        return resolved[None], direct[None]

    seq = P(None, "sp")
    fn = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq), out_specs=(P("sp"), P("sp")))
    return jax.jit(fn)(q_pos, kv_pos, q_seg, kv_seg)


@settings(max_examples=12)
@given(spec=st.sampled_from(SPECS), seed=st.integers(0, 2**16), spread=st.sampled_from([4, 40, 2**20]))
def test_every_step_is_decided_as_the_visiting_shard_would_be(spec, seed, spread):
    rng = np.random.default_rng(seed)
    shape = (BATCH, RING * LOCAL)
    q_pos, kv_pos = (jnp.asarray(rng.integers(-spread, spread, shape), jnp.int32) for _ in range(2))
    q_seg, kv_seg = (jnp.asarray(np.sort(rng.integers(0, 3, shape), axis=1), jnp.int32) for _ in range(2))
    resolved, direct = steps_both_ways(spec, q_pos, kv_pos, q_seg, kv_seg)
    assert resolved.shape == (RING, RING)
    np.testing.assert_array_equal(np.asarray(resolved), np.asarray(direct))


def test_a_spec_without_a_mask_visits_every_step():
    positions = jnp.zeros((BATCH, RING * LOCAL), jnp.int32)
    resolved, _ = steps_both_ways(AttentionSpec(scale=1.0), positions, positions, positions, positions)
    assert np.asarray(resolved).all()


def test_causal_contiguous_skips_the_shards_after_this_one():
    positions = jnp.broadcast_to(jnp.arange(RING * LOCAL, dtype=jnp.int32), (BATCH, RING * LOCAL))
    resolved, _ = steps_both_ways(AttentionSpec(scale=1.0, causal=True), positions, positions, positions, positions)
    # device r visits the shard of position (r - s) mod P at step s: only sources <= r are attended to
    want = np.array([[(r - s) % RING <= r for s in range(RING)] for r in range(RING)])
    np.testing.assert_array_equal(np.asarray(resolved), want)


@settings(max_examples=12)
@given(spec=st.sampled_from(SPECS + [AttentionSpec(scale=1.0, causal=True, window=(2**31 - 1, 0))]),
       seed=st.integers(0, 2**16), spread=st.sampled_from([4, 40, 2**31]))
def test_the_range_rules_answer_alike_in_numpy_and_in_jax(spec, seed, spread):
    """The trace runs the range rules in NumPy on the positions it knows (`tuner.semantics.known`), the device
    in jax: on the same int32 bounds, out to the ends of the range, they answer alike; and so does the cudnn
    kernel's kind of a chunk pair, which is built on them."""
    from tuner.kernels import cudnn_pairs

    rng = np.random.default_rng(seed)
    q_pos, kv_pos = (np.sort(rng.integers(-spread, spread, (BATCH, LOCAL)), axis=1).astype(np.int32) for _ in range(2))
    bounds = (q_pos.min(1), q_pos.max(1), kv_pos.min(1), kv_pos.max(1))
    segments = tuple(np.asarray(rng.integers(0, 3, BATCH), np.int32) for _ in range(4)) if spec.has_segments else None

    def rules(bounds, segments, q_pos, kv_pos):
        kinds = () if spec.has_segments else (cudnn_pairs.row_kinds(spec, q_pos, kv_pos),)  # cuDNN takes no segments
        return (masks.ranges_may_attend(*bounds, segments, spec), masks.ranges_fully_allowed(*bounds, segments, spec),
                *kinds)

    in_numpy = rules(bounds, segments, q_pos, kv_pos)
    in_jax = jax.jit(rules)(bounds, segments, q_pos, kv_pos)
    assert all(isinstance(x, np.ndarray) for x in in_numpy)
    for got, want in zip(in_numpy, in_jax):
        np.testing.assert_array_equal(got, np.asarray(want))
