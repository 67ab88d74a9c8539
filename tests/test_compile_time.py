"""`benchmarks/suite/compile_time.py`: the plugin times each XLA compile under the test that ran it, and the
summary ranks tests and programs by the seconds recorded."""

import json
import time
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src import compiler

import scripts

compile_time = scripts.load("benchmarks/suite/compile_time.py")


def test_each_compile_is_recorded_under_its_test_and_program(monkeypatch):
    monkeypatch.setattr(compiler, "backend_compile_and_load", compiler.backend_compile_and_load)  # undone after
    monkeypatch.setattr(compile_time, "_records", [])
    monkeypatch.setattr(compile_time, "_test", ["tests/x.py::test_a"])
    compile_time.pytest_configure(None)

    def a_program_of_its_own(x):
        return jnp.sin(x) * 3.0 + 1.0

    jax.jit(a_program_of_its_own)(jnp.arange(7.0)).block_until_ready()
    [(test, program, seconds)] = [r for r in compile_time._records if r[1] == "jit_a_program_of_its_own"]
    assert test == "tests/x.py::test_a" and seconds > 0


def test_each_test_s_start_and_end_are_recorded(monkeypatch):
    monkeypatch.setattr(compile_time, "_spans", [])
    monkeypatch.setattr(compile_time, "_test", ["(collection)"])
    protocol = compile_time.pytest_runtest_protocol(types.SimpleNamespace(nodeid="tests/x.py::test_b"), None)
    next(protocol)  # the test runs here
    time.sleep(0.01)
    with pytest.raises(StopIteration):
        next(protocol)
    [(test, start, end)] = compile_time._spans
    assert test == "tests/x.py::test_b" and end - start >= 0.01


def test_the_summary_ranks_tests_and_programs_by_seconds(tmp_path):
    (tmp_path / "compiles-gw0.json").write_text(json.dumps([["t1", "jit_f", 2.0], ["t2", "jit_add", 0.5]]))
    (tmp_path / "compiles-gw1.json").write_text(json.dumps([["t2", "jit_f", 3.0]]))
    lines = compile_time.summary(tmp_path, top=1).splitlines()
    assert lines[0] == "3 compiles, 6 s"
    assert lines[3].split() == ["3.5", "t2"] and len(lines) == 7
    assert lines[6].split() == ["5.0", "jit_f"]
    assert "workers" not in "\n".join(lines)  # no tests-*.json: nothing said of the workers

    (tmp_path / "tests-gw0.json").write_text(json.dumps([["t1", 100.0, 160.0], ["t2", 160.0, 190.0]]))
    (tmp_path / "tests-gw1.json").write_text(json.dumps([["t3", 100.0, 145.0], ["t4", 150.0, 200.0]]))
    workers = compile_time.summary(tmp_path, top=1).splitlines()[-3:]
    assert workers[0].endswith("from first start to last end 100 s")
    assert workers[1].split() == ["gw0:", "2", "tests", "ran", "90", "s", "(90%)"], workers
    assert workers[2].split() == ["gw1:", "2", "tests", "ran", "95", "s", "(95%)"], workers
    with pytest.raises(SystemExit, match="no compiles"):
        compile_time.summary(tmp_path / "empty", top=3)
