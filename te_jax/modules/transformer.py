"""The body of ``TransformerLayer`` (``te_jax.flax``, ``te_jax.nnx``): self attention, (decoder) cross attention and
an MLP, each with dropout and a residual connection, pre-LN (norms fused into the FP8 GEMMs after them), post-LN
(``post_layernorm``) or pre-LN with the first norm moved to the output (``output_layernorm``, Transformer Engine's);
the residual stream's sharding pinned to its logical names."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from te_jax.fused.layernorm_mlp import activation_params_items
from te_jax.modules.attention import AttentionRunOptions, MultiHeadAttentionOptions, RelativePositionBiasesOptions
from te_jax.modules.attention_cache import KVCache, check_fits_cache, query_positions
from te_jax.modules.axes import ACT, ACT_EMBED, BATCH, EMBED, HEADS, MLP, SEQ, Initializer, axes, constrain
from te_jax.modules.dense import DenseGeneralOptions
from te_jax.modules.layernorm_dense import LayerNormOptions
from te_jax.modules.layernorm_mlp import LayerNormMLPOptions, check_dropout_dims
from te_jax.modules.scope import Scope
from te_jax.ops.activation import activation

__all__ = ["LAYER_TYPES", "TransformerLayerOptions", "transformer_layer", "transformer_layer_params"]

LAYER_TYPES = ("encoder", "decoder")

# The checkpoint names of the MLP's fc1 and fc2 outputs: Transformer Engine's LayerNormMLP defaults, which its
# TransformerLayer keeps.
FFN1_CKPT_NAME, FFN2_CKPT_NAME = "ffn1", "ffn2"

_zeros = jax.nn.initializers.zeros


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerLayerOptions(AttentionRunOptions):
  """The options of ``TransformerLayer``: the linen module's attributes (documented there, with their defaults) but
  ``deterministic``; the NNX module maps its constructor's arguments onto them."""

  hidden_size: int
  intermediate_dim: int
  num_attention_heads: int
  head_dim: int | None
  num_gqa_groups: int | None
  layer_type: str
  self_attn_mask_type: str | None
  self_attn_bias_type: str | None
  enable_relative_embedding: bool
  relative_embedding_buckets: int
  relative_embedding_max_distance: int
  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  hidden_dropout: float
  hidden_dropout_dims: Sequence[int]
  drop_path: float
  attention_dropout: float
  intermediate_dropout: float
  intermediate_dropout_dims: Sequence[int]
  dropout_rng_name: str
  activation_type: Sequence[str]
  activation_params: Any  # as LayerNormMLPOptions' (a sorted tuple of the dict's items)
  use_bias: bool
  apply_residual_connection_post_layernorm: bool
  post_layernorm: bool
  output_layernorm: bool
  scale_attn_logits: bool
  softmax_type: str
  enable_rotary_pos_emb: bool
  rotary_base: float
  rotary_percent: float
  rotary_interleaved: bool
  fuse_qkv_params: bool
  window_size: tuple[int, int] | None
  transpose_batch_sequence: bool
  kernel_init: Initializer
  dtype: Any
  param_dtype: Any
  logical_axes: bool

  def __post_init__(self):
    object.__setattr__(self, "activation_type", tuple(self.activation_type))
    object.__setattr__(self, "activation_params", activation_params_items(self.activation_params,
                                                                          self.activation_type))
    dims = self.hidden_dropout_dims
    if not (isinstance(dims, Sequence) and all(isinstance(d, int) and not isinstance(d, bool) and -3 <= d < 3
                                               for d in dims)):
      raise ValueError(f"hidden_dropout_dims must be a sequence of dims of the (3-D) inputs, each in [-3, 3), got "
                       f"{dims!r}")
    object.__setattr__(self, "hidden_dropout_dims", tuple(d % 3 for d in dims))
    object.__setattr__(self, "intermediate_dropout_dims", tuple(
        d % 3 for d in check_dropout_dims(self.intermediate_dropout_dims, "intermediate_dropout_dims", 3)))
    if not (isinstance(self.drop_path, (int, float)) and not isinstance(self.drop_path, bool)
            and 0.0 <= self.drop_path < 1.0):
      raise ValueError(f"drop_path must be a rate in [0, 1), got {self.drop_path!r}")
    if self.layer_type not in LAYER_TYPES:
      raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {self.layer_type!r}")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                       f"{self.num_attention_heads}: give head_dim")
    if self.post_layernorm and self.output_layernorm:
      raise ValueError("post_layernorm=True (a norm after every residual add, BERT's) and output_layernorm=True (one "
                       "norm on the layer's output in place of the self attention's input norm, Transformer "
                       "Engine's) are two architectures: give one of the two")
    if self.apply_residual_connection_post_layernorm and self.post_layernorm:
      raise ValueError("apply_residual_connection_post_layernorm is a pre-LN option; post_layernorm=True is post-LN")
    if self.apply_residual_connection_post_layernorm and self.output_layernorm:
      raise ValueError("apply_residual_connection_post_layernorm=True takes each block's residual from its input "
                       "norm, and output_layernorm=True leaves the self attention without one: give one of the two")
    if self.enable_relative_embedding and self.self_attn_bias_type not in (None, "pre_scale_bias", "post_scale_bias"):
      raise ValueError(f"enable_relative_embedding=True makes the relative biases the self attention's bias (added "
                       f"after the logits' scale, or before it with self_attn_bias_type='pre_scale_bias'); "
                       f"self_attn_bias_type={self.self_attn_bias_type!r} asks for another")

  def axes(self, *names: str | None) -> tuple[str | None, ...]:
    return axes(self.logical_axes, *names)

  @property
  def drop_path_dims(self) -> tuple[int, ...]:
    """The dims a drop-path mask is shared along: all but the batch's (one draw per example)."""
    return (0, 2) if self.transpose_batch_sequence else (1, 2)

  @property
  def self_mask_type(self) -> str:
    return self.self_attn_mask_type or ("causal" if self.layer_type == "decoder" else "padding")

  def attention(self, cross: bool) -> MultiHeadAttentionOptions:
    """The options of the self attention, or of a decoder's cross attention (``cross``): both with the layer's RoPE,
    sliding window and softmax type, as in Transformer Engine; the self attention's bias, mask type and context
    parallelism its own."""
    relative = self.self_attn_bias_type if self.self_attn_bias_type == "pre_scale_bias" else "post_scale_bias"
    own = dict(attn_mask_type="padding", attn_bias_type=None, context_parallel=None) if cross else dict(
        attn_mask_type=self.self_mask_type,
        attn_bias_type=relative if self.enable_relative_embedding else self.self_attn_bias_type,
        context_parallel=self.context_parallel)
    return MultiHeadAttentionOptions(
        head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
        num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
        attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
        input_layernorm=not self.post_layernorm and (cross or not self.output_layernorm), norm_type=self.norm_type,
        epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
        return_layernorm_output=self.apply_residual_connection_post_layernorm,
        enable_rotary_pos_emb=self.enable_rotary_pos_emb, window_size=self.window_size, rotary_base=self.rotary_base,
        rotary_percent=self.rotary_percent, rotary_interleaved=self.rotary_interleaved,
        fuse_qkv_params=self.fuse_qkv_params, use_bias=self.use_bias, scale_factor=None,
        scale_attn_logits=self.scale_attn_logits,
        softmax_type=self.softmax_type, transpose_batch_sequence=self.transpose_batch_sequence,
        kernel_init=self.kernel_init, bias_init=_zeros, logical_axes=self.logical_axes, dtype=self.dtype,
        param_dtype=self.param_dtype, **{**self.run_options(), **own})

  def norm(self) -> LayerNormOptions:
    """The options of a post-LN norm, or of ``output_layernorm``'s."""
    return LayerNormOptions(epsilon=self.epsilon, norm_type=self.norm_type, zero_centered_gamma=self.zero_centered_gamma,
                            scale_init=None, scale_axes=self.axes(EMBED), bias_init=_zeros,
                            bias_axes=self.axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype)

  def dense(self, features: tuple[int, ...], kernel_axes, bias_axes) -> DenseGeneralOptions:
    """The options of a post-LN MLP's GEMM."""
    return DenseGeneralOptions(features=features, axis=-1, batch_dims=(), unstack_axis=None, use_bias=self.use_bias,
                               kernel_init=self.kernel_init, bias_init=_zeros, dtype=self.dtype,
                               param_dtype=self.param_dtype, precision=None, dot_general=None,
                               dot_general_cls=None, kernel_axes=kernel_axes, bias_axes=bias_axes, output_axes=(),
                               recipe=self.recipe, quantization_checkpoint_name=None)

  def mlp(self) -> LayerNormMLPOptions:
    """The options of a pre-LN MLP (``LayerNormMLP``)."""
    return LayerNormMLPOptions(
        intermediate_dim=self.intermediate_dim, activation_type=self.activation_type,
        activation_params=self.activation_params, intermediate_dropout=self.intermediate_dropout,
        intermediate_dropout_dims=self.intermediate_dropout_dims, dropout_rng_name=self.dropout_rng_name,
        use_bias=self.use_bias, return_layernorm_output=self.apply_residual_connection_post_layernorm,
        norm_type=self.norm_type, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
        ln_scale_init=None, ln_scale_axes=(), ln_bias_init=_zeros, ln_bias_axes=(), kernel_init=self.kernel_init,
        bias_init=_zeros, wi_kernel_axes=(), wi_bias_axes=(), wo_kernel_axes=(), wo_bias_axes=(),
        logical_axes=self.logical_axes, transpose_batch_sequence=self.transpose_batch_sequence, dtype=self.dtype,
        param_dtype=self.param_dtype, recipe=self.recipe, quantization_checkpoint_name=None,
        ffn1_ckpt_name=FFN1_CKPT_NAME, ffn2_ckpt_name=FFN2_CKPT_NAME)


class LayerParts(NamedTuple):
  """The submodules of a ``TransformerLayer`` (None where the options make none)."""

  relpos_bias: Any
  self_attention: Any
  cross_attention: Any
  cross_attention_layernorm: Any
  self_attention_layernorm: Any
  mlp_layernorm: Any
  wi: Any
  wo: Any
  mlp: Any
  output_layernorm: Any


def transformer_layer_params(scope: Scope, o: TransformerLayerOptions, cross_attention: bool,
                             decode: bool = False) -> LayerParts:
  """The submodules of a layer (with a decoder's ``cross_attention``), in the order NNX creates them; ``decode``: the
  NNX self attention's default."""
  hidden = o.hidden_size
  relpos = None
  if o.enable_relative_embedding:
    relpos = scope.submodule("relpos_bias", RelativePositionBiasesOptions(
        num_buckets=o.relative_embedding_buckets, max_distance=o.relative_embedding_max_distance,
        num_attention_heads=o.num_attention_heads,
        embedding_init=jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
        embedding_axes=o.axes(HEADS, None), dtype=jnp.float32))
  self_attention = scope.submodule("self_attention", o.attention(cross=False), hidden, attention_type="self",
                                   decode=decode)
  cross = cross_norm = self_norm = mlp_norm = wi = wo = mlp = out_norm = None
  if cross_attention:
    cross = scope.submodule("encoder_decoder_attention", o.attention(cross=True), hidden, attention_type="cross")
    if o.post_layernorm:
      cross_norm = scope.submodule("encoder_decoder_attention_layernorm", o.norm(), hidden)
  if o.post_layernorm:
    self_norm = scope.submodule("self_attention_layernorm", o.norm(), hidden)
    mlp_norm = scope.submodule("mlp_layernorm", o.norm(), hidden)
    n_act = 2 if len(o.activation_type) == 2 else 1
    wi = scope.submodule("wi", o.dense((n_act, o.intermediate_dim), o.axes(EMBED, ACT, MLP), o.axes(ACT, MLP)),
                         hidden)
    wo = scope.submodule("wo", o.dense((hidden,), o.axes(MLP, EMBED), o.axes(EMBED)), o.intermediate_dim)
    scope.declare_dropout("intermediate", o.intermediate_dropout, o.dropout_rng_name, o.intermediate_dropout_dims)
  else:
    mlp = scope.submodule("mlp", o.mlp(), hidden)
    if o.output_layernorm:
      out_norm = scope.submodule("output_layernorm", o.norm(), hidden)
  scope.declare_dropout("dropout", o.hidden_dropout, o.dropout_rng_name, o.hidden_dropout_dims)
  if o.drop_path > 0:
    scope.declare_dropout("drop_path", o.drop_path, o.dropout_rng_name, o.drop_path_dims)
  return LayerParts(relpos, self_attention, cross, cross_norm, self_norm, mlp_norm, wi, wo, mlp, out_norm)


def transformer_layer(scope: Scope, o: TransformerLayerOptions, inputs: jax.Array, encoded=None, attention_mask=None,
                      encoder_decoder_mask=None, *, segment_ids=None, positions=None, deterministic: bool = True,
                      decode: bool = False, cache: KVCache | None = None) -> jax.Array:
  """``TransformerLayer``'s call (documented on the linen module), ``deterministic`` and ``decode`` resolved by the
  framework; ``cache``: the self attention's KV cache, when decoding."""
  if inputs.ndim != 3 or inputs.shape[-1] != o.hidden_size:
    raise ValueError(f"inputs must be 3-D with last dim hidden_size={o.hidden_size}, got shape {inputs.shape}")
  if encoded is not None and o.layer_type != "decoder":
    raise ValueError("encoded (cross attention) is given, but layer_type is 'encoder'")
  mask_type = o.self_mask_type
  if mask_type in ("padding", "padding_causal") and attention_mask is None and segment_ids is None:
    mask_type = "no_mask" if mask_type == "padding" else "causal"
  stream_names = (SEQ, BATCH, ACT_EMBED) if o.transpose_batch_sequence else (BATCH, SEQ, ACT_EMBED)

  def residual_stream(x):
    """With ``logical_axes``, the residual stream pinned to its logical (batch, seq, hidden) sharding (a no-op
    outside Flax's logical axis rules)."""
    return constrain(x, stream_names) if o.logical_axes else x

  def dropout_add(y, residual, path: bool):
    """``residual + dropout(y)``, with ``path`` also the drop path (stochastic depth, Huang et al. 2016: the whole
    branch of an example dropped, the others scaled by 1 / (1 - drop_path)), as Transformer Engine applies it."""
    y = scope.dropout("dropout", o.hidden_dropout, o.dropout_rng_name, y, deterministic, o.hidden_dropout_dims)
    if path and o.drop_path > 0:
      y = scope.dropout("drop_path", o.drop_path, o.dropout_rng_name, y, deterministic, o.drop_path_dims)
    return residual_stream(y.astype(residual.dtype) + residual)

  def residual_block(block, residual, path: bool):
    """``residual + dropout(block(None))`` (``path``: with the drop path); with no dropout to apply and the residual
    stream in the compute dtype, ``block(residual)`` instead: the block adds it in its last GEMM's epilogue (no pass
    of its own). With ``apply_residual_connection_post_layernorm``, ``block(None)`` returns its normalized input
    too, which is the residual then."""
    if o.apply_residual_connection_post_layernorm:
      y, normalized = block(None)
      return dropout_add(y, normalized, path)
    compute_dtype = jnp.dtype(o.dtype or jnp.result_type(residual.dtype, o.param_dtype))
    no_dropout = deterministic or (o.hidden_dropout == 0.0 and (o.drop_path == 0.0 or not path))
    if no_dropout and jnp.dtype(residual.dtype) == compute_dtype:
      return residual_stream(block(residual))
    return dropout_add(block(None), residual, path)

  bias = offset = None
  length = inputs.shape[0 if o.transpose_batch_sequence else 1]
  keys = length
  if decode:  # checked here, before the relative biases read the cache
    cache_shape = cache.key_shape()
    if cache_shape is not None:
      own = o.attention(cross=False)
      batch = inputs.shape[1 if o.transpose_batch_sequence else 0]
      check_fits_cache(cache_shape, (batch, length, own.kv_heads, own.head_dim), "inputs")
      keys, offset = cache_shape[1], cache.index()
  parts = transformer_layer_params(scope, o, encoded is not None)
  x = residual_stream(inputs)
  if parts.relpos_bias is not None:
    # Over this input's positions; when decoding, of the queries at the cache index over every key the cache holds.
    bias = parts.relpos_bias(length, keys, bidirectional=o.layer_type == "encoder", q_offset=offset)
  attn = parts.self_attention
  kw = dict(segment_ids=segment_ids, positions=positions, decode=decode, deterministic=deterministic,
            attn_mask_type=mask_type)
  x = residual_block(lambda r: attn(x, None, attention_mask, bias, residual=r, **kw), x, True)
  if o.post_layernorm:
    x = parts.self_attention_layernorm(x)
  if encoded is not None:
    cross_type = "padding" if encoder_decoder_mask is not None else "no_mask"
    # RoPE: the queries at their positions (when decoding, the cache index's), the keys at the encoder's arange.
    q_positions = positions if positions is not None or offset is None else query_positions(length, offset)
    x = residual_block(lambda r: parts.cross_attention(x, encoded, encoder_decoder_mask, positions=q_positions,
                                                       deterministic=deterministic, residual=r,
                                                       attn_mask_type=cross_type), x, False)
    if o.post_layernorm:
      x = parts.cross_attention_layernorm(x)
  if not o.post_layernorm:
    x = residual_block(lambda r: parts.mlp(x, deterministic=deterministic, residual=r), x, True)
    # output_layernorm: the self attention read the input as it is; its norm is here, on the layer's output.
    return parts.output_layernorm(x) if o.output_layernorm else x
  # Post-LN: the input is normalized already; the MLP is fc1, activation, fc2, their outputs named as LayerNormMLP's.
  h = checkpoint_name(parts.wi(x), FFN1_CKPT_NAME)
  a = activation(h if len(o.activation_type) == 2 else h[..., 0, :], o.activation_type, dict(o.activation_params))
  a = scope.dropout("intermediate", o.intermediate_dropout, o.dropout_rng_name, a, deterministic,
                    o.intermediate_dropout_dims)
  x = dropout_add(checkpoint_name(parts.wo(a), FFN2_CKPT_NAME), x, True)
  return parts.mlp_layernorm(x)
