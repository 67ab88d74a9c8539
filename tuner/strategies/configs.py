"""The configs of the built-in implementations, and how a ring's tiles are chosen and searched.

- `TileConfig`: a ring's forward and backward tiles; the exchanges take it for their inner ring.
- `NoConfig`: the config of an implementation with nothing to tune (the gathered mechanisms).
- `TileSpace`: the optuna space over a kernel's tile candidates, tiles offered as ranks.
- The default tiles a kernel starts from (`kernel_default`), square where positions mask tiles out
  (`squared`), and no longer than a packed document's tile where the kernel accepts that
  (`capped_where_accepted`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tuner import registry
from tuner.kernels.base import Backend, SearchSpace
from tuner.kernels.params import BwdParams, FwdParams
from tuner.semantics.spec import AttentionSpec, LocalShapes


def _part(data: Any, part: str, kind: type) -> Any:
    """`kind` built from `data[part]`: only its known fields, each validated by `kind`."""
    name = f"{part}_params"
    values = data.get(part) if isinstance(data, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a JSON object, got {values!r}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        return kind(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None


@dataclass(frozen=True)
class TileConfig:
    """A ring's config: the forward and the backward tiles of its block kernel."""

    fwd: FwdParams = FwdParams()
    bwd: BwdParams = BwdParams()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {"fwd": self.fwd.to_dict(), "bwd": self.bwd.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TileConfig:
        return cls(_part(data, "fwd", FwdParams), _part(data, "bwd", BwdParams))


def capped(config: TileConfig, tile: int) -> TileConfig:
    """`config` with every query and key tile no longer than `tile`."""
    fwd, bwd = config.fwd, config.bwd
    dq = {} if bwd.block_q_dq is None else dict(block_q_dq=min(bwd.block_q_dq, tile),
                                                 block_kv_dq=min(bwd.block_kv_dq, tile))
    return TileConfig(dataclasses.replace(fwd, block_q=min(fwd.block_q, tile), block_kv=min(fwd.block_kv, tile)),
                      dataclasses.replace(bwd, block_q_dkv=min(bwd.block_q_dkv, tile),
                                          block_kv_dkv=min(bwd.block_kv_dkv, tile), **dq))


def capped_where_accepted(kernel: Backend, shapes: LocalShapes, spec: AttentionSpec, default: TileConfig,
                          tile: int) -> TileConfig:
    """`default` with its tiles no longer than `tile` (`capped`) where `kernel` accepts them on these shapes,
    else `default` (Pallas on a TPU takes no key tile under 128 shorter than the sequence)."""
    packed = capped(default, tile)
    return default if parts_violation(kernel, shapes, spec, packed, ("fwd", "bwd")) else packed


def parts_violation(kernel: Backend, shapes: LocalShapes, spec: AttentionSpec, config: TileConfig,
                    parts: tuple[str, ...]) -> str | None:
    """`kernel`'s constraints on the `parts` ("fwd", "bwd") of `config`."""
    return kernel.violation(shapes, spec, config.fwd if "fwd" in parts else None,
                            config.bwd if "bwd" in parts else None)


def kernel_default(kernel: Backend, q_len: int, kv_len: int, head_dims: tuple[int, ...], spec: AttentionSpec
                   ) -> TileConfig:
    """`kernel`'s default tiles for these lengths and head dims; where positions mask tiles out (causal,
    window, chunk), square ones no longer than its `masked_tile` (`squared`)."""
    default = TileConfig(*kernel.default_params(q_len, kv_len, *head_dims))
    if spec.has_position_mask and kernel.masked_tile is not None:
        return squared(default, kernel.masked_tile, q_len, kv_len)
    return default


def masked_side(longest: int, *tiles: int) -> int:
    """The side of the square tile a kernel takes where positions mask tiles out, from its unmasked default
    `tiles`: the longer one, no longer than `longest` (the backend's `masked_tile`)."""
    return min(longest, max(tiles))


def squared(config: TileConfig, longest: int, q_len: int, kv_len: int) -> TileConfig:
    """`config` with square tiles in each kernel (forward, dK/dV, dQ): `masked_side` of its tiles there,
    cut to the lengths."""
    def side(*tiles: int) -> tuple[int, int]:
        tile = masked_side(longest, *tiles)
        return min(tile, q_len), min(tile, kv_len)

    fwd, bwd = config.fwd, config.bwd
    block_q, block_kv = side(fwd.block_q, fwd.block_kv)
    block_q_dkv, block_kv_dkv = side(bwd.block_q_dkv, bwd.block_kv_dkv)
    dq = {} if bwd.block_q_dq is None else dict(zip(("block_q_dq", "block_kv_dq"), side(bwd.block_q_dq,
                                                                                       bwd.block_kv_dq)))
    return TileConfig(dataclasses.replace(fwd, block_q=block_q, block_kv=block_kv),
                      dataclasses.replace(bwd, block_q_dkv=block_q_dkv, block_kv_dkv=block_kv_dkv, **dq))


@dataclass(frozen=True)
class NoConfig:
    """The config of an implementation with nothing to tune."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {"fwd": {}, "bwd": {}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NoConfig:
        for part in registry.PARTS:
            values = data.get(part) if isinstance(data, dict) else None
            if values != {}:
                raise ValueError(f"{part}_params must be an empty JSON object (nothing to tune), got {values!r}")
        return cls()


RANK = "_rank"  # suffix of a tile field's optuna parameter when it is offered as a rank


@dataclass(frozen=True)
class TileSpace:
    """A ring's `Space` over its kernel's candidates (`tuner.kernels.base.SearchSpace`): forward fields,
    backward fields, and whether dq runs fused into the dk/dv pass or as a separate pass with its own
    tiles (optuna parameter `bwd.dq_pass`, then `bwd.block_q_dq` and `bwd.block_kv_dq`).

    A field with two or more sizes (tiles, warps, stages) is offered to the sampler as its rank among
    the sorted sizes (parameter `fwd.block_q_rank`, an int), so that TPE models 128 as lying between 64
    and 256; as categories the backward's 4 or 5 tile fields took it several times the trials
    (`benchmarks/search/README.md`, "Tiles as ranks for TPE"). Other fields stay categories."""

    candidates: SearchSpace

    def _sizes(self, key: str) -> tuple[int, ...] | None:
        """The sorted sizes of parameter `key` ("fwd.block_q"), or None where it is no field of two or
        more sizes (so it is offered as a category)."""
        part, name = key.split(".", 1)
        space = self.candidates
        if part == "fwd":
            choices = space.fwd.get(name, ())
        else:
            choices = space.dq_tiles if name in ("block_q_dq", "block_kv_dq") else space.bwd.get(name, ())
        if len(choices) > 1 and all(type(c) is int for c in choices):
            return tuple(sorted(choices))
        return None

    def _pick(self, trial: Any, key: str, choices: tuple[Any, ...]) -> Any:
        sizes = self._sizes(key)
        if sizes is None:
            return trial.suggest_categorical(key, choices)
        return sizes[trial.suggest_int(key + RANK, 0, len(sizes) - 1)]

    def suggest(self, trial: Any, default: TileConfig, parts: tuple[str, ...]) -> TileConfig:
        fwd, bwd = default.fwd, default.bwd
        space = self.candidates
        if "fwd" in parts:
            fwd = FwdParams(**{n: self._pick(trial, f"fwd.{n}", c) for n, c in space.fwd.items()})
        if "bwd" in parts:
            fields = {n: self._pick(trial, f"bwd.{n}", c) for n, c in space.bwd.items()}
            passes = tuple(p for p in space.dq_passes if p == "fused" or space.dq_tiles)
            if trial.suggest_categorical("bwd.dq_pass", passes) == "separate":
                for name in ("block_q_dq", "block_kv_dq"):
                    fields[name] = self._pick(trial, f"bwd.{name}", space.dq_tiles)
            bwd = BwdParams(**fields)
        return TileConfig(fwd, bwd)

    def params(self, config: TileConfig, parts: tuple[str, ...]) -> dict[str, Any]:
        """The optuna parameters that make `suggest` return `config` (a size it does not hold is an error)."""
        values: dict[str, Any] = {}
        if "fwd" in parts:
            values.update({f"fwd.{k}": v for k, v in config.fwd.to_dict().items() if v is not None})
        if "bwd" in parts:
            bwd = config.bwd.to_dict()
            dq = {"bwd.block_q_dq": bwd.pop("block_q_dq"), "bwd.block_kv_dq": bwd.pop("block_kv_dq")}
            values.update({f"bwd.{k}": v for k, v in bwd.items() if v is not None})
            values["bwd.dq_pass"] = "fused" if config.bwd.fused_dq else "separate"
            if not config.bwd.fused_dq:
                values.update(dq)
        params = {}
        for key, value in values.items():
            sizes = self._sizes(key)
            if sizes is None:
                params[key] = value
            elif value in sizes:
                params[key + RANK] = sizes.index(value)
            else:
                raise ValueError(f"{key}={value} is not among this problem's candidates {list(sizes)}")
        return params

    def config(self, params: dict[str, Any], default: TileConfig) -> TileConfig:
        """The config of a trial's `params`: ranks (as `suggest` asks them) or sizes (as older trials and
        recorded landscapes hold them)."""
        values = {}
        for key, value in params.items():
            if key.endswith(RANK):
                key = key.removesuffix(RANK)
                value = self._sizes(key)[value]
            values[key] = value
        fwd = {k[4:]: v for k, v in values.items() if k.startswith("fwd.")}
        bwd = {k[4:]: v for k, v in values.items() if k.startswith("bwd.") and k != "bwd.dq_pass"}
        return TileConfig(FwdParams(**fwd) if fwd else default.fwd, BwdParams(**bwd) if bwd else default.bwd)

    def grid(self, default: TileConfig, parts: tuple[str, ...]) -> list[TileConfig]:
        """Every forward point and every backward point, walked side by side (the passes are separate,
        so covering each once covers every combination that can win: the best of each are combined)."""
        fwds = list(self.candidates.fwd_points()) if "fwd" in parts else [default.fwd]
        bwds = list(self.candidates.bwd_points()) if "bwd" in parts else [default.bwd]
        return [TileConfig(fwds[i % len(fwds)], bwds[i % len(bwds)]) for i in range(max(len(fwds), len(bwds)))]


__all__ = ["NoConfig", "RANK", "TileConfig", "TileSpace", "capped", "capped_where_accepted", "kernel_default",
           "masked_side", "parts_violation", "squared"]
