"""The repository's benchmark scripts imported as modules, for the tests that run their functions."""

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def load(path: str) -> ModuleType:
    """The script at `path` (from the repository's root, e.g. "benchmarks/gpu/auto_pick.py"), imported once a
    process under its file's stem, and kept in `sys.modules` under that name: dataclasses look their module up
    there."""
    file = ROOT / path
    if not file.is_file():
        raise FileNotFoundError(f"path {path!r}: no such script under {ROOT}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module
