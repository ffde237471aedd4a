"""NNX attention: ``DotProductAttention`` (``te_jax.dot_product_attention`` as a module, no parameters) and
``MultiHeadAttention`` (norm, fused QKV projection, RoPE, attention, output projection), composed as
``te_jax.flax``'s are, from the same fused ops. Masks follow Flax: **True (or nonzero) =
attend**, unless a module's ``mask_convention="te"`` asks for NVIDIA Transformer Engine's (True = masked out);
tensors are ``(batch, sequence, hidden)`` unless ``transpose_batch_sequence``. The KV cache
(``decode``) is linen's only."""

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
from te_jax.fused.attention_config import check_mask_convention
from te_jax.fused.context_parallel import check_layer_options, context_parallel_attention
from te_jax.nnx.dense import DenseGeneral
from te_jax.nnx.layernorm import LayerNormDenseGeneral
from te_jax.nnx.params import resolve_deterministic
from te_jax.ops.rope import apply_rope, rope_frequencies
from te_jax.recipe import Recipe

__all__ = ["DotProductAttention", "MultiHeadAttention"]


class DotProductAttention(nnx.Module):
  """Scaled dot-product attention over already-projected q, k, v (see ``te_jax.dot_product_attention`` and
  te_jax.flax.DotProductAttention, whose arguments these are; dropout masks come from ``rngs``'
  ``dropout_rng_name`` stream). ``context_parallel``, ``cp_strategy``, ``cp_load_balanced`` and ``mesh``: context
  parallelism, as in te_jax.flax.DotProductAttention.

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
               rngs: nnx.Rngs | None = None):
    self.head_dim, self.num_attention_heads, self.num_gqa_groups = head_dim, num_attention_heads, num_gqa_groups
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
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, attn_mask_type=attn_mask_type or self.attn_mask_type,
              attn_bias_type=self.attn_bias_type, scale_factor=self.scale_factor, window_size=self.window_size,
              qkv_layout=layout, backend=self.backend, mask_convention=self.mask_convention)
    if self.context_parallel is not None:
      check_layer_options(bias=bias)
      del kw["attn_bias_type"], kw["window_size"], kw["mask_convention"]
      return context_parallel_attention(query, key, value, mask=mask, axis=self.context_parallel, mesh=self.mesh,
                                        strategy=self.cp_strategy, load_balanced=self.cp_load_balanced,
                                        **context_parallel_axes(), **kw)
    fp8_dpa = fp8_dpa_enabled(self.fp8_dpa, query, key, value, bias, mask, **kw)
    return dot_product_attention(query, key, value, bias, mask, dropout_rng=rng, fp8_dpa=fp8_dpa, **kw)


class MultiHeadAttention(nnx.Module):
  """Multi-head attention: (LayerNorm ->) fused QKV projection -> RoPE -> attention -> output projection, as
  te_jax.flax.MultiHeadAttention (same arguments, parameters and math), with the input size given up front.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> mha = te_nnx.MultiHeadAttention(64, 16, 4, num_gqa_groups=2, rngs=nnx.Rngs(0))
  >>> mha(jnp.ones((2, 8, 64), jnp.bfloat16)).shape, mha.kv.kernel.shape
  ((2, 8, 64), (64, 2, 2, 16))

  Args:
    in_features: the hidden size of the inputs (query and key/value).
    head_dim, num_attention_heads, and the keywords: te_jax.flax.MultiHeadAttention's attributes.
    attention_type: "self" (the call's ``inputs_kv`` is None or the query input) or "cross" (``inputs_kv`` is
      given): it decides the projections (one ``qkv`` kernel for self attention without GQA; ``query`` and ``kv``
      otherwise).
    context_parallel, cp_strategy, cp_load_balanced, mesh: context parallelism of the attention, as in
      te_jax.flax.MultiHeadAttention (with ``cp_load_balanced`` and RoPE, the call takes ``positions``).
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
               mesh: Any = None, recipe: Recipe | None = None, rngs: nnx.Rngs):
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
    self.attention_type, self.input_layernorm = attention_type, input_layernorm
    self.return_layernorm_output, self.enable_rotary_pos_emb = return_layernorm_output, enable_rotary_pos_emb
    self.rotary_base, self.rotary_interleaved = rotary_base, rotary_interleaved
    self.transpose_batch_sequence, self.deterministic = transpose_batch_sequence, deterministic
    self.attention_dropout = attention_dropout
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
    self.attention = DotProductAttention(
        d, h, num_gqa_groups=kv_heads, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
        attention_dropout=attention_dropout, dropout_rng_name=dropout_rng_name, scale_factor=scale_factor,
        window_size=window_size, backend=backend, fp8_dpa=fp8_dpa, mask_convention=mask_convention,
        context_parallel=context_parallel, cp_strategy=cp_strategy, cp_load_balanced=cp_load_balanced, mesh=mesh,
        rngs=rngs)
    self.cp_rope_needs_positions = context_parallel is not None and cp_load_balanced and enable_rotary_pos_emb
    self.out = DenseGeneral((h, d), in_features, axis=(-2, -1), kernel_axes=ax(HEADS, HEAD_DIM, EMBED),
                            bias_axes=ax(EMBED), **dense_kw)

  def _rope(self, q, k, positions):
    if positions is None:
      positions = jnp.arange(q.shape[1], dtype=jnp.int32)
    freqs = rope_frequencies(jnp.asarray(positions, jnp.int32), self.rotary_dim, self.rotary_base)
    rope = functools.partial(apply_rope, freqs=freqs, interleaved=self.rotary_interleaved)
    return rope(q), rope(k)

  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               deterministic: bool | None = None, residual: jax.Array | None = None,
               attn_mask_type: str | None = None):
    """As te_jax.flax.MultiHeadAttention's call (without ``decode``); ``attn_mask_type`` overrides the module's for
    this call."""
    self_attention = inputs_kv is None or inputs_kv is inputs_q
    if self_attention != (self.attention_type == "self"):
      raise ValueError(f"attention_type={self.attention_type!r}, but inputs_kv is "
                       f"{'not ' if not self_attention else ''}the query input: construct the module with "
                       f"attention_type={'self' if self_attention else 'cross'!r}")
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
      if x is not None and x.ndim != 3:
        raise ValueError(f"{name} must be 3-D ((B, S, hidden), or (S, B, hidden) with transpose_batch_sequence), "
                         f"got shape {x.shape}")
    xq = seq_first_to_batch_first(inputs_q, self.transpose_batch_sequence)
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
    if self.enable_rotary_pos_emb:
      if self.cp_rope_needs_positions and positions is None:
        raise ValueError("positions: with context_parallel and cp_load_balanced=True the sequence is in zig-zag order, "
                         "so RoPE needs its tokens' positions: pass positions=te_jax.zigzag_order(seq_len, cp)")
      q, k = self._rope(q, k, positions)
    if attn_mask_type is not None and attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
    out = self.attention(q, k, v, mask, bias, segment_ids=segment_ids, deterministic=deterministic,
                         attn_mask_type=attn_mask_type)
    out = self.out(out, x_passed if pass_input else seq_first_to_batch_first(residual, self.transpose_batch_sequence))
    out = seq_first_to_batch_first(out, self.transpose_batch_sequence)
    if self.return_layernorm_output:
      return out, seq_first_to_batch_first(ln_out, self.transpose_batch_sequence)
    return out


def _split_projection(out, want_norm_output: bool, pass_input: bool):
  """A projection's output as (y, the normalized input or None, the passed-through input or None)."""
  out = out if want_norm_output or pass_input else (out,)
  y, rest = out[0], list(out[1:])
  ln_out = rest.pop(0) if want_norm_output else None
  return y, ln_out, (rest.pop(0) if pass_input else None)
