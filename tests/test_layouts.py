"""Layouts: positions, lay-out / restore round trips, and clear errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from tuner.semantics import layouts


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("ring", [1, 2, 4, 8])
def test_lay_out_restore_round_trip(layout, ring):
    x = jnp.arange(2 * 16 * ring * 3).reshape(2, 16 * ring, 3)
    laid = layouts.lay_out(x, layout, ring)
    assert not (ring > 1 and layout != "contiguous") or not np.array_equal(laid, x)
    np.testing.assert_array_equal(layouts.restore(laid, layout, ring), x)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_device_positions_match_the_laid_out_order(layout):
    ring, local = 4, 6
    order = layouts.global_order(layout, ring * local, ring)
    assert sorted(order.tolist()) == list(range(ring * local))
    for r in range(ring):
        traced = np.asarray(layouts.local_positions(layout, local, ring, jnp.int32(r)))
        np.testing.assert_array_equal(traced, order[r * local:(r + 1) * local])


def test_zigzag_holds_chunk_r_and_its_mirror():
    np.testing.assert_array_equal(layouts.local_positions_np("zigzag", 4, 4, 1), [2, 3, 12, 13])


def test_zigzag_needs_even_local_length():
    with pytest.raises(ValueError, match="even"):
        layouts.global_order("zigzag", 12, 4)
    with pytest.raises(ValueError, match="even, got 7"):  # gave 7 positions, two of them one chunk's
        layouts.local_positions("zigzag", 7, 4, 0)


def test_unknown_layout_and_bad_lengths():
    with pytest.raises(ValueError, match="layout must be one of"):
        layouts.global_order("spiral", 8, 2)
    with pytest.raises(ValueError, match="layout must be one of"):  # was taken as zigzag
        layouts.local_positions("documents", 8, 2, 0)
    with pytest.raises(ValueError, match="length must be a non-negative int, got -3"):
        layouts.padded_length(-3, 4, "zigzag")
    with pytest.raises(ValueError, match=r"order must be \[B, T\] with T the length of axis 1"):  # took 16 of 32
        layouts.lay_out_rows(jnp.zeros((1, 32)), jnp.zeros((1, 16), jnp.int32))
    with pytest.raises(ValueError, match="multiple of ring_size"):
        layouts.lay_out(jnp.zeros((1, 10)), "contiguous", 4)
