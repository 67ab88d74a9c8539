"""How the cudnn kernel (`tuner.kernels.cudnn`) cuts a ring step's block into chunk pairs, and which
cuDNN call each pair runs.

cuDNN takes one mask per call, fixed when the program is built. Under a position mask the block is cut
into `block_q` x `block_kv` chunks, and each chunk pair is of one kind:

    SKIP      no query may read any key of the pair: nothing runs
    FULL      every query may read every key: cuDNN without a mask
    DIAGONAL  the pair's queries and keys hold the same rising positions (consecutive under a window):
              cuDNN causal (+ window); a ring step's own keys, under a causal mask, are one such pair
    GENERAL   anything else: the scan kernel, exact for every mask

Where the trace knows the positions (`tuner.semantics.known`), a pair whose kind every known case shares
runs that kind's call directly (`plan`, `decided`); the others are classified on the device, under
`lax.switch` (`pair_kind`). Where, in every known case, exactly one of the undecided pairs runs and always as
the same kind (the zigzag ring's steps past the first: a query half reads the low or the high half of the
visiting keys by which device sent them), the device runs that one pair, found from its positions
(`chosen_offsets`) and read at offsets (`at`), with no branch. Where the block is cut in halves, that pair
and the one that always runs are instead one call on prefixes of the queries (halves swapped) and of the
keys (`halves_as_prefixes`): XLA:GPU copies every slice it feeds to cuDNN, and this one reads none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tuner.semantics import masks
from tuner.semantics.known import KnownBlock
from tuner.semantics.spec import AttentionSpec
from tuner.support import arrays, vma

SKIP, FULL, DIAGONAL, GENERAL = range(4)


def row_kinds(spec: AttentionSpec, q_pos, kv_pos):
    """The `SKIP` / `FULL` / `DIAGONAL` / `GENERAL` of a chunk pair in each row of its `[B, T]` positions, in the
    library of the positions (NumPy on the positions the trace knows, `arrays.namespace`)."""
    xp = arrays.namespace(q_pos, kv_pos)
    q_lo, q_hi, k_lo, k_hi = q_pos.min(axis=1), q_pos.max(axis=1), kv_pos.min(axis=1), kv_pos.max(axis=1)
    may = masks.ranges_may_attend(q_lo, q_hi, k_lo, k_hi, None, spec)
    every = masks.ranges_fully_allowed(q_lo, q_hi, k_lo, k_hi, None, spec)
    diagonal = xp.zeros(may.shape, bool)
    if q_pos.shape[1] == kv_pos.shape[1]:
        # cuDNN's causal mask compares indices; so does its window, which positions must then step by one
        rising = q_pos[:, 1:] - q_pos[:, :-1]
        rising = rising > 0 if spec.window is None else rising == 1
        diagonal = xp.all(q_pos == kv_pos, axis=1) & xp.all(rising, axis=1)
    kinds = xp.where(every, FULL, xp.where(diagonal, DIAGONAL, GENERAL))
    return xp.where(may, kinds, SKIP).astype(xp.int32)


def pair_kind(spec: AttentionSpec, q_pos, kv_pos):
    """The kind every row of the batch shares (one cuDNN call covers them all), else `GENERAL`."""
    kinds = row_kinds(spec, q_pos, kv_pos)
    return jnp.where(jnp.all(kinds == kinds[0]), kinds[0], GENERAL)


def known_kind(spec: AttentionSpec, known: KnownBlock | None) -> int | None:
    """The kind of a chunk pair in every case the trace knows of (`tuner.semantics.known`), else None:
    the device decides."""
    return None if known is None else known.agreed(functools.partial(row_kinds, spec))


def switch(kind, branches, reference, *operands):
    """`lax.switch` over `branches`, each one's results varying over `reference`'s manual axes (so that
    the zeros of `SKIP` match the kernels' results inside `shard_map`)."""
    def varying(branch):
        return lambda *args: jax.tree.map(lambda x: vma.like(x, reference), branch(*args))

    return lax.switch(kind, [varying(branch) for branch in branches], *operands)


def chunks(x, size: int, axis: int = 1) -> list:
    """`x` cut along `axis` into pieces of `size`."""
    return [lax.slice_in_dim(x, start, start + size, axis=axis) for start in range(0, x.shape[axis], size)]


def decided(kind: int | None, spec: AttentionSpec, branches: tuple, reference, q_pos, kv_pos, *operands):
    """A chunk pair's results: the branch of `kind`, the kind the trace knows, or with None a `lax.switch`
    on the kind the device finds from the positions (`switch`)."""
    if kind is None:
        return switch(pair_kind(spec, q_pos, kv_pos), branches, reference, *operands, q_pos, kv_pos)
    return jax.tree.map(lambda x: vma.like(x, reference), branches[kind](*operands, q_pos, kv_pos))


def cut(known: KnownBlock | None, q_start: int, q_size: int, kv_start: int, kv_size: int) -> KnownBlock | None:
    """The known cases of one chunk pair of the block."""
    return None if known is None else known.chunk(q_start, q_size, kv_start, kv_size)


def one_of(spec: AttentionSpec, known: KnownBlock | None, pairs: list, size_q: int, size_kv: int) -> int | None:
    """The kind (`FULL` or `DIAGONAL`) where, in every case the trace knows, exactly one of chunk pairs
    `pairs` (`(i, j)` each) is of that kind and the others `SKIP`; else None. Then the device runs that one
    pair, chosen by `chosen_offsets`, with no branch (the zigzag ring's steps past the first: a query half reads
    either the low or the high half of the visiting keys, whole, by which device sent them)."""
    if known is None or len(pairs) < 2:
        return None

    agreed = known.agreed(functools.partial(_one_running, spec, tuple(pairs), size_q, size_kv))
    return agreed if agreed in (FULL, DIAGONAL) else None


def _one_running(spec: AttentionSpec, pairs: tuple, size_q: int, size_kv: int, q, kv):
    """In each case (the trace's known positions, NumPy), the kind of the one pair of `pairs` that runs; -1
    where none or several do."""
    kinds = np.stack([row_kinds(spec, q[:, i * size_q:(i + 1) * size_q], kv[:, j * size_kv:(j + 1) * size_kv])
                      for i, j in pairs])
    runs = kinds != SKIP
    return np.where(runs.sum(axis=0) == 1, np.max(np.where(runs, kinds, -1), axis=0), -1)


def chosen_offsets(spec: AttentionSpec, pairs: list, size_q: int, size_kv: int, q_pos, kv_pos) -> tuple:
    """The query and key offsets of the one pair of `pairs` that runs on this device (`one_of`)."""
    runs = jnp.stack([pair_kind(spec, lax.slice_in_dim(q_pos, i * size_q, (i + 1) * size_q, axis=1),
                            lax.slice_in_dim(kv_pos, j * size_kv, (j + 1) * size_kv, axis=1)) != SKIP
                      for i, j in pairs])
    index = jnp.argmax(runs)
    return (jnp.asarray([i * size_q for i, _ in pairs])[index], jnp.asarray([j * size_kv for _, j in pairs])[index])


def plan(spec: AttentionSpec, known: KnownBlock | None, q_len: int, kv_len: int, size_q: int, size_kv: int
         ) -> tuple[dict, list, int | None]:
    """The block's chunk pairs as the trace decides them: `{(i, j): kind}` of those that run by themselves
    (the kind the trace knows; None, a `switch` on the device), then the pairs of which one runs on each
    device, and its kind (`one_of`; chunks of equal sizes only), or `[]` and None."""
    kinds = {(i, j): known_kind(spec, cut(known, i * size_q, size_q, j * size_kv, size_kv))
             for i in range(-(-q_len // size_q)) for j in range(-(-kv_len // size_kv))}
    kinds = {pair: kind for pair, kind in kinds.items() if kind != SKIP}
    undecided = [pair for pair, kind in kinds.items() if kind is None]
    even = q_len % size_q == 0 and kv_len % size_kv == 0  # a shorter last chunk cannot be read at an offset
    one = one_of(spec, known, undecided, size_q, size_kv) if even else None
    if one is None:
        return kinds, [], None
    return {pair: kind for pair, kind in kinds.items() if kind is not None}, undecided, one


def halves_as_prefixes(kinds: dict, candidates: list, one: int | None, q_chunks: int, kv_chunks: int) -> bool:
    """Whether a block cut in halves runs, on every device, the pair of high queries and low keys and one
    of the two pairs on the diagonal of chunks, low with low or high with high (`plan`'s answer: the zigzag
    ring's steps past the first). With the query halves swapped, the pairs that run are then a prefix of
    the queries against a prefix of the keys: every query against the low keys, or the high queries against
    every key. That is one cuDNN call under a padding mask (`prefix_lengths`), which reads q with its halves
    swapped, and k and v as they are: no slice of them."""
    return (q_chunks == kv_chunks == 2 and one == FULL and sorted(candidates) == [(0, 0), (1, 1)]
            and kinds == {(1, 0): FULL})


def prefix_lengths(spec: AttentionSpec, candidates: list, q_pos, kv_pos, size_q: int, size_kv: int) -> tuple:
    """The query and key lengths, int32 `[B]` each, of the padding mask of a block whose halves run as
    prefixes (`halves_as_prefixes`) on this device: every query and the low keys where the low queries read
    the low keys, else the high queries and every key."""
    at_q, _ = chosen_offsets(spec, candidates, size_q, size_kv, q_pos, kv_pos)
    low = at_q == 0
    rows = jnp.where(low, 2 * size_q, size_q).astype(jnp.int32)
    keys = jnp.where(low, size_kv, 2 * size_kv).astype(jnp.int32)
    batch = q_pos.shape[0]
    return jnp.broadcast_to(rows, (batch,)), jnp.broadcast_to(keys, (batch,))


def swapped(x, axis: int = 1):
    """`x` with its two halves along `axis` swapped (its own inverse)."""
    half = x.shape[axis] // 2
    return jnp.concatenate([lax.slice_in_dim(x, half, x.shape[axis], axis=axis),
                            lax.slice_in_dim(x, 0, half, axis=axis)], axis=axis)


def at(x, start, size: int, axis: int = 1):
    """`size` entries of `x` along `axis` from `start`, a value on the device."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def added_at(x, y, start, axis: int = 1):
    """`x` with `y` added along `axis` from `start`, a value on the device."""
    return lax.dynamic_update_slice_in_dim(x, at(x, start, y.shape[axis], axis) + y, start, axis=axis)
