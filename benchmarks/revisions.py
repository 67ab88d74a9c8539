"""Another commit of this repository beside this tree, for the benchmarks that compare them
(`cpu_ring/ring_against.py`, `memory/ring_memory.py`): each side runs in a process of its own that
imports its own `tuner`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
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
