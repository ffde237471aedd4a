"""Transformer building blocks: MultiHeadAttention, RelativePositionBiases and TransformerLayer.

They compose the fused layers: the QKV projection is a ``LayerNormDenseGeneral`` (the input norm writes the FP8
GEMM input directly), attention is ``te_jax.dot_product_attention`` (cuDNN flash attention where it supports the
configuration), RoPE is ``te_jax.apply_rope`` (one fused kernel), and the MLP is ``LayerNormMLP``. Under
``te_jax.autocast`` every GEMM is FP8 and its scaling state lives in the ``te_jax.FP8_COLLECTION`` collection, as in
the other modules.

Conventions (NVIDIA Transformer Engine's): masks are **True where attention is masked out**; tensors are
``(batch, sequence, hidden)`` unless ``transpose_batch_sequence`` makes them ``(sequence, batch, hidden)``. Dropout
draws from the ``dropout_rng_name`` rng stream unless ``deterministic``.

KV cache (decoding): ``decode=True`` keeps the keys and values of past steps in the ``"cache"`` collection
(``cached_key``, ``cached_value``: ``(batch, max_length, kv_heads, head_dim)``, and ``cache_index``). Initialise it
by calling ``init`` with ``decode=True`` on an input of the full length (the cache takes its shape); then each call
appends its tokens at ``cache_index`` and attends over the filled part of the cache, as Flax's own attention does.
The index is a traced value, so appending past the cache's length cannot raise inside ``jit``: as in Flax,
``lax.dynamic_update_slice`` then clamps the write position. Keep the tokens decoded within ``max_length``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.activation import activation
from te_jax.attention import ATTN_MASK_TYPES, alibi_bias_at, dot_product_attention
from te_jax.flax.attention import resolve_fp8
from te_jax.flax.dense import DenseGeneral, _is_int, _logical
from te_jax.flax.fused import LayerNormDenseGeneral, LayerNormMLP
from te_jax.flax.normalization import LayerNorm
from te_jax.rope import apply_rope, rope_frequencies

Initializer = Callable[..., jax.Array]

__all__ = ["MultiHeadAttention", "RelativePositionBiases", "TransformerLayer"]

LAYER_TYPES = ("encoder", "decoder")

# Logical axis names of the parameters (with ``logical_axes=True``): the hidden size, attention heads, the head dim,
# the q/k/v (or k/v) packing axis, the MLP's intermediate size and its gated-pair axis.
EMBED, HEADS, HEAD_DIM, QKV, MLP, ACT = "embed", "heads", "kv", "qkv", "mlp", "act"
# ... and of the activations between the blocks (the residual stream): batch, sequence, hidden. Mapping "seq" to the
# tensor-parallel mesh axis gives sequence parallelism (norms, dropout and residual adds on sequence shards).
BATCH, SEQ, ACT_EMBED = "batch", "seq", "act_embed"
LOGICAL_AXES = (EMBED, HEADS, HEAD_DIM, QKV, MLP, ACT, BATCH, SEQ, ACT_EMBED)


def _axes(enabled: bool, *names: str | None) -> tuple[str | None, ...]:
  """The logical axis names of a parameter, or () (no names) when the module does not name its axes."""
  return names if enabled else ()


def _seq_first_to_batch_first(x: jax.Array | None, transposed: bool) -> jax.Array | None:
  return x if x is None or not transposed else jnp.swapaxes(x, 0, 1)


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
    """The bucket of each ``key_position - query_position`` (numpy; static shapes only)."""
    n = -relative_position
    buckets = np.zeros_like(n)
    if bidirectional:
      num_buckets //= 2
      buckets += (n < 0).astype(n.dtype) * num_buckets
      n = np.abs(n)
    else:
      n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    with np.errstate(divide="ignore"):
      large = max_exact + (np.log(np.maximum(n, 1) / max_exact) / np.log(max_distance / max_exact)
                           * (num_buckets - max_exact)).astype(n.dtype)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(is_small, n, large)

  @nn.compact
  def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True,
               q_offset: jax.Array | int | None = None) -> jax.Array:
    """The bias ``(1, heads, q_seqlen, k_seqlen)`` to add to the attention logits (a post-scale bias).

    ``q_offset`` (may be traced, in ``[0, k_seqlen - q_seqlen]``): the queries are at positions ``q_offset + t``, as
    when decoding with a KV cache of ``k_seqlen`` keys; default 0.
    """
    if self.num_buckets < 4 or self.max_distance <= self.num_buckets // 4:
      raise ValueError(f"num_buckets must be >= 4 and max_distance > num_buckets / 4, got {self.num_buckets} and "
                       f"{self.max_distance}")
    if not (_is_int(q_seqlen) and _is_int(k_seqlen) and q_seqlen > 0 and k_seqlen > 0):
      raise ValueError(f"q_seqlen and k_seqlen must be positive ints, got {q_seqlen!r} and {k_seqlen!r}")
    if q_offset is not None and q_seqlen > k_seqlen:
      raise ValueError(f"with q_offset, q_seqlen={q_seqlen} must be at most k_seqlen={k_seqlen}")
    # The bias depends on key - query only: one value per head for each relative position (a one-hot matmul of that
    # size, exact), laid out as (q, k) by _diagonals. No (q, k, buckets) one-hot, and the table's gradient is a sum
    # over diagonals and buckets in a fixed order (no scatter). With an offset, every position a query can have
    # (-(k - 1) .. k - 1), then the q + k - 1 of this offset.
    lowest = 1 - (k_seqlen if q_offset is not None else q_seqlen)
    relative = np.arange(lowest, k_seqlen, dtype=np.int32)
    buckets = self.bucket(relative, bidirectional=bidirectional, num_buckets=self.num_buckets,
                          max_distance=self.max_distance)
    table = self.param("rel_embedding", _logical(self.embedding_init, self.embedding_axes),
                       (self.num_attention_heads, self.num_buckets), jnp.float32)
    one_hot = jnp.asarray(np.eye(self.num_buckets, dtype=np.float32)[buckets])  # (relative positions, buckets)
    per_relative = jnp.einsum("hb,rb->hr", table, one_hot)
    if q_offset is not None:  # relative position j - (q_offset + t) sits at index j - q_offset - t + k - 1
      start = k_seqlen - q_seqlen - jnp.asarray(q_offset, jnp.int32)
      per_relative = jax.lax.dynamic_slice_in_dim(per_relative, start, q_seqlen + k_seqlen - 1, axis=-1)
    return _diagonals(per_relative, q_seqlen, k_seqlen)[None].astype(self.dtype)


def _diagonals(per_relative: jax.Array, q: int, k: int) -> jax.Array:
  """``out[..., i, j] = per_relative[..., j - i + q - 1]`` for ``per_relative`` of length ``q + k - 1``: row i is the
  window starting at ``q - 1 - i``, cut from the rows repeated end to end (broadcast, reshape and slices, which XLA
  fuses into one pass over the output; their transposes are a pad and a sum)."""
  if q == 1:
    return per_relative[..., None, :k]
  lead, length = per_relative.shape[:-1], q + k - 1
  rows = jnp.broadcast_to(per_relative[..., None, :], (*lead, q, length)).reshape(*lead, q * length)
  # Flat index q - 1 + i (length - 1) + j is row i, column q - 1 - i + j: the window of row i, read at column j.
  windows = rows[..., q - 1:q - 1 + q * (length - 1)].reshape(*lead, q, length - 1)
  return windows[..., :k]


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
    layernorm_type, layernorm_epsilon, zero_centered_gamma: that norm's.
    return_layernorm_output: also return the normalized input (the residual of
      ``apply_residual_connection_post_layernorm``).
    attn_mask_type: one of ``te_jax.attention.ATTN_MASK_TYPES``; attn_bias_type: None, "no_bias",
      "post_scale_bias" or "alibi".
    enable_rotary_pos_emb: rotate queries and keys (RoPE); rotary_base: its wavelength base; rotary_percent: the
      fraction of each head's features that rotate; rotary_interleaved: GPT-J pairs (2i, 2i+1) instead of the
      half-split pairs (i, i + R/2) of GPT-NeoX and Llama.
    fuse_qkv_params: one QKV kernel (self attention), else separate query / key / value kernels.
    use_bias: biases on the projections.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    window_size: a sliding window (left, right), -1 = unbounded.
    transpose_batch_sequence: inputs and outputs are (S, B, hidden).
    kernel_init, bias_init: the projections' initializers.
    logical_axes: name the parameters' axes with the logical names of ``te_jax.flax.LOGICAL_AXES`` (map them to
      mesh axes with ``flax.linen.logical_axis_rules`` for tensor parallelism: heads and mlp sharded, embed
      replicated); in TransformerLayer also the residual stream's (batch, seq, act_embed).
    dtype, param_dtype, backend: compute dtype, parameter dtype, attention backend ("auto", "fused", "unfused").
    fp8_attention: the attention forward in FP8 (cuDNN); None (default): as the autocast recipe's ``fp8_dpa`` asks,
      where the configuration allows it.
  """

  head_dim: int
  num_attention_heads: int
  num_gqa_groups: int | None = None
  attention_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  input_layernorm: bool = True
  layernorm_type: str = "layernorm"
  layernorm_epsilon: float = 1e-6
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
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  backend: str = "auto"
  fp8_attention: bool | None = None

  def _check(self):
    if self.attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {self.attn_mask_type!r}")
    kv_heads = self.num_gqa_groups or self.num_attention_heads
    if self.num_attention_heads % kv_heads:
      raise ValueError(f"num_gqa_groups={kv_heads} must divide num_attention_heads={self.num_attention_heads}")
    if not 0.0 < self.rotary_percent <= 1.0:
      raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
    if not 0.0 <= self.attention_dropout < 1.0:
      raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}")
    rotary_dim = int(self.head_dim * self.rotary_percent) // 2 * 2
    if self.enable_rotary_pos_emb and rotary_dim < 2:
      raise ValueError(f"rotary_percent={self.rotary_percent} of head_dim={self.head_dim} leaves no feature pair")
    return kv_heads, rotary_dim

  def _axes(self, *names: str | None) -> tuple[str | None, ...]:
    return _axes(self.logical_axes, *names)

  def _projection(self, name: str, features: tuple[int, ...], feature_axes: tuple[str | None, ...],
                  with_norm: bool, want_norm_output: bool, inputs: jax.Array, unstack_axis: int | None = None,
                  pass_input: bool = False):
    """(LayerNorm ->) a dense projection to ``features`` (unstacked along ``unstack_axis``); returns (output, the
    normalized input or None, and with ``pass_input`` and a norm, the input passed through the norm's layer (its
    gradient folds into the norm's backward), else None)."""
    kw = dict(features=features, unstack_axis=unstack_axis, use_bias=self.use_bias, kernel_init=self.kernel_init,
              bias_init=self.bias_init, kernel_axes=self._axes(EMBED, *feature_axes),
              bias_axes=self._axes(*feature_axes), dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    if not with_norm:
      return DenseGeneral(**kw)(inputs), None, None
    out = LayerNormDenseGeneral(layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                                zero_centered_gamma=self.zero_centered_gamma,
                                return_layernorm_output=want_norm_output, scale_axes=self._axes(EMBED),
                                **kw)(inputs, return_input=pass_input)
    out = out if want_norm_output or pass_input else (out,)
    y, rest = out[0], list(out[1:])
    ln_out = rest.pop(0) if want_norm_output else None
    return y, ln_out, (rest.pop(0) if pass_input else None)

  def _rope(self, q, k, positions, rotary_dim: int, offset):
    """RoPE of q and k (batch first) at ``positions`` (B, S) / (S,), else ``offset + arange(S)``."""
    if positions is None:
      positions = jnp.arange(q.shape[1], dtype=jnp.int32)
      if offset is not None:
        positions = positions + offset
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
    batch, max_len, heads, dim = cached_k.value.shape
    steps = k.shape[1]
    if k.shape[0] != batch or k.shape[2:] != (heads, dim) or steps > max_len:
      raise ValueError(f"decode: keys {k.shape} do not fit the cache {cached_k.value.shape}")
    i = index.value
    cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k.astype(cached_k.value.dtype), (0, i, 0, 0))
    cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v.astype(cached_v.value.dtype), (0, i, 0, 0))
    index.value = i + steps
    return cached_k.value, cached_v.value, i

  def _decode_mask_and_bias(self, offset, steps: int, max_len: int, mask, bias, bias_type):
    """The attention's mask and bias for ``steps`` queries at positions ``offset + t`` over the ``max_len`` cached
    keys, with the query positions the attention itself cannot know: causal over the keys filled so far, the sliding
    window, ALiBi's distances. Returns (mask, bias, bias_type)."""
    query_pos = offset + jnp.arange(steps)[:, None]
    key_pos = jnp.arange(max_len)[None, :]
    masked = key_pos > query_pos  # query t sees the cached keys 0 .. offset + t
    if self.window_size is not None and self.window_size[0] >= 0:
      masked = masked | (key_pos < query_pos - self.window_size[0])
    mask = masked[None, None] if mask is None else jnp.logical_or(mask, masked[None, None])
    if bias_type == "alibi":
      bias = alibi_bias_at(self.num_attention_heads, query_pos[:, 0], key_pos[0])
      bias_type = "post_scale_bias"
    return mask, bias, bias_type

  @nn.compact
  def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array | None = None, mask: jax.Array | None = None,
               bias: jax.Array | None = None, *, segment_ids=None, positions: jax.Array | None = None,
               decode: bool = False, deterministic: bool = False, residual: jax.Array | None = None):
    """Attention of ``inputs_q`` over ``inputs_kv`` (self attention when it is None or the same array).

    Args:
      inputs_q: (B, T, hidden), or (T, B, hidden) with ``transpose_batch_sequence``.
      inputs_kv: (B, S, hidden) for cross attention; None (or ``inputs_q``) for self attention.
      mask: boolean, True = masked out, broadcastable to (B, H, T, S): the padding of a padding mask type or the
        "arbitrary" mask.
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
    kv_heads, rotary_dim = self._check()
    for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
      if x is not None and x.ndim != 3:
        raise ValueError(f"{name} must be 3-D ((B, S, hidden), or (S, B, hidden) with transpose_batch_sequence), "
                         f"got shape {x.shape}")
    hidden = inputs_q.shape[-1]
    h = self.num_attention_heads
    xq = _seq_first_to_batch_first(inputs_q, self.transpose_batch_sequence)
    xkv = xq if self_attention else _seq_first_to_batch_first(inputs_kv, self.transpose_batch_sequence)

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
                                      unstack_axis=-2)

    mask_type, bias_type, window = self.attn_mask_type, self.attn_bias_type, self.window_size
    if decode:
      if self.enable_rotary_pos_emb:
        initialized = self.has_variable("cache", "cache_index")
        offset = self.get_variable("cache", "cache_index") if initialized else None
        q, k = self._rope(q, k, positions, rotary_dim, offset)
      k, v, offset = self._decode_cache(k, v)
      if offset is not None:  # the queries' positions go into an explicit mask (and ALiBi bias)
        mask, bias, bias_type = self._decode_mask_and_bias(offset, q.shape[1], k.shape[1], mask, bias, bias_type)
        mask_type, window = "arbitrary", None
    elif self.enable_rotary_pos_emb:
      q, k = self._rope(q, k, positions, rotary_dim, None)

    rate = 0.0 if deterministic else self.attention_dropout
    rng = self.make_rng(self.dropout_rng_name) if rate > 0 else None
    kw = dict(segment_ids=segment_ids, attn_mask_type=mask_type, attn_bias_type=bias_type,
              scale_factor=self.scale_factor, dropout_rate=rate, window_size=window, backend=self.backend)
    fp8 = resolve_fp8(self.fp8_attention, q, k, v, bias, mask, **kw)
    out = dot_product_attention(q, k, v, bias, mask, dropout_rng=rng, fp8=fp8, **kw)
    if decode and offset is not None:  # past the cache's end its update was clamped: say so with NaN, not wrong values
      out = jnp.where(offset + q.shape[1] <= k.shape[1], out, jnp.asarray(jnp.nan, out.dtype))
    out = DenseGeneral(features=hidden, axis=(-2, -1), use_bias=self.use_bias, kernel_init=self.kernel_init,
                       bias_init=self.bias_init, kernel_axes=self._axes(HEADS, HEAD_DIM, EMBED),
                       bias_axes=self._axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype,
                       name="out")(out, x_passed if pass_input else
                                   _seq_first_to_batch_first(residual, self.transpose_batch_sequence))
    out = _seq_first_to_batch_first(out, self.transpose_batch_sequence)
    if self.return_layernorm_output:
      return out, _seq_first_to_batch_first(ln_out, self.transpose_batch_sequence)
    return out


class TransformerLayer(nn.Module):
  """One Transformer layer: self attention, (decoder) cross attention, MLP, each with dropout and a residual.

  Pre-LN (default): ``x + Attn(LN(x))``, then ``x + MLP(LN(x))``, the norms fused into the FP8 GEMMs after them.
  Post-LN (``output_layernorm=True``, the original Transformer and BERT): ``LN(x + Attn(x))``, ``LN(x + MLP(x))``.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> layer = te_flax.TransformerLayer(hidden_size=64, mlp_hidden_size=128, num_attention_heads=4)
  >>> x = jnp.ones((2, 8, 64), jnp.bfloat16)
  >>> y, variables = layer.init_with_output(jax.random.key(0), x, deterministic=True)
  >>> y.shape, sorted(variables["params"])
  ((2, 8, 64), ['mlp', 'self_attention'])

  Attributes:
    hidden_size, mlp_hidden_size, num_attention_heads: the sizes (hidden_size is the inputs' last dim); head_dim
      defaults to hidden / heads.
    num_gqa_groups: key/value heads (GQA).
    layer_type: "encoder" (self attention, default mask "padding") or "decoder" (causal self attention, and cross
      attention over ``encoded`` when it is given).
    self_attn_mask_type: overrides the layer type's default self-attention mask type.
    self_attn_bias_type: None, "no_bias", "post_scale_bias", "alibi"; enable_relative_embedding: add T5 relative
      position biases (RelativePositionBiases with ``relative_embedding_buckets`` / ``_max_distance``) as that bias.
    layernorm_type, layernorm_epsilon, zero_centered_gamma: the norms'.
    hidden_dropout, attention_dropout, intermediate_dropout: dropout after attention and MLP (before the residual
      add), on the attention probabilities, and on the MLP's activation output.
    mlp_activations: e.g. ("gelu",), ("silu", "linear") for SwiGLU.
    use_bias: biases on every projection.
    apply_residual_connection_post_layernorm: each block's residual is its normalized input instead of its input
      (Megatron's option; self attention, cross attention and MLP alike), pre-LN only.
    output_layernorm: post-LN.
    enable_rotary_pos_emb, rotary_base, rotary_percent, rotary_interleaved: RoPE in self attention.
    window_size: sliding window of self attention.
    transpose_batch_sequence: inputs and outputs are (S, B, hidden).
    dtype, param_dtype, backend, logical_axes: as in MultiHeadAttention; kernel_init: every kernel's initializer.
  """

  hidden_size: int = 512
  mlp_hidden_size: int = 2048
  num_attention_heads: int = 8
  head_dim: int | None = None
  num_gqa_groups: int | None = None
  layer_type: str = "encoder"
  self_attn_mask_type: str | None = None
  self_attn_bias_type: str | None = None
  enable_relative_embedding: bool = False
  relative_embedding_buckets: int = 32
  relative_embedding_max_distance: int = 128
  layernorm_type: str = "layernorm"
  layernorm_epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  hidden_dropout: float = 0.0
  attention_dropout: float = 0.0
  intermediate_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  mlp_activations: Sequence[str] = ("gelu",)
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
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  backend: str = "auto"
  logical_axes: bool = False

  def _check(self):
    if self.layer_type not in LAYER_TYPES:
      raise ValueError(f"layer_type must be one of {LAYER_TYPES}, got {self.layer_type!r}")
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                       f"{self.num_attention_heads}: give head_dim")
    if self.apply_residual_connection_post_layernorm and self.output_layernorm:
      raise ValueError("apply_residual_connection_post_layernorm is a pre-LN option; output_layernorm=True is post-LN")
    for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

  def _mha(self, name: str, mask_type: str, bias_type, rope: bool, **kw) -> MultiHeadAttention:
    return MultiHeadAttention(
        head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
        num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
        attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
        input_layernorm=not self.output_layernorm, layernorm_type=self.layernorm_type,
        layernorm_epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
        attn_mask_type=mask_type, attn_bias_type=bias_type, enable_rotary_pos_emb=rope,
        rotary_base=self.rotary_base, rotary_percent=self.rotary_percent, rotary_interleaved=self.rotary_interleaved,
        use_bias=self.use_bias, kernel_init=self.kernel_init, dtype=self.dtype, param_dtype=self.param_dtype,
        backend=self.backend, logical_axes=self.logical_axes, name=name, **kw)

  def _axes(self, *names: str | None) -> tuple[str | None, ...]:
    return _axes(self.logical_axes, *names)

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
    return LayerNorm(layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                     zero_centered_gamma=self.zero_centered_gamma, scale_axes=self._axes(EMBED),
                     bias_axes=self._axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype, name=name)(x)

  def _plain_mlp(self, x, deterministic: bool):
    names = tuple(self.mlp_activations)
    n_act = 2 if len(names) == 2 else 1
    dense = functools.partial(DenseGeneral, use_bias=self.use_bias, kernel_init=self.kernel_init, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    h = dense(features=(n_act, self.mlp_hidden_size), kernel_axes=self._axes(EMBED, ACT, MLP),
              bias_axes=self._axes(ACT, MLP), name="wi")(x)
    a = activation(h if n_act == 2 else h[..., 0, :], names)
    a = nn.Dropout(self.intermediate_dropout, rng_collection=self.dropout_rng_name)(a, deterministic=deterministic)
    return dense(features=x.shape[-1], kernel_axes=self._axes(MLP, EMBED), bias_axes=self._axes(EMBED), name="wo")(a)

  @nn.compact
  def __call__(self, inputs: jax.Array, encoded: jax.Array | None = None, attention_mask: jax.Array | None = None,
               encoder_decoder_mask: jax.Array | None = None, *, segment_ids=None,
               positions: jax.Array | None = None, deterministic: bool = False, decode: bool = False) -> jax.Array:
    """The layer's output, shaped as ``inputs``.

    Args:
      inputs: (B, S, hidden), or (S, B, hidden) with ``transpose_batch_sequence``.
      encoded: the encoder output a decoder attends to (cross attention); None for none.
      attention_mask: self attention's padding / arbitrary mask, True = masked out.
      encoder_decoder_mask: cross attention's mask, True = masked out.
      segment_ids: packed-sequence ids for self attention.
      positions: RoPE positions.
      deterministic: no dropout.
      decode: use and update the self-attention KV cache (as long as the input it was initialized with; steps past
        its end give NaN outputs).
    """
    self._check()
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
                     transpose_batch_sequence=self.transpose_batch_sequence)
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
      mlp = LayerNormMLP(intermediate_dim=self.mlp_hidden_size, activations=tuple(self.mlp_activations),
                         intermediate_dropout_rate=self.intermediate_dropout, use_bias=self.use_bias,
                         return_layernorm_output=post_residual,
                         layernorm_type=self.layernorm_type, epsilon=self.layernorm_epsilon,
                         zero_centered_gamma=self.zero_centered_gamma, kernel_init=self.kernel_init,
                         kernel_axes_1=self._axes(EMBED, ACT, MLP), kernel_axes_2=self._axes(MLP, EMBED),
                         bias_axes_1=self._axes(ACT, MLP), bias_axes_2=self._axes(EMBED),
                         scale_axes=self._axes(EMBED), dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")
      x = self._residual_block(lambda r: mlp(x, deterministic=deterministic, residual=r), x, deterministic)
    if self.output_layernorm:
      x = self._post_ln("mlp_layernorm", x)
    return x
