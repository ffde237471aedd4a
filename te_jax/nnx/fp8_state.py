"""The FP8 state of the NNX modules: the variables the recipe's quantizer declares (delayed scaling's amax histories
and scales) as ``Fp8State`` variables, and the train-step helpers that keep it current.

The fused ops return a layer's updated state as the gradient of the state they were given (the backward pass is
where the output gradient's amax is known). ``value_and_grad`` and ``grad`` are ``nnx.value_and_grad`` and
``nnx.grad`` that also differentiate the ``Fp8State`` variables, write that "gradient" into the model, and return the
gradients of the parameters only, so ``nnx.Optimizer.update(model, grads)`` runs unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax._core.autocast import calibration_pass, resolve_recipe
from te_jax.fused.linear import keep_state, keeps_state
from te_jax.fused.quantizer import quantizer_for
from te_jax.fused.state_grads import from_min_grad_view, max_grad_view, where_updated
from te_jax.recipe import Recipe

__all__ = ["Fp8State", "calibrate", "declare_fp8_state", "fp8_metas", "grad", "update_fp8_state", "value_and_grad"]


class Fp8State(nnx.Variable):
  """A variable of an FP8 GEMM's state (delayed scaling's amax histories and scales, float32). Not a parameter: the
  optimizer never sees it; the train step writes its "gradient" (the updated state) over it
  (``te_jax.nnx.value_and_grad``).

  >>> import jax.numpy as jnp, te_jax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=8)):
  ...   layer = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))
  >>> sorted(nnx.to_pure_dict(nnx.state(layer, te_nnx.Fp8State)))[:2]
  ['grad_amax_history', 'grad_scale']
  """


def declare_fp8_state(module: nnx.Module, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",), *,
                      groups: int | None = None) -> None:
  """At construction: the ``Fp8State`` variables of each GEMM of ``module`` (one per prefix) that the recipe (the
  module's own, else autocast's) keeps, named as the linen modules' collection entries: ``{prefix}{name}`` for each
  variable its quantizer declares (``Quantizer.state_variables``; under ``DelayedScaling``,
  ``{prefix}{x,kernel,grad}_amax_history`` of ``amax_history_len`` and ``{prefix}{x,kernel,grad}_scale``, scalars);
  with ``groups``, one state per group of a grouped GEMM (a leading ``(groups,)`` dim); none under a recipe without
  state."""
  recipe = resolve_recipe(recipe)
  if not keeps_state(recipe):
    return
  declared = quantizer_for(recipe).state_variables
  lead = () if groups is None else (groups,)
  for prefix in prefixes:
    for var in declared:
      setattr(module, prefix + var.name, Fp8State(var.init((*lead, *var.shape), var.dtype)))


def fp8_metas(module: nnx.Module, recipe: Recipe | None, x, prefixes: tuple[str, ...] = ("",), *,
              groups: int | None = None):
  """At call time: ``(x, metas)``, the state of each GEMM of ``module`` for the fused ops (as ``te_jax.flax``'s
  layers hand it over; with ``groups``, as ``declare_fp8_state`` declares it). Under a recipe without state
  (current scaling, FP8 off) the metas are None, and a state the module holds anyway (each ``Fp8State`` under one of
  the prefixes) is tied to ``x`` (``keep_state``), so the step hands it back unchanged."""
  if not keeps_state(recipe):
    views = [_view(module, name, var) for prefix in prefixes for name, var in vars(module).items()
             if isinstance(var, Fp8State) and name.startswith(prefix)]
    return (keep_state(x, tuple(views)) if views else x), (None,) * len(prefixes)
  quantizer = quantizer_for(recipe)
  metas = []
  for prefix in prefixes:
    held = [(prefix + var.name, var, getattr(module, prefix + var.name, None)) for var in quantizer.state_variables]
    if not all(isinstance(v, Fp8State) for _, _, v in held):
      raise ValueError(
          f"{type(module).__name__}: {type(recipe).__name__} needs this layer's FP8 state (te_jax.nnx.Fp8State "
          "variables), and the module has none: construct the model inside te_jax.autocast(enabled=True, "
          f"recipe={type(recipe).__name__}()), or give the module recipe={type(recipe).__name__}(). To run without "
          "that state, use Float8CurrentScaling or autocast(enabled=False).")
    for name, var, v in held:  # its trailing dims (leading ones are a stack's, StateVariable.shape)
      shape = var.shape if groups is None else (groups, *var.shape)
      if v.shape[len(v.shape) - len(shape):] != shape:
        per_group = "" if groups is None else f" for each of {groups} groups, {shape} in all"
        raise ValueError(f"{type(module).__name__}: {var.wrong_shape(name, v.shape)}{per_group}")
    metas.append(quantizer.state_meta([_handed_over(module, name, v, var.combine) for name, var, v in held]))
  return x, tuple(metas)


# Per module instance (NNX merges a fresh one in each transform's trace): each state value converted once, so that
# every application of the module in a step (shared weights, a module called twice) uses the same converted value and
# autodiff combines their updates by max (histories) and min (scales), as te_jax.flax does.
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _view(module: nnx.Module, name: str, var: Fp8State, negated: bool = False):
  views = _VIEWS.setdefault(module, {})
  value = var[...]
  cached = views.get(name)
  if cached is None or cached[0] is not value:
    cached = views[name] = (value, max_grad_view(value, negated))
  return cached[1]


def _handed_over(module: nnx.Module, name: str, var: Fp8State, combine: str):
  """``var``'s value for the fused ops, its updates over several applications combined by ``combine`` (max, or min
  through a negated view)."""
  if combine == "max":
    return _view(module, name, var)
  return from_min_grad_view(_view(module, name, var, negated=True))


def update_fp8_state(model, grads: nnx.State) -> nnx.State:
  """Writes the ``Fp8State`` part of ``grads`` (the updated state, as the fused ops return it) into ``model`` and
  returns the rest: for a step that differentiates ``nnx.Any(nnx.Param, te_nnx.Fp8State)`` itself.

  >>> import jax, jax.numpy as jnp, optax, te_jax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=8)):
  ...   layer = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))
  ...   wrt = nnx.DiffState(0, nnx.Any(nnx.Param, te_nnx.Fp8State))
  ...   grads = nnx.grad(lambda m: m(jnp.ones((4, 32))).sum(), argnums=wrt)(layer)
  ...   grads = te_nnx.update_fp8_state(layer, grads)
  >>> sorted(nnx.to_pure_dict(grads)), float(layer.x_amax_history[0])
  (['bias', 'kernel'], 1.0)
  """
  state, rest = nnx.split_state(grads, Fp8State, ...)
  nnx.update(model, state)
  return rest


def value_and_grad(f: Callable, *, argnums: int = 0, has_aux: bool = False, wrt=nnx.Param) -> Callable:
  """``nnx.value_and_grad(f, argnums=argnums, has_aux=has_aux)`` for models with te_jax's FP8 layers: also
  differentiates the model's ``Fp8State`` variables and writes their update into the model; returns the value and
  the gradients of the ``wrt`` variables (default ``nnx.Param``), for ``nnx.Optimizer.update``.

  >>> import jax, jax.numpy as jnp, optax, te_jax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=8)):
  ...   model = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))
  ...   optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  ...   loss, grads = te_nnx.value_and_grad(lambda m: jnp.mean(m(jnp.ones((4, 32))) ** 2))(model)
  ...   _ = optimizer.update(model, grads)
  >>> float(model.x_amax_history[0])
  1.0

  A plain ``nnx.value_and_grad`` (parameters only) would leave the state frozen at its first scales; the FP8 layers
  raise with this fix instead.
  """
  if not isinstance(argnums, int):
    raise TypeError(f"te_jax.nnx.value_and_grad: argnums must be the int position of the model, got {argnums!r}")
  inner = nnx.value_and_grad(f, argnums=nnx.DiffState(argnums, nnx.Any(wrt, Fp8State)), has_aux=has_aux)

  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    value, grads = inner(*args, **kwargs)
    return value, update_fp8_state(args[argnums], grads)

  return wrapped


def grad(f: Callable, *, argnums: int = 0, has_aux: bool = False, wrt=nnx.Param) -> Callable:
  """``nnx.grad`` as ``value_and_grad`` extends ``nnx.value_and_grad``: the gradients of the ``wrt`` variables
  (with ``has_aux``, ``(grads, aux)``), the FP8 state written into the model."""
  vg = value_and_grad(f, argnums=argnums, has_aux=has_aux, wrt=wrt)

  @functools.wraps(f)
  def wrapped(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped


def calibrate(fn: Callable, model, *args, has_aux: bool = False) -> None:
  """Gives the ``Fp8State`` of ``model`` one forward and backward pass before the first train step (in place), as
  ``te_jax.flax.calibrate`` does for linen variables (its docstring says why): ``jax.grad`` of ``fn(model, *args)``
  with every FP8 tensor cast by its own amax, the amaxes rolled into the histories, the scales derived from them.
  Parameters stay as they are, and so does the state of every GEMM the pass does not run with delayed scaling.

  Raises where it would do nothing: under ``DelayedScaling`` on a model without FP8 state, or outside it on a model
  whose state no GEMM updates.
  """
  if not callable(fn):
    raise TypeError(f"calibrate: fn must be a callable loss function, got {type(fn).__name__}")
  delayed = keeps_state(resolve_recipe(None))
  old = nnx.state(model, Fp8State)
  if not jax.tree.leaves(old):
    if delayed:
      raise ValueError("calibrate: the model has no te_jax.nnx.Fp8State under an autocast with DelayedScaling: "
                       "construct it inside that autocast")
    return
  with calibration_pass():
    new = _calibrated(fn, bool(has_aux), model, args)
  unchanged = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.to_pure_dict(new), nnx.to_pure_dict(old))
  if not delayed and all(jax.tree.leaves(unchanged)):
    raise ValueError("calibrate: the pass ran no GEMM with delayed scaling, so no FP8 state changed: call it inside "
                     "te_jax.autocast(enabled=True, recipe=DelayedScaling(...)), as the train step runs")
  nnx.update(model, new)


@nnx.jit(static_argnums=(0, 1))
def _calibrated(fn, has_aux, model, args):
  grads = nnx.grad(fn, argnums=nnx.DiffState(0, Fp8State), has_aux=has_aux)(model, *args)
  grads = grads[0] if has_aux else grads
  old = nnx.state(model, Fp8State)
  new = where_updated(nnx.to_pure_dict(grads), nnx.to_pure_dict(old), "calibrate")
  nnx.replace_by_pure_dict(old, new)
  return old
