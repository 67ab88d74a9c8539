"""The `tuner` command line: the demo runs, checks and times a ring; bad input exits 2 with one line."""

import subprocess
import sys

import pytest


def _tuner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_demo_checks_and_times_a_ring():
    result = _tuner("demo", "--devices", "4", "--seq-len", "256", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "16", "--runs", "2")
    assert result.returncode == 0, result.stderr
    assert "relative error vs dense float64 attention" in result.stdout
    assert "(ok)" in result.stdout
    assert "ring" in result.stdout and "dense" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("demo", "--seq-len", "100"), "must be a multiple of 2 x --devices"),
    (("demo", "--heads", "6", "--kv-heads", "4"), "must be a multiple of --kv-heads"),
    (("demo", "--devices", "0"), "--devices must be a positive integer"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = _tuner(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_info_lists_the_scan_backend():
    result = _tuner("info")
    assert result.returncode == 0, result.stderr
    assert "scan" in result.stdout and "yes" in result.stdout
