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

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.flax.params import (EMBED, HEAD_DIM, HEADS, QKV, Initializer, axes, context_parallel_axes,
                                seq_first_to_batch_first)
from te_jax.fused.attention import (ATTN_MASK_TYPES, QKV_LAYOUTS, dot_product_attention, fp8_dpa_enabled,
                                    layout_for)
from te_jax.fused.attention_config import check_mask_convention, masked_out
from te_jax.fused.context_parallel import check_layer_options, context_parallel_attention
from te_jax.modules.attention_cache import (append_to_cache, check_fits_cache, decode_mask_and_bias, kv_cache_shape,
                                           mark_overflow, query_positions, require_cache)
from te_jax.modules.relative_position import (check_relative_position_options, relative_position_bias,
                                              relative_position_bucket)
from te_jax.nnx.dense import DenseGeneral
from te_jax.nnx.layernorm import LayerNormDenseGeneral
from te_jax.nnx.params import make_param, resolve_deterministic
from te_jax.ops.rope import apply_rope, rope_frequencies
from te_jax.recipe import Recipe

__all__ = ["DotProductAttention", "MultiHeadAttention", "RelativePositionBiases"]


class DotProductAttention(nnx.Module):
  """Scaled dot-product attention over already-projected q, k, v (see ``te_jax.dot_product_attention`` and
  te_jax.flax.DotProductAttention, whose arguments these are; dropout masks come from ``rngs``'
  ``dropout_rng_name`` stream). ``context_parallel``, ``cp_strategy``, ``cp_load_balanced`` and ``mesh``: context
  parallelism, as in te_jax.flax.DotProductAttention. ``recipe``: an FP8 recipe for this layer, overriding
  autocast's: with ``fp8_dpa=None``, its ``fp8_dpa`` decides FP8 attention.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> attn = te_nnx.DotProductAttention(32, 4, num_gqa_groups=2)
  >>> q, kv = jnp.ones((2, 16, 4, 32), jnp.bfloat16), jnp.ones((2, 16, 2, 32), jnp.bfloat16)
  >>> attn(q, kv, kv).shape
  (2, 16, 4, 32)
  """

  def __init__(self, head_dim: int, num_attention_heads: int, *, num_gqa_groups: int | None = None,
               attn_mask_type: str = "causal", attn_bias_type: str | None = None, attention_dropout: float = 0.0,
               dropout_rng_name: str = "dropout", qkv_layout: str = "BSHD", scale_factor: float | None = None,
               window_size: tuple[int, int] | None = None, transpose_batch_sequence: bool = False,
               deterministic: bool | None = None, dtype: Any = None, backend: str = "auto",
               fp8_dpa: bool | None = None, mask_convention: str = "flax", context_parallel: str | None = None,
               cp_strategy: str = "all_gather", cp_load_balanced: bool = True, mesh: Any = None,
               recipe: Recipe | None = None, rngs: nnx.Rngs | None = None):
    self.head_dim, self.num_attention_heads, self.num_gqa_groups = head_dim, num_attention_heads, num_gqa_groups
    self.recipe = recipe
    self.context_parallel, self.cp_strategy, self.cp_load_balanced = context_parallel, cp_strategy, cp_load_balanced
    self.mesh = mesh
    if context_parallel is not None:
      check_layer_options(attn_bias_type=attn_bias_type, window_size=window_size, fp8_dpa=fp8_dpa,
                          transpose_batch_sequence=transpose_batch_sequence)
    self.attn_mask_type, self.attn_bias_type, self.attention_dropout = attn_mask_type, attn_bias_type, attention_dropout
    self.qkv_layout, self.scale_factor, self.window_size = qkv_layout, scale_factor, window_size
    self.transpose_batch_sequence, self.deterministic, self.dtype = transpose_batch_sequence, deterministic, dtype
    self.backend, self.fp8_dpa = backend, fp8_dpa
    self.mask_convention = check_mask_convention(mask_convention)
    layout_for(qkv_layout, transpose_batch_sequence)
    if attention_dropout > 0 and rngs is None:
      raise ValueError("DotProductAttention with attention_dropout needs rngs (the dropout masks' stream)")
    self.rngs = rngs[dropout_rng_name].fork() if attention_dropout > 0 else nnx.data(None)

  def __call__(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
               deterministic: bool | None = None, attn_mask_type: str | None = None):
    """As te_jax.flax.DotProductAttention's call; ``attn_mask_type`` overrides the module's for this call."""
    return self._attend(query, key, value, mask, bias, segment_ids=segment_ids, deterministic=deterministic,
                        attn_mask_type=attn_mask_type or self.attn_mask_type, attn_bias_type=self.attn_bias_type,
                        window_size=self.window_size)

  def _attend(self, query, key, value, mask, bias, *, segment_ids, deterministic: bool | None, attn_mask_type: str,
              attn_bias_type: str | None, window_size: tuple[int, int] | None):
    """The call with the mask type, bias type and window given (the KV-cache path of MultiHeadAttention sets them
    from the queries' positions)."""
    layout = layout_for(self.qkv_layout, self.transpose_batch_sequence)
    packing = QKV_LAYOUTS[layout][1]
    kv = query if packing == "qkv" else key
    if query.shape[-1] != self.head_dim or query.shape[-2] != self.num_attention_heads:
      raise ValueError(f"head_dim={self.head_dim}, num_attention_heads={self.num_attention_heads}: the query has "
                       f"{query.shape[-2]} heads of {query.shape[-1]}")
    if kv is not None and kv.shape[-2] != (self.num_gqa_groups or self.num_attention_heads):
      raise ValueError(f"num_gqa_groups={self.num_gqa_groups}: the key has {kv.shape[-2]} heads")
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    if self.dtype is not None:
      query, key, value = (None if x is None else x.astype(self.dtype) for x in (query, key, value))
    rate = 0.0 if deterministic else self.attention_dropout
    rng = self.rngs() if rate > 0 else None
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, attn_mask_type=attn_mask_type,
              attn_bias_type=attn_bias_type, scale_factor=self.scale_factor, window_size=window_size,
              qkv_layout=layout, backend=self.backend, mask_convention=self.mask_convention)
    if self.context_parallel is not None:
      check_layer_options(bias=bias)
      del kw["attn_bias_type"], kw["window_size"], kw["mask_convention"]
      return context_parallel_attention(query, key, value, mask=mask, axis=self.context_parallel, mesh=self.mesh,
                                        strategy=self.cp_strategy, load_balanced=self.cp_load_balanced,
                                        **context_parallel_axes(), **kw)
    fp8_dpa = fp8_dpa_enabled(self.fp8_dpa, query, key, value, bias, mask, **kw, recipe=self.recipe)
    return dot_product_attention(query, key, value, bias, mask, dropout_rng=rng, fp8_dpa=fp8_dpa, **kw)


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
               window_size: tuple[int, int] | None = None, transpose_batch_sequence: bool = False,
               kernel_init: Initializer = nnx.initializers.variance_scaling(1.0, "fan_in", "normal"),
               bias_init: Initializer = nnx.initializers.zeros_init(), logical_axes: bool = False,
               deterministic: bool | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               backend: str = "auto", fp8_dpa: bool | None = None, mask_convention: str = "flax",
               context_parallel: str | None = None, cp_strategy: str = "all_gather", cp_load_balanced: bool = True,
               mesh: Any = None, decode: bool = False, recipe: Recipe | None = None, rngs: nnx.Rngs):
    if attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
    if attention_type not in ("self", "cross"):
      raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
    kv_heads = num_gqa_groups or num_attention_heads
    if num_attention_heads % kv_heads:
      raise ValueError(f"num_gqa_groups={kv_heads} must divide num_attention_heads={num_attention_heads}")
    if not 0.0 < rotary_percent <= 1.0:
      raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
    self.rotary_dim = int(head_dim * rotary_percent) // 2 * 2
    if enable_rotary_pos_emb and self.rotary_dim < 2:
      raise ValueError(f"rotary_percent={rotary_percent} of head_dim={head_dim} leaves no feature pair")
    self._check_decode(decode, attention_type, context_parallel)
    self.attention_type, self.input_layernorm = attention_type, input_layernorm
    self.return_layernorm_output, self.enable_rotary_pos_emb = return_layernorm_output, enable_rotary_pos_emb
    self.rotary_base, self.rotary_interleaved = rotary_base, rotary_interleaved
    self.transpose_batch_sequence, self.deterministic = transpose_batch_sequence, deterministic
    self.attention_dropout = attention_dropout
    self.mask_convention = check_mask_convention(mask_convention)
    self.in_features, self.head_dim, self.num_attention_heads, self.kv_heads = (in_features, head_dim,
                                                                                num_attention_heads, kv_heads)
    self.attn_bias_type, self.window_size, self.dtype = attn_bias_type, window_size, dtype
    self.context_parallel, self.decode = context_parallel, decode
    h, d = num_attention_heads, head_dim
    ax = functools.partial(axes, logical_axes)
    dense_kw = dict(use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                    param_dtype=param_dtype, recipe=recipe, rngs=rngs)
    norm_kw = dict(norm_type=norm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                   ln_scale_axes=ax(EMBED), ln_bias_axes=ax(EMBED))

    def projection(features, feature_axes, with_norm, want_norm_output, unstack_axis=None):
      kw = dict(unstack_axis=unstack_axis, kernel_axes=ax(EMBED, *feature_axes), bias_axes=ax(*feature_axes),
                **dense_kw)
      if not with_norm:
        return DenseGeneral(in_features, features, **kw)
      return LayerNormDenseGeneral(in_features, features, return_layernorm_output=want_norm_output, **norm_kw, **kw)

    self.fused_qkv = attention_type == "self" and fuse_qkv_params and kv_heads == h
    if self.fused_qkv:
      self.qkv = projection((h, 3, d), (HEADS, QKV, HEAD_DIM), input_layernorm, return_layernorm_output, -2)
    else:
      self.kv_from_norm = attention_type == "self" and input_layernorm
      self.query = projection((h, d), (HEADS, HEAD_DIM), input_layernorm,
                              return_layernorm_output or self.kv_from_norm)
      self.kv = projection((kv_heads, 2, d), (HEADS, QKV, HEAD_DIM), False, False, -2)
    # The call converts the caller's mask once (the KV-cache path adds its own masked positions to it), so the
    # attention takes it as "te" (True = masked out), as in te_jax.flax.MultiHeadAttention.
    self.attention = DotProductAttention(
        d, h, num_gqa_groups=kv_heads, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
        attention_dropout=attention_dropout, dropout_rng_name=dropout_rng_name, scale_factor=scale_factor,
        window_size=window_size, backend=backend, fp8_dpa=fp8_dpa, mask_convention="te",
        context_parallel=context_parallel, cp_strategy=cp_strategy, cp_load_balanced=cp_load_balanced, mesh=mesh,
        recipe=recipe, rngs=rngs)
    self.cp_rope_needs_positions = context_parallel is not None and cp_load_balanced and enable_rotary_pos_emb
    self.out = DenseGeneral((h, d), in_features, axis=(-2, -1), kernel_axes=ax(HEADS, HEAD_DIM, EMBED),
                            bias_axes=ax(EMBED), **dense_kw)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)

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
    self._check_decode(True, self.attention_type, self.context_parallel)
    shape = kv_cache_shape(input_shape, hidden=self.in_features, kv_heads=self.kv_heads, head_dim=self.head_dim,
                           transpose_batch_sequence=self.transpose_batch_sequence)
    dtype = dtype if dtype is not None else self.dtype if self.dtype is not None else jnp.float32
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

  def _rope(self, q, k, positions, offset=None):
    if positions is None:
      positions = query_positions(q.shape[1], offset)
    freqs = rope_frequencies(jnp.asarray(positions, jnp.int32), self.rotary_dim, self.rotary_base)
    rope = functools.partial(apply_rope, freqs=freqs, interleaved=self.rotary_interleaved)
    return rope(q), rope(k)

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               decode: bool | None = None, deterministic: bool | None = None, residual: jax.Array | None = None,
               attn_mask_type: str | None = None):
    """As te_jax.flax.MultiHeadAttention's call; ``decode`` (None: the module's) uses and updates the KV cache of
    ``init_cache``; ``attn_mask_type`` overrides the module's for this call."""
    self_attention = inputs_kv is None or inputs_kv is inputs_q
    if self_attention != (self.attention_type == "self"):
      raise ValueError(f"attention_type={self.attention_type!r}, but inputs_kv is "
                       f"{'not ' if not self_attention else ''}the query input: construct the module with "
                       f"attention_type={'self' if self_attention else 'cross'!r}")
    decode = self.decode if decode is None else decode
    self._check_decode(decode, self.attention_type, self.context_parallel)
    if decode and segment_ids is not None:
      raise ValueError("decode=True does not take segment_ids")
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
      if x is not None and x.ndim != 3:
        raise ValueError(f"{name} must be 3-D ((B, S, hidden), or (S, B, hidden) with transpose_batch_sequence), "
                         f"got shape {x.shape}")
    if attn_mask_type is not None and attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
    xq = seq_first_to_batch_first(inputs_q, self.transpose_batch_sequence)
    if decode:
      require_cache(self.cache_index is not None)
      check_fits_cache(self.cached_key.shape, (*xq.shape[:2], self.kv_heads, self.head_dim))
    mask = masked_out(mask, self.mask_convention)
    xkv = xq if self_attention else seq_first_to_batch_first(inputs_kv, self.transpose_batch_sequence)
    pass_input = residual is not None and residual is inputs_q and self.input_layernorm
    x_passed = ln_out = None
    if self.fused_qkv:
      out = self.qkv(xq, return_input=pass_input) if self.input_layernorm else self.qkv(xq)
      (q, k, v), ln_out, x_passed = _split_projection(out, self.input_layernorm and self.return_layernorm_output,
                                                      pass_input)
    else:
      want_norm = self.input_layernorm and (self.return_layernorm_output or self.kv_from_norm)
      out = self.query(xq, return_input=pass_input) if self.input_layernorm else self.query(xq)
      q, ln_out, x_passed = _split_projection(out, want_norm, pass_input)
      k, v = self.kv(ln_out if self.kv_from_norm else xkv)
    offset = self.cache_index[...] if decode else None
    if self.enable_rotary_pos_emb:
      if self.cp_rope_needs_positions and positions is None:
        raise ValueError("positions: with context_parallel and cp_load_balanced=True the sequence is in zig-zag order, "
                         "so RoPE needs its tokens' positions: pass positions=te_jax.zigzag_order(seq_len, cp)")
      q, k = self._rope(q, k, positions, offset)
    mask_type = attn_mask_type or self.attention.attn_mask_type
    bias_type, window = self.attn_bias_type, self.window_size
    if decode:
      cached_k, cached_v, index = append_to_cache(self.cached_key[...], self.cached_value[...], offset, k, v)
      self.cached_key[...], self.cached_value[...], self.cache_index[...] = cached_k, cached_v, index
      k, v = cached_k.astype(k.dtype), cached_v.astype(v.dtype)  # the compute dtype, whatever the cache's
      mask, bias, bias_type = decode_mask_and_bias(offset, q.shape[1], k.shape[1], mask, bias, bias_type,
                                                   window_size=window, num_heads=self.num_attention_heads)
      mask_type, window = "arbitrary", None
    out = self.attention._attend(q, k, v, mask, bias, segment_ids=segment_ids, deterministic=deterministic,
                                 attn_mask_type=mask_type, attn_bias_type=bias_type, window_size=window)
    if decode:
      out = mark_overflow(out, offset, q.shape[1], k.shape[1])
    out = self.out(out, x_passed if pass_input else seq_first_to_batch_first(residual, self.transpose_batch_sequence))
    out = seq_first_to_batch_first(out, self.transpose_batch_sequence)
    if self.return_layernorm_output:
      return out, seq_first_to_batch_first(ln_out, self.transpose_batch_sequence)
    return out


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
    check_relative_position_options(num_buckets, max_distance, num_attention_heads)
    self.num_buckets, self.max_distance, self.num_attention_heads = num_buckets, max_distance, num_attention_heads
    self.dtype = dtype
    self.rel_embedding = make_param(embedding_init, rngs.params(), (num_attention_heads, num_buckets), jnp.float32,
                                    axes=tuple(embedding_axes))

  @staticmethod
  def bucket(relative_position, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """The bucket of each ``key_position - query_position``, as te_jax.flax.RelativePositionBiases.bucket."""
    return relative_position_bucket(relative_position, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)

  def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True,
               q_offset: jax.Array | int | None = None) -> jax.Array:
    """The bias ``(1, heads, q_seqlen, k_seqlen)`` to add to the attention logits, as
    te_jax.flax.RelativePositionBiases's call (``q_offset``: the queries' first position, when decoding)."""
    return relative_position_bias(self.rel_embedding[...], q_seqlen, k_seqlen, bidirectional=bidirectional,
                                  max_distance=self.max_distance, q_offset=q_offset, dtype=self.dtype)


def _split_projection(out, want_norm_output: bool, pass_input: bool):
  """A projection's output as (y, the normalized input or None, the passed-through input or None)."""
  out = out if want_norm_output or pass_input else (out,)
  y, rest = out[0], list(out[1:])
  ln_out = rest.pop(0) if want_norm_output else None
  return y, ln_out, (rest.pop(0) if pass_input else None)
