"""The GPU side of issue 31 without a GPU: the compiler's verdict as the search's pruning rule, the
roofline model that ranks what it admits, the defaults per architecture it chose, and `tuner search
--device gpu --dry-run --target` that stores the model's best as a `compiled` row."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tuner import registry
from tuner.cache import Cache
from tuner.kernels import triton, triton_compile, triton_launch
from tuner.kernels.params import FwdParams
from tuner.models import gpu_model
from tuner.semantics.problem import Problem
from tuner.semantics.spec import AttentionSpec, LocalShapes

import scripts

pytest.importorskip("triton")

triton_defaults = scripts.load("benchmarks/gpu/triton_defaults.py")


def sweep_records() -> list[dict]:
    return [json.loads(line) for path in triton_defaults.SWEEPS for line in path.read_text().splitlines()
            if line.strip()]


def verdict(mma: str = "HGMMA", tensor_core: bool = True, blocks: int = 1, warps: int = 8) -> dict:
    return {"mma": mma, "tensor_core": tensor_core, "blocks_per_sm": blocks, "warps_per_sm": blocks * warps,
            "shared": 64 * 1024, "spill_bytes": 0, "limited_by": "shared"}


H100 = gpu_model.GPUS["h100"]
PROBLEM = Problem(batch=4, seq_len=4096, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16", causal=False,
                  ring_size=1, layout="contiguous")


def test_the_pruning_rule_rules_out_exactly_what_the_compiler_spills_or_cannot_fit_over_the_sweeps():
    """Over every launch of the committed sweeps (three kernels, whole search space, sm_80/sm_90/sm_100):
    the rule admits no launch that spills, exceeds a block's shared memory or fits no SM, and rules out
    no other one."""
    records = sweep_records()
    assert len(records) >= 864
    spilled = 0
    for record in records:
        bad = "error" in record or record["spill_bytes"] > 0 or not record["fits_shared"] or \
            record["blocks_per_sm"] == 0
        spilled += "error" not in record and record["spill_bytes"] > 0
        reason = triton_compile.ruled_out(record, int(record["target"][3:]))
        assert (reason is not None) == bad, (record, reason)
    assert spilled > 0


def test_a_search_on_the_gpu_never_times_a_launch_the_compiler_spills():
    """The backend's constraint compiles the launch again and agrees with the sweep: the first sm_90
    forward launch of the D=128 sweep that spills is ruled out with the compiler's reason; the same tiles
    with the other warp count, spill-free there, are admitted."""
    records = [r for r in sweep_records() if r["variant"] == "causal/bfloat16/128" and r["target"] == "sm_90"
               and r["kernel"] == "attention_fwd"]
    spill = next(r for r in records if r["spill_bytes"] > 0)
    clean = next(r for r in records if (r["block_q"], r["block_kv"], r["num_stages"]) ==
                 (spill["block_q"], spill["block_kv"], spill["num_stages"]) and r["num_warps"] != spill["num_warps"])
    assert clean["spill_bytes"] == 0
    shapes = LocalShapes(1, 4096, 4096, 16, 16, 128, "bfloat16")
    spec = AttentionSpec(scale=128**-0.5, causal=True)
    backend = triton.TritonBackend()

    def fwd(record):
        return FwdParams(block_q=record["block_q"], block_kv=record["block_kv"], num_warps=record["num_warps"],
                         num_stages=record["num_stages"])

    reason = backend.violation(shapes, spec, fwd(spill), None, capability=90)
    assert reason is not None and "spills registers on sm_90" in reason, reason
    assert backend.violation(shapes, spec, fwd(clean), None, capability=90) is None


def test_the_defaults_are_the_models_choice_among_the_launches_the_compiler_admits():
    """`triton.DEFAULTS` is what `benchmarks/gpu/triton_defaults.py` derives from the committed sweeps for
    every architecture and head-dim class they cover whole: so each default was compiled there, does not
    spill, and uses the tensor-core path."""
    chosen = triton_defaults.choose_defaults(sweep_records())
    covered = 0
    for (variant, arch), entry in chosen.items():
        if not entry["whole"]:
            continue
        head_dim = int(variant.split("/")[2])
        width = next(w for w in triton.WIDTHS if head_dim <= w)
        fwd, bwd = triton.DEFAULTS[(arch, width)]
        assert entry["config"] == {"fwd": dataclasses.asdict(fwd), "bwd": dataclasses.asdict(bwd)}, (variant, arch)
        assert all(launch["mma"] != "none" for launch in entry["launches"].values())
        covered += 1
    assert covered >= 6


def test_the_tensor_core_path_beats_mma_sync_and_float32_runs_on_the_cuda_cores():
    fast = gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 8, 3, verdict())
    legacy = gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 8, 3, verdict("HMMA", False))
    single = gpu_model.predict(dataclasses.replace(PROBLEM, dtype="float32"), H100, "attention_fwd", 128, 64, 8, 3,
                               verdict("none", False))
    assert fast.seconds < legacy.seconds < single.seconds
    assert fast.flops == legacy.flops and fast.tflops <= H100.tensor / 1e12
    assert gpu_model.matmul_rate(H100, "bfloat16", verdict("HMMA", False)) == H100.tensor * H100.legacy


def test_the_model_counts_the_tiles_the_causal_mask_skips_and_the_padded_head_dims():
    full = gpu_model.predict(PROBLEM, H100, "attention_dq", 64, 64, 4, 2, verdict())
    causal = gpu_model.predict(dataclasses.replace(PROBLEM, causal=True), H100, "attention_dq", 64, 64, 4, 2,
                               verdict())
    assert causal.flops == pytest.approx(full.flops * (64 * 65 / 2) / 64**2)
    padded = gpu_model.predict(dataclasses.replace(PROBLEM, head_dim=96, value_head_dim=96), H100, "attention_fwd",
                               64, 64, 4, 2, verdict())
    assert padded.flops == gpu_model.predict(PROBLEM, H100, "attention_fwd", 64, 64, 4, 2, verdict()).flops


def test_pipelining_occupancy_and_grid_fill_change_the_time():
    staged = gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 8, 2, verdict())
    unstaged = gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 8, 1, verdict())
    assert unstaged.seconds > staged.seconds
    few = gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 4, 2, verdict(blocks=1, warps=4))
    assert few.utilization == pytest.approx(0.5 * staged.utilization) and few.seconds > staged.seconds
    small = dataclasses.replace(PROBLEM, batch=1, heads=1, kv_heads=1)
    assert gpu_model.predict(small, H100, "attention_fwd", 128, 64, 8, 2, verdict()).utilization == \
        pytest.approx(32 / 132)


def test_the_model_refuses_what_it_cannot_rank():
    with pytest.raises(ValueError, match="kernel must be one of"):
        gpu_model.predict(PROBLEM, H100, "attention", 64, 64, 4, 2, verdict())
    with pytest.raises(ValueError, match="no block fits an SM"):
        gpu_model.predict(PROBLEM, H100, "attention_fwd", 64, 64, 4, 2, verdict(blocks=0))


def test_an_exchange_over_triton_is_timed_on_what_its_kernel_runs():
    """all_to_all over the Triton kernel does the ring's products on H/P heads of the whole sequence, in one
    launch a device (so fewer, longer programs); the model refuses an implementation over another kernel."""
    problem = dataclasses.replace(PROBLEM, ring_size=4)
    ring = gpu_model.predict(problem, H100, "attention_fwd", 128, 64, 8, 2, verdict())
    exchanged = gpu_model.predict(problem, H100, "attention_fwd", 128, 64, 8, 2, verdict(),
                                  implementation="all_to_all_triton")
    assert exchanged.flops == ring.flops and exchanged.seconds != ring.seconds
    with pytest.raises(ValueError, match="all_gather_pallas_tpu"):
        gpu_model.predict(PROBLEM, H100, "attention_fwd", 128, 64, 8, 2, verdict(),
                          implementation="all_gather_pallas_tpu")


def test_the_cli_knows_the_models_gpus():
    from tuner.cli import targets

    assert targets.GPU_TARGETS == tuple(gpu_model.GPUS)


def test_the_gpu_dry_run_stores_the_models_best_as_a_compiled_row_the_lookup_serves(tmp_path):
    """`tuner search --device gpu --dry-run --target h100`'s engine on a small problem, the default's
    launches and one more per kernel: each is compiled for sm_90 and judged, the stored row is the
    model's best admitted config, and a lookup for the H100's device kind returns it as `compiled`."""
    from tuner.tuning import compiled_gpu

    problem = Problem(seq_len=256, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16", ring_size=2)
    report = compiled_gpu.compile_gpu_target(problem, "h100", sample=1, workers=1)
    assert sorted({x.kernel for x in report.launches}) == sorted(triton_launch.KERNEL_ARGS)
    assert all(x.verdict for x in report.launches) and report.config is not None, report.render()
    fwd, dkv, dq = report.chosen
    assert fwd.ruled_out is None and fwd.predicted.seconds == min(
        x.predicted.seconds for x in report.launches if x.kernel == "attention_fwd" and x.predicted)
    assert (dkv.num_warps, dkv.num_stages) == (dq.num_warps, dq.num_stages)
    db = tmp_path / "tuning.sqlite"
    row = compiled_gpu.store(report, db)
    assert row["source"] == "compiled" and row["device_kind"] == "NVIDIA H100 80GB HBM3"
    implementation = registry.get("triton")
    key = registry.problem_key(problem, "triton", "NVIDIA H100 80GB HBM3")
    found = Cache(db).lookup(key, registry.versions(implementation))
    assert found.source == "compiled" and "not measured" in found.reason
    assert json.loads(found.row["fwd_params"]) == dataclasses.asdict(report.config.fwd)
    with pytest.raises(ValueError, match="--target tpu"):
        compiled_gpu.compile_gpu_target(problem, "tpu")


@pytest.mark.slow
def test_tuner_search_gpu_dry_run_prints_the_verdicts_and_stores_the_row(tmp_path, capsys):
    """The command itself, on the default's launches only (`--samples 0`), for the A100, of all_to_all over
    the Triton kernel (the engine test above takes the ring): a table per kernel, the stored row's key, and
    the model's source; the row is the lookup's for that implementation's problem."""
    from tuner.cli import main

    db = tmp_path / "tuning.sqlite"
    assert main(["search", "--device", "gpu", "--dry-run", "--target", "a100", "--backend", "all_to_all_triton",
                 "--seq-len", "1024", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "bfloat16",
                 "--ring-size", "4", "--samples", "0", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "a100 (NVIDIA A100-SXM4-80GB, sm_80, all_to_all_triton): 3 launches compiled" in out, out
    assert "stored  compiled entry" in out and "NVIDIA A100 datasheet" in out
    [row] = Cache(db).rows()
    assert (row["source"], row["device_kind"], row["backend"]) == ("compiled", "NVIDIA A100-SXM4-80GB",
                                                                   "all_to_all_triton")
    problem = Problem(seq_len=1024, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16", ring_size=4)
    implementation = registry.get("all_to_all_triton")
    found = Cache(db).lookup(registry.problem_key(problem, implementation.name, row["device_kind"]),
                             registry.versions(implementation))
    assert found.source == "compiled" and "not measured" in found.reason


@pytest.mark.parametrize("arguments, says", [
    (["--backend", "hybrid_triton"], "runs over 2 mesh axes, the problem over 1"),
    (["--backend", "all_to_all_pallas_tpu"], "one over the triton kernel (triton, "),
    (["--a2a-size", "2", "--backend", "triton"], "runs over 1 mesh axes, the problem over 2"),
])
def test_the_gpu_dry_run_names_the_backends_it_compiles(tmp_path, capsys, arguments, says):
    from tuner.cli import main

    assert main(["search", "--device", "gpu", "--dry-run", "--target", "a100", "--ring-size", "4", *arguments,
                 "--db", str(tmp_path / "tuning.sqlite")]) != 0
    assert says in capsys.readouterr().err
