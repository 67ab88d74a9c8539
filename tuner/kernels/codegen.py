"""Code generation (DESIGN section 5): Jinja templates of whole kernel modules, rendered per variant.

A `Variant` is a backend's template plus a feature set (what is compiled in or out, the dtype, the head
dim). Rendering writes `<backend>_<template stem>_<hash>.py` into the generated-kernel folder -- the
repository's `kernels_generated/` in a source checkout, else `$TUNER_HOME/kernels_generated` -- where
the hash covers the template text and the features: an edited template gives a new file. Each module
starts with a header naming its template, hashes and features.

Only what this module renders ever runs: `render` rewrites a file whose bytes differ from the
rendering, and `load` executes the rendered text itself (never the file, which could change after the
check), registering it in `linecache` so that `inspect.getsource` -- which `@triton.jit` reads --
sees the same text. The Triton interpreter process checks its files the same way
(`backends/triton_worker.py`, given `sha256` of the rendering).
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

from tuner.semantics.spec import AttentionSpec, LocalShapes
from tuner.support.resources import generated_dir, templates_dir

# The templates' folder; tests point it at a copy to edit templates.
TEMPLATES: Path = templates_dir()
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
# Executed modules by (file, sha256 of the text run), and rendered texts by (template, variant digest).
_MODULES: dict[tuple[Path, str], ModuleType] = {}
_SOURCES: dict[tuple[Path, str], str] = {}


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


def standard_shapes(source: Variant, local_len: int = 4096, heads: int = 16, kv_heads: int = 4
                    ) -> tuple[LocalShapes, AttentionSpec]:
    """One device's shapes and a spec with a rendered variant's features, at representative values (a
    256-token window, 1024-token chunks, segments, a cap of 30): what compile and lowering reports run."""
    f = source.features
    shapes = LocalShapes(1, local_len, local_len, heads, kv_heads, f["head_dim"], f["dtype"])
    spec = AttentionSpec(scale=f["head_dim"] ** -0.5, causal=f["causal"], window=(256, 0) if f["window"] else None,
                         chunk_size=1024 if f["chunk"] else None, softcap=30.0 if f["softcap"] else None,
                         has_segments=bool(f["segments"]))
    return shapes, spec


def sha256(data: str | bytes) -> str:
    """Hex sha256 of a module's bytes (text is taken as UTF-8, the encoding files are written in)."""
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def render_source(variant: Variant) -> str:
    """The text of the variant's module (the template rendered with its features; kept in memory per
    template text and features, so repeated loads do not re-render)."""
    path = template_path(variant.backend, variant.template)
    if not path.is_file():
        raise FileNotFoundError(f"no template {path}")
    key = (path, variant.digest)
    if key not in _SOURCES:
        environment = jinja2.Environment(loader=jinja2.FileSystemLoader(path.parent),
                                         undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        features = dict(sorted(variant.features.items()))
        _SOURCES[key] = environment.get_template(path.name).render(
            **features, features_json=json.dumps(features, sort_keys=True), features_repr=repr(features),
            template_hash=template_hash(variant.backend, variant.template), variant_hash=variant.digest)
    return _SOURCES[key]


def render(variant: Variant, out_dir: Path | None = None) -> Path:
    """Write the variant's module unless the file already holds exactly its rendering (a file whose
    bytes differ -- edited, truncated or planted -- is replaced); returns its path."""
    folder = Path(out_dir) if out_dir is not None else generated_dir()
    path = folder / variant.filename
    data = render_source(variant).encode("utf-8")
    try:
        if sha256(path.read_bytes()) == sha256(data):
            return path
    except FileNotFoundError:
        folder.mkdir(parents=True, exist_ok=True)
    # A fresh name, created exclusively (never through a link left in its place), then renamed over the
    # module: atomic, so concurrent renderers never see half a file.
    partial = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as file:
            file.write(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _execute(name: str, path: Path, text: str) -> ModuleType:
    """Run `text` as module `name` (in `sys.modules`) attributed to the file `path`: compiled from the
    text, not from the file, and registered in `linecache` with no mtime, so that `inspect` returns this
    text for its functions and `linecache.checkcache` never swaps in the file's current bytes."""
    filename = str(path)
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(compile(text, filename, "exec"), module.__dict__)  # noqa: S102 - the text codegen rendered
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load(variant: Variant) -> ModuleType:
    """The variant's module, executed (once per process) from the text rendered here; its file in the
    generated-kernel folder is (re)written to match, for tracebacks and reading."""
    text = render_source(variant)
    path = render(variant).absolute()
    key = (path, sha256(text))
    with _LOCK:
        if key not in _MODULES:
            _MODULES[key] = _execute(f"tuner_generated.{path.stem}", path, text)
        return _MODULES[key]
