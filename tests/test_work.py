"""Masked work is skipped, not computed and thrown away; zigzag balances causal work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import FwdParams, BwdParams, ring_attention
from tuner.support.work import count_work


def _count(ring: int, layout: str, *, causal: bool = True, local: int = 16, backward: bool = False,
           **options):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    seq = P(None, "sp")
    half = local // 2  # tiles of half a local shard: the zigzag chunk size

    def local_fn(q, k, v):
        return ring_attention(q, k, v, causal=causal, axis_name="sp", layout=layout, backend="scan",
                              fwd_params=FwdParams(half, half), bwd_params=BwdParams(half, half),
                              **options)

    fn = jax.shard_map(local_fn, mesh=mesh, in_specs=(seq, seq, seq), out_specs=seq)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, ring * local, 2, 8)), jnp.float32)
    with count_work() as counts:
        if backward:
            jax.block_until_ready(jax.jit(jax.grad(lambda q: fn(q, x, x).sum()))(x))
        else:
            jax.block_until_ready(jax.jit(fn)(x, x, x))
    return counts


@pytest.mark.parametrize("ring", [4, 8])
def test_contiguous_causal_ring_skips_future_blocks(ring):
    counts = _count(ring, "contiguous")
    assert sum(counts["blocks"].values()) == ring * (ring + 1) // 2
    assert dict(counts["blocks"]) == {r: r + 1 for r in range(ring)}  # device r sees shards 0..r


def test_non_causal_ring_computes_every_block():
    counts = _count(4, "contiguous", causal=False)
    assert dict(counts["blocks"]) == {r: 4 for r in range(4)}


@pytest.mark.slow
def test_backward_skips_the_same_blocks():
    counts = _count(4, "contiguous", backward=True)
    # the forward (saved for the backward) and the backward each compute P(P+1)/2 blocks
    assert sum(counts["blocks"].values()) == 2 * (4 * 5 // 2)


def test_zigzag_balances_causal_work_at_p8():
    zigzag = _count(8, "zigzag")["tile_area"]
    contiguous = _count(8, "contiguous")["tile_area"]
    balance = lambda work: max(work.values()) / (sum(work.values()) / 8)  # noqa: E731
    assert len(zigzag) == 8 and balance(zigzag) <= 1.1, dict(zigzag)
    assert balance(contiguous) > 1.5, dict(contiguous)  # the imbalance zigzag removes
    assert sum(zigzag.values()) <= 0.6 * 8 * 8 * 16 * 16  # about half of the P^2 T^2 pairs is computed


def test_sliding_window_skips_far_blocks():
    counts = _count(8, "contiguous", causal=False, sliding_window=4)
    # a window of 4 tokens on shards of 16 reaches only the neighbouring shards
    assert dict(counts["blocks"]) == {r: 3 - (r in (0, 7)) for r in range(8)}


@pytest.mark.parametrize("by_key", [False, True])
@pytest.mark.parametrize("features", [
    dict(causal=True), dict(window=(30, 20)), dict(causal=True, chunk_size=40), dict(causal=True, has_segments=True),
    dict(window=(0, 60), has_segments=True), {}])
def test_tile_schedule_lists_every_allowed_tile_and_unmasks_only_whole_allowed_ones(features, by_key):
    """Against the token-level rule: every tile with an allowed pair is among the first `count`; the
    first `full` ones are allowed pair by pair and lie inside the lengths; and a tile that is whole and
    allowed everywhere is unmasked whenever its position and segment ranges show it."""
    from tuner.semantics import masks
    from tuner.semantics.spec import AttentionSpec

    spec = AttentionSpec(scale=1.0, **features)
    q_len, kv_len, block_q, block_kv = 44, 52, 8, 16  # both ends with a partial tile
    q_pos = np.stack([np.arange(q_len) + 8, 2 * np.arange(q_len) + 3]).astype(np.int32)  # row 1 with gaps
    kv_pos = np.stack([np.arange(kv_len), np.arange(kv_len) + 5]).astype(np.int32)
    q_seg, kv_seg = q_pos // 40, kv_pos // 40  # packed segments
    order, count, full = (np.asarray(x) for x in masks.tile_schedule(
        jnp.asarray(q_pos), jnp.asarray(kv_pos), jnp.asarray(q_seg), jnp.asarray(kv_seg), spec, block_q, block_kv,
        by_key=by_key))
    pairs = masks.allowed(q_pos, kv_pos, q_seg, kv_seg, spec)
    pairs = np.ones((2, q_len, kv_len), bool) if pairs is None else np.asarray(pairs)
    unmasked = 0
    for b in range(2):
        for qt in range(-(-q_len // block_q)):
            for kt in range(-(-kv_len // block_kv)):
                tile = pairs[b, qt * block_q:(qt + 1) * block_q, kt * block_kv:(kt + 1) * block_kv]
                mine, other = (kt, qt) if by_key else (qt, kt)
                listed = list(order[b, mine, :count[b, mine]])
                whole = (qt + 1) * block_q <= q_len and (kt + 1) * block_kv <= kv_len
                if tile.any():
                    assert other in listed
                if other in listed[:full[b, mine]]:
                    assert whole and tile.all()
                    unmasked += 1
                elif whole and tile.all() and not spec.has_segments and spec.window is None:
                    raise AssertionError(f"whole allowed tile {(b, qt, kt)} is masked")
    assert unmasked > 0


@pytest.mark.parametrize("fused_dq", [True, False])
def test_the_scan_kernel_visits_only_the_pairs_its_masks_let_through(fused_dq):
    """One block of 8 tiles, causal, a document every 2 tiles: 3 of each document's 4 tile pairs are
    allowed, 12 in all. The forward computes each once, the backward once per pass (dk/dv, and dq when
    separate)."""
    from tuner.kernels import BACKENDS
    from tuner.semantics.spec import AttentionSpec

    scan, t, tile = BACKENDS["scan"], 64, 8
    spec = AttentionSpec(scale=0.5, causal=True, has_segments=True)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    seg = pos // (2 * tile)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, t, 2, 8)), jnp.float32)
    bwd = BwdParams(tile, tile) if fused_dq else BwdParams(tile, tile, block_q_dq=tile, block_kv_dq=tile)

    def forward(q):
        return scan.block_fwd(q, x, x, pos, pos, seg, seg, None, spec=spec, params=FwdParams(tile, tile))

    def backward(q):
        out, lse = forward(q)
        return scan.block_bwd(q, x, x, out, lse, x, jnp.zeros(lse.shape), pos, pos, seg, seg, None, spec=spec,
                              params=bwd)

    with count_work() as forward_counts:
        jax.block_until_ready(jax.jit(forward)(x))
    with count_work() as both_counts:
        jax.block_until_ready(jax.jit(backward)(x))
    allowed = 12 * tile * tile
    assert forward_counts["tile_area"][0] == allowed
    assert both_counts["tile_area"][0] == allowed * (2 if fused_dq else 3)
