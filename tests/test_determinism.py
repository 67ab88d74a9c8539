"""Deterministic results on the CPU: two runs give bitwise-identical outputs and gradients (issue 56).

Every registered implementation runs twice on the same inputs, and the two runs must agree bit for bit:
the output, and dq, dk, dv of a weighted loss (with lse where the helper returns it). Each case is causal,
with grouped-query heads and packed documents (segment ids, some rows reading no key).

- The kernel backends (`scan`; `triton` and `pallas_tpu` in their interpreters) run through
  `tests.cases.run_ring`: the function is built from scratch for each run, and `jax.clear_caches()`
  between the runs makes the second one trace and compile again. A ring of 4 for scan, of 2 for the
  slow interpreters; pallas_tpu in bfloat16.
- The exchanging implementations (`all_to_all` in bfloat16, `all_gather`, `hybrid` on a 2x2 mesh,
  `dense`; all-to-all, all-gather and the hybrid over the other kernels, in their interpreters) run the
  same compiled function twice (`tests.cases.exchanged_step`).
- The loader (`get_tuned_ring_attention(mesh=...)` on global arrays, from an empty cache): one loader
  run twice, and a second loader built and compiled anew, with the same plan (`explain()`); `jax_nn`
  (which returns no lse) through the loader, run twice.

`run_ring` gives its results in token order as float64: a permutation and an exact widening, so equal
bits there mean equal bits in the raw arrays. The other helpers give the raw arrays.
`docs/determinism.md` says what this covers and what holds on a GPU or a TPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.cases import Case, exchanged_step, laid_out_args, make_arrays, run_ring
from tuner import BwdParams, FwdParams, get_tuned_ring_attention, registry
from tuner.strategies.configs import NoConfig, TileConfig

NO_TRITON = importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None

# Causal, grouped-query heads (4 query heads, 2 kv heads), packed documents; zigzag over the ring.
BASE = Case(batch=1, length=64, heads=4, kv_heads=2, head_dim=16, ring=4, layout="zigzag", causal=True,
            segments="packed")
TILES = TileConfig(FwdParams(16, 16), BwdParams(16, 16))  # several tiles a shard

KERNEL_CASES = [
    pytest.param(dataclasses.replace(BASE, length=128, fwd=FwdParams(16, 16), bwd=BwdParams(16, 16)),
                 id="scan-ring4-f32"),
    pytest.param(dataclasses.replace(BASE, backend="triton", ring=2, heads=2, kv_heads=1, fwd=FwdParams(16, 16),
                                     bwd=BwdParams(16, 16, 16, 16)),
                 id="triton-ring2-f32",
                 marks=pytest.mark.skipif(NO_TRITON, reason="needs triton and torch (pip install -e '.[test]')")),
    pytest.param(dataclasses.replace(BASE, backend="pallas_tpu", ring=2, heads=2, kv_heads=1, dtype="bfloat16",
                                     fwd=FwdParams(16, 32),
                                     bwd=BwdParams(16, 32, 16, 32)),
                 id="pallas_tpu-ring2-bf16"),
    pytest.param(dataclasses.replace(BASE, backend="cudnn", segments=None, dtype="bfloat16", fwd=FwdParams(8, 8),
                                     bwd=BwdParams(8, 8)),
                 id="cudnn-twin-ring4-bf16"),
]

SMALL = dataclasses.replace(BASE, ring=2, heads=2, kv_heads=1)  # for the interpreters
INTERPRETED = {  # the exchanges over the other kernels, in their interpreters (cuDNN: its XLA twin, bf16)
    "pallas_tpu": (SMALL, TileConfig(FwdParams(16, 64), BwdParams(16, 64, 16, 64)), []),
    "triton": (SMALL, TileConfig(FwdParams(16, 16), BwdParams(16, 16, 16, 16)),
               [pytest.mark.skipif(NO_TRITON, reason="needs triton and torch (pip install -e '.[test]')")]),
    "cudnn": (dataclasses.replace(SMALL, segments=None, dtype="bfloat16"),
              TileConfig(FwdParams(16, 16), BwdParams(16, 16)), []),  # chunks of the zigzag halves
}
EXCHANGES = {"all_to_all": 1, "all_gather": 1, "hybrid": 2}  # over the other kernels: strategy, all-to-all group
EXCHANGED_CASES = [  # (implementation, case, config, all-to-all group, interpreted)
    pytest.param("all_to_all", dataclasses.replace(BASE, dtype="bfloat16"), TILES, 1, False,
                 id="all_to_all-ring4-bf16"),
    pytest.param("all_gather", BASE, TILES, 1, False, id="all_gather-ring4-f32"),
    pytest.param("hybrid", dataclasses.replace(BASE, ring=2), TILES, 2, False, id="hybrid-2x2-f32"),
    pytest.param("dense", BASE, NoConfig(), 1, False, id="dense-ring4-f32"),
] + [pytest.param(f"{strategy}_{kernel}", case, config, a2a, True, marks=marks, id=f"{strategy}_{kernel}-interpreted")
     for strategy, a2a in EXCHANGES.items() for kernel, (case, config, marks) in INTERPRETED.items()]

LOADER_BACKENDS = [("auto", True), ("jax_nn", False)]  # (backend, whether a second loader compiles again)

COVERED = {"scan", "triton", "pallas_tpu", "cudnn", "all_to_all", "all_gather", "hybrid", "dense", "jax_nn",
           *(f"{strategy}_{kernel}" for strategy in EXCHANGES for kernel in INTERPRETED)}


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache of this test's own: no tuned row changes the tiles between runs."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path / "tuner-home"))
    for name in ("TUNER_DB", "TUNER_RECORD"):
        monkeypatch.delenv(name, raising=False)


def assert_identical(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> None:
    """The two runs' arrays are bitwise identical, free of NaN, and not all zero."""
    assert first.keys() == second.keys()
    for name in first:
        a, b = np.asarray(first[name]), np.asarray(second[name])
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert not np.isnan(a.astype(np.float64)).any() and not np.isnan(b.astype(np.float64)).any(), \
            f"{name} has NaN"
        assert np.any(a != 0), f"{name} is all zero: nothing to compare"
        if not np.array_equal(a, b):
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            pytest.fail(f"{name}: {np.count_nonzero(diff)} of {a.size} values differ between the runs "
                        f"(largest difference {diff.max():.3g})")
        assert a.tobytes() == b.tobytes(), f"{name}: equal values but other bits (the sign of a zero)"


def ring_results(case: Case) -> dict[str, np.ndarray]:
    """One run of `run_ring` (built from scratch): out, lse, dq, dk, dv."""
    out, lse, (dq, dk, dv, _, _) = run_ring(case, make_arrays(case))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_a_kernel_backend_built_twice_gives_the_same_bits(case):
    first = ring_results(case)
    jax.clear_caches()  # the second run traces and compiles again
    second = ring_results(case)
    assert_identical(first, second)


@pytest.mark.parametrize("name, case, config, a2a, interpret", EXCHANGED_CASES)
def test_an_exchanging_implementation_run_twice_gives_the_same_bits(name, case, config, a2a, interpret):
    step = exchanged_step(name, case, config, a2a, interpret)
    # on the host: a device array's cast, and its placement on the mesh, each compile a program per shape
    args = [None if x is None else np.asarray(x) for x in laid_out_args(case, make_arrays(case))]
    args[:3] = [x.astype(jnp.dtype(case.dtype)) for x in args[:3]]

    def run():
        (_, (out, lse)), (dq, dk, dv, _) = step(*args)
        return {key: np.asarray(x) for key, x in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items()}

    first = run()
    assert first["out"].dtype == jnp.dtype(case.dtype)
    assert_identical(first, run())


def global_arrays():
    """q, k, v (GQA), packed documents and the loss weights, global and in token order."""
    rng = np.random.default_rng(0)
    b, t, h, hkv, d = 1, 64, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32) for _ in range(2))
    documents = jnp.asarray(np.repeat([[0, 1, 1, 2]], t // 4, axis=1), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    return q, k, v, documents, weights


def loader_step(mesh: Mesh, backend: str):
    """A new loader on `mesh` and the jitted value and gradient of a weighted loss of its output."""
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, backend=backend)

    def loss(q, k, v, documents, weights):
        out = attn(q, k, v, q_segment_ids=documents, kv_segment_ids=documents)
        return jnp.vdot(out, weights), out

    return attn, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("backend, rebuild", LOADER_BACKENDS, ids=[b for b, _ in LOADER_BACKENDS])
def test_the_loader_called_twice_gives_the_same_bits(backend, rebuild):
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q, k, v, documents, weights = global_arrays()

    def run(step):
        (_, out), (dq, dk, dv) = step(q, k, v, documents, weights)
        return {key: np.asarray(x) for key, x in dict(out=out, dq=dq, dk=dk, dv=dv).items()}

    attn, step = loader_step(mesh, backend)
    first = run(step)
    assert_identical(first, run(step))  # the same compiled function, run again
    if rebuild:
        again, new_step = loader_step(mesh, backend)
        assert_identical(first, run(new_step))  # a new loader, traced and compiled again
        plans = [a.explain(q, k, v, q_segment_ids=documents, kv_segment_ids=documents) for a in (attn, again)]
        assert plans[0] == plans[1] and plans[0].source == "default", plans


def test_every_registered_implementation_is_covered():
    """A newly registered implementation needs a case here."""
    assert set(registry.names()) <= COVERED, set(registry.names()) - COVERED
