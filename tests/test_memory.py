"""`tuner memory`: one device's memory for a problem, from the compilers (XLA:CPU here, the TPU compiler
through libtpu), beside the ring's analytic floor, and the longest sequence a chip's memory holds."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import jax
import pytest

from tuner.semantics.problem import Problem
from tuner.tuning import compiled, memory

PROBLEM = Problem(batch=1, seq_len=4096, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16", causal=True,
                  ring_size=4, layout="zigzag")
MIB = 2**20


def test_the_floor_counts_what_the_ring_holds():
    shapes = PROBLEM.shapes  # a shard of 1024 tokens
    forward = memory.floor(shapes, "fwd")
    assert forward == {"float32 output accumulator": 4 * 1024 * 8 * 64, "lse": 4 * 8 * 1024,
                       "key and value shard arriving": 1024 * 2 * 128 * 2 + 4 * 1024}
    both = memory.floor(shapes, "fwd+bwd")
    assert both["float32 dq accumulator"] == 4 * 1024 * 8 * 64 and both["saved output"] == 1024 * 8 * 64 * 2
    assert sum(both.values()) > sum(forward.values())


def test_the_bytes_a_token_hold_at_twice_the_length_and_the_longest_sequence_fits():
    devices = jax.devices()[:4]
    reports = {t: memory.compiled_memory(replace(PROBLEM, seq_len=t), devices, "cpu", "fwd+bwd")
               for t in (4096, 8192)}
    short, long = reports[4096], reports[8192]
    assert short.implementation == "scan" and short.temp > short.floor_bytes > 0
    assert long.per_token == pytest.approx(short.per_token, rel=0.05), "memory must grow with the shard"
    budget, headroom = 64 * MIB, 0.25
    longest = short.longest(budget, headroom)
    assert longest % (4 * memory.TOKEN_MULTIPLE) == 0 and longest > 8192
    at_longest = memory.compiled_memory(replace(PROBLEM, seq_len=longest), devices, "cpu", "fwd+bwd")
    held = at_longest.temp + at_longest.arguments + at_longest.outputs
    assert held <= budget * (1 - headroom) * 1.02, f"{held / MIB:.1f} MiB over the {budget * 0.75 / MIB:.0f} MiB"
    assert held >= budget * (1 - headroom) * 0.9, "the longest sequence should nearly fill the budget"


@pytest.mark.skipif(compiled.libtpu_missing() is not None, reason=str(compiled.libtpu_missing()))
def test_the_tpu_compiler_s_count_for_the_pallas_ring():
    devices = list(compiled.topology_mesh("v5e:2x2").devices.flat)
    problem = replace(PROBLEM, seq_len=32768)
    forward = memory.compiled_memory(problem, devices, "v5e:2x2", "fwd")
    assert forward.implementation == "pallas_tpu"
    assert forward.temp >= forward.floor_bytes  # the floor is a floor
    assert forward.arguments == (32768 // 4) * (8 + 2 + 2) * 64 * 2  # the q, k, v shards in bfloat16


def test_the_verb_prints_the_table_and_names_a_bad_flag(tmp_path):
    env = {**os.environ, "TUNER_HOME": str(tmp_path)}
    env.pop("XLA_FLAGS", None)
    args = ["--device", "cpu", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
            "--ring-size", "2", "--causal", "--objective", "fwd"]
    run = subprocess.run([sys.executable, "-m", "tuner.cli", "memory", *args], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    for words in ("temp/floor", "bytes a token", "floor (fwd): float32 output accumulator", "v5e   16 GiB",
                  "tokens on the ring"):
        assert words in run.stdout, run.stdout
    bad = subprocess.run([sys.executable, "-m", "tuner.cli", "memory", *args, "--headroom", "1.5"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode != 0 and "--headroom must be a fraction" in bad.stderr
