"""Flax linen modules of te_jax, on the fused ops of ``te_jax``; their FP8 state lives in ``te_jax.FP8_COLLECTION``."""

from te_jax.flax.attention import DotProductAttention as DotProductAttention
from te_jax.flax.attention import MultiHeadAttention as MultiHeadAttention
from te_jax.flax.attention import RelativePositionBiases as RelativePositionBiases
from te_jax.flax.checkpoint import FlaxLayout as FlaxLayout
from te_jax.flax.checkpoint import convert_blocks as convert_blocks
from te_jax.flax.checkpoint import convert_like as convert_like
from te_jax.flax.checkpoint import convert_train_state as convert_train_state
from te_jax.flax.checkpoint import flax_block_to_te as flax_block_to_te
from te_jax.flax.checkpoint import restore_into_fp8 as restore_into_fp8
from te_jax.flax.checkpoint import te_block_to_flax as te_block_to_flax
from te_jax.flax.dense import DenseGeneral as DenseGeneral
from te_jax.flax.dense import Fp8DotGeneral as Fp8DotGeneral
from te_jax.flax.dense import Fp8Einsum as Fp8Einsum
from te_jax.flax.fp8_state import accumulate_gradients as accumulate_gradients
from te_jax.flax.fp8_state import calibrate as calibrate
from te_jax.flax.fp8_state import split_fp8_state as split_fp8_state
from te_jax.flax.layernorm_dense import LayerNormDenseGeneral as LayerNormDenseGeneral
from te_jax.flax.layernorm_mlp import LayerNormMLP as LayerNormMLP
from te_jax.flax.moe import MoEBlock as MoEBlock
from te_jax.flax.normalization import LayerNorm as LayerNorm
from te_jax.flax.params import LOGICAL_AXES as LOGICAL_AXES
from te_jax.flax.sharding import logical_axis_rules as logical_axis_rules
from te_jax.flax.softmax import Softmax as Softmax
from te_jax.flax.transformer import TransformerLayer as TransformerLayer

__all__ = [
    "DenseGeneral", "DotProductAttention", "FlaxLayout", "Fp8DotGeneral", "Fp8Einsum", "LOGICAL_AXES", "LayerNorm",
    "LayerNormDenseGeneral", "LayerNormMLP", "MoEBlock", "MultiHeadAttention", "RelativePositionBiases",
    "Softmax", "TransformerLayer", "accumulate_gradients", "calibrate", "convert_blocks", "convert_like",
    "convert_train_state", "flax_block_to_te", "logical_axis_rules", "restore_into_fp8", "split_fp8_state",
    "te_block_to_flax",
]
