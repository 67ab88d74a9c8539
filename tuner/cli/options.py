"""From parsed options to what the API takes, checked before any work: the problem, the calls per timed
run, the simulated CPU devices, the cache, and the paths and storage a verb will write to. Every check
fails with a `UsageError` (one line naming the flag, exit status 2), before a trial runs or a file is
written.
"""

from __future__ import annotations

import argparse
import os
import sys

from tuner.cache import Cache, CacheError
from tuner.semantics.problem import Problem


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


def fail(message: str, status: int = 2) -> int:
    """Print `message` as the command's one error line; returns the exit status."""
    print(f"tuner: error: {message}", file=sys.stderr)
    return status


def simulate_cpu_devices(count: int) -> None:
    """Before jax starts a backend: make the CPU client expose `count` devices, and start no other (jax read
    `JAX_PLATFORMS` when it was imported, so its config is set too: a TPU runtime installed beside it would
    otherwise start, and warn, on a machine without a TPU)."""
    import jax

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def prepare_device(args: argparse.Namespace) -> None:
    """On the CPU, simulate the ring's devices (the default ring size when none is given)."""
    if args.device == "cpu":
        simulate_cpu_devices(args.ring_size or Problem().ring_size)


def problem_of(args: argparse.Namespace) -> Problem:
    """The problem the options describe; the ring is every device of the platform off the CPU when
    `--ring-size` is not given. A `UsageError` names the flag of an invalid field."""
    ring = args.ring_size if args.ring_size is not None else (Problem().ring_size if args.device == "cpu"
                                                             else None)
    if ring is None:  # gpu / tpu: every device of the platform
        import jax

        ring = len(jax.devices())
    try:
        return Problem(batch=args.batch, seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
                       head_dim=args.head_dim, dtype=args.dtype, causal=args.causal, window=args.window,
                       chunk_size=args.chunk, segments=args.segments, softcap=args.softcap,
                       sinks=args.sinks, ring_size=ring, layout=args.layout, a2a_size=getattr(args, "a2a_size", 1),
                       value_head_dim=args.value_head_dim, packing=args.documents)
    except ValueError as error:  # name the flag, not the field
        message = str(error)
        for field in ("seq_len", "kv_heads", "value_head_dim", "head_dim", "ring_size", "a2a_size", "chunk_size",
                      "batch", "heads", "segments", "sinks", "softcap", "dtype", "layout", "window", "packing"):
            flag = {"chunk_size": "--chunk", "packing": "--documents"}.get(field, "--" + field.replace("_", "-"))
            message = message.replace(f"{field}=", f"{flag} ").replace(f"{field} must", f"{flag} must")
        raise UsageError(message) from None


def calls_of(args: argparse.Namespace) -> int:
    """Calls per timed run: `--calls`, else 5 on the GPU (its dispatch gap) and 1 elsewhere."""
    if args.calls is not None:
        return args.calls
    return 5 if args.device == "gpu" else 1


def cache_of(args: argparse.Namespace) -> Cache:
    """The cache `--db` names, else the default one."""
    return Cache(args.db)


def check_writable_cache(args: argparse.Namespace) -> None:
    """Before the first trial: the cache can be written (the default study storage lives in its folder)."""
    source = "--db" if args.db else ("TUNER_DB" if os.environ.get("TUNER_DB") else "TUNER_HOME")
    try:
        cache_of(args).check_writable()
    except CacheError as error:
        raise UsageError(f"{source}: {error}") from None


def prepare_output(path: str, flag: str, *, folder: bool = False) -> None:
    """Before the work: `path` (a file, or with `folder` a folder) can be written, and the folder it goes
    in exists (created when missing); else one line naming `flag`."""
    target = os.path.abspath(path)
    parent = target if folder else os.path.dirname(target)
    if not folder and os.path.isdir(target):
        raise UsageError(f"{flag} {path} is a folder; give a file path")
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is a file, not a folder; give a path in a folder")
    if not os.access(probe, os.W_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path} is not writable; give a writable path")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot create {parent} ({error.strerror or error})") from None


def check_storage(url: str) -> None:
    """`--storage` names a database optuna can use: a well-formed URL with an installed driver, and
    for SQLite a file that can be created."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()
    except sqlalchemy.exc.ArgumentError:
        raise UsageError(f"--storage {url!r} is not a database URL; use e.g. sqlite:///studies.sqlite or "
                         f"postgresql://user@host/db") from None
    except sqlalchemy.exc.NoSuchModuleError:
        raise UsageError(f"--storage {url!r}: no SQLAlchemy driver for {url.split(':')[0]!r}; install it "
                         f"or use sqlite:///PATH") from None
    from tuner.tuning.study import check_driver

    try:
        check_driver(url)
    except ImportError as error:
        raise UsageError(f"--storage: {error}") from None
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise UsageError(f"--storage {url!r}: an in-memory study cannot be shared or resumed; give a file, "
                             f"e.g. sqlite:///studies.sqlite")
        folder = os.path.dirname(os.path.abspath(parsed.database)) or "."
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--storage {url!r}: cannot create {folder} ({error.strerror or error})") from None
        if not os.access(folder, os.W_OK):
            raise UsageError(f"--storage {url!r}: {folder} is not writable")
