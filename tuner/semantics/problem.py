"""What the tuner tunes: one ring attention problem (global shape, features, ring) and its cache key.

A `Problem` is the user's description (global sequence length, ring size, layout, feature options);
`ProblemKey` is what the cache stores and looks up (DESIGN section 8): the local shapes each device
sees, the dtype, the feature flags, the device kind, ring size, layout and backend. The runtime loader
builds the same key from the shapes it is traced with, so a search and a training job meet on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.semantics import layouts
from tuner.semantics.packing import Packing
from tuner.support.checks import check_bool, check_int
from tuner.semantics.spec import (INT32_MAX, LAYOUTS, AttentionSpec, LocalShapes, check_int32_length, clip_window,
                        normalize_window)

DTYPES = ("float32", "bfloat16", "float16")
OBJECTIVES = ("fwd", "bwd", "fwd+bwd")
DEVICES = ("cpu", "gpu", "tpu")
SAMPLERS = ("tpe", "gp", "random", "grid")


@dataclass(frozen=True)
class Problem:
    """One attention problem over a ring: global shapes, dtype, features, ring size and layout.

    `ring_size` is every device the sequence is split over; `a2a_size` > 1 makes it a problem over two mesh
    axes (the hybrid's, or another implementation's over two): `ring_size / a2a_size` ring positions, each a
    group of `a2a_size` devices, the layout over the ring positions.
    `value_head_dim` is the head dim of the values where it differs from `head_dim`, the query/key one
    (multi-head latent attention), else None. `packing` is how the documents of a row are drawn
    (`tuner.semantics.packing.Packing`'s text; `segments` is then its document count), else None: with
    `segments` > 0, that many documents cut at random points, a packing the key does not name. `drawn` is
    a packing the search draws the rows from where the key names none (`segments` > 0, `packing` None):
    the documents `tuner.autotune` saw a program's undeclared packed calls get, so that their key is tuned
    on them.
    `segments` is the number of packed documents per batch row (0: no segment ids); `sinks` the number
    of sink logits per head (0: none); `window` is `(left, right)` or None, kept as `clip_window` leaves
    it for a `seq_len`-token sequence (a window at least that long is None, and so is a chunk), as
    `ring_attention` does with positions from the layout -- so a search and the runtime build the same
    key.
    """

    batch: int = 1
    seq_len: int = 2048
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = True
    window: tuple[int, int] | None = None
    chunk_size: int | None = None
    segments: int = 0
    softcap: float | None = None
    sinks: int = 0
    ring_size: int = 4
    layout: str = "zigzag"
    a2a_size: int = 1
    value_head_dim: int | None = None
    packing: str | None = None
    drawn: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "ring_size", "a2a_size"):
            check_int(name, getattr(self, name))
        check_bool("causal", self.causal)
        if check_int("value_head_dim", self.value_head_dim, optional=True) == self.head_dim:
            object.__setattr__(self, "value_head_dim", None)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.seq_len % self.ring_size:
            raise ValueError(f"seq_len={self.seq_len} must be divisible by ring_size={self.ring_size}")
        if self.ring_size % self.a2a_size:
            raise ValueError(f"a2a_size={self.a2a_size} must divide ring_size={self.ring_size}: the ring positions "
                             f"are groups of a2a_size devices")
        layouts.check_layout(self.layout, self.a2a_size * self.local_len)
        if self.seq_len > INT32_MAX + 1:
            raise ValueError(f"seq_len must be at most 2**31 (int32 positions), got {self.seq_len}")
        window = normalize_window(self.window, name="window")
        object.__setattr__(self, "window", clip_window(window, self.seq_len - 1, causal=self.causal))
        if check_int32_length("chunk_size", self.chunk_size) is not None and self.chunk_size >= self.seq_len:
            object.__setattr__(self, "chunk_size", None)  # one chunk holds the whole sequence: no chunk mask
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be a positive number, got {self.softcap!r}")
        for name in ("segments", "sinks"):
            check_int(name, getattr(self, name), non_negative=True)
        if self.packing is not None:
            packing = self._checked_packing("packing")
            if self.segments not in (0, packing.documents):
                raise ValueError(f"segments={self.segments} does not match the packing's {packing.documents} "
                                 f"documents; leave segments 0 with a packing")
            object.__setattr__(self, "packing", packing.describe())
            object.__setattr__(self, "segments", packing.documents)
        if self.segments > self.seq_len:
            raise ValueError(f"segments={self.segments} cannot exceed seq_len={self.seq_len} "
                             f"(every packed document needs a token)")
        if self.drawn is not None:
            if self.packing is not None or not self.segments:
                raise ValueError(f"drawn={self.drawn!r} draws the rows of a packed problem whose key names no "
                                 f"packing: it needs segments > 0 and packing None")
            object.__setattr__(self, "drawn", self._checked_packing("drawn").describe())

    def _checked_packing(self, name: str) -> Packing:
        """The packing the field `name` writes, checked to fill a row of `seq_len` tokens; `ValueError`
        naming the field."""
        text = getattr(self, name)
        try:
            packing = Packing.parse(text)
            packing.check(self.seq_len)
        except ValueError as error:
            raise ValueError(f"{name}={text!r}: {error}") from None
        return packing

    @property
    def local_len(self) -> int:
        """Tokens per device: the local query and key length."""
        return self.seq_len // self.ring_size

    @property
    def ring_positions(self) -> int:
        """Positions on the ring the layout is over: `ring_size`, or over two axes `ring_size / a2a_size`."""
        return self.ring_size // self.a2a_size

    @property
    def group(self) -> int | None:
        """The size of the second mesh axis of a problem over two (`a2a_size` > 1), else None."""
        return self.a2a_size if self.a2a_size > 1 else None

    @property
    def value_dim(self) -> int:
        """The head dim of the values (and of the output): `value_head_dim`, else `head_dim`."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def documents(self) -> Packing | None:
        """How a row's documents are drawn: the packing (or `drawn`), else `segments` documents cut uniformly
        at random (seed 0), else None (no segment ids)."""
        if self.packing is not None or self.drawn is not None:
            return Packing.parse(self.packing or self.drawn)
        return Packing("uniform", count=self.segments) if self.segments else None

    @property
    def shapes(self) -> LocalShapes:
        """What each device's block kernels see."""
        return LocalShapes(self.batch, self.local_len, self.local_len, self.heads, self.kv_heads, self.head_dim,
                           self.dtype, value_head_dim=self.value_head_dim)

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(scale=self.head_dim**-0.5, causal=self.causal, window=self.window,
                             chunk_size=self.chunk_size, softcap=self.softcap,
                             has_segments=self.segments > 0, num_sinks=self.sinks)

    def describe(self) -> str:
        """One line: shapes, dtype and the features that are on."""
        extras = [name for name, on in (("causal", self.causal), (f"window={self.window}", self.window),
                                        (f"chunk={self.chunk_size}", self.chunk_size),
                                        (f"segments={self.segments}", self.segments),
                                        (f"packing={self.packing}", self.packing),
                                        (f"drawn={self.drawn}", self.drawn),
                                        (f"softcap={self.softcap}", self.softcap),
                                        (f"sinks={self.sinks}", self.sinks)) if on]
        dims = f"D={self.head_dim}" + (f" Dv={self.value_head_dim}" if self.value_head_dim is not None else "")
        return (f"B={self.batch} T={self.seq_len} H={self.heads} Hkv={self.kv_heads} {dims} "
                f"{self.dtype} {' '.join(extras) or 'full'} | ring {self.ring_positions} x "
                f"{f'a2a {self.a2a_size} x ' if self.a2a_size > 1 else ''}{self.local_len} "
                f"tokens, {self.layout}")

    @classmethod
    def parse(cls, text: str) -> Problem:
        """The problem `describe()` wrote as `text`; `ValueError` saying what does not parse."""
        match = _DESCRIPTION.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"not a problem description (B=.. T=.. H=.. Hkv=.. D=.. dtype features | ring N x M "
                             f"tokens, layout): {str(text)[:80]!r}")
        fields = dict(batch=int(match["batch"]), seq_len=int(match["seq_len"]), heads=int(match["heads"]),
                      kv_heads=int(match["kv_heads"]), head_dim=int(match["head_dim"]), dtype=match["dtype"],
                      value_head_dim=int(match["value_head_dim"]) if match["value_head_dim"] else None,
                      ring_size=int(match["ring"]) * int(match["a2a"] or 1), a2a_size=int(match["a2a"] or 1),
                      layout=match["layout"], causal=False)
        features = re.sub(r"\((\d+), (\d+)\)", r"(\1,\2)", match["features"])  # a window's "(left, right)"
        for word in features.split(" ") if features != "full" else ():
            name, _, value = word.partition("=")
            if name == "causal" and not value:
                fields["causal"] = True
            elif name == "window" and re.fullmatch(r"\(\d+,\d+\)", value):
                fields["window"] = tuple(int(v) for v in value[1:-1].split(","))
            elif name in ("chunk", "segments", "sinks") and value.isdigit():
                fields[{"chunk": "chunk_size"}.get(name, name)] = int(value)
            elif name == "softcap" and value:
                fields["softcap"] = float(value)
            elif name in ("packing", "drawn") and value:
                fields[name] = value
            else:
                raise ValueError(f"unknown feature {word!r} in problem description {text[:80]!r}")
        problem = cls(**fields)
        if problem.describe() != text.strip():
            raise ValueError(f"problem description {text[:80]!r} does not describe one problem")
        return problem


_DESCRIPTION = re.compile(r"B=(?P<batch>\d+) T=(?P<seq_len>\d+) H=(?P<heads>\d+) Hkv=(?P<kv_heads>\d+) "
                          r"D=(?P<head_dim>\d+) (?:Dv=(?P<value_head_dim>\d+) )?(?P<dtype>\w+) (?P<features>.+?) "
                          r"\| ring (?P<ring>\d+) x "
                          r"(?:a2a (?P<a2a>\d+) x )?\d+ tokens, (?P<layout>\w+)")


def key_layout(layout: str, ring_size: int) -> str:
    """The layout a cache key records: every layout of a one-device ring holds the tokens in order, so
    such a key says "contiguous" whatever the layout asked for."""
    return layout if ring_size > 1 else "contiguous"


@dataclass(frozen=True)
class ProblemKey(LocalShapes):
    """The cache key of DESIGN section 8, less the versions (those decide staleness, not identity): one
    device's shapes, and the implementation, device kind, ring and features they run with; `packing`, the
    packing of the documents where the call declares one (`Problem.packing`), else None."""

    backend: str
    device_kind: str
    ring_size: int
    layout: str
    features: dict[str, Any] = field(default_factory=dict)
    op: str = "ring_attention"
    packing: str | None = field(default=None, kw_only=True)

    @classmethod
    def of(cls, shapes: LocalShapes, spec: AttentionSpec, *, backend: str, device_kind: str, ring_size: int,
           layout: str, packing: str | None = None) -> ProblemKey:
        """The key of one device's shapes and the spec on a ring of `ring_size` in `layout`, with segment ids
        packed as `packing` says (`tuner.registry.key` builds every key through it, from what the
        implementation is tuned for)."""
        if packing is not None and not spec.has_segments:
            raise ValueError(f"packing={packing!r} describes packed documents, but the call has no segment ids")
        return cls(**asdict(shapes), backend=backend, device_kind=device_kind, ring_size=ring_size,
                   layout=key_layout(layout, ring_size), features=spec.features(), packing=packing)

    def as_dict(self) -> dict[str, Any]:
        """The key's fields; `value_head_dim` and `packing` only where they are set, so that the keys of calls
        without them keep the digests (and cache rows) they had before either existed."""
        fields_ = asdict(self)
        for name in ("value_head_dim", "packing"):
            if fields_[name] is None:
                del fields_[name]
        return fields_

    @property
    def digest(self) -> str:
        """A stable 16-hex-digit id of the key, the primary key of its cache row."""
        text = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def family(self) -> tuple:
        """What must match for a tuned entry to be borrowed by a nearby shape (nearest lookup)."""
        return (self.op, self.backend, self.device_kind, self.head_dim, self.value_dim, self.dtype,
                json.dumps(self.features, sort_keys=True), self.packing)

    def distance(self, other: ProblemKey) -> float:
        """How far apart two shapes of one family are: summed |log2 ratio| of the size fields."""
        fields = ("batch", "q_len", "kv_len", "heads", "kv_heads", "ring_size")
        return sum(abs(math.log2(getattr(self, f) / getattr(other, f))) for f in fields) + (
            0.5 if self.layout != other.layout else 0.0)
