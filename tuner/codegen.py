"""Code generation (DESIGN section 5): Jinja templates of whole kernel modules, rendered per variant.

A `Variant` is a backend's template plus a feature set (what is compiled in or out, the dtype, the head
dim). Rendering writes `<backend>_<template stem>_<hash>.py` into the generated-kernel folder -- the
repository's `kernels_generated/` in a source checkout, else `$TUNER_HOME/kernels_generated` -- where
the hash covers the template text and the features: the same variant reuses its file, an edited
template gives a new one. Each module starts with a header naming its template, hashes and features.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

from tuner.cache import tuner_home
from tuner.problem import Problem

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
_LOCK = threading.Lock()

# The feature sets every kernel backend renders as its standard variants (`tuner generate`): full,
# causal, and causal with each other feature in turn.
STANDARD_FEATURES: list[dict[str, bool]] = [
    dict(causal=causal, window=window, chunk=chunk, segments=segments, softcap=softcap)
    for causal, window, chunk, segments, softcap in (
        (False, False, False, False, False), (True, False, False, False, False),
        (True, False, False, True, False), (True, True, False, False, False),
        (True, False, True, False, False), (True, False, False, False, True),
    )
]
_MODULES: dict[Path, ModuleType] = {}


def template_path(backend: str, template: str) -> Path:
    return TEMPLATES / backend / template


def template_hash(backend: str, template: str) -> str:
    """First 12 hex digits of the sha256 of the template text."""
    return hashlib.sha256(template_path(backend, template).read_bytes()).hexdigest()[:12]


@dataclass(frozen=True)
class Variant:
    """One rendered module: `templates/<backend>/<template>` with these features."""

    backend: str
    template: str
    features: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.backend, self.template, json.dumps(self.features, sort_keys=True)))

    @property
    def digest(self) -> str:
        text = template_path(self.backend, self.template).read_bytes() + json.dumps(
            self.features, sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:12]

    @property
    def filename(self) -> str:
        stem = self.template.split(".")[0]
        return f"{self.backend}_{stem}_{self.digest}.py"


def standard_problem(source: Variant, local_len: int = 4096, heads: int = 16, kv_heads: int = 4) -> Problem:
    """A one-device problem with a rendered variant's features, at representative values (a 256-token
    window, 1024-token chunks, two segments, a cap of 30): what compile and lowering reports run."""
    f = source.features
    return Problem(batch=1, seq_len=local_len, heads=heads, kv_heads=kv_heads, head_dim=f["head_dim"],
                   dtype=f["dtype"], causal=f["causal"], window=(256, 0) if f["window"] else None,
                   chunk_size=1024 if f["chunk"] else None, segments=2 if f["segments"] else 0,
                   softcap=30.0 if f["softcap"] else None, ring_size=1)


def generated_dir() -> Path:
    """`kernels_generated/` of a source checkout, else `$TUNER_HOME/kernels_generated`."""
    checkout = Path(__file__).resolve().parents[1] / "kernels_generated"
    if checkout.is_dir() and os.access(checkout, os.W_OK):
        return checkout
    return tuner_home() / "kernels_generated"


def render_source(variant: Variant) -> str:
    """The text of the variant's module (the template rendered with its features)."""
    path = template_path(variant.backend, variant.template)
    if not path.is_file():
        raise FileNotFoundError(f"no template {path}")
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(path.parent), undefined=jinja2.StrictUndefined,
                                     keep_trailing_newline=True)
    features = dict(sorted(variant.features.items()))
    return environment.get_template(path.name).render(
        **features, features_json=json.dumps(features, sort_keys=True), features_repr=repr(features),
        template_hash=template_hash(variant.backend, variant.template), variant_hash=variant.digest)


def render(variant: Variant, out_dir: Path | None = None) -> Path:
    """Write the variant's module (once: an existing file of the same hash is reused); returns its path."""
    folder = Path(out_dir) if out_dir is not None else generated_dir()
    path = folder / variant.filename
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_text(render_source(variant), encoding="utf-8")
    os.replace(partial, path)  # atomic: concurrent renderers never see half a file
    return path


def load(variant: Variant) -> ModuleType:
    """Import the rendered module (once per process)."""
    path = render(variant)
    with _LOCK:
        if path not in _MODULES:
            name = f"tuner_generated.{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            _MODULES[path] = module
        return _MODULES[path]
