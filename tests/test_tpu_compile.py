"""The ring as the production TPU compiler builds it, on this CPU host: libtpu compiles a `shard_map` over
a TPU topology (`jax.experimental.topologies`) without a TPU. Checked here:

- the loader and `ring_attention` pick the TPU kernel for a TPU mesh (the mesh decides, not the host);
- in the scheduled program, every ring step's transfers overlap its kernels: in the loop body of the
  forward and of the backward, a kernel (or the branch that skips it) runs between each
  collective-permute's start and its completion, on v5e, v6e, v5p and v4. In the backward the dK/dV
  accumulators of the keys at hand arrive while the step's dQ kernel runs, and its dK/dV kernel then adds
  into them (`tuner.strategies.ring`). Without a mask the forward's kernel runs in a branch, under an
  always-true predicate the compiler cannot fold: a bare kernel was scheduled before its transfers on v6e;
- each kernel asks Mosaic for half the VMEM of the chip the mesh is made of (not a fallback chip's),
  and the compiler reports it uses no more.

Skipped where libtpu is not installed (`pip install -e '.[tpu]'`)."""

import dataclasses
import functools
import importlib.util
import json
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
from tuner.cache import Cache  # noqa: E402
from tuner.models import hlo  # noqa: E402

RING, H, HKV, D = 4, 8, 2, 128
# The compiled programs: one tile a ring step (the kernel chosen, the transfers' overlap and the VMEM asked
# do not depend on the tile count or its length), of 256 tokens: Mosaic's compile grows with the tile.
STEP_T = 4 * 256


@functools.cache
def topology_mesh(name: str) -> Mesh:
    from jax.experimental import topologies

    return Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name=name).devices), ("sp",))


def structs(mesh: Mesh):
    """q, k, v of `STEP_T` tokens, the sequence sharded over the mesh."""
    sharding = NamedSharding(mesh, P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, STEP_T, H, D), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, STEP_T, HKV, D), jnp.bfloat16, sharding=sharding)
    return q, kv, kv


def test_a_tpu_mesh_gets_the_tpu_kernel(tmp_path):
    """Nothing but the mesh says which chip: the loader with backend="auto" (on the ring: at this small size
    the strategy model picks all_gather, `tests/test_strategies.py`), under `jax.jit` over a v5e topology,
    decides for and compiles to the Pallas kernels on this CPU host."""
    mesh = topology_mesh("v5e:2x2")
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(tmp_path / "empty.sqlite"),
                                    strategy="ring")
    decision = attn.explain(*structs(mesh))
    assert decision.backend == "pallas_tpu" and decision.key.device_kind == "TPU v5 lite", decision
    text = jax.jit(attn).lower(*structs(mesh)).compile().as_text()
    assert {name.split(".")[0] for name in hlo.kernel_vmem(text)} == {"ring_attention_fwd"}


def other_generation(*values) -> pytest.param:
    """A case on a generation other than v5e: the fast tier compiles for v5e only, the full run for all."""
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize("topology, causal, window", [
    ("v5e:2x2", True, None), ("v5e:2x2", False, None), ("v5e:2x2", True, 256),
    other_generation("v6e:2x2", True, None), other_generation("v5p:2x2x1", True, None),
    other_generation("v4:2x2x1", True, None)],
    ids=["v5e-causal", "v5e-full", "v5e-window", "v6e-causal", "v5p-causal", "v4-causal"])  # no mask: v5e only
def test_every_ring_step_overlaps_its_transfers_forward_and_backward(topology, causal, window):
    """With a window every device can skip the same step, so the backward's dK/dV kernel runs in a branch
    too (`ring._idle_together`); with a causal mask alone, or none, it does not."""
    text = compiled_ring(topology, causal, window)
    forward, backward = hlo.loop_bodies(text)
    # forward: k, v and their positions travel; backward: those and the dK, dV accumulators
    for body, transfers in ((forward, 3), (backward, 5)):
        assert body.count("collective-permute-start") == body.count("collective-permute-done") == transfers, body
        assert hlo.overlap_problem(body) is None, (hlo.overlap_problem(body), body)
    branches = 2 if window is not None else 1  # the dK/dV kernel in a branch only where steps idle together
    assert backward.count("conditional") == branches and backward.count("kernel") == 2 - branches, backward


@pytest.mark.parametrize("topology, vmem_mib", [("v5e:2x2", 128), other_generation("v5p:2x2x1", 64),
                                                other_generation("v6e:2x2", 128)])
def test_kernels_ask_for_the_vmem_of_the_target_chip(topology, vmem_mib):
    kernels = hlo.kernel_vmem(compiled_ring(topology, True, None))  # the overlap test's ring, compiled once
    assert {name.split(".")[0] for name in kernels} == {"ring_attention_fwd", "ring_attention_dkv",
                                                        "ring_attention_dq"}, kernels
    for name, (asked, used) in kernels.items():
        assert asked == vmem_mib * 2**20 // 2, (name, asked)  # half the chip's VMEM, not a fallback chip's
        assert 0 < used <= asked, (name, used, asked)


def test_kernels_with_values_of_another_head_dim_use_no_more_vmem_than_estimated():
    """Multi-head latent attention's dims (queries and keys 192 wide, values 128), bf16, at the default
    tiles of v5e on an 8192-token shard (several tiles each way, so blocks are double-buffered): each
    kernel, compiled alone, uses no more VMEM than the constraints' estimate, which stays within what
    the kernels ask for."""
    from tuner.kernels import pallas_tiling, pallas_tpu
    from tuner.semantics.spec import AttentionSpec, LocalShapes
    from tuner.tuning import compiled

    shapes = LocalShapes(1, 8192, 8192, H, HKV, 192, "bfloat16", value_head_dim=128)
    spec = AttentionSpec(scale=192**-0.5, causal=True)
    backend = pallas_tpu.PallasTpuBackend()
    with jax.sharding.use_abstract_mesh(topology_mesh("v5e:2x2").abstract_mesh):
        fwd, bwd = backend.default_params(shapes.q_len, shapes.kv_len, 192, 128)
        assert backend.violation(shapes, spec, fwd, bwd) is None
    used = compiled.compile_step(shapes, spec, "v5e:2x2", fwd, bwd)
    assert isinstance(used, dict) and set(used) == {"fwd", "dkv", "dq"}, used  # else the compiler's error
    estimates = pallas_tiling.vmem_estimates(shapes, spec, fwd, bwd)
    for kernel, (asked, use) in used.items():
        assert 0 < use <= estimates[kernel] <= asked == 64 * 2**20, (kernel, use, estimates[kernel], asked)


@functools.cache
def compiled_ring(topology: str, causal: bool, window: int | None) -> str:
    """The scheduled HLO of the gradient of a ring over `topology` (pallas_tpu kernels, zigzag; with a
    `window`, a sliding window of that many keys before each query, contiguous)."""
    mesh = topology_mesh(topology)

    def local(q, k, v):
        if window is not None:
            return ring_attention(q, k, v, axis_name="sp", causal=causal, sliding_window=(window, 0))
        return ring_attention(q, k, v, axis_name="sp", layout="zigzag", causal=causal)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    loss = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    text = jax.jit(loss).lower(*structs(mesh)).compile().as_text()
    assert "tpu_custom_call" in text  # the Pallas kernels, compiled by Mosaic
    return text


@pytest.mark.slow
def test_the_tpu_dry_run_compiles_the_defaults_and_the_loader_uses_its_row(tmp_path, capsys):
    """`tuner search --device tpu --dry-run --target v5e:2x2 --samples 0`: the default tiles of each kernel
    compile in the whole ring, the compiler never reports more VMEM than the estimate the constraints rule
    by (so they never admit a variant over the limit), and the stored `compiled` row is what the loader runs
    on that topology, saying so. (`test_the_largest_tiles...` compiles the other end of the space.)"""
    from tuner.cli import main
    from tuner.tuning.compiled import PARTS

    db = tmp_path / "tuning.sqlite"
    assert main(["search", "--device", "tpu", "--dry-run", "--target", "v5e:2x2", "--samples", "0",
                 "--seq-len", str(STEP_T), "--heads", str(H), "--kv-heads", str(HKV), "--head-dim", str(D),
                 "--dtype", "bfloat16", "--causal", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "3 of 3 compiled" in out and "stored  compiled entry" in out, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in PARTS}
    assert sorted(rows) == sorted(PARTS), out
    for part, line in rows.items():
        used, estimate = map(float, re.search(r"(\d+\.\d+) / (\d+\.\d+)", line).groups())
        assert 0 < used <= estimate < 64 * 1024, (part, line)
    [row] = Cache(db).rows()
    assert row["source"] == "compiled" and row["default_s"] is None
    mesh = topology_mesh("v5e:2x2")
    q, kv, _ = structs(mesh)
    decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(db)).explain(q, kv, kv)
    assert (decision.backend, decision.source) == ("pallas_tpu", "compiled")
    assert json.loads(row["fwd_params"]) == dataclasses.asdict(decision.config.fwd)
    assert json.loads(row["bwd_params"]) == dataclasses.asdict(decision.config.bwd)
    assert "not measured" in decision.reason, decision.reason


def test_the_tpu_dry_run_compiles_the_hybrid_over_pallas_and_the_loader_uses_its_row(tmp_path, capsys):
    """`--a2a-size 2` compiles the Pallas kernel's tiles on what it runs inside the hybrid (H/2 heads of the
    ring position's chunk) over the topology as a 2x2 mesh, and the loader on that mesh, over the pair of
    axes, runs the stored row."""
    from tuner.cli import main
    from tuner.semantics.problem import Problem
    from tuner import registry

    db = tmp_path / "tuning.sqlite"
    assert main(["search", "--device", "tpu", "--dry-run", "--target", "v5e:2x2", "--a2a-size", "2", "--samples",
                 "0", "--seq-len", str(STEP_T), "--heads", str(H), "--kv-heads", str(HKV), "--head-dim", str(D),
                 "--dtype", "bfloat16", "--causal", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "(TPU v5 lite, hybrid_pallas_tpu on 4 chips)" in out and "3 of 3 compiled" in out, out
    [row] = Cache(db).rows()
    assert (row["backend"], row["source"]) == ("hybrid_pallas_tpu", "compiled")
    problem = Problem(seq_len=STEP_T, heads=H, kv_heads=HKV, head_dim=D, ring_size=4, a2a_size=2)
    shapes = registry.problem_tile_shapes(registry.get("hybrid_pallas_tpu"), problem)
    assert (shapes.q_len, shapes.heads, shapes.kv_heads) == (STEP_T // 2, H // 2, HKV // 2)
    devices = topology_mesh("v5e:2x2").devices.reshape(2, 2)
    mesh = Mesh(devices, ("ring", "a2a"))
    sharding = NamedSharding(mesh, P(None, ("ring", "a2a")))
    q = jax.ShapeDtypeStruct((1, STEP_T, H, D), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, STEP_T, HKV, D), jnp.bfloat16, sharding=sharding)
    attn = get_tuned_ring_attention(axis_name=("ring", "a2a"), causal=True, mesh=mesh, db=str(db))
    decision = attn.explain(q, kv, kv)
    assert (decision.backend, decision.source) == ("hybrid_pallas_tpu", "compiled"), decision
    assert json.loads(row["fwd_params"]) == dataclasses.asdict(decision.config.fwd)


@pytest.mark.slow
@pytest.mark.parametrize("topology, dtype, head_dim, ring, local_len, asked_mib", [
    ("v5p:2x2x1", "bfloat16", D, RING, 2048, 32),  # the smallest VMEM (64 MiB, the kernels ask for half)
    ("v4:2x2x1", "float32", 256, 8, 4096, 8)])  # v4 asks for 8 MiB; float32 at D=256 needs the most per tile
def test_the_largest_tiles_the_vmem_constraint_admits_compile_within_the_estimate(topology, dtype, head_dim, ring,
                                                                                 local_len, asked_mib):
    """The admitted tiles of each kernel with the largest VMEM estimate, compiled alone
    (`compiled.compile_step`: a kernel's VMEM is its own, whatever program it sits in), compile and use no
    more than the estimate, which stays within what the kernels ask for. Before the estimate was fitted to
    the compiler, it admitted a v4 forward the compiler rejected (256x1024: estimated 7.6 MiB of 8).
    (`python benchmarks/tpu/tpu_vmem.py` compiles them in the whole ring on every generation;
    `benchmarks/tpu/tpu_vmem_kernels.py` the whole tile space.)"""
    from tuner.tuning import compiled
    from tuner.semantics.problem import Problem

    problem = Problem(seq_len=ring * local_len, heads=H, kv_heads=HKV, head_dim=head_dim, dtype=dtype, causal=True,
                      ring_size=ring)
    variants, _, _ = compiled.variants_of(problem, topology_mesh(topology))
    largest = {part: max((v for v in variants if v.part == part and v.ruled_out is None),
                         key=lambda v: compiled.estimate(problem, v)) for part in compiled.PARTS}
    bwd = dataclasses.replace(largest["dkv"].config.bwd, block_q_dq=largest["dq"].config.bwd.block_q_dq,
                              block_kv_dq=largest["dq"].config.bwd.block_kv_dq)
    used = {}
    for tiles in ({"fwd": largest["fwd"].config.fwd}, {"bwd": bwd}):
        result = compiled.compile_step(problem.shapes, problem.spec, topology, **tiles)
        assert isinstance(result, dict), (tiles, result)  # else the compiler's error
        used.update(result)
    for part in compiled.PARTS:
        asked, use = used[part]
        assert use <= compiled.estimate(problem, largest[part]) <= asked == asked_mib * 2**20, (part, use, asked)
