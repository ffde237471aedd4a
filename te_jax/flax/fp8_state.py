"""The FP8 state of a module: the variables its recipe's quantizer declares (delayed scaling's amax histories and
scales) in the ``_overwrite_with_gradient`` collection.

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

from te_jax._core.autocast import calibration_pass, resolve_recipe
from te_jax._core.jax_compat import differentiated_from_outside
from te_jax._core.scaling import FP8_COLLECTION
from te_jax.fused.linear import keep_state, keeps_state
from te_jax.fused.quantizer import Quantizer, quantizer_for, state_combine
from te_jax.fused.state_grads import from_min_grad_view, max_grad_view, where_updated
from te_jax.recipe import Recipe

__all__ = ["accumulate_gradients", "calibrate", "fp8_state", "split_fp8_state"]


def fp8_state(module: nn.Module, recipe: Recipe | None, x, prefixes: tuple[str, ...] = ("",), *,
              groups: int | None = None):
  """The state of each GEMM of ``module`` (one per prefix) under ``recipe``, declared at init: ``(x, metas)``.

  Variables: ``{prefix}{name}`` for each of the variables the recipe's quantizer declares
  (``Quantizer.state_variables``; under ``DelayedScaling``, ``{prefix}{x,kernel,grad}_amax_history``, float32 of
  ``amax_history_len``, and ``{prefix}{x,kernel,grad}_scale``, float32 scalars); with ``groups``, one state per
  group of a grouped GEMM (``te_jax.grouped_dense``'s experts), each variable with a leading ``(groups,)`` dim.
  Under a recipe without state (current scaling, or FP8 off) the metas are None, and a state the variables hold
  anyway is tied to the input ``x``, so the step hands it back unchanged as its gradient instead of a zero that
  ``TrainState.apply_gradients`` would write over it.
  """
  if not keeps_state(recipe):
    return _keep_state(module, x, prefixes), (None,) * len(prefixes)
  quantizer = quantizer_for(recipe)
  return x, tuple(_meta(module, recipe, quantizer, prefix, groups) for prefix in prefixes)


def _meta(module: nn.Module, recipe: Recipe, quantizer: Quantizer, prefix: str, groups: int | None):
  declared = quantizer.state_variables
  present = [module.has_variable(FP8_COLLECTION, prefix + var.name) for var in declared]
  if not all(present) and not (module.is_initializing() or module.is_mutable_collection(FP8_COLLECTION)):
    where, name = "no" if not any(present) else "an incomplete", type(recipe).__name__
    raise ValueError(
        f"{_where(module)}: {name} needs this layer's FP8 state, and the variables have "
        f"{where} {FP8_COLLECTION!r} collection (te_jax.FP8_COLLECTION). Initialize the model inside "
        f"te_jax.autocast(enabled=True, recipe={name}()) and pass the whole variables dict (params and FP8 "
        "state) to apply; under nn.scan, list the collection in variable_axes. To run without that state, use "
        "Float8CurrentScaling or autocast(enabled=False).")
  values = []
  for var in declared:
    shape = var.shape if groups is None else (groups, *var.shape)
    value = module.variable(FP8_COLLECTION, prefix + var.name, var.init, shape, var.dtype).value
    if differentiated_from_outside(value):
      raise ValueError(
          f"{_where(module)}: this layer's FP8 state is shared by the iterations of a loop or "
          f"the examples of a vmap (nn.scan's variable_broadcast, or nn.vmap's variable_axes None, holding "
          f"{FP8_COLLECTION!r}), and autodiff would add their state updates (summed amaxes and scales). Give each "
          f"iteration its own state: list te_jax.FP8_COLLECTION in variable_axes ({{te_jax.FP8_COLLECTION: 0}}), "
          "as for per-layer params; under nn.vmap over examples, apply the module to the whole batch instead.")
    if value.shape != shape:
      per_group = "" if groups is None else f" for each of {groups} groups, {shape} in all"
      raise ValueError(f"{_where(module)}: {var.wrong_shape(prefix + var.name, value.shape)}{per_group}")
    values.append(_VIEWS[var.combine](module, value))
  return quantizer.state_meta(values)


def _where(module: nn.Module) -> str:
  return "/".join(map(str, module.path)) or type(module).__name__


def _keep_state(module: nn.Module, x, prefixes):
  """``x``, tied by ``keep_state`` to the FP8 state ``module``'s variables hold for ``prefixes`` (if any): each
  variable of its FP8 collection under one of the prefixes that is a state variable (``state_combine``), whichever
  recipe declared it."""
  held = [name for name, value in module.variables.get(FP8_COLLECTION, {}).items()
          if not isinstance(value, Mapping) and state_combine(name) is not None]
  views = [_VIEWS[state_combine(name)](module, module.get_variable(FP8_COLLECTION, name))
           for prefix in prefixes for name in held if name.startswith(prefix)]
  return keep_state(x, tuple(views)) if views else x


def split_fp8_state(tree: Mapping) -> tuple[dict, Mapping | None]:
  """``(tree without the FP8 collection, the FP8 collection or None)``: for train steps that do not use
  ``TrainState.apply_gradients``, which splits them itself.

  The gradient of the whole variables dict carries the layers' new FP8 state as the gradient of
  ``te_jax.FP8_COLLECTION``; the optimizer must see the rest only, and the new state replaces the old:

  >>> import jax, jax.numpy as jnp, optax, te_jax, te_jax.flax as te_flax
  >>> layer, x, tx = te_flax.DenseGeneral(16), jnp.ones((4, 32)), optax.adam(1e-3)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=8)):
  ...   variables = layer.init(jax.random.key(0), x)
  ...   params, _ = te_flax.split_fp8_state(variables)
  ...   opt_state = tx.init(params)
  ...   grads, new_fp8_state = te_flax.split_fp8_state(jax.grad(lambda v: layer.apply(v, x).sum())(variables))
  ...   updates, opt_state = tx.update(grads, opt_state, params)
  ...   variables = {**optax.apply_updates(params, updates), te_jax.FP8_COLLECTION: new_fp8_state}
  >>> float(variables[te_jax.FP8_COLLECTION]["x_amax_history"][0])
  1.0
  """
  if not isinstance(tree, Mapping):
    raise TypeError(f"split_fp8_state: expected the variables dict or its gradient, got {type(tree).__name__}")
  rest = {k: v for k, v in tree.items() if k != FP8_COLLECTION}
  return rest, tree.get(FP8_COLLECTION)


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
  ``recipe=``. Without an FP8 collection ``variables`` come back as they are, so the same code runs in BF16 (but under
  an autocast with ``DelayedScaling`` that is a mistake, the params-only dict, and raises); a pass that updates no
  state at all outside such an autocast raises too (it would leave every scale at 1). Jitted here (once per ``fn``),
  or traced into the caller's ``jax.jit``.

  Args:
    fn: ``fn(variables, *args)``: the scalar loss the train step differentiates (``(loss, aux)`` with ``has_aux``).
    variables: the whole variables dict, as ``fn`` takes it.
    args: the rest of ``fn``'s arguments: a batch of the training data.
  """
  if not callable(fn):
    raise TypeError(f"calibrate: fn must be a callable loss function, got {type(fn).__name__}")
  if not isinstance(variables, Mapping):
    raise TypeError(f"calibrate: variables must be the variables dict, got {type(variables).__name__}")
  delayed = keeps_state(resolve_recipe(None))
  if FP8_COLLECTION not in variables:
    if delayed:
      raise ValueError(f"calibrate: variables has no {FP8_COLLECTION!r} collection (te_jax.FP8_COLLECTION) under an "
                       "autocast with DelayedScaling: pass the whole variables dict that init returned, not its params")
    return variables
  with calibration_pass():
    state = _calibrated_state(fn, bool(has_aux), variables, args)
  old = variables[FP8_COLLECTION]
  unchanged = jax.tree.map(lambda a, b: jnp.array_equal(a, b), state, old)
  if not delayed and not any(isinstance(u, jax.core.Tracer) for u in jax.tree.leaves(unchanged)) and all(
      bool(u) for u in jax.tree.leaves(unchanged)):
    raise ValueError("calibrate: the pass ran no GEMM with delayed scaling, so no FP8 state changed: call it inside "
                     "te_jax.autocast(enabled=True, recipe=DelayedScaling(...)), as the train step runs")
  return {**variables, FP8_COLLECTION: state}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _calibrated_state(fn, has_aux, variables, args):
  grads = jax.grad(fn, has_aux=has_aux)(variables, *args)
  return where_updated((grads[0] if has_aux else grads)[FP8_COLLECTION], variables[FP8_COLLECTION])


def accumulate_gradients(total, grads):
  """``total + grads``, for gradient accumulation over micro-batches, with the FP8 state's updates combined the
  way autodiff combines those of a module applied twice: amax histories by max, scales by min (the scale of the
  max-combined history). A plain sum would add them, into histories of summed amaxes and summed scales under which
  the next step's tensors saturate. ``total`` None: ``grads`` (the first micro-batch). Both are gradients w.r.t. the
  whole variables dict; the FP8 collection holds ``*_amax_history`` and ``*_scale`` leaves only. Zeros are the
  identity (a zero scale is one no micro-batch updated), so a ``jax.lax.scan`` over micro-batches may start from
  ``jax.tree.map(jnp.zeros_like, variables)``.

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
    how = state_combine(str(getattr(path[-1], "key", "")))
    if how is None:
      raise ValueError(f"accumulate_gradients: {jax.tree_util.keystr(path)} is not an FP8 amax history or scale")
    if how == "max":
      return jnp.maximum(a, b)
    # A scale's update is positive; 0 is "not updated" (a micro-batch that did not reach the module, or the zeros a
    # `jax.lax.scan` over micro-batches starts its sum from): the other's, so that zeros are the sum's identity.
    return jnp.where(a == 0, b, jnp.where(b == 0, a, jnp.minimum(a, b)))

  return jax.tree_util.tree_map_with_path(combine, total, grads)


# Per apply (keyed by the root scope): each FP8 state value converted once to Flax's fp32_max_grad dtype.
_MAX_GRAD_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _max_grad_view(module: nn.Module, value, negated: bool = False):
  """``value`` in ``fp8_ops.fp32_max_grad``, a float32 whose gradients combine by max instead of sum.

  The conversion is made once per state value and apply, so that every application of a module (shared weights,
  a module called twice) uses the same converted value: autodiff then accumulates their state updates in the
  max-combining dtype, and the one conversion hands the result back as float32. ``negated``: the conversion of
  a scale's view, ``max_grad_view(value, negated=True)``.
  """
  views = _MAX_GRAD_VIEWS.setdefault(module.scope.root, {})
  key = id(value)
  if key not in views:
    views[key] = (value, max_grad_view(value, negated))
  return views[key][1]


def _min_grad_view(module: nn.Module, value):
  """``value`` (a scale) as ``_max_grad_view`` hands it over, but with the updates of several applications
  combined by min (``te_jax.fused.state_grads.from_min_grad_view``)."""
  return from_min_grad_view(_max_grad_view(module, value, negated=True))


# A state variable's value as the module hands it to the fused ops, by how its updates combine (StateVariable.combine).
_VIEWS = {"max": _max_grad_view, "min": _min_grad_view}
