"""The unfused attention backend: plain jnp (two einsums) around te_jax's fused softmax kernels. Runs everywhere; the
reference the cuDNN backend is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.fused.attention_config import AttentionConfig
from te_jax.fused.attention_masks import alibi_bias
from te_jax.ops.softmax import scaled_masked_softmax, scaled_softmax

__all__ = ["unfused"]


def _probabilities(logits: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
  """``softmax(scale * logits)`` over the last axis, masked (True = masked out), in float32; 0 on fully masked rows.

  The one place the unfused path computes its softmax: te_jax's fused softmax kernels (``te_jax.softmax``: one pass
  forward, one backward, only the probabilities saved), which share this mask convention and the zero rows.
  """
  logits = logits.astype(jnp.float32)
  if mask is None:
    return scaled_softmax(logits, scale_factor=float(scale))
  return scaled_masked_softmax(logits, mask, scale_factor=float(scale))


def unfused(q, k, v, bias, mask, dropout_rng, cfg: AttentionConfig):
  """BSHD q (B, T, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> (B, T, H, Dv)."""
  b, t, h, d = q.shape
  s, dv = k.shape[1], v.shape[-1]  # explicit sizes, not -1: a reshape cannot infer a dim of an empty array
  hk, g = cfg.kv_heads, cfg.heads // cfg.kv_heads
  qg = q.reshape(b, t, hk, g, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32).reshape(b, h, t, s)
  scale = cfg.scale
  if cfg.bias_type != "no_bias":
    extra = alibi_bias(cfg) if cfg.bias_type == "alibi" else bias.astype(jnp.float32)
    logits, scale = logits * jnp.float32(cfg.scale) + extra, 1.0
  probs = _probabilities(logits, mask, scale)
  if cfg.dropout_rate > 0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - cfg.dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / jnp.float32(1.0 - cfg.dropout_rate), 0.0)
  probs = probs.astype(v.dtype).reshape(b, hk, g, t, s)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, dv).astype(q.dtype)

