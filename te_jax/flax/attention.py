"""Flax linen attention: ``DotProductAttention`` (``te_jax.dot_product_attention`` as a layer, no parameters),
``MultiHeadAttention`` (norm, fused QKV projection, RoPE, attention, output projection) and T5's
``RelativePositionBiases``.

They compose the fused layers: the QKV projection is a ``LayerNormDenseGeneral`` (the input norm writes the FP8
GEMM input directly), attention is ``te_jax.dot_product_attention`` (cuDNN flash attention where it supports the
configuration), RoPE is ``te_jax.apply_rope`` (one fused kernel), and the MLP is ``LayerNormMLP``. Under
``te_jax.autocast`` every GEMM is FP8 and its scaling state lives in the ``te_jax.FP8_COLLECTION`` collection, as in
the other modules.

Conventions: masks are Flax's, **True (or nonzero) where attention is allowed** (``nn.make_attention_mask`` and
``nn.make_causal_mask`` make them), unless a module's ``mask_convention="te"`` asks for NVIDIA Transformer Engine's
(True = masked out); tensors are ``(batch, sequence, hidden)`` unless ``transpose_batch_sequence`` makes them
``(sequence, batch, hidden)``. Dropout draws from the ``dropout_rng_name`` rng stream unless ``deterministic``.

KV cache (decoding): ``decode=True`` keeps the keys and values of past steps in the ``"cache"`` collection
(``cached_key``, ``cached_value``: ``(batch, max_length, kv_heads, head_dim)``, and ``cache_index``). Initialise it
by calling ``init`` with ``decode=True`` on an input of the full length (the cache takes its shape); then each call
appends its tokens at ``cache_index`` and attends over the filled part of the cache, as Flax's own attention does.
The index is a traced value, so appending past the cache's length cannot raise inside ``jit``: as in Flax,
``lax.dynamic_update_slice`` then clamps the write position. Keep the tokens decoded within ``max_length``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.flax.params import resolve_deterministic
from te_jax.flax.scope import LinenKVCache, LinenScope, builds, options_of
from te_jax.fused.attention import AttentionBackend
from te_jax.modules.attention import (DotProductAttentionOptions, MultiHeadAttentionOptions,
                                      RelativePositionBiasesOptions, attention_backend_for,
                                      dot_product_attention_block, multi_head_attention, relative_position_biases)
from te_jax.modules.axes import Initializer
from te_jax.modules.relative_position import relative_position_bucket
from te_jax.recipe import Recipe

__all__ = ["DotProductAttention", "MultiHeadAttention", "RelativePositionBiases"]


@builds(DotProductAttentionOptions)
class DotProductAttention(nn.Module):
  """Scaled dot-product attention over already-projected q, k, v (see ``te_jax.dot_product_attention``).

  Masks follow Flax: **True (or nonzero) = attend**, unless ``mask_convention="te"``. Dropout draws from the
  ``dropout_rng_name`` rng stream unless ``deterministic``. The backend is cuDNN flash attention where it supports
  the configuration on this machine, else plain jnp (``backend_for`` says which, and why). The compute dtype is
  ``dtype``, else the query's.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> attn = te_flax.DotProductAttention(head_dim=32, num_attention_heads=4, num_gqa_groups=2)
  >>> q = jnp.ones((2, 16, 4, 32), jnp.bfloat16)
  >>> kv = jnp.ones((2, 16, 2, 32), jnp.bfloat16)
  >>> out, variables = attn.init_with_output(jax.random.key(0), q, kv, kv, deterministic=True)
  >>> out.shape, out.dtype, variables
  ((2, 16, 4, 32), dtype(bfloat16), {})

  Attributes:
    head_dim: D, the size of each head (checked against the inputs).
    num_attention_heads: H, the query heads.
    num_gqa_groups: the key/value heads (GQA; 1 is MQA); None means H.
    attn_mask_type: one of ``te_jax.fused.attention.ATTN_MASK_TYPES`` (default "causal").
    attn_bias_type: None (from the ``bias`` argument), "no_bias", "pre_scale_bias" (the bias added before the
      logits' scale), "post_scale_bias" (after it) or "alibi".
    attention_dropout: the dropout rate on the attention probabilities.
    dropout_rng_name: the rng stream of the dropout mask.
    qkv_layout: "BSHD", "BS3HD" or "BSHD_BS2HD" (or their "SB" forms); with ``transpose_batch_sequence`` the "BS"
      forms mean sequence-first tensors.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    window_size: a sliding window (left, right), -1 = unbounded (with a causal mask type the causal mask bounds the
      right side).
    softmax_type: "vanilla" (default); "off_by_one", one more logit of 0 in each softmax denominator; "learnable",
      a learned sink logit per head there, the parameter ``softmax_offset`` (1, H, 1, 1), float32, zeros at first
      (Transformer Engine's). Both run unfused (cuDNN has no sink).
    transpose_batch_sequence: inputs and output are (S, B, H, D).
    deterministic: no dropout; or give it to the call (one of the two, as in Flax; needed when there is dropout).
    dtype: the compute dtype (q, k, v are cast to it); None keeps the query's.
    backend: "auto", "fused" or "unfused".
    fp8_dpa: the forward pass in FP8 through cuDNN (``te_jax.attention_backend`` says where it runs); None
      (default): as the autocast recipe's ``fp8_dpa`` asks, where this configuration allows it.
    mask_convention: what the call's ``mask`` means: "flax" (default), True or nonzero = attend; "te" (NVIDIA
      Transformer Engine's), True or nonzero = masked out.
    context_parallel: the mesh axis the sequence is sharded over, for context parallelism
      (``te_jax.context_parallel_attention``); None (default): none. The mesh is ``mesh``, else the one set by
      ``jax.set_mesh``; the batch and heads axes come from Flax's logical axis rules in context (``"batch"``,
      ``"heads"``), else the batch is taken as sharded over every other mesh axis. Masks: "no_mask", "causal", and
      the padding as ``segment_ids``; no bias, window, dropout or FP8 attention.
    cp_strategy: "all_gather" (default) or "ring".
    cp_load_balanced: the sequence is in zig-zag order (``te_jax.to_zigzag``), which balances causal attention's
      work over the devices (default True).
    mesh: the mesh of ``context_parallel``; None: the one in context.
    recipe: an FP8 recipe for this layer, overriding autocast's: with ``fp8_dpa=None``, its ``fp8_dpa`` decides FP8
      attention.
  """

  head_dim: int
  num_attention_heads: int
  num_gqa_groups: int | None = None
  attn_mask_type: str = "causal"
  attn_bias_type: str | None = None
  attention_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  qkv_layout: str = "BSHD"
  scale_factor: float | None = None
  window_size: tuple[int, int] | None = None
  softmax_type: str = "vanilla"
  transpose_batch_sequence: bool = False
  deterministic: bool | None = None
  dtype: Any = None
  backend: str = "auto"
  fp8_dpa: bool | None = None
  mask_convention: str = "flax"
  context_parallel: str | None = None
  cp_strategy: str = "all_gather"
  cp_load_balanced: bool = True
  mesh: Any = None
  recipe: Recipe | None = None

  def backend_for(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
                  deterministic: bool | None = None, segment_pos=None) -> AttentionBackend:
    """Which backend ``__call__`` with these arguments runs on, and why (arrays or ``jax.ShapeDtypeStruct``)."""
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    return attention_backend_for(options_of(self, DotProductAttentionOptions), query, key, value, mask, bias,
                                 segment_ids=segment_ids, deterministic=deterministic, segment_pos=segment_pos)

  @nn.compact
  def __call__(self, query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
               mask: jax.Array | None = None, bias: jax.Array | None = None, *, segment_ids=None,
               deterministic: bool | None = None, attn_mask_type: str | None = None,
               attn_bias_type: str | None = None, window_size: tuple[int, int] | None = None,
               segment_pos=None) -> jax.Array:
    """Attention of ``query`` over ``key``/``value`` (None where the layout packs them into another argument).

    Args:
      query, key, value: in ``qkv_layout`` (sequence-first with ``transpose_batch_sequence``).
      mask: bool, int or float, True (nonzero) = attend (``mask_convention``), broadcastable to (B, H, T, S): the
        padding or the "arbitrary" mask; or a ``te_jax.SequenceDescriptor`` (Transformer Engine's
        ``sequence_descriptor``, in the same place), the padding as sequence lengths (and offsets) or segment ids and
        positions.
      bias: the bias of ``attn_bias_type`` (by default post-scale), broadcastable to (B, H, T, S).
      segment_ids: (B, S) or (q_ids, kv_ids) packed-sequence ids, 0 = padding; or a ``te_jax.SequenceDescriptor``.
      segment_pos: with ``segment_ids``, each token's position within its segment, (B, S) or (q_pos, kv_pos): the
        causal mask and the window compare them (packed cross attention; see ``te_jax.dot_product_attention``).
      deterministic: no dropout.
      attn_mask_type, attn_bias_type, window_size: this call's, in place of the module's (None: the module's;
        ``window_size`` (-1, -1): none).

    Returns:
      The attention output, shaped as ``query`` (heads and head dim of value).
    """
    options = options_of(self, DotProductAttentionOptions)
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    return dot_product_attention_block(LinenScope(self), options, query, key, value, mask, bias,
                                       segment_ids=segment_ids,
                                       deterministic=deterministic, attn_mask_type=attn_mask_type,
                                       attn_bias_type=attn_bias_type, window_size=window_size,
                                       segment_pos=segment_pos)


@builds(RelativePositionBiasesOptions)
class RelativePositionBiases(nn.Module):
  """T5's relative position biases: a learned scalar per head and log-spaced distance bucket (Raffel et al., 2020).

  >>> import jax, te_jax.flax as te_flax
  >>> rpb = te_flax.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=4)
  >>> bias, variables = rpb.init_with_output(jax.random.key(0), 8, 8)
  >>> bias.shape, variables["params"]["rel_embedding"].shape
  ((1, 4, 8, 8), (4, 32))

  Attributes:
    num_buckets: buckets; half are exact distances (0 .. num_buckets/4 - 1 when bidirectional), the rest log-spaced.
    max_distance: distances at or beyond it share the last bucket.
    num_attention_heads: heads (one bias table each).
    embedding_init: initializer of the (heads, buckets) table.
    embedding_axes: logical axis names of the table.
    dtype: dtype of the returned bias.
  """

  num_buckets: int
  max_distance: int
  num_attention_heads: int
  embedding_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")
  embedding_axes: tuple[str | None, ...] = ()
  dtype: Any = jnp.float32

  @staticmethod
  def bucket(relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """The bucket of each ``key_position - query_position`` (numpy; static shapes only): T5's scheme, see
    ``te_jax.modules.relative_position.relative_position_bucket``."""
    return relative_position_bucket(relative_position, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)

  @nn.compact
  def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True,
               q_offset: jax.Array | int | None = None) -> jax.Array:
    """The bias ``(1, heads, q_seqlen, k_seqlen)`` to add to the attention logits (a post-scale bias).

    ``q_offset`` (may be traced, in ``[0, k_seqlen - q_seqlen]``): the queries are at positions ``q_offset + t``, as
    when decoding with a KV cache of ``k_seqlen`` keys; default 0.
    """
    return relative_position_biases(LinenScope(self), options_of(self, RelativePositionBiasesOptions), q_seqlen,
                                    k_seqlen, bidirectional, q_offset)


@builds(MultiHeadAttentionOptions)
class MultiHeadAttention(nn.Module):
  """Multi-head attention: (LayerNorm ->) fused QKV projection -> RoPE -> attention -> output projection.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> mha = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=4, num_gqa_groups=2, input_layernorm=True)
  >>> x = jnp.ones((2, 8, 64), jnp.bfloat16)
  >>> y, variables = mha.init_with_output(jax.random.key(0), x, x, deterministic=True)
  >>> y.shape, sorted((name, p["kernel"].shape) for name, p in variables["params"].items())
  ((2, 8, 64), [('kv', (64, 2, 2, 16)), ('out', (4, 16, 64)), ('query', (64, 4, 16))])

  Attributes:
    head_dim, num_attention_heads: D and H.
    num_gqa_groups: key/value heads (GQA; 1 is MQA); None means H.
    attention_dropout: dropout on the attention probabilities.
    dropout_rng_name: the rng stream of every dropout mask.
    input_layernorm: normalize the query input first (pre-LN), fused into the projection's FP8 cast.
    norm_type, epsilon, zero_centered_gamma: that norm's.
    return_layernorm_output: also return the normalized input (the residual of
      ``apply_residual_connection_post_layernorm``).
    attn_mask_type: one of ``te_jax.fused.attention.ATTN_MASK_TYPES``; attn_bias_type: None, "no_bias",
      "pre_scale_bias", "post_scale_bias" or "alibi".
    enable_rotary_pos_emb: rotate queries and keys (RoPE); rotary_base: its wavelength base; rotary_percent: the
      fraction of each head's features that rotate; rotary_interleaved: GPT-J pairs (2i, 2i+1) instead of the
      half-split pairs (i, i + R/2) of GPT-NeoX and Llama. In cross attention the queries rotate at their positions
      and the keys at ``arange(S)`` of their own sequence; with the call's ``segment_pos`` (or a
      ``te_jax.SequenceDescriptor`` of packed sequences) each token at its position within its segment.
    fuse_qkv_params: one QKV kernel (self attention), else separate query / key / value kernels.
    use_bias: biases on the projections.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    scale_attn_logits: False leaves the logits unscaled (``q . k``, Transformer Engine's default, which scales the
      query kernel's initialization instead); not with a ``scale_factor``.
    window_size: a sliding window (left, right), -1 = unbounded.
    softmax_type: "vanilla", "off_by_one" or "learnable" (see ``DotProductAttention``; the learnable sink logits are
      ``attention/softmax_offset``).
    transpose_batch_sequence: inputs and outputs are (S, B, hidden).
    kernel_init, bias_init: the projections' initializers; a fused kernel's q, k and v (or k and v) parts are each
      initialized as a kernel of its own (one projection's fan, as Flax's separate query, key and value kernels).
    logical_axes: name the parameters' axes with the logical names of ``te_jax.flax.LOGICAL_AXES`` (map them to
      mesh axes with ``flax.linen.logical_axis_rules`` for tensor parallelism: heads and mlp sharded, embed
      replicated); in TransformerLayer also the residual stream's (batch, seq, act_embed).
    deterministic: no dropout; or give it to the call (one of the two, as in Flax; needed when there is dropout).
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``, as in Flax).
    param_dtype, backend: the parameters' dtype; the attention backend ("auto", "fused", "unfused").
    fp8_dpa: the attention forward in FP8 (cuDNN); None (default): as the recipe's ``fp8_dpa`` asks (``recipe``,
      else autocast's), where the configuration allows it.
    mask_convention: what the call's ``mask`` means: "flax" (default), True or nonzero = attend; "te" (NVIDIA
      Transformer Engine's), True or nonzero = masked out.
    context_parallel, cp_strategy, cp_load_balanced, mesh: context parallelism of the attention (see
      ``DotProductAttention``; no KV cache; for cross attention both inputs are sequence-sharded). With
      ``cp_load_balanced`` the sequence is in zig-zag order, so RoPE needs the call's ``positions``
      (``te_jax.zigzag_order(S, cp)``): the default ``arange`` would be wrong, and raises.
    recipe: an FP8 recipe for this layer, overriding autocast's: every projection's GEMM (and with ``fp8_dpa=None``
      the choice of FP8 attention) follows it; a recipe without state (``Float8CurrentScaling``) keeps no FP8 state
      even under an autocast with ``DelayedScaling``.
  """

  head_dim: int
  num_attention_heads: int
  num_gqa_groups: int | None = None
  attention_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  input_layernorm: bool = True
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  return_layernorm_output: bool = False
  attn_mask_type: str = "causal"
  attn_bias_type: str | None = None
  enable_rotary_pos_emb: bool = False
  rotary_base: float = 10000.0
  rotary_percent: float = 1.0
  rotary_interleaved: bool = False
  fuse_qkv_params: bool = True
  use_bias: bool = False
  scale_factor: float | None = None
  scale_attn_logits: bool = True
  window_size: tuple[int, int] | None = None
  softmax_type: str = "vanilla"
  transpose_batch_sequence: bool = False
  kernel_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
  bias_init: Initializer = nn.initializers.zeros_init()
  logical_axes: bool = False
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  backend: str = "auto"
  fp8_dpa: bool | None = None
  mask_convention: str = "flax"
  context_parallel: str | None = None
  cp_strategy: str = "all_gather"
  cp_load_balanced: bool = True
  mesh: Any = None
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               decode: bool = False, deterministic: bool | None = None, residual: jax.Array | None = None,
               attn_mask_type: str | None = None, segment_pos=None):
    """Attention of ``inputs_q`` over ``inputs_kv`` (self attention when it is None or the same array).

    Args:
      inputs_q: (B, T, hidden), or (T, B, hidden) with ``transpose_batch_sequence``.
      inputs_kv: (B, S, hidden) for cross attention; None (or ``inputs_q``) for self attention.
      mask: bool, int or float, True (nonzero) = attend (``mask_convention``), broadcastable to (B, H, T, S): the
        padding of a padding mask type or the "arbitrary" mask (``nn.make_attention_mask`` makes one); or a
        ``te_jax.SequenceDescriptor``.
      bias: the bias of ``attn_bias_type`` (by default post-scale), broadcastable to (B, H, T, S).
      segment_ids: packed-sequence ids (B, S) or (q_ids, kv_ids), 0 = padding; or a ``te_jax.SequenceDescriptor``.
      positions: RoPE positions, (T,) or (B, T); default ``arange(T)`` (from the cache index when decoding).
      segment_pos: with ``segment_ids``, each token's position within its segment, (B, T) for self attention or
        (q_pos (B, T), kv_pos (B, S)) (a ``SequenceDescriptor`` of packed sequences carries them): RoPE rotates the
        queries and keys at these positions, and the causal mask and the window compare them; not with
        ``positions``.
      decode: use and update the KV cache (self attention only), which holds as many positions as the input it was
        initialized with; steps past its end give NaN outputs.
      deterministic: no dropout.
      residual: added to the output (``inputs_q``' shape and layout), in the output projection's GEMM epilogue;
        when it is ``inputs_q`` itself and the input is normalized here (a pre-LN block), its gradient is added inside
        the norm's backward kernel.
      attn_mask_type: this call's mask type, in place of the module's (None: the module's).

    Returns:
      The output (same layout as ``inputs_q``), and with ``return_layernorm_output`` also the normalized input.
    """
    options = options_of(self, MultiHeadAttentionOptions)
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    return multi_head_attention(LinenScope(self), options, inputs_q, inputs_kv, mask, bias, segment_ids=segment_ids,
                                positions=positions, decode=decode, deterministic=deterministic, residual=residual,
                                attn_mask_type=attn_mask_type, cache=LinenKVCache(self) if decode else None,
                                segment_pos=segment_pos)
