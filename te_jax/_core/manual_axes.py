"""Inside ``jax.shard_map``: which manual mesh axes a value varies over, and the casts te_jax's ops and layers need.

Under ``shard_map`` (with ``check_vma``, the default) every value's type says over which manual axes its shards
differ. jax's own ops cast an operand that varies over fewer axes than the others up to the union before they run
(``pcast(..., to="varying")``, whose transpose is a ``psum``): the gradient of a replicated weight used with a
batch-sharded input comes out summed over the batch shards. te_jax's primitives and ``custom_vjp`` layers do the
same through ``to_common_varying``, so a layer's gradients have the types and values jax's own ops would give.

Scales are the exception. A delayed-scaling state is replicated wherever its layer's weight is, and its update
must not be summed over shards but see the amax of the whole tensor; a current-scaling scale is that of the whole
tensor too. ``max_over_shards`` max-reduces per-shard amaxes accordingly, so that a layer inside ``shard_map`` uses
the scales it would use under ``jax.jit`` on the same global arrays. With ``check_vma=False`` values carry no
varying axes; there it reduces over every manual axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax._core.jax_compat import check_vma_enabled

__all__ = ["max_over_shards", "to_common_varying", "varying_axes"]


def varying_axes(x) -> frozenset[str]:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map`` and for non-arrays)."""
  if not hasattr(x, "shape"):
    return frozenset()
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def to_common_varying(*xs):
  """``xs`` (arrays or None), each cast to vary over every manual axis any of them varies over."""
  axes = frozenset().union(*(varying_axes(x) for x in xs))
  if not axes:
    return xs
  return tuple(x if x is None or not hasattr(x, "shape") else _cast_to(x, axes) for x in xs)


def _cast_to(x, axes: frozenset[str]):
  missing = tuple(sorted(axes - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def max_over_shards(amaxes, axes) -> list[jax.Array]:
  """Each scalar of ``amaxes`` max-reduced over its entry of ``axes`` (manual mesh axes; None: every axis it varies
  over), with one ``pmax`` per distinct set of axes. Without vma tracking (``check_vma=False``), where values carry
  no varying axes, over every manual axis."""
  amaxes = list(amaxes)
  if check_vma_enabled():
    axes = [tuple(sorted(varying_axes(a) if ax is None else ax)) for a, ax in zip(amaxes, axes, strict=True)]
  else:
    axes = [tuple(jax.sharding.get_abstract_mesh().manual_axes)] * len(amaxes)
  for group in sorted(set(axes) - {()}):
    where = [i for i, g in enumerate(axes) if g == group]
    reduced = jax.lax.pmax(jnp.stack([amaxes[i] for i in where]), group)
    for j, i in enumerate(where):
      amaxes[i] = reduced[j]
  return amaxes
