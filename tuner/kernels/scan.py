"""The scan backend: blockwise flash attention in pure JAX (`tuner.kernels.scan_kernel`).

Every feature, every platform: it is the fallback of the runtime loader and the verifier of the
kernel backends. This module holds its side of the backend contract (availability, support, params,
search space and constraints); the tiled computation itself is the kernel module's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from tuner.kernels import scan_kernel, scan_tiling
from tuner.kernels.base import AddedGrads, DecidesOnDevice, SearchSpace, reject_settings, source_hash
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec, LocalShapes

TILE_BYTES_LIMIT = 256 * 2**20
SHORT_SHARD = 1024  # up to this local length the default forward takes query tiles of 128 (default_params)


class ScanBackend(DecidesOnDevice, AddedGrads):
    """Pure-JAX blockwise attention; honours every feature on every platform."""

    name = "scan"
    # Where positions mask tiles out, the kernel loops over the tiles it visits only, and square tiles of
    # 128 skip most of the masked ones: within 3.5% of the best on 7 of the 8 recorded landscapes with a
    # position mask (benchmarks/cpu_ring/README.md, "A default tile for masked problems").
    masked_tile = 128
    starts_fresh = False  # its state is its own tiles' (`fwd_step`)

    def unavailable_reason(self, interpret: bool = False, platform: str | None = None) -> str | None:
        return None

    def supports(self, spec: AttentionSpec, dtype: Any, head_dim: int, value_head_dim: int | None = None
                 ) -> str | None:
        return None

    def check_params(self, fwd: FwdParams, bwd: BwdParams) -> None:
        reject_settings(self.name, fwd, bwd, launch=False, compute_slice=False)

    def default_params(self, q_len: int, kv_len: int, head_dim: int, value_head_dim: int | None = None
                       ) -> tuple[FwdParams, BwdParams]:
        """The forward: tall query tiles (512) and short key tiles (256), from an early sweep on a 2-core
        x86 CPU (local T=1024, H=8, D=64, float32), beyond `SHORT_SHARD` tokens; up to it query tiles of
        128, which took 0.81 to 0.95 of the tall ones' time up to 1024 tokens and 1.03 to 1.08 from 2048
        on the 7 unmasked forward landscapes. The backward: short query tiles (64) and long key tiles
        (512), dq fused, which took 0.80 to 1.04 of 512 x 256's time on the same 7 problems (0.92 in
        geometric mean; `benchmarks/cpu_ring/unmasked_tile.py`). These are the unmasked defaults: under a mask
        every tile is `masked_tile` (128). Tiles are cut to the local lengths (the same computation,
        named as the search space names it)."""
        fwd_q = min(128, q_len) if q_len <= SHORT_SHARD else min(512, q_len)
        return (FwdParams(block_q=fwd_q, block_kv=min(256, kv_len)),
                BwdParams(block_q_dkv=min(64, q_len), block_kv_dkv=min(512, kv_len)))

    def search_space(self, shapes: LocalShapes, spec: AttentionSpec) -> SearchSpace:
        """Powers of two from 32 up to the local length (and the local length itself): a longer tile
        would only be shortened to the sequence, a point already in the space."""
        local = max(shapes.q_len, shapes.kv_len)
        tiles = tuple(sorted({t for t in (32, 64, 128, 256, 512, 1024, 2048, 4096) if t <= local}
                             | {min(local, 4096)}))
        return SearchSpace(fwd={"block_q": tiles, "block_kv": tiles},
                           bwd={"block_q_dkv": tiles, "block_kv_dkv": tiles}, dq_tiles=tiles)

    def violation(self, shapes: LocalShapes, spec: AttentionSpec, fwd: FwdParams | None, bwd: BwdParams | None
                  ) -> str | None:
        """A float32 logits tile for every (batch, head) must fit in `TILE_BYTES_LIMIT`: larger tiles
        thrash the caches on a CPU and exhaust memory on an accelerator."""
        tiles = []
        if fwd is not None:
            tiles.append(("fwd", fwd.block_q, fwd.block_kv))
        if bwd is not None:
            tiles.append(("bwd dk/dv", bwd.block_q_dkv, bwd.block_kv_dkv))
            if not bwd.fused_dq:
                tiles.append(("bwd dq", bwd.block_q_dq, bwd.block_kv_dq))
        for name, block_q, block_kv in tiles:
            rows, cols = min(block_q, shapes.q_len), min(block_kv, shapes.kv_len)
            size = 4 * shapes.batch * shapes.heads * rows * cols
            if size > TILE_BYTES_LIMIT:
                return (f"{name} logits tile {rows}x{cols} x B*H={shapes.batch * shapes.heads} is "
                        f"{size / 2**20:.0f} MiB, over the {TILE_BYTES_LIMIT // 2**20} MiB tile limit")
        return None

    def code_hash(self) -> str:
        return source_hash(Path(__file__), Path(scan_kernel.__file__), Path(scan_tiling.__file__))

    def block_fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                  params: FwdParams, interpret: bool = False):
        return scan_kernel.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec, block_q=params.block_q,
                                   block_kv=params.block_kv)

    def fwd_start(self, q, k, v, *, params: FwdParams) -> tuple:
        return scan_kernel.empty_state(q, k, v, block_q=params.block_q, block_kv=params.block_kv)

    def fwd_step(self, state: tuple, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, *, spec: AttentionSpec,
                 params: FwdParams, interpret: bool = False, fresh: bool = False) -> tuple:
        """Merged into the running state in place (`scan_kernel.accumulate`): no block output is made, and a
        `fresh` state is read as any other."""
        return scan_kernel.accumulate(state, q, k, v, q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec,
                                      block_q=params.block_q, block_kv=params.block_kv)

    def fwd_finish(self, state: tuple, q) -> tuple:
        return scan_kernel.result(state, q.shape[1])

    def keys_start(self, k, v, *, params: FwdParams | BwdParams) -> tuple:
        """Heads-major (`scan_tiling.heads_major`), once a ring: a key tile is then a slice of whole rows,
        however often the loops read it."""
        return scan_tiling.heads_major(k), scan_tiling.heads_major(v)

    def block_bwd(self, q, k, v, o, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                  spec: AttentionSpec, params: BwdParams, interpret: bool = False):
        return scan_kernel.backward(q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias, spec=spec,
                                    **_tiles(params))

    def bwd_start(self, q, do, *, params: BwdParams) -> tuple:
        return q, do  # tiled by reshaping in each step: nothing to make once

    def dq_start(self, q, k, *, params: BwdParams):
        """Query tiles as the pass that computes dq keeps them (`scan_kernel.dq_state`)."""
        return scan_kernel.dq_state(q, k, **_tiles(params))

    def dq_finish(self, dq, q, *, params: BwdParams):
        return scan_kernel.dq_result(dq, q.shape[1], _tiles(params)["dq_tiles"])

    def grads_start(self, k, v, *, params: BwdParams | None = None) -> tuple:
        """Heads-major, as the keys travel."""
        return tuple(jnp.zeros(scan_tiling.heads_major(x).shape, jnp.float32) for x in (k, v))

    def bwd_idle(self, k, v) -> tuple:
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (k, v))

    def grads_finish(self, grads: tuple, k, v) -> tuple:
        return tuple(scan_tiling.caller_major(g).astype(x.dtype) for g, x in zip(grads, (k, v)))

    def bwd_step(self, dq, rows: tuple, k, v, o, lse, delta, q_pos, kv_pos, q_seg, kv_seg, bias, *,
                 spec: AttentionSpec, params: BwdParams, interpret: bool = False) -> tuple:
        """The block's dq added into the running `dq` in place; its dk and dv, heads-major, left for
        `bwd_accumulate`."""
        q, do = rows
        dq, dk, dv, dbias = scan_kernel.step_backward(dq, q, k, v, lse, do, delta, q_pos, kv_pos, q_seg, kv_seg, bias,
                                                      spec=spec, **_tiles(params))
        return dq, dbias, (dk, dv)


def _tiles(params: BwdParams) -> dict:
    return {"dkv_tiles": (params.block_q_dkv, params.block_kv_dkv),
            "dq_tiles": None if params.fused_dq else (params.block_q_dq, params.block_kv_dq)}
