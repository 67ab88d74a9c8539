"""Where the test suite's time goes to XLA compiles: a pytest plugin that times every compile per test,
and a summary of what it wrote.

    PYTHONPATH=benchmarks/suite COMPILE_TIME_DIR=/tmp/compiles python -m pytest -q -p compile_time
    python benchmarks/suite/compile_time.py /tmp/compiles          # the tests and programs that compile longest

Each pytest process (every xdist worker) writes `<COMPILE_TIME_DIR>/compiles-<worker>.json`: one record a
compile, with the test, the program's name (`jit_<function>`; a primitive's name, such as `jit_add`, is an
operation run outside `jax.jit`, compiled on its own) and the seconds; and `<COMPILE_TIME_DIR>/tests-<worker>.json`:
when each test started and ended, from which the summary says how much of its time each worker spent in
tests (the rest: starting, collecting, waiting for the last files). Compiles in subprocesses that a test
starts are not seen. It wraps `jax._src.compiler.backend_compile_and_load`, a private function of
jax 0.10: on another jax it may be missing, and the plugin then says so and records nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

_records: list[tuple[str, str, float]] = []
_test = ["(collection)"]
_spans: list[tuple[str, float, float]] = []  # (test, start, end), wall-clock seconds


def _program_name(module) -> str:
    try:
        return str(module.operation.attributes["sym_name"]).strip('"')
    except (AttributeError, KeyError):
        return "?"


def pytest_configure(config: pytest.Config) -> None:
    try:
        from jax._src import compiler
        original = compiler.backend_compile_and_load
    except (ImportError, AttributeError) as error:
        print(f"compile_time: cannot time compiles on this jax ({error}); nothing is recorded", file=sys.stderr)
        return

    def timed(backend, module, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(backend, module, *args, **kwargs)
        finally:
            _records.append((_test[0], _program_name(module), time.perf_counter() - start))

    compiler.backend_compile_and_load = timed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _test[0] = item.nodeid
    start = time.time()
    yield
    _spans.append((item.nodeid, start, time.time()))


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("COMPILE_TIME_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(folder) / f"compiles-{worker}.json").write_text(json.dumps(_records))
        (Path(folder) / f"tests-{worker}.json").write_text(json.dumps(_spans))


def summary(folder: Path, top: int) -> str:
    """The compile seconds of the `top` tests and programs that spent most, from the files in `folder`."""
    records = [r for path in sorted(folder.glob("compiles-*.json")) for r in json.loads(path.read_text())]
    if not records:
        raise SystemExit(f"{folder}: no compiles-*.json (run pytest with -p compile_time and COMPILE_TIME_DIR)")
    by_test, by_program = collections.Counter(), collections.Counter()
    for test, program, seconds in records:
        by_test[test] += seconds
        by_program[program] += seconds
    lines = [f"{len(records)} compiles, {sum(by_test.values()):.0f} s", "", "seconds  test"]
    lines += [f"{s:7.1f}  {t}" for t, s in by_test.most_common(top)]
    lines += ["", "seconds  program"]
    lines += [f"{s:7.1f}  {p}" for p, s in by_program.most_common(top)]
    return "\n".join(lines + _workers(folder))


def _workers(folder: Path) -> list[str]:
    """A line per worker: the seconds its tests ran, against the run's span from the first test's start to
    the last one's end (what is left is the worker's start, its collection and its wait at the end)."""
    spans = {path.stem.removeprefix("tests-"): json.loads(path.read_text())
             for path in sorted(folder.glob("tests-*.json"))}
    spans = {worker: tests for worker, tests in spans.items() if tests}
    if not spans:
        return []
    first = min(start for tests in spans.values() for _, start, _ in tests)
    last = max(end for tests in spans.values() for _, _, end in tests)
    lines = ["", f"workers: the run's tests from first start to last end {last - first:.0f} s"]
    for worker, tests in spans.items():
        ran = sum(end - start for _, start, end in tests)
        lines.append(f"  {worker}: {len(tests)} tests ran {ran:.0f} s ({ran / (last - first):.0%})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the COMPILE_TIME_DIR of a run")
    parser.add_argument("--top", type=int, default=25, help="how many tests and programs to list")
    args = parser.parse_args(argv)
    if args.top <= 0:
        parser.error(f"--top must be positive, got {args.top}")
    print(summary(args.folder, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
