"""Test setup: 8 simulated CPU devices and JAX's persistent compilation cache (before jax is imported),
the `slow` tier, and the hypothesis profiles.

    python -m pytest -q                     # everything (what CI runs)
    python -m pytest -q -m "not slow"       # the fast tier, while editing
    HYPOTHESIS_PROFILE=thorough pytest      # many more hypothesis examples, on demand

The compilation cache is one folder for the whole run, shared by the pytest-xdist workers and by every
`tuner` subprocess a test starts (they inherit the environment), so a program compiled once is not
compiled again by the next test or process that builds it. Set `JAX_COMPILATION_CACHE_DIR` yourself to
keep one folder across runs.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the xdist controller makes it; its workers inherit it
    _compiled = tempfile.mkdtemp(prefix="ring-tuner-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compiled
    atexit.register(shutil.rmtree, _compiled, ignore_errors=True)
# Keep every program that took a tenth of a second to compile (the default keeps only those over 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=200, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))



def pytest_collection_modifyitems(items: list) -> None:
    """Test files with slow tests first, so that pytest-xdist (a file per worker) does not leave a long
    file to run alone at the end; the order within a file is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
