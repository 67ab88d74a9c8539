"""The forward landscape of the pallas_tpu space for a TPU topology: every variant the TPU compiler accepts,
ranked by the analytic model. Nothing runs; no TPU is needed (libtpu: `pip install 'ring-tuner[tpu]'`).

    python benchmarks/landscape_tpu.py PROBLEM [--target v5e:2x2] [--workers 2]

The problem is one of `benchmarks/landscape.py --list` whose ring is the topology's chips. For
each forward variant of the space, as `tuner search --device tpu --dry-run --target` does it
(`tuner.tuning.compiled`): the target chip's constraints first (a ruled-out point is `pruned`, with the
reason), then the whole forward ring compiled for the topology (a compiler error is `failed`, with its
first line), then the model's seconds (`tuner.models.tpu_model`). A point's value is its modelled seconds
over the default's. The model has no noise: the `noise` block repeats the default's and the best's values,
so a replay draws them exactly.

Only the forward: the dry run compiles the backward one kernel's tiles at a time, not the product of the
dK/dV and dQ tiles that a backward landscape walks.

Writes `benchmarks/results/landscape-pallas_tpu-<chip>-<problem>.json`, in `landscape.py`'s format, which
`benchmarks/replay.py` reads beside the CPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOISE_REPEATS = 5


def modelled(name: str, target: str, workers: int) -> dict:
    """The landscape file of problem `name` on the topology `target`."""
    from landscape import PROBLEMS

    from tuner.models import tpu_model
    from tuner.semantics.problem import Problem
    from tuner.strategies.implementations import TileConfig
    from tuner.tuning import compiled

    mesh = compiled.topology_mesh(target)
    problem = Problem(**PROBLEMS[name])
    if problem.ring_size != mesh.size:
        raise ValueError(f"{name} runs on a ring of {problem.ring_size}; {target} has {mesh.size} chips: pick a "
                         f"problem of that ring, or a topology of {problem.ring_size} chips")
    _, default_fwd, default_bwd = compiled.variants_of(problem, mesh)
    report = compiled.compile_target(problem, target, workers=workers, parts=("fwd",))
    default_s = tpu_model.predict(problem, report.chip, fwd=default_fwd).seconds
    points = []
    for v in report.variants:
        entry = {"config": v.config.to_dict()["fwd"]}
        if v.ruled_out is not None:
            points.append({**entry, "status": "pruned", "reason": v.ruled_out})
        elif v.error is not None:
            points.append({**entry, "status": "failed", "reason": v.error})
        else:
            seconds = v.predicted.seconds
            points.append({**entry, "status": "ok", "seconds": seconds, "default_seconds": default_s,
                           "rel": seconds / default_s})
        print(f"{name} {target} fwd {entry['config']}: {points[-1]['status']} "
              f"{points[-1].get('rel', points[-1].get('reason', ''))}", file=sys.stderr, flush=True)
    ok = [p for p in points if p["status"] == "ok"]
    best = min(ok, key=lambda p: p["rel"])
    part = {"part": "fwd", "objective": "fwd", "grid": len(report.variants),
            "default": TileConfig(default_fwd, default_bwd).to_dict()["fwd"], "points": points,
            "noise": {"default_rel": [1.0] * NOISE_REPEATS, "best_rel": [best["rel"]] * NOISE_REPEATS,
                      "best_config": best["config"]},
            "seconds_total": report.seconds, "device_kind": report.device_kind, "target": target,
            "command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
            "value": "the TPU model's seconds of the variants the TPU compiler accepted; nothing ran"}
    return {"backend": "pallas_tpu", "device": target, "problem": dataclasses.asdict(problem), "parts": {"fwd": part}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="one of `python benchmarks/landscape.py --list`")
    parser.add_argument("--target", default="v5e:2x2", help="a TPU topology (v5e:2x2, v6e:2x2, ...)")
    parser.add_argument("--workers", type=int, default=2, help="variants compiled at once")
    options = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from landscape import PROBLEMS

    if options.problem not in PROBLEMS:
        parser.error(f"problem must be one of {', '.join(PROBLEMS)}, got {options.problem!r}")
    try:
        recorded = modelled(options.problem, options.target, options.workers)
    except ValueError as error:  # a topology libtpu does not give, or one of another ring size
        parser.error(str(error))
    chip = options.target.split(":")[0]
    out = ROOT / "benchmarks" / "results" / f"landscape-pallas_tpu-{chip}-{options.problem}.json"
    out.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
