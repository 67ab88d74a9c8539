"""`tuner memory`: one device's memory for a problem, from the compilers (XLA:CPU here, the TPU compiler
through libtpu), beside the ring's analytic floor, and the longest sequence a chip's memory holds."""

from __future__ import annotations

import os
from dataclasses import replace

import jax
import pytest

from tuner.semantics.problem import Problem
from tuner.tuning import compiled, memory
from tuner.tuning.decision import loader_plan

PROBLEM = Problem(batch=1, seq_len=4096, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16", causal=True,
                  ring_size=4, layout="zigzag")
MIB = 2**20


def test_the_floor_counts_what_the_ring_holds():
    shapes = PROBLEM.shapes  # a shard of 1024 tokens, bfloat16
    shard = 1024 * 2 * 128 * 2 + 4 * 1024  # k and v, and the positions
    forward = memory.floor(shapes, "fwd", 4)
    assert forward == {"float32 output accumulator": 4 * 1024 * 8 * 64, "lse": 4 * 8 * 1024,
                       "key and value shards at hand and arriving": 2 * shard}
    assert memory.floor(shapes, "fwd", 2)["key and value shards at hand and arriving"] == shard
    assert "key and value shards at hand and arriving" not in memory.floor(shapes, "fwd", 1)
    both = memory.floor(shapes, "fwd+bwd", 4)
    assert both["float32 dq accumulator"] == 4 * 1024 * 8 * 64
    assert sum(both.values()) > sum(forward.values())
    wide = replace(PROBLEM, dtype="float32").shapes  # the accumulators can be the program's outputs
    assert "float32 output accumulator" not in memory.floor(wide, "fwd", 4)
    assert "float32 dq accumulator" not in memory.floor(wide, "fwd+bwd", 4)


def cpu_held(problem: Problem, objective: str) -> int:
    """What one of 4 CPU devices holds for the loader's plan of `problem` (temporaries, arguments and outputs,
    `Report.held` on the CPU), from one compile: `compiled_memory` compiles a second length for what a token
    more costs."""
    _, analysis = memory.analysis(problem, jax.devices()[:4], objective)
    return memory._held_of(analysis, "cpu")


def test_memory_is_affine_in_the_shard_and_the_longest_sequence_fits():
    devices = jax.devices()[:4]
    short = memory.compiled_memory(PROBLEM, devices, "cpu", "fwd+bwd")
    assert short.implementation == "scan" and short.temp > short.floor_bytes > 0
    assert short.peak is None and short.held == short.temp + short.arguments + short.outputs  # the CPU counts no peak
    tripled = cpu_held(replace(PROBLEM, seq_len=3 * PROBLEM.seq_len), "fwd+bwd")
    predicted = short.held + short.growth * 2 * PROBLEM.local_len
    assert tripled == pytest.approx(predicted, rel=0.02), "what a device holds must be affine in its shard"
    budget, headroom = 64 * MIB, 0.25
    longest = short.longest(budget, headroom)
    assert short.multiple == memory.tile_multiple(loader_plan(PROBLEM, "auto", None).config)
    assert longest % (4 * short.multiple) == 0 and longest > 8192
    held = cpu_held(replace(PROBLEM, seq_len=longest), "fwd+bwd")
    assert held <= budget * (1 - headroom) * 1.02, f"{held / MIB:.1f} MiB over the {budget * 0.75 / MIB:.0f} MiB"
    assert held >= budget * (1 - headroom) * 0.95, "the longest sequence should fill the budget"


def test_the_longest_shard_is_a_length_the_tiles_divide():
    """A shard the tiles do not divide costs whole tiles: the scan kernel pads it to them, and the Pallas
    kernels' last tile, running past its end, does a whole tile's work. So the longest sequence is
    rounded down to a length the plan's tiles divide: the least common multiple of its tiles and 128."""
    from tuner.kernels.params import BwdParams, FwdParams
    from tuner.strategies.configs import TileConfig

    config = TileConfig(FwdParams(block_q=1024, block_kv=512), BwdParams(block_q_dkv=256, block_kv_dkv=1024,
                                                                         block_q_dq=384, block_kv_dq=64))
    assert memory.tile_multiple(config) == 3072  # 1024 and 384's least common multiple
    assert memory.tile_multiple(TileConfig(FwdParams(block_q=32, block_kv=64), BwdParams())) == 128


def test_the_scan_ring_holds_no_output_sized_array_beyond_its_state():
    """The scan kernel merges each block into the running output in place and tiles by reshaping, so the
    forward holds the floor and the bytes XLA:CPU adds for 16-bit arrays (a uint16 view of each tiled
    input, `scan_tiling.Stored`; float32 transfers); before, it held 3 to 4 times the floor. The backward
    keeps dq in the kernel's tiles and adds dk, dv heads-major, as the keys travel: no copy of q, dq or
    the output's cotangent a step (1.14x and 1.23x the floor at 131072 tokens before, 1.01x and 1.09x
    since). One compile each: the temporaries over the floor (`Report.ratio`) need no second length."""
    devices = jax.devices()[:4]
    problem = replace(PROBLEM, seq_len=32768, kv_heads=8)
    for dtype, bounds in (("float32", {"fwd": 1.3, "fwd+bwd": 1.1}), ("bfloat16", {"fwd": 1.4, "fwd+bwd": 1.2})):
        for objective, bound in bounds.items():
            typed = replace(problem, dtype=dtype)
            _, analysis = memory.analysis(typed, devices, objective, "scan")
            floor = sum(memory.floor(typed.shapes, objective, typed.ring_positions).values())
            temp = analysis.temp_size_in_bytes
            assert temp / floor <= bound, (dtype, objective, temp / MIB, floor / MIB)


def test_the_report_compiles_what_the_loader_runs_from_the_cache(tmp_path):
    """With a tuned entry in the cache, the report compiles its tiles (the loader's plan), and says so."""
    import dataclasses

    from tuner import registry
    from tuner.cache import Cache, make_row
    from tuner.support.version import __version__

    db = str(tmp_path / "t.sqlite")
    devices = jax.devices()[:4]
    default = memory.compiled_memory(PROBLEM, devices, "cpu", "fwd", "scan", db)
    assert default.source == "default" and "block_q=128" in default.config
    plan = loader_plan(PROBLEM, "scan", db)
    tuned = dataclasses.replace(plan.config, fwd=dataclasses.replace(plan.config.fwd, block_q=512, block_kv=512))
    Cache(db).put(make_row(plan.key, tuned, versions=registry.versions(registry.get("scan")), tool_version=__version__,
                           objective="fwd", best_s=1.0, default_s=2.0, speedup=2.0, trials_run=1, trials_pruned=0,
                           study="test"))
    report = memory.compiled_memory(PROBLEM, devices, "cpu", "fwd", "scan", db)
    assert report.source != "default" and "block_q=512 block_kv=512" in report.config, (report.source, report.config)
    assert report.temp > default.temp  # larger tiles: larger tile temporaries, from the compiler


@pytest.mark.skipif(compiled.libtpu_missing() is not None, reason=str(compiled.libtpu_missing()))
def test_the_tpu_compiler_s_count_for_the_pallas_ring():
    devices = list(compiled.topology_mesh("v5e:2x2").devices.flat)
    problem = replace(PROBLEM, seq_len=32768)
    forward = memory.compiled_memory(problem, devices, "v5e:2x2", "fwd")
    assert forward.implementation == "pallas_tpu"
    assert forward.temp >= forward.floor_bytes  # the floor is a floor
    assert forward.arguments == (32768 // 4) * (8 + 2 + 2) * 64 * 2  # the q, k, v shards in bfloat16
    # a device holds the compiler's peak (HBM), arguments and outputs included, which is less than its
    # temporaries, arguments and outputs together: it counts temporaries that its HBM assignment does not hold
    assert forward.held == forward.peak
    assert forward.arguments + forward.outputs < forward.held < forward.temp + forward.arguments + forward.outputs
    # laid out by the compiler, as inside a model, q needs no copy into the kernels' heads-major layout (the
    # arguments may grow: a head dim of 64 pads to the TPU's 128 lanes there)
    in_a_model = memory.compiled_memory(problem, devices, "v5e:2x2", "fwd", argument_layouts="compiler")
    assert in_a_model.temp < forward.temp and in_a_model.held < forward.held, (in_a_model, forward)
    assert "as inside a model" in memory.render([in_a_model], 0.2)


@pytest.mark.skipif(compiled.libtpu_missing() is not None, reason=str(compiled.libtpu_missing()))
def test_near_the_limit_a_token_more_is_measured_at_half_the_length_and_past_it_the_verb_says_so(capsys):
    """On v5e the Pallas forward at 4M tokens (1M a chip, H=8/2, D=128) compiles, its tile schedules run
    in calls that SMEM holds (one call overflowed it); at 8M it needs more HBM than the chip has. So what a
    token more costs at 4M is measured at 2M: at least what the arguments and the output add a token, at
    most a little more than that and the floor together (the compiler's peak can hold some temporaries in
    the output's buffer: 11,816 bytes a token with jax 0.10.2's libtpu, 9,816 with 0.0.48 and 0.0.50,
    against 5,120 and 11,304). `tuner memory` at 8M says the problem does not fit, what the compiler said,
    and what to try, in one line (exit 1), not a traceback."""
    devices = list(compiled.topology_mesh("v5e:2x2").devices.flat)
    problem = replace(PROBLEM, seq_len=2**22, head_dim=128)
    near = memory.compiled_memory(problem, devices, "v5e:2x2", "fwd", "pallas_tpu")
    io = (near.arguments + near.outputs) / problem.local_len
    floor_and_io = io + sum(memory.floor(problem.shapes, "fwd", 4).values()) / problem.local_len
    assert io <= near.growth <= 1.2 * floor_and_io, (near.growth, io, floor_and_io)

    from tuner.cli import main
    args = ["memory", "--device", "tpu", "--target", "v5e:2x2", "--seq-len", str(2**23), "--heads", "8",
            "--kv-heads", "2", "--head-dim", "128", "--dtype", "bfloat16", "--causal", "--layout", "zigzag",
            "--objective", "fwd", "--backend", "pallas_tpu"]
    assert main(args) == 1
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "T=8388608" in said and "does not fit one device" in said, said
    assert "the compiler says" in said and said.endswith("try a shorter --seq-len or a larger --ring-size"), said


@pytest.mark.skipif(compiled.libtpu_missing() is not None, reason=str(compiled.libtpu_missing()))
def test_a_shard_the_tiles_do_not_divide_holds_no_more_than_a_longer_one():
    """The Pallas ring pads nothing to whole tiles (the last tile runs past the shard's end), so a shard
    of 7.75 tiles of 1024 holds less than a shard of 8 (at 31,744 and 32,768 tokens on a ring of 4,
    H=8/2, D=128: peak 139.5 against 144.0 MiB, temporaries 103.3 against 106.5). Padded once a ring, it
    held more (159.2 against 144.0, and 106.6 against 106.5): XLA lays the kernels' heads-major copies of
    q, the output's cotangent, k and v in the buffers of the program's outputs of the same size, and
    padded copies did not fit them. Padded in every step and kernel: 1,296 against 663."""
    devices = list(compiled.topology_mesh("v5e:2x2").devices.flat)
    problem = replace(PROBLEM, seq_len=32768, head_dim=128)
    _, whole = memory.analysis(problem, devices, "fwd+bwd", "pallas_tpu")
    plan, cut = memory.analysis(replace(problem, seq_len=31744), devices, "fwd+bwd", "pallas_tpu")
    assert plan.config.fwd.block_q == 1024 and 31744 // 4 % 1024  # the tiles do not divide the shard
    held = [x.peak_memory_in_bytes / MIB for x in (cut, whole)]
    temp = [x.temp_size_in_bytes / MIB for x in (cut, whole)]
    assert held[0] <= held[1] and temp[0] <= temp[1], (held, temp)


def test_values_of_their_own_head_dim_compile_forward_and_backward():
    """Multi-head latent attention's dims (queries and keys 64 wide, values and the output 32): the
    output's cotangent the report compiles against is the output's shape (it was the queries')."""
    problem = replace(PROBLEM, head_dim=64, value_head_dim=32)
    _, analysis = memory.analysis(problem, jax.devices()[:4], "fwd+bwd")
    rows = (problem.heads + problem.kv_heads) * (64 + 32)  # q and the cotangent; k and v
    assert analysis.argument_size_in_bytes == 2 * problem.local_len * rows  # bfloat16


def test_the_verb_prints_the_table_and_names_a_bad_flag(tmp_path, monkeypatch, capsys):
    """`tuner memory` run as the script runs it (`tuner.cli.main`), in this process: its 2-device ring on the
    first 2 of the suite's 8 CPU devices."""
    from tuner.cli import main

    monkeypatch.setenv("TUNER_HOME", str(tmp_path))
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the verb sets them for a jax it would start: restored after
        monkeypatch.setenv(name, os.environ[name])
    args = ["memory", "--device", "cpu", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
            "--ring-size", "2", "--causal", "--objective", "fwd", "--dtype", "bfloat16"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    for words in ("temp/floor", "bytes a token more", "held: temp, arguments and outputs",
                  "floor (fwd): float32 output accumulator", "v5e   16 GiB", "tokens on the ring"):
        assert words in out, (out, err)
    assert main([*args, "--headroom", "1.5"]) != 0
    assert "--headroom must be a fraction" in capsys.readouterr().err
