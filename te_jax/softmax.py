"""Differentiable scaled softmax over the last axis: plain, with a boolean mask, and causal (upper-triangle masked).

The softmax of attention's unfused path, ``softmax(scale * logits)`` over the keys, each in one fused kernel forward
and one backward (``dx = scale * y * (dy - sum(dy * y))``). Only the output ``y`` is saved for the backward pass.
Math is float32 whatever the dtype; outputs and gradients have the logits' dtype.

Masked positions give 0. A fully masked row (every key masked out, or every logit -inf) gives an all-zero row, not
NaN and not a uniform row, and an all-zero gradient. The formulas, the edge cases and the numerics are in
``te_jax.ops.softmax``.
"""

from __future__ import annotations

import functools

import jax

from te_jax.ops.softmax import check_logits, check_mask, check_scale_factor, softmax_bwd, softmax_fwd

__all__ = ["scaled_masked_softmax", "scaled_softmax", "scaled_upper_triang_masked_softmax"]


# ---- plain and causal: logits only ---------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _softmax(logits, kind, scale_factor):
  return softmax_fwd(logits, kind=kind, scale_factor=scale_factor)


def _softmax_fwd(logits, kind, scale_factor):
  y = softmax_fwd(logits, kind=kind, scale_factor=scale_factor)
  return y, y


def _softmax_bwd(kind, scale_factor, y, dy):
  return (softmax_bwd(dy.astype(y.dtype), y, kind=kind, scale_factor=scale_factor),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


# ---- masked: the mask is not differentiable ------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _masked_softmax(logits, mask, scale_factor):
  return softmax_fwd(logits, mask, kind="masked", scale_factor=scale_factor)


def _masked_softmax_fwd(logits, mask, scale_factor):
  y = softmax_fwd(logits, mask, kind="masked", scale_factor=scale_factor)
  return y, y


def _masked_softmax_bwd(scale_factor, y, dy):
  # y is 0 wherever the mask is True, so the backward needs no mask; the bool mask gets no gradient (None).
  return softmax_bwd(dy.astype(y.dtype), y, kind="masked", scale_factor=scale_factor), None


_masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


# ---- public API ------------------------------------------------------------------------------------------------------


def scaled_softmax(logits: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """``softmax(scale_factor * logits)`` over the last axis.

  >>> import jax.numpy as jnp, te_jax
  >>> y = te_jax.scaled_softmax(jnp.array([[0.0, 0.0], [1.0, -jnp.inf]]), scale_factor=2.0)
  >>> y.tolist()
  [[0.5, 0.5], [1.0, 0.0]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16.
    scale_factor: a static Python float multiplying the logits (float32 math).

  Returns:
    The softmax, logits' shape and dtype. A row of all -inf logits gives zeros.
  """
  logits = check_logits(logits)
  return _softmax(logits, "plain", check_scale_factor(scale_factor))


def scaled_masked_softmax(logits: jax.Array, mask: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """``softmax(scale_factor * logits)`` over the last axis, with the keys where ``mask`` is True masked out.

  >>> import jax.numpy as jnp, te_jax
  >>> logits = jnp.zeros((1, 1, 2, 3))
  >>> mask = jnp.array([[[[False, True, False], [True, True, True]]]])  # True = masked out
  >>> te_jax.scaled_masked_softmax(logits, mask).tolist()
  [[[[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16, e.g. ``(B, H, Sq, Sk)``.
    mask: bool, True means masked out (Transformer Engine's convention); broadcastable to ``logits`` along the
      leading dims, e.g. ``(B, 1, Sq, Sk)``, ``(B, H, Sq, Sk)`` or ``(B, 1, 1, Sk)``: each dim 1 or the logits', the
      last one equal to ``Sk``. The broadcast is not materialized. It gets no gradient.
    scale_factor: a static Python float multiplying the logits.

  Returns:
    The softmax, logits' shape and dtype: 0 at masked positions; a row with every key masked is all 0 (not NaN,
    not uniform), and so is its gradient.
  """
  logits = check_logits(logits)
  check_mask(mask, logits.shape)
  return _masked_softmax(logits, mask, check_scale_factor(scale_factor))


def scaled_upper_triang_masked_softmax(logits: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """Causal ``softmax(scale_factor * logits)`` over the last axis: key ``j > i`` is masked out for query ``i``.

  Top-left aligned: row ``i`` of the ``(..., Sq, Sk)`` logits sees keys ``0..i`` (every row sees key 0, so no row
  is fully masked).

  >>> import jax.numpy as jnp, te_jax
  >>> te_jax.scaled_upper_triang_masked_softmax(jnp.zeros((2, 2))).tolist()
  [[1.0, 0.0], [0.5, 0.5]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16.
    scale_factor: a static Python float multiplying the logits.

  Returns:
    The softmax, logits' shape and dtype, 0 above the diagonal (and so is the gradient).
  """
  logits = check_logits(logits)
  return _softmax(logits, "causal", check_scale_factor(scale_factor))
