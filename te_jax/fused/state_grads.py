"""How a layer hands its delayed-scaling state to the fused ops so that the state's "gradient" is its update, in
whatever Flax API holds the state (``te_jax.flax``'s collection, ``te_jax.nnx``'s ``Fp8State`` variables).

When one layer is applied several times in a step (shared weights, a module called twice), autodiff adds the
cotangents of its state. Handed over in Flax's ``fp8_ops.fp32_max_grad`` dtype, whose "addition" is a max, the
amax histories combine by max; a scale goes through ``min_grad_view``, so that its updates combine by min (the scale
of the max-combined history). The layer must convert each state value once per trace and share the converted value
between its applications: ``max_grad_view`` is that conversion, the caching is the API's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from te_jax._core.jax_compat import enable_eager_extended_dtype_add

__all__ = ["from_min_grad_view", "max_grad_view", "negated_cotangent", "where_updated"]


def max_grad_view(value: jax.Array, negated: bool = False) -> jax.Array:
  """``value`` in ``fp8_ops.fp32_max_grad``, a float32 whose cotangents combine by max instead of sum. ``negated``:
  the view of a scale (``negated_cotangent(value)`` converted), to be read through ``from_min_grad_view``."""
  return jax.lax.convert_element_type(negated_cotangent(value) if negated else value, fp8_ops.fp32_max_grad)


def from_min_grad_view(view: jax.Array) -> jax.Array:
  """A scale's ``max_grad_view(value, negated=True)`` as the fused ops take it: each application's update is negated
  on its way into the shared view and negated back on its way out to the variable, so the view's max picks the min
  (with a max, the application with the smallest amax would set the scale, and the others' tensors would saturate).
  """
  return negated_cotangent(view)


@jax.custom_vjp
def negated_cotangent(x):
  """``x``; its cotangent comes back negated (in ``x``'s dtype, float32 or ``fp32_max_grad``)."""
  return x


def _negated_cotangent_fwd(x):
  return x, None


def _negated_cotangent_bwd(_, g):
  if jax.dtypes.issubdtype(g.dtype, jax.dtypes.extended):  # negated in float32, handed back in g's dtype
    return (jax.lax.convert_element_type(-jax.lax.convert_element_type(g, jnp.float32), g.dtype),)
  return (-g,)


negated_cotangent.defvjp(_negated_cotangent_fwd, _negated_cotangent_bwd)


def where_updated(new, old, what: str = "calibrate"):
  """``new`` for each tensor whose state a pass updated, ``old`` for the others: ``new`` and ``old`` are nested dicts
  of ``*_amax_history`` and ``*_scale`` leaves (a state's gradient and the state). An updated scale is positive
  (fp8_max / amax, or the previous scale where amax is 0); a state the pass did not reach gets a zero cotangent,
  scale 0 included. Per element of the scale, so each layer of a stacked state (``nn.scan``, ``nnx.scan``) is judged
  on its own. ``what`` names the caller in errors."""
  new_leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
  old_leaves = treedef.flatten_up_to(old)
  by_path = {tuple(_key(k) for k in path): leaf for path, leaf in new_leaves}
  merged = []
  for (path, leaf), before in zip(new_leaves, old_leaves, strict=True):
    *parent, name = (_key(k) for k in path)
    stem = name.removesuffix("_amax_history").removesuffix("_scale")
    scale = by_path.get((*parent, f"{stem}_scale"))
    if scale is None or name not in (f"{stem}_amax_history", f"{stem}_scale"):
      raise ValueError(f"{what}: {jax.tree_util.keystr(path)} is not an FP8 amax history or scale")
    updated = scale != 0
    merged.append(jnp.where(updated[..., None] if name.endswith("_amax_history") else updated, leaf, before))
  return treedef.unflatten(merged)


def _key(k) -> str:
  return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


# Eager (un-jitted) autodiff of a layer applied twice adds its state's max-combining cotangents.
enable_eager_extended_dtype_add()
