"""`tuner info`: what this installation has and can run -- the devices jax sees, the versions a cache row
is matched against, the registered implementations (whether each runs here or in its interpreter, and
why not), and the caches: the local file's entries by status and the shipped entries.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import jax

from tuner.support.version import __version__
from tuner import registry
from tuner.cache import Cache, CacheError, current_versions, read_shipped
from tuner.cache.views import counts
from tuner.support.resources import shipped_dir
from tuner.support.tables import table


def implementations_table(width: int | None = None) -> str:
    """A row per registered implementation: available here (or a note saying why not), in the interpreter,
    its code hash (part of the versions its cache rows are matched against) and what it is, wrapped to
    `width` columns. The reasons follow the table, one line each, as many rows share one."""
    here, interpreter = registry.Target.here(), registry.Target.here(interpret=True)
    reasons: dict[str, int] = {}
    rows = []
    for name in registry.names():
        impl = registry.get(name)
        why = impl.available(here)
        here_cell = "yes" if why is None else f"no [{reasons.setdefault(why, len(reasons) + 1)}]"
        rows.append([name, here_cell, "yes" if impl.available(interpreter) is None else "no", impl.code_hash(),
                     impl.summary])
    notes = [f"[{n}] {why}" for why, n in reasons.items()]
    return "\n".join([table(["backend", "here", "interpreter", "code hash", "what"], rows, width), *notes])


def info(cache: Cache) -> Iterator[str]:
    """The lines `tuner info` prints, one at a time as each is known, with `cache` as the local cache (an
    unusable one is reported, not raised)."""
    devices = jax.devices()
    yield (f"ring-tuner {__version__}, platform {jax.default_backend()}, {len(devices)} device(s): "
           f"{devices[0].device_kind}")
    versions = current_versions("-", triton=True)
    yield "versions: " + ", ".join(f"{k.removesuffix('_version')} {v}" for k, v in versions.items()
                                   if k != "code_hash")
    yield implementations_table(shutil.get_terminal_size((100, 24)).columns)
    try:
        tuned, stale, invalid, sources = counts(cache)
        kinds = {"bench": "bench times", "compiled": "compiled for a TPU target, not measured"}
        others = "".join(f", {n} of them {kinds.get(source, source)}" for source, n in sorted(sources.items()))
        line = f"cache: {cache.path} ({tuned} tuned, {stale} stale, {invalid} invalid{others})"
    except CacheError as error:
        line = f"cache: unusable: {error}"
    yield line
    shipped = list(read_shipped())
    yield f"shipped: {shipped_dir()} ({len(shipped)} tuned)"
