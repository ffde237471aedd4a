"""Primitives, one op family per module. Each module holds, in this order: the pure-jnp reference ``<op>_ref``, the
primitives with their abstract evaluation, lowerings (the CUDA and CPU FFI handlers ``te_<op>_<platform>`` where
they exist, the reference everywhere else), the vmap rule and the sharding rule; ops that are differentiable on their
own (norm, activation, softmax, rope) end with the ``custom_vjp`` that pairs their forward and backward primitives.

The ops that write or read FP8 take and return ``te_jax.QuantizedTensor`` values (data, scales and their
``te_jax.ScalingMode``, an optional transposed copy): ``quantize``, the FP8 outputs of ``norm`` and ``activation``,
``gemm``'s operands.

Modules:

- ``quantize``: the saturating FP8 cast with amax, transposed copy and bias gradient fused; ``amax``.
- ``quantize_interleaved``: the same cast of several arrays' column chunks, interleaved.
- ``quantize_block``: the block-scaled casts (1 x 128 and 128 x 128 FP8 blocks, MXFP8, NVFP4), references first.
- ``gemm``: FP8 and bf16/fp16/fp32 GEMMs through cuBLASLt, with bias and residual epilogues, and a strided batched
  form.
- ``grouped_gemm``: the ragged GEMMs of mixture-of-experts layers (one matrix per group of rows, the groups given by
  traced sizes), high precision, FP8 with per-group scales and block-scaled; reference first, a CUDA handler for
  tiled groups.
- ``norm``: LayerNorm and RMSNorm forward (high-precision or FP8 output) and backward; ``layernorm``.
- ``activation``: gelu, relu, silu, quick_gelu, squared_relu, sigmoid, their gated and paired forms and the clamped
  SwiGLU (``ACTIVATION_TYPES``); ``activation``.
- ``softmax``: scaled, masked and causal softmax; ``scaled_softmax`` and its masked and causal forms.
- ``rope``: rotary position embedding; ``apply_rope``, ``rope_frequencies``.
- ``scale_update``: the delayed-scaling update of many amax histories and scales in one op.
"""

from te_jax.ops import activation as activation
from te_jax.ops import gemm as gemm
from te_jax.ops import grouped_gemm as grouped_gemm
from te_jax.ops import norm as norm
from te_jax.ops import quantize as quantize
from te_jax.ops import quantize_block as quantize_block
from te_jax.ops import quantize_interleaved as quantize_interleaved
from te_jax.ops import rope as rope
from te_jax.ops import scale_update as scale_update
from te_jax.ops import softmax as softmax

__all__ = ["activation", "gemm", "grouped_gemm", "norm", "quantize", "quantize_block", "quantize_interleaved", "rope",
           "scale_update", "softmax"]
