"""The strategy model: its bytes per collective kind are what the compiled programs of the ring, all_to_all
and all_gather move on 8 simulated devices (read by `hlo.collective_bytes`, itself checked on a
hand-written module with async pairs, tuples, loops and branches); its causal work is what the scan ring
computes tile by tile; what cannot run says why; its rankings follow from first principles; rates can be
overridden; bad inputs are refused by name."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tuner.kernels.params import FwdParams
from tuner.models import hlo, platforms, strategy_model
from tuner.semantics import documents, layouts
from tuner.runtime import plan
from tuner import registry, ring_attention
from tuner.strategies.all_to_all import kv_repeats
from tuner.semantics.problem import Problem
from tuner.models.platforms import PLATFORMS, Platform
from tuner.models.strategy_model import STRATEGIES, explain, predict, rank
from tuner.models.tpu_model import CHIPS
from tuner.support.work import count_work

MODULE = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp-start = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1}}
  %cp-done = f32[4,8]{1,0} collective-permute-done(%cp-start), metadata={op_name="a/all-gather(x)"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %cp-done)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%wrapped_rs (a: bf16[16,8]) -> bf16[2,8] {
  %a = bf16[16,8]{1,0} parameter(0)
  ROOT %rs = bf16[2,8]{1,0} reduce-scatter(%a), dimensions={0}, to_apply=%add
}

%branch (b: f32[3]) -> f32[3] {
  %b = f32[3]{0} parameter(0)
  ROOT %cp = f32[3]{0} collective-permute(%b), source_target_pairs={{0,1}}
}

ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %ag-start = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%x), dimensions={0}
  %ag-done = f32[32,8]{1,0:T(8,128)} all-gather-done(%ag-start)
  %rs-start = ((bf16[16,8]{1,0}), bf16[2,8]{1,0}) async-start(%y), calls=%wrapped_rs
  %rs-done = bf16[2,8]{1,0} async-done(%rs-start), calls=%wrapped_rs
  %a2a = (f32[1,8]{1,0}, /*index=1*/f32[1,8]{1,0}, s32[1,2]{1,0}) all-to-all(%u, %v, %w), dimensions={0}
  %w = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %if = f32[3]{0} conditional(%pr, %z, %z), branch_computations={%branch, %branch}
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""


def test_collective_bytes_reads_results_once_per_execution():
    assert hlo.collective_bytes(MODULE) == {
        "collective-permute": 5 * 4 * 8 * 4 + 2 * 3 * 4,  # 5 loop trips; each branch once
        "all-to-all": 2 * 8 * 4 + 2 * 4,  # a tuple result, summed
        "all-gather": 32 * 8 * 4,  # the done's result, not the start's tuple
        "reduce-scatter": 2 * 8 * 2,  # the async-wrapped op, once: async-done names the same computation
    }
    without_trip_count = MODULE.replace(', backend_config={"known_trip_count":{"n":"5"}}', "")
    with pytest.raises(ValueError, match="cannot read the trip count of this loop"):  # not counted once: refused
        hlo.collective_bytes(without_trip_count)
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.collective_bytes("%f (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}\n")


# float32: XLA:CPU widens bf16 collectives to float32, so a bf16 program's bytes there are not a GPU's or TPU's
PROBLEM = Problem(batch=1, seq_len=256, heads=8, kv_heads=2, head_dim=16, dtype="float32", causal=True,
                  ring_size=8, layout="zigzag")


def compiled_bytes(strategy: str, backward: bool, p: Problem = PROBLEM) -> dict[str, int]:
    """`hlo.collective_bytes` of `strategy` on `p`'s shards under `shard_map` over 8 CPU devices: the
    forward, or the value and gradient of a weighted sum of the output (a training step: the output is
    used, and dout is not a constant)."""
    mesh = Mesh(np.array(jax.devices()[:p.ring_size]), ("sp",))
    seq = P(None, "sp")
    mask = dict(causal=True, sliding_window=None, chunk_size=None, logits_soft_cap=None, softmax_scale=None)

    def local(q, k, v):
        if strategy == "ring":
            return ring_attention(q, k, v, causal=True, axis_name="sp", layout=p.layout, backend="scan")
        impl = registry.get(strategy)
        resolved = plan.resolve(q, k, v, ring_size=p.ring_size, layout=p.layout, backend=strategy,
                                target=registry.Target.here(), mask=mask, arrays={})
        shapes = registry.tile_shapes(impl, resolved.shapes, p.ring_size)
        return impl.attend(q, k, v, spec=resolved.spec, config=impl.default_config(shapes, resolved.spec),
                           axis_name="sp", layout=p.layout)

    attend = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    sharding = NamedSharding(mesh, seq)
    q = jax.ShapeDtypeStruct((p.batch, p.seq_len, p.heads, p.head_dim), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((p.batch, p.seq_len, p.kv_heads, p.head_dim), jnp.float32, sharding=sharding)
    if backward:
        program = jax.jit(jax.value_and_grad(lambda q, k, v, w: jnp.vdot(attend(q, k, v), w), argnums=(0, 1, 2)))
        lowered = program.lower(q, kv, kv, q)
    else:
        lowered = jax.jit(attend).lower(q, kv, kv)
    return hlo.collective_bytes(lowered.compile().as_text())


@pytest.mark.parametrize(("strategy", "layout"), [("ring", "zigzag"), ("ring", "contiguous"), ("all_to_all", "zigzag"),
                                                  ("all_gather", "zigzag")])
def test_model_bytes_are_the_compiled_programs(strategy, layout):
    """Zigzag's ring decides every step in the trace and gathers no position bounds; contiguous's does."""
    assert strategy == "ring" or strategy in registry.names(), f"{strategy} is not registered"
    problem = dataclasses.replace(PROBLEM, layout=layout)
    want = [compiled_bytes(strategy, backward, problem) for backward in (False, True)]
    got = [predict(problem, strategy, "h100", backward=backward).bytes for backward in (False, True)]

    def backward_alone(fwd: dict[str, int], step: dict[str, int]) -> dict[str, int]:
        return {kind: step[kind] - fwd[kind] for kind in fwd}

    # the forward, the training step, and the backward alone (a ring step it missed could hide in 10% of all)
    for name, model, program in (("fwd", got[0], want[0]), ("fwd+bwd", got[1], want[1]),
                                 ("bwd", backward_alone(*got), backward_alone(*want))):
        assert model.keys() == program.keys() == set(hlo.COLLECTIVE_KINDS)
        for kind in program:
            assert abs(model[kind] - program[kind]) <= 0.1 * program[kind], (strategy, name, kind, model, program)
    assert sum(want[1].values()) > sum(want[0].values())  # the backward moves bytes too


def test_what_cannot_run_says_why_and_ranks_last():
    six = Problem(seq_len=1024, heads=6, kv_heads=2, ring_size=4, dtype="bfloat16")
    refused = predict(six, "all_to_all", "h100")
    assert refused.unsupported == "heads (6) must be a multiple of the ring size (4)"
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of the ring size \(4\)"):
        kv_repeats(6, 2, 4)  # the implementation refuses the same heads
    assert math.isinf(refused.seconds) and "unsupported: heads (6)" in refused.why
    ranked = rank(six, "h100")
    assert [t.strategy for t in ranked][-1] == "all_to_all" and ranked[0].unsupported is None
    assert predict(six, "hybrid", "h100").axes == (2, 2)  # Pa = 2 splits 6 heads
    assert "Pa (4)" in predict(six, "hybrid", "h100", axes=(1, 4)).unsupported
    prime = Problem(seq_len=1280, heads=10, kv_heads=2, ring_size=5)
    assert "no split" in predict(prime, "hybrid", "h100").unsupported
    small = dataclasses.replace(PLATFORMS["h100"], memory=4 * 2**20)  # gathered K/V: 4 MiB of 1024x4x128 bf16
    big = Problem(seq_len=2048, heads=8, kv_heads=4, head_dim=128, dtype="bfloat16", ring_size=4)
    assert "half the device memory" in predict(big, "all_gather", small).unsupported
    assert predict(big, "all_gather", "h100").gathered_bytes == 2 * 2048 * 4 * 128 * 2
    # gathered K/V of 48 GiB: over half an H100's 80 GB, under half an H200's 141 GB
    long = Problem(seq_len=6291456, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", ring_size=8)
    assert "half the device memory" in predict(long, "all_gather", "h100").unsupported
    assert predict(long, "all_gather", "h200").unsupported is None
    assert "no strategy can run" in strategy_model.verdict(rank(six, small, strategies=("all_to_all",)))


def links(rate: float) -> Platform:
    return dataclasses.replace(PLATFORMS["h100"], p2p=rate, all_gather=rate, all_to_all=rate, latency=0.0)


def test_with_free_links_every_strategy_takes_its_compute_the_same_without_a_mask():
    problem = Problem(seq_len=32768, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", ring_size=8, causal=False)
    for t in rank(problem, links(1e30)):
        assert t.seconds == pytest.approx(t.compute_s, rel=1e-9), t.strategy
        assert t.seconds == pytest.approx(rank(problem, links(1e30))[0].seconds, rel=1e-9), t.strategy
    slow = [t.seconds - t.compute_s for t in rank(problem, "v5e")]
    assert max(slow) > 0  # real links expose some transfers


@pytest.mark.parametrize("ring, seq_len, layout", [(4, 8192, "zigzag"), (4, 4096, "contiguous"),
                                                    (8, 8192, "striped")])
def test_causal_work_is_what_the_scan_ring_computes_tile_by_tile(ring, seq_len, layout):
    """The model's share of the logits the slowest device computes is the scan ring's, counted as it runs
    (`tuner.support.work.count_work`) at its default tiles."""
    mesh, seq = Mesh(np.array(jax.devices()[:ring]), ("sp",)), P(None, "sp")
    attend = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, causal=True, axis_name="sp", layout=layout),
                           mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    x = jnp.zeros((1, seq_len, 1, 8), jnp.float32)
    with count_work() as counts:
        jax.block_until_ready(jax.jit(attend)(x, x, x))
    counted = max(counts["tile_area"].values()) / (seq_len // ring * seq_len)
    problem = Problem(seq_len=seq_len, heads=1, kv_heads=1, head_dim=8, ring_size=ring, layout=layout)
    shards = strategy_model._shards(problem, ring)
    tiles = strategy_model._ring_tiles(problem, platforms.get_platform("cpu"))
    assert tiles == (128, 128)  # the scan kernel's masked tile: the ring's default for a causal problem
    assert strategy_model._work_share(problem, shards, shards, tiles) == counted
    assert 0.5 < counted < 1.0  # some tiles skipped, some crossing the diagonal


@pytest.mark.parametrize("platform, kernel", [("v5e", "pallas_tpu"), ("h100", "triton")])
def test_the_exchanges_work_is_counted_at_their_kernels_default_tiles(platform, kernel):
    """The model's tiles for all_to_all, all_gather and the hybrid are the default forward tiles of the
    platform's kernel, which `strategy=` runs there, on what that kernel runs (`registry.tile_shapes`)."""
    for causal in (True, False):
        problem = Problem(seq_len=32768, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", causal=causal,
                          ring_size=8)
        tiles = strategy_model._exchanged_tiles(problem, PLATFORMS[platform])
        for strategy, group in (("all_to_all", None), ("all_gather", None), ("hybrid", 2)):
            implementation = registry.get(f"{strategy}_{kernel}")
            shapes = registry.tile_shapes(implementation, problem.shapes, 8, group)
            fwd = implementation.default_config(shapes, problem.spec).fwd
            assert (min(fwd.block_q, shapes.q_len), min(fwd.block_kv, shapes.kv_len)) == (
                min(tiles[0], shapes.q_len), min(tiles[1], shapes.kv_len)), (strategy, causal)


@pytest.mark.parametrize("packing, causal", [("512,64x8", True), ("lognormal:6,seed=1", True), ("256x4", False)])
def test_packed_work_is_what_the_scan_ring_computes_tile_by_tile(packing, causal):
    """With documents, the model's share of the slowest device is the scan ring's count at the ring's packed
    default tiles, on the packing's segment ids laid out in zigzag."""
    problem = Problem(seq_len=1024, heads=1, kv_heads=1, head_dim=8, ring_size=4, layout="zigzag", causal=causal,
                      packing=packing)
    tiles = strategy_model._ring_tiles(problem, dataclasses.replace(PLATFORMS["h100"], ring_tiles=(512, 256)))
    assert tiles == (documents.declared_tile(packing, 1024, 4, problem.spec),) * 2  # the loader's default
    mesh, seq = Mesh(np.array(jax.devices()[:4]), ("sp",)), P(None, "sp")
    attend = jax.shard_map(
        lambda q, k, v, s: ring_attention(q, k, v, causal=causal, axis_name="sp", layout="zigzag", q_segment_ids=s,
                                          kv_segment_ids=s, fwd_params=FwdParams(*tiles)),
        mesh=mesh, in_specs=(seq, seq, seq, seq), out_specs=seq)
    x = jnp.zeros((1, 1024, 1, 8), jnp.float32)
    segment_ids = problem.documents.segment_ids(1024, 1)[:, layouts.global_order("zigzag", 1024, 4)]
    with count_work() as counts:
        jax.block_until_ready(jax.jit(attend)(x, x, x, jnp.asarray(segment_ids)))
    counted = max(counts["tile_area"].values()) / (1024 // 4 * 1024)
    shards = strategy_model._shards(problem, 4)
    assert strategy_model._work_share(problem, shards, shards, tiles) == counted
    assert counted < 0.5  # the documents' tiles are skipped


def test_the_tile_count_is_the_tile_by_tile_rule_on_any_layout():
    """`_computed` counts with sorted key tiles; here the rule is applied to every pair of tiles, on random
    layouts, tiles, documents and masks: each tile pair is computed unless its keys all follow its queries
    (causal) or its documents cannot meet."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        ring = int(rng.choice([1, 2, 4, 8]))
        seq = ring * 2 * int(rng.integers(1, 40))
        layout = str(rng.choice(["zigzag", "contiguous", "striped"]))
        queries = layouts.local_positions_np(layout, seq // ring, ring, int(rng.integers(ring)))
        keys = layouts.global_order(layout, seq, ring) if rng.random() < 0.5 else queries[::-1]
        tiles = (int(rng.integers(1, 24)), int(rng.integers(1, 24)))
        docs = None if rng.random() < 0.3 else np.sort(rng.integers(1, int(rng.integers(2, 10)), seq))
        causal = bool(rng.random() < 0.6)
        expected = 0
        for q in np.array_split(queries, range(tiles[0], len(queries), tiles[0])):
            for k in np.array_split(keys, range(tiles[1], len(keys), tiles[1])):
                skipped = causal and k.min() > q.max()
                if docs is not None:
                    skipped |= docs[k].max() < docs[q].min() or docs[k].min() > docs[q].max()
                expected += 0 if skipped else len(q) * len(k)
        assert strategy_model._computed(queries, keys, tiles, causal, docs) == expected, (layout, tiles, causal)
    with pytest.raises(ValueError, match="documents must be numbered in token order"):
        strategy_model._computed(np.arange(4), np.arange(4), (2, 2), True, np.array([1, 2, 1, 2]))


def test_a_long_document_costs_the_ring_and_not_all_to_all():
    """Half the sequence one document: the ring's slowest device holds more of its causal work than of a
    single sequence's, and all_to_all, whose devices each hold the whole sequence, overtakes the ring."""
    def compute(packing, strategy):
        problem = Problem(seq_len=131072, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", ring_size=8,
                          packing=packing)
        return predict(problem, strategy, "h100").compute_s

    packed, single = "65536,4096x16", None
    assert compute(single, "ring") == pytest.approx(compute(single, "all_to_all"), rel=0.02)
    assert compute(packed, "ring") > 1.5 * compute(packed, "all_to_all")
    assert rank(Problem(seq_len=131072, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", ring_size=8,
                        packing=packed), "h100")[0].strategy == "all_to_all"


@pytest.mark.parametrize("kv_heads, winner", [(8, "all_to_all"), (1, "all_gather")])
def test_with_slow_links_the_fewest_bytes_win(kv_heads, winner):
    problem = Problem(seq_len=32768, heads=8, kv_heads=kv_heads, head_dim=128, dtype="bfloat16", ring_size=8)
    ranked = rank(problem, links(1.0))
    assert ranked[0].strategy == min(ranked, key=lambda t: t.link_bytes).strategy == winner
    for t in ranked:  # every byte on a link takes 1 s; compute is lost in it
        assert t.seconds == pytest.approx(t.link_bytes, rel=1e-3), t.strategy


def test_longer_sequences_and_balanced_layouts_favour_the_ring():
    def ring_over_all_to_all(seq_len: int, layout: str = "zigzag") -> float:
        problem = Problem(seq_len=seq_len, heads=8, kv_heads=8, head_dim=128, dtype="bfloat16", ring_size=8,
                          layout=layout)
        return predict(problem, "ring", "v5e").seconds / predict(problem, "all_to_all", "v5e").seconds

    assert ring_over_all_to_all(131072) < ring_over_all_to_all(32768) < ring_over_all_to_all(8192)
    assert ring_over_all_to_all(131072, "contiguous") > ring_over_all_to_all(131072) * 1.5  # unbalanced causal
    long = Problem(seq_len=131072, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", ring_size=8)
    assert rank(long, "h100")[0].strategy == "ring"
    assert "compute-bound" in predict(long, "ring", "h100").why


def test_rates_can_be_overridden_and_bad_inputs_are_refused_by_name():
    assert set(CHIPS) <= set(PLATFORMS) and PLATFORMS["v5e"].p2p == CHIPS["v5e"].ici_link
    problem = Problem(seq_len=32768, heads=8, kv_heads=2, head_dim=128, dtype="bfloat16", ring_size=8)
    fast = dataclasses.replace(PLATFORMS["h100"], flops=2 * PLATFORMS["h100"].flops)
    for strategy in STRATEGIES:
        base = predict(problem, strategy, "h100")
        assert predict(problem, strategy, fast).compute_s == pytest.approx(base.compute_s / 2), strategy
        assert predict(problem, strategy, "h100", backward=False).backward_s == 0.0
    text = explain(rank(problem, "v5e"))
    assert all(s in text for s in STRATEGIES) and "pick: " in text
    cpu = platforms.get_platform("cpu")
    assert cpu is platforms.get_platform("cpu") and cpu.flops > 0 and cpu.p2p > 0
    with pytest.raises(ValueError, match="strategy must be one of"):
        predict(problem, "tree", "h100")
    with pytest.raises(ValueError, match="platform must be"):
        predict(problem, "ring", "a100")
    with pytest.raises(ValueError, match="axes applies to the hybrid"):
        predict(problem, "ring", "h100", axes=(2, 4))
    with pytest.raises(ValueError, match="axes must be"):
        predict(problem, "hybrid", "h100", axes=(3, 3))
    with pytest.raises(ValueError, match="problem must be"):
        predict("B=1", "ring", "h100")
    with pytest.raises(ValueError, match=r"Platform\.p2p must be positive"):
        dataclasses.replace(PLATFORMS["h100"], p2p=0)


TPU_LOOP = """HloModule m

%cond (p: (s32[], f32[2])) -> pred[] {
  %p = (s32[], f32[2]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(5)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %p = (s32[], f32[2]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %c = s32[]{:T(128)} copy(%i)
  %one = s32[]{:T(128)} constant(1)
  %x = f32[2]{0} get-tuple-element(%p), index=1
  %done = f32[2]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %next = s32[]{:T(128)} add(%c, %one)
  ROOT %t = (s32[], f32[2]{0}) tuple(%next, %done)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %start = s32[]{:T(128)} constant(1)
  %init = (s32[], f32[2]{0}) tuple(%start, %x)
  %w = (s32[], f32[2]{0}) while(%init), condition=%cond, body=%body, backend_config={"flag_configs":[]}
  ROOT %r = f32[2]{0} get-tuple-element(%w), index=1
}
"""


def test_trip_counts_the_tpu_compiler_leaves_out_are_read_from_the_loop():
    """XLA:TPU writes no `known_trip_count` on its loops; `hlo.with_trip_counts` reads `for i = 1; i < 5; i++`
    as 4 trips, also where the next index is copied before the body returns it (the layer loop of a training
    step that offloads residuals to the host), and refuses a loop it cannot read rather than count it once."""
    assert hlo.collective_bytes(TPU_LOOP)["collective-permute"] == 4 * 2 * 4
    copied = TPU_LOOP.replace("tuple(%next, %done)", "tuple(%moved, %done)").replace(
        "  ROOT %t", "  %moved = s32[]{:T(128)S(6)} copy(%next)\n  ROOT %t")
    assert "copy(%next)" in copied and hlo.collective_bytes(copied)["collective-permute"] == 4 * 2 * 4
    with pytest.raises(ValueError, match="cannot read the trip count"):
        hlo.with_trip_counts(TPU_LOOP.replace("direction=LT", "direction=NE"))
