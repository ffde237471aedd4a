"""The FP8 state of a module: delayed-scaling amax histories and scales in the ``_overwrite_with_gradient``
collection.

``dense`` returns the updated state as the gradient of these variables, and
``flax.training.train_state.TrainState.apply_gradients`` writes gradients of this collection over the variables
instead of passing them to the optimizer, so the state follows the train step with no extra user code.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from te_jax._core import scaling
from te_jax._core.autocast import calibration_pass
from te_jax._core.jax_compat import enable_eager_extended_dtype_add
from te_jax._core.scaling import FP8_COLLECTION
from te_jax.fused.linear import DenseFp8Meta
from te_jax.recipe import DelayedScaling, Recipe

__all__ = ["accumulate_gradients", "calibrate", "dense_fp8_meta"]


_ROLES = ("x", "kernel", "grad")


def dense_fp8_meta(module: nn.Module, recipe: Recipe | None, prefix: str = "") -> DenseFp8Meta | None:
  """Declares (at init) and reads the delayed-scaling state of one dense GEMM of ``module``.

  Returns None for recipes without state. Variables: ``{prefix}{x,kernel,grad}_amax_history`` (float32,
  ``amax_history_len``) and ``{prefix}{x,kernel,grad}_scale`` (float32 scalar).
  """
  if not isinstance(recipe, DelayedScaling):
    return None
  states = []
  for role in _ROLES:
    history = module.variable(FP8_COLLECTION, f"{prefix}{role}_amax_history", jnp.zeros,
                              (recipe.amax_history_len,), jnp.float32)
    scale = module.variable(FP8_COLLECTION, f"{prefix}{role}_scale", jnp.ones, (), jnp.float32)
    if history.value.shape != (recipe.amax_history_len,):
      raise ValueError(
          f"{module.name}: {prefix}{role}_amax_history has shape {history.value.shape}, but the recipe's "
          f"amax_history_len is {recipe.amax_history_len}"
      )
    states.append(scaling.ScaleState(_max_grad_view(module, history.value), _min_grad_view(module, scale.value)))
  return DenseFp8Meta(*states)


def calibrate(fn: Callable, variables: Mapping, *args, has_aux: bool = False):
  """``variables`` with a delayed-scaling FP8 state that has seen one forward and backward pass: call it once after
  ``init``, before the first train step, with that step's loss function and a batch.

  A fresh state has empty amax histories and scales of 1, so without this the first step casts every tensor with a
  scale of 1, whatever its range: the E5M2 gradients of a loss averaged over many tokens (mostly far below 1)
  underflow, the dgrads computed from them give the layers below amaxes that are too small, and the scales take a few
  steps to settle, just when the optimizer's moments are set, which leaves FP8's loss behind BF16's for hundreds of
  steps (the README gives the LM example's figures with and without this call).

  Runs ``jax.grad(fn)(variables, *args)`` once with every FP8 tensor cast by its own amax (current scaling, so each
  amax is the one a calibrated step would see), and returns ``variables`` with the FP8 collection updated from it:
  the amaxes rolled into the histories, the scales derived from them. Parameters are returned unchanged, and so is
  the state of every GEMM the pass does not run with delayed scaling (a module ``fn`` does not apply, or one that runs
  without FP8 in this call). Delayed scaling is whatever the modules resolve: autocast's recipe or a module's own
  ``recipe=``. Without an FP8 collection ``variables`` come back as they are, so the same code runs in BF16. Jitted
  here (once per ``fn``), or traced into the caller's ``jax.jit``.

  Args:
    fn: ``fn(variables, *args)``: the scalar loss the train step differentiates (``(loss, aux)`` with ``has_aux``).
    variables: the whole variables dict, as ``fn`` takes it.
    args: the rest of ``fn``'s arguments: a batch of the training data.
  """
  if not callable(fn):
    raise TypeError(f"calibrate: fn must be a callable loss function, got {type(fn).__name__}")
  if not isinstance(variables, Mapping):
    raise TypeError(f"calibrate: variables must be the variables dict, got {type(variables).__name__}")
  if FP8_COLLECTION not in variables:
    return variables
  with calibration_pass():
    state = _calibrated_state(fn, bool(has_aux), variables, args)
  return {**variables, FP8_COLLECTION: state}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _calibrated_state(fn, has_aux, variables, args):
  grads = jax.grad(fn, has_aux=has_aux)(variables, *args)
  return _where_updated((grads[0] if has_aux else grads)[FP8_COLLECTION], variables[FP8_COLLECTION])


def _where_updated(new, old):
  """``new`` for each tensor whose state the pass updated, ``old`` for the others. An updated scale is positive
  (fp8_max / amax, or the previous scale where amax is 0); a state the pass did not reach gets a zero cotangent, scale
  0 included. Per element of the scale, so each layer of a state stacked by ``nn.scan`` is judged on its own."""
  new_leaves, treedef = jax.tree_util.tree_flatten_with_path(new)
  old_leaves = treedef.flatten_up_to(old)
  by_path = {tuple(_key(k) for k in path): leaf for path, leaf in new_leaves}
  merged = []
  for (path, leaf), before in zip(new_leaves, old_leaves, strict=True):
    *parent, name = (_key(k) for k in path)
    stem = name.removesuffix("_amax_history").removesuffix("_scale")
    scale = by_path.get((*parent, f"{stem}_scale"))
    if scale is None or name not in (f"{stem}_amax_history", f"{stem}_scale"):
      raise ValueError(f"calibrate: {jax.tree_util.keystr(path)} is not an FP8 amax history or scale")
    updated = scale != 0
    merged.append(jnp.where(updated[..., None] if name.endswith("_amax_history") else updated, leaf, before))
  return treedef.unflatten(merged)


def _key(k) -> str:
  return str(getattr(k, "key", k))


def accumulate_gradients(total, grads):
  """``total + grads``, for gradient accumulation over micro-batches, with the FP8 state's updates combined the
  way autodiff combines those of a module applied twice: amax histories by max, scales by min (the scale of the
  max-combined history). A plain sum would add them, into histories of summed amaxes and summed scales under which
  the next step's tensors saturate. ``total`` None: ``grads`` (the first micro-batch). Both are gradients w.r.t. the
  whole variables dict; the FP8 collection holds ``*_amax_history`` and ``*_scale`` leaves only.

  >>> import jax.numpy as jnp
  >>> g = lambda amax, scale, w: {FP8_COLLECTION: {"x_amax_history": jnp.array([amax, 0.0]),
  ...                                              "x_scale": jnp.array(scale)}, "params": {"w": jnp.array(w)}}
  >>> acc = accumulate_gradients(accumulate_gradients(None, g(2.0, 224.0, 1.0)), g(4.0, 112.0, 3.0))
  >>> [acc[FP8_COLLECTION]["x_amax_history"].tolist(), float(acc[FP8_COLLECTION]["x_scale"]), float(acc["params"]["w"])]
  [[4.0, 0.0], 112.0, 4.0]
  """
  if total is None:
    return grads

  def combine(path, a, b):
    if not any(getattr(k, "key", None) == FP8_COLLECTION for k in path):
      return a + b
    name = str(getattr(path[-1], "key", ""))
    if name.endswith("_amax_history"):
      return jnp.maximum(a, b)
    if name.endswith("_scale"):
      return jnp.minimum(a, b)
    raise ValueError(f"accumulate_gradients: {jax.tree_util.keystr(path)} is not an FP8 amax history or scale")

  return jax.tree_util.tree_map_with_path(combine, total, grads)


# Eager (un-jitted) autodiff of a module applied twice adds its state's max-combining cotangents.
enable_eager_extended_dtype_add()

# Per apply (keyed by the root scope): each FP8 state value converted once to Flax's fp32_max_grad dtype.
_MAX_GRAD_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _max_grad_view(module: nn.Module, value, negated: bool = False):
  """``value`` in ``fp8_ops.fp32_max_grad``, a float32 whose gradients combine by max instead of sum.

  The conversion is made once per state value and apply, so that every application of a module (shared weights,
  a module called twice) uses the same converted value: autodiff then accumulates their state updates in the
  max-combining dtype, and the one conversion hands the result back as float32. ``negated``: the conversion of
  ``_negated_cotangent(value)``.
  """
  views = _MAX_GRAD_VIEWS.setdefault(module.scope.root, {})
  key = id(value)
  if key not in views:
    views[key] = (value, jax.lax.convert_element_type(_negated_cotangent(value) if negated else value,
                                                      fp8_ops.fp32_max_grad))
  return views[key][1]


def _min_grad_view(module: nn.Module, value):
  """``value`` (a scale) as ``_max_grad_view`` hands it over, but with the updates of several applications
  combined by min: the scale of the max-combined amax history, since a larger amax gives a smaller scale (with a
  max, the application with the smallest amax would set the scale, and the others' tensors would saturate). Each
  application's update is negated on its way into the shared view and negated back on its way out to the variable,
  so the view's max-combination picks the min."""
  return _negated_cotangent(_max_grad_view(module, value, negated=True))


@jax.custom_vjp
def _negated_cotangent(x):
  """``x``; its cotangent comes back negated (in ``x``'s dtype, float32 or ``fp32_max_grad``)."""
  return x


def _negated_cotangent_fwd(x):
  return x, None


def _negated_cotangent_bwd(_, g):
  if jax.dtypes.issubdtype(g.dtype, jax.dtypes.extended):  # negated in float32, handed back in g's dtype
    return (jax.lax.convert_element_type(-jax.lax.convert_element_type(g, jnp.float32), g.dtype),)
  return (-g,)


_negated_cotangent.defvjp(_negated_cotangent_fwd, _negated_cotangent_bwd)
