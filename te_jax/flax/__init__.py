"""Flax linen modules of te_jax, on the fused ops of ``te_jax``; their FP8 state lives in ``te_jax.FP8_COLLECTION``."""

from te_jax.flax.attention import DotProductAttention as DotProductAttention
from te_jax.flax.attention import MultiHeadAttention as MultiHeadAttention
from te_jax.flax.attention import RelativePositionBiases as RelativePositionBiases
from te_jax.flax.dense import DenseGeneral as DenseGeneral
from te_jax.flax.dense import Fp8DotGeneral as Fp8DotGeneral
from te_jax.flax.fp8_state import accumulate_gradients as accumulate_gradients
from te_jax.flax.fp8_state import calibrate as calibrate
from te_jax.flax.fp8_state import split_fp8_state as split_fp8_state
from te_jax.flax.layernorm_dense import LayerNormDenseGeneral as LayerNormDenseGeneral
from te_jax.flax.layernorm_mlp import LayerNormMLP as LayerNormMLP
from te_jax.flax.normalization import LayerNorm as LayerNorm
from te_jax.flax.params import LOGICAL_AXES as LOGICAL_AXES
from te_jax.flax.sharding import logical_axis_rules as logical_axis_rules
from te_jax.flax.transformer import TransformerLayer as TransformerLayer

__all__ = [
    "DenseGeneral", "DotProductAttention", "Fp8DotGeneral", "LOGICAL_AXES", "LayerNorm", "LayerNormDenseGeneral",
    "LayerNormMLP", "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer", "accumulate_gradients",
    "calibrate", "logical_axis_rules", "split_fp8_state",
]
