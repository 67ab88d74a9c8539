"""The GPU session's one command, rehearsed on the CPU (`--dry-run`): every step runs and writes what a
GPU session writes, with the Triton kernels in their interpreter, the cudnn kernel on its XLA twin, and
auto's pick between two implementations that run on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.semantics.problem import Problem

import scripts

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "benchmarks" / "gpu" / "gpu_session.sh"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="the dry run interprets the Triton kernels: pip install -e '.[test]'")
def test_the_dry_run_writes_every_file_a_gpu_session_writes(tmp_path):
    out = tmp_path / "session"
    # through the path the GPU plan names, benchmarks/gpu_session.sh
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), str(out), "--dry-run"],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    log = (out / "session.log").read_text() if (out / "session.log").exists() else ""
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{log[-3000:]}"
    steps = dict(line.split() for line in (out / "steps.txt").read_text().splitlines())
    assert steps == {"environment": "0", "check-float32": "0", "check-bfloat16": "0", "timings": "0",
                     "auto": "0", "zigzag-step": "0"}, steps

    environment = json.loads((out / "environment.json").read_text())
    assert environment["jax"] and environment["jaxlib_extension_version"] and environment["cudnn_binding"] == "bound"

    for dtype, bound in (("float32", 1e-5), ("bfloat16", 2e-2)):
        checked = json.loads((out / f"check-{dtype}.json").read_text())
        assert checked["dtype"] == dtype and checked["group"] == 2 and checked["rows"] == []
        assert {c["causal"] for c in checked["checks"]} == {False, True}
        for point in checked["checks"]:
            errors = point["errors"]
            assert all(point["same_bits_twice"].values()) and "ring" in point["same_bits_twice"], point
            assert max(errors["ring"].values()) <= bound, errors
            if dtype == "float32":
                assert "does not support dtype float32" in errors["ring_cudnn"], errors
            else:
                assert max(errors["ring_cudnn"].values()) <= bound, errors
        assert "cudnn" in checked["unavailable"]  # jax.nn's cuDNN: no GPU here

    timings = json.loads((out / "timings.json").read_text())
    assert {(r["causal"], r["objective"]) for r in timings["rows"]} == {
        (causal, objective) for causal in (False, True) for objective in ("fwd", "bwd")}
    for row in timings["rows"]:
        assert all(row[name]["median_s"] > 0 for name in ("ring", "ring_cudnn", "ring_cudnn_shard")), row

    # auto: each problem benched, and auto runs the implementation the bench measured faster
    auto = json.loads((out / "auto.json").read_text())
    assert auto["failed"] == [] and {r["causal"] for r in auto["rows"]} == {False, True}, auto
    for row in auto["rows"]:
        assert set(row["bench_s"]) == {"scan", "all_to_all"} and "harness" not in row, row
        assert row["auto_runs"] == min(row["bench_s"], key=row["bench_s"].get) and row["auto_runs_the_faster"], row
        assert row["auto_reason"].startswith("tuner bench --mechanisms measured"), row

    # one zigzag step: the halves read as prefixes compute what the switch does, but for bf16 rounding, and
    # each way was timed
    zigzag = json.loads((out / "zigzag-step.json").read_text())
    assert [r["objective"] for r in zigzag["rows"]] == ["fwd", "bwd"], zigzag
    for row in zigzag["rows"]:
        assert 0 <= row["prefixes_vs_switch_relative"] <= 4 * 2.0 ** -8, row  # a few bf16 resolutions
        assert all(row[w]["median_s"] > 0 for w in ("prefixes", "switch", "floor")), row

    # the harness's order of the two engines, which the GPU session compares the bench with
    problem = Problem(batch=1, seq_len=32, heads=2, kv_heads=2, head_dim=16, dtype="bfloat16", causal=True,
                      ring_size=1)
    module = scripts.load("benchmarks/gpu/auto_pick.py")
    rows = [r for r in timings["rows"] if r["causal"]]
    want = {engine: sum(r[name]["median_s"] for r in rows) for engine, name in (("triton", "ring"),
                                                                                 ("cudnn", "ring_cudnn"))}
    assert module.harness_order(timings, problem, ["cudnn", "triton"]) == {"seconds": want,
                                                                           "faster": min(want, key=want.get)}
    assert module.harness_order(timings, problem, ["scan", "all_to_all"]) is None


def test_without_an_output_folder_it_says_how_to_call_it():
    run = subprocess.run(["bash", str(SESSION)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "usage: bash benchmarks/gpu/gpu_session.sh OUT [--dry-run]" in run.stderr
