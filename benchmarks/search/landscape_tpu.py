"""The landscapes of the pallas_tpu space for a TPU topology: every variant the TPU compiler accepts, ranked
by the analytic model. Nothing runs; no TPU is needed (libtpu: `pip install 'ring-tuner[tpu]'`).

    python benchmarks/search/landscape_tpu.py PROBLEM [--target v5e:2x2] [--part fwd|bwd|both] [--workers 2]

The problem is one of `benchmarks/search/landscape.py --list` whose ring is the topology's chips. Each kernel's
variants are handled as `tuner search --device tpu --dry-run --target` handles them
(`tuner.tuning.compiled`): the target chip's constraints first (a ruled-out point is `pruned`, with the
reason), then the whole ring compiled for the topology (a compiler error is `failed`, with its first
line), then the model's seconds (`tuner.models.tpu_model`). A point's value is its modelled seconds over
the default's. The model has no noise: the `noise` block repeats the default's and the best's values, so
a replay draws them exactly.

The forward landscape has one point per forward variant. The backward runs two kernels, dK/dV and dQ,
each a pallas_call of its own with its own tiles and its own VMEM; a backward point is a pair of their
tiles. Each kernel's tiles are compiled once (beside the other kernel's default tiles), and a pair is
`ok` when the constraints admit the pair and both its kernels compiled, `failed` with the first
kernel's error otherwise; the model values the pair. So the backward landscape covers the whole
product (every dK/dV tile pair times every dQ tile pair) for the price of compiling each kernel's
variants once.

Writes `benchmarks/search/results/landscape-pallas_tpu-<chip>-<problem>.json`, in `landscape.py`'s format, which
`benchmarks/search/replay.py` reads beside the CPU ones; a later run of another part adds to the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
NOISE_REPEATS = 5


def _noise(best: dict) -> dict:
    """The noise block of a modelled landscape: the values repeat exactly."""
    return {"default_rel": [1.0] * NOISE_REPEATS, "best_rel": [best["rel"]] * NOISE_REPEATS,
            "best_config": best["config"]}


def _verdict(variant) -> dict:
    """A compiled variant's status: pruned (with the constraint's reason), failed (the compiler's) or ok."""
    if variant.ruled_out is not None:
        return {"status": "pruned", "reason": variant.ruled_out}
    if variant.error is not None:
        return {"status": "failed", "reason": variant.error}
    return {"status": "ok"}


def modelled(name: str, target: str, workers: int, parts: tuple[str, ...]) -> dict:
    """The landscape file of problem `name` on the topology `target`, with the `parts` ("fwd", "bwd")."""
    import jax
    from landscape import PROBLEMS

    from tuner import registry
    from tuner.kernels import pallas_tpu
    from tuner.models import tpu_model
    from tuner.semantics.problem import Problem
    from tuner.strategies.configs import TileConfig
    from tuner.tuning import compiled

    mesh = compiled.topology_mesh(target)
    problem = Problem(**PROBLEMS[name])
    if problem.ring_size != mesh.size:
        raise ValueError(f"{name} runs on a ring of {problem.ring_size}; {target} has {mesh.size} chips: pick a "
                         f"problem of that ring, or a topology of {problem.ring_size} chips")
    _, default_fwd, default_bwd = compiled.variants_of(problem, mesh)
    kernels = ("fwd",) * ("fwd" in parts) + ("dkv", "dq") * ("bwd" in parts)
    report = compiled.compile_target(problem, target, workers=workers, parts=kernels)
    chip = report.chip

    def part_file(part: str, points: list[dict]) -> dict:
        best = min((p for p in points if p["status"] == "ok"), key=lambda p: p["rel"])
        return {"part": part, "objective": part, "grid": len(points),
                "default": TileConfig(default_fwd, default_bwd).to_dict()[part], "points": points,
                "noise": _noise(best), "seconds_total": report.seconds, "device_kind": report.device_kind,
                "target": target, "command": " ".join(["python", *sys.argv]),
                "date": datetime.date.today().isoformat(),
                "value": "the TPU model's seconds of the variants the TPU compiler accepted; nothing ran"}

    def scored(entry: dict, seconds: float | None, default_s: float) -> dict:
        if entry["status"] == "ok":
            entry.update(seconds=seconds, default_seconds=default_s, rel=seconds / default_s)
        print(f"{name} {target} {entry['config']}: {entry['status']} {entry.get('rel', entry.get('reason', ''))}",
              file=sys.stderr, flush=True)
        return entry

    out = {}
    if "fwd" in parts:
        default_s = tpu_model.predict(problem, chip, fwd=default_fwd).seconds
        points = [scored({"config": v.config.to_dict()["fwd"], **_verdict(v)},
                         v.predicted.seconds if v.compiled else None, default_s)
                  for v in report.variants if v.part == "fwd"]
        out["fwd"] = part_file("fwd", points)
    if "bwd" in parts:
        tiles = {"dkv": ("block_q_dkv", "block_kv_dkv"), "dq": ("block_q_dq", "block_kv_dq")}
        kernel = {(v.part, tuple(getattr(v.config.bwd, f) for f in tiles[v.part])): v
                  for v in report.variants if v.part in tiles}
        space = registry.get("pallas_tpu").space(problem.shapes, problem.spec)
        backend = pallas_tpu.PallasTpuBackend()
        default_s = tpu_model.predict(problem, chip, bwd=default_bwd).seconds
        points = []
        for config in space.grid(TileConfig(default_fwd, default_bwd), ("bwd",)):
            bwd = config.bwd
            entry = {"config": config.to_dict()["bwd"]}
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the target chip's constraints
                reason = backend.violation(problem.shapes, problem.spec, None, bwd)
            if reason is not None:
                points.append(scored({**entry, "status": "pruned", "reason": reason}, None, default_s))
                continue
            verdicts = [_verdict(kernel[part, tuple(getattr(bwd, f) for f in fields)])
                        for part, fields in tiles.items()]
            bad = next((v for v in verdicts if v["status"] != "ok"), {"status": "ok"})
            seconds = tpu_model.predict(problem, chip, bwd=bwd).seconds if bad["status"] == "ok" else None
            points.append(scored({**entry, **bad}, seconds, default_s))
        out["bwd"] = part_file("bwd", points)
    return {"backend": "pallas_tpu", "device": target, "problem": dataclasses.asdict(problem), "parts": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="one of `python benchmarks/search/landscape.py --list`")
    parser.add_argument("--target", default="v5e:2x2", help="a TPU topology (v5e:2x2, v6e:2x2, ...)")
    parser.add_argument("--part", choices=("fwd", "bwd", "both"), default="fwd", help="which landscape to record")
    parser.add_argument("--workers", type=int, default=2, help="variants compiled at once")
    options = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]
    from landscape import PROBLEMS

    if options.problem not in PROBLEMS:
        parser.error(f"problem must be one of {', '.join(PROBLEMS)}, got {options.problem!r}")
    try:
        recorded = modelled(options.problem, options.target, options.workers,
                            ("fwd", "bwd") if options.part == "both" else (options.part,))
    except ValueError as error:  # a topology libtpu does not give, or one of another ring size
        parser.error(str(error))
    chip = options.target.split(":")[0]
    out = RESULTS / f"landscape-pallas_tpu-{chip}-{options.problem}.json"
    if out.exists():  # keep the parts recorded before
        recorded["parts"] = {**json.loads(out.read_text())["parts"], **recorded["parts"]}
    out.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
