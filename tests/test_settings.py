"""The library under the JAX settings real codebases turn on (`docs/settings.md`).

Each setting runs the loader on global arrays over a mesh of 4 devices (`mesh=`), forward outside any
trace and forward and gradients under `jax.jit`, against the float64 dense reference at DESIGN section 10's
float32 tolerances (bfloat16: 2e-2 forward, 4e-2 gradients). The problem: grouped-query heads and a causal
sliding window, in the zigzag layout under every setting, with packed documents (segment ids) under x64 and
bfloat16 and without under the restricting settings and explicit sharding (there the trace decides from the
positions it knows which ring steps run: under explicit sharding that failed until 2026-11-30), and in the documents
layout (its plan, permutations and per-row tile: three rings compiled, 20 s a case) under x64, explicit
sharding and the restricting settings (rank promotion `raise` among them: the three that broke it before
issue 56; strict dtype promotion broke it until 2026-11-30).

The six settings that only restrict run at once, one case per layout: rank promotion `raise`, strict dtype
promotion, NaN checks, tracer-leak checks and the transfer guard `disallow` each raise where the library
does what they forbid, and matmul precision `highest` changes no float32 product on the CPU. None changes
what is traced otherwise (the library reads none of them), so a call that passes under all six passes under
each; a failure there names the check that raised. x64 and explicit sharding change what is traced (the
integer types; the mesh's axis types), bfloat16 the inputs: each runs on its own.

The Triton kernels (their interpreter, on one row) run under x64, and the cudnn kernel (its XLA twin,
bfloat16, no segment ids: cuDNN takes none) under x64, rank promotion `raise` and strict dtype promotion,
each through the loader with forward and gradients from one jitted program; the Pallas TPU kernels
(interpret mode, through `ring_attention` under `shard_map`) under x64, and the hybrid, all-to-all and
all-gather over them under x64, rank promotion `raise` and NaN checks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from cases import Case, check_case, check_exchanged, rel_err
from tuner import BwdParams, FwdParams, get_tuned_ring_attention
from tuner.strategies.configs import TileConfig
from tuner.semantics.reference import dense_attention

RING, B, T, H, HKV, D = 4, 2, 256, 4, 2, 16
WINDOW = (96, 0)


@dataclass(frozen=True)
class Setting:
    """A JAX setting: the context it runs under, the mesh's axis type, the inputs' dtype."""

    context: Callable[[jax.sharding.Mesh], contextlib.AbstractContextManager]
    axis_type: AxisType = AxisType.Auto
    dtype: str = "float32"


SETTINGS = {
    "x64": Setting(lambda mesh: jax.enable_x64(True)),
    "rank_promotion_raise": Setting(lambda mesh: jax.numpy_rank_promotion("raise")),
    "dtype_promotion_strict": Setting(lambda mesh: jax.numpy_dtype_promotion("strict")),
    "explicit_sharding": Setting(jax.set_mesh, AxisType.Explicit),
    "debug_nans": Setting(lambda mesh: jax.debug_nans(True)),
    "tracer_leaks": Setting(lambda mesh: jax.checking_leaks()),
    "matmul_precision_highest": Setting(lambda mesh: jax.default_matmul_precision("highest")),
    "transfer_guard_disallow": Setting(lambda mesh: jax.transfer_guard("disallow")),
    "bfloat16_sharded": Setting(lambda mesh: contextlib.nullcontext(), dtype="bfloat16"),
}
RESTRICTIONS = ("rank_promotion_raise", "dtype_promotion_strict", "debug_nans", "tracer_leaks",
                "matmul_precision_highest", "transfer_guard_disallow")  # run at once (module docstring)
ON_THEIR_OWN = ("x64", "explicit_sharding", "bfloat16_sharded")
# (setting, layout, packed): unpacked, the trace decides which ring steps run from the positions it knows
# (`tuner.semantics.known`), which failed under explicit sharding until 2026-11-30; packed, the device does
CASES = [("restrictions", "zigzag", False), ("x64", "zigzag", True), ("explicit_sharding", "zigzag", False),
         ("bfloat16_sharded", "zigzag", True)] + [
    (name, "documents", True) for name in ("restrictions", "x64", "explicit_sharding")]


def together(*names: str) -> Setting:
    """The settings `names` (over auto axes, float32 inputs) turned on at once."""
    def context(mesh):
        stack = contextlib.ExitStack()
        for name in names:
            stack.enter_context(SETTINGS[name].context(mesh))
        return stack

    return Setting(context)


def segment_ids(rng: np.random.Generator) -> np.ndarray:
    """`[B, T]` packed rows: documents of random lengths, one id each, in order."""
    rows = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), 4, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(T), side="right"))
    return np.asarray(rows, np.int32)


@functools.cache
def problem(dtype: str, packed: bool) -> tuple[list[np.ndarray], np.ndarray | None, list[np.ndarray]]:
    """q, k, v (rounded to `dtype`: what the ring gets) and the loss weights, NumPy float32; the segment ids
    where `packed`; and the float64 reference. The same for every setting: computed once per dtype."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in
              ((B, T, H, D), (B, T, HKV, D), (B, T, HKV, D), (B, T, H, D))]
    arrays[:3] = [np.asarray(jnp.asarray(x, dtype), np.float32) for x in arrays[:3]]
    segments = segment_ids(rng) if packed else None
    return arrays, segments, reference(*arrays, segments)


def reference(q, k, v, w, segments=None):
    """The float64 dense output and gradients of `sum(out * w)`, NumPy."""
    with jax.enable_x64(True):
        def loss(q, k, v):
            out, _ = dense_attention(q, k, v, causal=True, sliding_window=WINDOW, q_segment_ids=segments,
                                     kv_segment_ids=segments)
            return jnp.sum(out * w), out

        as64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, w)]
        w = as64[3]
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*as64[:3])
        return [np.asarray(x, np.float64) for x in (out, *grads)]


def check_loader(setting: Setting, layout: str, *, backend: str = "auto", dtype: str | None = None,
                 packed: bool = True, rows: int = B, eager_forward: bool = True) -> None:
    """The loader under `setting` against float64: the output and gradients of one jitted program and, with
    `eager_forward`, the output of a call outside any trace; on the batch's first `rows` rows (each row's
    output and gradients are its own: the reference's rows are those of the smaller batch)."""
    mesh = jax.make_mesh((RING,), ("sp",), axis_types=(setting.axis_type,), devices=jax.devices()[:RING])
    dtype = jnp.dtype(dtype or setting.dtype)
    arrays, segments, want = problem(dtype.name, packed)
    arrays, want = [x[:rows] for x in arrays], [x[:rows] for x in want]

    sharding = NamedSharding(mesh, P(None, "sp"))
    q, k, v = (jax.device_put(jnp.asarray(x, dtype), sharding) for x in arrays[:3])
    w = jax.device_put(arrays[3], sharding)
    ids = None if segments is None else jax.device_put(segments[:rows], sharding)
    per_call = {"q_segment_ids": ids, "kv_segment_ids": ids} if packed else {}
    interpret = {"interpret": True} if backend != "auto" else {}

    with setting.context(mesh):
        attn = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, sliding_window=WINDOW,
                                        layout=layout, backend=backend)
        outs = [attn(q, k, v, **per_call, **interpret)] if eager_forward else []

        # arrays go in as arguments: jax 0.12 makes an array a jitted function closes over a constant of
        # its program, fetched to the host, which transfer_guard("disallow") refuses
        def loss(q, k, v, w, per_call):
            out = attn(q, k, v, **per_call, **interpret)
            return jnp.sum(out.astype(jnp.float32) * w), out

        (_, traced), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, w, per_call)
        outs.append(traced)
        jax.block_until_ready((outs, grads))

    assert all(g.dtype == dtype and tuple(g.sharding.spec)[:2] == (None, "sp") for g in (*outs, *grads))
    fwd_tol, grad_tol = (1e-5, 1e-4) if dtype == jnp.float32 else (2e-2, 4e-2)
    as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    for out in outs:
        assert rel_err(as64(out), want[0]) <= fwd_tol, f"forward error {rel_err(as64(out), want[0]):.2e}"
    for grad, g, r in zip(("dq", "dk", "dv"), grads, want[1:]):
        assert rel_err(as64(g), r) <= grad_tol, f"{grad} error {rel_err(as64(g), r):.2e}"


@pytest.mark.parametrize(("name", "layout", "packed"), CASES,
                         ids=[f"{n}-{layout}{'' if packed else '-unpacked'}" for n, layout, packed in CASES])
def test_the_loader_under_the_setting_matches_float64(name, layout, packed, tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    check_loader(together(*RESTRICTIONS) if name == "restrictions" else SETTINGS[name], layout, packed=packed)


def test_under_explicit_sharding_arrays_placed_otherwise_are_resharded_to_the_sequence_axis(tmp_path, monkeypatch):
    """An explicit-sharding mesh: `shard_map` takes only arrays sharded as its specs say (over auto axes it
    reshards them itself). q, k, v, segment ids and positions all replicated run, match float64, and the
    output comes back sharded over the sequence."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    mesh = jax.make_mesh((RING,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:RING])
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, T, h, D)).astype(np.float32) for h in (H, HKV, HKV))
    ids = dict(q_segment_ids=segment_ids(rng)[:1], q_positions=np.arange(T, dtype=np.int32)[None])
    ids.update(kv_segment_ids=ids["q_segment_ids"], kv_positions=ids["q_positions"])
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh):
        attn = get_tuned_ring_attention(axis_name="sp", mesh=mesh, causal=True, sliding_window=WINDOW)
        out = jax.jit(attn)(*(jax.device_put(x, replicated) for x in (q, k, v)),
                            **{n: jax.device_put(x, replicated) for n, x in ids.items()})
    assert tuple(out.sharding.spec)[:2] == (None, "sp")
    with jax.enable_x64(True):  # under one `jax.jit`: op by op, each operation compiled a program of its own
        want, _ = jax.jit(lambda *qkv, **ids: dense_attention(*qkv, causal=True, sliding_window=WINDOW, **ids))(
            *(np.asarray(x, np.float64) for x in (q, k, v)), **ids)
    assert rel_err(np.asarray(out, np.float64), np.asarray(want)) <= 1e-5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="the Triton interpreter needs triton and torch (pip install -e '.[test]')")
def test_the_triton_kernels_under_x64_in_their_interpreter(tmp_path, monkeypatch):
    """Forward and gradients from one program, on one row: the interpreter runs every program of its grid in
    Python, a forward of its own and a second row each ran it again; the loader's path outside a trace is
    the zigzag cases' above (a zigzag call runs the same ring, `_traced`, in and out of a trace)."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    check_loader(SETTINGS["x64"], "zigzag", backend="triton", rows=1, eager_forward=False)


@pytest.mark.parametrize("names", [("x64",), ("rank_promotion_raise", "dtype_promotion_strict")],
                         ids=["x64", "rank_promotion_raise+dtype_promotion_strict"])
def test_the_cudnn_kernel_under_the_setting_with_its_xla_twin(names, tmp_path, monkeypatch):
    """One program a case, forward and gradients (a forward of its own, outside a trace, compiled the same
    kernel again): the promotion settings share one."""
    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    check_loader(together(*names), "zigzag", backend="cudnn", dtype="bfloat16", packed=False, eager_forward=False)


def test_the_pallas_tpu_kernels_under_x64_in_interpret_mode():
    case = Case(batch=1, length=128, heads=4, kv_heads=2, head_dim=16, ring=2, layout="zigzag", causal=True,
                window=48, backend="pallas_tpu", fwd=FwdParams(16, 64), bwd=BwdParams(16, 64, 16, 64))
    with jax.enable_x64(True):
        check_case(case)


@pytest.mark.parametrize("name, implementation, a2a", [
    ("x64", "hybrid_pallas_tpu", 2), ("rank_promotion_raise", "all_to_all_pallas_tpu", 1),
    ("debug_nans", "all_gather_pallas_tpu", 1)])
def test_the_exchanges_over_pallas_under_the_setting_in_interpret_mode(name, implementation, a2a):
    """Each exchange over the Pallas kernels (interpret mode, under the caller's `shard_map`; the hybrid on
    a 2x2 mesh) with packed documents, GQA and a causal window, against float64."""
    case = Case(batch=1, length=64, heads=4, kv_heads=2, head_dim=8, ring=2, layout="zigzag", causal=True,
                window=(20, 0), segments="packed")
    with SETTINGS[name].context(None):  # these settings take no mesh
        check_exchanged(implementation, case, TileConfig(FwdParams(16, 128), BwdParams(16, 128, 16, 128)), a2a,
                        interpret=True)
