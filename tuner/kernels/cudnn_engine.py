"""The engines of the cudnn block kernel: cuDNN's fused attention, and its XLA twin.

Both compute attention of a query chunk against a key chunk under one of the masks cuDNN's flash
attention expresses, with one contract:

    forward(q, k, v, *, scale, causal, window, lengths=None) -> o [B, Tq, H, Dv] (q's dtype), lse [B, H, Tq] (float32)
    backward(q, k, v, o, lse, do, *, scale, causal, window, lengths=None) -> dq, dk, dv (their inputs' dtypes)

`causal` is cuDNN's top-left causal mask (key j for query i when j <= i); `window` (with `causal`) keeps
the keys j >= i - window as well. `lengths`, int32 `[B]` arrays `(queries, keys)` on the device, is cuDNN's
padding mask (without `causal`): in batch row b only queries i < queries[b] read, and only keys j < keys[b]
are read. What the engines leave in the other query rows differs (cuDNN's is not documented): the cudnn
kernel masks them. `lse` is the natural-log logsumexp of the scaled logits. The backward
takes the final `o` and `lse` of the whole softmax, not this chunk's, and computes `delta = rowsum(do * o)`
itself, as cuDNN does.

`CudnnEngine` binds the primitives of `jax._src.cudnn.fused_attention_stablehlo`, a private module whose
primitives took the same operands and parameters from jax 0.10.0 to 0.11.x; jax 0.12 added a `score_mod`
parameter (flex attention's score function; None here) and variadic operands for it (none here). Each
release's extra parameters are in `RELEASE_PARAMS`; other releases are refused with the reason. The
module was read, and the CUDA lowering tested, on jax 0.10.2, 0.11.2 and 0.12.0.1. It does not
differentiate through that module's `return_residual` path (whose backward drops the lse cotangent) nor
use `jax.nn.dot_product_attention`'s residual (the lse cast to the input dtype): the cudnn kernel's ring
has its own `custom_vjp`.
`XlaEngine` computes the same contract with XLA in float32 (the output rounded to the input dtype, as
cuDNN's is), so that the cudnn kernel's code runs, and is tested, on a CPU.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Protocol

import jax
import jax.numpy as jnp

F32 = jnp.float32
PRIVATE_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
NAMES = ("_dot_product_attention_fwd_p_wrapper", "_dot_product_attention_bwd_p_wrapper", "MaskType",
         "AttentionLayout")
TESTED_JAX = ("0.10.0", "0.12.0.1")  # the jax versions whose private module this binding was written for
# the primitives' parameters beyond those of jax 0.10, per (major, minor) release bound here
RELEASE_PARAMS: dict[tuple[int, int], dict[str, Any]] = {(0, 10): {}, (0, 11): {}, (0, 12): {"score_mod": None}}


Lengths = tuple[Any, Any] | None  # (query lengths, key lengths), int32 [B] each: cuDNN's padding mask


class Engine(Protocol):
    def forward(self, q, k, v, *, scale: float, causal: bool, window: int | None, lengths: Lengths = None): ...

    def backward(self, q, k, v, o, lse, do, *, scale: float, causal: bool, window: int | None,
                 lengths: Lengths = None): ...


@functools.lru_cache(maxsize=1)
def private_module() -> tuple[Any, str | None]:
    """(jax's cuDNN attention module, None), or (None, why it cannot be bound): a jax outside `TESTED_JAX`,
    or a module without the names bound here."""
    if release() not in RELEASE_PARAMS:
        return None, (f"jax {jax.__version__}: the cudnn kernel binds the private {PRIVATE_MODULE} of jax "
                      f"{TESTED_JAX[0]} to {TESTED_JAX[1]}, and another jax's may differ")
    try:
        module = importlib.import_module(PRIVATE_MODULE)
    except ImportError as error:
        return None, f"jax {jax.__version__} has no {PRIVATE_MODULE} ({error})"
    missing = [name for name in NAMES if not hasattr(module, name)]
    if missing:
        return None, (f"jax {jax.__version__}'s {PRIVATE_MODULE} lacks {', '.join(missing)}: the cudnn kernel binds "
                      f"the module of jax {TESTED_JAX[0]} to {TESTED_JAX[1]}")
    return module, None


def release() -> tuple[int, int]:
    """The installed jax's (major, minor)."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


class CudnnEngine:
    """cuDNN's flash attention through jax's primitives, layout `[B, T, N, H]`."""

    def _common(self, q, scale: float, causal: bool, window: int | None, lengths: Lengths
                ) -> tuple[Any, tuple, dict[str, Any]]:
        """(the bound module, the operands after q, k, v and before the primitive's own: bias, the query and
        key lengths, offsets and page tables, empty but for the lengths of a padding mask; the primitives'
        parameters)."""
        fa, reason = private_module()
        if fa is None:
            raise RuntimeError(reason)
        unused = jnp.zeros((0,), q.dtype)
        if lengths is not None and causal:
            raise ValueError("lengths: the cudnn engines take a padding mask without the causal one")
        mask = fa.MaskType.PADDING if lengths is not None else fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
        # cuDNN's window keeps the keys (i - length, i]: `window` keys back and the query's own
        length = None if window is None else window + 1
        operands = (unused, *(lengths if lengths is not None else (unused, unused)), *(unused,) * 4)
        return fa, operands, dict(scale=float(scale), seed=0, dropout_rate=0.0, variadic_args=(False, False),
                                  mask_type=mask, layout=fa.AttentionLayout.BTNH.value,
                                  sliding_window_length=length, **RELEASE_PARAMS[release()])

    def forward(self, q, k, v, *, scale: float, causal: bool, window: int | None, lengths: Lengths = None):
        fa, operands, params = self._common(q, scale, causal, window, lengths)
        o, lse = fa._dot_product_attention_fwd_p_wrapper.bind(q, k, v, *operands, **params, is_training=True)
        return o, lse

    def backward(self, q, k, v, o, lse, do, *, scale: float, causal: bool, window: int | None,
                 lengths: Lengths = None):
        fa, operands, params = self._common(q, scale, causal, window, lengths)
        dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(q, k, v, *operands, lse, o, do, **params)
        return dq, dk, dv


class XlaEngine:
    """The same contract in XLA, float32 inside: the twin the CPU runs the cudnn kernel with."""

    @staticmethod
    def _logits(q, k, *, scale: float, causal: bool, window: int | None, lengths: Lengths):
        """The scaled logits, `[B, Hkv, G, Tq, Tk]` float32, -inf where the mask excludes a key."""
        b, tq, h, d = q.shape
        hkv = k.shape[2]
        grouped = q.astype(F32).reshape(b, tq, hkv, h // hkv, d)
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k.astype(F32)) * scale
        i, j = jnp.arange(tq)[:, None], jnp.arange(k.shape[1])[None, :]
        if lengths is not None:
            rows, keys = lengths
            allowed = (i[None] < rows[:, None, None]) & (j[None] < keys[:, None, None])  # [B, Tq, Tk]
            return jnp.where(allowed[:, None, None], logits, -jnp.inf)
        if not causal:
            return logits
        allowed = j <= i if window is None else (j <= i) & (i - j <= window)
        return jnp.where(allowed[None, None, None], logits, -jnp.inf)

    def forward(self, q, k, v, *, scale: float, causal: bool, window: int | None, lengths: Lengths = None):
        b, tq, h, _ = q.shape
        logits = self._logits(q, k, scale=scale, causal=causal, window=window, lengths=lengths)
        lse = jax.nn.logsumexp(logits, axis=-1)  # -inf only in a padding mask's rows past the queries' length
        p = jnp.exp(logits - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None])
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(F32))
        return o.reshape(b, tq, h, v.shape[3]).astype(q.dtype), lse.reshape(b, h, tq)

    def backward(self, q, k, v, o, lse, do, *, scale: float, causal: bool, window: int | None,
                 lengths: Lengths = None):
        b, tq, h, d = q.shape
        hkv, g = k.shape[2], h // k.shape[2]
        logits = self._logits(q, k, scale=scale, causal=causal, window=window, lengths=lengths)
        p = jnp.exp(logits - lse.reshape(b, hkv, g, tq)[..., None])  # 0 where masked: the lse passed is finite
        do_g = do.astype(F32).reshape(b, tq, hkv, g, do.shape[3])
        delta = jnp.einsum("bqhgd,bqhgd->bhgq", do_g, o.astype(F32).reshape(do_g.shape))
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do_g)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_g, v.astype(F32))
        ds = p * (dp - delta[..., None]) * scale
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(F32)).reshape(q.shape)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q.astype(F32).reshape(b, tq, hkv, g, d))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


ENGINES: dict[str, Engine] = {"cudnn": CudnnEngine(), "xla": XlaEngine()}


def engine(interpret: bool) -> Engine:
    """The XLA twin in interpret mode (the CPU), else cuDNN."""
    return ENGINES["xla" if interpret else "cudnn"]


__all__ = ["ENGINES", "Engine", "CudnnEngine", "Lengths", "RELEASE_PARAMS", "TESTED_JAX", "XlaEngine", "engine",
           "private_module", "release"]
