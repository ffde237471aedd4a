"""``autocast``: which recipe te_jax's ops and modules use, as part of jax's jit cache key.

The state lives in a ``jax.make_user_context``, so a function traced under one recipe and called under another
(or outside any autocast) is retraced, never silently reused with the wrong numerics.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax

from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["MeshResource", "AutocastState", "autocast", "calibration_pass", "get_autocast_state", "check_fp8_support"]


@dataclasses.dataclass(frozen=True)
class MeshResource:
  """Which mesh axes play which role, for the modules' logical sharding.

  Attributes:
    dp_resource: the data-parallel axis (batch).
    fsdp_resource: the axis parameters are sharded over for FSDP.
    tp_resource: the tensor-parallel axis (heads, MLP hidden).
    sp_resource: the sequence-parallel axis (usually the tensor-parallel one).
  """

  dp_resource: str | None = None
  fsdp_resource: str | None = None
  tp_resource: str | None = None
  sp_resource: str | None = None


@dataclasses.dataclass(frozen=True)
class AutocastState:
  """What ``autocast`` set: hashable, so it can be part of the jit cache key."""

  enabled: bool = False
  recipe: Recipe | None = None
  mesh_resource: MeshResource = MeshResource()
  allow_emulation: bool = False
  # Inside ``calibration_pass``: delayed-scaling tensors are cast by their own amax, the state still updated.
  calibrating: bool = False

  @property
  def fp8_recipe(self) -> Recipe | None:
    """The recipe to quantize with, or None for plain high-precision math."""
    return self.recipe if self.enabled else None


_STATE = jax.make_user_context(AutocastState())


def get_autocast_state() -> AutocastState:
  """The innermost ``autocast``'s state (FP8 disabled outside any)."""
  return _STATE.value


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
    mesh_resource: MeshResource | None = None,
    *,
    allow_emulation: bool = False,
) -> Iterator[AutocastState]:
  """Runs te_jax ops and modules inside with FP8 under ``recipe`` (or in high precision when not ``enabled``).

  >>> import te_jax
  >>> from te_jax import recipe
  >>> with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
  ...   te_jax.get_autocast_state().enabled
  True

  Args:
    enabled: use FP8. ``False`` runs the same modules in plain high-precision math.
    recipe: the FP8 recipe; ``DelayedScaling()`` when None.
    mesh_resource: mesh axis roles for the modules' sharding.
    allow_emulation: on a GPU without FP8 tensor cores (compute capability < 8.9), run the FP8 numerics on the
      pure-JAX path instead of raising.
  """
  if recipe is None:
    recipe = DelayedScaling()
  if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
    raise ValueError(f"recipe must be DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
  if mesh_resource is None:
    mesh_resource = MeshResource()
  if not isinstance(mesh_resource, MeshResource):
    raise ValueError(f"mesh_resource must be a te_jax.MeshResource, got {type(mesh_resource).__name__}")
  if enabled:
    check_fp8_support(allow_emulation)
  state = AutocastState(bool(enabled), recipe, mesh_resource, bool(allow_emulation))
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
