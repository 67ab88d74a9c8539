"""The documents layout (`tuner.layouts.document_order`, the loader's `layout="documents"`): a permutation
that gives every device its share of the rows' documents, never more work than a fixed layout, exact
results through the loader against the float64 dense reference."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tuner import FwdParams, BwdParams, get_tuned_ring_attention, layouts, registry, ring_attention
from tuner.semantics import documents, masks
from tuner.semantics.packing import Packing
from tuner.semantics.reference import dense_attention
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.work import count_work

import scripts

first_trace = scripts.load("benchmarks/suite/first_trace.py")


def segment_ids(*rows: list[int]) -> np.ndarray:
    """`[len(rows), T]` segment ids of rows of documents of these lengths (ids 1, 2, ...)."""
    return np.stack([np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(row)]) for row in rows])


def test_each_row_is_a_permutation_that_fills_every_device_in_token_order():
    seg = segment_ids([512, 64, 64, 128, 256], [1024])
    order = layouts.document_order(seg, 8, tile=32)
    assert isinstance(order, np.ndarray) and order.shape == (2, 1024) and order.dtype == np.int32
    for row in order:
        assert sorted(row.tolist()) == list(range(1024))
        assert all(np.all(np.diff(shard) > 0) for shard in row.reshape(8, 128))  # each shard in token order
    traced = jax.jit(lambda s: layouts.document_order(s, 8, tile=32))(jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(traced), order)  # the same inside jit, on traced ids


@given(st.lists(st.lists(st.integers(1, 200), min_size=1, max_size=6), min_size=1, max_size=3),
       st.sampled_from([2, 4, 8]), st.booleans(), st.sampled_from([None, (0, 0), (40, 0), (7, 30)]),
       st.sampled_from([8, 16, (16, 32)]))
@settings(max_examples=6)
def test_the_host_and_the_device_choose_the_same_layouts(rows, ring, causal, window, tile):
    """NumPy in: the plan runs in NumPy and compiles nothing; the choice is the jitted program's."""
    total = -(-max(map(sum, rows)) // (2 * ring)) * 2 * ring
    seg = segment_ids(*[row + [total - sum(row)] if total > sum(row) else row for row in rows])
    with first_trace.compiles_counted() as compiles:
        host = layouts.document_order(seg, ring, causal=causal, window=window, tile=tile)
    assert compiles == [] and isinstance(host, np.ndarray)
    device = layouts.document_order(jnp.asarray(seg), ring, causal=causal, window=window, tile=tile)
    np.testing.assert_array_equal(host, np.asarray(device))


def test_a_long_row_is_counted_in_tile_pairs_not_in_an_area_that_overflows():
    """At 262144 tokens on 8 devices a device's tile area passes 2**31: one causal document then wrapped
    int32 and got the contiguous layout (its last device computes 15 times the first's) instead of zigzag."""
    total, ring = 262144, 8
    seg = np.ones((1, total), np.int32)
    zigzag = layouts.global_order("zigzag", total, ring)
    np.testing.assert_array_equal(layouts.document_order(seg, ring, tile=64)[0], zigzag)
    np.testing.assert_array_equal(np.asarray(layouts.document_order(jnp.asarray(seg), ring, tile=64))[0], zigzag)


@pytest.mark.parametrize("total, ring, tile, chunk", [
    (4096, 8, 64, 64), (131072, 8, 16, 128), (131072, 8, 64, 128),  # whole tiles; coarser on long rows
    (6144, 4, 128, 128), (12288, 4, 64, 64),
    (100000, 8, 128, 250), (100008, 8, 128, 463),  # shards of 12500 and 12501 = 3 x 4167 tokens
    (8 * 1021, 8, 64, 1021),  # a prime shard: one chunk
])
def test_a_row_is_cut_into_whole_chunks_at_least_a_tile_long_and_at_most_1024_of_them(total, ring, tile, chunk):
    """The plan counts chunk pairs, so a row of a length the tile does not divide must not be cut into chunks
    of a few tokens: a row of 100008 tokens over 8 devices was cut into 100008 chunks of one token, and
    planning it asked for 41 GB."""
    local = total // ring
    assert documents.chunk_size(total, ring, (tile, tile)) == chunk
    assert local % chunk == 0 and chunk >= min(tile, local) and total // chunk <= documents.COUNTED_TILES
    if local % tile == 0:
        assert chunk % tile == 0
    order = layouts.document_order(np.repeat(np.arange(total // 300 + 1), 300)[None, :total], ring, tile=tile)
    assert sorted(order[0].tolist()) == list(range(total))


@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.sampled_from([2, 4, 8]), st.booleans())
@settings(max_examples=5)
def test_never_more_work_than_the_best_fixed_layout(lengths, ring, causal):
    """Per the tile count of the masks' skipping rule, the layout chosen is at most the best fixed one."""
    total = -(-sum(lengths) // (2 * ring)) * 2 * ring
    lengths = lengths + [total - sum(lengths)] if total > sum(lengths) else lengths
    seg = jnp.asarray(segment_ids(lengths)[0])
    spec = AttentionSpec(scale=1.0, causal=causal, has_segments=True)
    order = jnp.asarray(layouts.document_order(np.asarray(seg)[None], ring, causal=causal, tile=16)[0])
    busiest = jax.jit(documents.busiest, static_argnums=(2, 3, 4))
    chosen = busiest(order, seg, ring, spec, (16, 16))
    fixed = [busiest(jnp.asarray(layouts.global_order(name, total, ring)), seg, ring, spec, (16, 16))
             for name in layouts.LAYOUTS]
    assert chosen <= min(fixed)


def _counted(orders: list[np.ndarray], seg: np.ndarray, ring: int, tile: int) -> list[dict]:
    """The tile area each device computes for the row laid out by each of `orders`, counted by the ring
    itself: one program (the order and the laid-out ids are its arguments), run once an order."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    seq = P(None, "sp")

    def local(q, k, v, s, p):
        return ring_attention(q, k, v, causal=True, axis_name="sp", layout="contiguous", backend="scan",
                              fwd_params=FwdParams(tile, tile), bwd_params=BwdParams(tile, tile),
                              q_segment_ids=s, kv_segment_ids=s, q_positions=p, kv_positions=p)

    x = jnp.zeros((1, seg.shape[1], 1, 8), jnp.float32)
    rows = [(np.take_along_axis(seg, order, axis=1), order.astype(np.int32)) for order in orders]
    with count_work() as counts:
        ring_step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 5, out_specs=seq)).lower(
            x, x, x, *rows[0]).compile()
    works = []
    for laid, pos in rows:
        jax.block_until_ready(ring_step(x, x, x, laid, pos))
        works.append(dict(counts["tile_area"]))
        counts["tile_area"].clear()
    return works


def _loader_counted(packing: str, ring: int, declared: bool = True) -> tuple[dict, int]:
    """The tile area each device computes when the loader, told the rows' `packing` or not, runs them in
    the documents layout (counted by the ring itself), and the forward tile `explain()` says it runs."""
    mesh = Mesh(np.array(jax.devices()[:ring]), ("sp",))
    lengths = Packing.parse(packing).row_lengths(sum(Packing.parse(packing).lengths))
    seg = jnp.asarray(segment_ids(lengths))
    x = jnp.zeros((1, seg.shape[1], 1, 8), jnp.float32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents",
                                    packing=packing if declared else None)
    with count_work() as counts:
        jax.block_until_ready(jax.jit(lambda x, s: attn(x, x, x, q_segment_ids=s, kv_segment_ids=s))(x, seg))
    tile = attn.explain(x, x, x, q_segment_ids=seg, kv_segment_ids=seg).config.to_dict()["fwd"]["block_q"]
    return counts["tile_area"], tile


@pytest.mark.parametrize("packing, declared, tile", [("512,32x16", True, 32), ("64x16", True, 16),
                                                     ("64x16", False, 16)])
def test_the_loader_balances_the_ring_and_wastes_little(packing, declared, tile):
    """Ring 8, 1024 tokens, the loader on an empty cache, told the packing (the tile is planned from it)
    or not (the rows choose it in the step): one long document among short ones, or 16 tiny ones. The
    ring's own count: every device within 10% of the mean, and 75% of the busiest device's work useful
    (tiles of 64, the longest default, reach 0.51 on the tiny ones). For the long document, the best
    fixed layout (on the same tiles) is far from it."""
    lengths = Packing.parse(packing).lengths
    useful = sum(n * (n + 1) // 2 for n in Packing.parse(packing).row_lengths(sum(lengths)))

    def measure(work):
        return max(work.values()) / (sum(work.values()) / 8), useful / (8 * max(work.values()))

    work, chosen = _loader_counted(packing, 8, declared)
    assert chosen == tile
    imbalance, efficiency = measure(work)
    assert imbalance <= 1.10 and efficiency >= 0.75, (imbalance, efficiency)
    if packing.startswith("512"):
        seg = segment_ids(Packing.parse(packing).row_lengths(1024))
        orders = [layouts.global_order(name, 1024, 8)[None] for name in layouts.LAYOUTS]
        fixed = [measure(work) for work in _counted(orders, seg, 8, tile)]
        assert max(e for _, e in fixed) < 0.7 * efficiency, fixed


@given(st.lists(st.lists(st.integers(1, 200), min_size=1, max_size=16), min_size=1, max_size=3),
       st.sampled_from([2, 4, 8]), st.booleans())
@settings(max_examples=6, deadline=None)
def test_the_rows_choose_in_the_step_the_tile_their_packing_would(rows, ring, causal):
    """`rows_tile_choice` on traced segment ids (what an undeclared packed call runs) picks the tile
    `packed_tile` computes on the host from the documents' lengths (what a declared packing runs)."""
    total = -(-max(sum(row) for row in rows) // ring) * ring
    rows = [row + [total - sum(row)] if total > sum(row) else row for row in rows]
    spec = AttentionSpec(scale=1.0, causal=causal, has_segments=True)
    chosen = jax.jit(documents.rows_tile_choice, static_argnums=(1, 2))(jnp.asarray(segment_ids(*rows)), spec, ring)
    assert documents.PACKED_TILES[int(chosen)] == documents.packed_tile(rows, spec, ring)


@given(st.lists(st.one_of(st.floats(0, 1, width=32), st.sampled_from([documents.EFFICIENT])),
                min_size=len(documents.PACKED_TILES), max_size=len(documents.PACKED_TILES)))
@settings(max_examples=40, deadline=None)
def test_the_tile_rule_answers_alike_in_numpy_and_in_jax(efficiencies):
    """`tile_choice` on the host (NumPy, a declared packing's) and in a step (jax) picks the same tile, at
    the threshold too: both compare in float32."""
    host = documents.tile_choice(np.asarray(efficiencies, np.float32))
    assert isinstance(host, np.ndarray | np.integer)  # computed without jax
    assert int(host) == int(_jitted_tile_choice(jnp.asarray(efficiencies, jnp.float32)))


_jitted_tile_choice = jax.jit(documents.tile_choice)


@given(st.lists(st.integers(1, 400), min_size=1, max_size=12), st.sampled_from([2, 4, 8]), st.booleans(),
       st.sampled_from([16, 32]))
@settings(max_examples=5, deadline=None)
def test_the_plan_deals_within_one_chunk_and_its_host_estimate_is_its_count(lengths, ring, causal, tile):
    """The documents plan's devices differ by at most one chunk's cost, and `efficiency` (the host-side
    estimate the default tile is chosen by) is what `busiest` counts for the plan (in tile pairs)."""
    total = -(-sum(lengths) // (ring * tile)) * ring * tile
    lengths = lengths + [total - sum(lengths)] if total > sum(lengths) else lengths
    spec = AttentionSpec(scale=1.0, causal=causal, has_segments=True)
    seg = jnp.asarray(segment_ids(lengths)[0])

    @jax.jit  # one program, not one a function
    def planned(seg):
        order = documents.plan(seg, ring, spec, tile)
        return order, documents.chunk_costs(seg, spec, tile), documents.busiest(order, seg, ring, spec, (tile, tile))

    order, cost, counted = (np.asarray(x) for x in planned(seg))
    loads = cost[order.reshape(ring, -1, tile)[:, :, 0] // tile].sum(axis=1)
    assert loads.max() - loads.min() <= cost.max()
    useful = documents.useful_logits(lengths, spec)
    assert documents.efficiency(lengths, spec, ring, tile) == pytest.approx(useful / (ring * int(counted) * tile**2))


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (5, 0)), (False, (3, 7))])
def test_the_useful_logits_of_a_row_are_its_allowed_pairs(causal, window):
    """`row_useful` counts each document's allowed (query, key) pairs from where the document starts and
    ends: the pairs `masks.allowed` allows, counted one by one; documents of one token, and a row that
    ends in a document of one."""
    seg = segment_ids([1, 9, 4, 1, 30, 6, 1])[0]
    spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
    token = np.arange(seg.shape[0])
    want = int(np.asarray(masks.allowed(token, token, seg, seg, spec)).sum())
    assert float(jax.jit(documents.row_useful, static_argnums=1)(jnp.asarray(seg), spec)) == want


@pytest.mark.parametrize("tile", [8, 7, 40])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_busiest_device_counts_the_tile_pairs_its_shard_may_compute(tile, layout):
    """`busiest` against the tiles' bounds taken one by one in NumPy: tiles that divide the shard, that
    leave a shorter last tile in each shard, and one longer than the shard (cut to it)."""
    ring, local = 4, 24
    seg = segment_ids([10, 3, 50, 33])[0]
    order = np.asarray(layouts.global_order(layout, ring * local, ring), np.int32)
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    size = min(tile, local)
    tiles = [order[d * local:][start:min(start + size, local)] for d in range(ring) for start in range(0, local, size)]
    bounds = [np.array([f(x) for x in tiles]) for f in (np.min, np.max)]
    ids = [np.array([f(seg[x]) for x in tiles]) for f in (np.min, np.max)]
    may = np.asarray(masks.ranges_may_attend(bounds[0][:, None], bounds[1][:, None], bounds[0][None], bounds[1][None],
                                             (ids[0][:, None], ids[1][:, None], ids[0][None], ids[1][None]), spec))
    want = may.sum(axis=1).reshape(ring, -1).sum(axis=1).max()
    busiest = jax.jit(documents.busiest, static_argnums=(2, 3, 4))
    assert int(busiest(jnp.asarray(order), jnp.asarray(seg), ring, spec, (tile, tile))) == want
    assert int(documents.busiest(order, seg, ring, spec, (tile, tile))) == want  # on the host, in NumPy


@given(st.lists(st.integers(1, 250), min_size=1, max_size=16), st.sampled_from([2, 4, 8]), st.booleans(),
       st.sampled_from([None, (40, 0), (7, 9)]))
@settings(max_examples=6, deadline=None)
def test_a_rows_efficiency_is_the_same_in_numpy_and_in_jax(lengths, ring, causal, window):
    """`row_efficiency` on the host (NumPy: a declared packing's rows) and in a step (jax: the rows a call
    gets) gives the same float32 on every tile, and `row_useful` the same count (rows of 4096 tokens, the
    last document the padding, so that the examples of one spec and ring share a program)."""
    spec = AttentionSpec(scale=1.0, causal=causal, window=window, has_segments=True)
    row = segment_ids(lengths + [4096 - sum(lengths)])[0]
    host = [documents.row_efficiency(row, spec, ring, tile) for tile in documents.PACKED_TILES]
    assert all(isinstance(e, np.float32) for e in host), host
    traced, useful = _jitted_row(jnp.asarray(row), spec, ring)
    np.testing.assert_array_equal(np.asarray(host), np.asarray(traced))
    assert documents.row_useful(row, spec) == useful


@functools.partial(jax.jit, static_argnums=(1, 2))
def _jitted_row(row, spec, ring):
    """`row_efficiency` on each tile and `row_useful`, traced, in one program."""
    efficiencies = [documents.row_efficiency(row, spec, ring, tile) for tile in documents.PACKED_TILES]
    return jnp.stack(efficiencies), documents.row_useful(row, spec)


def test_a_declared_packing_chooses_the_longest_tile_that_wastes_little():
    spec = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    assert documents.declared_tile(None, 4096, 8, spec) is None
    assert documents.declared_tile("2048,128x16", 4096, 8, spec) == 64  # one long document: tiles of 64 suffice
    with first_trace.compiles_counted() as compiles:  # in NumPy: no program to compile, whatever mesh is set
        documents.declared_tile.__wrapped__("2048,128x16", 4104, 8, spec)  # a length no other test asks for
    assert compiles == []
    assert documents.declared_tile("64x64", 4096, 8, spec) == 16  # tiny ones: diagonals waste less in short tiles
    tailed = documents.declared_tile("lognormal:14", 4096, 8, spec)
    rows = [Packing.parse("lognormal:14").row_lengths(4096, r) for r in range(documents.DECLARED_ROWS)]
    assert min(documents.efficiency(row, spec, 8, tailed) for row in rows) >= documents.EFFICIENT
    assert tailed == 64 or min(documents.efficiency(row, spec, 8, 2 * tailed) for row in rows) < documents.EFFICIENT
    assert documents.declared_tile("1000,24", 1032, 8, spec) == documents.declared_tile("1000,24,8", 1032, 8, spec)


def _check_against_dense(rows: np.ndarray, ring: int, heads: tuple[int, int], causal: bool, window,
                         group: int = 0) -> None:
    """The loader in the documents layout on packed `rows` of segment ids: output, lse and gradients
    against float64 dense. With a `group`, over two mesh axes: `ring` positions of `group` devices."""
    if group:
        mesh, axis = Mesh(np.array(jax.devices()[:ring * group]).reshape(ring, group), ("ring", "a2a")), ("ring", "a2a")
    else:
        mesh, axis = Mesh(np.array(jax.devices()[:ring]), ("sp",)), "sp"
    seg = jnp.asarray(rows)
    batch, length = rows.shape
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((batch, length, heads[0], 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, length, heads[1], 16)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    attn = get_tuned_ring_attention(axis_name=axis, causal=causal, sliding_window=window, mesh=mesh,
                                    layout="documents")

    def loss(q, k, v, seg):  # the ids an argument: as constants XLA would fold the plan at compile time
        out, lse = attn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
        return jnp.vdot(out, w), (out, lse)

    def dense_loss(q, k, v, seg):
        out, lse = dense_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal,
                                   sliding_window=window)
        return jnp.vdot(out, w.astype(jnp.float64)), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, seg)
    with jax.enable_x64(True):
        f64 = [np.asarray(x, np.float64) for x in (q, k, v)]  # on the host: no cast program a shape
        (_, (ref_out, ref_lse)), ref_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2),
                                                                        has_aux=True))(*f64, seg)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_loader_in_the_documents_layout_matches_dense():
    """Two rows packed differently, GQA, ring 4. The first row's layout is none of the fixed ones: the
    documents plan is what runs."""
    rows = segment_ids([384, 32, 32, 32, 32], [40, 300, 60, 112])
    order = layouts.document_order(rows, 4, tile=64)[0]  # the loader's default tile for packed rows
    assert not any(np.array_equal(order, layouts.global_order(name, 512, 4)) for name in layouts.LAYOUTS)
    _check_against_dense(rows, 4, (4, 2), True, None)


def test_over_two_mesh_axes_the_ring_positions_are_laid_out_from_the_documents():
    """A 2 x 2 mesh (ring positions x all-to-all group), two rows packed differently: each ring position's
    slots are cut over its group, and the result is exact."""
    _check_against_dense(segment_ids([300, 40, 60, 112], [128, 384]), 2, (4, 2), True, None, group=2)


@pytest.mark.slow
@given(st.lists(st.integers(1, 48), min_size=1, max_size=8), st.sampled_from([2, 4, 8]),
       st.sampled_from([(2, 2), (4, 2), (4, 1)]), st.booleans(), st.sampled_from([None, (12, 0), (6, 6)]))
@settings(max_examples=3)  # about 40 s each under the suite's two workers: the slowest test of the suite
def test_drawn_packings_match_dense(lengths, ring, heads, causal, window):
    """Any packing (its length padded to the ring when it does not divide), ring, GQA ratio and window."""
    _check_against_dense(segment_ids(lengths), ring, heads, causal, window)


def test_given_positions_travel_with_their_tokens():
    """Positions that restart in every document (with segment ids, the same mask) give the result of
    the row's token indices: the layout carries them with the tokens."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    lengths = [40, 24]
    seg = jnp.asarray(segment_ids(lengths))
    restarted = jnp.asarray(np.concatenate([np.arange(n) for n in lengths])[None], jnp.int32)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((1, 64, 2, 8)), jnp.float32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents")
    plain = attn(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
    given_positions = attn(q, q, q, q_segment_ids=seg, kv_segment_ids=seg, q_positions=restarted,
                           kv_positions=restarted)
    np.testing.assert_allclose(given_positions, plain, atol=1e-6)
    explained = attn.explain(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
    assert explained.key in [d.key for d in attn.traced]  # explain() plans the call that runs
    assert "documents layout" in explained.reason


def test_a_call_outside_any_trace_compiles_only_the_tile_its_rows_choose():
    """Called on arrays (not traced), the loader reads the rows' tile before compiling: one ring, the
    tile `explain()` names, where a traced call compiles one per tile and switches in the step. The
    results agree."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    seg = jnp.asarray(segment_ids([32] * 8))  # tiny documents: their rows choose tiles of 16, not 64
    q = jnp.asarray(np.random.default_rng(3).standard_normal((1, 256, 2, 8)), jnp.float32)
    attn = get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents")
    eager = attn(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
    tile = attn.explain(q, q, q, q_segment_ids=seg, kv_segment_ids=seg).config.to_dict()["fwd"]["block_q"]
    assert tile == 16
    assert [d.config.to_dict()["fwd"]["block_q"] for d in attn.traced] == [tile]
    traced = jax.jit(lambda q, s: attn(q, q, q, q_segment_ids=s, kv_segment_ids=s))(q, seg)
    assert len(attn.traced) == len(documents.PACKED_TILES)  # the traced call planned a ring per tile
    np.testing.assert_allclose(eager, traced, atol=1e-6)


def test_bad_input_names_the_argument():
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))
    with pytest.raises(ValueError, match="pass mesh="):
        get_tuned_ring_attention(axis_name="sp", causal=True, layout="documents")
    x = jnp.zeros((1, 16, 1, 8))
    with pytest.raises(ValueError, match="q_segment_ids"):
        get_tuned_ring_attention(axis_name="sp", causal=True, mesh=mesh, layout="documents")(x, x, x)
    with pytest.raises(ValueError, match="multiple of ring_size"):
        layouts.document_order(np.ones((1, 10), np.int32), 4)
    with pytest.raises(ValueError, match="tile"):
        layouts.document_order(np.ones((1, 8), np.int32), 2, tile=0)
    with pytest.raises(ValueError, match=r"segment_ids must be \[batch, length\]"):
        layouts.document_order(np.ones(8, np.int32), 2)
    with pytest.raises(ValueError, match="causal must be True or False, got 'no'"):
        layouts.document_order(np.ones((1, 8), np.int32), 2, causal="no")


def test_a_declared_tile_shortens_every_tiled_default_and_only_with_segment_ids():
    shapes = LocalShapes(batch=1, q_len=512, kv_len=512, heads=4, kv_heads=4, head_dim=64, dtype="float32")
    packed = AttentionSpec(scale=1.0, causal=True, has_segments=True)
    for name in ("scan", "all_to_all", "all_gather"):
        implementation = registry.get(name)
        tiles = [t for part in registry.default_config(implementation, shapes, packed, 16).to_dict().values()
                 for field, t in part.items() if field.startswith("block") and t is not None]
        assert tiles and max(tiles) == 16, (name, tiles)
        plain = AttentionSpec(scale=1.0, causal=True)
        assert registry.default_config(implementation, shapes, plain, 16) == implementation.default_config(shapes,
                                                                                                            plain)
    untiled = registry.get("dense")  # a mechanism with nothing to tune
    assert registry.default_config(untiled, shapes, packed, 16) == untiled.default_config(shapes, packed)


def test_a_permutation_s_gradient_is_the_inverse_permutation():
    """`documents.permute` (every layout's gather) differentiates as the plain gather does, per row and
    for one order of all rows, a batch of 1 broadcast; its backward gathers instead of scattering."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 32, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 32, 3)), jnp.float32)
    rows = jnp.asarray(np.stack([rng.permutation(32), rng.permutation(32)]), jnp.int32)

    def plain(x, order):
        x = jnp.broadcast_to(x, (order.shape[0],) + x.shape[1:])
        return jnp.take_along_axis(x, jnp.broadcast_to(order[:, :, None], x.shape), axis=1)

    inverse = jnp.argsort(rows, axis=-1)
    for laid_out, reference in ((lambda x: documents.lay_out_rows(x, rows), lambda x: plain(x, rows)),
                                (lambda x: documents.restore_rows(x, rows), lambda x: plain(x, inverse))):
        np.testing.assert_array_equal(laid_out(x), reference(x))
        grad, want = (jax.grad(lambda x, f=f: jnp.vdot(jnp.sin(f(x)), w))(x) for f in (laid_out, reference))
        np.testing.assert_allclose(grad, want, rtol=1e-6)
    one = jnp.asarray(rng.permutation(32), jnp.int32)
    grad = jax.grad(lambda x: jnp.vdot(jnp.sin(documents.permute(x, one, 1)), w[:1]))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.vdot(jnp.sin(jnp.take(x, one, axis=1)), w[:1]))(x),
                               rtol=1e-6)
    backward = jax.make_jaxpr(jax.grad(lambda x: documents.permute(x, one, 1).sum()))(x)
    assert "scatter-add" not in str(backward)  # the cotangent is gathered; only the order's inverse is scattered
    assert not re.search(r"f32\[[\d,]*\] = scatter", str(backward)), backward
