"""The package's layers, read from its imports: each subpackage of `tuner/` imports only the layers below it
(`ALLOWED`), no module imports the package root, and the modules' imports form no cycle; no module holds
more than one concern's worth of code (`LONGEST` lines). Also: the public names the README and the docs use
resolve where they always did."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tuner"

# What each layer may import, bottom to top (docs/ARCHITECTURE.md draws it). `flax` is the module
# `tuner/flax.py`, the Flax layer over the loader.
BELOW = ["support", "semantics", "kernels", "registry", "strategies", "models", "cache", "runtime", "tuning", "cli"]
ALLOWED: dict[str, set[str]] = {
    "support": set(),
    "semantics": {"support"},
    "kernels": {"support", "semantics"},
    "registry": {"support", "semantics"},
    "strategies": {"support", "semantics", "kernels", "registry"},
    "models": {"support", "semantics", "kernels", "registry", "strategies"},
    "cache": {"support", "semantics", "kernels", "registry"},
    "runtime": {"support", "semantics", "kernels", "registry", "strategies", "models", "cache"},
    "tuning": {"support", "semantics", "kernels", "registry", "strategies", "models", "cache", "runtime"},
    "cli": set(BELOW) - {"cli"},
    "flax": {"support", "semantics", "strategies", "runtime"},
}


LONGEST = 400  # lines of a module: past it, it holds more than one concern (split it as registry/ is split)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The `tuner` modules `path` imports, at any depth of its code (function-level imports count)."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tuner"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "tuner":
            for alias in node.names:  # `from tuner.x import y`: the module y when it is one, else tuner.x
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def layer(module: str) -> str:
    """The layer of a module: its subpackage under `tuner`, or "tuner" for the root package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tuner"


def graph() -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_layer_of_the_table():
    layers = {layer(m) for m in graph()} - {"tuner"}
    assert layers == set(ALLOWED), f"a subpackage the table does not place: {sorted(layers ^ set(ALLOWED))}"


def test_imports_only_go_down_the_layers():
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        for target in targets:
            other = layer(target)
            if own == "tuner" or other == own:
                continue  # the root may import every layer; a layer its own modules
            if other == "tuner" or other not in ALLOWED[own]:
                wrong.append(f"{module} imports {target} ({own} -> {other})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_modules_import_no_cycle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if target == "tuner" or target == module:
                continue
            if state.get(target) == 1:
                return [*path, module, target]
            if target not in state:
                cycle = visit(target, [*path, module])
                if cycle:
                    return cycle
        state[module] = 2
        return None

    for module in edges:
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "an import cycle: " + " -> ".join(cycle)


def test_no_module_is_longer_than_one_concern():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > LONGEST}
    assert not long, f"modules over {LONGEST} lines, to split by concern: {long}"


def test_the_table_refuses_an_upward_import(tmp_path):
    """The check above can fail: a kernel importing the runtime is one layer skipped upward."""
    source = tmp_path / "upward.py"
    source.write_text("from tuner.runtime import dispatch\nfrom tuner.semantics import spec\n")
    assert {layer(t) for t in imported(source)} == {"runtime", "semantics"}
    assert "runtime" not in ALLOWED["kernels"] and "semantics" in ALLOWED["kernels"]


@pytest.mark.parametrize("name", [
    "tuner.ring_attention", "tuner.get_tuned_ring_attention", "tuner.autotune", "tuner.FwdParams",
    "tuner.BwdParams", "tuner.__version__", "tuner.layouts.lay_out", "tuner.layouts.restore",
    "tuner.layouts.local_positions", "tuner.registry.register", "tuner.registry.get", "tuner.registry.ChoiceSpace",
    "tuner.flax.RingSelfAttention", "tuner.cli.main", "tuner.cache.Cache", "tuner.save_attention_residuals",
    "tuner.RESIDUAL_NAMES",
])
def test_the_public_names_resolve(name):
    module, _, attribute = name.rpartition(".")
    parent = importlib.import_module(module) if module != "tuner.layouts" else importlib.import_module("tuner").layouts
    assert getattr(parent, attribute) is not None
