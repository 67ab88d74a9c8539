"""The tiles the Pallas TPU kernels run, and what a TPU allows of them (`tuner/kernels/pallas_tpu.py`).

A tile request is cut to the local length. A tile shorter than the shard need not divide it: the last
tile runs past the shard's end. TPU tiling wants key tiles and, as the lse and delta rows hold the
queries on lanes, query tiles in multiples of 128 (the interpreter takes query tiles of any multiple
of 8). Each kernel's blocks must fit the VMEM the kernels ask Mosaic for (`tpu_memory`), and its
scalar-prefetched tile schedule the chip's SMEM: a schedule longer than half the SMEM runs in several
kernel calls a step (`kernel_calls`), up to `MAX_CALLS`.
"""

from __future__ import annotations

from tuner.kernels.params import BwdParams, FwdParams
from tuner.kernels.tpu_memory import LANES, chip, vmem_bytes, vmem_limit_bytes
from tuner.semantics.spec import AttentionSpec, LocalShapes

Q_ALIGN, KV_ALIGN = 8, 128  # a tile shorter than the sequence: sublane multiple (queries), lane multiple (keys)
QUERY_TILE_FIELDS = {"fwd": "fwd_params.block_q", "dkv": "bwd_params.block_q_dkv", "dq": "bwd_params.block_q_dq"}
Q_TILES = (128, 256, 512, 1024)
KV_TILES = (128, 256, 512, 1024, 2048)
COMPUTE_TILES = (128, 256, 512)
MAX_CALLS = 64  # kernel calls a step for a tile schedule SMEM cannot hold at once; past it, longer tiles


# --------------------------------------------------------------------------------------------------
# The tiles as run.
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


def bwd_tiles(params: BwdParams, q_len: int, kv_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((block_q, block_kv) of dk/dv, (block_q, block_kv) of dq) as run for these local lengths."""
    return ((_tile("bwd_params.block_q_dkv", params.block_q_dkv, q_len, Q_ALIGN),
             _tile("bwd_params.block_kv_dkv", params.block_kv_dkv, kv_len, KV_ALIGN)),
            (_tile("bwd_params.block_q_dq", params.block_q_dq, q_len, Q_ALIGN),
             _tile("bwd_params.block_kv_dq", params.block_kv_dq, kv_len, KV_ALIGN)))


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


def tile_count(length: int, tile: int) -> int:
    """How many tiles cover `length`, the last one running past its end where `tile` does not divide it."""
    return -(-length // tile)


# --------------------------------------------------------------------------------------------------
# What a TPU allows: lanes, VMEM, SMEM.
# --------------------------------------------------------------------------------------------------


def lane_violation(kernel: str, block_q: int, q_len: int) -> str | None:
    """Why `kernel`'s query tile `block_q` (as run, for `q_len` queries) cannot compile for a TPU, or None:
    its lse and delta rows hold the query tile on lanes, so a tile shorter than the shard must be a
    multiple of `LANES` there (the interpreter takes any multiple of `Q_ALIGN`)."""
    if block_q < q_len and block_q % LANES:
        return (f"{QUERY_TILE_FIELDS[kernel]}={block_q} must be a multiple of {LANES} on a TPU (the lse and "
                f"delta rows hold the query tile on lanes) or at least the local length {q_len}")
    return None


def require_lanes(kernel: str, block_q: int, q_len: int, interpret: bool) -> None:
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


def violation(shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None) -> str | None:
    """Why the kernels of the given parts cannot run these tiles on the target TPU, or None: TPU tiling
    of each tile, the VMEM estimate of each kernel against the scoped limit the kernels request, and the
    scalar-prefetched schedules against SMEM."""
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
        lanes = lane_violation(kernel, block_q, q_len)
        if lanes:
            return lanes
        if used > limit:
            return (f"{kernel} kernel needs about {used / 2**20:.1f} MiB of VMEM with {block_q}x{block_kv} "
                    f"tiles, over the {limit / 2**20:.0f} MiB scoped limit on TPU {info.chip_version.value}")
        q_tiles, kv_tiles = tile_count(q_len, block_q), tile_count(kv_len, block_kv)
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
