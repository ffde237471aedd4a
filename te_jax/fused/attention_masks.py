"""The masks and biases of attention as arrays: the causal/window band, packed-sequence segments, ALiBi."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.fused.attention_config import AttentionConfig, segment_pair

__all__ = ["alibi_bias", "alibi_bias_at", "alibi_slopes", "band_mask", "combine", "segment_mask"]


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The ALiBi head slopes of Press et al. (2022): ``2^(-8 (h + 1) / n)`` for ``n`` a power of two; otherwise the
  slopes of the power of two ``m`` below ``n``, then every other slope of ``2m`` (float32, shape ``(num_heads,)``)."""

  def power_of_2(n):
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  m = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_2(m) + power_of_2(2 * m)[0::2][: num_heads - m]
  return np.asarray(slopes, np.float32)


def alibi_bias_at(num_heads: int, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
  """``-slope_h * |key_position - query_position|``, float32, shape (1, H, T, S), for the queries' and keys' positions
  (1-D, integer; the queries' may be traced, as when decoding from a KV cache)."""
  dist = jnp.abs(key_positions[None, :] - query_positions[:, None]).astype(jnp.float32)
  return -jnp.asarray(alibi_slopes(num_heads))[None, :, None, None] * dist[None, None]


def alibi_bias(cfg: AttentionConfig) -> jax.Array:
  """``-slope_h * |j - i - a|``, float32, shape (1, H, T, S)."""
  return alibi_bias_at(cfg.heads, jnp.arange(cfg.q_len) + cfg.align, jnp.arange(cfg.kv_len))


def band_mask(cfg: AttentionConfig) -> jax.Array | None:
  """True where ``j - i`` is outside ``[lo, hi]`` (causal mask and window), shape (1, 1, T, S); None if unbounded."""
  if cfg.lo == -math.inf and cfg.hi == math.inf:
    return None
  rel = jnp.arange(cfg.kv_len)[None, :] - jnp.arange(cfg.q_len)[:, None]
  out = jnp.zeros(rel.shape, bool)
  if cfg.lo != -math.inf:
    out = out | (rel < cfg.lo)
  if cfg.hi != math.inf:
    out = out | (rel > cfg.hi)
  return out[None, None]


def segment_mask(segment_ids, cfg: AttentionConfig) -> jax.Array:
  """True between different segments and at padding (id 0), shape (B, 1, T, S)."""
  q_ids, kv_ids = segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len)
  q, kv = q_ids[:, :, None], kv_ids[:, None, :]
  return ((q != kv) | (q == 0) | (kv == 0))[:, None]


def combine(*masks):
  masks = [m for m in masks if m is not None]
  return functools.reduce(jnp.logical_or, masks) if masks else None

