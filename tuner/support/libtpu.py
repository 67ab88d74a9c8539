"""libtpu on a host without TPU chips.

The TPU dry runs need libtpu (the TPU compiler), and the test extra installs it, so it is often present
on CPU and GPU hosts. There jax still starts it when it looks for devices, and libtpu prints five lines
of failed lookups to stderr: no accelerator type, no host bounds, no worker hostnames. `quiet_without_chips`
tells it, before jax starts it, what such a host is: one host with no others. `import tuner` calls it (the
`tuner` command too, which imports it). Nothing changes on a host with a TPU chip on its PCI bus, and a
variable the caller set keeps its value.
"""

from __future__ import annotations

import importlib.util
import os

HOST = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}  # one host, no others


def tpu_chips() -> int | None:
    """TPU chips on this host's PCI bus, as jax counts them; None where jax's count cannot be read."""
    try:
        from jax._src import hardware_utils

        count = hardware_utils.num_available_tpu_chips_and_device_id
    except (ImportError, AttributeError):  # a private module: another jax may move it
        return None
    return count()[0]


def quiet_without_chips() -> bool:
    """Describe this host to libtpu as one host of its own, where libtpu is installed and no TPU chip is
    present; call before jax starts its backends. Returns whether it did."""
    if importlib.util.find_spec("libtpu") is None or tpu_chips() != 0:
        return False
    for name, value in HOST.items():
        os.environ.setdefault(name, value)
    return True


__all__ = ["HOST", "quiet_without_chips", "tpu_chips"]
