"""te_jax: FP8 training of Transformers in JAX/Flax on NVIDIA GPUs, with a pure-JAX fallback everywhere else.

The public API, in one place. Everything not re-exported here is private.
"""

from te_jax import scaling as scaling
from te_jax.ops.quantize import Quantized as Quantized
from te_jax.ops.quantize import amax as amax
from te_jax.ops.quantize import dequantize as dequantize
from te_jax.ops.quantize import quantize as quantize

__version__ = "0.1.0"
