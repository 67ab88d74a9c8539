"""Test setup: 8 simulated CPU devices (before jax is imported), the order of the test files, the
hypothesis profiles, and the heap frozen after each test.

    python -m pytest -q                     # everything (what CI runs)
    python -m pytest -q -m "not slow"       # the fast tier, while editing
    HYPOTHESIS_PROFILE=fresh pytest         # the usual sizes, examples drawn anew each run
    HYPOTHESIS_PROFILE=thorough pytest      # many more hypothesis examples, on demand

After each test, the objects still alive are frozen (`gc.freeze`): the garbage collector no longer walks
them. A worker's heap grows with every program jax keeps (to a million objects and more), and each full
collection walked all of it: about 5% of a file's time, and 20 s of the test under `jax.checking_leaks()`,
which collects at the end of every trace still alive. The objects a test makes stay collectable during
it; at the session's end the heap is unfrozen.

Every worker gets an empty tuning cache of its own (`TUNER_HOME` in a temporary folder), whatever the
user's `tuner search` stored.

JAX's persistent compilation cache is off, even where `JAX_COMPILATION_CACHE_DIR` is set: on jax 0.10.2
a multi-device CPU program loaded back from it is more likely to have two collectives of one kind in
flight at once, which XLA:CPU cannot run (`benchmarks/cpu_ring/README.md`). The run's header says when the
variable was dropped.
"""

import functools
import gc
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the TPU-compiler tests of several workers each load libtpu (to compile, never to run): without this the
# second to load it is refused its lock file, whichever test files the workers happen to hold
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_DROPPED_CACHE = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # tuner subprocesses inherit the removal
# a tuning cache of the run's own: the entries a user's `tuner search` stored in ~/.cache/tuner change the
# tiles the loader picks, and with them what a test measures (the README's main command made a memory
# bound fail); tests and their subprocesses see an empty cache unless they make one
_TUNER_HOME = os.environ["TUNER_HOME"] = tempfile.mkdtemp(prefix="tuner-home-")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from cli_run import in_process  # noqa: E402

settings.register_profile(
    "ci", max_examples=6, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(  # the ci profile's sizes with new examples each run (ci draws the same ones)
    "fresh", max_examples=6, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=200, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def cli(capsys):
    """`tuner ARGS` as the script runs it, in this process, with this test's output capture
    (`cli_run.in_process`): no interpreter and jax to start per command."""
    return functools.partial(in_process, capsys)


def pytest_report_header() -> str | None:
    """A line in the run's header when the caller's compilation cache folder was dropped."""
    if _DROPPED_CACHE:
        return (f"JAX_COMPILATION_CACHE_DIR={_DROPPED_CACHE} ignored: JAX's persistent compilation cache stays off "
                "on the CPU (benchmarks/cpu_ring/README.md)")
    return None


def pytest_collection_modifyitems(items: list) -> None:
    """Test files with slow tests first, so that pytest-xdist (a file per worker) does not leave a long
    file to run alone at the end; the order within a file is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run the test, then freeze what is still alive (see the module's docstring)."""
    yield
    gc.freeze()


def pytest_sessionfinish(session, exitstatus) -> None:
    """The heap unfrozen, so that the process's exit collects it; the run's tuning cache removed."""
    gc.unfreeze()
    shutil.rmtree(_TUNER_HOME, ignore_errors=True)
