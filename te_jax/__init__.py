"""te_jax: FP8 training of Transformers in JAX/Flax on NVIDIA GPUs, with a pure-JAX fallback everywhere else.

The public API, in one place. Everything not re-exported here is private.
"""

from te_jax import recipe as recipe
from te_jax import scaling as scaling
from te_jax.activation import activation as activation
from te_jax.attention import AttentionBackend as AttentionBackend
from te_jax.attention import attention_backend as attention_backend
from te_jax.attention import dot_product_attention as dot_product_attention
from te_jax.attention import fp8_attention_support as fp8_attention_support
from te_jax.attention import make_attention_mask as make_attention_mask
from te_jax.autocast import AutocastState as AutocastState
from te_jax.autocast import MeshResource as MeshResource
from te_jax.autocast import autocast as autocast
from te_jax.autocast import get_autocast_state as get_autocast_state
from te_jax.dense import DenseFp8Meta as DenseFp8Meta
from te_jax.dense import dense as dense
from te_jax.layernorm import layernorm as layernorm
from te_jax.layernorm_dense import layernorm_dense as layernorm_dense
from te_jax.layernorm_mlp import layernorm_mlp as layernorm_mlp
from te_jax.ops.activation import activation_bwd as activation_bwd
from te_jax.ops.activation import activation_fwd as activation_fwd
from te_jax.ops.gemm import gemm as gemm
from te_jax.ops.norm import NormOutput as NormOutput
from te_jax.ops.norm import norm_bwd as norm_bwd
from te_jax.ops.norm import norm_fwd as norm_fwd
from te_jax.ops.quantize import Quantized as Quantized
from te_jax.ops.quantize import amax as amax
from te_jax.ops.quantize import dequantize as dequantize
from te_jax.ops.quantize import quantize as quantize
from te_jax.ops.quantize_interleaved import quantize_interleaved as quantize_interleaved
from te_jax.rope import apply_rope as apply_rope
from te_jax.rope import rope_frequencies as rope_frequencies
from te_jax.softmax import scaled_masked_softmax as scaled_masked_softmax
from te_jax.softmax import scaled_softmax as scaled_softmax
from te_jax.softmax import scaled_upper_triang_masked_softmax as scaled_upper_triang_masked_softmax

#: The Flax variable collection of the modules' FP8 state (Flax's `_overwrite_with_gradient`).
FP8_COLLECTION = "_overwrite_with_gradient"

__version__ = "0.1.0"
