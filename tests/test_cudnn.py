"""The cudnn backend without a GPU: its ring code (chunks, their kinds, merges, the lse correction) runs
with the XLA twin engine against float64 dense attention, its refusals name what cuDNN cannot express,
and the ring with cuDNN's real primitives lowers for CUDA to the custom calls cuDNN runs.

The float32 cases call the ring driver directly (cuDNN itself takes bfloat16 and float16 only, so the
public entry refuses float32): there the twin computes in float32 and the DESIGN tolerances apply. The
bfloat16 case goes through `ring_attention` and is held to twice dense bfloat16's error.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from cases import Case, check_low_precision, inner_jaxprs, rel_err
from tuner.kernels import BACKENDS, cudnn_engine, cudnn_pairs
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics import known, layouts
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec
from tuner.strategies import ring as ring_module
from tuner.strategies.ring import run_ring

B, T, H, HKV, D = 2, 128, 4, 2, 16
KERNEL = BACKENDS["cudnn"]


def ring_step(spec: AttentionSpec, ring: int, layout: str, chunk: int, *, interpret: bool = True,
              use_lse: bool = False):
    """The jitted value and gradients of `sum(out * w) (+ sum(lse * u))` of the cudnn ring under
    `shard_map` over `ring` devices, on arrays laid out in `layout`; the lse is asked for only with
    `use_lse` (else the aux's lse is None)."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def local(q, k, v):
        return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(chunk, chunk),
                        bwd_params=BwdParams(chunk, chunk), axis_name="sp", layout=layout, interpret=interpret,
                        return_lse=use_lse)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                            out_specs=(P(None, "sp"), P(None, None, "sp")) if use_lse else P(None, "sp"))

    def loss(q, k, v, w, u):
        out, lse = sharded(q, k, v) if use_lse else (sharded(q, k, v), None)
        value = jnp.sum(out.astype(jnp.float32) * w)
        return (value + jnp.sum(lse * u) if use_lse else value), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def reference(spec: AttentionSpec, q, k, v, w, u, use_lse: bool):
    with jax.enable_x64(True):
        def loss(q, k, v):
            out, lse = dense_attention(q, k, v, causal=spec.causal, sliding_window=spec.window,
                                       softmax_scale=spec.scale)
            value = jnp.sum(out * w)
            return (value + jnp.sum(lse * u) if use_lse else value), (out, lse)

        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


# (ring, layout, causal, window, chunks a shard, lse in the loss): the zigzag halves' FULL / DIAGONAL / SKIP
# pairs (past the first step, the pair each device chooses) with the lse's cotangent (its correction) and
# without the lse, a striped shard under a window (GENERAL pairs, where the window also crosses the
# diagonal), and no mask (one call a block).
CASES = [
    (4, "zigzag", True, None, 2, True),
    (4, "zigzag", True, None, 2, False),
    (2, "striped", True, 20, 2, False),
    (1, "contiguous", False, None, 1, True),
]


@pytest.mark.parametrize(("ring", "layout", "causal", "window", "parts", "use_lse"), CASES)
def test_the_ring_over_the_twin_engine_matches_float64(ring, layout, causal, window, parts, use_lse):
    window = (window, window) if isinstance(window, int) else window
    spec = AttentionSpec(scale=D ** -0.5, causal=causal, window=window)
    rng = np.random.default_rng(ring)
    q, k, v, w = (rng.standard_normal(s).astype(np.float32) for s in ((B, T, H, D), (B, T, HKV, D), (B, T, HKV, D),
                                                                        (B, T, H, D)))
    u = rng.standard_normal((B, H, T)).astype(np.float32)

    def lay(x, axis=1):
        return jnp.asarray(np.take(x, layouts.global_order(layout, x.shape[axis], ring), axis=axis))

    def back(x, axis=1):
        order = np.argsort(layouts.global_order(layout, x.shape[axis], ring))
        return np.take(np.asarray(x, np.float64), order, axis=axis)

    step = ring_step(spec, ring, layout, T // ring // parts, use_lse=use_lse)
    (_, (out, lse)), grads = step(lay(q), lay(k), lay(v), lay(w), lay(u, 2))
    want = reference(spec, q, k, v, w, u, use_lse)
    got = [back(out), None if lse is None else back(lse, 2), *(back(g) for g in grads)]
    for name, tol, g, r in zip(("out", "lse", "dq", "dk", "dv"), (1e-5, 1e-5, 1e-4, 1e-4, 1e-4), got, want):
        assert g is None or rel_err(g, r) <= tol, f"{name} error {rel_err(g, r):.2e}"


def test_bfloat16_through_ring_attention_within_twice_dense_error():
    check_low_precision(Case(batch=1, length=128, heads=4, kv_heads=2, head_dim=16, ring=2, layout="zigzag",
                             causal=True, backend="cudnn", dtype="bfloat16", fwd=FwdParams(32, 32),
                             bwd=BwdParams(32, 32)))


def test_zigzag_halves_are_full_diagonal_or_skipped_and_interleaved_striped_halves_are_general():
    spec = AttentionSpec(scale=1.0, causal=True)
    length, ring = 64, 4

    def kinds(layout: str, rank: int, source: int) -> list[int]:
        q_pos = layouts.local_positions(layout, length // ring, ring, rank)[None]
        kv_pos = layouts.local_positions(layout, length // ring, ring, source)[None]
        half = length // ring // 2
        return [int(cudnn_pairs.pair_kind(spec, q_pos[:, i * half:(i + 1) * half], kv_pos[:, j * half:(j + 1) * half]))
                for i in range(2) for j in range(2)]

    assert kinds("zigzag", 1, 1) == [cudnn_pairs.DIAGONAL, cudnn_pairs.SKIP, cudnn_pairs.FULL, cudnn_pairs.DIAGONAL]
    assert kinds("zigzag", 2, 0) == [cudnn_pairs.FULL, cudnn_pairs.SKIP, cudnn_pairs.FULL, cudnn_pairs.SKIP]
    assert kinds("zigzag", 0, 2) == [cudnn_pairs.SKIP, cudnn_pairs.SKIP, cudnn_pairs.FULL, cudnn_pairs.FULL]
    assert kinds("striped", 1, 2) == [cudnn_pairs.GENERAL, cudnn_pairs.SKIP, cudnn_pairs.FULL, cudnn_pairs.GENERAL]


def test_what_cudnn_cannot_express_is_refused_with_the_reason():
    spec = AttentionSpec(scale=1.0, causal=True)
    bf16 = jnp.bfloat16
    assert KERNEL.supports(spec, bf16, 128) is None
    assert KERNEL.supports(AttentionSpec(scale=1.0, causal=True, window=(64, 64)), bf16, 128) is None
    assert KERNEL.supports(spec, bf16, 192, 128) is None
    refused = {
        "segment ids": AttentionSpec(scale=1.0, causal=True, has_segments=True),
        "bias": AttentionSpec(scale=1.0, has_bias=True),
        "a soft cap": AttentionSpec(scale=1.0, softcap=30.0),
        "chunked attention": AttentionSpec(scale=1.0, causal=True, chunk_size=64),
        "a window that looks right": AttentionSpec(scale=1.0, window=(8, 8)),
    }
    for words, refused_spec in refused.items():
        assert KERNEL.supports(refused_spec, bf16, 128).startswith(words), words
    assert KERNEL.supports(spec, jnp.float32, 128).startswith("dtype float32")
    assert KERNEL.supports(spec, bf16, 12).startswith("head_dim 12")
    assert KERNEL.supports(spec, bf16, 128, 320).startswith("value_head_dim 320")


def test_without_the_private_names_or_on_another_jax_the_backend_says_why(monkeypatch):
    monkeypatch.setattr(cudnn_engine, "NAMES", (*cudnn_engine.NAMES, "_a_name_jax_never_had"))
    cudnn_engine.private_module.cache_clear()
    try:
        reason = KERNEL.unavailable_reason(platform="gpu")
        assert "lacks _a_name_jax_never_had" in reason and "0.10.0 to 0.12.0.1" in reason
        assert KERNEL.unavailable_reason(interpret=True) is None  # the twin needs none of it
        monkeypatch.setattr(jax, "__version__", "0.13.0")
        cudnn_engine.private_module.cache_clear()
        assert "jax 0.13.0: the cudnn kernel binds" in KERNEL.unavailable_reason(platform="gpu")
    finally:
        monkeypatch.undo()
        cudnn_engine.private_module.cache_clear()
    assert cudnn_engine.private_module()[1] is None


def _custom_calls(text: str) -> list[tuple[str, list[str], dict]]:
    """(target, operand types, cuDNN backend config) of each cuDNN custom call in StableHLO `text`."""
    calls = []
    pattern = r'custom_call @(__cudnn\$\w+)\(.*?backend_config = "(.*?)".*?: \((.*?)\) ->'
    for target, config, types in re.findall(pattern, text):
        decoded = re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), config)
        calls.append((target, re.findall(r"tensor<[^>]*>", types), json.loads(decoded)["cudnn_fmha_backend_config"]))
    return calls


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 100)])
def test_the_ring_lowers_for_cuda_to_cudnn_s_custom_calls(causal, window):
    ring, length = 4, 1024
    local = length // ring
    spec = AttentionSpec(scale=0.125, causal=causal, window=None if window is None else (window, window))
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def attention(q, k, v):
        return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(local // 2, local // 2),
                        bwd_params=BwdParams(local // 2, local // 2), axis_name="sp", layout="zigzag")

    sharded = jax.shard_map(attention, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, length, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, length, 2, 128), jnp.bfloat16)
    forward = jax.jit(sharded).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    both = jax.jit(jax.grad(lambda q, k, v: sharded(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))).trace(
        q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()

    # past the first step, the zigzag halves that run are prefixes of the queries (halves swapped) and keys,
    # one call under a padding mask whose lengths follow q, k and v; under a window, pairs of halves
    masked = ["NO_MASK"] if not causal else ["CAUSAL", "PADDING"] if window is None else ["CAUSAL", "NO_MASK"]
    calls = _custom_calls(forward)
    assert {t for t, _, _ in calls} == {"__cudnn$fmhaSoftmax"}
    assert sorted({c["mask_type"] for _, _, c in calls}) == sorted(masked)

    def rows(config) -> int:
        """A call's query (and key) rows: the shard without a mask, on the diagonal step (its own keys,
        rising positions: causal in cuDNN's index order) without a window, and under a padding mask; else a
        half (the zigzag chunks)."""
        return 256 if not causal or (window is None and config["mask_type"] != "NO_MASK") else 128

    for _, types, config in calls:
        n = rows(config)
        lengths = ["tensor<1xi32>"] * 2 if config["mask_type"] == "PADDING" else []
        assert types == [f"tensor<1x{n}x4x128xbf16>", f"tensor<1x{n}x2x128xbf16>", f"tensor<1x{n}x2x128xbf16>",
                         *lengths] if causal else types[0] == "tensor<1x256x4x128xbf16>", types
        assert config["fmha_scale"] == 0.125
        expected_window = window + 1 if (window is not None and config["mask_type"] == "CAUSAL") else 0
        assert config["sliding_window_length"] == expected_window, config

    backward = [c for c in _custom_calls(both) if c[0] == "__cudnn$fmhaSoftmaxBackward"]
    assert backward and sorted({c["mask_type"] for _, _, c in backward}) == sorted(masked)
    for _, types, config in backward:  # q, k, v, the softmax statistics (float32 lse), do, o
        assert types[3] == f"tensor<1x4x{rows(config)}xf32>", types
        assert types[4] == types[5] == f"tensor<1x{rows(config)}x4x128xbf16>", types


def _branches(jaxpr) -> list[int]:
    """The branch count of every `cond` in `jaxpr` and the jaxprs inside it, the branches of a chunk pair's
    4-way `switch` left unread (its scan kernel has branches of its own)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append(len(eqn.params["branches"]))
            if found[-1] == 4:
                continue
        for inner in inner_jaxprs(eqn):
            found += _branches(inner)
    return found


@pytest.mark.parametrize("ring", [1, 4])
def test_the_first_step_s_block_is_the_running_state_without_a_merge(ring, monkeypatch):
    """Lowered for CUDA: each merge of a block into the running state is a pass over the output (`merge`'s
    exponentials and its log1p). The first step's block is the state as it comes (`MergedBlocks` starts
    fresh), so on one device the forward is cuDNN's call and no merge, and a ring of 4 merges its steps
    past the first: the loop's two (on a GPU the loop runs two steps a turn) and the last's."""
    monkeypatch.setattr(ring_module, "compile_target", lambda: ("gpu", "NVIDIA H100"))
    spec = AttentionSpec(scale=0.125)
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def local(q, k, v):
        return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(64, 64),
                        bwd_params=BwdParams(64, 64), axis_name="sp", layout="contiguous")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    q = jax.ShapeDtypeStruct((1, 256 * ring, 4, 64), jnp.bfloat16)
    text = jax.jit(sharded).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert [target for target, _, _ in _custom_calls(text)] == ["__cudnn$fmhaSoftmax"] * (1 if ring == 1 else 4)
    assert text.count("stablehlo.log_plus_one") == (0 if ring == 1 else 3)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("window", [None, 5])
def test_the_kinds_the_trace_knows_are_those_every_device_finds(layout, window):
    """For each group of ring steps the driver traces as one (step 0, the loop's, the last), a chunk pair whose
    kind the trace knows has that kind on every device at every step of the group, by `pair_kind` on its
    positions. Where the trace says that one of the undecided pairs runs (`plan`), exactly one does on every
    device, of that kind, and `chosen_offsets` finds it there."""
    spec = AttentionSpec(scale=1.0, causal=True, window=None if window is None else (window, 0))
    local, chunk, decided, chosen = 16, 8, 0, 0

    def positions(ring: int, rank: int):
        return jnp.asarray(layouts.local_positions_np(layout, local, ring, rank)[None], jnp.int32)

    def found(ring: int, rank: int, source: int, i: int, j: int) -> int:
        q_pos, kv_pos = positions(ring, rank)[:, i:i + chunk], positions(ring, source)[:, j:j + chunk]
        return int(cudnn_pairs.pair_kind(spec, q_pos, kv_pos))

    for ring in (1, 2, 4):
        for steps in (range(1), range(1, ring - 1), range(ring - 1, ring)):
            block = known.ring_block(layout, local, local, ring, steps)
            pairs = [(i, j) for i in range(0, local, chunk) for j in range(0, local, chunk)] if block else []
            cases = [(rank, (rank - step) % ring) for rank in range(ring) for step in steps]
            for i, j in pairs:
                kind = cudnn_pairs.known_kind(spec, block.chunk(i, chunk, j, chunk))
                decided += kind is not None
                every = {found(ring, rank, source, i, j) for rank, source in cases}
                assert kind is None or every == {kind}, (ring, steps, i, j, kind, every)
            _, candidates, one = cudnn_pairs.plan(spec, block, local, local, chunk, chunk) if block else (0, [], None)
            chosen += one is not None
            for rank, source in cases if one is not None else ():
                runs = [(i * chunk, j * chunk) for i, j in candidates
                        if found(ring, rank, source, i * chunk, j * chunk) != cudnn_pairs.SKIP]
                assert len(runs) == 1 and found(ring, rank, source, *runs[0]) == one, (ring, rank, source, runs)
                offsets = cudnn_pairs.chosen_offsets(spec, candidates, chunk, chunk, positions(ring, rank),
                                                     positions(ring, source))
                assert tuple(int(x) for x in offsets) == runs[0], (ring, rank, source, offsets, runs)
    assert decided >= 12  # at least the diagonal steps' four pairs on each ring
    assert chosen >= (3 if layout == "zigzag" and window is None else 0)  # zigzag: the steps past the first


def test_a_ring_on_its_layout_s_positions_branches_only_where_devices_differ(monkeypatch):
    """Traced for a GPU: on one device the causal block is one cuDNN call with no branch (the backward has the
    lse correction's only where the caller asks for the lse). On a zigzag ring of 4, no branch either way: at
    each step past the first, of the two pairs that differ between devices exactly one is FULL, and the
    device runs that one, read at its offsets. Passed positions, the same values, are decided on the
    device: every step in a branch, every pair in a `switch`."""
    monkeypatch.setattr(ring_module, "compile_target", lambda: ("gpu", "NVIDIA H100"))
    spec = AttentionSpec(scale=0.125, causal=True)
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)

    def single(q, k, v, interpret=True, return_lse=False):
        return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(64, 64),
                        bwd_params=BwdParams(64, 64), axis_name=None, layout="zigzag", interpret=interpret,
                        return_lse=return_lse)

    def loss(fn, read_lse=False):
        def total(q, k, v):
            if not read_lse:
                return fn(q, k, v).astype(jnp.float32).sum()
            out, lse = fn(q, k, v, return_lse=True)
            return out.astype(jnp.float32).sum() + lse.sum()
        return total

    def grad_branches(read_lse):
        return _branches(jax.make_jaxpr(jax.grad(loss(single, read_lse), argnums=(0, 1, 2)))(q, q, q).jaxpr)

    assert _branches(jax.make_jaxpr(single)(q, q, q).jaxpr) == []
    assert grad_branches(read_lse=False) == [] and grad_branches(read_lse=True) == [2]
    # with cuDNN's primitives, lowered for CUDA: one causal call over the whole shard each way, and the lse
    # correction's backward (in its branch) only where the lse is asked for
    on_gpu = functools.partial(single, interpret=False)
    for read_lse, backward_calls in ((False, 1), (True, 2)):
        both = jax.jit(jax.value_and_grad(loss(on_gpu, read_lse), argnums=(0, 1, 2))).trace(q, q, q).lower(
            lowering_platforms=("cuda",)).as_text()
        calls = [(target, types[0], config["mask_type"]) for target, types, config in _custom_calls(both)]
        assert sorted(calls) == [("__cudnn$fmhaSoftmax", "tensor<1x256x4x64xbf16>", "CAUSAL")] + [
            ("__cudnn$fmhaSoftmaxBackward", "tensor<1x256x4x64xbf16>", "CAUSAL")] * backward_calls, calls

    ring = 4
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))

    def sharded(passed: bool):
        def local(q, k, v):
            pos = layouts.local_positions("zigzag", q.shape[1], ring, jax.lax.axis_index("sp"))[None]
            return run_ring(q, k, v, spec=spec, backend="cudnn", fwd_params=FwdParams(32, 32),
                            bwd_params=BwdParams(32, 32), axis_name="sp", layout="zigzag", interpret=True,
                            q_positions=pos if passed else None, kv_positions=pos if passed else None)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))

    def grad(fn):
        return jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))

    assert _branches(jax.make_jaxpr(sharded(False))(q, q, q).jaxpr) == []
    assert _branches(jax.make_jaxpr(grad(sharded(False)))(q, q, q).jaxpr) == []
    passed = _branches(jax.make_jaxpr(sharded(True))(q, q, q).jaxpr)
    # a branch a traced step (the first, the loop's two: a GPU loop runs two a turn, the last), four pairs in each
    assert passed.count(2) == 4 and passed.count(4) == 4 * 4
