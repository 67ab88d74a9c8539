"""The Pallas TPU backend: generated Pallas/Mosaic kernels (`templates/pallas_tpu/attention.py.j2`).

On a TPU the kernels compile with Mosaic. With `interpret=True` the same rendered kernels -- grid,
block specs, scalar-prefetched schedules and all -- run in Pallas's interpreter on the CPU, and `lower`
exports them for the TPU platform without one (`jax.export(..., platforms=["tpu"])`), which runs
Pallas's Mosaic lowering and its TPU tiling checks. Neither proves speed, and Mosaic's own compile in
libtpu only happens on a TPU. (Pallas's more faithful TPU interpret mode, `pltpu.InterpretParams`,
simulates each device's memories; under `shard_map` on simulated CPU devices it did not finish a
2-device ring in 300 s, so the plain interpreter is used.)

Layout: TPU blocks need their last two dims to be multiples of (8, 128) or whole, so the kernels work
on heads-major `[B, H, T, D]` arrays, which is how XLA lays out a `[B, T, H, D]` array on a TPU anyway
(the transposes here move nothing there; elsewhere, they copy), and on lane-dense rows `[B, H, 1, T]` of
the lse and delta. Where a tile does not divide the shard, nothing is padded: the last tile runs past
the shard's end, which Pallas allows (reads there are garbage, writes dropped), and the kernels keep
those rows out of every sum. XLA lays the kernels' copies of q, the output's cotangent, k and v in the
buffers of the program's outputs of their size; padded copies did not fit them (docs/memory.md).
The ring keeps its running state in the kernels' layout, and the kernels add each block into it in
place: the forward kernel into the output and lse (`fwd_start`, `fwd_step`, `fwd_finish`), the dq
kernel into dq (`bwd_step`), the dk/dv kernel into the travelling dk/dv accumulators once they have
arrived (`grads_start`, `bwd_accumulate`, `grads_finish`). Values, the output and its gradient
may have a head dim of their own (multi-head latent attention: 192 for queries and keys, 128 for
values). dq is a kernel of its own (a fused dq would need atomics), and bias and float16 are not
supported (`backend="auto"` takes scan for them). The tiles as run, and what a TPU allows of them (its
tiling, VMEM and SMEM), are `pallas_tiling`'s.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tuner.kernels import codegen
from tuner.semantics import masks
from tuner.support import vma
from tuner.kernels.base import CallerLayout, DecidesOnDevice, SearchSpace, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.kernels.pallas_tiling import COMPUTE_TILES, KV_TILES, Q_TILES, bwd_tiles, fwd_tiles, kernel_calls
from tuner.kernels.pallas_tiling import require_lanes, tile_count, violation
from tuner.kernels.tpu_memory import FALLBACK_TILES, GENERATION_TILES, chip, fitted_tiles, vmem_limit_bytes
from tuner.support.targets import compile_target

TEMPLATE = "attention.py.j2"
DTYPES = ("bfloat16", "float32")


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def variant(spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None) -> codegen.Variant:
    """The rendered module for these features (window / cap values and tiles are trace-time arguments);
    `value_head_dim` None: the values' head dim is `head_dim`."""
    return codegen.Variant("pallas_tpu", TEMPLATE, {
        "causal": spec.causal, "window": spec.window is not None, "chunk": spec.chunk_size is not None,
        "segments": spec.has_segments, "softcap": spec.softcap is not None, "dtype": _dtype_name(dtype),
        "head_dim": head_dim, "value_head_dim": head_dim if value_head_dim is None else value_head_dim})


def standard_variants() -> list[codegen.Variant]:
    """`codegen.STANDARD_FEATURES` in bfloat16 and float32, head dims 64 and 128 (values of the same dim)."""
    return [codegen.Variant("pallas_tpu", TEMPLATE, {**f, "dtype": dtype, "head_dim": d, "value_head_dim": d})
            for f in codegen.STANDARD_FEATURES for dtype in DTYPES for d in (64, 128)]


# --------------------------------------------------------------------------------------------------
# Calling the kernels: heads-major arrays, id arrays, schedules.
# --------------------------------------------------------------------------------------------------


def _interpret_mode(interpret: bool, q) -> bool:
    """Pallas's `interpret` for these kernels; with it, refuse what Pallas's interpreter cannot run."""
    if interpret and vma.varying_axes(q):
        raise ValueError("interpret=True with backend='pallas_tpu' cannot run under shard_map's varying-axes "
                         "check (Pallas's interpreter evaluates the scalar-prefetch index maps without it): "
                         "pass check_vma=False to jax.shard_map, or run the kernels on a TPU")
    return interpret


def _heads_major(x):
    """`[B, T, H, D]` -> `[B, H, T, D]` (XLA's TPU layout of `[B, T, H, D]` is heads-major already: the
    transpose moves nothing), and back."""
    return jnp.swapaxes(x, 1, 2)


def _ids(spec: AttentionSpec, pos, seg, *, keys: bool):
    """Per-token ids the kernels compare -- position, chunk id (position // chunk), segment id:
    `[B, T, IDS]` for queries, `[B, IDS, T]` for keys."""
    columns = [pos]
    if spec.chunk_size is not None:
        columns.append(jnp.floor_divide(pos, spec.chunk_size))
    if spec.has_segments:
        columns.append(seg)
    ids = jnp.stack(columns, axis=1).astype(jnp.int32)
    return ids if keys else jnp.swapaxes(ids, 1, 2)


def _row_stats(x):
    """`[B, H, Tq]` lse or delta -> lane-dense rows `[B, H, 1, Tq]`."""
    return x[:, :, None]


def _flat_schedule(q_pos, kv_pos, q_seg, kv_seg, spec: AttentionSpec, block_q: int, block_kv: int, by_key=False):
    """The kernels' scalar-prefetched `schedule, count, unmasked` (`masks.tile_schedule`), flattened."""
    schedule = masks.tile_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv, by_key=by_key)
    return tuple(x.reshape(-1) for x in (schedule.order, schedule.count, schedule.unmasked))


def _mask_values(spec: AttentionSpec) -> dict[str, Any]:
    left, right = spec.window if spec.window is not None else (0, 0)
    return dict(scale=float(spec.scale), softcap=float(spec.softcap or 1.0), window_left=left, window_right=right)


# --------------------------------------------------------------------------------------------------
# The backend.
# --------------------------------------------------------------------------------------------------


class PallasTpuBackend(DecidesOnDevice, CallerLayout):
    """Generated Pallas kernels for TPUs (or Pallas's TPU interpret mode on the CPU for checks)."""

    name = "pallas_tpu"
    masked_tile = None  # its defaults are tuned per architecture for every mask
    starts_fresh = False  # its forward kernel merges into the running state in place (`fwd_step`)

    def unavailable_reason(self, interpret: bool = False, platform: str | None = None) -> str | None:
        if interpret:
            return None
        building_for_tpu = (platform or compile_target()[0]) == "tpu"
        # a TPU present compiles for itself; libtpu compiles for a TPU topology on any host
        if not building_for_tpu or (jax.default_backend() != "tpu" and importlib.util.find_spec("libtpu") is None):
            return "no TPU visible to jax (interpret=True runs the kernels on the CPU)"
        return None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None
                 ) -> str | None:
        """Bias and dtypes other than `DTYPES` are refused; head dims are not: each block spans the whole
        head dim, which TPU tiling takes at any width, and queries/keys and values have their own blocks
        (compiled for v5e with dims from 1 to 576, values narrower and wider than keys)."""
        if spec.has_bias:
            return "bias (the scan backend supports it)"
        if _dtype_name(dtype) not in DTYPES:
            return f"dtype {_dtype_name(dtype)} (TPU kernels take {' or '.join(DTYPES)})"
        return None

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        reject_settings(self.name, fwd, bwd, launch=False, compute_slice=True)
        if bwd.fused_dq:
            raise ValueError("bwd_params.block_q_dq and block_kv_dq must be set: the pallas_tpu backend "
                             "computes dq in its own kernel")

    def default_params(self, q_len: int, kv_len: int, head_dim: int, value_head_dim: int | None = None
                       ) -> tuple[FwdParams, BwdParams]:
        """The tiles of the target chip's generation (`GENERATION_TILES`, chosen from compile results;
        `FALLBACK_TILES` elsewhere), each kernel's halved until the VMEM estimate for float32 at these
        head dims (`value_head_dim` None: `head_dim`) fits the chip's limit (the defaults never depend on
        the dtype), cut to the local lengths. Not yet measured on a TPU."""
        info = chip()
        fwd, bwd = GENERATION_TILES.get(info.chip_version.value, FALLBACK_TILES)
        limit = vmem_limit_bytes(info)
        dims = dict(head_dim=head_dim, limit=limit, value_head_dim=value_head_dim)
        fwd_q, fwd_kv = fitted_tiles("fwd", fwd.block_q, fwd.block_kv, compute=fwd.block_kv_compute, **dims)
        dkv_q, dkv_kv = fitted_tiles("dkv", bwd.block_q_dkv, bwd.block_kv_dkv, **dims)
        dq_q, dq_kv = fitted_tiles("dq", bwd.block_q_dq, bwd.block_kv_dq, **dims)
        return (FwdParams(block_q=min(fwd_q, q_len), block_kv=min(fwd_kv, kv_len),
                          block_kv_compute=min(fwd.block_kv_compute, fwd_kv, kv_len)),
                BwdParams(block_q_dkv=min(dkv_q, q_len), block_kv_dkv=min(dkv_kv, kv_len),
                          block_q_dq=min(dq_q, q_len), block_kv_dq=min(dq_kv, kv_len)))

    def search_space(self, shapes: LocalShapes, spec: AttentionSpec) -> SearchSpace:
        """Tiles shorter than the local length from the lists above, and the whole length when it is
        not longer than the longest; `violation` removes what does not fit."""
        local = max(shapes.q_len, shapes.kv_len)

        def tiles(options: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(t for t in options if t < local) + ((local,) if local <= options[-1] else ())

        q_tiles, kv_tiles = tiles(Q_TILES), tiles(KV_TILES)
        compute = tuple(sorted({t for t in COMPUTE_TILES if t < local} | ({local} if local <= 512 else set())))
        return SearchSpace(fwd={"block_q": q_tiles, "block_kv": kv_tiles, "block_kv_compute": compute},
                           bwd={"block_q_dkv": q_tiles, "block_kv_dkv": tiles(Q_TILES)},
                           dq_tiles=tiles(Q_TILES), dq_passes=("separate",))

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None
                  ) -> str | None:
        """`pallas_tiling.violation`: TPU tiling, VMEM and SMEM."""
        return violation(shapes, spec, fwd, bwd)

    def code_hash(self) -> str:
        return source_hash(codegen.template_path("pallas_tpu", TEMPLATE), Path(__file__),
                           Path(__file__).with_name("pallas_tiling.py"))

    def fwd_start(self, q, k, v, *, params: FwdParams) -> tuple:
        """The running output, float32 in the kernels' layout, and lse as rows `[B, H, 1, Tq]`: what
        `attention_fwd` merges each block into, in place. Each step lays q out as the kernel reads it, a
        move XLA makes once or not at all (kept in the state, the v6e program held it through the
        backward: 2,303 against 1,993 MiB, forward and backward at 524,288 tokens)."""
        (b, tq, h, _), dv = q.shape, v.shape[3]
        return (vma.like(jnp.zeros((b, h, tq, dv), jnp.float32), q),
                vma.like(jnp.full((b, h, 1, tq), -jnp.inf, jnp.float32), q))

    def keys_start(self, k, v, *, params: FwdParams | BwdParams) -> tuple:
        """k and v heads-major, as they travel the ring: the kernels read them so, whatever their tiles."""
        return _heads_major(k), _heads_major(v)

    def fwd_step(self, state: tuple, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                 params: FwdParams, interpret: bool = False, fresh: bool = False) -> tuple:
        """This block merged into the running state in place; a `fresh` state is read as any other."""
        out, lse = state
        tq, tk = q.shape[1], kv_pos.shape[1]
        block_q, block_kv, compute = fwd_tiles(params, tq, tk)
        require_lanes("fwd", block_q, tq, interpret)
        module = codegen.load(variant(spec, q.dtype, q.shape[3], v.shape[3]))
        return module.attention_fwd(
            *_flat_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv), _heads_major(q), k, v,
            _ids(spec, q_pos, q_seg, keys=False), _ids(spec, kv_pos, kv_seg, keys=True), out, lse,
            kv_len=tk, block_q=block_q, block_kv=block_kv, block_kv_compute=compute,
            calls=kernel_calls("fwd", q.shape[0], tile_count(tq, block_q), tile_count(tk, block_kv)),
            **_mask_values(spec), vmem_limit_bytes=vmem_limit_bytes(), interpret=_interpret_mode(interpret, q))

    def fwd_finish(self, state: tuple, q) -> tuple:
        out, lse = state
        return _heads_major(out), lse[:, :, 0]

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool = False):
        state = self.fwd_step(self.fwd_start(q, k, v, params=params), q, *self.keys_start(k, v, params=params), q_pos,
                              kv_pos, q_seg, kv_seg, bias, spec=spec, params=params, interpret=interpret)
        return self.fwd_finish(state, q)

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        dq = self.dq_start(q, k, params=params)
        rows = self.bwd_start(q, do, params=params)
        grads = tuple(vma.like(x, q) for x in self.grads_start(k, v, params=params))
        keys = self.keys_start(k, v, params=params)
        dq, dbias, pending = self.bwd_step(dq, rows, *keys, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias,
                                           spec=spec, params=params, interpret=interpret)
        grads = self.bwd_accumulate(grads, pending, rows, *keys, lse, delta, q_pos, kv_pos, q_seg, kv_seg, spec=spec,
                                    params=params, interpret=interpret)
        return (self.dq_finish(dq, q, params=params), *self.grads_finish(grads, k, v), dbias)

    def bwd_start(self, q, do, *, params: BwdParams) -> tuple:
        """q and do heads-major, once for the whole ring (a step made its own copies beside the loop's)."""
        return _heads_major(q), _heads_major(do.astype(q.dtype))

    def dq_start(self, q, k, *, params: BwdParams):
        """The running dq in the dq kernel's layout, float32 `[B, H, Tq, D]` heads-major: the kernel adds
        each block's into it in place."""
        b, tq, h, d = q.shape
        return vma.like(jnp.zeros((b, h, tq, d), jnp.float32), q)

    def dq_finish(self, dq, q, *, params: BwdParams):
        return _heads_major(dq)

    def grads_start(self, k, v, *, params: BwdParams) -> tuple:
        """The dk and dv accumulators in the dk/dv kernel's layout, float32 `[B, Hkv, Tk, D]` heads-major:
        they travel the ring in it, and the kernel adds each block into them."""
        (b, tk, hkv, d), dv = k.shape, v.shape[3]
        return jnp.zeros((b, hkv, tk, d), jnp.float32), jnp.zeros((b, hkv, tk, dv), jnp.float32)

    def bwd_step(self, dq, rows: tuple, k, v, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                 spec: AttentionSpec, params: BwdParams, interpret: bool = False) -> tuple:
        """The dq kernel adds the block's dq into the running `dq` (`dq_start`'s) in place; dk and dv are
        left to the dk/dv kernel (`bwd_accumulate`), which needs the accumulators."""
        tq, tk = q_pos.shape[1], kv_pos.shape[1]
        _, (block_q, block_kv) = bwd_tiles(params, tq, tk)
        module = codegen.load(variant(spec, k.dtype, k.shape[3], v.shape[3]))
        dq = module.attention_dq(*_flat_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv),
                                 *_bwd_operands(spec, rows, k, v, lse, delta, q_pos, kv_pos, q_seg, kv_seg),
                                 dq, block_q=block_q, block_kv=block_kv,
                                 **_bwd_settings("dq", spec, tq, tk, block_q, block_kv, interpret, k))
        return dq, None, ()

    def bwd_idle(self, k, v) -> tuple:
        return ()

    def bwd_accumulate(self, grads: tuple, pending: tuple, rows: tuple, k, v, lse, delta, q_pos, kv_pos, q_seg,
                       kv_seg, *, spec: AttentionSpec, params: BwdParams, interpret: bool = False) -> tuple:
        """The dk/dv kernel adds the block's dk and dv into the accumulators in place."""
        tq, tk = q_pos.shape[1], kv_pos.shape[1]
        (block_q, block_kv), _ = bwd_tiles(params, tq, tk)
        module = codegen.load(variant(spec, k.dtype, k.shape[3], v.shape[3]))
        return tuple(module.attention_dkv(
            *_flat_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv, by_key=True),
            *_bwd_operands(spec, rows, k, v, lse, delta, q_pos, kv_pos, q_seg, kv_seg), *grads,
            block_q=block_q, block_kv=block_kv, **_bwd_settings("dkv", spec, tq, tk, block_q, block_kv, interpret, k)))

    def grads_finish(self, grads: tuple, k, v) -> tuple:
        return tuple(_heads_major(g.astype(x.dtype)) for g, x in zip(grads, (k, v)))


def _bwd_operands(spec: AttentionSpec, rows: tuple, k, v, lse, delta, q_pos, kv_pos, q_seg, kv_seg) -> tuple:
    """What both backward kernels read: q, k, v, do heads-major, the lse and delta rows (a row that read
    nothing gets lse +inf: p = exp(s - inf) = 0), the query and key ids."""
    q, do = rows
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    return (q, k, v, do, _row_stats(lse), _row_stats(delta), _ids(spec, q_pos, q_seg, keys=False),
            _ids(spec, kv_pos, kv_seg, keys=True))


def _bwd_settings(kernel: str, spec: AttentionSpec, tq: int, tk: int, block_q: int, block_kv: int,
                  interpret: bool, reference) -> dict[str, Any]:
    """The keyword arguments the backward `kernel` takes besides its tiles, for `tq` queries and `tk` keys;
    `reference` is one of the call's arrays (its batch, and the axes it varies over)."""
    require_lanes(kernel, block_q, tq, interpret)
    tiles = tile_count(tq, block_q), tile_count(tk, block_kv)
    return dict(kv_len=tk, calls=kernel_calls(kernel, reference.shape[0], *tiles), **_mask_values(spec),
                vmem_limit_bytes=vmem_limit_bytes(), interpret=_interpret_mode(interpret, reference))


# --------------------------------------------------------------------------------------------------
# Lowering for TPU without one.
# --------------------------------------------------------------------------------------------------


def step_programs(shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None = None,
                  bwd: BwdParams | None = None, sharding: Any = None) -> list[tuple[Any, tuple]]:
    """One ring step's kernels for these local shapes as jitted programs with their argument structs
    (`sharding` on each; values, output and its gradient `shapes.value_dim` wide): the forward block
    when `fwd` is given, the backward block (dK/dV and dQ kernels) when `bwd` is."""
    backend = PallasTpuBackend()
    b, tq, tk, h, hkv = shapes.batch, shapes.q_len, shapes.kv_len, shapes.heads, shapes.kv_heads
    d, dv = shapes.head_dim, shapes.value_dim

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)

    q, k, v, o, do = (struct((b, t, n, width), dtype) for t, n, width, dtype in
                      ((tq, h, d, shapes.dtype), (tk, hkv, d, shapes.dtype), (tk, hkv, dv, shapes.dtype),
                       (tq, h, dv, shapes.dtype), (tq, h, dv, jnp.float32)))
    lse, q_pos, kv_pos = struct((b, h, tq), jnp.float32), struct((b, tq), jnp.int32), struct((b, tk), jnp.int32)
    q_seg, kv_seg = (q_pos, kv_pos) if spec.has_segments else (None, None)
    programs = []
    if fwd is not None:
        def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
            return backend.block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, None, spec=spec, params=fwd)

        programs.append((jax.jit(forward), (q, k, v, q_pos, kv_pos, q_seg, kv_seg)))
    if bwd is not None:
        def backward(q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg):
            return backend.block_bwd(q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, None, spec=spec,
                                     params=bwd)

        programs.append((jax.jit(backward), (q, k, v, o, lse, do, lse, q_pos, kv_pos, q_seg, kv_seg)))
    return programs


def lower(shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None = None, bwd: BwdParams | None = None
          ) -> int:
    """Export the block kernels for these local shapes (one ring step) for the TPU platform with
    `jax.export(..., platforms=["tpu"])`, which runs the Mosaic lowering of every kernel; returns how
    many Mosaic kernels the exported modules hold. Raises what the lowering raises."""
    return sum(jax.export.export(program, platforms=["tpu"])(*args).mlir_module().count("tpu_custom_call")
               for program, args in step_programs(shapes, spec, fwd, bwd))
