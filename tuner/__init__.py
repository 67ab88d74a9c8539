"""ring-tuner: exact ring flash attention for JAX, verified against a dense reference, autotuned.

    from tuner import get_tuned_ring_attention, ring_attention, autotune, FwdParams, BwdParams
"""

from tuner import all_to_all, implementations  # noqa: F401 - registers the built-in implementations
from tuner import all_gather, hybrid  # noqa: F401 - register the all-gather and hybrid implementations
from tuner.autotuning import autotune
from tuner.dispatch import get_tuned_ring_attention
from tuner.params import BwdParams, FwdParams
from tuner.attention import ring_attention

__version__ = "0.1.0"

__all__ = ["BwdParams", "FwdParams", "autotune", "get_tuned_ring_attention", "ring_attention", "__version__"]
