"""Another commit of this repository beside this tree, for the benchmarks that compare them
(`cpu_ring/ring_against.py`, `memory/ring_memory.py`, `memory/strategy_memory.py`): each side runs in a
process of its own that imports its own `tuner`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TREE = "RING_TUNER_BENCH_TREE"


@contextlib.contextmanager
def checkout(revision: str) -> Iterator[str]:
    """A `git worktree` of `revision` in a temporary folder, removed afterwards; yields its path."""
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "checkout")
    subprocess.run(["git", "worktree", "add", "--detach", path, revision], cwd=ROOT, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def environment(tree: str) -> dict[str, str]:
    """The environment of a worker process that imports `tree`'s `tuner` (`check_tree` checks it did)."""
    return {**os.environ, "PYTHONPATH": tree, _TREE: tree}


def check_tree() -> None:
    """In a worker started with `environment(tree)`: exit unless `tuner` came from `tree`."""
    import tuner

    tree = os.environ[_TREE]
    if not os.path.abspath(tuner.__file__).startswith(tree + os.sep):
        raise SystemExit(f"the worker for {tree} imported tuner from {tuner.__file__}")


def worker_rows(script: str, tree: str, argv: list[str]) -> list[dict]:
    """The JSON lines that `script` run with `argv` and `--worker` prints, importing `tree`'s `tuner`;
    exits with the worker's error where it fails."""
    run = subprocess.run([sys.executable, script, *argv, "--worker"], env=environment(tree), cwd=tree,
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"the worker for {tree} failed:\n{run.stderr[-3000:]}")
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def this_and_against(script: str, argv: list[str], against: str | None) -> tuple[list[dict], list[dict]]:
    """`worker_rows` of this tree, and of the commit `against` in a worktree (none without one)."""
    this = worker_rows(script, ROOT, argv)
    if against is None:
        return this, []
    with checkout(against) as other:
        return this, worker_rows(script, other, argv)


def write_results(path: str | None, args, rows: list[dict]) -> None:
    """`rows` and the command's arguments, but the workers' own, as JSON at `path` where one is given."""
    if path:
        with open(path, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker", "hlo_dir")}, "rows": rows},
                      f, indent=1)
