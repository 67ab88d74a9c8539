"""`strategy=` of the public API: "ring", "all_to_all" and "all_gather" run that strategy (by the loader and by
`ring_attention`) and agree with the ring; a backend of another strategy, an unknown strategy and the
unimplemented "hybrid" are refused by name; all_to_all with heads that do not split over the ring is refused at
resolve time when asked for and skipped, with its reason, under `auto`. On a TPU topology (libtpu compiles for
one on this host) and an H100 or H200 target, the strategy model decides where nothing measured or tuned does."""

import functools
import importlib.util
import os
import re

import numpy as np
import pytest

os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: libtpu's worker list, without a warning

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tuner.runtime import dispatch, modelled
from tuner import get_tuned_ring_attention, registry, ring_attention  # noqa: E402
from tuner.semantics import layouts
from tuner.cache import Cache, make_row  # noqa: E402
from tuner.semantics.problem import Problem  # noqa: E402

import scripts  # noqa: E402

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed: pip install -e '.[tpu]' compiles for TPU topologies")
RING = 4
SMALL = Problem(batch=1, seq_len=32, heads=4, kv_heads=2, head_dim=8, causal=True, ring_size=RING, layout="zigzag")


def cpu_mesh(size: int = RING) -> Mesh:
    return Mesh(np.array(jax.devices()[:size]), ("sp",))


def arrays(problem: Problem, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((problem.batch, problem.seq_len, problem.heads, problem.head_dim), np.float32)
    k, v = (rng.standard_normal((problem.batch, problem.seq_len, problem.kv_heads, problem.head_dim), np.float32)
            for _ in range(2))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def output_and_grads(attend, q, k, v):
    """The output and d/dq, d/dk, d/dv of a weighted sum of it, under one `jax.jit`."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    step = jax.jit(jax.value_and_grad(lambda q, k, v: (jnp.vdot(attend(q, k, v), w), attend(q, k, v)),
                                      argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = step(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


def ring_attention_of(strategy: str, backend: str = "auto"):
    """`ring_attention(strategy=...)` under a `shard_map` of the caller's on the arrays laid out in zigzag
    order, as a function of global arrays in token order."""
    def local(q, k, v):
        return ring_attention(q, k, v, causal=True, axis_name="sp", layout="zigzag", strategy=strategy, backend=backend)

    seq = P(None, "sp")
    sharded = jax.shard_map(local, mesh=cpu_mesh(), in_specs=(seq, seq, seq), out_specs=seq)
    return lambda q, k, v: layouts.restore(sharded(*(layouts.lay_out(x, "zigzag", RING) for x in (q, k, v))),
                                           "zigzag", RING)


def bench_rows(problem: Problem, seconds: dict[str, float], device_kind: str) -> list[dict]:
    """One `tuner bench --mechanisms` run of `problem`: `seconds` per implementation."""
    rows = []
    for name, best_s in seconds.items():
        implementation = registry.get(name)
        rows.append(make_row(registry.problem_key(problem, name, device_kind),
                             implementation.default_config(problem.shapes, problem.spec),
                             versions=registry.versions(implementation), tool_version="test", source="bench",
                             objective="fwd+bwd", best_s=best_s, default_s=None, speedup=None, trials_run=2,
                             trials_pruned=0, study="bench 1"))
    return rows


@functools.cache
def ring_reference() -> list[np.ndarray]:
    """The ring's output and gradients on SMALL (computed once for every strategy compared with it)."""
    return output_and_grads(ring_attention_of("ring"), *arrays(SMALL))


@pytest.mark.parametrize("strategy", ["all_to_all", "all_gather"])
def test_an_explicit_strategy_runs_and_matches_the_ring(strategy, tmp_path):
    q, k, v = arrays(SMALL)
    ring = ring_reference()
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), strategy=strategy,
                                    db=str(tmp_path / "t.sqlite"))
    assert attn.explain(q, k, v).backend == strategy
    for caller, attend in (("ring_attention", ring_attention_of(strategy)), ("loader", attn)):
        for name, got, want in zip(("out", "dq", "dk", "dv"), output_and_grads(attend, q, k, v), ring):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5, err_msg=f"{caller} {strategy}: {name}")


@pytest.mark.parametrize("strategy", ["ring", "all_to_all", "all_gather"])
def test_a_gradient_of_the_gradient_is_refused_in_one_line_by_every_strategy(strategy, tmp_path):
    """A second-order derivative (a gradient penalty, `jax.hessian`) differentiates the ring's backward pass,
    whose loops jax cannot differentiate: refused with what to use instead, not jax's message about a
    `lax.while_loop` of the library. First-order gradients are the other tests'."""
    q, k, v = arrays(SMALL)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), strategy=strategy,
                                    db=str(tmp_path / "t.sqlite"))

    def penalty(k):
        return (jax.grad(lambda q: attn(q, k, v).sum())(q) ** 2).sum()

    with pytest.raises(NotImplementedError, match="ring attention has first-order gradients only: .* use "
                                                  "tuner.semantics.reference.dense_attention"):
        jax.jit(jax.grad(penalty)).lower(k)


def test_global_arrays_take_jax_s_transforms_outside_any_jit(tmp_path):
    """`jax.vjp` and `jax.vmap` of the loader on global arrays, called outside any jit, match the same
    transforms under `jax.jit`; forward mode (`jax.jvp`, and `jax.linearize`'s linear map) is refused in jax's
    words for a custom VJP. (Before, outside any jit, they ran the `shard_map` primitive by primitive and
    failed inside jax: "unhashable type: 'list'".)"""
    q, k, v = arrays(SMALL)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), layout="zigzag",
                                    db=str(tmp_path / "t.sqlite"))

    def transforms(q, k, v):
        out, pullback = jax.vjp(lambda k: attn(q, k, v), k)
        batched = jax.vmap(lambda v: attn(q, k, v))(jnp.stack([v, 2 * v]))
        return out, *pullback(q), batched

    eager, jitted = transforms(q, k, v), jax.jit(transforms)(q, k, v)
    for name, got, want in zip(("output", "pulled back", "vmapped"), eager, jitted):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(eager[2], np.stack([eager[0], 2 * eager[0]]), rtol=0, atol=1e-5)  # linear in v
    forward_mode = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"
    with pytest.raises(TypeError, match=forward_mode):
        jax.jvp(lambda q: attn(q, k, v), (q,), (q,))
    _, linear = jax.linearize(lambda q: attn(q, k, v), q)
    with pytest.raises(TypeError, match=forward_mode):
        linear(q)


def test_an_eager_shard_map_compiles_the_ring_as_one_program(tmp_path):
    """Inside a `shard_map` called outside any jit, jax runs each primitive as a program of its own: `ring_attention`
    and the loader put their call under a jit of its own, so the ring is one program (at 256 tokens the forward
    compiles 7 programs, 89 before, the gradient 25, 241 before: `benchmarks/cpu_ring/eager_calls.py`)."""
    q, k, v = arrays(SMALL)
    seq = P(None, "sp")
    loader = get_tuned_ring_attention(axis_name="sp", causal=True, layout="zigzag", db=str(tmp_path / "t.sqlite"))
    with scripts.load("benchmarks/suite/first_trace.py").compiles_counted() as compiles:
        for attend in (ring_attention_of("ring"), lambda q, k, v: layouts.restore(jax.shard_map(
                loader, mesh=cpu_mesh(), in_specs=(seq,) * 3, out_specs=seq)(
                    *(layouts.lay_out(x, "zigzag", RING) for x in (q, k, v))), "zigzag", RING)):
            compiles.clear()
            out = attend(q, k, v)
            assert len(compiles) <= 20, len(compiles)
            np.testing.assert_allclose(out, ring_reference()[0], rtol=0, atol=1e-5)
            compiles.clear()
            jax.grad(lambda q, attend=attend: attend(q, k, v).sum())(q)
            assert len(compiles) <= 40, len(compiles)


def test_strategy_ring_keeps_the_ring_and_auto_on_the_cpu_is_as_before(tmp_path):
    q, k, v = arrays(SMALL)
    for strategy in ("ring", "auto"):
        decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), strategy=strategy,
                                            db=str(tmp_path / "t.sqlite")).explain(q, k, v)
        assert (decision.backend, decision.source, decision.predictions) == ("scan", "default", None), decision
        assert "strategy model" not in decision.reason  # the CPU is a simulation platform: the model never decides


def test_a_backend_of_another_strategy_is_refused_naming_both():
    for strategy, backend in (("ring", "dense"), ("ring", "all_to_all"), ("all_to_all", "scan"),
                              ("all_gather", "all_to_all")):
        with pytest.raises(ValueError, match=rf"backend '{backend}' runs the .* strategy, not strategy='{strategy}'"):
            get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), strategy=strategy, backend=backend)
    q, k, v = arrays(SMALL)
    with pytest.raises(ValueError, match=r"backend 'all_gather' runs the 'all_gather' strategy, not strategy='ring'"):
        ring_attention_of("ring", backend="all_gather")(q, k, v)  # ring_attention's strategy is "ring" by default
    get_tuned_ring_attention(axis_name="sp", mesh=cpu_mesh(), strategy="all_to_all", backend="all_to_all")
    get_tuned_ring_attention(axis_name="sp", mesh=cpu_mesh(), strategy="ring", backend="scan")


def test_unknown_strategies_and_axis_names_that_do_not_fit_the_strategy_are_refused():
    with pytest.raises(ValueError, match="strategy must be one of auto, ring, all_to_all, all_gather, hybrid, "
                                         "got 'ulysses'"):
        get_tuned_ring_attention(axis_name="sp", mesh=cpu_mesh(), strategy="ulysses")
    with pytest.raises(ValueError, match=r"strategy='hybrid' runs over 2 mesh axis\(es\), got axis_name='sp': "
                                         r"pass axis_name=\(ring_axis, group_axis\)"):
        get_tuned_ring_attention(axis_name="sp", mesh=cpu_mesh(), strategy="hybrid")
    with pytest.raises(ValueError, match=r"strategy='ring' runs over 1 mesh axis\(es\), got "
                                         r"axis_name=\('sp', 'x'\): pass one axis name"):
        get_tuned_ring_attention(axis_name=("sp", "x"), strategy="ring")
    for pair in (("sp", "sp"), ("sp", None), ("a", "b", "c")):
        with pytest.raises(ValueError, match="two different mesh axes"):
            get_tuned_ring_attention(axis_name=pair)  # "auto" with a pair is the hybrid
    with pytest.raises(ValueError, match="backend 'scan' runs the 'ring' strategy, not strategy='hybrid'"):
        get_tuned_ring_attention(axis_name=("sp", "x"), backend="scan")
    q, k, v = arrays(SMALL)
    with pytest.raises(ValueError, match=r"backend 'hybrid' runs over 2 mesh axis\(es\), got axis_name='sp': "
                                         r"pass axis_name=\(ring_axis, group_axis\)"):
        get_tuned_ring_attention(axis_name="sp", mesh=cpu_mesh(), backend="hybrid")(q, k, v)
    for strategy, message in (("hybrid", "runs over 2 mesh axis\\(es\\)"),
                              ("auto", "strategy='auto' is get_tuned_ring"), ("ulysses", "strategy must be one of")):
        with pytest.raises(ValueError, match=message):
            ring_attention_of(strategy)(q, k, v)


def test_all_to_all_with_heads_that_do_not_split_is_refused_when_asked_for_and_skipped_under_auto(tmp_path):
    six = Problem(batch=1, seq_len=32, heads=6, kv_heads=2, head_dim=8, causal=True, ring_size=RING)
    q, k, v = arrays(six)
    heads = ("cannot run these shapes: all_to_all splits the query heads over the ring: heads (6) must be a "
             "multiple of the ring size (4)")
    for argument in ("backend", "strategy"):
        attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), db=str(tmp_path / "t.sqlite"),
                                        **{argument: "all_to_all"})
        with pytest.raises(ValueError, match=re.escape(f"{argument} 'all_to_all' {heads}")):
            attn.explain(q, k, v)
        with pytest.raises(ValueError, match=re.escape(f"{argument} 'all_to_all' {heads}")):
            attn(q, k, v)  # refused, not run on the scan ring with a warning
    with pytest.raises(ValueError, match=re.escape(f"strategy 'all_to_all' {heads}")):
        ring_attention_of("all_to_all")(q, k, v)

    db = tmp_path / "bench.sqlite"  # a bench run that measured all_to_all fastest (on other heads, say)
    Cache(db).put_run(bench_rows(six, {"all_to_all": 0.001, "scan": 0.004}, jax.devices()[0].device_kind))
    decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), db=str(db)).explain(q, k, v)
    assert decision.backend == "scan" and "the fastest cannot honour it" in decision.reason, decision
    assert f"passed over: all_to_all {heads}" in decision.reason, decision.reason
    ring_only = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), db=str(db), strategy="ring")
    assert ring_only.explain(q, k, v).backend == "scan"


def test_all_gather_over_the_memory_limit_is_refused_at_resolve(monkeypatch):
    from tuner.strategies import all_gather

    monkeypatch.setattr(all_gather, "device_bytes_limit", lambda: 1024)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), strategy="all_gather")
    with pytest.raises(ValueError, match="strategy 'all_gather' cannot run these shapes: all_gather would hold"):
        attn.explain(*arrays(SMALL))


@pytest.mark.parametrize(("device_kind", "platform"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200")])
def test_the_model_decides_for_an_h100_or_h200_and_the_margin_holds(device_kind, platform, tmp_path, monkeypatch):
    monkeypatch.setattr(dispatch, "compile_target", lambda mesh=None: ("gpu", device_kind))
    short = Problem(batch=1, seq_len=4096, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16", causal=True,
                    ring_size=RING, layout="zigzag")
    ranked = {t.strategy: t.seconds for t in modelled.strategy_model.rank(short, platform)}
    assert ranked["all_gather"] < (1 - modelled.MARGIN) * ranked["ring"]  # the premise: all_gather clearly wins
    q = jax.ShapeDtypeStruct((1, short.seq_len, short.heads, short.head_dim), jnp.bfloat16)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=cpu_mesh(), db=str(tmp_path / "t.sqlite"))
    decision = attn.explain(q, q, q)
    assert decision.backend == "all_gather", decision
    assert f"strategy model ({platform})" in decision.reason and "picked all_gather" in decision.reason
    assert [s for s, _, _ in decision.predictions][0] == "all_gather"
    assert {s for s, _, _ in decision.predictions} == set(modelled.CANDIDATES)


def test_the_model_knows_a_gpu_by_a_word_of_its_device_kind():
    """An H100 or H200 by name; a GH200 (its own memory) and an A100 (no rates here) get no model."""
    kinds = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB")
    assert [modelled.model_platform("gpu", kind) for kind in kinds] == ["h100", "h200", None, None]


def tpu_mesh(name: str = "v5e:2x2") -> Mesh:
    from jax.experimental import topologies

    return Mesh(np.array(topologies.get_topology_desc(platform="tpu", topology_name=name).devices), ("sp",))


def tpu_structs(problem: Problem):
    q = jax.ShapeDtypeStruct((problem.batch, problem.seq_len, problem.heads, problem.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((problem.batch, problem.seq_len, problem.kv_heads, problem.head_dim), jnp.bfloat16)
    return q, kv, kv


FAVOURS_ALL_GATHER = Problem(seq_len=1024, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True,
                             ring_size=RING)  # v5e: all_gather predicted at ~0.55 of the ring's time
KEEPS_RING = Problem(seq_len=3584, heads=8, kv_heads=4, head_dim=128, dtype="bfloat16", causal=True,
                     ring_size=RING)  # v5e: all_gather predicted ~7% faster, all_to_all ~4%: under the margin


@needs_libtpu
def test_on_a_tpu_topology_the_model_picks_another_strategy_only_by_the_margin(tmp_path):
    mesh, db = tpu_mesh(), str(tmp_path / "t.sqlite")
    for problem, picked in ((FAVOURS_ALL_GATHER, "all_gather"), (KEEPS_RING, "ring")):
        ranked = {t.strategy: t.seconds for t in modelled.strategy_model.rank(problem, "v5e")}
        assert (ranked["all_gather"] < (1 - modelled.MARGIN) * ranked["ring"]) == (picked == "all_gather"), ranked
        decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=db).explain(
            *tpu_structs(problem))
        # on a TPU the picked strategy runs over the Pallas kernels, as the ring does
        assert decision.backend == {"ring": "pallas_tpu", "all_gather": "all_gather_pallas_tpu"}[picked], decision
        assert decision.reason.startswith("strategy model (v5e): ring predicted"), decision.reason
        assert ("picked all_gather" if picked == "all_gather" else "under the 10% margin") in decision.reason
        assert [(s, t) for s, t, _ in decision.predictions] == sorted(
            ((s, t) for s, t in ranked.items() if s in modelled.CANDIDATES), key=lambda p: p[1])
        assert all(measured is None for _, _, measured in decision.predictions)
    asked = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=db, strategy="ring")
    assert asked.explain(*tpu_structs(FAVOURS_ALL_GATHER)).backend == "pallas_tpu"


@needs_libtpu
def test_on_a_tpu_topology_a_measurement_or_a_tuned_ring_outranks_the_model(tmp_path):
    mesh, kind = tpu_mesh(), "TPU v5 lite"
    q, k, v = tpu_structs(FAVOURS_ALL_GATHER)
    measured = tmp_path / "bench.sqlite"
    Cache(measured).put_run(bench_rows(FAVOURS_ALL_GATHER, {"pallas_tpu": 0.002, "all_gather_pallas_tpu": 0.003}, kind))
    decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(measured)).explain(q, k, v)
    assert decision.backend == "pallas_tpu" and "tuner bench --mechanisms measured" in decision.reason, decision
    assert {s: m for s, _, m in decision.predictions} == {"ring": 0.002, "all_gather": 0.003, "all_to_all": None}

    tuned = tmp_path / "tuned.sqlite"
    pallas = registry.get("pallas_tpu")
    config = pallas.default_config(FAVOURS_ALL_GATHER.shapes, FAVOURS_ALL_GATHER.spec)
    Cache(tuned).put(make_row(registry.problem_key(FAVOURS_ALL_GATHER, "pallas_tpu", kind), config,
                              versions=registry.versions(pallas), tool_version="test", objective="fwd+bwd",
                              best_s=0.001, default_s=0.002, speedup=2.0, trials_run=2, trials_pruned=0, study="test"))
    decision = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, db=str(tuned)).explain(q, k, v)
    assert (decision.backend, decision.source) == ("pallas_tpu", "exact"), decision
    assert "picked all_gather, but pallas_tpu is tuned for this problem" in decision.reason, decision.reason


@needs_libtpu
def test_on_a_tpu_topology_a_pair_axis_name_runs_the_hybrid_over_pallas(tmp_path):
    """The loader over a 2x2 mesh of v5e chips: a pair `axis_name` plans the hybrid over the Pallas
    kernels, keyed by its inner ring; float16, which Pallas does not take, over the scan kernel, and
    `explain()` says why (source "fallback")."""
    from jax.experimental import topologies

    devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices)
    mesh = Mesh(devices.reshape(2, 2), ("ring", "a2a"))
    attn = get_tuned_ring_attention(axis_name=("ring", "a2a"), causal=True, mesh=mesh, db=str(tmp_path / "t.sqlite"))
    problem = Problem(seq_len=4096, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True, ring_size=4,
                      a2a_size=2)
    decision = attn.explain(*tpu_structs(problem))
    assert decision.backend == "hybrid_pallas_tpu", decision
    assert (decision.key.backend, decision.key.ring_size, decision.key.heads) == ("hybrid_pallas_tpu", 2, 4)
    assert decision.source == "default", decision  # the platform's first choice: no fallback
    half = attn.explain(*(jax.ShapeDtypeStruct(x.shape, jnp.float16) for x in tpu_structs(problem)))
    assert (half.backend, half.source) == ("hybrid", "fallback"), half  # Pallas takes no float16: scan, and why
    assert half.reason.startswith("hybrid_pallas_tpu does not support"), half.reason
