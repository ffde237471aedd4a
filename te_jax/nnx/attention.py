"""NNX attention: ``DotProductAttention`` (``te_jax.dot_product_attention`` as a module, no parameters),
``MultiHeadAttention`` (norm, fused QKV projection, RoPE, attention, output projection) and T5's
``RelativePositionBiases``, composed as ``te_jax.flax``'s are, from the same fused ops and ``te_jax.modules``
bodies. Masks follow Flax: **True (or nonzero) = attend**, unless a module's ``mask_convention="te"`` asks for NVIDIA
Transformer Engine's (True = masked out); tensors are ``(batch, sequence, hidden)`` unless
``transpose_batch_sequence``.

KV cache (decoding), as Flax NNX's ``nnx.MultiHeadAttention`` has it: ``decode=True`` (the constructor's, or the
call's, which takes precedence) keeps the keys and values of past steps in ``nnx.Cache`` variables ``cached_key``,
``cached_value`` (``(batch, max_length, kv_heads, head_dim)``) and ``cache_index``, which ``init_cache(input_shape)``
creates (``input_shape``: the inputs' shape at the full length); each call then appends its tokens at the index and
attends over the filled part, with linen's arithmetic (``te_jax.modules.attention_cache``): the same outputs as
te_jax.flax.MultiHeadAttention's ``decode``, steps past the cache's end NaN."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.fused.attention import AttentionBackend
from te_jax.fused.context_parallel import check_layer_options
from te_jax.modules.attention import (DotProductAttentionOptions, MultiHeadAttentionOptions,
                                      RelativePositionBiasesOptions, attention_backend_for,
                                      dot_product_attention_block, dot_product_attention_params, multi_head_attention,
                                      multi_head_attention_params, relative_position_biases)
from te_jax.modules.attention_cache import kv_cache_shape
from te_jax.modules.axes import Initializer
from te_jax.modules.relative_position import relative_position_bucket
from te_jax.modules.scope import fields_of
from te_jax.nnx.params import resolve_deterministic
from te_jax.nnx.scope import NnxKVCache, NnxScope, builds
from te_jax.recipe import Recipe

__all__ = ["DotProductAttention", "MultiHeadAttention", "RelativePositionBiases"]


@builds(DotProductAttentionOptions)
class DotProductAttention(nnx.Module):
  """Scaled dot-product attention over already-projected q, k, v (see ``te_jax.dot_product_attention`` and
  te_jax.flax.DotProductAttention, whose arguments these are; dropout masks come from ``rngs``'
  ``dropout_rng_name`` stream). ``context_parallel``, ``cp_strategy``, ``cp_load_balanced`` and ``mesh``: context
  parallelism, as in te_jax.flax.DotProductAttention. ``recipe``: an FP8 recipe for this layer, overriding
  autocast's: with ``fp8_dpa=None``, its ``fp8_dpa`` decides FP8 attention. ``softmax_type="learnable"``: the
  ``softmax_offset`` parameter, created from ``rngs``.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> attn = te_nnx.DotProductAttention(32, 4, num_gqa_groups=2)
  >>> q, kv = jnp.ones((2, 16, 4, 32), jnp.bfloat16), jnp.ones((2, 16, 2, 32), jnp.bfloat16)
  >>> attn(q, kv, kv).shape
  (2, 16, 4, 32)
  """

  def __init__(self, head_dim: int, num_attention_heads: int, *, num_gqa_groups: int | None = None,
               attn_mask_type: str = "causal", attn_bias_type: str | None = None, attention_dropout: float = 0.0,
               dropout_rng_name: str = "dropout", qkv_layout: str = "BSHD", scale_factor: float | None = None,
               window_size: tuple[int, int] | None = None, softmax_type: str = "vanilla",
               transpose_batch_sequence: bool = False,
               deterministic: bool | None = None, dtype: Any = None, backend: str = "auto",
               fp8_dpa: bool | None = None, mask_convention: str = "flax", context_parallel: str | None = None,
               cp_strategy: str = "all_gather", cp_load_balanced: bool = True, mesh: Any = None,
               recipe: Recipe | None = None, rngs: nnx.Rngs | None = None):
    self.deterministic = deterministic
    self.options = nnx.static(DotProductAttentionOptions(
        head_dim=head_dim, num_attention_heads=num_attention_heads, num_gqa_groups=num_gqa_groups,
        attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type, attention_dropout=attention_dropout,
        dropout_rng_name=dropout_rng_name, qkv_layout=qkv_layout, scale_factor=scale_factor, window_size=window_size,
        softmax_type=softmax_type, transpose_batch_sequence=transpose_batch_sequence, dtype=dtype, backend=backend,
        fp8_dpa=fp8_dpa,
        mask_convention=mask_convention, context_parallel=context_parallel, cp_strategy=cp_strategy,
        cp_load_balanced=cp_load_balanced, mesh=mesh, recipe=recipe))
    if softmax_type == "learnable" and rngs is None:
      raise ValueError("softmax_type='learnable' makes the parameter softmax_offset: give rngs (its 'params' stream)")
    dot_product_attention_params(NnxScope(self, rngs, building=True), self.options)

  @classmethod
  def from_options(cls, options: DotProductAttentionOptions, in_features=None, *,
                   rngs: nnx.Rngs | None) -> "DotProductAttention":
    """The attention of ``options`` (``te_jax.modules.attention``); it has no input sizes to take."""
    del in_features
    return cls(**fields_of(options), rngs=rngs)

  def backend_for(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
                  deterministic: bool | None = None, segment_pos=None) -> AttentionBackend:
    """As te_jax.flax.DotProductAttention.backend_for: the backend the call with these arguments runs on, and why."""
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.options.attention_dropout)
    return attention_backend_for(self.options, query, key, value, mask, bias, segment_ids=segment_ids,
                                 deterministic=deterministic, segment_pos=segment_pos)

  def __call__(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
               deterministic: bool | None = None, attn_mask_type: str | None = None,
               attn_bias_type: str | None = None, window_size: tuple[int, int] | None = None, segment_pos=None):
    """As te_jax.flax.DotProductAttention's call (``attn_mask_type``, ``attn_bias_type``, ``window_size``: this
    call's, None for the module's; ``mask`` or ``segment_ids`` may be a ``te_jax.SequenceDescriptor``;
    ``segment_pos``: the tokens' positions within their segments)."""
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.options.attention_dropout)
    return dot_product_attention_block(NnxScope(self), self.options, query, key, value, mask, bias,
                                       segment_ids=segment_ids, deterministic=deterministic,
                                       attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
                                       window_size=window_size, segment_pos=segment_pos)


@builds(MultiHeadAttentionOptions)
class MultiHeadAttention(nnx.Module):
  """Multi-head attention: (LayerNorm ->) fused QKV projection -> RoPE -> attention -> output projection, as
  te_jax.flax.MultiHeadAttention (same arguments, parameters and math), with the input size given up front.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> mha = te_nnx.MultiHeadAttention(64, 16, 4, num_gqa_groups=2, rngs=nnx.Rngs(0))
  >>> mha(jnp.ones((2, 8, 64), jnp.bfloat16)).shape, mha.kv.kernel.shape
  ((2, 8, 64), (64, 2, 2, 16))

  Decoding with the KV cache, one token at a time after a prompt:

  >>> mha = te_nnx.MultiHeadAttention(64, 16, 4, decode=True, rngs=nnx.Rngs(0))
  >>> mha.init_cache((2, 8, 64))
  >>> x = jnp.ones((2, 8, 64))
  >>> mha(x[:, :3]).shape, mha(x[:, 3:4]).shape, int(mha.cache_index[...]), mha.cached_key.shape
  ((2, 3, 64), (2, 1, 64), 4, (2, 8, 4, 16))

  Args:
    in_features: the hidden size of the inputs (query and key/value).
    head_dim, num_attention_heads, and the keywords: te_jax.flax.MultiHeadAttention's attributes.
    attention_type: "self" (the call's ``inputs_kv`` is None or the query input) or "cross" (``inputs_kv`` is
      given): it decides the projections (one ``qkv`` kernel for self attention without GQA; ``query`` and ``kv``
      otherwise).
    context_parallel, cp_strategy, cp_load_balanced, mesh: context parallelism of the attention, as in
      te_jax.flax.MultiHeadAttention (with ``cp_load_balanced`` and RoPE, the call takes ``positions``).
    decode: use and update the KV cache in every call (self attention only; the call's ``decode`` takes
      precedence), as ``nnx.MultiHeadAttention``'s ``decode``: call ``init_cache`` first. A call appends its tokens
      (any number that fits the cache) at ``cache_index``; RoPE, the sliding window and ALiBi see them at their
      positions there; steps past the cache's end give NaN outputs.
    recipe: an FP8 recipe for every projection's GEMM (and, with ``fp8_dpa=None``, the choice of FP8 attention),
      overriding autocast's.
    rngs: the ``params`` stream, and with attention dropout the ``dropout_rng_name`` stream.
  """

  def __init__(self, in_features: int, head_dim: int, num_attention_heads: int, *,
               num_gqa_groups: int | None = None, attention_type: str = "self", attention_dropout: float = 0.0,
               dropout_rng_name: str = "dropout", input_layernorm: bool = True, norm_type: str = "layernorm",
               epsilon: float = 1e-6, zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
               attn_mask_type: str = "causal", attn_bias_type: str | None = None, enable_rotary_pos_emb: bool = False,
               rotary_base: float = 10000.0, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
               fuse_qkv_params: bool = True, use_bias: bool = False, scale_factor: float | None = None,
               scale_attn_logits: bool = True, window_size: tuple[int, int] | None = None,
               softmax_type: str = "vanilla", transpose_batch_sequence: bool = False,
               kernel_init: Initializer = nnx.initializers.variance_scaling(1.0, "fan_in", "normal"),
               bias_init: Initializer = nnx.initializers.zeros_init(), logical_axes: bool = False,
               deterministic: bool | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               backend: str = "auto", fp8_dpa: bool | None = None, mask_convention: str = "flax",
               context_parallel: str | None = None, cp_strategy: str = "all_gather", cp_load_balanced: bool = True,
               mesh: Any = None, decode: bool = False, recipe: Recipe | None = None, rngs: nnx.Rngs):
    if attention_type not in ("self", "cross"):
      raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
    self.options = nnx.static(MultiHeadAttentionOptions(
        head_dim=head_dim, num_attention_heads=num_attention_heads, num_gqa_groups=num_gqa_groups,
        attention_dropout=attention_dropout, dropout_rng_name=dropout_rng_name, input_layernorm=input_layernorm,
        norm_type=norm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
        return_layernorm_output=return_layernorm_output, attn_mask_type=attn_mask_type,
        attn_bias_type=attn_bias_type, enable_rotary_pos_emb=enable_rotary_pos_emb, rotary_base=rotary_base,
        rotary_percent=rotary_percent, rotary_interleaved=rotary_interleaved, fuse_qkv_params=fuse_qkv_params,
        use_bias=use_bias, scale_factor=scale_factor, scale_attn_logits=scale_attn_logits, window_size=window_size,
        softmax_type=softmax_type, transpose_batch_sequence=transpose_batch_sequence, kernel_init=kernel_init,
        bias_init=bias_init,
        logical_axes=logical_axes, dtype=dtype, param_dtype=param_dtype, backend=backend, fp8_dpa=fp8_dpa,
        mask_convention=mask_convention, context_parallel=context_parallel, cp_strategy=cp_strategy,
        cp_load_balanced=cp_load_balanced, mesh=mesh, recipe=recipe))
    self._check_decode(decode, attention_type, context_parallel)
    self.in_features, self.attention_type, self.decode = in_features, attention_type, decode
    self.deterministic = deterministic
    multi_head_attention_params(NnxScope(self, rngs), self.options, in_features, attention_type == "self")
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

  @classmethod
  def from_options(cls, options: MultiHeadAttentionOptions, in_features: int, *, rngs: nnx.Rngs,
                   attention_type: str = "self", decode: bool = False) -> "MultiHeadAttention":
    """The layer of ``options`` (``te_jax.modules.attention``) over inputs of last dim ``in_features``."""
    return cls(in_features, **fields_of(options), attention_type=attention_type, decode=decode, rngs=rngs)

  @staticmethod
  def _check_decode(decode, attention_type: str, context_parallel) -> None:
    if not isinstance(decode, bool):
      raise TypeError(f"decode must be a bool, got {decode!r}")
    if decode and attention_type != "self":
      raise ValueError("decode=True (KV cache) is for self attention: construct the module with "
                       "attention_type='self'")
    if decode and context_parallel is not None:
      check_layer_options(decode=True)

  def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
    """Creates (or empties) the KV cache for decoding, as ``nnx.MultiHeadAttention.init_cache``: ``cached_key`` and
    ``cached_value`` of shape ``(batch, max_length, kv_heads, head_dim)`` (zeros) and ``cache_index`` 0.

    Args:
      input_shape: the inputs' shape at the full length the cache holds: (batch, max_length, hidden), or
        (max_length, batch, hidden) with ``transpose_batch_sequence``.
      dtype: the cache's dtype; None: the module's ``dtype``, else float32 (``nnx.MultiHeadAttention``'s default).
        The keys and values are stored in it and read back in the compute dtype.
    """
    o = self.options
    self._check_decode(True, self.attention_type, o.context_parallel)
    shape = kv_cache_shape(input_shape, hidden=self.in_features, kv_heads=o.kv_heads, head_dim=o.head_dim,
                           transpose_batch_sequence=o.transpose_batch_sequence)
    dtype = dtype if dtype is not None else o.dtype if o.dtype is not None else jnp.float32
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               decode: bool | None = None, deterministic: bool | None = None, residual: jax.Array | None = None,
               attn_mask_type: str | None = None, segment_pos=None):
    """As te_jax.flax.MultiHeadAttention's call; ``decode`` (None: the module's) uses and updates the KV cache of
    ``init_cache``; ``mask`` or ``segment_ids`` may be a ``te_jax.SequenceDescriptor``, and ``segment_pos`` gives
    RoPE and the masks the tokens' positions within their segments."""
    self_attention = inputs_kv is None or inputs_kv is inputs_q
    if self_attention != (self.attention_type == "self"):
      raise ValueError(f"attention_type={self.attention_type!r}, but inputs_kv is "
                       f"{'not ' if not self_attention else ''}the query input: construct the module with "
                       f"attention_type={'self' if self_attention else 'cross'!r}")
    decode = self.decode if decode is None else decode
    self._check_decode(decode, self.attention_type, self.options.context_parallel)
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.options.attention_dropout)
    return multi_head_attention(NnxScope(self), self.options, inputs_q, inputs_kv, mask, bias,
                                segment_ids=segment_ids, positions=positions, decode=decode,
                                deterministic=deterministic, residual=residual, attn_mask_type=attn_mask_type,
                                cache=NnxKVCache(self) if decode else None, segment_pos=segment_pos)


@builds(RelativePositionBiasesOptions)
class RelativePositionBiases(nnx.Module):
  """T5's relative position biases, as te_jax.flax.RelativePositionBiases (same arguments, parameter and math: the
  ``rel_embedding`` table of shape (heads, buckets), float32), with ``rngs`` to create the table up front.

  >>> import te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> rpb = te_nnx.RelativePositionBiases(32, 128, 4, rngs=nnx.Rngs(0))
  >>> rpb(8, 8).shape, rpb.rel_embedding.shape
  ((1, 4, 8, 8), (4, 32))

  Args:
    num_buckets: buckets; half are exact distances (0 .. num_buckets/4 - 1 when bidirectional), the rest log-spaced.
    max_distance: distances at or beyond it share the last bucket.
    num_attention_heads: heads (one bias table each).
    embedding_init: initializer of the (heads, buckets) table.
    embedding_axes: logical axis names of the table (``out_sharding`` metadata).
    dtype: dtype of the returned bias.
    rngs: the ``params`` stream initializes the table.
  """

  def __init__(self, num_buckets: int, max_distance: int, num_attention_heads: int, *,
               embedding_init: Initializer = nnx.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
               embedding_axes: tuple[str | None, ...] = (), dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.options = nnx.static(RelativePositionBiasesOptions(
        num_buckets=num_buckets, max_distance=max_distance, num_attention_heads=num_attention_heads,
        embedding_init=embedding_init, embedding_axes=embedding_axes, dtype=dtype))
    relative_position_biases(NnxScope(self, rngs), self.options)

  @classmethod
  def from_options(cls, options: RelativePositionBiasesOptions, in_features=None, *,
                   rngs: nnx.Rngs) -> "RelativePositionBiases":
    """The biases of ``options`` (``te_jax.modules.attention``); they have no input sizes to take."""
    del in_features
    return cls(**fields_of(options), rngs=rngs)

  @staticmethod
  def bucket(relative_position, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """The bucket of each ``key_position - query_position``, as te_jax.flax.RelativePositionBiases.bucket."""
    return relative_position_bucket(relative_position, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)

  def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True,
               q_offset: jax.Array | int | None = None) -> jax.Array:
    """The bias ``(1, heads, q_seqlen, k_seqlen)`` to add to the attention logits, as
    te_jax.flax.RelativePositionBiases's call (``q_offset``: the queries' first position, when decoding)."""
    return relative_position_biases(NnxScope(self), self.options, q_seqlen, k_seqlen, bidirectional, q_offset)
