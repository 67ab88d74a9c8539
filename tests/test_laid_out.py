"""Laying a batch out once (`tuner.layouts.lay_out_batch`) and running attention on it with `laid_out=True`:
on the host and on the devices (sharded, under `jax.jit`) the same layout as the loader's per-call one,
undone by `restore_batch`; the loader then permutes nothing, and its output equals the per-call path's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tuner import get_tuned_ring_attention, layouts
from tuner.semantics.reference import dense_attention

RING, T = 8, 256


def packed_batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    segments = np.sort(rng.integers(0, 5, (2, T)), axis=1).astype(np.int32)
    return {"tokens": rng.integers(0, 100, (2, T)).astype(np.int32), "segment_ids": segments,
            "features": rng.standard_normal((2, T, 3)).astype(np.float32)}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped", "documents"])
def test_a_batch_laid_out_on_the_host_and_on_the_devices_alike(layout):
    batch = packed_batch()
    laid, positions = layouts.lay_out_batch(batch, RING, layout)
    assert isinstance(positions, np.ndarray) and sorted(positions[0]) == list(range(T))
    for name, x in batch.items():
        index = positions.reshape(positions.shape + (1,) * (x.ndim - 2))
        np.testing.assert_array_equal(laid[name], np.take_along_axis(x, np.broadcast_to(index, laid[name].shape), 1))
    back = layouts.restore_batch(laid, positions)
    assert all(np.array_equal(back[name], batch[name]) for name in batch)

    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    on_devices = {n: jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for n, x in batch.items()}
    laid_d, positions_d = jax.jit(lambda b: layouts.lay_out_batch(b, RING, layout, mesh=mesh, axis_name="sp"))(
        on_devices)
    np.testing.assert_array_equal(np.asarray(positions_d), np.broadcast_to(positions, positions_d.shape))
    assert all(np.array_equal(np.asarray(laid_d[n]), laid[n]) for n in batch)
    assert laid_d["features"].sharding.spec == P(None, "sp")
    back_d = jax.jit(lambda b, p: layouts.restore_batch(b, p, mesh=mesh, axis_name="sp"))(laid_d, positions_d)
    assert all(np.array_equal(np.asarray(back_d[n]), batch[n]) for n in batch)


def test_on_an_explicit_sharding_mesh_a_replicated_batch_is_laid_out_as_on_the_host():
    """Over explicit mesh axes `shard_map` refuses arrays not sharded as its specs say: the batch is resharded
    over the sequence first (`tuner.support.placement`), then laid out and restored as on the host."""
    batch = packed_batch()
    laid, positions = layouts.lay_out_batch(batch, RING, "zigzag")
    mesh = jax.make_mesh((RING,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:RING])
    with jax.set_mesh(mesh):
        replicated = {n: jax.device_put(x, NamedSharding(mesh, P())) for n, x in batch.items()}
        laid_d, positions_d = jax.jit(lambda b: layouts.lay_out_batch(b, RING, "zigzag", mesh=mesh, axis_name="sp"))(
            replicated)
        back = jax.jit(lambda b, p: layouts.restore_batch(b, p, mesh=mesh, axis_name="sp"))(laid_d, positions_d)
    np.testing.assert_array_equal(np.asarray(positions_d), positions)
    assert all(np.array_equal(np.asarray(laid_d[n]), laid[n]) for n in batch)
    assert all(np.array_equal(np.asarray(back[n]), batch[n]) for n in batch)


@pytest.mark.parametrize("layout", ["zigzag", "documents"])
def test_attention_on_a_laid_out_batch_equals_the_per_call_layout(layout):
    batch = packed_batch(1)
    rng = np.random.default_rng(1)  # on the host: jax.random would compile programs of its own
    q = jnp.asarray(rng.standard_normal((2, T, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, T, 2, 16)), jnp.float32) for _ in range(2))
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    segments = jnp.asarray(batch["segment_ids"])
    per_call = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout=layout)
    want = per_call(q, k, v, q_segment_ids=segments, kv_segment_ids=segments)
    laid, positions = layouts.lay_out_batch({"q": q, "k": k, "v": v, "segment_ids": segments}, RING, layout)
    once = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout=layout, laid_out=True)
    assert positions.shape == (2, T)  # every row's, as attention takes them, whatever the layout
    arrays = dict(q_segment_ids=laid["segment_ids"], kv_segment_ids=laid["segment_ids"], q_positions=positions,
                  kv_positions=positions)
    qkv = (laid["q"], laid["k"], laid["v"])
    compiled = jax.jit(lambda q, k, v, arrays: once(q, k, v, **arrays)).lower(*qkv, arrays).compile()  # run and read
    assert " all-to-all(" not in compiled.as_text() and "ragged" not in compiled.as_text()
    restored = layouts.restore_batch({"out": compiled(*qkv, arrays)}, positions)["out"]
    np.testing.assert_allclose(restored, want, rtol=0, atol=2e-5)
    dense, _ = jax.jit(functools.partial(dense_attention, causal=True))(q, k, v, q_segment_ids=segments,
                                                                        kv_segment_ids=segments)  # one compile
    np.testing.assert_allclose(restored, dense, rtol=0, atol=2e-5)
    assert "arrays laid out by the caller" in once.explain(*qkv, **arrays).reason


def test_a_nested_batch_is_laid_out_leaf_by_leaf_as_a_flat_one():
    """Pipelines hand out nested batches (inputs and targets, each a mapping): every leaf is laid out and
    restored as the same array in a flat batch, on the host and on the devices, and the structure is kept."""
    flat = packed_batch()
    nested = {"inputs": {"tokens": flat["tokens"], "features": (flat["features"],)},
              "segment_ids": flat["segment_ids"]}
    laid, positions = layouts.lay_out_batch(flat, RING, "documents")
    laid_n, positions_n = layouts.lay_out_batch(nested, RING, "documents")
    np.testing.assert_array_equal(positions_n, positions)
    assert jax.tree.structure(laid_n) == jax.tree.structure(nested)
    np.testing.assert_array_equal(laid_n["inputs"]["features"][0], laid["features"])
    np.testing.assert_array_equal(layouts.restore_batch(laid_n, positions_n)["inputs"]["tokens"], flat["tokens"])

    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    laid_d, positions_d = jax.jit(lambda b: layouts.lay_out_batch(b, RING, "documents", mesh=mesh, axis_name="sp"))(
        nested)
    np.testing.assert_array_equal(np.asarray(positions_d), positions)
    np.testing.assert_array_equal(np.asarray(laid_d["inputs"]["tokens"]), laid["tokens"])
    back = jax.jit(lambda b, p: layouts.restore_batch(b, p, mesh=mesh, axis_name="sp"))(laid_d, positions_d)
    np.testing.assert_array_equal(np.asarray(back["inputs"]["features"][0]), flat["features"])
    with pytest.raises(ValueError, match=r"batch\['segment_ids'\]\[0\]\[0\] is of type int, not an array"):
        layouts.lay_out_batch({**flat, "segment_ids": flat["segment_ids"].tolist()}, RING, "documents")


def test_laid_out_arguments_are_checked():
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    with pytest.raises(ValueError, match="laid_out=True says"):
        get_tuned_ring_attention(axis_name="sp", layout="zigzag", laid_out=True)
    with pytest.raises(ValueError, match="needs the layout"):
        get_tuned_ring_attention(axis_name="sp", mesh=mesh, laid_out=True)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents", laid_out=True)
    q = jnp.zeros((1, T, 2, 16))
    with pytest.raises(ValueError, match="q_positions"):
        attn(q, q, q, q_segment_ids=jnp.zeros((1, T), jnp.int32), kv_segment_ids=jnp.zeros((1, T), jnp.int32))
    with pytest.raises(ValueError, match="length it splits"):
        attn(q[:, :T - 4], q[:, :T - 4], q[:, :T - 4])
    with pytest.raises(ValueError, match="segment_ids"):
        layouts.lay_out_batch({"tokens": np.zeros((1, T), np.int32)}, RING, "documents")
    with pytest.raises(ValueError, match="multiple of 16"):
        layouts.lay_out_batch({"tokens": np.zeros((1, T - 8), np.int32)}, RING, "zigzag")
    batch = {"segment_ids": np.zeros((2, T))}  # float ids were laid out as ints
    with pytest.raises(TypeError, match="segment_ids must have an integer dtype, got float64"):
        layouts.lay_out_batch(batch, RING, "documents")
    with pytest.raises(ValueError, match=r"window must have sides that are ints from 0"):  # an OverflowError in jit
        layouts.lay_out_batch({"segment_ids": np.zeros((2, T), np.int32)}, RING, "documents", window=(-1, 0))
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] \(or \[1, T\]\) for the arrays of batch"):
        layouts.restore_batch(batch, np.zeros((2, T // 2), np.int32))  # half the positions were taken as all
