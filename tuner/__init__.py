"""ring-tuner: exact ring flash attention for JAX, verified against a dense reference, autotuned.

    from tuner import get_tuned_ring_attention, ring_attention, autotune, FwdParams, BwdParams
    from tuner import save_attention_residuals   # a jax.checkpoint policy that skips the ring's recompute
"""

from tuner.strategies import all_gather, all_to_all, hybrid, implementations  # noqa: F401 - register themselves
from tuner.tuning.autotuning import autotune
from tuner.runtime.dispatch import get_tuned_ring_attention
from tuner.kernels.params import BwdParams, FwdParams
from tuner.runtime.attention import ring_attention
from tuner.runtime.remat import RESIDUAL_NAMES, save_attention_residuals
from tuner.semantics import layouts
from tuner.support import libtpu
from tuner.support.version import __version__

# before jax starts its backends (importing jax starts none): where libtpu is installed and this host has no TPU
# chip, libtpu's failed lookups would fill the first call's stderr
libtpu.quiet_without_chips()


__all__ = ["BwdParams", "FwdParams", "RESIDUAL_NAMES", "autotune", "get_tuned_ring_attention", "layouts",
           "ring_attention", "save_attention_residuals", "__version__"]
