"""The unfused attention backend: plain jnp (two einsums) around te_jax's fused softmax kernels. Runs everywhere; the
reference the cuDNN backend is tested against. ``unfused_with_lse`` also returns each row's log-sum-exp, which is
what blocks of keys computed apart (context parallelism's ring) need to be merged into one softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.fused.attention_config import AttentionConfig
from te_jax.fused.attention_masks import alibi_bias
from te_jax.ops.softmax import scaled_masked_softmax, scaled_softmax

__all__ = ["softmax_sink", "unfused", "unfused_with_lse"]


def _probabilities(logits: jax.Array, mask: jax.Array | None, scale: float, sink=None) -> jax.Array:
  """``softmax(scale * logits)`` over the last axis, masked (True = masked out), in float32; 0 on fully masked rows.

  The one place the unfused path computes its softmax: te_jax's fused softmax kernels (``te_jax.softmax``: one pass
  forward, one backward, only the probabilities saved), which share this mask convention and the zero rows.

  ``sink`` (the "off_by_one" and "learnable" softmax types): one more logit, never masked, broadcastable to
  (B, H, T, 1), in the denominator only: the softmax runs over the scaled logits with the sink appended as a last
  key, whose probability is dropped (so a row with every key masked gives zeros, as in Transformer Engine).
  """
  logits = logits.astype(jnp.float32)
  if sink is not None:
    b, h, t, s = logits.shape
    z = logits * jnp.float32(scale) if scale != 1.0 else logits
    z = jnp.concatenate([z, jnp.broadcast_to(jnp.asarray(sink, jnp.float32), (b, h, t, 1))], axis=-1)
    if mask is not None:
      mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)], constant_values=False)
    return _probabilities(z, mask, 1.0)[..., :s]
  if mask is None:
    return scaled_softmax(logits, scale_factor=float(scale))
  return scaled_masked_softmax(logits, mask, scale_factor=float(scale))


def softmax_sink(cfg: AttentionConfig, softmax_offset):
  """The extra logit of ``cfg.softmax_type``: None ("vanilla"), 0 ("off_by_one"), the (1, H, 1, 1) ``softmax_offset``
  ("learnable")."""
  if cfg.softmax_type == "off_by_one":
    return jnp.zeros((), jnp.float32)
  return softmax_offset if cfg.softmax_type == "learnable" else None


def _logits(q, k, bias, cfg: AttentionConfig) -> tuple[jax.Array, float]:
  """``<q_i, k_j>`` per head (B, H, T, S) in float32, and the scale the softmax still has to apply (a post-scale bias
  or ALiBi is added after the scaling, so the scale is applied here and 1 is left; a pre-scale bias is added before
  it, and the softmax applies the scale)."""
  b, t, h, d = q.shape
  s = k.shape[1]  # explicit sizes, not -1: a reshape cannot infer a dim of an empty array
  hk, g = cfg.kv_heads, cfg.heads // cfg.kv_heads
  qg = q.reshape(b, t, hk, g, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32).reshape(b, h, t, s)
  if cfg.bias_type == "no_bias":
    return logits, cfg.scale
  if cfg.bias_type == "pre_scale_bias":
    return logits + bias.astype(jnp.float32), cfg.scale
  extra = alibi_bias(cfg) if cfg.bias_type == "alibi" else bias.astype(jnp.float32)
  return logits * jnp.float32(cfg.scale) + extra, 1.0


def _attend(probs, v, cfg: AttentionConfig) -> jax.Array:
  """``sum_j P[i, j] v[j]`` per head: probabilities (B, H, T, S) and v (B, S, Hk, Dv) -> (B, T, H, Dv) in float32."""
  b, h, t, s = probs.shape
  hk, dv = cfg.kv_heads, v.shape[-1]
  probs = probs.astype(v.dtype).reshape(b, hk, h // hk, t, s)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, dv)


def unfused(q, k, v, bias, mask, dropout_rng, cfg: AttentionConfig, softmax_offset=None):
  """BSHD q (B, T, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> (B, T, H, Dv); ``softmax_offset``: the learnable
  softmax's (1, H, 1, 1) sink logits."""
  logits, scale = _logits(q, k, bias, cfg)
  probs = _probabilities(logits, mask, scale, softmax_sink(cfg, softmax_offset))
  if cfg.dropout_rate > 0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - cfg.dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / jnp.float32(1.0 - cfg.dropout_rate), 0.0)
  return _attend(probs, v, cfg).astype(q.dtype)


def _masked_logsumexp(z: jax.Array, mask: jax.Array | None) -> jax.Array:
  """``log sum_j exp(z_j)`` over the last axis and the j not masked; -inf (with a zero gradient, not NaN) on a fully
  masked row. The shift by the row's maximum only keeps exp in range: it is held constant for the gradient, which
  does not depend on it."""
  if mask is not None:
    z = jnp.where(mask, -jnp.inf, z)
  m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  total = jnp.sum(jnp.exp(z - m), axis=-1)
  some = total > 0
  return jnp.where(some, jnp.log(jnp.where(some, total, 1.0)) + m[..., 0], -jnp.inf)


def unfused_with_lse(q, k, v, bias, mask, cfg: AttentionConfig) -> tuple[jax.Array, jax.Array]:
  """``unfused`` without dropout, returning the output in float32 (B, T, H, Dv) and each row's log-sum-exp of the
  scaled logits over the keys not masked, float32 (B, T, H) (-inf on a fully masked row, whose output is 0).

  Two blocks of keys attended apart merge into the attention over both: ``lse = logaddexp(lse_1, lse_2)``,
  ``out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2``. The probabilities come from the same softmax kernel as
  ``unfused``; the log-sum-exp is a second pass over the logits (the kernel keeps neither the row maximum nor the
  sum), differentiable, so a block's gradient through both outputs is ``jax.vjp`` of this function.
  """
  if cfg.dropout_rate > 0 or cfg.softmax_type != "vanilla":
    raise ValueError("unfused_with_lse takes no dropout and only the vanilla softmax")
  logits, scale = _logits(q, k, bias, cfg)
  out = _attend(_probabilities(logits, mask, scale), v, cfg)
  lse = _masked_logsumexp(logits * jnp.float32(scale), mask)
  return out, jnp.swapaxes(lse, 1, 2)
