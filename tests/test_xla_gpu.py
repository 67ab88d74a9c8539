"""What XLA:GPU makes of the ring, read without a GPU: the bytes a compiled module moves without computing
(`hlo.moved_bytes`), and, where jax's CUDA plugin is installed, the ring compiled for an H100 topology
(`benchmarks/gpu/xla_gpu_compile.py` reports the same for several rings and implementations)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import Case, check_case, inner_jaxprs
from tuner.kernels.cudnn import CudnnBackend, cuda_plugin
from tuner.kernels.params import BwdParams, FwdParams
from tuner.models import hlo
from tuner.semantics.spec import AttentionSpec
from tuner.strategies import ring as ring_module
from tuner.strategies.ring import run_ring

MODULE = """HloModule m

%wrapped_slice_computation (a: bf16[1,64,2,8]) -> bf16[1,32,2,8] {
  %a = bf16[1,64,2,8]{3,2,1,0} parameter(0)
  ROOT %s = bf16[1,32,2,8]{3,2,1,0} slice(%a), slice={[0:1], [32:64], [0:2], [0:8]}
}

%fused_merge (x: f32[1,32,2,8], y: f32[1,32,2,8]) -> f32[1,32,2,8] {
  %x = f32[1,32,2,8]{3,2,1,0} parameter(0)
  %y = f32[1,32,2,8]{3,2,1,0} parameter(1)
  ROOT %m = f32[1,32,2,8]{3,2,1,0} multiply(%x, %y)
}

%input_concatenate_fusion_computation (x: f32[1,32,2,8], y: f32[1,32,2,8]) -> f32[1,64,2,8] {
  %x = f32[1,32,2,8]{3,2,1,0} parameter(0)
  %y = f32[1,32,2,8]{3,2,1,0} parameter(1)
  ROOT %c = f32[1,64,2,8]{3,2,1,0} concatenate(%x, %y), dimensions={1}
}

%fused_dynamic_slice (a: bf16[1,64,2,8], i: s32[]) -> bf16[1,32,2,8] {
  %a = bf16[1,64,2,8]{3,2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %two = s32[] constant(2)
  %offset = s32[] multiply(%i, %two)
  %z = s32[] constant(0)
  ROOT %d = bf16[1,32,2,8]{3,2,1,0} dynamic-slice(%a, %z, %offset, %z, %z), dynamic_slice_sizes={1,32,2,8}
}

%body (p: (s32[], bf16[1,64,2,8])) -> (s32[], bf16[1,64,2,8]) {
  %p = (s32[], bf16[1,64,2,8]{3,2,1,0}) parameter(0)
  %k = bf16[1,64,2,8]{3,2,1,0} get-tuple-element(%p), index=1
  %copy.1 = bf16[1,64,2,8]{3,2,1,0} copy(%k)
  %wrapped_slice = bf16[1,32,2,8]{3,2,1,0} fusion(%copy.1), kind=kLoop, calls=%wrapped_slice_computation
  %chosen = bf16[1,32,2,8]{3,2,1,0} fusion(%k, %i), kind=kLoop, calls=%fused_dynamic_slice
  %merged = f32[1,32,2,8]{3,2,1,0} fusion(%o, %o), kind=kLoop, calls=%fused_merge
  %dus = f32[1,64,2,8]{3,2,1,0} dynamic-update-slice(%big, %merged, %z, %z, %z, %z)
  ROOT %t = (s32[], bf16[1,64,2,8]{3,2,1,0}) tuple(%i, %copy.1)
}

%cond (p: (s32[], bf16[1,64,2,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (k: bf16[1,64,2,8]) -> f32[1,64,2,8] {
  %w = (s32[], bf16[1,64,2,8]{3,2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={TRIPS}
  %copy-start = (f32[1,32,2,8]{3,2,1,0}, f32[1,32,2,8]{3,2,1,0}, u32[]) copy-start(%a)
  %copy-done = f32[1,32,2,8]{3,2,1,0} copy-done(%copy-start)
  ROOT %cat = f32[1,64,2,8]{3,2,1,0} fusion(%a, %copy-done), kind=kInput, calls=%input_concatenate_fusion_computation
}
""".replace("{TRIPS}", '{"known_trip_count":{"n":"3"}}')
SHARD = 64 * 2 * 8  # elements of the module's k


def test_moved_bytes_counts_kernels_that_compute_nothing_once_per_execution():
    assert hlo.moved_bytes(MODULE) == {
        "copy": 3 * SHARD * 2 + SHARD // 2 * 4,  # the loop's copy, 3 trips; the async copy once, by its done
        "slice": 2 * 3 * SHARD // 2 * 2,  # the wrapped slice and the dynamic one (its offset's scalar math aside)
        "concatenate": SHARD * 4,  # a fusion of nothing but a concatenation
    }  # the merge computes, and the dynamic-update-slice writes in place: neither counts


def test_the_cudnn_kernel_compiles_for_a_gpu_the_cuda_plugin_describes(monkeypatch):
    """With jax's CUDA plugin XLA:GPU compiles for a GPU topology on a host without one, as libtpu does
    for a TPU topology: the cudnn kernel is then available where the program is built for a GPU."""
    kernel = CudnnBackend()
    monkeypatch.setattr(jax, "devices", lambda *a: [type("Cpu", (), {"platform": "cpu"})()])
    monkeypatch.setattr("tuner.kernels.cudnn.cuda_plugin", lambda: True)
    assert kernel.unavailable_reason(platform="gpu") is None
    assert kernel.unavailable_reason(platform="cpu") == "no CUDA GPU visible to jax"
    monkeypatch.setattr("tuner.kernels.cudnn.cuda_plugin", lambda: False)
    assert kernel.unavailable_reason(platform="gpu") == "no CUDA GPU visible to jax"


TARGET = os.path.join(os.path.dirname(__file__), os.pardir, "tuner", "models", "targets", "h100.txtpb")


@pytest.mark.skipif(not cuda_plugin(), reason="needs jax's CUDA plugin (pip install 'jax[cuda12]' of the installed "
                                              "jax's version; benchmarks/gpu/xla_gpu_compile.py); the CUDA "
                                              "lowering tests of test_cudnn.py run instead")
def test_the_cudnn_ring_compiled_for_an_h100_copies_and_slices_nothing_a_step_and_gathers_nothing():
    """A causal zigzag ring of 8 (a loop of three turns), forward and backward: the loop copies no travelling
    array (two steps a turn) and no step slices q, k or v for cuDNN (the diagonal step is one causal call,
    the others one call on prefixes). What is left are the backward's copies of k and v once, before its
    loop, the query halves swapped once a turn, and slices of positions."""
    from jax.experimental import topologies

    from tuner import registry
    from tuner.semantics.problem import Problem
    from tuner.tuning.workload import Workload, vjp_of

    ring = 8
    with open(TARGET) as f:
        devices = topologies.get_topology_desc("h100", "cuda", target_config=f.read(), topology=f"1x1x{ring}").devices
    problem = Problem(seq_len=1024 * ring, heads=4, kv_heads=4, head_dim=128, dtype="bfloat16", causal=True,
                      ring_size=ring, layout="zigzag", batch=1)
    workload = Workload(problem, devices=devices)
    with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):
        config = registry.default_config(registry.get("cudnn"), problem.shapes, problem.spec, None)
    fn = workload.attend("cudnn", config)
    inputs, dout = workload.structs()

    def forward_and_backward(x, cotangent):
        out, vjp = vjp_of(fn, x)
        return out, vjp(cotangent)

    text = jax.jit(forward_and_backward).lower(inputs, dout).compile().as_text()
    shard = 1024 * 4 * 128 * 2  # one device's k, in bytes
    assert not hlo.gathers(text)
    moved = hlo.moved_bytes(text)
    assert moved["slice"] < shard // 100 and moved["copy"] <= 2 * shard + shard // 100, moved  # + positions
    # the forward's q and the backward's q, o and do swapped once a turn (3) and at the last step
    assert moved["concatenate"] <= 4 * 4 * shard, moved
    assert text.count('custom_call_target="__cudnn$fmhaSoftmaxBackward"') > 0
    received = hlo.collective_bytes(text)["collective-permute"]
    assert received >= (ring - 1) * 2 * shard  # k and v, each step but the last, forward and backward
    assert received < 8 * ring * shard  # and not a sequence's worth of anything more


def _sends_per_turn(jaxpr) -> list[int]:
    """The collective permutes in the body of each loop of `jaxpr` that sends any (and of the jaxprs it
    holds); `lax.fori_loop` with static bounds is a `scan`."""
    found = []
    for eqn in jaxpr.eqns:
        body = {"while": "body_jaxpr", "scan": "jaxpr"}.get(eqn.primitive.name)
        sends = sum(e.primitive.name == "ppermute" for e in eqn.params[body].jaxpr.eqns) if body else 0
        found += [sends] if sends else []
        for inner in inner_jaxprs(eqn):
            found += _sends_per_turn(inner)
    return found


@pytest.mark.parametrize("ring", [4, 5, 8])
def test_on_a_gpu_the_ring_loop_runs_two_steps_a_turn_and_computes_the_same(ring, monkeypatch):
    """Built for a GPU, the ring's loops run two steps a turn (an odd step count runs one first), so that the
    keys that arrive in a turn's second step take the place of those its first read, and XLA:GPU copies
    nothing to make room (`benchmarks/gpu/xla_gpu_compile.py`: the copies it counts went from 194 MiB to
    none in the cudnn ring of 8's forward). The results are the float64 reference's, forward and
    gradients, on the CPU's simulated devices."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def local(q, k, v):
        return run_ring(q, k, v, spec=AttentionSpec(scale=0.5, causal=True), backend="scan", axis_name="sp",
                        layout="zigzag", fwd_params=FwdParams(16, 16), bwd_params=BwdParams(16, 16))

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    x = jnp.zeros((1, 32 * ring, 2, 8), jnp.float32)

    def sends_per_turn() -> list[int]:
        return _sends_per_turn(jax.make_jaxpr(jax.grad(lambda q, k, v: sharded(q, k, v).sum()))(x, x, x).jaxpr)

    one_step = sends_per_turn()
    assert one_step == [3, 5]  # the forward sends k, v and positions; the backward those and the dk/dv accumulators
    monkeypatch.setattr(ring_module, "compile_target", lambda *a: ("gpu", "NVIDIA H100"))
    assert sends_per_turn() == [6, 10]
    check_case(Case(batch=1, length=32 * ring, heads=2, kv_heads=1, head_dim=8, ring=ring, layout="zigzag",
                    causal=True, window=(40, 0), seed=ring))


def test_a_gpu_target_for_tuner_memory_names_what_is_wrong(monkeypatch, capsys):
    """`tuner memory --device gpu --target NAME:COUNT`: a name it has no description of, a count missing or
    past a node's GPUs, and a host without jax's CUDA plugin are each one line saying what to do."""
    from tuner.cli import main

    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # `--device cpu` sets them for a jax it would start: restored after
        monkeypatch.setenv(name, os.environ[name])
    monkeypatch.setattr("tuner.tuning.gpu_topology.cuda_plugin", lambda: True)
    for target, words in (("a100:8", "no GPU named 'a100'; GPU targets: h100:COUNT"),
                          ("h100", "write the number of GPUs after the colon, 1 to 8"),
                          ("h100:16", "write the number of GPUs after the colon, 1 to 8")):
        assert main(["memory", "--device", "gpu", "--target", target]) != 0
        assert f"--target {target}: {words}" in capsys.readouterr().err
    from tuner.tuning import gpu_topology

    assert [gpu_topology.parse(t) for t in ("h100:1", "h200:8")] == [("h100", 1), ("h200", 8)]
    monkeypatch.setattr("tuner.tuning.gpu_topology.cuda_plugin", lambda: False)
    assert main(["memory", "--device", "gpu", "--target", "h100:8"]) != 0
    assert f"needs jax's CUDA plugin: pip install 'jax[cuda12]=={jax.__version__}'" in capsys.readouterr().err
    assert main(["memory", "--device", "cpu", "--target", "h100:8"]) != 0
    assert "pass it with --device tpu or gpu" in capsys.readouterr().err


@pytest.mark.skipif(not cuda_plugin(), reason="needs jax's CUDA plugin (pip install 'jax[cuda12]' of the installed "
                                              "jax's version); the errors of the GPU target are tested without it")
def test_tuner_memory_compiles_the_cudnn_ring_for_h100s_and_h200s_without_one(tmp_path):
    """The verb in a process of its own (it tells jax, before jax starts, that the host's devices are the
    CPU's): two H100s, the cudnn ring, what a device holds and the longest sequence an H100 holds. Asked for
    the loader's own choice, for two H200s, it says why it fell back (Triton does not build without a GPU)."""
    env = {**os.environ, "TUNER_HOME": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    problem = ["--seq-len", "16384", "--heads", "8", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16"]
    run = subprocess.run([sys.executable, "-m", "tuner.cli", "memory", "--device", "gpu", "--target", "h100:2",
                          *problem, "--backend", "cudnn"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled for h100:2: what the loader runs, cudnn" in run.stdout, run.stdout
    held = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.startswith(("fwd ", "fwd+bwd "))}
    assert set(held) == {"fwd", "fwd+bwd"} and "H100  80 GiB" in run.stdout, run.stdout
    run = subprocess.run([sys.executable, "-m", "tuner.cli", "memory", "--device", "gpu", "--target", "h200:2",
                          *problem, "--objective", "fwd"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(fallback)" in run.stdout and "fallback: " in run.stdout and "triton cannot run here" in run.stdout
