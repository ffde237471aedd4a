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

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.flax.dense import DenseGeneral
from te_jax.flax.layernorm_dense import LayerNormDenseGeneral
from te_jax.flax.params import (
  ACT_EMBED,
  BATCH,
  EMBED,
  HEAD_DIM,
  HEADS,
  QKV,
  SEQ,
  Initializer,
  axes,
  context_parallel_axes,
  gather_sequence,
  logical,
  resolve_deterministic,
  seq_first_to_batch_first,
  stream_input,
)
from te_jax.fused.attention import (
  ATTN_MASK_TYPES,
  QKV_LAYOUTS,
  AttentionBackend,
  attention_backend,
  dot_product_attention,
  fp8_dpa_enabled,
  layout_for,
)
from te_jax.fused.attention_config import check_mask_convention, masked_out
from te_jax.fused.context_parallel import check_layer_options, context_parallel_attention, context_parallel_backend
from te_jax.modules.attention_cache import (append_to_cache, check_fits_cache, decode_mask_and_bias, mark_overflow,
                                           query_positions)
from te_jax.modules.relative_position import (check_relative_position_options, relative_position_bias,
                                              relative_position_bucket)
from te_jax.ops.rope import apply_rope, rope_frequencies
from te_jax.recipe import Recipe

__all__ = ["DotProductAttention", "MultiHeadAttention", "RelativePositionBiases"]


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
    attn_bias_type: None (from the ``bias`` argument), "no_bias", "post_scale_bias" or "alibi".
    attention_dropout: the dropout rate on the attention probabilities.
    dropout_rng_name: the rng stream of the dropout mask.
    qkv_layout: "BSHD", "BS3HD" or "BSHD_BS2HD" (or their "SB" forms); with ``transpose_batch_sequence`` the "BS"
      forms mean sequence-first tensors.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    window_size: a sliding window (left, right), -1 = unbounded.
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

  def _layout(self) -> str:
    return layout_for(self.qkv_layout, self.transpose_batch_sequence)

  def _check_heads(self, query, key, value, layout: str):
    packing = QKV_LAYOUTS[layout][1]
    q_heads, q_dim = query.shape[-2:]
    kv = query if packing == "qkv" else key
    kv_heads = None if kv is None else kv.shape[-2]
    expected_kv = self.num_gqa_groups or self.num_attention_heads
    if q_dim != self.head_dim:
      raise ValueError(f"head_dim={self.head_dim} but the query's last dim is {q_dim}")
    if q_heads != self.num_attention_heads:
      raise ValueError(f"num_attention_heads={self.num_attention_heads} but the query has {q_heads} heads")
    if kv_heads is not None and kv_heads != expected_kv:
      raise ValueError(f"num_gqa_groups={self.num_gqa_groups} expects {expected_kv} key/value heads, the key has "
                       f"{kv_heads}")
    del value

  def _kwargs(self, layout: str) -> dict:
    return dict(attn_mask_type=self.attn_mask_type, attn_bias_type=self.attn_bias_type,
                scale_factor=self.scale_factor, window_size=self.window_size, qkv_layout=layout,
                backend=self.backend, mask_convention=check_mask_convention(self.mask_convention))

  def backend_for(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
                  deterministic: bool | None = None) -> AttentionBackend:
    """Which backend ``__call__`` with these arguments runs on, and why (arrays or ``jax.ShapeDtypeStruct``)."""
    layout = self._layout()
    cast = [None if x is None else jax.ShapeDtypeStruct(x.shape, self.dtype or query.dtype)
            for x in (query, key, value)]
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    rate = 0.0 if deterministic else self.attention_dropout
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, **self._kwargs(layout))
    if self.context_parallel is not None:
      return context_parallel_backend(*cast, strategy=self.cp_strategy, **kw)
    fp8_dpa = fp8_dpa_enabled(self.fp8_dpa, *cast, bias, mask, **kw, recipe=self.recipe)
    return attention_backend(*cast, bias, mask, fp8_dpa=fp8_dpa, **kw)

  @nn.compact
  def __call__(self, query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
               mask: jax.Array | None = None, bias: jax.Array | None = None, *, segment_ids=None,
               deterministic: bool | None = None) -> jax.Array:
    """Attention of ``query`` over ``key``/``value`` (None where the layout packs them into another argument).

    Args:
      query, key, value: in ``qkv_layout`` (sequence-first with ``transpose_batch_sequence``).
      mask: bool, int or float, True (nonzero) = attend (``mask_convention``), broadcastable to (B, H, T, S): the
        padding or the "arbitrary" mask.
      bias: the post-scale bias, broadcastable to (B, H, T, S).
      segment_ids: (B, S) or (q_ids, kv_ids) packed-sequence ids, 0 = padding.
      deterministic: no dropout.

    Returns:
      The attention output, shaped as ``query`` (heads and head dim of value).
    """
    layout = self._layout()
    kw = self._kwargs(layout)  # checks the attributes before anything is traced
    self._check_heads(query, key, value, layout)
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    if self.dtype is not None:
      query, key, value = (None if x is None else x.astype(self.dtype) for x in (query, key, value))
    rate = 0.0 if deterministic else self.attention_dropout
    rng = self.make_rng(self.dropout_rng_name) if rate > 0 else None
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, **kw)
    if self.context_parallel is not None:
      check_layer_options(bias=bias, attn_bias_type=self.attn_bias_type, window_size=self.window_size,
                          fp8_dpa=self.fp8_dpa, transpose_batch_sequence=self.transpose_batch_sequence)
      del kw["attn_bias_type"], kw["window_size"], kw["mask_convention"]
      return context_parallel_attention(query, key, value, mask=mask, axis=self.context_parallel, mesh=self.mesh,
                                        strategy=self.cp_strategy, load_balanced=self.cp_load_balanced,
                                        **context_parallel_axes(), **kw)
    fp8_dpa = fp8_dpa_enabled(self.fp8_dpa, query, key, value, bias, mask, **kw, recipe=self.recipe)
    return dot_product_attention(query, key, value, bias, mask, dropout_rng=rng, fp8_dpa=fp8_dpa, **kw)


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
    check_relative_position_options(self.num_buckets, self.max_distance, self.num_attention_heads)
    table = self.param("rel_embedding", logical(self.embedding_init, self.embedding_axes),
                       (self.num_attention_heads, self.num_buckets), jnp.float32)
    return relative_position_bias(table, q_seqlen, k_seqlen, bidirectional=bidirectional,
                                  max_distance=self.max_distance, q_offset=q_offset, dtype=self.dtype)


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
      "post_scale_bias" or "alibi".
    enable_rotary_pos_emb: rotate queries and keys (RoPE); rotary_base: its wavelength base; rotary_percent: the
      fraction of each head's features that rotate; rotary_interleaved: GPT-J pairs (2i, 2i+1) instead of the
      half-split pairs (i, i + R/2) of GPT-NeoX and Llama.
    fuse_qkv_params: one QKV kernel (self attention), else separate query / key / value kernels.
    use_bias: biases on the projections.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    window_size: a sliding window (left, right), -1 = unbounded.
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
  window_size: tuple[int, int] | None = None
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

  def _check(self):
    if self.attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {self.attn_mask_type!r}")
    kv_heads = self.num_gqa_groups or self.num_attention_heads
    if self.num_attention_heads % kv_heads:
      raise ValueError(f"num_gqa_groups={kv_heads} must divide num_attention_heads={self.num_attention_heads}")
    if not 0.0 < self.rotary_percent <= 1.0:
      raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
    rotary_dim = int(self.head_dim * self.rotary_percent) // 2 * 2
    if self.enable_rotary_pos_emb and rotary_dim < 2:
      raise ValueError(f"rotary_percent={self.rotary_percent} of head_dim={self.head_dim} leaves no feature pair")
    return kv_heads, rotary_dim

  def _axes(self, *names: str | None) -> tuple[str | None, ...]:
    return axes(self.logical_axes, *names)

  def _gathered(self, x, *names: str | None):
    """With ``logical_axes``, ``x`` (batch first) constrained to the batch sharding with its sequence gathered over the
    tensor-parallel axes (sequence parallelism: every tensor-parallel shard projects its heads over the whole
    sequence) and kept sharded over any other (context parallelism), its other axes named by ``names``."""
    if not self.logical_axes:
      return x
    return gather_sequence(x, (BATCH, SEQ, *names), 1)

  def _stream(self, x):
    """With ``logical_axes``, the input ``x`` (batch first, a residual stream) as the projections read it:
    ``_gathered``, its gradient handed back on the stream's (batch, seq, act_embed) shards."""
    return stream_input(x, (BATCH, SEQ, ACT_EMBED), 1) if self.logical_axes else x

  def _projection(self, name: str, features: tuple[int, ...], feature_axes: tuple[str | None, ...],
                  with_norm: bool, want_norm_output: bool, inputs: jax.Array, unstack_axis: int | None = None,
                  pass_input: bool = False, stream: bool = True):
    """(LayerNorm ->) a dense projection to ``features`` (unstacked along ``unstack_axis``) of ``inputs`` (batch first;
    with ``stream``, the module's input, read through ``_stream``); returns (output, the normalized input or None, and
    with ``pass_input`` and a norm, the input passed through the norm's layer (its gradient folds into the norm's
    backward), else None)."""
    kw = dict(features=features, unstack_axis=unstack_axis, use_bias=self.use_bias, kernel_init=self.kernel_init,
              bias_init=self.bias_init, kernel_axes=self._axes(EMBED, *feature_axes),
              bias_axes=self._axes(*feature_axes), dtype=self.dtype, param_dtype=self.param_dtype, recipe=self.recipe,
              name=name)
    if not with_norm:
      return DenseGeneral(**kw)(self._stream(inputs) if stream else inputs), None, None
    # The norm's layer reads the stream itself (input_axes): its dgrad GEMM then reduce-scatters onto the stream's
    # sequence shards (sequence parallelism), or every op stays on them (context parallelism).
    out = LayerNormDenseGeneral(norm_type=self.norm_type, epsilon=self.epsilon,
                                zero_centered_gamma=self.zero_centered_gamma,
                                return_layernorm_output=want_norm_output, ln_scale_axes=self._axes(EMBED),
                                ln_bias_axes=self._axes(EMBED), input_axes=self._axes(BATCH, SEQ, ACT_EMBED),
                                **kw)(inputs, return_input=pass_input)
    out = out if want_norm_output or pass_input else (out,)
    y, rest = out[0], list(out[1:])
    ln_out = rest.pop(0) if want_norm_output else None
    return y, ln_out, (rest.pop(0) if pass_input else None)

  def _rope(self, q, k, positions, rotary_dim: int, offset):
    """RoPE of q and k (batch first) at ``positions`` (B, S) / (S,), else ``offset + arange(S)``."""
    if positions is None:
      positions = query_positions(q.shape[1], offset)
    freqs = rope_frequencies(jnp.asarray(positions, jnp.int32), rotary_dim, self.rotary_base)
    rope = functools.partial(apply_rope, freqs=freqs, interleaved=self.rotary_interleaved)
    return rope(q), rope(k)

  def _decode_cache(self, k, v):
    """Appends k, v (B, S, Hk, D) at the cache index; returns the whole cache and the index the queries start at, or
    k, v and None at init."""
    initialized = self.has_variable("cache", "cached_key")
    cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
    index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:  # init: the cache takes the shape of this (full-length) input
      return k, v, None
    check_fits_cache(cached_k.value.shape, k.shape)
    i = index.value
    cached_k.value, cached_v.value, index.value = append_to_cache(cached_k.value, cached_v.value, i, k, v)
    return cached_k.value, cached_v.value, i

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               decode: bool = False, deterministic: bool | None = None, residual: jax.Array | None = None):
    """Attention of ``inputs_q`` over ``inputs_kv`` (self attention when it is None or the same array).

    Args:
      inputs_q: (B, T, hidden), or (T, B, hidden) with ``transpose_batch_sequence``.
      inputs_kv: (B, S, hidden) for cross attention; None (or ``inputs_q``) for self attention.
      mask: bool, int or float, True (nonzero) = attend (``mask_convention``), broadcastable to (B, H, T, S): the
        padding of a padding mask type or the "arbitrary" mask (``nn.make_attention_mask`` makes one).
      bias: a post-scale bias, broadcastable to (B, H, T, S).
      segment_ids: packed-sequence ids (B, S) or (q_ids, kv_ids), 0 = padding.
      positions: RoPE positions, (T,) or (B, T); default ``arange(T)`` (from the cache index when decoding).
      decode: use and update the KV cache (self attention only), which holds as many positions as the input it was
        initialized with; steps past its end give NaN outputs.
      deterministic: no dropout.
      residual: added to the output (``inputs_q``' shape and layout), in the output projection's GEMM epilogue;
        when it is ``inputs_q`` itself and the input is normalized here (a pre-LN block), its gradient is added inside
        the norm's backward kernel.

    Returns:
      The output (same layout as ``inputs_q``), and with ``return_layernorm_output`` also the normalized input.
    """
    self_attention = inputs_kv is None or inputs_kv is inputs_q
    if decode and not self_attention:
      raise ValueError("decode=True (KV cache) is for self attention: pass inputs_kv=None")
    if decode and segment_ids is not None:
      raise ValueError("decode=True does not take segment_ids")
    if self.context_parallel is not None:
      check_layer_options(decode=decode)
      if self.enable_rotary_pos_emb and self.cp_load_balanced and positions is None:
        raise ValueError("positions: with context_parallel and cp_load_balanced=True the sequence is in zig-zag order, "
                         "so RoPE needs its tokens' positions: pass positions=te_jax.zigzag_order(seq_len, cp) (or "
                         "cp_load_balanced=False for a sequence in its natural order)")
    kv_heads, rotary_dim = self._check()
    # The caller's mask in the one representation the attention computes with (True = masked out), converted once
    # here: the KV-cache path adds its own masked positions to it, and the attention below takes it as "te".
    mask = masked_out(mask, self.mask_convention)
    deterministic = resolve_deterministic(self, deterministic, attention_dropout=self.attention_dropout)
    for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
      if x is not None and x.ndim != 3:
        raise ValueError(f"{name} must be 3-D ((B, S, hidden), or (S, B, hidden) with transpose_batch_sequence), "
                         f"got shape {x.shape}")
    hidden = inputs_q.shape[-1]
    h = self.num_attention_heads
    xq = seq_first_to_batch_first(inputs_q, self.transpose_batch_sequence)
    xkv = xq if self_attention else seq_first_to_batch_first(inputs_kv, self.transpose_batch_sequence)

    d = self.head_dim
    # A residual that is the input itself (a pre-LN block) is taken from the input norm's layer, which then adds its
    # gradient inside the norm's backward kernel.
    pass_input = residual is not None and residual is inputs_q and self.input_layernorm
    if self_attention and self.fuse_qkv_params and kv_heads == h:
      # One (hidden, H, 3, D) kernel, heads major: with the heads sharded (tensor parallelism) every shard holds whole
      # heads of q, k and v, the GEMM's flattened output dim is sharded in contiguous blocks, and the unstacking is
      # shard-local. Unstacked by the projection, whose backward reads dq, dk and dv straight into its FP8 operand.
      (q, k, v), ln_out, x_passed = self._projection(
          "qkv", (h, 3, d), (HEADS, QKV, HEAD_DIM), self.input_layernorm, self.return_layernorm_output, xq,
          unstack_axis=-2, pass_input=pass_input)
    else:
      # GQA, cross attention or separate kernels: a query projection and one (hidden, Hk, 2, D) key/value kernel;
      # with an input norm on self attention, the norm's output feeds the key/value projection too.
      kv_from_norm = self_attention and self.input_layernorm
      q, ln_out, x_passed = self._projection("query", (h, d), (HEADS, HEAD_DIM), self.input_layernorm,
                                             self.return_layernorm_output or kv_from_norm, xq, pass_input=pass_input)
      kv_in = ln_out if kv_from_norm else xkv
      (k, v), _, _ = self._projection("kv", (kv_heads, 2, d), (HEADS, QKV, HEAD_DIM), False, False, kv_in,
                                      unstack_axis=-2, stream=not kv_from_norm)

    mask_type, bias_type, window = self.attn_mask_type, self.attn_bias_type, self.window_size
    if decode:
      if self.enable_rotary_pos_emb:
        initialized = self.has_variable("cache", "cache_index")
        offset = self.get_variable("cache", "cache_index") if initialized else None
        q, k = self._rope(q, k, positions, rotary_dim, offset)
      k, v, offset = self._decode_cache(k, v)
      if offset is not None:  # the queries' positions go into an explicit mask (and ALiBi bias)
        mask, bias, bias_type = decode_mask_and_bias(offset, q.shape[1], k.shape[1], mask, bias, bias_type,
                                                     window_size=self.window_size,
                                                     num_heads=self.num_attention_heads)
        mask_type, window = "arbitrary", None
    elif self.enable_rotary_pos_emb:
      q, k = self._rope(q, k, positions, rotary_dim, None)

    q, k, v = (self._gathered(t, HEADS, HEAD_DIM) for t in (q, k, v))
    attention = DotProductAttention(
        head_dim=d, num_attention_heads=h, num_gqa_groups=kv_heads, attn_mask_type=mask_type, attn_bias_type=bias_type,
        attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
        scale_factor=self.scale_factor, window_size=window, backend=self.backend, fp8_dpa=self.fp8_dpa,
        mask_convention="te", context_parallel=self.context_parallel, cp_strategy=self.cp_strategy,
        cp_load_balanced=self.cp_load_balanced, mesh=self.mesh, recipe=self.recipe, name="attention")
    out = self._gathered(attention(q, k, v, mask, bias, segment_ids=segment_ids, deterministic=deterministic), HEADS,
                         HEAD_DIM)
    if decode and offset is not None:  # past the cache's end its update was clamped: say so with NaN, not wrong values
      out = mark_overflow(out, offset, q.shape[1], k.shape[1])
    out = DenseGeneral(features=hidden, axis=(-2, -1), use_bias=self.use_bias, kernel_init=self.kernel_init,
                       bias_init=self.bias_init, kernel_axes=self._axes(HEADS, HEAD_DIM, EMBED),
                       bias_axes=self._axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype,
                       recipe=self.recipe,
                       # the residual stream's sharding (sequence parallel: the projection reduce-scatters onto it)
                       output_axes=self._axes(BATCH, SEQ, ACT_EMBED),
                       name="out")(out, x_passed if pass_input else
                                   seq_first_to_batch_first(residual, self.transpose_batch_sequence))
    out = seq_first_to_batch_first(out, self.transpose_batch_sequence)
    if self.return_layernorm_output:
      return out, seq_first_to_batch_first(ln_out, self.transpose_batch_sequence)
    return out


