"""`tuner.flax.RingSelfAttention`: on a ring of simulated devices (zigzag, inside `shard_map`) and on
one device it equals the same layer with dense attention and the same weights, forward and the
gradients of every weight; bad arguments name themselves; the example language model learns its
long-range task in a short CI run."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import rel_err
from tuner.semantics import layouts
from tuner.semantics.packing import Packing

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None,
                                reason="needs flax (pip install -e '.[flax]')")

RING = 4
PACKING = "64,32x2,16x8"  # two rows of 256 tokens, documents of 64 tokens down to 16: tiles of 16 waste least


def layers(**options):
    from flax import nnx

    from tuner.flax import RingSelfAttention

    ring = RingSelfAttention(64, 4, num_kv_heads=2, rngs=nnx.Rngs(0), **options)
    dense_options = {k: v for k, v in options.items() if k not in ("axis_name", "layout", "mesh", "packing")}
    dense = RingSelfAttention(64, 4, num_kv_heads=2, attention="dense", rngs=nnx.Rngs(0), **dense_options)
    if options.get("sinks"):  # drawn, not the zeros they start from, so that each sink weighs differently
        drawn = jnp.asarray(np.random.default_rng(2).standard_normal((4, options["sinks"])), jnp.float32)
        ring.sinks[...] = dense.sinks[...] = drawn
    return ring, dense


def packed_ids():
    """The segment ids `[2, 256]` of rows packed as PACKING."""
    return jnp.asarray(Packing.parse(PACKING).segment_ids(256, 2))


def compare(got_out, want_out, got_grads, want_grads):
    assert rel_err(np.asarray(got_out), np.asarray(want_out)) <= 1e-5
    flat_got, flat_want = jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)
    assert len(flat_got) == len(flat_want) >= 4  # query, key, value, out kernels (and the sinks)
    for g, w in zip(flat_got, flat_want):
        assert np.linalg.norm(np.asarray(w)) > 0
        assert rel_err(np.asarray(g), np.asarray(w)) <= 1e-4


def check_sharded(mesh: Mesh, axis_name, ring: int, options: dict) -> None:
    """The layer under `shard_map` over `axis_name` of `mesh`, on the sequence laid out in zigzag over `ring`
    positions, against the dense layer with the same weights: forward and every weight's gradient."""
    from flax import nnx

    ring_layer, dense = layers(axis_name=axis_name, layout="zigzag", **options)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 128, 64)), jnp.float32)
    graphdef, state = nnx.split(ring_layer)
    seq = P(None, axis_name)
    apply = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh, in_specs=(P(), seq), out_specs=seq)

    def ring_loss(state):
        out = layouts.restore(apply(state, layouts.lay_out(x, "zigzag", ring)), "zigzag", ring)
        return (jnp.sin(out) * out).sum(), out

    (_, got), got_grads = jax.jit(jax.value_and_grad(ring_loss, has_aux=True))(state)

    def dense_loss(model):
        out = model(x)
        return (jnp.sin(out) * out).sum(), out

    (_, want), want_grads = nnx.jit(nnx.value_and_grad(dense_loss, has_aux=True))(dense)
    compare(got, want, got_grads, nnx.state(want_grads, nnx.Param))


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, sliding_window=24, logits_soft_cap=20.0),
                                     dict(causal=False, chunk_size=16), dict(causal=True, sinks=2, softmax_scale=0.2,
                                                                              value_head_dim=24)],
                         ids=["causal", "window-softcap", "chunk", "sinks-scale-value-dim"])
def test_layer_on_a_zigzag_ring_equals_the_dense_layer(options):
    check_sharded(Mesh(np.array(jax.devices()[:RING]), ("sp",)), "sp", RING, options)


def test_hybrid_layer_on_a_2x2_mesh_equals_the_dense_layer():
    """`axis_name=(ring_axis, a2a_axis)`: the loader runs the hybrid, and the rotary positions are the
    hybrid's (zigzag over the 2 ring positions, each chunk cut over the a2a axis)."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("ring", "a2a"))
    check_sharded(mesh, ("ring", "a2a"), 2, dict(causal=True, sliding_window=40))


def test_layer_on_one_device_with_packed_documents_equals_the_dense_layer():
    from flax import nnx

    ring, dense = layers(causal=True)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 96, 64)), jnp.float32)
    segments = jnp.asarray(np.repeat([[0, 1, 2]], 2, axis=0).repeat(32, axis=1), jnp.int32)
    positions = jnp.tile(jnp.arange(32, dtype=jnp.int32), 3)[None].repeat(2, axis=0)  # each document from 0

    def loss(model):
        out = model(x, positions=positions, segment_ids=segments)
        return (out**2).sum(), out

    (_, got), got_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ring)
    (_, want), want_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(dense)
    compare(got, want, nnx.state(got_grads, nnx.Param), nnx.state(want_grads, nnx.Param))


def test_layer_on_global_arrays_with_a_declared_packing_equals_the_dense_layer_and_compiles_one_ring():
    """`mesh=` in the documents layout, `packing=` declared and a learned sink a head: on global arrays under
    `jax.jit` the layer equals the dense one, forward and every weight's gradient (the sinks' too), and its
    program holds one ring's loops where the same layer without `packing=` holds one ring per default tile
    (64, 32 and 16 here), chosen by the rows in the step."""
    from flax import nnx

    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    options = dict(causal=True, sinks=1, mesh=mesh, axis_name="sp", layout="documents")
    ring, dense = layers(packing=PACKING, **options)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 256, 64)), jnp.float32)
    ids = packed_ids()

    def loss(model):
        out = model(x, segment_ids=ids)
        return (jnp.sin(out) * out).sum(), out

    (_, got), got_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(ring)
    (_, want), want_grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(dense)
    compare(got, want, nnx.state(got_grads, nnx.Param), nnx.state(want_grads, nnx.Param))

    def lowered(layer) -> tuple[int, int]:
        """The rings the layer's program holds (the plans its loader traced: one per tile the rows may
        choose in the step) and its loops (the rings', and the moves' that every program shares)."""
        graphdef, state = nnx.split(layer)
        text = jax.jit(lambda s: nnx.merge(graphdef, s)(x, segment_ids=ids)).lower(state).as_text()
        return len(layer.ring.traced), text.count("stablehlo.while")

    undeclared, _ = layers(**options)
    (rings, loops), (declared_rings, declared_loops) = lowered(undeclared), lowered(ring)
    assert (rings, declared_rings) == (3, 1) and loops > declared_loops > 0


def test_explain_says_what_the_layer_runs():
    """`RingSelfAttention.explain`: the loader's plan for the heads the layer's projections make. In the documents
    layout, given arrays, the tile the rows choose (16 for these rows, as the packing declared gives); given
    shapes, the plan before the choice. On local shards, the key holds the layer's heads, value dim and sinks."""
    from flax import nnx

    from tuner.flax import RingSelfAttention

    mesh = Mesh(np.array(jax.devices()[:RING]), ("sp",))
    ids = packed_ids()
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 256, 64)), jnp.float32)
    options = dict(num_kv_heads=2, axis_name="sp", mesh=mesh, layout="documents", rngs=nnx.Rngs(0))
    declared = RingSelfAttention(64, 4, packing=PACKING, **options).explain(x, segment_ids=ids)
    assert declared.key.packing is not None and declared.fwd_params.block_q == 16
    assert "without packing=" not in declared.reason
    undeclared = RingSelfAttention(64, 4, **options)
    rows = undeclared.explain(x, segment_ids=ids)
    assert rows.fwd_params.block_q == 16 and "packed rows without packing=: tiles of at most 16" in rows.reason
    shapes = undeclared.explain(jax.ShapeDtypeStruct(x.shape, x.dtype), segment_ids=ids)
    assert shapes.fwd_params.block_q == 64 and "as each step's rows choose" in shapes.reason

    local = RingSelfAttention(64, 4, num_kv_heads=2, value_head_dim=8, sinks=2, axis_name="sp", layout="zigzag",
                              rngs=nnx.Rngs(0))
    key = local.explain(jax.ShapeDtypeStruct((2, 64, 64), jnp.float32), ring_size=RING).key
    assert (key.heads, key.kv_heads, key.head_dim, key.value_head_dim, key.ring_size, key.features["sinks"]) == (
        4, 2, 16, 8, RING, 2), key
    with pytest.raises(ValueError, match="attention='dense' runs dense attention"):
        RingSelfAttention(64, 4, attention="dense", rngs=nnx.Rngs(0)).explain(x)


def test_bad_arguments_name_themselves():
    from flax import nnx

    from tuner.flax import RingSelfAttention

    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        RingSelfAttention(48, 6, num_kv_heads=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rotary embeddings need an even head_dim, got 5"):
        RingSelfAttention(10, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention must be one of ring, dense"):
        RingSelfAttention(16, 2, attention="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layout must be one of"):
        RingSelfAttention(16, 2, layout="spiral", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="value_head_dim must be a positive int, got 0"):
        RingSelfAttention(16, 2, value_head_dim=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sinks must be a non-negative int, got -1"):
        RingSelfAttention(16, 2, sinks=-1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="packing: "):
        RingSelfAttention(16, 2, packing="many", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_rope must be True or False, got 'no'"):
        RingSelfAttention(16, 2, use_rope="no", rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_example_language_model_learns_the_long_range_task():
    """A short run of `examples/long_context_lm.py` as a user runs it, in its own process: 4 simulated
    devices, 256 tokens, 64 per device in chunks of 32; the needle sits 185 to 255 positions before the
    questions, on another device half the time, and chance is ln(8) = 2.08. The loss is down by step 150
    of 200 (0.03 over the last 10 steps here). 8 devices and 300 steps took 42 s alone, this 19 s."""
    script = Path(__file__).resolve().parents[1] / "examples" / "long_context_lm.py"
    run = subprocess.run([sys.executable, str(script), "--seq-len", "256", "--devices", "4", "--steps", "200"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) \(mean of the last 10 steps\)", run.stdout).groups())
    assert first > 1.5 and last < 0.1, run.stdout


@pytest.mark.slow
def test_example_trains_on_packed_documents_laid_out_once_as_it_does_laid_out_per_call():
    """`examples/long_context_lm.py --packed`: the pipeline lays each batch of packed documents out once
    (`tuner.layouts.lay_out_batch`) and attention runs with `laid_out=True`; `--per-call` trains on the same
    batches in token order, the loader laying q, k and v out in every call. The loss is per token, so the two
    curves are the same up to float rounding (the sums run in another order). The packing is declared as
    `Packing.fit` reads the example's rows (`--packing`): one ring compiled, not three."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import long_context_lm

    small = dict(packed=True, seq_len=256, devices=4, batch=2, num_layers=1, steps=6, packing="lognormal:2,sigma=0.34")
    once = long_context_lm.train(long_context_lm.Config(**small), progress=False)
    per_call = long_context_lm.train(long_context_lm.Config(**small, per_call=True), progress=False)
    np.testing.assert_allclose(once, per_call, rtol=2e-4)
    assert once[0] > once[-1]
