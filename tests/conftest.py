"""Test setup: 8 simulated CPU devices (before jax is imported), the order of the test files, and the
hypothesis profiles.

    python -m pytest -q                     # everything (what CI runs)
    python -m pytest -q -m "not slow"       # the fast tier, while editing
    HYPOTHESIS_PROFILE=thorough pytest      # many more hypothesis examples, on demand

JAX's persistent compilation cache is not used: on jax 0.10.2's CPU runtime a ring program loaded back
from it can abort in a collective-permute rendezvous (`benchmarks/NOTES.md`).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
