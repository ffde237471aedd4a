"""Flax linen ``DotProductAttention``: ``te_jax.dot_product_attention`` as a layer (no parameters)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.attention import QKV_LAYOUTS, AttentionBackend, attention_backend, dot_product_attention
from te_jax.flax._fp8_state import resolve_recipe

def resolve_fp8(fp8: bool | None, *args, **kwargs) -> bool:
  """FP8 attention or not: ``fp8`` when given; for None, what the autocast recipe's ``fp8_dpa`` asks, where
  ``dot_product_attention(*args, fp8=True, **kwargs)`` accepts the configuration (shapes and dtypes are read)."""
  if fp8 is not None:
    return fp8
  recipe = resolve_recipe(None)
  if recipe is None or not recipe.fp8_dpa:
    return False
  try:
    attention_backend(*args, fp8=True, **kwargs)
  except ValueError:  # not this configuration, or not on this machine: attention stays in the input precision
    return False
  return True


# BSHD-family layout -> the same packing in SBHD, for ``transpose_batch_sequence``.
_TO_SEQUENCE_FIRST = {"BSHD": "SBHD", "BS3HD": "SB3HD", "BSHD_BS2HD": "SBHD_SB2HD"}


class DotProductAttention(nn.Module):
  """Scaled dot-product attention over already-projected q, k, v (see ``te_jax.dot_product_attention``).

  Masks follow NVIDIA Transformer Engine: **True = masked out**. Dropout draws from the ``dropout_rng_name`` rng
  stream unless ``deterministic``. The backend is cuDNN flash attention where it supports the configuration on this
  machine, else plain jnp (``backend_for`` says which, and why).

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
    attn_mask_type: one of ``te_jax.attention.ATTN_MASK_TYPES`` (default "causal").
    attn_bias_type: None (from the ``bias`` argument), "no_bias", "post_scale_bias" or "alibi".
    attention_dropout: the dropout rate on the attention probabilities.
    dropout_rng_name: the rng stream of the dropout mask.
    qkv_layout: "BSHD", "BS3HD" or "BSHD_BS2HD" (or their "SB" forms); with ``transpose_batch_sequence`` the "BS"
      forms mean sequence-first tensors.
    scale_factor: the logits' scale; None is 1 / sqrt(head_dim).
    window_size: a sliding window (left, right), -1 = unbounded.
    transpose_batch_sequence: inputs and output are (S, B, H, D).
    dtype: the compute dtype (q, k, v are cast to it); None keeps the query's.
    backend: "auto", "fused" or "unfused".
    fp8: the forward pass in FP8 through cuDNN (``te_jax.attention.fp8_attention_support``); None (default): as the
      autocast recipe's ``fp8_dpa`` asks, where this configuration allows it (``resolve_fp8``).
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
  dtype: Any = jnp.bfloat16
  backend: str = "auto"
  fp8: bool | None = None

  def _layout(self) -> str:
    if self.qkv_layout not in QKV_LAYOUTS:
      raise ValueError(f"qkv_layout must be one of {tuple(QKV_LAYOUTS)}, got {self.qkv_layout!r}")
    if not self.transpose_batch_sequence:
      return self.qkv_layout
    if self.qkv_layout not in _TO_SEQUENCE_FIRST:
      raise ValueError(f"transpose_batch_sequence=True takes a 'BS' layout ({tuple(_TO_SEQUENCE_FIRST)}) and makes "
                       f"it sequence-first; got qkv_layout={self.qkv_layout!r}")
    return _TO_SEQUENCE_FIRST[self.qkv_layout]

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
                backend=self.backend)

  def backend_for(self, query, key=None, value=None, mask=None, bias=None, *, segment_ids=None,
                  deterministic: bool = True) -> AttentionBackend:
    """Which backend ``__call__`` with these arguments runs on, and why (arrays or ``jax.ShapeDtypeStruct``)."""
    layout = self._layout()
    cast = [None if x is None else jax.ShapeDtypeStruct(x.shape, self.dtype or query.dtype)
            for x in (query, key, value)]
    rate = 0.0 if deterministic else self.attention_dropout
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, **self._kwargs(layout))
    return attention_backend(*cast, bias, mask, fp8=resolve_fp8(self.fp8, *cast, bias, mask, **kw), **kw)

  @nn.compact
  def __call__(self, query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
               mask: jax.Array | None = None, bias: jax.Array | None = None, *, segment_ids=None,
               deterministic: bool = False) -> jax.Array:
    """Attention of ``query`` over ``key``/``value`` (None where the layout packs them into another argument).

    Args:
      query, key, value: in ``qkv_layout`` (sequence-first with ``transpose_batch_sequence``).
      mask: boolean, True = masked out, broadcastable to (B, H, T, S): the padding or the "arbitrary" mask.
      bias: the post-scale bias, broadcastable to (B, H, T, S).
      segment_ids: (B, S) or (q_ids, kv_ids) packed-sequence ids, 0 = padding.
      deterministic: no dropout.

    Returns:
      The attention output, shaped as ``query`` (heads and head dim of value).
    """
    layout = self._layout()
    self._check_heads(query, key, value, layout)
    if self.dtype is not None:
      query, key, value = (None if x is None else x.astype(self.dtype) for x in (query, key, value))
    rate = 0.0 if deterministic else self.attention_dropout
    rng = self.make_rng(self.dropout_rng_name) if rate > 0 else None
    kw = dict(segment_ids=segment_ids, dropout_rate=rate, **self._kwargs(layout))
    fp8 = resolve_fp8(self.fp8, query, key, value, bias, mask, **kw)
    return dot_product_attention(query, key, value, bias, mask, dropout_rng=rng, fp8=fp8, **kw)
