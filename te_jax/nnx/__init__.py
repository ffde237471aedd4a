"""Flax NNX modules of te_jax, on the same fused ops as ``te_jax.flax``; their FP8 state lives in ``Fp8State``
variables, kept current by ``value_and_grad`` / ``grad``."""

from te_jax.nnx.attention import DotProductAttention as DotProductAttention
from te_jax.nnx.attention import MultiHeadAttention as MultiHeadAttention
from te_jax.nnx.attention import RelativePositionBiases as RelativePositionBiases
from te_jax.nnx.convert import from_linen as from_linen
from te_jax.nnx.convert import to_linen as to_linen
from te_jax.nnx.dense import DenseGeneral as DenseGeneral
from te_jax.nnx.dense import Fp8DotGeneral as Fp8DotGeneral
from te_jax.nnx.dense import Fp8Einsum as Fp8Einsum
from te_jax.nnx.fp8_state import Fp8State as Fp8State
from te_jax.nnx.fp8_state import calibrate as calibrate
from te_jax.nnx.fp8_state import grad as grad
from te_jax.nnx.fp8_state import update_fp8_state as update_fp8_state
from te_jax.nnx.fp8_state import value_and_grad as value_and_grad
from te_jax.nnx.layernorm import LayerNorm as LayerNorm
from te_jax.nnx.layernorm import LayerNormDenseGeneral as LayerNormDenseGeneral
from te_jax.nnx.layernorm import LayerNormMLP as LayerNormMLP
from te_jax.nnx.moe import AuxLoss as AuxLoss
from te_jax.nnx.moe import MoEBlock as MoEBlock
from te_jax.nnx.softmax import Softmax as Softmax
from te_jax.nnx.transformer import TransformerLayer as TransformerLayer

__all__ = [
    "AuxLoss", "DenseGeneral", "DotProductAttention", "Fp8DotGeneral", "Fp8Einsum", "Fp8State", "LayerNorm",
    "LayerNormDenseGeneral", "LayerNormMLP", "MoEBlock", "MultiHeadAttention", "RelativePositionBiases",
    "Softmax", "TransformerLayer", "calibrate", "from_linen", "grad", "to_linen", "update_fp8_state",
    "value_and_grad",
]
