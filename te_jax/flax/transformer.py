"""Flax linen ``TransformerLayer``: self attention, (decoder) cross attention and an MLP, each with dropout and a
residual connection, pre-LN (norms fused into the FP8 GEMMs after them) or post-LN.

Conventions: masks are Flax's, **True (or nonzero) where attention is allowed** (``nn.make_attention_mask``), unless
``mask_convention="te"`` asks for NVIDIA Transformer Engine's (True = masked out); tensors are
``(batch, sequence, hidden)`` unless ``transpose_batch_sequence`` makes them ``(sequence, batch, hidden)``. Dropout
draws from the ``dropout_rng_name`` rng stream unless ``deterministic``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.attention import MultiHeadAttention, RelativePositionBiases
from te_jax.flax.dense import DenseGeneral
from te_jax.flax.layernorm_mlp import LayerNormMLP
from te_jax.flax.normalization import LayerNorm
from te_jax.flax.params import ACT, ACT_EMBED, BATCH, EMBED, HEADS, MLP, SEQ, Initializer, axes, resolve_deterministic
from te_jax.ops.activation import activation
from te_jax.recipe import Recipe

__all__ = ["TransformerLayer"]

LAYER_TYPES = ("encoder", "decoder")


class TransformerLayer(nn.Module):
  """One Transformer layer: self attention, (decoder) cross attention, MLP, each with dropout and a residual.

  Pre-LN (default): ``x + Attn(LN(x))``, then ``x + MLP(LN(x))``, the norms fused into the FP8 GEMMs after them.
  Post-LN (``output_layernorm=True``, the original Transformer and BERT): ``LN(x + Attn(x))``, ``LN(x + MLP(x))``.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4)
  >>> x = jnp.ones((2, 8, 64), jnp.bfloat16)
  >>> y, variables = layer.init_with_output(jax.random.key(0), x, deterministic=True)
  >>> y.shape, sorted(variables["params"])
  ((2, 8, 64), ['mlp', 'self_attention'])

  Attributes:
    hidden_size, intermediate_dim, num_attention_heads: the sizes (hidden_size is the inputs' last dim,
      intermediate_dim the MLP's); head_dim defaults to hidden / heads.
    num_gqa_groups: key/value heads (GQA).
    layer_type: "encoder" (self attention, default mask "padding") or "decoder" (causal self attention, and cross
      attention over ``encoded`` when it is given).
    self_attn_mask_type: overrides the layer type's default self-attention mask type.
    self_attn_bias_type: None, "no_bias", "post_scale_bias", "alibi"; enable_relative_embedding: add T5 relative
      position biases (RelativePositionBiases with ``relative_embedding_buckets`` / ``_max_distance``) as that bias.
    norm_type, epsilon, zero_centered_gamma: the norms'.
    hidden_dropout, attention_dropout, intermediate_dropout: dropout after attention and MLP (before the residual
      add), on the attention probabilities, and on the MLP's activation output.
    activation_type: the MLP's, e.g. ("gelu",), ("silu", "linear") for SwiGLU.
    use_bias: biases on every projection.
    apply_residual_connection_post_layernorm: each block's residual is its normalized input instead of its input
      (Megatron's option; self attention, cross attention and MLP alike), pre-LN only.
    output_layernorm: post-LN.
    enable_rotary_pos_emb, rotary_base, rotary_percent, rotary_interleaved: RoPE in self attention.
    window_size: sliding window of self attention.
    transpose_batch_sequence: inputs and outputs are (S, B, hidden).
    deterministic: no dropout; or give it to the call (one of the two, as in Flax; needed when there is dropout).
    dtype, param_dtype, backend, logical_axes, fp8_dpa, mask_convention: as in MultiHeadAttention; kernel_init:
      every kernel's initializer (each of q, k and v initialized as a kernel of its own).
    context_parallel, cp_strategy, cp_load_balanced, mesh: context parallelism of the self attention, as in
      MultiHeadAttention (with ``cp_load_balanced`` and RoPE, pass ``positions``).
    recipe: an FP8 recipe for every GEMM of the layer (and, with ``fp8_dpa=None``, its attention's FP8 choice),
      overriding autocast's: e.g. ``Float8CurrentScaling()`` keeps no FP8 state under an autocast with
      ``DelayedScaling``, and ``DelayedScaling()`` makes the layer keep one outside any autocast.
  """

  hidden_size: int = 512
  intermediate_dim: int = 2048
  num_attention_heads: int = 8
  head_dim: int | None = None
  num_gqa_groups: int | None = None
  layer_type: str = "encoder"
  self_attn_mask_type: str | None = None
  self_attn_bias_type: str | None = None
  enable_relative_embedding: bool = False
  relative_embedding_buckets: int = 32
  relative_embedding_max_distance: int = 128
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  hidden_dropout: float = 0.0
  attention_dropout: float = 0.0
  intermediate_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  activation_type: Sequence[str] = ("gelu",)
  use_bias: bool = False
  apply_residual_connection_post_layernorm: bool = False
  output_layernorm: bool = False
  enable_rotary_pos_emb: bool = False
  rotary_base: float = 10000.0
  rotary_percent: float = 1.0
  rotary_interleaved: bool = False
  window_size: tuple[int, int] | None = None
  transpose_batch_sequence: bool = False
  kernel_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  backend: str = "auto"
  logical_axes: bool = False
  fp8_dpa: bool | None = None
  mask_convention: str = "flax"
  context_parallel: str | None = None
  cp_strategy: str = "all_gather"
  cp_load_balanced: bool = True
  mesh: Any = None
  recipe: Recipe | None = None

  def _check(self):
    if self.layer_type not in LAYER_TYPES:
      raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {self.layer_type!r}")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                       f"{self.num_attention_heads}: give head_dim")
    if self.apply_residual_connection_post_layernorm and self.output_layernorm:
      raise ValueError("apply_residual_connection_post_layernorm is a pre-LN option; output_layernorm=True is post-LN")

  def _mha(self, name: str, mask_type: str, bias_type, rope: bool, **kw) -> MultiHeadAttention:
    return MultiHeadAttention(
        head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
        num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
        attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
        input_layernorm=not self.output_layernorm, norm_type=self.norm_type,
        epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
        attn_mask_type=mask_type, attn_bias_type=bias_type, enable_rotary_pos_emb=rope,
        rotary_base=self.rotary_base, rotary_percent=self.rotary_percent, rotary_interleaved=self.rotary_interleaved,
        use_bias=self.use_bias, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype,
        backend=self.backend, logical_axes=self.logical_axes, fp8_dpa=self.fp8_dpa,
        mask_convention=self.mask_convention, recipe=self.recipe, name=name, **kw)

  def _axes(self, *names: str | None) -> tuple[str | None, ...]:
    return axes(self.logical_axes, *names)

  def _dropout_add(self, y, residual, deterministic: bool):
    y = nn.Dropout(self.hidden_dropout, rng_collection=self.dropout_rng_name)(y, deterministic=deterministic)
    return self._residual_stream(y.astype(residual.dtype) + residual)

  def _residual_block(self, block, residual, deterministic: bool):
    """``residual + dropout(block(None))``; with no dropout to apply and the residual stream in the compute dtype,
    ``block(residual)`` instead: the block adds it in its last GEMM's epilogue (no pass of its own). With
    ``apply_residual_connection_post_layernorm``, ``block(None)`` returns its normalized input too, which is the
    residual then."""
    if self.apply_residual_connection_post_layernorm:
      y, normalized = block(None)
      return self._dropout_add(y, normalized, deterministic)
    compute_dtype = jnp.dtype(self.dtype or jnp.result_type(residual.dtype, self.param_dtype))
    if (self.hidden_dropout == 0.0 or deterministic) and jnp.dtype(residual.dtype) == compute_dtype:
      return self._residual_stream(block(residual))
    return self._dropout_add(block(None), residual, deterministic)

  def _residual_stream(self, x):
    """With ``logical_axes``, pins the residual stream's sharding to the logical (batch, seq, hidden) names (a no-op
    outside ``nn.logical_axis_rules``)."""
    if not self.logical_axes:
      return x
    names = (SEQ, BATCH, ACT_EMBED) if self.transpose_batch_sequence else (BATCH, SEQ, ACT_EMBED)
    return nn.with_logical_constraint(x, names)

  def _post_ln(self, name: str, x):
    return LayerNorm(norm_type=self.norm_type, epsilon=self.epsilon,
                     zero_centered_gamma=self.zero_centered_gamma, scale_axes=self._axes(EMBED),
                     bias_axes=self._axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype, name=name)(x)

  def _plain_mlp(self, x, deterministic: bool):
    names = tuple(self.activation_type)
    n_act = 2 if len(names) == 2 else 1
    dense = functools.partial(DenseGeneral, use_bias=self.use_bias, kernel_init=self.kernel_init, dtype=self.dtype,
                              param_dtype=self.param_dtype, recipe=self.recipe)
    h = dense(features=(n_act, self.intermediate_dim), kernel_axes=self._axes(EMBED, ACT, MLP),
              bias_axes=self._axes(ACT, MLP), name="wi")(x)
    a = activation(h if n_act == 2 else h[..., 0, :], names)
    a = nn.Dropout(self.intermediate_dropout, rng_collection=self.dropout_rng_name)(a, deterministic=deterministic)
    return dense(features=x.shape[-1], kernel_axes=self._axes(MLP, EMBED), bias_axes=self._axes(EMBED), name="wo")(a)

  @nn.compact
  def __call__(self, inputs: jax.Array, encoded: jax.Array | None = None, attention_mask: jax.Array | None = None,
               encoder_decoder_mask: jax.Array | None = None, *, segment_ids=None,
               positions: jax.Array | None = None, deterministic: bool | None = None,
               decode: bool = False) -> jax.Array:
    """The layer's output, shaped as ``inputs``.

    Args:
      inputs: (B, S, hidden), or (S, B, hidden) with ``transpose_batch_sequence``.
      encoded: the encoder output a decoder attends to (cross attention); None for none.
      attention_mask: self attention's padding / arbitrary mask, True (nonzero) = attend (``mask_convention``).
      encoder_decoder_mask: cross attention's mask, True (nonzero) = attend (``mask_convention``).
      segment_ids: packed-sequence ids for self attention.
      positions: RoPE positions.
      deterministic: no dropout (here or as the module's attribute; needed when there is dropout).
      decode: use and update the self-attention KV cache (as long as the input it was initialized with; steps past
        its end give NaN outputs).
    """
    self._check()
    deterministic = resolve_deterministic(self, deterministic, hidden_dropout=self.hidden_dropout,
                                          attention_dropout=self.attention_dropout,
                                          intermediate_dropout=self.intermediate_dropout)
    if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
      raise ValueError(f"inputs must be 3-D with last dim hidden_size={self.hidden_size}, got shape {inputs.shape}")
    if encoded is not None and self.layer_type != "decoder":
      raise ValueError("encoded (cross attention) is given, but layer_type is 'encoder'")
    mask_type = self.self_attn_mask_type or ("causal" if self.layer_type == "decoder" else "padding")
    if mask_type in ("padding", "padding_causal") and attention_mask is None and segment_ids is None:
      mask_type = "no_mask" if mask_type == "padding" else "causal"
    x = self._residual_stream(inputs)
    bias, bias_type = None, self.self_attn_bias_type
    seq_axis = 0 if self.transpose_batch_sequence else 1
    if self.enable_relative_embedding:
      length = x.shape[seq_axis]
      relpos = RelativePositionBiases(self.relative_embedding_buckets, self.relative_embedding_max_distance,
                                      self.num_attention_heads, embedding_axes=self._axes(HEADS, None),
                                      dtype=jnp.float32, name="relpos_bias")
      cache = self.variables.get("cache", {}).get("self_attention") if decode else None
      if cache is None:  # no KV cache yet (or none used): queries and keys are this input's positions
        bias = relpos(length, length, bidirectional=self.layer_type == "encoder")
      else:  # decoding: these queries sit at the cache index, over every key the cache holds
        bias = relpos(length, cache["cached_key"].shape[1], bidirectional=self.layer_type == "encoder",
                      q_offset=cache["cache_index"])
      bias_type = "post_scale_bias"

    post_residual = self.apply_residual_connection_post_layernorm
    attn = self._mha("self_attention", mask_type, bias_type, self.enable_rotary_pos_emb,
                     return_layernorm_output=post_residual, window_size=self.window_size,
                     transpose_batch_sequence=self.transpose_batch_sequence, context_parallel=self.context_parallel,
                     cp_strategy=self.cp_strategy, cp_load_balanced=self.cp_load_balanced, mesh=self.mesh)
    attn_args = dict(segment_ids=segment_ids, positions=positions, decode=decode, deterministic=deterministic)
    x = self._residual_block(lambda r: attn(x, None, attention_mask, bias, residual=r, **attn_args), x, deterministic)
    if self.output_layernorm:
      x = self._post_ln("self_attention_layernorm", x)

    if encoded is not None:
      cross_type = "padding" if encoder_decoder_mask is not None else "no_mask"
      cross = self._mha("encoder_decoder_attention", cross_type, None, False, return_layernorm_output=post_residual,
                        transpose_batch_sequence=self.transpose_batch_sequence)
      x = self._residual_block(
          lambda r: cross(x, encoded, encoder_decoder_mask, deterministic=deterministic, residual=r), x, deterministic)
      if self.output_layernorm:
        x = self._post_ln("encoder_decoder_attention_layernorm", x)

    if self.output_layernorm:  # post-LN: the input is normalized already; the MLP is fc1, activation, fc2
      x = self._dropout_add(self._plain_mlp(x, deterministic), x, deterministic)
    else:
      mlp = LayerNormMLP(intermediate_dim=self.intermediate_dim, activation_type=tuple(self.activation_type),
                         intermediate_dropout=self.intermediate_dropout, dropout_rng_name=self.dropout_rng_name,
                         use_bias=self.use_bias, return_layernorm_output=post_residual,
                         norm_type=self.norm_type, epsilon=self.epsilon,
                         zero_centered_gamma=self.zero_centered_gamma, kernel_init=self.kernel_init,
                         logical_axes=self.logical_axes, transpose_batch_sequence=self.transpose_batch_sequence,
                         dtype=self.dtype, param_dtype=self.param_dtype, recipe=self.recipe, name="mlp")
      x = self._residual_block(lambda r: mlp(x, deterministic=deterministic, residual=r), x, deterministic)
    if self.output_layernorm:
      x = self._post_ln("mlp_layernorm", x)
    return x
