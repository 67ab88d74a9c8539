"""Any global length over a ring: pad the sequence to a length the layout splits evenly, run, and strip
the padding. The loader with `mesh=` does it; on local shards, pad the global arrays with `Padding`
(`tuner.layouts.Padding`) before sharding them.

A pad token reads nothing useful and no real query reads it:

- causal, queries and keys of one length, no positions given: the pad tokens take the positions after
  the last token, which the causal mask keeps every real query from reading. A pad query reads real
  keys, but its output is stripped, so its gradient is zero and nothing flows back from it.
- otherwise: segment ids mark them (the call's own, or all zeros for the real tokens): pad queries get
  an id below every real one, pad keys another, so no pair with a pad token is allowed (out 0 and lse
  -inf on the pad rows, which are stripped). Given positions are padded with their last value, which
  leaves every tile's position range as it was. Segment ids must then stay above `-2**31 + 2`.

Padding costs the pad tokens' share of the work: at most `multiple - 1` tokens, where `multiple` is the
number of devices (twice that for zigzag, whose devices hold two equal chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from tuner.support.checks import check_int
from tuner.semantics.spec import INT32_MIN, check_bias_shape

QUERY_SIDE = ("q_segment_ids", "q_positions")
KEY_SIDE = ("kv_segment_ids", "kv_positions")


def padded_length(length: int, devices: int, layout: str) -> int:
    """The shortest global length of at least `length` that `layout` splits evenly over `devices`: a
    multiple of `devices`, of twice that for zigzag (each device holds two equal chunks)."""
    check_int("length", length, non_negative=True, numeric=True)
    multiple = check_int("devices", devices, numeric=True) * (2 if layout == "zigzag" else 1)
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class Padding:
    """The lengths of a call before (`q_len`, `kv_len`) and after (`q_to`, `kv_to`) padding."""

    q_len: int
    kv_len: int
    q_to: int
    kv_to: int
    by_position: bool  # the causal mask keeps the pad keys unread; else segment ids do

    @classmethod
    def of(cls, query, key, options: dict[str, Any], *, devices: int, layout: str, causal: bool) -> Padding:
        """What `layout` over `devices` needs for these global arrays."""
        q_len, kv_len = query.shape[1], key.shape[1]
        for names, length, side in ((QUERY_SIDE, q_len, "query"), (KEY_SIDE, kv_len, "key")):
            for name in names:
                x = options.get(name)
                if x is not None and (len(x.shape) != 2 or x.shape[1] != length):
                    raise ValueError(f"{name} must be [batch, {side} length {length}], got shape {tuple(x.shape)}")
        if options.get("bias") is not None:
            check_bias_shape(options["bias"], (query.shape[0], query.shape[2], q_len, kv_len),
                             "batch, heads, query length, key length")
        by_position = (causal and q_len == kv_len and options.get("q_positions") is None
                       and options.get("kv_positions") is None)
        return cls(q_len, kv_len, padded_length(q_len, devices, layout), padded_length(kv_len, devices, layout),
                   by_position)

    @property
    def needed(self) -> bool:
        return (self.q_to, self.kv_to) != (self.q_len, self.kv_len)

    def describe(self) -> str:
        """The padding and its cost, for `explain()`."""
        share = (self.q_to * self.kv_to) / (self.q_len * self.kv_len) - 1
        how = ("positions after the last token, which causal queries cannot read" if self.by_position
               else "segment ids no real token shares")
        return (f"padded to {self.q_to} query and {self.kv_to} key tokens (from {self.q_len} and {self.kv_len}; "
                f"{share:.1%} more logits), pad tokens marked by {how}")

    def pad(self, query, key, value, options: dict[str, Any]):
        """The padded `(query, key, value, options)`."""
        options = dict(options)
        query = pad_to(query, 1, self.q_to)
        key, value = (pad_to(x, 1, self.kv_to) for x in (key, value))
        for name in ("q_positions", "kv_positions"):
            if options.get(name) is not None:
                options[name] = pad_to(options[name], 1, self.q_to if name[0] == "q" else self.kv_to, "edge")
        q_seg, kv_seg = options.get("q_segment_ids"), options.get("kv_segment_ids")
        if self.by_position:
            if q_seg is not None:
                options["q_segment_ids"] = pad_to(q_seg, 1, self.q_to, "edge")
                options["kv_segment_ids"] = pad_to(kv_seg, 1, self.kv_to, "edge")
        elif self.needed:  # unpadded, a call without segment ids keeps none: they would change its problem
            if q_seg is None:
                q_seg = jnp.zeros((query.shape[0], self.q_len), jnp.int32)
                kv_seg = jnp.zeros((key.shape[0], self.kv_len), jnp.int32)
            lowest = jnp.maximum(jnp.minimum(q_seg.min(), kv_seg.min()), INT32_MIN + 2)
            options["q_segment_ids"] = pad_to(q_seg, 1, self.q_to, value=lowest - 1)
            options["kv_segment_ids"] = pad_to(kv_seg, 1, self.kv_to, value=lowest - 2)
        bias = options.get("bias")
        if bias is not None:
            if bias.shape[2] > 1:
                bias = pad_to(bias, 2, self.q_to)
            if bias.shape[3] > 1:
                bias = pad_to(bias, 3, self.kv_to)
            options["bias"] = bias
        return query, key, value, options

    def strip(self, result, return_lse: bool):
        """The call's result without the pad rows."""
        if return_lse:
            out, lse = result
            return out[:, :self.q_len], lse[:, :, :self.q_len]
        return result[:, :self.q_len]


def pad_to(x, axis: int, length: int, mode: str = "constant", value: Any = 0):
    """`x` with its `axis` padded at the end to `length`: with `value`, or with `mode="edge"` its last
    entry repeated (positions and segment ids, whose ranges then stay as they were)."""
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


__all__ = ["Padding", "pad_to", "padded_length"]
