"""The contract every backend publishes (DESIGN section 3): one op, several implementations.

A backend computes attention between one block of queries and one block of keys -- it knows nothing
about rings. The ring driver (`tuner.ring`) calls it once per ring step and merges the results.

    block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret)
        -> o_f32 [B,Tq,H,D], lse_f32 [B,H,Tq]
    block_bwd(q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec, params, interpret)
        -> dq, dk, dv (float32), dbias (bias's shape and float32, or None without bias)

Positions and segment ids are int32 `[B, T]`; `q_seg`/`kv_seg` are None without segments. `bias` is
the slice for this key block (`[B|1, H|1, Tq|1, Tk|1]`) or None. `lse` and `delta` are those of the
final softmax (all ring steps and sinks), so a block's probabilities are `exp(logits - lse)`.
"""

from __future__ import annotations

from typing import Any, Protocol

from tuner.params import BwdParams, FwdParams
from tuner.spec import AttentionSpec


class Backend(Protocol):
    """What `tuner.ring` and the tuner need from a backend."""

    name: str

    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else why not (no GPU, missing package, ...)."""

    def supports(self, spec: AttentionSpec, dtype: Any) -> str | None:
        """None when every feature of `spec` is honoured, else the first one that is not."""

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        """Raise `ValueError` naming the field for parameters this backend cannot honour."""

    def default_params(self, q_len: int, kv_len: int, head_dim: int) -> tuple[FwdParams, BwdParams]:
        """The heuristic default for a local problem of these lengths."""

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool): ...

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool): ...


def available(backend: Backend) -> bool:
    """True when `backend` can run on this machine."""
    return backend.unavailable_reason() is None
