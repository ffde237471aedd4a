"""``autocast``: which recipe te_jax's ops and modules use, as part of jax's jit cache key.

The state lives in a ``jax.make_user_context``, so a function traced under one recipe and called under another
(or outside any autocast) is retraced, never silently reused with the wrong numerics.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import typing

import jax
import numpy as np

from te_jax._core import determinism
from te_jax.recipe import DelayedScaling, Recipe

__all__ = [
    "AutocastState", "autocast", "calibration_pass", "check_fp8_support", "check_recipe", "get_autocast_state",
    "resolve_recipe",
]


@dataclasses.dataclass(frozen=True)
class AutocastState:
  """What ``autocast`` set: hashable, so it can be part of the jit cache key."""

  enabled: bool = False
  recipe: Recipe | None = None
  allow_emulation: bool = False
  # Inside ``calibration_pass``: delayed-scaling tensors are cast by their own amax, the state still updated.
  calibrating: bool = False
  # Repeatable runs (``te_jax._core.determinism``): te_jax's GEMMs take cuBLASLt's heuristic choice, never timed.
  deterministic: bool = False

  @property
  def fp8_recipe(self) -> Recipe | None:
    """The recipe to quantize with, or None for plain high-precision math."""
    return self.recipe if self.enabled else None


if determinism.env_requested():  # XLA reads XLA_FLAGS when JAX starts its backends: importing te_jax is earlier
  determinism.request_xla_deterministic()
_STATE = jax.make_user_context(AutocastState(deterministic=determinism.env_requested()))


def get_autocast_state() -> AutocastState:
  """The innermost ``autocast``'s state (FP8 disabled outside any)."""
  return _STATE.value


def check_recipe(recipe) -> Recipe:
  """``recipe`` if it is one of ``te_jax.recipe``'s recipes, else a ValueError that names it."""
  recipes = typing.get_args(Recipe)
  if isinstance(recipe, recipes):
    return recipe
  names = ", ".join(f"te_jax.recipe.{r.__name__}()" for r in recipes)
  if isinstance(recipe, type) and issubclass(recipe, recipes):
    raise ValueError(f"recipe must be a recipe instance, got the class {recipe.__name__}: pass {recipe.__name__}()")
  raise ValueError(f"recipe must be one of {names}, got {recipe!r} ({type(recipe).__name__})")


def resolve_recipe(recipe: Recipe | None) -> Recipe | None:
  """The recipe an op or module runs with: its own ``recipe=`` when given (checked), else the innermost enabled
  ``autocast``'s; None means plain high-precision math."""
  return get_autocast_state().fp8_recipe if recipe is None else check_recipe(recipe)


def check_fp8_support(allow_emulation: bool) -> None:
  """Raises when FP8 cannot run natively here and emulation was not asked for.

  FP8 tensor cores need compute capability >= 8.9 (Ada, Hopper, Blackwell). On an older GPU the pure-JAX path would
  run FP8 numerics at high-precision speed; that is allowed only with ``allow_emulation=True``. On CPU the
  emulated numerics are the point (tests, notebooks), so they always run.
  """
  if allow_emulation:
    return
  for device in jax.local_devices():
    if device.platform != "gpu":
      continue
    cc = getattr(device, "compute_capability", None)
    if cc is None:
      continue
    major, minor = (int(v) for v in str(cc).split(".")[:2])
    if (major, minor) < (8, 9):
      raise RuntimeError(
          f"FP8 needs compute capability >= 8.9, but {device.device_kind} has {cc}. Pass "
          "autocast(..., allow_emulation=True) to run the FP8 numerics on the pure-JAX path anyway (slow)."
      )


@contextlib.contextmanager
def autocast(
    enabled: bool = False,
    recipe: Recipe | None = None,
    *,
    allow_emulation: bool = False,
    deterministic: bool | None = None,
) -> Iterator[AutocastState]:
  """Runs te_jax ops and modules inside with FP8 under ``recipe`` (or in high precision when not ``enabled``).

  >>> import te_jax
  >>> from te_jax import recipe
  >>> with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling(amax_history_len=16)) as state:
  ...   state.fp8_recipe.amax_history_len
  16

  Args:
    enabled: use FP8. ``False`` runs the same modules in plain high-precision math.
    recipe: the FP8 recipe; ``DelayedScaling()`` when None.
    allow_emulation: on a GPU without FP8 tensor cores (compute capability < 8.9), run the FP8 numerics on the
      pure-JAX path instead of raising.
    deterministic: repeatable runs (FP8 or not): te_jax's GEMMs take cuBLASLt's heuristic algorithm instead of the
      fastest one timed at the first call; on a GPU, XLA must run its own ops deterministically too
      (``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` when JAX starts, or ``TE_JAX_DETERMINISTIC=1``), else this
      raises. None: the enclosing autocast's choice (``TE_JAX_DETERMINISTIC`` outside any).
  """
  if deterministic is None:
    deterministic = get_autocast_state().deterministic
  for name, flag in (("enabled", enabled), ("allow_emulation", allow_emulation), ("deterministic", deterministic)):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"autocast: {name} must be a bool, got {flag!r}")
  recipe = check_recipe(DelayedScaling() if recipe is None else recipe)
  if enabled:
    check_fp8_support(allow_emulation)
  if deterministic:
    determinism.check_xla_deterministic()
  state = AutocastState(bool(enabled), recipe, bool(allow_emulation), deterministic=bool(deterministic))
  with _STATE(state):
    yield state


@contextlib.contextmanager
def calibration_pass() -> Iterator[AutocastState]:
  """Inside (within an FP8 ``autocast``): every tensor a ``DelayedScaling`` state would scale is cast by its own
  amax instead (current scaling), and the state is updated with the amaxes as in a train step. For
  ``te_jax.flax.calibrate``: the pass that gives a fresh state its first amaxes."""
  state = dataclasses.replace(get_autocast_state(), calibrating=True)
  with _STATE(state):
    yield state
