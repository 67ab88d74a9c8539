"""All-to-all, all-gather and the 2-D hybrid over every block kernel: one registration per kernel,
`strategy=` runs the platform's preferred one that can run the call, and each is exact (the Pallas and
Triton kernels in their interpreters against float64; cuDNN's XLA twin in bf16 against the scan kernel in
bf16), compiles for a TPU with only the collectives of its strategy (Pallas) and lowers for CUDA (cuDNN)."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tests.cases import Case, check_exchanged, exchanged_step, laid_out_args, make_arrays, rel_err, replace
from tests.test_determinism import NO_TRITON
from tests.test_hybrid import BASE as HYBRID_BASE
from tests.test_strategies import needs_libtpu
from tuner import BwdParams, FwdParams, registry
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.strategies.configs import TileConfig

EXCHANGES = ("all_to_all", "all_gather", "hybrid")
GROUP = {"all_to_all": 1, "all_gather": 1, "hybrid": 2}  # the all-to-all axis: the hybrid's on a 2x2 mesh
CASE = Case(batch=1, length=80, heads=4, kv_heads=2, head_dim=8, ring=2, layout="zigzag", causal=True)


def test_each_exchange_is_registered_over_each_kernel():
    for strategy in EXCHANGES:
        for kernel in ("scan", "triton", "pallas_tpu", "cudnn"):
            implementation = registry.get(strategy if kernel == "scan" else f"{strategy}_{kernel}")
            assert registry.strategy_of(implementation) == strategy and implementation.engine == kernel
            assert kernel in implementation.summary and implementation.gathered
    assert registry.get("all_to_all_triton").packages == ("triton",)


def test_a_strategy_runs_the_platforms_preferred_kernel_that_can():
    shapes = LocalShapes(1, 1024, 1024, 8, 2, 128, "bfloat16")
    spec = AttentionSpec(scale=128**-0.5, causal=True)

    def chosen(strategy, platform, dtype=jnp.bfloat16):
        group = GROUP[strategy] if strategy == "hybrid" else None
        implementation, passed_over = registry.for_strategy(strategy, spec, dtype, 128, registry.Target(platform),
                                                            shapes=shapes, ring_size=4, group=group)
        assert bool(passed_over) == (platform == "tpu" and dtype == jnp.float16), passed_over  # Pallas first
        return implementation.name

    tpu = importlib.util.find_spec("libtpu") is not None  # the TPU compiler is at hand: Pallas is available
    for strategy in EXCHANGES:
        assert chosen(strategy, "cpu") == strategy  # the CPU prefers the scan kernel
        if tpu:
            assert chosen(strategy, "tpu") == f"{strategy}_pallas_tpu"
            assert chosen(strategy, "tpu", jnp.float16) == strategy  # Pallas takes no float16: scan
    pair = registry.resolve_auto(spec, jnp.bfloat16, 128, registry.Target("tpu" if tpu else "cpu"), shapes=shapes,
                                 ring_size=4, group=2)[0]  # what `tuner search --a2a-size 2` tunes
    assert pair.name == ("hybrid_pallas_tpu" if tpu else "hybrid")
    with pytest.raises(ValueError, match=r"strategy 'all_to_all' cannot run these shapes: all_to_all splits the "
                                         r"query heads over the ring: heads \(8\) must be a multiple of the ring "
                                         r"size \(16\)"):
        registry.for_strategy("all_to_all", spec, jnp.bfloat16, 128, registry.Target("cpu"), shapes=shapes,
                              ring_size=16)


def test_a_packed_tile_the_kernel_cannot_take_leaves_its_default():
    """The documents layout's tile of 16 caps the scan kernel's tiles inside an exchange; Pallas on a TPU
    takes no key tile under 128 shorter than the sequence, so its default stays (it failed to build, and
    the call fell back to the scan kernel)."""
    spec = AttentionSpec(scale=128**-0.5, causal=True, has_segments=True)
    local = LocalShapes(1, 256, 256, 8, 2, 128, "bfloat16")
    for strategy, a2a in GROUP.items():
        for kernel, capped in (("scan", True), ("pallas_tpu", False)):
            implementation = registry.get(strategy if kernel == "scan" else f"{strategy}_{kernel}")
            shapes = registry.tile_shapes(implementation, local, 4, a2a if strategy == "hybrid" else None)
            default = implementation.default_config(shapes, spec)
            packed = implementation.default_config(shapes, spec, packed_tile=16)
            assert (packed.fwd.block_kv == 16) == capped, (implementation.name, packed)
            if not capped:
                assert packed == default
            assert implementation.violation(shapes, spec, packed, ("fwd", "bwd")) is None, implementation.name


INTERPRETED = {  # kernel: (its config, what its interpreted program holds that the scan kernel's does not)
    "pallas_tpu": (TileConfig(FwdParams(16, 128), BwdParams(16, 128, 16, 128)), "pallas_call"),
    "triton": (TileConfig(FwdParams(16, 16), BwdParams(16, 16, 16, 16)), "pure_callback"),  # torch on the CPU
}


@pytest.mark.parametrize("kernel", [
    "pallas_tpu", pytest.param("triton", marks=pytest.mark.skipif(NO_TRITON, reason="needs triton and torch"))])
@pytest.mark.parametrize("strategy", EXCHANGES)
def test_over_pallas_and_triton_in_their_interpreters_it_matches_float64(strategy, kernel):
    """Tiles of 16 queries over 80 tokens (all_to_all's whole sequence) and 40 (all_gather's shard, the
    hybrid's chunk on a ring of 2 positions of 2 devices): the last query tile runs past the end; GQA,
    causal, zigzag; forward, lse and every gradient."""
    config, mark = INTERPRETED[kernel]
    step = check_exchanged(f"{strategy}_{kernel}", CASE, config, GROUP[strategy], interpret=True)
    assert mark in str(jax.make_jaxpr(step)(*laid_out_args(CASE, make_arrays(CASE))))  # not the scan kernel


FEATURE_CASES = [  # test_hybrid.py's, on 2x4 meshes
    pytest.param(replace(HYBRID_BASE, causal=True, segments="random", softcap=4.0, sinks="pair"),
                 id="zigzag-causal-segments-softcap-sinks"),
    pytest.param(replace(HYBRID_BASE, heads=4, kv_heads=1, layout="striped", causal=True, window=(6, 0),
                         explicit_positions=True, scale=0.3), id="striped-positions-window-mqa"),
]


@pytest.mark.parametrize("case", FEATURE_CASES)
def test_the_hybrid_over_pallas_honours_every_feature_but_bias(case):
    """The hybrid on a 2x4 mesh in Pallas's interpreter, against float64: packed segments, a soft cap and
    sinks; a window on explicit positions with one kv head repeated over the group. (Over Triton's
    interpreter these pass too, 8 s more; the Triton kernel's features are held in its rings.)"""
    check_exchanged("hybrid_pallas_tpu", case, INTERPRETED["pallas_tpu"][0], 4, interpret=True)


@pytest.mark.parametrize("strategy", EXCHANGES)
def test_over_cudnns_twin_engine_it_matches_the_scan_kernel_in_bf16(strategy, monkeypatch):
    """cuDNN takes bf16 only: its XLA twin (the cudnn kernel's engine on the CPU) against the scan kernel,
    both fed the same bf16 arrays; output, lse and gradients within bf16's rounding."""
    from tuner.kernels import cudnn_engine

    asked, engine = [], cudnn_engine.engine
    monkeypatch.setattr(cudnn_engine, "engine", lambda interpret: asked.append(interpret) or engine(interpret))
    # on the host: a device array's cast, and its placement on the mesh, each compile a program per shape
    args = [None if x is None else np.asarray(x) for x in laid_out_args(CASE, make_arrays(CASE))]
    args[:3] = [x.astype(jnp.bfloat16) for x in args[:3]]
    (_, (out, lse)), grads = exchanged_step(f"{strategy}_cudnn", CASE, TileConfig(FwdParams(20, 20), BwdParams(20, 20)),
                                            GROUP[strategy], interpret=True)(*args)
    (_, (want, want_lse)), want_grads = exchanged_step(strategy, CASE, TileConfig(FwdParams(16, 16), BwdParams(16, 16)),
                                                       GROUP[strategy])(*args)
    assert out.dtype == jnp.bfloat16 and asked and all(asked)  # the cudnn kernel ran, on its twin
    assert rel_err(np.asarray(lse), np.asarray(want_lse)) < 1e-5
    for got, expected in zip((out, *grads[:3]), (want, *want_grads[:3])):
        assert rel_err(np.asarray(got, np.float32), np.asarray(expected, np.float32)) < 1e-2


COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(")


@needs_libtpu
@pytest.mark.parametrize("strategy, collectives, reductions", [
    ("all_to_all", {"all-to-all"}, set()), ("all_gather", {"all-gather"}, {"reduce-scatter", "all-reduce"}),
    ("hybrid", {"all-to-all", "collective-permute"}, set())])
def test_over_pallas_on_the_tpu_compiler_only_the_strategys_collectives_move_the_sequence(strategy, collectives,
                                                                                         reductions):
    """v5e, 2,048 tokens on 4 chips (the hybrid's: a ring of 2 positions of 2), forward and backward: three
    Mosaic kernels, and the bf16 arrays move only by the strategy's collectives (all_gather: K and V,
    heads-major, then the sum of dK and dV, which XLA:TPU builds as a reduce-scatter up to 8,192 tokens and
    as an all-reduce from 16,384, either accepted; the hybrid: its all-to-alls and its ring's permutes). The
    rest does not depend on the length, and the compile's time grows with it (the default tiles with it):
    all_gather's took 3.4 times as long at 32,768 tokens."""
    from tuner.tuning import compiled
    from tuner.tuning.decision import loader_plan
    from tuner.tuning.workload import Workload, vjp_of

    problem = Problem(seq_len=2048, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True, ring_size=4,
                      layout="zigzag", a2a_size=GROUP[strategy])
    workload = Workload(problem, devices=list(compiled.topology_mesh("v5e:2x2").devices.flat))
    with jax.sharding.use_abstract_mesh(workload.mesh.abstract_mesh):
        plan = loader_plan(problem, f"{strategy}_pallas_tpu", None)
    attend = workload.attend(plan.backend, plan.config)
    inputs, dout = workload.structs()

    def forward_and_backward(x, cotangent):
        out, vjp = vjp_of(attend, x)
        return out, vjp(cotangent)

    text = jax.jit(forward_and_backward).lower(inputs, dout).compile().as_text()
    moved = {found[2] for found in map(COLLECTIVE.search, text.splitlines()) if found and "bf16[" in found[1]}
    assert collectives <= moved <= collectives | reductions, moved
    assert text.count("tpu_custom_call") >= 3


@pytest.mark.parametrize("strategy", ["all_to_all", "hybrid"])
def test_over_cudnn_it_lowers_for_cuda_to_cudnns_calls_between_all_to_alls(strategy):
    """The real cuDNN primitives (not the twin), on 4 devices (the hybrid's: a ring of 2 positions of 2),
    1,024 tokens, causal, zigzag (all_to_all's gathered sequence holds the shards' halves of 128 in ring
    order, the hybrid's chunk the halves of 256, so chunks of 128 are whole halves), lowered for CUDA on
    this host: cuDNN's forward and backward calls between the all-to-alls, and ring permutes in the
    hybrid's ring alone."""
    from tuner.kernels import cudnn_engine

    if cudnn_engine.private_module()[0] is None:
        pytest.skip(f"this jax has no cuDNN primitives to bind: {cudnn_engine.private_module()[1]}")
    implementation, spec = registry.get(f"{strategy}_cudnn"), AttentionSpec(scale=0.125, causal=True)
    config = TileConfig(FwdParams(128, 128), BwdParams(128, 128))
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices.reshape(2, 2), ("ring", "a2a")) if strategy == "hybrid" else Mesh(devices, ("sp",))
    axis_name = mesh.axis_names if strategy == "hybrid" else "sp"

    def attention(q, k, v):
        return implementation.attend(q, k, v, spec=spec, config=config, axis_name=axis_name, layout="zigzag")

    sharded = jax.shard_map(attention, mesh=mesh, in_specs=(P(None, axis_name),) * 3, out_specs=P(None, axis_name))
    q, kv = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    grads = jax.grad(lambda q, k, v: sharded(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    text = jax.jit(grads).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    assert "all_to_all" in text and ("collective_permute" in text) == (strategy == "hybrid")
