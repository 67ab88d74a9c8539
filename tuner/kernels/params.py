"""Tunable tile parameters shared by every backend (DESIGN section 6)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tuner.support.checks import check_int


def _check_fields(params: FwdParams | BwdParams) -> None:
    """Every field a positive int; those that default to None may also be None."""
    for field in dataclasses.fields(params):
        check_int(f"{type(params).__name__}.{field.name}", getattr(params, field.name), optional=field.default is None)


@dataclass(frozen=True)
class FwdParams:
    """Forward tiles: a `block_q` x `block_kv` tile of logits is live at a time.

    `num_warps` / `num_stages` are GPU launch settings; `block_kv_compute` is the slice of a `block_kv`
    tile that a TPU kernel computes at once (the tile is copied into VMEM whole, then computed in
    slices). Backends without a setting reject it. A tile longer than the local sequence is shortened
    to the sequence (results are unchanged).
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int | None = None
    num_stages: int | None = None
    block_kv_compute: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self)

    def to_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BwdParams:
    """Backward tiles.

    The dk/dv pass holds a `block_kv_dkv` tile of keys and streams `block_q_dkv` query tiles past it.
    The dq pass holds a `block_q_dq` tile of queries and streams `block_kv_dq` key tiles past it;
    leaving both dq tiles `None` computes dq inside the dk/dv pass instead (one pass, fewer matmuls).
    """

    block_q_dkv: int = 128
    block_kv_dkv: int = 128
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        if (self.block_q_dq is None) != (self.block_kv_dq is None):
            raise ValueError(
                "BwdParams.block_q_dq and BwdParams.block_kv_dq must both be set (a separate dq pass) "
                f"or both be None (dq fused into the dk/dv pass), got {self.block_q_dq!r} and "
                f"{self.block_kv_dq!r}"
            )

    @property
    def fused_dq(self) -> bool:
        """True when dq is accumulated inside the dk/dv pass."""
        return self.block_q_dq is None

    def to_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)
