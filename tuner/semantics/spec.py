"""The problem every backend solves: its feature set and the validation of its inputs (DESIGN section 2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tuner.support.checks import check_bool, check_int

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
LAYOUTS = ("contiguous", "zigzag", "striped")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # token positions are int32


@dataclass(frozen=True)
class AttentionSpec:
    """The static features of one attention problem: what is compiled in or out of a kernel.

    Hashable, so it can be a static argument and part of a cache key. Shapes are not part of it.
    """

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    has_segments: bool = False
    has_bias: bool = False
    num_sinks: int = 0

    @property
    def has_position_mask(self) -> bool:
        """True when positions alone can exclude a key (causal, window or chunk)."""
        return self.causal or self.window is not None or self.chunk_size is not None

    @property
    def has_mask(self) -> bool:
        """True when some (query, key) pair may be excluded."""
        return self.has_position_mask or self.has_segments

    def features(self) -> dict[str, Any]:
        """The feature flags as plain values, for cache keys and kernel headers."""
        return {
            "causal": self.causal,
            "window": list(self.window) if self.window is not None else None,
            "chunk_size": self.chunk_size,
            "softcap": self.softcap is not None,
            "segments": self.has_segments,
            "bias": self.has_bias,
            "sinks": self.num_sinks,
        }


@dataclass(frozen=True)
class LocalShapes:
    """The shapes one device's block kernels see: its query shard `[batch, q_len, heads, head_dim]`, key
    shard `[batch, kv_len, kv_heads, head_dim]` and value shard `[batch, kv_len, kv_heads, value_dim]`,
    and their dtype's name.

    `value_head_dim` is the value head dim where it differs from the query/key head dim (multi-head
    latent attention: 192 and 128), else None, so that shapes of equal dims compare, hash and key as
    they always have.
    """

    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    value_head_dim: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.value_head_dim == self.head_dim:
            object.__setattr__(self, "value_head_dim", None)

    @property
    def value_dim(self) -> int:
        """The head dim of the values (and of the output): `value_head_dim`, else `head_dim`."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def head_dims(self) -> tuple[int, ...]:
        """`(head_dim,)`, or `(head_dim, value_head_dim)` where they differ: the dims a block kernel's
        `default_params` takes after the lengths (one written before values could differ takes one)."""
        return (self.head_dim,) if self.value_head_dim is None else (self.head_dim, self.value_head_dim)

    @classmethod
    def of_shards(cls, query: Any, key: Any, value: Any = None) -> LocalShapes:
        """The shapes of a query, a key and a value shard (arrays or `jax.ShapeDtypeStruct`s); without
        `value`, values of the keys' shape."""
        b, tq, h, d = query.shape
        dv = d if value is None else value.shape[3]
        return cls(b, tq, key.shape[1], h, key.shape[2], d, jnp.dtype(query.dtype).name, value_head_dim=dv)


def normalize_window(sliding_window: int | tuple[int, int] | None, *,
                     name: str = "sliding_window") -> tuple[int, int] | None:
    """`w` means `(w, w)`; both sides must be ints from 0 to 2**31 - 1, as the window bounds are int32
    arithmetic on int32 positions. `name` is the argument named in errors."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool):
        sides = (sliding_window, sliding_window)
    elif isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2:
        sides = tuple(sliding_window)
    else:
        raise ValueError(f"{name} must be an int or a (left, right) pair of ints, got {sliding_window!r}")
    for side in sides:
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)) or not 0 <= side <= INT32_MAX:
            raise ValueError(f"{name} must have sides that are ints from 0 to 2**31 - 1 (int32 positions), "
                             f"got {sliding_window!r}")
    return int(sides[0]), int(sides[1])


def clip_window(window: tuple[int, int] | None, span: int, *, causal: bool) -> tuple[int, int] | None:
    """The same window for positions no two of which are more than `span` apart: each side cut to
    `span`, and None (no window) when it excludes no such pair -- both sides reach `span`, or, under
    `causal` (which already excludes every key to the right), the left side does. One problem thus has
    one spec, one cache key and one compiled kernel however long its window is written."""
    if window is None:
        return None
    left, right = min(window[0], span), min(window[1], span)
    if left == span and (right == span or causal):
        return None
    return left, right


def layout_span(ring_size: int, q_len: int, kv_len: int, q_positions: Any = None,
                kv_positions: Any = None) -> int | None:
    """The largest distance between a query and a key position when the layout gives both (positions
    `0 .. ring_size * local length - 1`), for `build_spec(position_span=...)`; None when either side's
    positions are given explicitly (then nothing bounds the distance)."""
    if q_positions is not None or kv_positions is not None:
        return None
    return ring_size * max(q_len, kv_len) - 1


def _check_layout_length(positions: str, ring_size: int, local_len: int) -> None:
    """Raise `ValueError` when a layout cannot number a global sequence of `ring_size * local_len`
    tokens with int32 positions (0 .. 2**31 - 1); `positions` names the argument to give instead."""
    total = ring_size * local_len
    if total > INT32_MAX + 1:
        raise ValueError(f"the global sequence length {ring_size} x {local_len} = {total} is over 2**31 "
                         f"tokens, more than int32 positions can number: pass {positions}")


def check_int32_length(name: str, value: Any, *, numeric: bool = False) -> int | None:
    """`check_int(name, value, optional=True, numeric=numeric)` of a length counted in int32 positions
    (a chunk), so also at most 2**31 - 1."""
    length = check_int(name, value, optional=True, numeric=numeric)
    if length is not None and length > INT32_MAX:
        raise ValueError(f"{name} must be at most 2**31 - 1 (int32 positions), got {value!r}")
    return length


def optional_positive_float(name: str, value: Any) -> float | None:
    """`value` as a float: a Python or NumPy number, or a concrete scalar jax array (`1 / jnp.sqrt(d)`)."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be known when the call is traced (it is a constant of the kernels), got a "
                         f"traced value: compute it with Python or NumPy, outside the jitted function")
    if isinstance(value, jax.Array) and value.shape == () and not jnp.issubdtype(value.dtype, jnp.bool_):
        value = value.item()
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} must be a positive float, got {value!r}")
    return float(value)


def build_spec(
    query: Any,
    *,
    causal: bool,
    sliding_window: int | tuple[int, int] | None,
    chunk_size: int | None,
    logits_soft_cap: float | None,
    softmax_scale: float | None,
    has_segments: bool,
    bias: Any,
    softmax_aux: Any,
    position_span: int | None = None,
) -> AttentionSpec:
    """Check the scalar options and turn them into an `AttentionSpec`.

    `position_span`: the largest distance between any query and any key position, when known (positions
    laid out by a layout: `layout_span`); the window is then clipped to it (`clip_window`), so a window
    at least as long as the sequence gives the spec of no window, and so does a chunk that long.
    """
    check_bool("causal", causal)
    chunk_size = check_int32_length("chunk_size", chunk_size, numeric=True)
    softcap = optional_positive_float("logits_soft_cap", logits_soft_cap)
    softmax_scale = optional_positive_float("softmax_scale", softmax_scale)
    head_dim = query.shape[-1]
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    num_sinks = 0
    if softmax_aux is not None:
        num_sinks = 1 if softmax_aux.ndim == 1 else softmax_aux.shape[1]
    window = normalize_window(sliding_window)
    if position_span is not None:
        window = clip_window(window, position_span, causal=bool(causal))
        if chunk_size is not None and chunk_size > position_span:  # one chunk holds every position
            chunk_size = None
    return AttentionSpec(
        scale=scale,
        causal=bool(causal),
        window=window,
        chunk_size=chunk_size,
        softcap=softcap,
        has_segments=has_segments,
        has_bias=bias is not None,
        num_sinks=num_sinks,
    )


def _check_float(name: str, x: Any) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")


def check_int_dtype(name: str, x: Any) -> None:
    """`TypeError` naming `name` unless the array `x` holds integers (segment ids, positions)."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")


def check_bias_shape(bias: Any, want: tuple[int, int, int, int], axes: str) -> None:
    """`ValueError` unless `bias` is `want` (its `axes`, named in the message) or broadcastable to it."""
    if len(bias.shape) != 4 or any(got not in (1, full) for got, full in zip(bias.shape, want)):
        raise ValueError(f"bias must have shape [{axes}] = {want} or be broadcastable to it (size-1 dims), got "
                         f"{tuple(bias.shape)}")


def _check_int32_values(name: str, x: Any) -> None:
    """Positions are converted to int32: concrete values outside its range raise rather than wrap.
    (Traced values and shapes cannot be looked at; a wider dtype's values must then be in range.)"""
    info = jnp.iinfo(x.dtype)
    concrete = hasattr(x, "__array__") and not isinstance(x, jax.core.Tracer)
    if not concrete or (info.min >= INT32_MIN and info.max <= INT32_MAX):
        return
    values = np.asarray(x)
    if values.min() < INT32_MIN or values.max() > INT32_MAX:
        raise ValueError(f"{name} must be int32 positions, from -2**31 to 2**31 - 1, got values from "
                         f"{values.min()} to {values.max()}")


def check_arrays(query: Any, key: Any, value: Any) -> None:
    """Raise `ValueError` / `TypeError` naming the argument where `query`, `key` and `value` are not three
    non-empty float arrays of one dtype, `[B, Tq, H, D]`, `[B, Tk, Hkv, D]` and `[B, Tk, Hkv, Dv]` with `Hkv`
    dividing `H`: shards or global arrays alike."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have rank 4 [batch, length, heads, head_dim], got shape "
                             f"{getattr(x, 'shape', None)}")
        _check_float(name, x)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                        f"{value.dtype}")
    b, tq, h, d = query.shape
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must have the same batch, length and heads [batch, length, kv_heads], "
                         f"got {key.shape} and {value.shape}")
    _, tk, hkv, _ = key.shape
    if key.shape[0] != b:
        raise ValueError(f"key batch {key.shape[0]} does not match query batch {b}")
    if key.shape[3] != d:
        raise ValueError(f"key head_dim {key.shape[3]} does not match query head_dim {d}")
    if min(b, tq, tk, h, hkv, d, value.shape[3]) == 0:
        raise ValueError(f"query {query.shape}, key {key.shape} and value {value.shape} must have no empty "
                         f"dimension")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")


def check_call_arrays(**arrays: Any) -> None:
    """`TypeError` naming the argument for a per-call option (segment ids, positions, `softmax_aux`, `bias`)
    given as something other than an array, and `ValueError` unless the segment ids come as a pair: before
    anything reads their shapes, on shards and global arrays alike."""
    for name, x in arrays.items():
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
    if (arrays.get("q_segment_ids") is None) != (arrays.get("kv_segment_ids") is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together (or neither): for "
                         "self-attention pass the same array as both")


def check_inputs(
    query: Any,
    key: Any,
    value: Any,
    *,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    q_positions: Any,
    kv_positions: Any,
    softmax_aux: Any,
    bias: Any,
    ring_size: int,
) -> None:
    """Raise `ValueError` / `TypeError` naming the argument for every malformed input.

    Shapes are the local shards: `query [B, Tq, H, D]`, `key [B, Tk, Hkv, D]`, `value [B, Tk, Hkv, Dv]` (the
    value head dim may differ from the query/key one, as in multi-head latent attention); `bias` spans the
    global key axis (`ring_size * Tk`). Positions not given come from a layout, which numbers at most
    2**31 tokens.
    """
    check_arrays(query, key, value)
    check_call_arrays(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                      kv_positions=kv_positions, softmax_aux=softmax_aux, bias=bias)
    b, tq, h, _ = query.shape
    tk = key.shape[1]

    for name, x, t in (("q_segment_ids", q_segment_ids, tq), ("kv_segment_ids", kv_segment_ids, tk),
                       ("q_positions", q_positions, tq), ("kv_positions", kv_positions, tk)):
        if x is None:
            continue
        check_int_dtype(name, x)
        if x.shape != (b, t):
            raise ValueError(f"{name} must have shape [batch, length] = {(b, t)}, got {x.shape}")
    for name, x, t in (("q_positions", q_positions, tq), ("kv_positions", kv_positions, tk)):
        if x is None:
            _check_layout_length(name, ring_size, t)
        else:
            _check_int32_values(name, x)

    if softmax_aux is not None:
        _check_float("softmax_aux", softmax_aux)
        if not (softmax_aux.ndim in (1, 2) and softmax_aux.shape[0] == h
                and (softmax_aux.ndim == 1 or softmax_aux.shape[1] > 0)):
            raise ValueError(f"softmax_aux must have shape [heads] = ({h},) or [heads, n] = ({h}, n), "
                             f"got {softmax_aux.shape}")
    if bias is not None:
        _check_float("bias", bias)
        check_bias_shape(bias, (b, h, tq, tk * ring_size), "batch, heads, q_length, global kv_length")
