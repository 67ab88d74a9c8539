"""The loader's call on global arrays (`mesh=`) as the TPU compiler builds it for v5e 2x2 (4 chips, one
sequence axis) at 1024 tokens, bf16, GQA 8/2, D=128, the Pallas kernels: the rules of
`tests/test_global_sharding.py`, for the layouts with collectives of their own on the TPU (zigzag's collective
permutes, the documents layout's ragged all-to-all), forward and forward+backward (the documents layout's
forward+backward only: its program holds the forward's moves). Contiguous moves nothing, and the striped
layout's all-to-all is the CPU test's. The rules hold at any length (the moves are the same collectives, the
memory bound scales with the shard); the kernels' compile grows with the tiles, so a short sequence.
`benchmarks/memory/global_memory.py --tpu v5e:2x2 --tokens 131072 524288` prints every layout's table at
the lengths `benchmarks/memory/README.md` reports. And a mesh with a data axis that neither the batch nor
the heads divide, lowered, and a batch laid out over a data axis."""

import importlib.util
import os
import re

import numpy as np
import pytest

import scripts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                 reason="libtpu is not installed: pip install -e '.[tpu]'")]

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: libtpu's worker list, without a warning
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

global_memory = scripts.load("benchmarks/memory/global_memory.py")
lay_out_memory = scripts.load("benchmarks/memory/lay_out_memory.py")


@pytest.mark.parametrize("layout, backward", [("zigzag", False), ("zigzag", True), ("documents", True)],
                         ids=["zigzag-fwd", "zigzag-fwd+bwd", "documents-fwd+bwd"])
def test_on_the_tpu_compiler(layout, backward):
    devices = global_memory.tpu_devices("v5e:2x2")
    case = global_memory.Case(layout, "ring", "4", backward, 1024, batch=1, heads=8, dim=128)
    result = global_memory.compile_case(case, devices)
    assert result.largest_gather_per_token <= 8.0, result
    assert result.out_spec == result.in_spec, result
    assert result.mesh_bytes - result.shard_map_bytes <= case.moved_bytes(), result  # its laid-out copies
    if layout == "documents":  # the TPU has a ragged all-to-all: each token moves once, in one collective
        assert result.collectives.get("ragged-all-to-all", 0) >= 8, result.collectives
    else:
        assert "all-to-all" not in result.collectives and "all-gather" not in result.collectives, result.collectives


def test_a_batch_and_heads_the_data_axis_does_not_divide_run_replicated_over_it():
    """On a (dp, sp) mesh, one row and three heads under `jax.jit` (auto axes: no sharding to read): the
    batch cannot be split over dp, nor the heads, so the ring runs replicated over dp, manual over both
    axes. It was left to XLA's partitioner over dp, which cannot partition a Mosaic kernel: jax refused
    to lower it. Lowered for the TPU (the refusal came from lowering), forward and backward."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tuner import get_tuned_ring_attention

    mesh = Mesh(np.array(global_memory.tpu_devices("v5e:2x2")).reshape(2, 2), ("dp", "sp"))
    sequence = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, 2048, 3, 128), jnp.bfloat16, sharding=sequence)
    attn = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True)
    step = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    text = step.trace(q, q, q).lower().as_text()
    assert "tpu_custom_call" in text and text.count("collective_permute") >= 4
    plan = attn.explain(jax.ShapeDtypeStruct(q.shape, q.dtype), q, q)  # a trace's: no sharding to read
    assert "batch and heads replicated over 'dp': every device along it runs the same ring" in plan.reason
    two_rows = jax.ShapeDtypeStruct((2, 2048, 3, 128), jnp.bfloat16)
    assert "replicated" not in attn.explain(two_rows, two_rows, two_rows).reason  # the batch split over dp


def test_a_batch_laid_out_over_a_data_axis_holds_one_shard_in_flight():
    """`lay_out_batch` on the devices of a (dp, sp) mesh, dp left automatic: the documents permutation moves
    by collective permutes (no ragged all-to-all there), each shard passed around the ring in a loop. The
    TPU compiler's program (v5e 4x4, 2x8, 2 x 8192 tokens of width 1024, bfloat16): the P - 1 shards it
    sends, and at most a shard held beyond what it takes and gives (P - 1 rounds written out held 13 at 131072
    tokens, `benchmarks/memory/README.md`)."""
    memory, collectives = lay_out_memory.compile_lay_out(global_memory.tpu_devices("v5e:4x4"), (2, 8), 2, 8192,
                                                         1024, "documents")
    shard = 8192 // 8 * 1024 * 2  # one row of one device's tokens, bfloat16 (each of dp's 2 devices holds one row)
    assert collectives["collective-permute"] >= 7 * shard, collectives
    assert memory.temp_size_in_bytes <= shard, memory


def test_under_an_explicit_mesh_of_a_tpu_topology_the_trace_decides_without_running_anything():
    """Under `jax.set_mesh` of a TPU topology's devices (explicit axes), a causal, windowed zigzag ring without
    segment ids: the trace decides from the positions it knows which steps run (`tuner/semantics/known.py`).
    Its rules ran as jax programs, which jax placed on the mesh's devices, and a topology's devices cannot run
    one (`'Executable' object has no attribute 'local_devices'`); so did a declared packing's tile, computed
    on the host as the call is traced (now in NumPy, as the rules are). Lowered, the ring's forward and gradient and
    a packed documents-layout forward: nothing gathered but int32 ids and bounds (`masks.ring_mask`), and the
    outputs and gradients sharded as the inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tuner import get_tuned_ring_attention

    mesh = Mesh(np.array(global_memory.tpu_devices("v5e:2x2")), ("sp",), axis_types=(AxisType.Explicit,))
    sequence = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=sequence)
    kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16, sharding=sequence)
    ids = jax.ShapeDtypeStruct((1, 2048), jnp.int32, sharding=sequence)
    with jax.set_mesh(mesh):
        attn = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, sliding_window=(512, 0),
                                        backend="pallas_tpu")
        forward = jax.jit(attn).trace(q, kv, kv).lower()
        gradient = jax.jit(jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
                           ).trace(q, kv, kv).lower()
        packed = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, layout="documents",
                                          packing="lognormal:4,sigma=0.9", backend="pallas_tpu")
        documents = jax.jit(lambda q, k, v, ids: packed(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
                            ).trace(q, kv, kv, ids).lower()
    for lowered in (forward, gradient, documents):
        text = lowered.as_text()
        gathered = re.findall(r'"stablehlo.all_gather".*-> tensor<([^>]*)>', text)
        assert "tpu_custom_call" in text and all(shape.endswith("xi32") for shape in gathered), gathered
        outputs = jax.tree.leaves(lowered.out_info)
        assert outputs and all(tuple(x.sharding.spec)[:2] == (None, "sp") for x in outputs), outputs
