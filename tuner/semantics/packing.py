"""Packings: the lengths of the documents packed into one batch row, as a search tunes them.

A packed problem's speed depends on its documents' lengths: the ring skips the tiles whose position and
segment ranges cannot meet, so many short documents leave most tiles skipped, one long document few. A
`Packing` says how the documents of a row are drawn, in a one-line text form that `tuner search
--documents` takes and a problem description keeps:

- `2048,128x16`: fixed lengths, in token order (`NxK` is K documents of N tokens); they must fill the row;
- `lognormal:14` (or `lognormal:14,sigma=1.5,seed=3`): 14 documents whose lengths are drawn log-normally
  (sigma 1 unless given) and scaled to fill the row, drawn again for every row from the seed;
- `uniform:8` (or `uniform:8,seed=3`): 8 documents cut at uniformly random points, what `--segments 8` does.

`segment_ids` gives the rows' segment ids in token order (ids 1, 2, ... in each row). `of_segment_ids`
reads the first row's documents as a fixed packing, `fit` the packing to declare for rows a data pipeline
draws (their fixed packing, or a log-normal one fitted to their lengths), and `statistics` says what a
packing is like.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

KINDS = ("fixed", "lognormal", "uniform")
FIT_SIGMA_FLOOR = 0.05  # `Packing.fit`'s least spread: rows of near-equal documents whose counts differ
_FIXED = re.compile(r"\d+(x\d+)?(,\d+(x\d+)?)*")
_DRAWN = re.compile(r"(?P<kind>lognormal|uniform):(?P<count>\d+)(?P<options>(,(sigma|seed)=[^,]+)*)")


@dataclass(frozen=True)
class Packing:
    """How the documents of a batch row are drawn: `kind` "fixed" with `lengths`, or "lognormal" /
    "uniform" with `count` documents, a log-normal `sigma` and a `seed` (module docstring)."""

    kind: str
    lengths: tuple[int, ...] = ()
    count: int = 0
    sigma: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"packing kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "fixed":
            if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
                raise ValueError(f"a fixed packing needs positive document lengths, got {self.lengths!r}")
        elif not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"a {self.kind} packing needs a positive document count, got {self.count!r}")
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"sigma must be a positive number, got {self.sigma!r}")

    @classmethod
    def parse(cls, text: str) -> Packing:
        """The packing `text` writes (module docstring); `ValueError` saying what does not parse."""
        text = text.strip() if isinstance(text, str) else ""
        if _FIXED.fullmatch(text):
            lengths: list[int] = []
            for part in text.split(","):
                size, _, times = part.partition("x")
                lengths += [int(size)] * int(times or 1)
            return cls("fixed", tuple(lengths))
        match = _DRAWN.fullmatch(text)
        if match is None:
            raise ValueError(f"a packing is fixed lengths like '2048,128x16', or 'lognormal:N' / 'uniform:N' with "
                             f"optional ',sigma=S' and ',seed=K', got {text[:80]!r}")
        options = dict(part.split("=", 1) for part in match["options"].split(",")[1:])
        try:
            sigma, seed = float(options.get("sigma", 1.0)), int(options.get("seed", 0))
        except ValueError:
            raise ValueError(f"sigma must be a number and seed an int, in packing {text[:80]!r}") from None
        if "sigma" in options and match["kind"] == "uniform":
            raise ValueError(f"a uniform packing has no sigma, got {text[:80]!r}")
        return cls(match["kind"], count=int(match["count"]), sigma=sigma, seed=seed)

    def describe(self) -> str:
        """The one text form of this packing (`parse` of it gives an equal packing)."""
        if self.kind == "fixed":
            runs: list[list[int]] = []
            for n in self.lengths:
                if runs and runs[-1][0] == n:
                    runs[-1][1] += 1
                else:
                    runs.append([n, 1])
            return ",".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)
        options = (f",sigma={self.sigma:g}" if self.kind == "lognormal" and self.sigma != 1.0 else "") + (
            f",seed={self.seed}" if self.seed else "")
        return f"{self.kind}:{self.count}{options}"

    @property
    def documents(self) -> int:
        """Documents per row."""
        return len(self.lengths) if self.kind == "fixed" else self.count

    def check(self, seq_len: int) -> None:
        """`ValueError` unless every row of `seq_len` tokens can hold this packing."""
        if self.kind == "fixed" and sum(self.lengths) != seq_len:
            raise ValueError(f"the documents' lengths sum to {sum(self.lengths)} tokens, not the sequence length "
                             f"{seq_len}")
        if self.documents > seq_len:
            raise ValueError(f"{self.documents} documents cannot fill {seq_len} tokens (each needs one)")

    def row_lengths(self, seq_len: int, row: int = 0) -> list[int]:
        """The lengths of the documents of batch row `row`, in token order, summing to `seq_len`."""
        self.check(seq_len)
        if self.kind == "fixed":
            return list(self.lengths)
        rng = np.random.default_rng([self.seed, row])
        if self.kind == "uniform":
            cuts = np.sort(rng.choice(np.arange(1, seq_len), size=self.count - 1, replace=False))
            return [int(n) for n in np.diff(np.concatenate([[0], cuts, [seq_len]]))]
        weights = rng.lognormal(0.0, self.sigma, self.count)
        extra = seq_len - self.count  # each document has one token; the rest is shared by weight, largest remainder
        shares = weights / weights.sum() * extra
        lengths = 1 + np.floor(shares).astype(np.int64)
        short = seq_len - int(lengths.sum())
        lengths[np.argsort(np.floor(shares) - shares, kind="stable")[:short]] += 1
        return [int(n) for n in lengths]

    def segment_ids(self, seq_len: int, batch: int) -> np.ndarray:
        """int32 `[batch, seq_len]` segment ids in token order: documents numbered 1, 2, ... in each row."""
        return np.stack([np.repeat(np.arange(1, self.documents + 1, dtype=np.int32),
                                   self.row_lengths(seq_len, row)) for row in range(batch)])

    @classmethod
    def of_segment_ids(cls, segment_ids: np.ndarray) -> Packing:
        """The first row's documents (runs of equal ids) as a fixed packing."""
        return cls("fixed", tuple(_rows(segment_ids)[0]))

    @classmethod
    def fit(cls, segment_ids: np.ndarray) -> Packing:
        """The packing to declare for rows like these (`[B, T]` or `[T]` segment ids in token order, the
        rows of a few batches): their fixed packing where every row holds the same lengths; else
        `lognormal:N,sigma=S`, N the mean number of documents a row and S the spread of the logs of their
        lengths within a row (at least `FIT_SIGMA_FLOOR`, two decimals). A data pipeline that knows its rows
        only as data fits them once and passes the text to the loader (`packing=`) and to `tuner search
        --documents`."""
        rows = _rows(segment_ids)
        if all(row == rows[0] for row in rows):
            return cls("fixed", tuple(rows[0]))
        count = max(1, round(float(np.mean([len(row) for row in rows]))))
        spread = [np.log(row) - np.log(row).mean() for row in map(np.asarray, rows) if len(row) > 1]
        sigma = float(np.sqrt(sum((d**2).sum() for d in spread) / max(1, sum(len(d) - 1 for d in spread))))
        return cls("lognormal", count=count, sigma=max(FIT_SIGMA_FLOOR, round(sigma, 2)))

    def statistics(self, seq_len: int, batch: int = 1) -> dict[str, float]:
        """What the rows are like: documents per row, the mean and longest document, and the share of a row's
        causal work (the sum of its documents' triangles) that its longest document takes, averaged over rows."""
        rows = [np.asarray(self.row_lengths(seq_len, r), np.float64) for r in range(batch)]
        work = [r * (r + 1) / 2 for r in rows]
        return {"documents": float(np.mean([len(r) for r in rows])),
                "mean_length": float(np.mean([r.mean() for r in rows])),
                "longest": float(max(r.max() for r in rows)),
                "longest_work_share": float(np.mean([w.max() / w.sum() for w in work]))}


def _rows(segment_ids: np.ndarray) -> list[list[int]]:
    """The lengths of each row's documents (runs of equal ids) of `[B, T]` or `[T]` segment ids."""
    ids = np.asarray(segment_ids)
    if ids.ndim not in (1, 2) or 0 in ids.shape or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"segment_ids must be integer ids of shape [B, T] or [T], got {ids.dtype} {list(ids.shape)}")
    rows = []
    for row in ids.reshape(-1, ids.shape[-1]):
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        rows.append([int(n) for n in np.diff(np.concatenate([starts, [len(row)]]))])
    return rows


__all__ = ["FIT_SIGMA_FLOOR", "KINDS", "Packing"]
