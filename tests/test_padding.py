"""Any global length with `mesh=`, queries and keys of lengths of their own too: the loader pads to a length
the layout splits, lays each side out for its length, runs and strips the padding
(`tuner.semantics.padding`); output, lse and gradients match the float64 dense reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh

from tuner import get_tuned_ring_attention, layouts, registry
from tuner.models import hlo
from tuner.semantics.problem import Problem
from tuner.semantics.reference import dense_attention

T = 30  # divides no ring of 4 devices
SEG = np.repeat([[1, 2, 3]], [12, 10, 8], axis=1)
POS = np.arange(T)[None] * 3


@pytest.mark.parametrize("causal, layout, given", [
    (True, "zigzag", ()),  # the pad keys sit after the last position: causal queries cannot read them
    (False, "zigzag", ()),  # segment ids mark them
    (True, "contiguous", ("positions",)),  # given positions: segment ids mark them
    (False, "documents", ("segments",)),
])
def test_a_length_the_ring_does_not_divide_matches_dense(causal, layout, given):
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, T, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32) for _ in range(2))
    options = {}
    if "segments" in given:
        options.update(q_segment_ids=jnp.asarray(SEG, jnp.int32), kv_segment_ids=jnp.asarray(SEG, jnp.int32))
    if "positions" in given:
        options.update(q_positions=jnp.asarray(POS, jnp.int32), kv_positions=jnp.asarray(POS, jnp.int32))
    attn = get_tuned_ring_attention(axis_name="sp", causal=causal, mesh=mesh, layout=layout)

    def loss(q, k, v, options):  # the ids and positions arguments, not constants for XLA to fold
        out, lse = attn(q, k, v, return_lse=True, **options)
        return jnp.sum(out ** 2) + jnp.sum(lse), (out, lse)

    def dense_loss(q, k, v, options):
        out, lse = dense_attention(q, k, v, causal=causal, **options)
        return jnp.sum(out ** 2) + jnp.sum(lse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, options)
    with jax.enable_x64(True):
        f64 = [np.asarray(x, np.float64) for x in (q, k, v)]  # on the host: no cast program a shape
        (_, (ref_out, ref_lse)), ref_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2),
                                                                        has_aux=True))(*f64, options)
    assert out.shape == q.shape and lse.shape == (1, 4, T)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=1e-4)
    reason = attn.explain(q, k, v, **options).reason
    assert f"padded to 32 query and 32 key tokens (from {T} and {T}" in reason, reason  # 4 devices (x2) divide 32


@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from(["contiguous", "zigzag", "striped"]),
       st.sampled_from([("sp",), ("sp", "a2a")]), st.booleans(), st.sampled_from([None, (5, 0), (3, 9)]),
       st.booleans(), st.sampled_from([None, "full", "keys"]))
def test_any_lengths_in_any_fixed_layout_match_float64(tq, tk, layout, axes, causal, window, packed, bias):
    """Global arrays of any query and key lengths (cross-attention too), over one axis of 4 devices or two of
    2x2 (the hybrid, which takes no bias): output and gradients against the float64 dense reference. The
    keys' side moved by the queries' permutation in the striped layout and over two axes: wrong outputs
    without an error, or a failed reshape."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape((4,) if len(axes) == 1 else (2, 2)), axes)
    rng = np.random.default_rng(tq * 71 + tk)
    q = jnp.asarray(rng.standard_normal((1, tq, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, tk, 2, 8)), jnp.float32) for _ in range(2))
    ids, floats = {}, {}
    if packed:
        ids = dict(q_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (1, tq))), jnp.int32),
                   kv_segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (1, tk))), jnp.int32))
    if bias and len(axes) == 1:
        shape = (1, 4, tq, tk) if bias == "full" else (1, 1, 1, tk)  # every query's, as a key-padding bias
        floats["bias"] = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    mask = dict(causal=causal, sliding_window=window)
    attn = get_tuned_ring_attention(axis_name=axes if len(axes) == 2 else axes[0], mesh=mesh, layout=layout,
                                    strategy="hybrid" if len(axes) == 2 else "ring", **mask)

    def loss(attend, q, k, v, floats, ids):  # the ids an argument, not constants for XLA to fold
        out = attend(q, k, v, **floats, **ids)
        return jnp.sum(out ** 2), out

    def dense(q, k, v, **options):
        return dense_attention(q, k, v, **mask, **options)[0]

    argnums = (0, 1, 2, 3)
    ring_step = jax.value_and_grad(functools.partial(loss, attn), argnums, has_aux=True)
    (_, out), grads = jax.jit(ring_step)(q, k, v, floats, ids)
    with jax.enable_x64(True):
        f64 = jax.tree.map(lambda x: np.asarray(x, np.float64), (q, k, v, floats))  # on the host
        (_, want), want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, dense), argnums, has_aux=True))(
            *f64, ids)
    np.testing.assert_allclose(out, want, atol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-4)


def test_a_bias_and_sinks_the_devices_share_get_their_summed_gradients():
    """A key-padding bias `[B, 1, 1, T]` (every query's, so every device holds it whole) and sinks: their
    gradients are the sums of every device's part (a custom VJP that ordered the bias returned it unsummed,
    which jax refused), they match float64, and on the CPU the backward's all-reduces run one at a time."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, T, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, T, 2, 8)), jnp.float32) for _ in range(2))
    bias, sinks = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((2, 1, 1, T), (4,)))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)

    def loss(attend, q, k, v, bias, sinks):
        return jnp.sum(attend(q, k, v, bias=bias, softmax_aux=sinks) ** 2)

    def dense(q, k, v, bias, softmax_aux):
        return dense_attention(q, k, v, causal=True, bias=bias, softmax_aux=softmax_aux)[0]

    arguments = (q, k, v, bias, sinks)
    step = jax.jit(jax.grad(functools.partial(loss, attn), argnums=(0, 1, 2, 3, 4))).lower(*arguments).compile()
    grads = step(*arguments)  # the program whose text is read below: compiled once
    with jax.enable_x64(True):
        want = jax.jit(jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2, 3, 4)))(
            *(np.asarray(x, np.float64) for x in arguments))
    for name, got, ref in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, want):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, atol=1e-4, err_msg=name)
    text = step.as_text()
    assert {kind: hlo.unordered_collectives(text, kind) for kind in ("all-reduce", "collective-permute")} == {
        "all-reduce": [], "collective-permute": []}


@pytest.mark.parametrize("causal, layout, given", [(False, "zigzag", ()), (True, "contiguous", ("positions",))])
def test_a_length_the_ring_divides_is_not_padded_and_keeps_the_problem_search_tunes(causal, layout, given):
    """Where nothing is padded, no segment ids are made for the pad tokens: a call without segment ids is the
    problem `tuner search` tunes (its key, and so its cache entry), not a packed one."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    x, kv = jnp.zeros((1, 32, 4, 8)), jnp.zeros((1, 32, 2, 8))
    positions = jnp.asarray(np.arange(32)[None] * 3, jnp.int32)
    options = dict(q_positions=positions, kv_positions=positions) if "positions" in given else {}
    plan = get_tuned_ring_attention(axis_name="sp", causal=causal, mesh=mesh, layout=layout).explain(x, kv, kv,
                                                                                                     **options)
    problem = Problem(batch=1, seq_len=32, heads=4, kv_heads=2, head_dim=8, causal=causal, ring_size=4, layout=layout)
    assert not plan.key.features["segments"] and "padded" not in plan.reason, plan.reason
    assert plan.key.digest == registry.problem_key(problem, plan.backend, plan.key.device_kind).digest
    if not given:
        return
    documents = get_tuned_ring_attention(axis_name="sp", causal=causal, mesh=mesh, layout="documents")
    with pytest.raises(ValueError, match="layout='documents' lays out each row from its documents"):
        documents(x, kv, kv, **options)  # given positions do not stand in for the segment ids it plans from


def test_explain_names_the_keys_move_where_their_length_gives_another():
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="striped")
    q, kv = jnp.zeros((1, 32, 2, 8)), jnp.zeros((1, 52, 2, 8))  # shards of 8 and 13 tokens
    reason = attn.explain(q, kv, kv).reason
    assert reason.endswith("laid out in the step (striped): queries: one all-to-all each way; keys and values: P-1 "
                           "collective permutes of one shard each way, passed around the ring (no ragged all-to-all "
                           "here)"), reason
    assert attn.explain(q, q, q).reason.endswith("laid out in the step (striped): one all-to-all each way")


def test_padded_lengths_and_the_local_shards_message():
    assert layouts.padded_length(100, 8, "zigzag") == 112
    assert layouts.padded_length(100, 8, "striped") == 104
    assert layouts.padded_length(96, 8, "contiguous") == 96
    with pytest.raises(ValueError, match=r"tuner.layouts.padded_length"):
        layouts.check_layout("zigzag", 7)


def test_per_call_arrays_of_another_length_name_the_argument():
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    x = jnp.zeros((1, T, 2, 8))
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh)
    with pytest.raises(ValueError, match=r"q_segment_ids must be \[batch, query length 30\]"):
        attn(x, x, x, q_segment_ids=jnp.zeros((1, 32), jnp.int32), kv_segment_ids=jnp.zeros((1, T), jnp.int32))
    for shape in ((1, 2, T, T - 1), (1, 2, T + 1, T), (1, 3, T, T)):  # the padding would have hidden the first two
        with pytest.raises(ValueError, match=r"bias must have shape \[batch, heads, query length, key length\] = "
                                             r"\(1, 2, 30, 30\)"):
            attn(x, x, x, bias=jnp.zeros(shape))
    empty = jnp.zeros((0, T, 2, 8))  # checked before the padding and the layout's moves, which fail less clearly
    for call in (attn, jax.jit(attn), attn.explain):
        with pytest.raises(ValueError, match=r"query \(0, 30, 2, 8\), key .* must have no empty dimension"):
            call(empty, empty, empty)
    with pytest.raises(ValueError, match=r"query must have rank 4"):
        attn(x[0], x, x)
