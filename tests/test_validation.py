"""Bad input raises ValueError / TypeError naming the argument; the public API keeps its promises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tuner import BwdParams, FwdParams, get_tuned_ring_attention, layouts, ring_attention

B, T, H, HKV, D = 2, 8, 4, 2, 8


def _arrays(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, HKV, D)), dtype)
    return q, k, k + 1


def _raises(exc, match, **kwargs):
    q, k, v = kwargs.pop("qkv", _arrays())
    with pytest.raises(exc, match=match):
        ring_attention(q, k, v, **kwargs)


def test_rank_and_shapes():
    q, k, v = _arrays()
    _raises(ValueError, "query must have rank 4", qkv=(q[0], k, v))
    _raises(ValueError, "key and value must have the same batch, length and heads", qkv=(q, k, v[:, :4]))
    _raises(ValueError, "key batch", qkv=(q, k[:1], v[:1]))
    _raises(ValueError, "key head_dim", qkv=(q, k[..., :4], v[..., :4]))
    _raises(ValueError, r"query heads \(4\) must be a multiple of key/value heads \(3\)",
            qkv=(q, jnp.zeros((B, T, 3, D)), jnp.zeros((B, T, 3, D))))


def test_dtypes():
    q, k, v = _arrays()
    _raises(TypeError, "query must be an array \\(jax or NumPy\\), got list", qkv=(np.asarray(q).tolist(), k, v))
    _raises(TypeError, "query must be float16, bfloat16 or float32", qkv=(q.astype(jnp.int32), k, v))
    _raises(TypeError, "share a dtype", qkv=(q, k.astype(jnp.bfloat16), v))
    seg = jnp.zeros((B, T), jnp.float32)
    _raises(TypeError, "q_segment_ids must have an integer dtype", q_segment_ids=seg, kv_segment_ids=seg)


def test_masks_and_scalars():
    _raises(ValueError, r"sliding_window must have sides that are ints from 0 to 2\*\*31 - 1", sliding_window=-1)
    _raises(ValueError, "sliding_window must be an int or a", sliding_window=(1, 2, 3))
    _raises(ValueError, "chunk_size must be a positive int", chunk_size=0)
    _raises(ValueError, "logits_soft_cap must be a positive float", logits_soft_cap=-1.0)
    _raises(ValueError, "softmax_scale must be a positive float", softmax_scale=0.0)
    _raises(ValueError, "causal must be True or False", causal="yes")
    _raises(ValueError, "return_lse must be True or False", return_lse="no")  # truthy: would have returned the lse
    _raises(ValueError, "interpret must be True or False", interpret=1)


def test_a_scale_may_be_a_concrete_jax_scalar_but_not_a_traced_one(tmp_path):
    q, k, v = _arrays()
    want = ring_attention(q, k, v, softmax_scale=0.25, logits_soft_cap=5.0)
    got = ring_attention(q, k, v, softmax_scale=1 / jnp.sqrt(16.0), logits_soft_cap=jnp.asarray(5))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    loader = get_tuned_ring_attention(softmax_scale=1 / jnp.sqrt(16.0), logits_soft_cap=jnp.asarray(5),
                                      db=str(tmp_path / "t.sqlite"))
    np.testing.assert_array_equal(np.asarray(jax.jit(loader)(q, k, v)), np.asarray(want))
    with pytest.raises(ValueError, match="softmax_scale must be known when the call is traced"):
        jax.jit(lambda q, scale: ring_attention(q, k, v, softmax_scale=scale))(q, 0.25)
    _raises(ValueError, "softmax_scale must be a positive float", softmax_scale=jnp.asarray(-1.0))
    _raises(ValueError, "logits_soft_cap must be a positive float", logits_soft_cap=jnp.ones(2))


def test_segments_positions_sinks_bias():
    seg = jnp.zeros((B, T), jnp.int32)
    _raises(ValueError, "must be given together", q_segment_ids=seg)
    _raises(ValueError, r"kv_segment_ids must have shape \[batch, length\]", q_segment_ids=seg,
            kv_segment_ids=seg[:, :5])
    _raises(ValueError, r"q_positions must have shape", q_positions=jnp.arange(T))
    _raises(ValueError, r"softmax_aux must have shape \[heads\]", softmax_aux=jnp.zeros((HKV,)))
    _raises(ValueError, r"softmax_aux must have shape", softmax_aux=jnp.zeros((H, 0)))
    _raises(ValueError, r"bias must have shape \[batch, heads, q_length, global kv_length\]",
            bias=jnp.zeros((B, H, T, T + 1)))
    _raises(ValueError, "bias must have shape", bias=jnp.zeros((H, T, T)))


def test_the_loader_names_a_lone_segment_ids_array_and_a_list_before_reading_shapes(tmp_path, monkeypatch):
    """On global arrays (`mesh=`) the padding read the segment ids' shapes before the pair was checked: a lone
    `q_segment_ids` or a list raised `AttributeError` from inside the library. Every path names them now."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    q, k, v = _arrays()
    seg = jnp.zeros((B, T), jnp.int32)
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    for attn in (get_tuned_ring_attention(axis_name="sp", mesh=mesh), get_tuned_ring_attention()):
        for call in (attn, attn.explain):
            with pytest.raises(ValueError, match="must be given together .*pass the same array as both"):
                call(q, k, v, q_segment_ids=seg)
            with pytest.raises(TypeError, match="kv_segment_ids must be an array \\(jax or NumPy\\), got list"):
                call(q, k, v, q_segment_ids=seg, kv_segment_ids=np.asarray(seg).tolist())
            with pytest.raises(TypeError, match="q_positions must be an array \\(jax or NumPy\\), got tuple"):
                call(q, k, v, q_positions=tuple(range(T)))
    _raises(TypeError, "bias must be an array", bias=[[0.0]])


def test_layout_backend_params():
    _raises(ValueError, "layout must be one of contiguous, zigzag, striped", layout="spiral")
    _raises(ValueError, "even", layout="zigzag", qkv=tuple(x[:, :7] for x in _arrays()))
    _raises(ValueError, "backend must be one of auto, scan", backend="cuda")
    _raises(ValueError, "fwd_params must be a FwdParams", fwd_params={"block_q": 8})
    _raises(ValueError, "fwd_params.num_warps is a GPU launch setting", fwd_params=FwdParams(8, 8, num_warps=4))
    with pytest.raises(ValueError, match="FwdParams.block_q must be a positive int"):
        FwdParams(block_q=0)
    with pytest.raises(ValueError, match="both be set"):
        BwdParams(block_q_dq=16)


def test_an_axis_name_no_shard_map_binds_is_named_with_the_fix(tmp_path, monkeypatch):
    """Outside any `shard_map`, inside one without that axis, or under a `jax.vmap` that names it: a
    `ValueError` naming `axis_name` and what to do, not jax's bare "unbound axis name" or an
    `AssertionError` from inside jax."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    q, k, v = _arrays()
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    seq = jax.sharding.PartitionSpec(None, ("a", "b"))

    def sharded(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq))

    fix = "call this inside a shard_map over a mesh with that axis, or call get_tuned_ring_attention"
    calls = {
        "'a'": lambda: ring_attention(q, k, v, axis_name="a"),
        "'zz'": lambda: sharded(lambda q, k, v: ring_attention(q, k, v, axis_name="zz"))(q, k, v),
        r"\('a', 'zz'\)": lambda: sharded(lambda q, k, v: ring_attention(q, k, v, axis_name=("a", "zz"),
                                                                          strategy="hybrid"))(q, k, v),
        r"\('zz', 'b'\)": lambda: sharded(get_tuned_ring_attention(axis_name=("zz", "b"), layout="contiguous"))(
            q, k, v),
        "'b'": lambda: get_tuned_ring_attention(axis_name="b", layout="contiguous")(q, k, v),
        r"\('a', 'b'\)": lambda: layouts.grouped_positions("contiguous", T, ("a", "b")),
        "'v'": lambda: jax.vmap(lambda q, k, v: ring_attention(q, k, v, axis_name="v"), axis_name="v")(
            *(x[None] for x in (q, k, v))),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"axis_name={name} names an axis that no enclosing jax.shard_map "
                                             f"binds .*: {fix}"):
            call()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_output_dtype_and_lse(dtype):
    q, k, v = _arrays(dtype)
    out, lse = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True, return_lse=True))(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (B, H, T)


def test_fully_masked_rows_are_exactly_zero_without_nan():
    q, k, v = _arrays()
    q_seg = jnp.asarray([[0] * 4 + [7] * 4] * B, jnp.int32)  # segment 7 has no key
    kv_seg = jnp.zeros((B, T), jnp.int32)

    def loss(q, k, v):
        out, lse = ring_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True)
        return out.sum(), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert np.all(np.asarray(out[:, 4:]) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, 4:])))
    assert np.all(np.isfinite(np.asarray(lse[:, :, :4])))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][:, 4:]) == 0.0)
