"""The FP8 state of a module: delayed-scaling amax histories and scales in the ``_overwrite_with_gradient``
collection.

``dense`` returns the updated state as the gradient of these variables, and
``flax.training.train_state.TrainState.apply_gradients`` writes gradients of this collection over the variables
instead of passing them to the optimizer, so the state follows the train step with no extra user code.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import fp8_ops

from te_jax import scaling
from te_jax.autocast import get_autocast_state
from te_jax.dense import DenseFp8Meta
from te_jax.recipe import DelayedScaling, Recipe

#: The Flax variable collection holding FP8 state (Flax's own name for it, so TrainState handles it).
FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT

_ROLES = ("x", "kernel", "grad")


def resolve_recipe(module_recipe: Recipe | None) -> Recipe | None:
  """The module's own recipe if it has one, else autocast's (None: FP8 off)."""
  return module_recipe if module_recipe is not None else get_autocast_state().fp8_recipe


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
    states.append(scaling.ScaleState(history.value, scale.value))
  return DenseFp8Meta(*states)
