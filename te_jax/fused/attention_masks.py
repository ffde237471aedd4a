"""The masks and biases of attention as arrays: the causal/window band, packed-sequence segments, ALiBi."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.fused.attention_config import AttentionConfig, position_pair, segment_pair

__all__ = ["alibi_bias", "alibi_bias_at", "alibi_slopes", "band_mask", "combine", "layer_band", "position_band_mask",
           "segment_mask", "sequence_band_mask"]


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


def _outside(rel: jax.Array, lo: float, hi: float) -> jax.Array:
  out = jnp.zeros(rel.shape, bool)
  if lo != -math.inf:
    out = out | (rel < lo)
  if hi != math.inf:
    out = out | (rel > hi)
  return out


def band_mask(cfg: AttentionConfig) -> jax.Array | None:
  """True where ``j - i`` is outside ``[lo, hi]`` (causal mask and window), shape (1, 1, T, S); None if unbounded,
  and None where the band is aligned per sequence (``cfg.per_sequence``: ``sequence_band_mask``, from the data)."""
  if (cfg.lo == -math.inf and cfg.hi == math.inf) or cfg.per_sequence:
    return None
  rel = jnp.arange(cfg.kv_len)[None, :] - jnp.arange(cfg.q_len)[:, None]
  return _outside(rel, cfg.lo, cfg.hi)[None, None]


def _from_end(ids: jax.Array) -> jax.Array:
  """For each token (B, L), how many tokens of its segment (its id) stand at or after it: ``length - position`` in a
  contiguous segment."""
  same = ids[:, :, None] == ids[:, None, :]
  later = jnp.arange(ids.shape[1])[None, :] >= jnp.arange(ids.shape[1])[:, None]
  return jnp.sum(same & later[None], axis=-1)


def sequence_band_mask(cfg: AttentionConfig, mask: jax.Array | None, segment_ids) -> jax.Array:
  """The causal band (and window) of "padding_causal_bottom_right" aligned per sequence, True = masked out,
  (B, 1, T, S): query ``i`` and key ``j`` of one sequence (segment) with ``t`` queries and ``s`` keys are masked where
  ``j - i`` is outside ``[lo, hi]`` shifted by ``s - t`` (their positions taken within the sequence), as Transformer
  Engine and cuDNN align it, where ``band_mask`` takes the padded lengths' ``S - T``. The sequences are the segments
  of ``segment_ids``, else the attended rows and columns of ``mask`` (True = masked out), as Transformer Engine
  reads a padding mask's lengths."""
  if segment_ids is not None:
    q_ids, kv_ids = segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len)
  else:
    attend = ~jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], cfg.q_len, cfg.kv_len))
    q_ids = jnp.any(attend, axis=(1, 3)).astype(jnp.int32)
    kv_ids = jnp.any(attend, axis=(1, 2)).astype(jnp.int32)
  # j - i - (s - t) within a sequence is (t - i) - (s - j): the queries after i less the keys after j, each counted
  # from its sequence's end.
  rel = _from_end(q_ids)[:, :, None] - _from_end(kv_ids)[:, None, :]
  return _outside(rel, cfg.lo - cfg.align, cfg.hi - cfg.align)[:, None]


def position_band_mask(cfg: AttentionConfig, segment_ids, segment_pos) -> jax.Array | None:
  """The causal band (and window) at the tokens' positions within their segments, True = masked out, (B, 1, T, S):
  query ``i`` at position ``p_i`` and key ``j`` at ``p_j`` are masked where ``p_j - p_i`` is outside ``[lo, hi]``
  (packed sequences, each in its own coordinates, as Transformer Engine's ``segment_pos``). Aligned per sequence
  ("padding_causal_bottom_right"), ``p_j - p_i`` less the sequence's ``s - t``: ``(t - p_i) - (s - p_j)``, ``t``
  and ``s`` its queries and keys (the tokens of its segment id). None where the band is unbounded."""
  if cfg.lo == -math.inf and cfg.hi == math.inf:
    return None
  q_pos, kv_pos = (p.astype(jnp.int32) for p in position_pair(segment_pos, cfg.batch, cfg.q_len, cfg.kv_len))
  if cfg.per_sequence:
    q_ids, kv_ids = segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len)
    q_pos = jnp.sum(q_ids[:, :, None] == q_ids[:, None, :], axis=-1) - q_pos  # t - p_i
    kv_pos = jnp.sum(kv_ids[:, :, None] == kv_ids[:, None, :], axis=-1) - kv_pos  # s - p_j
    rel = q_pos[:, :, None] - kv_pos[:, None, :]
  else:
    rel = kv_pos[:, None, :] - q_pos[:, :, None]
  return _outside(rel, cfg.lo - cfg.align, cfg.hi - cfg.align)[:, None]


def layer_band(cfg: AttentionConfig, mask: jax.Array | None, segment_ids, segment_pos=None) -> jax.Array | None:
  """The band a call applies: ``position_band_mask`` with ``segment_pos``, else ``sequence_band_mask`` where it is
  aligned per sequence, else ``band_mask``."""
  if segment_pos is not None:
    return position_band_mask(cfg, segment_ids, segment_pos)
  return sequence_band_mask(cfg, mask, segment_ids) if cfg.per_sequence else band_mask(cfg)


def segment_mask(segment_ids, cfg: AttentionConfig) -> jax.Array:
  """True between different segments and at padding (id 0), shape (B, 1, T, S)."""
  q_ids, kv_ids = segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len)
  q, kv = q_ids[:, :, None], kv_ids[:, None, :]
  return ((q != kv) | (q == 0) | (kv == 0))[:, None]


def combine(*masks):
  masks = [m for m in masks if m is not None]
  return functools.reduce(jnp.logical_or, masks) if masks else None

