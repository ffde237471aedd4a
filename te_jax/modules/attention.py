"""The bodies of the attention modules (``te_jax.flax``, ``te_jax.nnx``): ``DotProductAttention`` (attention over
projected q, k, v), ``MultiHeadAttention`` ((norm ->) QKV projection -> RoPE -> attention -> output projection, with
its sharding and KV cache) and T5's ``RelativePositionBiases``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from te_jax.fused.attention import (ATTN_MASK_TYPES, QKV_LAYOUTS, AttentionBackend, attention_backend,
                                    dot_product_attention, fp8_dpa_enabled, layout_for)
from te_jax.fused.attention_config import check_mask_convention, check_softmax_type, masked_out, position_pair
from te_jax.fused.attention_sequences import resolve_sequences, sequence_shape
from te_jax.fused.context_parallel import check_layer_options, context_parallel_attention, context_parallel_backend
from te_jax.modules.attention_cache import (KVCache, check_fits_cache, decode_mask_and_bias, mark_overflow,
                                           query_positions)
from te_jax.modules.axes import (ACT_EMBED, BATCH, EMBED, HEAD_DIM, HEADS, QKV, SEQ, Initializer, axes,
                                 context_parallel_axes, gather_sequence, seq_first_to_batch_first, stream_input)
from te_jax.modules.dense import DenseGeneralOptions
from te_jax.modules.layernorm_dense import LayerNormDenseGeneralOptions
from te_jax.modules.relative_position import check_relative_position_options, relative_position_bias
from te_jax.modules.scope import Scope
from te_jax.ops.rope import apply_rope, rope_frequencies
from te_jax.recipe import Recipe

__all__ = ["AttentionRunOptions", "DotProductAttentionOptions", "MultiHeadAttentionOptions", "RelativePositionBiasesOptions",
           "attention_backend_for", "dot_product_attention_block", "dot_product_attention_params",
           "multi_head_attention", "multi_head_attention_params", "relative_position_biases"]

_zeros = jax.nn.initializers.zeros


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionRunOptions:
  """How an attention layer runs, the options every attention module (and TransformerLayer) has: its backend, FP8
  attention, the mask convention, context parallelism and the FP8 recipe."""

  backend: str
  fp8_dpa: bool | None
  mask_convention: str
  context_parallel: str | None
  cp_strategy: str
  cp_load_balanced: bool
  mesh: Any
  recipe: Recipe | None

  def run_options(self) -> dict[str, Any]:
    """These options by name, for a submodule that runs as this module does."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(AttentionRunOptions)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotProductAttentionOptions(AttentionRunOptions):
  """The options of ``DotProductAttention``: the linen module's attributes (documented there, with their defaults)
  but ``deterministic``, which each framework resolves its own way."""

  head_dim: int
  num_attention_heads: int
  num_gqa_groups: int | None
  attn_mask_type: str
  attn_bias_type: str | None
  attention_dropout: float
  dropout_rng_name: str
  qkv_layout: str
  scale_factor: float | None
  window_size: tuple[int, int] | None
  softmax_type: str
  transpose_batch_sequence: bool
  dtype: Any

  def __post_init__(self):
    check_mask_convention(self.mask_convention)
    layout_for(self.qkv_layout, self.transpose_batch_sequence)
    check_softmax_type(self.softmax_type)
    if self.context_parallel is not None:
      check_layer_options(attn_bias_type=self.attn_bias_type, window_size=self.window_size, fp8_dpa=self.fp8_dpa,
                          transpose_batch_sequence=self.transpose_batch_sequence)
      _check_context_parallel_softmax(self.softmax_type)

  @property
  def layout(self) -> str:
    """The qkv layout ``te_jax.dot_product_attention`` takes (its "SB" form with ``transpose_batch_sequence``)."""
    return layout_for(self.qkv_layout, self.transpose_batch_sequence)


def _check_context_parallel_softmax(softmax_type: str) -> None:
  if softmax_type != "vanilla":
    raise ValueError(f"softmax_type: context_parallel attention does not support softmax_type={softmax_type!r} (only "
                     "'vanilla')")


def dot_product_attention_params(scope: Scope, o: DotProductAttentionOptions) -> jax.Array | None:
  """The module's variables: the dropout's key stream (NNX: ``rngs``), with attention dropout; the learnable
  softmax's ``softmax_offset`` (1, H, 1, 1), float32, zeros at first (Transformer Engine's name, shape and
  initialization), which it returns (None for the other softmax types)."""
  scope.declare_rng("rngs", o.dropout_rng_name, o.attention_dropout > 0)
  if o.softmax_type != "learnable":
    return None
  return scope.param("softmax_offset", _zeros, (1, o.num_attention_heads, 1, 1), jnp.float32)


def _check_heads(o: DotProductAttentionOptions, query, key, layout: str) -> None:
  kv = query if QKV_LAYOUTS[layout][1] == "qkv" else key
  q_heads, q_dim = query.shape[-2:]
  expected_kv = o.num_gqa_groups or o.num_attention_heads
  if q_dim != o.head_dim:
    raise ValueError(f"head_dim={o.head_dim} but the query's last dim is {q_dim}")
  if q_heads != o.num_attention_heads:
    raise ValueError(f"num_attention_heads={o.num_attention_heads} but the query has {q_heads} heads")
  if kv is not None and kv.shape[-2] != expected_kv:
    raise ValueError(f"num_gqa_groups={o.num_gqa_groups} expects {expected_kv} key/value heads, the key has "
                     f"{kv.shape[-2]}")


def _check_mask_type(attn_mask_type: str | None) -> None:
  if attn_mask_type is not None and attn_mask_type not in ATTN_MASK_TYPES:
    raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")


def _sequences(o: DotProductAttentionOptions, query, key, mask, segment_ids, segment_pos, attn_mask_type):
  """The call's ``mask``, ``segment_ids``, ``segment_pos``, a ``SequenceDescriptor`` (as the mask or the segment
  ids) converted once into segment ids and positions."""
  _check_mask_type(attn_mask_type)
  batch, q_len, kv_len = sequence_shape(query, key, o.layout)
  return resolve_sequences(mask, segment_ids, segment_pos, batch=batch, q_len=q_len, kv_len=kv_len,
                           attn_mask_type=attn_mask_type or o.attn_mask_type)


def _attention_kwargs(o: DotProductAttentionOptions, segment_ids, segment_pos, rate: float,
                      attn_mask_type: str | None, attn_bias_type: str | None,
                      window_size: tuple[int, int] | None) -> dict:
  _check_mask_type(attn_mask_type)
  return dict(segment_ids=segment_ids, segment_pos=segment_pos, dropout_rate=rate,
              attn_mask_type=attn_mask_type or o.attn_mask_type, attn_bias_type=attn_bias_type or o.attn_bias_type,
              scale_factor=o.scale_factor,
              window_size=o.window_size if window_size is None else window_size, qkv_layout=o.layout,
              backend=o.backend, mask_convention=o.mask_convention, softmax_type=o.softmax_type)


def _without_positions(kw: dict) -> dict:
  """``kw`` less ``segment_pos``, which context parallelism does not take (it raises when one is given)."""
  if kw["segment_pos"] is not None:
    raise ValueError("segment_pos: context_parallel attention takes the tokens at their indices (its own zig-zag "
                     "order); give segment_ids without positions (a SequenceDescriptor from seqlens)")
  return {k: v for k, v in kw.items() if k != "segment_pos"}


def _context_parallel_kwargs(o: DotProductAttentionOptions, kw: dict, bias) -> dict:
  """The arguments of ``context_parallel_attention`` from the call's, checked for what it does not combine with."""
  check_layer_options(bias=bias, attn_bias_type=kw["attn_bias_type"], window_size=kw["window_size"],
                      fp8_dpa=o.fp8_dpa, transpose_batch_sequence=o.transpose_batch_sequence)
  kw = _without_positions(kw)
  kw = {k: v for k, v in kw.items() if k not in ("attn_bias_type", "window_size", "mask_convention", "softmax_type",
                                                 "softmax_offset")}
  return dict(axis=o.context_parallel, mesh=o.mesh, strategy=o.cp_strategy, load_balanced=o.cp_load_balanced,
              **context_parallel_axes(), **kw)


def dot_product_attention_block(scope: Scope, o: DotProductAttentionOptions, query, key, value, mask, bias, *,
                                segment_ids, deterministic: bool, attn_mask_type: str | None = None,
                                attn_bias_type: str | None = None, window_size: tuple[int, int] | None = None,
                                segment_pos=None) -> jax.Array:
  """``DotProductAttention``'s call (documented on the linen module), ``deterministic`` resolved by the framework;
  ``attn_mask_type``, ``attn_bias_type``, ``window_size``: this call's, None for the module's; ``mask`` or
  ``segment_ids`` may be a ``SequenceDescriptor``."""
  rate = 0.0 if deterministic else o.attention_dropout
  mask, segment_ids, segment_pos = _sequences(o, query, key, mask, segment_ids, segment_pos, attn_mask_type)
  kw = _attention_kwargs(o, segment_ids, segment_pos, rate, attn_mask_type, attn_bias_type, window_size)
  kw["softmax_offset"] = dot_product_attention_params(scope, o)
  _check_heads(o, query, key, kw["qkv_layout"])
  if o.dtype is not None:
    query, key, value = (None if x is None else x.astype(o.dtype) for x in (query, key, value))
  if o.context_parallel is not None:
    return context_parallel_attention(query, key, value, mask=mask, **_context_parallel_kwargs(o, kw, bias))
  rng = scope.rng("rngs", o.dropout_rng_name) if rate > 0 else None
  fp8_dpa = fp8_dpa_enabled(o.fp8_dpa, query, key, value, bias, mask, **kw, recipe=o.recipe)
  return dot_product_attention(query, key, value, bias, mask, dropout_rng=rng, fp8_dpa=fp8_dpa, **kw)


def attention_backend_for(o: DotProductAttentionOptions, query, key=None, value=None, mask=None, bias=None, *,
                          segment_ids=None, deterministic: bool = True, segment_pos=None) -> AttentionBackend:
  """Which backend the call with these arguments (arrays or ``jax.ShapeDtypeStruct``) runs on, and why."""
  cast = [None if x is None else jax.ShapeDtypeStruct(x.shape, o.dtype or query.dtype) for x in (query, key, value)]
  mask, segment_ids, segment_pos = _sequences(o, query, key, mask, segment_ids, segment_pos, None)
  kw = _attention_kwargs(o, segment_ids, segment_pos, 0.0 if deterministic else o.attention_dropout, None, None,
                         None)
  if o.softmax_type == "learnable":
    kw["softmax_offset"] = jax.ShapeDtypeStruct((1, o.num_attention_heads, 1, 1), jnp.float32)
  if o.context_parallel is not None:
    return context_parallel_backend(*cast, strategy=o.cp_strategy, **_without_positions(kw))
  fp8_dpa = fp8_dpa_enabled(o.fp8_dpa, *cast, bias, mask, **kw, recipe=o.recipe)
  return attention_backend(*cast, bias, mask, fp8_dpa=fp8_dpa, **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RelativePositionBiasesOptions:
  """The options of ``RelativePositionBiases``: the linen module's attributes (documented there)."""

  num_buckets: int
  max_distance: int
  num_attention_heads: int
  embedding_init: Initializer
  embedding_axes: tuple[str | None, ...]
  dtype: Any

  def __post_init__(self):
    check_relative_position_options(self.num_buckets, self.max_distance, self.num_attention_heads)
    object.__setattr__(self, "embedding_axes", tuple(self.embedding_axes))


def relative_position_biases(scope: Scope, o: RelativePositionBiasesOptions, q_seqlen: int | None = None,
                             k_seqlen: int | None = None, bidirectional: bool = True, q_offset=None):
  """The ``rel_embedding`` table (heads, buckets), float32; with the lengths, ``RelativePositionBiases``' call (the
  bias ``(1, heads, q_seqlen, k_seqlen)``)."""
  table = scope.param("rel_embedding", o.embedding_init, (o.num_attention_heads, o.num_buckets), jnp.float32,
                      axes=o.embedding_axes)
  if q_seqlen is None:
    return table
  return relative_position_bias(table, q_seqlen, k_seqlen, bidirectional=bidirectional, max_distance=o.max_distance,
                                q_offset=q_offset, dtype=o.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiHeadAttentionOptions(AttentionRunOptions):
  """The options of ``MultiHeadAttention``: the linen module's attributes (documented there, with their defaults)
  but ``deterministic``; the NNX module maps its constructor's arguments onto them."""

  head_dim: int
  num_attention_heads: int
  num_gqa_groups: int | None
  attention_dropout: float
  dropout_rng_name: str
  input_layernorm: bool
  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  return_layernorm_output: bool
  attn_mask_type: str
  attn_bias_type: str | None
  enable_rotary_pos_emb: bool
  rotary_base: float
  rotary_percent: float
  rotary_interleaved: bool
  fuse_qkv_params: bool
  use_bias: bool
  scale_factor: float | None
  scale_attn_logits: bool
  window_size: tuple[int, int] | None
  softmax_type: str
  transpose_batch_sequence: bool
  kernel_init: Initializer
  bias_init: Initializer
  logical_axes: bool
  dtype: Any
  param_dtype: Any

  def __post_init__(self):
    if self.attn_mask_type not in ATTN_MASK_TYPES:
      raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {self.attn_mask_type!r}")
    if self.num_attention_heads % self.kv_heads:
      raise ValueError(f"num_gqa_groups={self.kv_heads} must divide num_attention_heads={self.num_attention_heads}")
    if not 0.0 < self.rotary_percent <= 1.0:
      raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
    if self.enable_rotary_pos_emb and self.rotary_dim < 2:
      raise ValueError(f"rotary_percent={self.rotary_percent} of head_dim={self.head_dim} leaves no feature pair")
    if not self.scale_attn_logits and self.scale_factor is not None:
      raise ValueError(f"scale_attn_logits=False leaves the logits unscaled, and scale_factor={self.scale_factor} "
                       "asks for a scale: give one of the two (scale_factor=1.0 is scale_attn_logits=False)")
    check_mask_convention(self.mask_convention)
    check_softmax_type(self.softmax_type)
    if self.context_parallel is not None:
      _check_context_parallel_softmax(self.softmax_type)

  @property
  def kv_heads(self) -> int:
    return self.num_gqa_groups or self.num_attention_heads

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.rotary_percent) // 2 * 2

  def fused_qkv(self, self_attention: bool) -> bool:
    """One ``qkv`` kernel (self attention without GQA), else ``query`` and ``kv``."""
    return self_attention and self.fuse_qkv_params and self.kv_heads == self.num_attention_heads

  def axes(self, *names: str | None) -> tuple[str | None, ...]:
    return axes(self.logical_axes, *names)

  def projection(self, features: tuple[int, ...], feature_axes: tuple[str | None, ...], with_norm: bool,
                 want_norm_output: bool, unstack_axis: int | None = None):
    """The options of a projection of the hidden size to ``features`` (LayerNormDenseGeneral ``with_norm``)."""
    kw = dict(features=features, unstack_axis=unstack_axis, use_bias=self.use_bias, kernel_init=self.kernel_init,
              bias_init=self.bias_init, kernel_axes=self.axes(EMBED, *feature_axes),
              bias_axes=self.axes(*feature_axes), dtype=self.dtype, param_dtype=self.param_dtype, recipe=self.recipe,
              quantization_checkpoint_name=None)
    if not with_norm:
      return DenseGeneralOptions(axis=-1, batch_dims=(), precision=None, dot_general=None, dot_general_cls=None,
                                 output_axes=(), **kw)
    # The norm's layer reads the stream itself (input_axes): its dgrad GEMM then reduce-scatters onto the stream's
    # sequence shards (sequence parallelism), or every op stays on them (context parallelism).
    return LayerNormDenseGeneralOptions(
        norm_type=self.norm_type, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
        return_layernorm_output=want_norm_output, ln_scale_init=None, ln_scale_axes=self.axes(EMBED),
        ln_bias_init=_zeros, ln_bias_axes=self.axes(EMBED), input_axes=self.axes(BATCH, SEQ, ACT_EMBED), **kw)

  def attention(self) -> DotProductAttentionOptions:
    """The options of the ``attention`` submodule (batch-first q, k, v; masks True = masked out)."""
    return DotProductAttentionOptions(
        head_dim=self.head_dim, num_attention_heads=self.num_attention_heads, num_gqa_groups=self.kv_heads,
        attn_mask_type=self.attn_mask_type, attn_bias_type=self.attn_bias_type,
        attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name, qkv_layout="BSHD",
        scale_factor=self.scale_factor if self.scale_attn_logits else 1.0, window_size=self.window_size,
        softmax_type=self.softmax_type, transpose_batch_sequence=False, dtype=None,
        **{**self.run_options(), "mask_convention": "te"})

  def output(self, hidden: int) -> DenseGeneralOptions:
    """The options of the ``out`` projection of the heads back to ``hidden``, its output the residual stream's
    sharding (sequence parallel: the projection reduce-scatters onto it)."""
    return DenseGeneralOptions(
        features=(hidden,), axis=(-2, -1), batch_dims=(), unstack_axis=None, use_bias=self.use_bias,
        kernel_init=self.kernel_init, bias_init=self.bias_init, dtype=self.dtype, param_dtype=self.param_dtype,
        precision=None, dot_general=None, dot_general_cls=None, kernel_axes=self.axes(HEADS, HEAD_DIM, EMBED),
        bias_axes=self.axes(EMBED), output_axes=self.axes(BATCH, SEQ, ACT_EMBED), recipe=self.recipe,
        quantization_checkpoint_name=None)


class AttentionParts(NamedTuple):
  """The submodules of a ``MultiHeadAttention``: ``qkv``, or ``query`` and ``kv``; ``attention``; ``out``."""

  qkv: Any
  query: Any
  kv: Any
  attention: Any
  out: Any


def multi_head_attention_params(scope: Scope, o: MultiHeadAttentionOptions, hidden: int,
                                self_attention: bool) -> AttentionParts:
  """The submodules of an attention layer over inputs of last dim ``hidden``, in the order NNX creates them."""
  h, d = o.num_attention_heads, o.head_dim
  qkv = query = kv = None
  if o.fused_qkv(self_attention):
    # One (hidden, H, 3, D) kernel, heads major: with the heads sharded (tensor parallelism) every shard holds whole
    # heads of q, k and v, the GEMM's flattened output dim is sharded in contiguous blocks, and the unstacking is
    # shard-local. Unstacked by the projection, whose backward reads dq, dk and dv straight into its FP8 operand.
    qkv = scope.submodule("qkv", o.projection((h, 3, d), (HEADS, QKV, HEAD_DIM), o.input_layernorm,
                                              o.return_layernorm_output, -2), hidden)
  else:
    # GQA or cross attention: a query projection and one (hidden, Hk, 2, D) key/value kernel; fuse_qkv_params=False:
    # separate query, key and value kernels (Transformer Engine's). With an input norm on self attention, the norm's
    # output feeds the key/value projections too.
    kv_from_norm = self_attention and o.input_layernorm
    query = scope.submodule("query", o.projection((h, d), (HEADS, HEAD_DIM), o.input_layernorm,
                                                  o.return_layernorm_output or kv_from_norm), hidden)
    if o.fuse_qkv_params:
      kv = scope.submodule("kv", o.projection((o.kv_heads, 2, d), (HEADS, QKV, HEAD_DIM), False, False, -2), hidden)
    else:
      key, value = (scope.submodule(n, o.projection((o.kv_heads, d), (HEADS, HEAD_DIM), False, False), hidden)
                    for n in ("key", "value"))
      kv = lambda x: (key(x), value(x))  # noqa: E731
  attention = scope.submodule("attention", o.attention())
  out = scope.submodule("out", o.output(hidden), (h, d))
  return AttentionParts(qkv, query, kv, attention, out)


def _split_projection(out, want_norm_output: bool, pass_input: bool):
  """A normed projection's output as (y, the normalized input or None, the passed-through input or None)."""
  out = out if want_norm_output or pass_input else (out,)
  y, rest = out[0], list(out[1:])
  ln_out = rest.pop(0) if want_norm_output else None
  return y, ln_out, (rest.pop(0) if pass_input else None)


def _rope(o: MultiHeadAttentionOptions, q, k, positions, offset, self_attention: bool, segment_pos=None):
  """RoPE of q and k (batch first): the queries at ``positions`` (B, T) / (T,), else ``offset + arange(T)``; the keys
  of self attention at the queries' positions, those of cross attention at ``arange(S)`` (their own sequence). With
  ``segment_pos`` (packed sequences), the queries and keys each at their positions within their segments."""
  rope = functools.partial(apply_rope, interleaved=o.rotary_interleaved)
  if segment_pos is not None:
    q_pos, kv_pos = position_pair(segment_pos, q.shape[0], q.shape[1], k.shape[1])
    q_freqs = rope_frequencies(q_pos.astype(jnp.int32), o.rotary_dim, o.rotary_base)
    k_freqs = q_freqs if kv_pos is q_pos else rope_frequencies(kv_pos.astype(jnp.int32), o.rotary_dim,
                                                                o.rotary_base)
    return rope(q, freqs=q_freqs), rope(k, freqs=k_freqs)
  if positions is None:
    positions = query_positions(q.shape[1], offset)
  q_freqs = rope_frequencies(jnp.asarray(positions, jnp.int32), o.rotary_dim, o.rotary_base)
  k_freqs = q_freqs if self_attention else rope_frequencies(query_positions(k.shape[1]), o.rotary_dim, o.rotary_base)
  return rope(q, freqs=q_freqs), rope(k, freqs=k_freqs)


def multi_head_attention(scope: Scope, o: MultiHeadAttentionOptions, inputs_q: jax.Array, inputs_kv=None, mask=None,
                         bias=None, *, segment_ids=None, positions=None, decode: bool = False,
                         deterministic: bool = True, residual=None, attn_mask_type: str | None = None,
                         cache: KVCache | None = None, segment_pos=None):
  """``MultiHeadAttention``'s call (documented on the linen module), ``deterministic`` and ``decode`` resolved by the
  framework, whose ``cache`` holds the keys and values of past steps when decoding."""
  self_attention = inputs_kv is None or inputs_kv is inputs_q
  if decode and not self_attention:
    raise ValueError("decode=True (KV cache) is for self attention: pass inputs_kv=None")
  if attn_mask_type is not None and attn_mask_type not in ATTN_MASK_TYPES:
    raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
  for name, x in (("inputs_q", inputs_q), ("inputs_kv", inputs_kv)):
    if x is not None and x.ndim != 3:
      raise ValueError(f"{name} must be 3-D ((B, S, hidden), or (S, B, hidden) with transpose_batch_sequence), "
                       f"got shape {x.shape}")
  seq = 0 if o.transpose_batch_sequence else 1
  mask, segment_ids, segment_pos = resolve_sequences(
      mask, segment_ids, segment_pos, batch=inputs_q.shape[1 - seq], q_len=inputs_q.shape[seq],
      kv_len=(inputs_q if self_attention else inputs_kv).shape[seq], attn_mask_type=attn_mask_type or o.attn_mask_type)
  if decode and (segment_ids is not None or segment_pos is not None):
    raise ValueError("decode=True does not take segment_ids, segment_pos or a SequenceDescriptor")
  if segment_pos is not None and positions is not None:
    raise ValueError("positions are RoPE's and segment_pos (or a SequenceDescriptor's) gives RoPE and the masks the "
                     "tokens' positions within their segments: give one of the two")
  if o.context_parallel is not None:
    check_layer_options(decode=decode)
    if o.enable_rotary_pos_emb and o.cp_load_balanced and not self_attention:
      raise ValueError("enable_rotary_pos_emb: with context_parallel and cp_load_balanced=True the keys of cross "
                       "attention are in zig-zag order, and RoPE takes them at arange(S): give cp_load_balanced=False "
                       "(or no RoPE)")
    if o.enable_rotary_pos_emb and o.cp_load_balanced and positions is None:
      raise ValueError("positions: with context_parallel and cp_load_balanced=True the sequence is in zig-zag order, "
                       "so RoPE needs its tokens' positions: pass positions=te_jax.zigzag_order(seq_len, cp) (or "
                       "cp_load_balanced=False for a sequence in its natural order)")
  # The caller's mask in the one representation the attention computes with (True = masked out), converted once
  # here: the KV-cache path adds its own masked positions to it, and the attention takes it as "te".
  mask = masked_out(mask, o.mask_convention)
  h, d = o.num_attention_heads, o.head_dim
  xq = seq_first_to_batch_first(inputs_q, o.transpose_batch_sequence)
  xkv = xq if self_attention else seq_first_to_batch_first(inputs_kv, o.transpose_batch_sequence)
  offset = None
  if decode:
    cache_shape = cache.key_shape()
    if cache_shape is not None:
      check_fits_cache(cache_shape, (*xq.shape[:2], o.kv_heads, d))
    offset = cache.index()
  parts = multi_head_attention_params(scope, o, inputs_q.shape[-1], self_attention)
  logical = o.logical_axes

  def stream(x):
    """The module's input as a projection reads it: its sequence gathered over the tensor-parallel axes (sequence
    parallelism) and kept sharded over any other (context parallelism), its gradient handed back on the stream's
    (batch, seq, act_embed) shards."""
    return stream_input(x, (BATCH, SEQ, ACT_EMBED), 1) if logical else x

  def gathered(x):
    """q, k, v or the attention output (batch first) on the batch sharding, their sequence gathered as ``stream``
    gathers it (every tensor-parallel shard attends over the whole sequence for its heads)."""
    return gather_sequence(x, (BATCH, SEQ, HEADS, HEAD_DIM), 1) if logical else x

  # A residual that is the input itself (a pre-LN block) is taken from the input norm's layer, which then adds its
  # gradient inside the norm's backward kernel.
  pass_input = residual is not None and residual is inputs_q and o.input_layernorm
  ln_out = x_passed = None
  if parts.qkv is not None:
    if o.input_layernorm:
      (q, k, v), ln_out, x_passed = _split_projection(parts.qkv(xq, return_input=pass_input),
                                                      o.return_layernorm_output, pass_input)
    else:
      q, k, v = parts.qkv(stream(xq))
  else:
    kv_from_norm = self_attention and o.input_layernorm
    if o.input_layernorm:
      q, ln_out, x_passed = _split_projection(parts.query(xq, return_input=pass_input),
                                              o.return_layernorm_output or kv_from_norm, pass_input)
    else:
      q = parts.query(stream(xq))
    k, v = parts.kv(ln_out if kv_from_norm else stream(xkv))

  if o.enable_rotary_pos_emb:
    q, k = _rope(o, q, k, positions, offset, self_attention, segment_pos)
  bias_type = window = None  # the attention's own
  if decode:
    cached_k, cached_v = cache.append(k, v)
    k, v = cached_k.astype(k.dtype), cached_v.astype(v.dtype)  # the compute dtype, whatever the cache's
    if offset is not None:  # the queries' positions go into an explicit mask (and ALiBi bias); no window left
      mask, bias, bias_type = decode_mask_and_bias(offset, q.shape[1], k.shape[1], mask, bias, o.attn_bias_type,
                                                   window_size=o.window_size, num_heads=h)
      attn_mask_type, window = "arbitrary", (-1, -1)
  q, k, v = (gathered(t) for t in (q, k, v))
  out = gathered(parts.attention(q, k, v, mask, bias, segment_ids=segment_ids, deterministic=deterministic,
                                 attn_mask_type=attn_mask_type, attn_bias_type=bias_type, window_size=window,
                                 segment_pos=segment_pos))
  if offset is not None:  # past the cache's end its update was clamped: say so with NaN, not wrong values
    out = mark_overflow(out, offset, q.shape[1], k.shape[1])
  out = parts.out(out, x_passed if pass_input else seq_first_to_batch_first(residual, o.transpose_batch_sequence))
  out = seq_first_to_batch_first(out, o.transpose_batch_sequence)
  if o.return_layernorm_output:
    return out, seq_first_to_batch_first(ln_out, o.transpose_batch_sequence)
  return out
