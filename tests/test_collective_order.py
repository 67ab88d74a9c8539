"""On the CPU the ring never has two sends in flight at once: jax 0.10.2 gives every collective the same
channel id, and XLA:CPU then joins two collective-permutes in flight together into one rendezvous and
aborts, hangs or corrupts its heap (benchmarks/cpu_ring/README.md). Checked on the compiled programs with
`hlo.unordered_collectives`, itself checked on programs that do have such pairs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import get_tuned_ring_attention, ring_attention
from tuner.models import hlo

RING = 4
SEQ = P(None, "sp")


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def shard(body, n_in: int, out_specs):
    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    return jax.shard_map(body, mesh=mesh, in_specs=(SEQ,) * n_in, out_specs=out_specs)


def qkv(length: int = 256):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((1, length, 2, 16)), jnp.float32) for _ in range(3)]


def test_the_check_finds_sends_that_nothing_orders():
    """Two independent sends, and a loop of sends beside another send: each pair is reported."""
    perm = [(i, (i + 1) % RING) for i in range(RING)]

    def shift(x):
        return jax.lax.ppermute(x, "sp", perm)

    def program(a, b):
        looped = jax.lax.fori_loop(0, 3, lambda i, x: shift(jnp.sin(x)), a)
        return looped, shift(b), shift(b * 2)

    x = jnp.ones((1, 64))
    pairs = hlo.unordered_collectives(compiled_text(shard(program, 2, (SEQ,) * 3), x, x))
    ops = [tuple(sorted(name.split(".")[0] for name in pair)) for pair in pairs]
    assert sorted(ops) == [("ppermute", "ppermute"), ("ppermute", "while"), ("ppermute", "while")], pairs

    def chained(a):
        return shift(shift(a) + 1)

    assert hlo.unordered_collectives(compiled_text(shard(chained, 1, SEQ), x)) == []


def test_the_rings_gradient_program_runs_one_send_at_a_time():
    """Forward and backward of a causal ring with packed documents (keys, values, positions and segment
    ids travel), two layers deep: every send is ordered after the one before it, across the forward and
    backward loops and across the layers."""
    q, k, v = qkv()
    docs = jnp.repeat(jnp.array([[0, 1, 1, 2]]), 64, axis=1)

    def attend(q, k, v, docs):
        return ring_attention(q, k, v, causal=True, axis_name="sp", backend="scan", q_segment_ids=docs,
                              kv_segment_ids=docs)

    def two_layers(q, k, v, docs):
        first = attend(q, k, v, docs)
        return attend(first, first, v, docs)

    ring = shard(two_layers, 4, SEQ)
    step = jax.grad(lambda q, k, v, docs: ring(q, k, v, docs).sum(), argnums=(0, 1, 2))
    text = compiled_text(step, q, k, v, docs)
    assert text.count("collective-permute(") >= 8, "the program should hold the ring's sends"
    assert hlo.unordered_collectives(text) == []


KINDS = ("collective-permute", "all-to-all", "all-gather", "reduce-scatter", "all-reduce")


@pytest.mark.parametrize("strategy, mesh_shape", [("all_to_all", (RING,)), ("all_gather", (RING,)),
                                                  ("dense", (RING,)), ("hybrid", (2, 2))])
def test_every_strategys_gradient_program_runs_one_collective_of_a_kind_at_a_time(strategy, mesh_shape, tmp_path):
    """The exchanges of q, k and v, of the positions and segment ids, and of the output and lse (and,
    in the backward, their transposes) are ordered one after the other, kind by kind."""
    axes = ("sp",) if len(mesh_shape) == 1 else ("sp", "a2a")
    mesh = Mesh(np.array(jax.devices()[:math.prod(mesh_shape)]).reshape(mesh_shape), axes)
    seq = P(None, axes if len(axes) > 1 else axes[0])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 4, 16)), jnp.float32) for _ in range(3))
    docs = jnp.repeat(jnp.array([[0, 1, 1, 2]]), 64, axis=1)
    axis_name = axes if len(axes) > 1 else axes[0]
    if strategy == "dense":  # a gathered mechanism, reached through the loader
        attend_ = get_tuned_ring_attention(axis_name=axis_name, causal=True, layout="zigzag", backend="dense",
                                           db=str(tmp_path / "tuning.sqlite"))
    else:
        attend_ = functools.partial(ring_attention, causal=True, axis_name=axis_name, layout="zigzag",
                                    strategy=strategy)

    def attend(q, k, v, docs):
        return attend_(q, k, v, q_segment_ids=docs, kv_segment_ids=docs)

    ring = jax.shard_map(attend, mesh=mesh, in_specs=(seq,) * 4, out_specs=seq)
    step = jax.grad(lambda q, k, v, docs: ring(q, k, v, docs).sum(), argnums=(0, 1, 2))
    text = compiled_text(step, q, k, v, docs)
    assert {kind: hlo.unordered_collectives(text, kind) for kind in KINDS} == dict.fromkeys(KINDS, [])
