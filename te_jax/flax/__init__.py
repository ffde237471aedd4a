"""Flax linen modules of te_jax. Everything not re-exported here is private."""

from te_jax.flax._fp8_state import FP8_COLLECTION as FP8_COLLECTION
from te_jax.flax._fp8_state import accumulate_gradients as accumulate_gradients
from te_jax.flax._fp8_state import calibrate as calibrate
from te_jax.flax.attention import DotProductAttention as DotProductAttention
from te_jax.flax.dense import DenseGeneral as DenseGeneral
from te_jax.flax.dense import Fp8DotGeneral as Fp8DotGeneral
from te_jax.flax.normalization import LayerNorm as LayerNorm
from te_jax.flax.fused import LayerNormDenseGeneral as LayerNormDenseGeneral
from te_jax.flax.fused import LayerNormMLP as LayerNormMLP
from te_jax.flax.transformer import LOGICAL_AXES as LOGICAL_AXES
from te_jax.flax.transformer import MultiHeadAttention as MultiHeadAttention
from te_jax.flax.transformer import RelativePositionBiases as RelativePositionBiases
from te_jax.flax.transformer import TransformerLayer as TransformerLayer
