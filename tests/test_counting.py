"""`tuner.support.counting.counted_before`: the documents layout's running counts as triangular products,
exact against NumPy's `cumsum` on every axis and across the block boundaries of its recursion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tuner.support.counting import BLOCK, EXACT, counted_before


@pytest.mark.parametrize("length", [1, BLOCK - 1, BLOCK, BLOCK + 1, BLOCK * BLOCK + 5])
def test_it_counts_the_flags_before_each_position(length):
    """Lengths around a block, and one whose blocks' totals are counted in blocks again."""
    flags = np.random.default_rng(length).integers(0, 2, (3, length, 2)).astype(np.int8)
    got = jax.jit(counted_before, static_argnums=1)(flags, 1)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.cumsum(flags, axis=1, dtype=np.int32) - flags)


def test_it_counts_by_products_and_keeps_cumsum_past_float32s_integers():
    """The count is matrix products, no reduce-window (`cumsum` on the TPU); an axis too long for
    float32 to count exactly keeps `cumsum` (lowered only: 2**24 positions)."""
    short = jax.jit(counted_before).lower(jax.ShapeDtypeStruct((4, 131072), jnp.int32)).as_text()
    assert "dot_general" in short and "reduce_window" not in short
    long = jax.jit(counted_before).lower(jax.ShapeDtypeStruct((EXACT,), jnp.int8)).as_text()
    assert "dot_general" not in long and "reduce_window" in long
