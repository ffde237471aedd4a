"""te_jax: FP8 training of Transformers in JAX/Flax on NVIDIA GPUs, with a pure-JAX path everywhere else.

The public API, in one place. The layers of the package, bottom to top (each imports only from those below it):

- ``te_jax._core``: infrastructure (native extension loading, autocast, scaling math, primitive plumbing, shard_map
  helpers, the one module that touches private JAX APIs). ``te_jax.recipe`` belongs to this layer.
- ``te_jax.ops``: primitives, one op family per module (its pure-jnp reference, primitives, lowerings, vmap and
  sharding rules, and for ops differentiable on their own, the ``custom_vjp`` pairing forward and backward).
- ``te_jax.fused``: differentiable ops built from several primitives, with FP8 GEMMs and their scaling state.
- ``te_jax.flax``: Flax linen modules on the fused ops.
"""

from te_jax import ops as ops
from te_jax import recipe as recipe
from te_jax._core.autocast import autocast as autocast
from te_jax._core.quantized_tensor import QuantizedTensor as QuantizedTensor
from te_jax._core.quantized_tensor import ScalingMode as ScalingMode
from te_jax._core.scaling import FP8_COLLECTION as FP8_COLLECTION
from te_jax._core.scaling import FP8_RESIDUAL as FP8_RESIDUAL
from te_jax.fused.attention import attention_backend as attention_backend
from te_jax.fused.attention import dot_product_attention as dot_product_attention
from te_jax.fused.attention import make_attention_mask as make_attention_mask
from te_jax.fused.attention_sequences import SequenceDescriptor as SequenceDescriptor
from te_jax.fused.attention_sequences import segment_positions as segment_positions
from te_jax.fused.context_parallel import context_parallel_attention as context_parallel_attention
from te_jax.fused.context_parallel import context_parallel_backend as context_parallel_backend
from te_jax.fused.context_parallel import from_zigzag as from_zigzag
from te_jax.fused.context_parallel import to_zigzag as to_zigzag
from te_jax.fused.context_parallel import zigzag_order as zigzag_order
from te_jax.fused.dense import dense as dense
from te_jax.fused.dot_general import dot_general as dot_general
from te_jax.fused.expert_parallel import expert_parallel_moe as expert_parallel_moe
from te_jax.fused.grouped_dense import group_align as group_align
from te_jax.fused.grouped_dense import grouped_dense as grouped_dense
from te_jax.fused.layernorm_dense import layernorm_dense as layernorm_dense
from te_jax.fused.layernorm_mlp import layernorm_mlp as layernorm_mlp
from te_jax.fused.moe_permute import expert_capacity as expert_capacity
from te_jax.fused.moe_permute import permute as permute
from te_jax.fused.moe_permute import unpermute as unpermute
from te_jax.fused.moe_router import load_balancing_loss as load_balancing_loss
from te_jax.fused.moe_router import route as route
from te_jax.fused.moe_router import update_expert_bias as update_expert_bias
from te_jax.fused.moe_router import z_loss as z_loss
from te_jax.fused.quantizer import DenseFp8Meta as DenseFp8Meta
from te_jax.ops.activation import activation as activation
from te_jax.ops.norm import layernorm as layernorm
from te_jax.ops.rope import apply_rope as apply_rope
from te_jax.ops.rope import rope_frequencies as rope_frequencies
from te_jax.ops.softmax import scaled_masked_softmax as scaled_masked_softmax
from te_jax.ops.softmax import scaled_softmax as scaled_softmax
from te_jax.ops.softmax import scaled_upper_triang_masked_softmax as scaled_upper_triang_masked_softmax

__all__ = [
    "DenseFp8Meta", "FP8_COLLECTION", "FP8_RESIDUAL", "QuantizedTensor", "ScalingMode", "SequenceDescriptor",
    "activation", "apply_rope",
    "attention_backend", "autocast", "context_parallel_attention", "context_parallel_backend", "dense", "dot_general",
    "dot_product_attention", "expert_capacity", "expert_parallel_moe", "from_zigzag", "group_align", "grouped_dense",
    "layernorm", "layernorm_dense", "layernorm_mlp", "load_balancing_loss", "make_attention_mask", "ops", "permute",
    "recipe", "rope_frequencies", "route", "scaled_masked_softmax", "scaled_softmax",
    "scaled_upper_triang_masked_softmax", "segment_positions", "to_zigzag", "unpermute", "update_expert_bias",
    "z_loss", "zigzag_order",
]

__version__ = "0.1.0"
