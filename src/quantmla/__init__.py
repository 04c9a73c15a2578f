"""quantmla: a low-bit, dual-path KV cache for Multi-Head Latent Attention (MLA) models.

QuantMLA stores the two things MLA caches per token and layer -- the 512-dim *content latent*
(``c_kv``) and the 64-dim decoupled *RoPE key* (``k_pe``) -- in separately chosen low-bit formats
(C4R4, C2R4, ...), keeps the *sink* tokens and a *local window* of recent tokens in full precision,
and attends over the packed cache directly.

Importing this package never touches CUDA; GPU kernels are imported lazily.
"""

from quantmla.quant.formats import FORMATS, CacheFormat, get_format
from quantmla.quant.spec import QuantSpec

__version__ = "0.1.0"

__all__ = ["FORMATS", "CacheFormat", "QuantSpec", "get_format", "__version__"]
