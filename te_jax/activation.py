"""``activation``: a differentiable activation (gelu, relu, silu, quick_gelu, squared_relu, or a gated pair).

Forward: one fused kernel computes ``act(x)`` in float32 and writes it in the output dtype; only ``x`` is saved. Backward:
one fused kernel computes ``g * act'(x)`` (both halves of a gated pair) in float32. The FP8 variants of both passes
(cast, amax, transposed copy and dbias fused in) are ``te_jax.activation_fwd`` / ``te_jax.activation_bwd``, which an
FP8 MLP calls inside its own ``custom_vjp``.
"""

from __future__ import annotations

import functools

import jax

from te_jax.ops.activation import activation_bwd, activation_fwd, parse_activation_type

__all__ = ["activation"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(x, activation_type):
  return activation_fwd(x, activation_type).data


def _activation_fwd(x, activation_type):
  return activation_fwd(x, activation_type).data, x


def _activation_bwd(activation_type, x, g):
  return (activation_bwd(g.astype(x.dtype), x, activation_type).data,)


_activation.defvjp(_activation_fwd, _activation_bwd)


def activation(x: jax.Array, activation_type=("gelu",)) -> jax.Array:
  """``act(x)``, or ``act(x[..., 0, :]) * x[..., 1, :]`` for a gated pair, in ``x``'s dtype (float32 math inside).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-2.0, 0.5], [3.0, 4.0]], jnp.float32)
  >>> te_jax.activation(x, ("relu",)).tolist()
  [[0.0, 0.5], [3.0, 4.0]]
  >>> te_jax.activation(x.reshape(1, 2, 2), ("relu", "linear")).tolist()  # ReGLU: relu(x[0]) * x[1]
  [[0.0, 2.0]]
  >>> jax.grad(lambda x: te_jax.activation(x, ("relu",)).sum())(x).tolist()
  [[0.0, 1.0], [1.0, 1.0]]

  Args:
    x: float32, bfloat16 or float16; ``(..., N)``, or ``(..., 2, N)`` for a gated pair (activated half first).
    activation_type: ``(act,)`` or ``(act, "linear")`` with ``act`` one of ``te_jax.ops.activation.ACTIVATIONS``:
      ``("silu", "linear")`` is SwiGLU, ``("gelu", "linear")`` GeGLU, ``("relu", "linear")`` ReGLU.

  Returns:
    ``(..., N)`` in ``x``'s dtype.
  """
  names = parse_activation_type(activation_type)
  normalized = (names[0], "linear") if names[1] else (names[0],)
  return _activation(x, normalized)
