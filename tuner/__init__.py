"""ring-tuner: exact ring flash attention for JAX, verified against a dense reference.

    from tuner import ring_attention, FwdParams, BwdParams
"""

from tuner.params import BwdParams, FwdParams
from tuner.ring import ring_attention

__version__ = "0.1.0"

__all__ = ["BwdParams", "FwdParams", "ring_attention", "__version__"]
