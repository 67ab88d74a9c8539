"""`tuner info`: what this installation has and can run -- the devices jax sees, the versions a cache row
is matched against, the registered implementations (whether each runs here or in its interpreter, and
why not), and the caches: the local file's entries by status and the shipped entries.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax

from tuner.support.version import __version__
from tuner import registry
from tuner.cache import Cache, CacheError, current_versions, read_shipped
from tuner.cache.views import counts
from tuner.support.resources import shipped_dir
from tuner.support.tables import table


def implementations_table() -> str:
    """A row per registered implementation: available here (or why not), in the interpreter, its code
    hash (part of the versions its cache rows are matched against) and what it is."""
    here, interpreter = registry.Target.here(), registry.Target.here(interpret=True)
    rows = [[name, "yes" if impl.available(here) is None else "no", impl.code_hash(), impl.available(here) or "",
             "yes" if impl.available(interpreter) is None else "no", impl.summary]
            for name, impl in ((n, registry.get(n)) for n in registry.names())]
    return table(["backend", "available", "code hash", "why not", "interpreter", "what"], rows)


def info(cache: Cache) -> Iterator[str]:
    """The lines `tuner info` prints, one at a time as each is known, with `cache` as the local cache (an
    unusable one is reported, not raised)."""
    devices = jax.devices()
    yield (f"ring-tuner {__version__}, platform {jax.default_backend()}, {len(devices)} device(s): "
           f"{devices[0].device_kind}")
    versions = current_versions("-", triton=True)
    yield "versions: " + ", ".join(f"{k.removesuffix('_version')} {v}" for k, v in versions.items()
                                   if k != "code_hash")
    yield implementations_table()
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
