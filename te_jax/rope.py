"""``apply_rope``: rotary position embedding (RoPE) of queries or keys, differentiable; ``rope_frequencies``: angles.

The angle of feature pair ``i`` at position ``p`` is ``p * base ** (-2 i / R)`` (``R`` the rotary dim; Su et al.,
"RoFormer", 2021). ``apply_rope`` computes ``cos`` and ``sin`` of the angles once with XLA (a ``(S, R/2)`` table,
tiny next to ``x``) and hands them to one fused kernel that rotates every head of every token; the backward pass is
the same kernel rotating the gradient by the negated angles, from the same tables (the only residuals: ``x`` itself
is not saved). See ``te_jax.ops.rope`` for the pairing conventions and the exact float32 operations.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops.rope import check_rope_shapes, rope_bwd, rope_fwd

__all__ = ["apply_rope", "rope_frequencies"]


def rope_frequencies(positions_or_seq_len, rotary_dim: int, base: float = 10000.0) -> jax.Array:
  """The float32 rotation angles ``angle[.., p, i] = position[p] * base ** (-2 i / rotary_dim)``, ``i < rotary_dim/2``.

  >>> import te_jax
  >>> te_jax.rope_frequencies(3, 4, base=100.0).tolist()
  [[0.0, 0.0], [1.0, 0.10000000149011612], [2.0, 0.20000000298023224]]

  Args:
    positions_or_seq_len: an int ``S`` (positions 0..S-1), or an integer array of positions, ``(S,)`` or ``(B, S)``
      (packed sequences, or KV-cache decoding where positions do not start at 0).
    rotary_dim: ``R``, the number of features that rotate: even and positive.
    base: the wavelength base (10000 in RoFormer and Llama 2; Llama 3 uses 500000).

  Returns:
    float32 angles, ``(S, R/2)`` or ``(B, S, R/2)``: the ``freqs`` of ``apply_rope``. The inverse wavelengths
    ``base ** (-2 i / R)`` are computed in float64 on the host and rounded once to float32, so the angles are the
    same on every backend; each angle is one float32 product.

  Raises:
    ValueError: naming ``rotary_dim``, ``base`` or ``positions_or_seq_len`` for an odd or non-positive rotary dim,
      a non-positive base, a negative length or positions of rank other than 1 or 2.
    TypeError: naming ``positions_or_seq_len`` for positions that are not integers.
  """
  if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim <= 0 \
      or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
  if not isinstance(base, (int, float, np.floating, np.integer)) or not base > 0:
    raise ValueError(f"base must be a positive number, got {base!r}")
  inv_freq = (float(base) ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)).astype(np.float32)
  if isinstance(positions_or_seq_len, (int, np.integer)) and not isinstance(positions_or_seq_len, bool):
    seq_len = operator.index(positions_or_seq_len)
    if seq_len < 0:
      raise ValueError(f"positions_or_seq_len must be a non-negative length or positions, got {seq_len}")
    positions = jnp.arange(seq_len, dtype=jnp.float32)
  else:
    dtype = getattr(positions_or_seq_len, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"positions_or_seq_len must be an int or an integer array of positions, got "
                      f"{type(positions_or_seq_len).__name__ if dtype is None else jnp.dtype(dtype).name}")
    if jnp.ndim(positions_or_seq_len) not in (1, 2):
      raise ValueError(f"positions_or_seq_len must be (S,) or (B, S) positions, got shape "
                       f"{jnp.shape(positions_or_seq_len)}")
    positions = jnp.asarray(positions_or_seq_len).astype(jnp.float32)
  return positions[..., None] * jnp.asarray(inv_freq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _apply_rope(x, cos, sin, layout, interleaved):
  return rope_fwd(x, cos, sin, layout=layout, interleaved=interleaved)


def _apply_rope_fwd(x, cos, sin, layout, interleaved):
  return rope_fwd(x, cos, sin, layout=layout, interleaved=interleaved), (cos, sin)


def _apply_rope_bwd(layout, interleaved, residuals, g):
  cos, sin = residuals
  # No gradient for the tables (hence for freqs): the angles are a function of the positions, not trained.
  return rope_bwd(g, cos, sin, layout=layout, interleaved=interleaved), None, None


_apply_rope.defvjp(_apply_rope_fwd, _apply_rope_bwd)


def apply_rope(x: jax.Array, freqs: jax.Array, *, layout: str = "BSHD", interleaved: bool = False) -> jax.Array:
  """Rotates the first ``R = 2 * freqs.shape[-1]`` features of every head of ``x`` by the angles ``freqs``.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([1.0, 0.0, 0.0, 2.0, 5.0]).reshape(1, 1, 1, 5)   # (B, S, H, D), R = 4: feature 4 passes
  >>> freqs = jnp.full((1, 2), jnp.pi / 2)                           # angle pi/2 for both pairs
  >>> te_jax.apply_rope(x, freqs).round(6).tolist()                  # pairs (0, 2), (1, 3)
  [[[[-0.0, -2.0, 1.0, -0.0, 5.0]]]]
  >>> te_jax.apply_rope(x, freqs, interleaved=True).round(6).tolist()  # pairs (0, 1), (2, 3)
  [[[[-0.0, 1.0, -2.0, -0.0, 5.0]]]]

  Args:
    x: queries or keys, ``(B, S, H, D)`` ("BSHD") or ``(S, B, H, D)`` ("SBHD"); float32, bfloat16 or float16.
    freqs: float32 angles (``rope_frequencies``), ``(S, R/2)``, or ``(B, S, R/2)`` for per-sequence positions;
      ``R <= D``: the features after the first ``R`` pass through unchanged.
    layout: "BSHD" or "SBHD".
    interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)`` ("rotate half": GPT-NeoX, Llama).

  Returns:
    ``x`` rotated, same shape and dtype; the rotation is computed in float32. Differentiable in ``x``; ``freqs``
    gets no gradient (a zero cotangent): angles are functions of the positions, trained by no model we know of.

  Raises:
    TypeError: naming ``x`` or ``freqs`` for a dtype other than those above.
    ValueError: naming ``layout``, ``x`` or ``freqs`` for a wrong layout string, rank, or table shape (including
      ``R > D``).
  """
  check_rope_shapes(x, tuple(getattr(freqs, "shape", ())), layout)
  if getattr(freqs, "dtype", None) is None or jnp.dtype(freqs.dtype) != jnp.float32:
    raise TypeError(f"freqs must be float32 angles (see rope_frequencies), got "
                    f"{getattr(freqs, 'dtype', type(freqs).__name__)}")
  freqs = jax.lax.stop_gradient(freqs)
  return _apply_rope(x, jnp.cos(freqs), jnp.sin(freqs), layout, bool(interleaved))
