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
those rows out of every sum. Padded arrays no longer fit the buffers of the program's outputs, which
XLA reuses for the kernels' copies of q, the output's cotangent, k and v otherwise (docs/memory.md).
The ring keeps its running state in the kernels' layout, and the kernels add each block into it in
place: the forward kernel into the output and lse (`fwd_start`, `fwd_step`, `fwd_finish`), the dq
kernel into dq (`bwd_step`), the dk/dv kernel into the travelling dk/dv accumulators once they have
arrived (`grads_start`, `bwd_accumulate`, `grads_finish`). Values, the output and its gradient
may have a head dim of their own (multi-head latent attention: 192 for queries and keys, 128 for
values). dq is a kernel of its own (a fused dq would need atomics), and bias and float16 are not
supported (`backend="auto"` takes scan for them).
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
from tuner.kernels.base import CallerLayout, SearchSpace, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.kernels.tpu_memory import FALLBACK_TILES, GENERATION_TILES, LANES, chip, fitted_tiles, vmem_bytes
from tuner.kernels.tpu_memory import vmem_limit_bytes
from tuner.support.targets import compile_target

TEMPLATE = "attention.py.j2"
DTYPES = ("bfloat16", "float32")
Q_ALIGN, KV_ALIGN = 8, 128  # a tile shorter than the sequence: sublane multiple (queries), lane multiple (keys)
QUERY_TILE_FIELDS = {"fwd": "fwd_params.block_q", "dkv": "bwd_params.block_q_dkv", "dq": "bwd_params.block_q_dq"}
Q_TILES = (128, 256, 512, 1024)
KV_TILES = (128, 256, 512, 1024, 2048)
COMPUTE_TILES = (128, 256, 512)
MAX_CALLS = 64  # kernel calls a step for a tile schedule SMEM cannot hold at once; past it, longer tiles


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
# Tiles and the chip's memory.
# --------------------------------------------------------------------------------------------------


def _tile(name: str, requested: int, length: int, align: int) -> int:
    """The tile used for a sequence of `length`: the request, cut to the length. A tile shorter than
    the sequence must be a multiple of `align` (TPU tiling); it need not divide the length."""
    tile = min(requested, length)
    if tile < length and tile % align:
        raise ValueError(f"{name}={requested} must be a multiple of {align} (TPU tiling) or at least the "
                         f"local length {length}")
    return tile


def fwd_tiles(params: FwdParams, q_len: int, kv_len: int) -> tuple[int, int, int]:
    """(block_q, block_kv, block_kv_compute) as run for these local lengths; `ValueError` naming the field.
    A compute slice that does not divide a key tile cut to the whole sequence becomes that tile."""
    block_q = _tile("fwd_params.block_q", params.block_q, q_len, Q_ALIGN)
    block_kv = _tile("fwd_params.block_kv", params.block_kv, kv_len, KV_ALIGN)
    compute = min(params.block_kv_compute or block_kv, block_kv)
    if block_kv == kv_len and block_kv % compute:
        compute = block_kv  # the key tile was cut to a sequence the slice does not divide: one slice
    if block_kv % compute or (compute < block_kv and compute % LANES):
        raise ValueError(f"fwd_params.block_kv_compute={params.block_kv_compute} must divide the key tile "
                         f"{block_kv} and be a multiple of {LANES}")
    return block_q, block_kv, compute


def kernel_tiles(fwd: FwdParams | None, bwd: BwdParams | None, q_len: int, kv_len: int
                 ) -> dict[str, tuple[int, int, int | None]]:
    """(block_q, block_kv, block_kv_compute) of each kernel the given parts run, as run for these local
    lengths: "fwd" with `fwd`, "dkv" and "dq" with `bwd` (no compute slice); `ValueError` naming the field."""
    tiles = {}
    if fwd is not None:
        tiles["fwd"] = fwd_tiles(fwd, q_len, kv_len)
    if bwd is not None:
        (dkv_q, dkv_kv), (dq_q, dq_kv) = bwd_tiles(bwd, q_len, kv_len)
        tiles.update(dkv=(dkv_q, dkv_kv, None), dq=(dq_q, dq_kv, None))
    return tiles


def lane_violation(kernel: str, block_q: int, q_len: int) -> str | None:
    """Why `kernel`'s query tile `block_q` (as run, for `q_len` queries) cannot compile for a TPU, or None:
    its lse and delta rows hold the query tile on lanes, so a tile shorter than the shard must be a
    multiple of `LANES` there (the interpreter takes any multiple of `Q_ALIGN`)."""
    if block_q < q_len and block_q % LANES:
        return (f"{QUERY_TILE_FIELDS[kernel]}={block_q} must be a multiple of {LANES} on a TPU (the lse and "
                f"delta rows hold the query tile on lanes) or at least the local length {q_len}")
    return None


def _compiles_for_tpu(kernel: str, block_q: int, q_len: int, interpret: bool) -> None:
    """`lane_violation` as a `ValueError`, where the kernels compile with Mosaic (not interpreted)."""
    reason = None if interpret else lane_violation(kernel, block_q, q_len)
    if reason:
        raise ValueError(reason)


def vmem_estimates(shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None
                   ) -> dict[str, int]:
    """The VMEM estimate (`tpu_memory.vmem_bytes`) of each kernel the given parts run (`kernel_tiles`)."""
    ids = 1 + (spec.chunk_size is not None) + spec.has_segments
    return {kernel: vmem_bytes(kernel, block_q, block_kv, shapes.head_dim, shapes.dtype, ids, compute,
                               value_head_dim=shapes.value_dim)
            for kernel, (block_q, block_kv, compute) in kernel_tiles(fwd, bwd, shapes.q_len, shapes.kv_len).items()}


def bwd_tiles(params: BwdParams, q_len: int, kv_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((block_q, block_kv) of dk/dv, (block_q, block_kv) of dq) as run for these local lengths."""
    return ((_tile("bwd_params.block_q_dkv", params.block_q_dkv, q_len, Q_ALIGN),
             _tile("bwd_params.block_kv_dkv", params.block_kv_dkv, kv_len, KV_ALIGN)),
            (_tile("bwd_params.block_q_dq", params.block_q_dq, q_len, Q_ALIGN),
             _tile("bwd_params.block_kv_dq", params.block_kv_dq, kv_len, KV_ALIGN)))


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


def _tiles(length: int, tile: int) -> int:
    """How many tiles cover `length`, the last one running past its end where `tile` does not divide it."""
    return -(-length // tile)


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


def schedule_row_bytes(kernel: str, q_tiles: int, kv_tiles: int) -> int:
    """SMEM bytes of one row of a kernel's scalar-prefetched schedule (int32 `schedule [B, held, streamed]`,
    `count` and `unmasked [B, held]`): one batch row's held tile, its streamed tiles and its two counts.
    The dk/dv kernel holds key tiles and streams query tiles, the others the reverse."""
    streamed = q_tiles if kernel == "dkv" else kv_tiles
    return 4 * (streamed + 2)


def rows_per_call(kernel: str, q_tiles: int, kv_tiles: int) -> int:
    """The most schedule rows one call of `kernel` prefetches: what half the chip's SMEM holds. A longer
    schedule (many tiles, a large batch) runs in several calls (`kernel_calls`); at least one row a call
    (`violation` checks that one fits)."""
    return max(1, chip().smem_capacity_bytes // 2 // schedule_row_bytes(kernel, q_tiles, kv_tiles))


def kernel_calls(kernel: str, batch: int, q_tiles: int, kv_tiles: int) -> tuple[tuple[int, int, int, int], ...]:
    """How `kernel`'s grid is cut into calls, each prefetching at most `rows_per_call` schedule rows:
    `(first batch row, batch rows, first held tile, held tiles)` per call. Whole batch rows where one fits
    a call, else each batch row's held tiles in runs. One call where the whole schedule fits."""
    held, rows = (kv_tiles if kernel == "dkv" else q_tiles), rows_per_call(kernel, q_tiles, kv_tiles)
    if held <= rows:
        per_call = rows // held
        return tuple((b0, min(per_call, batch - b0), 0, held) for b0 in range(0, batch, per_call))
    return tuple((b0, 1, i0, min(rows, held - i0)) for b0 in range(batch) for i0 in range(0, held, rows))


def _mask_values(spec: AttentionSpec) -> dict[str, Any]:
    left, right = spec.window if spec.window is not None else (0, 0)
    return dict(scale=float(spec.scale), softcap=float(spec.softcap or 1.0), window_left=left, window_right=right)


# --------------------------------------------------------------------------------------------------
# The backend.
# --------------------------------------------------------------------------------------------------


class PallasTpuBackend(CallerLayout):
    """Generated Pallas kernels for TPUs (or Pallas's TPU interpret mode on the CPU for checks)."""

    name = "pallas_tpu"
    masked_tile = None  # its defaults are tuned per architecture for every mask

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
        """TPU tiling of each tile, the VMEM estimate of each kernel against the scoped limit the
        kernels request, and the scalar-prefetched schedules against SMEM."""
        q_len, kv_len = shapes.q_len, shapes.kv_len
        info = chip()
        limit = vmem_limit_bytes(info)
        if fwd is not None and fwd.block_kv_compute is not None and fwd.block_kv_compute > min(fwd.block_kv, kv_len):
            return (f"block_kv_compute={fwd.block_kv_compute} is longer than the key tile, so it is cut to it: "
                    f"the point with block_kv_compute={min(fwd.block_kv, kv_len)}")
        try:
            tiles = kernel_tiles(fwd, bwd, q_len, kv_len)
        except ValueError as error:
            return str(error)
        for kernel, used in vmem_estimates(shapes, spec, fwd, bwd).items():
            block_q, block_kv, _ = tiles[kernel]
            if lane_violation(kernel, block_q, q_len):
                return lane_violation(kernel, block_q, q_len)
            if used > limit:
                return (f"{kernel} kernel needs about {used / 2**20:.1f} MiB of VMEM with {block_q}x{block_kv} "
                        f"tiles, over the {limit / 2**20:.0f} MiB scoped limit on TPU {info.chip_version.value}")
            q_tiles, kv_tiles = _tiles(q_len, block_q), _tiles(kv_len, block_kv)
            one_row = schedule_row_bytes(kernel, q_tiles, kv_tiles)
            if one_row > info.smem_capacity_bytes // 2:
                return (f"{kernel} kernel's tile schedule needs {one_row // 1024} KiB of SMEM for one row of "
                        f"{block_q}x{block_kv} tiles, over half the {info.smem_capacity_bytes // 1024} KiB of TPU "
                        f"{info.chip_version.value}")
            calls = len(kernel_calls(kernel, shapes.batch, q_tiles, kv_tiles))
            if calls > MAX_CALLS:
                return (f"{kernel} kernel's tile schedule of {block_q}x{block_kv} tiles needs {calls} calls a step "
                        f"to fit half the {info.smem_capacity_bytes // 1024} KiB of SMEM of TPU "
                        f"{info.chip_version.value}, over {MAX_CALLS}: take longer tiles")
        return None

    def code_hash(self) -> str:
        return source_hash(codegen.template_path("pallas_tpu", TEMPLATE), Path(__file__))

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
                 params: FwdParams, interpret: bool = False) -> tuple:
        out, lse = state
        tq, tk = q.shape[1], kv_pos.shape[1]
        block_q, block_kv, compute = fwd_tiles(params, tq, tk)
        _compiles_for_tpu("fwd", block_q, tq, interpret)
        module = codegen.load(variant(spec, q.dtype, q.shape[3], v.shape[3]))
        return module.attention_fwd(
            *_flat_schedule(q_pos, kv_pos, q_seg, kv_seg, spec, block_q, block_kv), _heads_major(q), k, v,
            _ids(spec, q_pos, q_seg, keys=False), _ids(spec, kv_pos, kv_seg, keys=True), out, lse,
            kv_len=tk, block_q=block_q, block_kv=block_kv, block_kv_compute=compute,
            calls=kernel_calls("fwd", q.shape[0], _tiles(tq, block_q), _tiles(tk, block_kv)),
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
    _compiles_for_tpu(kernel, block_q, tq, interpret)
    tiles = _tiles(tq, block_q), _tiles(tk, block_kv)
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
