"""The GPU benchmark's harness, run on the CPU: the Triton kernels in the interpreter against XLA at a
tiny point (cuDNN recorded as unavailable), its FLOP accounting, target checks and argument errors;
and the per-call timing it relies on."""

import importlib.util
import json
import time

import pytest

from tuner.tuning.timing import DEVICE_WARMUP_S, attention_flops, run_interleaved, warmup_seconds_on

import scripts

INTERPRETER = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch for the interpreter (pip install -e '.[test]')")


def run_interpreted(tmp_path, *args: str) -> tuple[int, dict]:
    """The benchmark with the kernels interpreted, at a tiny point: exit status and its JSON."""
    out = tmp_path / "result.json"
    status = scripts.load("benchmarks/gpu/gpu_attention.py").main(
        ["--interpret", "--head-dims", "16", "--seq-lens", "32", *args, "--out", str(out)])
    return status, json.loads(out.read_text())


def test_back_to_back_calls_are_timed_per_call_on_distinct_inputs():
    seen = []

    def thunk(i):
        seen.append(i)
        time.sleep(0.02)

    timing = run_interleaved({"sleep": thunk}, runs=3, warmup=1, calls=4)["sleep"]
    assert seen == [-1, -2, -3, -4, *range(12)], "each call of each run gets its own input index"
    assert 0.02 <= timing.median < 0.04, f"{timing.median:.3f} s is not the time of one call"
    with pytest.raises(ValueError, match="calls must be >= 1"):
        run_interleaved({"sleep": thunk}, calls=0)
    with pytest.raises(ValueError, match="warmup_seconds must be >= 0"):
        run_interleaved({"sleep": thunk}, warmup_seconds=-1.0)


def test_rounds_alternate_their_order_and_share_each_rounds_inputs():
    seen = []
    thunks = {name: (lambda i, name=name: seen.append((name, i))) for name in "abc"}
    run_interleaved(thunks, runs=3, warmup=1)
    assert seen == [("a", -1), ("b", -1), ("c", -1), ("c", 0), ("b", 0), ("a", 0),
                    ("a", 1), ("b", 1), ("c", 1), ("c", 2), ("b", 2), ("a", 2)]


def test_warm_up_lasts_its_seconds_before_any_timed_run():
    issued = []

    def thunk(i):
        issued.append((i, time.perf_counter()))
        time.sleep(0.01)

    start = time.perf_counter()
    run_interleaved({"sleep": thunk}, runs=2, warmup=1, warmup_seconds=0.1)
    warm = [t for i, t in issued if i < 0]
    timed = [t for i, t in issued if i >= 0]
    assert len(timed) == 2 and len(warm) >= 2, "the warm-up ran past its one round"
    assert timed[0] - start >= 0.1, "a timed run began before the warm-up's seconds were over"
    assert warmup_seconds_on("cpu") == 0.0 and warmup_seconds_on("gpu") == warmup_seconds_on("tpu") == DEVICE_WARMUP_S


@pytest.mark.slow
@INTERPRETER
def test_harness_checks_and_times_every_objective_on_the_cpu(tmp_path, capsys):
    status, result = run_interpreted(tmp_path, "--tokens", "64", "--hidden", "32", "--runs", "1", "--calls", "2",
                                     "--warmup", "0", "--implementations", "ring,cudnn,xla")
    assert status == 0, capsys.readouterr().err
    assert result["device"].startswith("cpu") and result["interpret"] is True
    assert result["unavailable"] == {"cudnn": "cuDNN needs a CUDA GPU"}
    assert len(result["checks"]) == 2
    for check in result["checks"]:
        assert set(check["errors"]) == {"ring", "xla"}  # the cudnn engine's rings: tests/test_gpu_session.py
        for errors in check["errors"].values():
            assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 2e-2
    rows = result["rows"]
    assert [(r["causal"], r["objective"]) for r in rows] == [
        (c, o) for c in (False, True) for o in ("fwd", "bwd", "fwd+bwd")]
    for row in rows:
        assert (row["batch"], row["seq_len"], row["heads"], row["head_dim"]) == (2, 32, 2, 16)
        assert row["flops"] == attention_flops(2, 2, 32, 32, 16, causal=row["causal"], objective=row["objective"])
        for name in ("ring", "xla"):
            assert row[name]["median_s"] > 0 and row[name]["runs"] == 1
            assert row[name]["tflops"] == pytest.approx(row["flops"] / row[name]["median_s"] / 1e12)
        assert "cudnn" not in row and "ratio_vs_cudnn" not in row
    assert "ring ms" in capsys.readouterr().out


@INTERPRETER
def test_a_failed_check_stops_the_point_and_the_exit_status_says_so(tmp_path, capsys):
    """bf16 is never within 1e-9 of float32: every point must fail its check and time nothing."""
    status, result = run_interpreted(tmp_path, "--tokens", "32", "--hidden", "16", "--causal", "true",
                                     "--max-error", "1e-9")
    assert status == 1
    assert "FAILED check at D=16 S=32 causal=True" in capsys.readouterr().err
    assert result["rows"] == [] and len(result["checks"]) == 1


def test_tuned_tiles_are_the_search_row_of_the_point_on_this_device(tmp_path):
    """`--tuned DB` times the tiles `tuner search` stored for the point's own key (one device, bf16, this
    device kind); a point without such a row gets None (the harness then times the default alone)."""
    import jax

    from tuner import BwdParams, FwdParams, registry
    from tuner.cache import Cache, make_row
    from tuner.semantics.problem import Problem, ProblemKey

    bench = scripts.load("benchmarks/gpu/gpu_attention.py")
    point = {"batch": 2, "seq_len": 256, "heads": 4, "head_dim": 64}
    problem = Problem(batch=2, seq_len=256, heads=4, kv_heads=4, head_dim=64, dtype="bfloat16", causal=True,
                      ring_size=1)
    key = ProblemKey.of(problem.shapes, problem.spec, backend="triton", device_kind=jax.devices()[0].device_kind,
                        ring_size=1, layout="zigzag")
    fwd = FwdParams(block_q=64, block_kv=32, num_warps=4, num_stages=3)
    bwd = BwdParams(block_q_dkv=32, block_kv_dkv=64, block_q_dq=64, block_kv_dq=32, num_warps=8, num_stages=2)
    db = tmp_path / "tuning.sqlite"
    Cache(db).put(make_row(key, fwd, bwd, versions=registry.versions(registry.get("triton")), tool_version="test",
                           objective="fwd+bwd", best_s=1.0, default_s=2.0, speedup=2.0, trials_run=3,
                           trials_pruned=0, study="s"))
    assert bench.tuned_params(Cache(db), point, causal=True) == (fwd, bwd)
    assert bench.tuned_params(Cache(db), point, causal=False) is None
    assert bench.tuned_params(Cache(db), {**point, "batch": 1}, causal=True) is None


def test_targets_are_checked_at_d128_from_4k_tokens():
    bench = scripts.load("benchmarks/gpu/gpu_attention.py")
    base = {"batch": 4, "heads": 16, "head_dim": 128, "causal": True}
    rows = [{**base, "seq_len": 4096, "objective": "fwd", "ratio_vs_cudnn": 0.7},
            {**base, "seq_len": 8192, "objective": "bwd", "ratio_vs_cudnn": 0.4},
            {**base, "seq_len": 8192, "objective": "fwd+bwd", "ratio_vs_cudnn": 0.9},
            {**base, "seq_len": 2048, "objective": "fwd", "ratio_vs_cudnn": 0.1},
            {**base, "head_dim": 64, "seq_len": 4096, "objective": "fwd", "ratio_vs_cudnn": 0.1},
            {**base, "seq_len": 16384, "objective": "fwd"}]
    checks = bench.target_checks(rows)
    assert [(c["objective"], c["seq_len"], c["target"], c["met"]) for c in checks] == [
        ("fwd", 4096, 0.6, True), ("bwd", 8192, 0.5, False)]


def test_the_cudnn_engine_s_targets_take_the_faster_of_its_two_chunkings():
    bench = scripts.load("benchmarks/gpu/gpu_attention.py")
    base = {"batch": 4, "heads": 16, "head_dim": 128, "causal": True, "seq_len": 4096}
    rows = [{**base, "objective": "fwd", "ring_cudnn_vs_cudnn": 0.7, "ring_cudnn_shard_vs_cudnn": 0.95},
            {**base, "objective": "bwd", "ring_cudnn_vs_cudnn": 0.8},
            {**base, "seq_len": 2048, "objective": "bwd", "ring_cudnn_vs_cudnn": 0.1}]
    checks = bench.target_checks(rows)
    assert [(c["objective"], c["of"], c["target"], c["met"]) for c in checks] == [
        ("fwd", "ring_cudnn_shard", 0.9, True), ("bwd", "ring_cudnn", 0.85, False)]


@pytest.mark.parametrize("args, message", [
    (["--objectives", "fwd,sideways"], "--objectives: unknown sideways"),
    (["--calls", "0"], "--calls must be >= 1"),
    (["--tokens", "100", "--seq-lens", "32"], "--tokens 100 is not a multiple of sequence length 32"),
    (["--hidden", "96", "--head-dims", "64"], "--hidden 96 is not a multiple of head dim 64"),
    (["--seq-lens", "1k"], "--seq-lens must be comma-separated integers"),
])
def test_bad_arguments_name_the_argument(args, message, capsys):
    bench = scripts.load("benchmarks/gpu/gpu_attention.py")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--interpret", *args])
    said = capsys.readouterr().err + str(exit_info.value.code)
    assert message in said


def test_without_a_gpu_it_says_what_to_do(capsys):
    bench = scripts.load("benchmarks/gpu/gpu_attention.py")
    assert bench.main([]) == 2
    assert "no CUDA GPU visible to jax" in capsys.readouterr().err
