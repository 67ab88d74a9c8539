"""The ring as the production TPU compiler builds it, on this CPU host: libtpu compiles a `shard_map` over
a TPU topology (`jax.experimental.topologies`) without a TPU. Checked here:

- the loader and `ring_attention` pick the TPU kernel for a TPU mesh (the mesh decides, not the host);
- in the scheduled program, every ring step's transfers overlap its kernel: in the loop body of the
  forward and of the backward, each collective-permute starts before the step's kernel (or the branch
  that skips it) and completes after it. The backward used to wait for its kernel before sending the
  dK/dV accumulators (`tuner.ring` now adds a step's block gradients after the accumulator arrives).

Skipped where libtpu is not installed (`pip install -e '.[tpu]'`)."""

import importlib.util
import os
import re

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed: pip install -e '.[tpu]' compiles for TPU topologies")

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: libtpu's worker list, without a warning

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner import get_tuned_ring_attention, ring_attention  # noqa: E402

RING, T, H, HKV, D = 4, 4 * 2048, 8, 2, 128


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    from jax.experimental import topologies

    return Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices), ("sp",))


def structs(mesh: Mesh):
    sharding = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, T, HKV, D), jnp.bfloat16, sharding=sharding)
    return q, kv, kv


def loop_bodies(hlo: str) -> list[list[str]]:
    """The ring-relevant instructions of each while loop body of a scheduled HLO module, in order:
    collective-permute starts and dones, conditionals, and Mosaic kernels."""
    computations = {}
    for block in re.split(r"\n(?=\S.*\{\n)", hlo):
        name = re.match(r"%?(\S+)", block.split("\n", 1)[0])
        ops = []
        for line in block.split("\n")[1:]:
            for op in ("collective-permute-start(", "collective-permute-done(", "conditional("):
                if op in line:
                    ops.append(op[:-1])
                    break
            else:
                if "tpu_custom_call" in line:
                    ops.append("kernel")
        computations[name.group(1) if name else ""] = ops
    bodies = re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", hlo)
    return [computations[body] for body in bodies if body in computations]


def assert_overlapped(body: list[str], permutes: int) -> None:
    compute = [i for i, op in enumerate(body) if op in ("conditional", "kernel")]
    starts = [i for i, op in enumerate(body) if op == "collective-permute-start"]
    dones = [i for i, op in enumerate(body) if op == "collective-permute-done"]
    assert compute and len(starts) == len(dones) == permutes, body
    assert max(starts) < min(compute) and min(dones) > max(compute), body


def test_a_tpu_mesh_gets_the_tpu_kernel(mesh, tmp_path):
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(tmp_path / "empty.sqlite"))
    decision = attn.explain(*structs(mesh))
    assert decision.backend == "pallas_tpu" and decision.key.device_kind == "TPU v5 lite", decision


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_ring_step_overlaps_its_transfers_forward_and_backward(mesh, causal):
    def local(q, k, v):
        return ring_attention(q, k, v, axis_name="sp", layout="zigzag", causal=causal)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    loss = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    hlo = jax.jit(loss).lower(*structs(mesh)).compile().as_text()
    assert "tpu_custom_call" in hlo  # the Pallas kernels, compiled by Mosaic
    forward, backward = loop_bodies(hlo)
    assert_overlapped(forward, permutes=3)  # k, v, their positions
    assert_overlapped(backward, permutes=5)  # k, v, positions, and the dK, dV accumulators
