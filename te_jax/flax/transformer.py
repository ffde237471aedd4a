"""Flax linen ``TransformerLayer``: self attention, (decoder) cross attention and an MLP, each with dropout and a
residual connection, pre-LN (norms fused into the FP8 GEMMs after them) or post-LN.

Conventions: masks are Flax's, **True (or nonzero) where attention is allowed** (``nn.make_attention_mask``), unless
``mask_convention="te"`` asks for NVIDIA Transformer Engine's (True = masked out); tensors are
``(batch, sequence, hidden)`` unless ``transpose_batch_sequence`` makes them ``(sequence, batch, hidden)``. Dropout
draws from the ``dropout_rng_name`` rng stream unless ``deterministic``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.params import resolve_deterministic
from te_jax.flax.scope import LinenKVCache, LinenScope, options_of
from te_jax.flax.te_names import te_names
from te_jax.modules.axes import Initializer
from te_jax.modules.transformer import TransformerLayerOptions, transformer_layer
from te_jax.recipe import Recipe

__all__ = ["TransformerLayer"]


@te_names
class TransformerLayer(nn.Module):
  """One Transformer layer: self attention, (decoder) cross attention, MLP, each with dropout and a residual.

  Pre-LN (default): ``x + Attn(LN(x))``, then ``x + MLP(LN(x))``, the norms fused into the FP8 GEMMs after them.
  Post-LN (``post_layernorm=True``, the original Transformer and BERT): ``LN(x + Attn(x))``, ``LN(x + MLP(x))``.
  ``output_layernorm=True`` (Transformer Engine's option of that name): pre-LN with the self attention's input norm
  moved to the output, ``y = x + Attn(x)``, ``LN_out(y + MLP(LN(y)))`` (a decoder's cross attention keeps its input
  norm), the norm's parameters under ``output_layernorm``.

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
    hidden_dropout_dims: the dims of the (3-D) stream along which ``hidden_dropout``'s mask is shared (Flax's
      ``broadcast_dims``), e.g. ``(1,)`` for one mask per example and feature across the sequence.
    intermediate_dropout_dims: the same for ``intermediate_dropout``, dims of the (3-D) MLP activation (the
      stream's dims, the hidden one the intermediate one), as Transformer Engine's option of that name.
    drop_path: stochastic depth (Huang et al., 2016) on the self attention's and the MLP's residual branches, as in
      Transformer Engine: each example's branch dropped with this rate, the kept ones scaled by 1 / (1 - rate);
      none when ``deterministic``.
    activation_type: the MLP's, e.g. ("gelu",), ("silu", "linear") for SwiGLU.
    activation_params: the MLP's activation parameters (Transformer Engine's ``mlp_activation_params``), as
      LayerNormMLP's ``activation_params``: the clamped SwiGLU's ``limit``, ``alpha``, ``glu_linear_offset``.
    use_bias: biases on every projection.
    apply_residual_connection_post_layernorm: each block's residual is its normalized input instead of its input
      (Megatron's option; self attention, cross attention and MLP alike), pre-LN only.
    post_layernorm: post-LN, a norm after each residual add (te_jax's ``output_layernorm`` before it took
      Transformer Engine's meaning).
    output_layernorm: Transformer Engine's: no norm before the self attention, one on the layer's output (above);
      not with ``post_layernorm`` or ``apply_residual_connection_post_layernorm``.
    scale_attn_logits: False leaves both attentions' logits unscaled (``q . k``; Transformer Engine's default).
    softmax_type: both attentions' softmax, "vanilla", "off_by_one" or "learnable" (see DotProductAttention).
    enable_rotary_pos_emb, rotary_base, rotary_percent, rotary_interleaved: RoPE in self attention, and in a
      decoder's cross attention (queries at their positions, keys at the encoder output's), as in Transformer Engine.
    fuse_qkv_params: as in Transformer Engine: the self attention's one ``qkv`` kernel (``query`` and ``kv`` with
      GQA, and in a decoder's cross attention); False, separate ``query``, ``key`` and ``value`` kernels in both
      attentions (the same math: the unfused kernels are the fused one's slices).
    window_size: sliding window of self attention and of a decoder's cross attention.
    transpose_batch_sequence: inputs and outputs are (S, B, hidden).
    deterministic: no dropout; or give it to the call (one of the two, as in Flax; needed when there is dropout).
    dtype, param_dtype, backend, logical_axes, fp8_dpa, mask_convention: as in MultiHeadAttention; kernel_init:
      every kernel's initializer (each of q, k and v initialized as a kernel of its own).

  The MLP's fc1 and fc2 outputs are named ``"ffn1"`` and ``"ffn2"`` for ``jax.checkpoint`` policies (Transformer
  Engine's names; LayerNormMLP's ``ffn1_ckpt_name`` / ``ffn2_ckpt_name``), the FP8 tensors saved for the backward
  pass ``te_jax.FP8_RESIDUAL``.
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
  hidden_dropout_dims: Sequence[int] = ()
  drop_path: float = 0.0
  attention_dropout: float = 0.0
  intermediate_dropout: float = 0.0
  intermediate_dropout_dims: Sequence[int] = ()
  dropout_rng_name: str = "dropout"
  activation_type: Sequence[str] = ("gelu",)
  activation_params: Mapping[str, float] | None = None
  use_bias: bool = False
  apply_residual_connection_post_layernorm: bool = False
  post_layernorm: bool = False
  output_layernorm: bool = False
  scale_attn_logits: bool = True
  softmax_type: str = "vanilla"
  enable_rotary_pos_emb: bool = False
  rotary_base: float = 10000.0
  rotary_percent: float = 1.0
  rotary_interleaved: bool = False
  fuse_qkv_params: bool = True
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
    options = options_of(self, TransformerLayerOptions)
    deterministic = resolve_deterministic(self, deterministic, hidden_dropout=self.hidden_dropout,
                                          drop_path=self.drop_path,
                                          attention_dropout=self.attention_dropout,
                                          intermediate_dropout=self.intermediate_dropout)
    return transformer_layer(LinenScope(self), options, inputs, encoded, attention_mask, encoder_decoder_mask,
                             segment_ids=segment_ids, positions=positions, deterministic=deterministic, decode=decode,
                             cache=LinenKVCache(self, "self_attention") if decode else None)
