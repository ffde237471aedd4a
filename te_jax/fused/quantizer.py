"""Quantizers: what each recipe does to a tensor, in one class per recipe.

A quantizer says how a tensor's scale is found (from a kept state, or from the tensor itself), whether the kernel that
produces the tensor (a norm, an activation, the quantize of a gradient) can cast it in the same pass, what state it
keeps between steps and how the backward pass updates that state. ``quantizer_for`` picks the quantizer of a recipe,
the one place that looks at the recipe's type: the fused ops and the modules ask the quantizer, never the recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax._core import scaling
from te_jax._core.manual_axes import max_over_shards, varying_axes
from te_jax._core.quantized_tensor import ScalingMode
from te_jax.ops.quantize import amax
from te_jax.ops.scale_update import update_scale_states
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["CurrentQuantizer", "DelayedQuantizer", "DenseFp8Meta", "Quantizer", "quantizer_for"]


class DenseFp8Meta(NamedTuple):
  """Delayed-scaling state of one FP8 GEMM: its input, kernel and output gradient.

  >>> import te_jax
  >>> meta = te_jax.DenseFp8Meta.create(history_len=16)
  >>> meta.x.amax_history.shape, float(meta.kernel.scale)
  ((16,), 1.0)
  """

  x: scaling.ScaleState
  kernel: scaling.ScaleState
  grad: scaling.ScaleState

  @classmethod
  def create(cls, history_len: int) -> "DenseFp8Meta":
    return cls(*(scaling.ScaleState.create(history_len) for _ in range(3)))


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """The per-tensor quantizer's interface; the subclasses say how the scale is found.

  Attributes:
    recipe: the recipe it quantizes for (its formats and margin).
    mode: the ``ScalingMode`` of the tensors it makes.
    stateful: it keeps a state per GEMM (``te_jax.DenseFp8Meta``) in the FP8 collection, updated by the backward pass.
    fused_cast: the scale is known before the kernel that produces a tensor runs, so that kernel casts it in its own
      pass; otherwise the tensor is written in high precision and quantized by a second pass.
  """

  recipe: Recipe
  mode = ScalingMode.PER_TENSOR
  stateful = False
  fused_cast = False

  def check_state(self, states: dict) -> None:
    """Raises unless each of a fused op's state arguments (by name) is what this quantizer needs."""

  def scale(self, state: scaling.ScaleState | None, x: jax.Array | tuple[jax.Array, ...] | None, dtype,
            shard_axes: frozenset[str] | None = None) -> jax.Array:
    """The float32 scale to cast ``x`` (an array, or the parts of one) to ``dtype`` with."""
    raise NotImplementedError

  def update(self, items):
    """The next step's states of one or more GEMMs: ``items`` are ``(meta, amax_x, amax_kernel, amax_grad)``."""
    raise NotImplementedError


def _current_scale(x, dtype, shard_axes) -> jax.Array:
  """The scale from ``x``'s own amax; inside shard_map the amax of the whole tensor, reduced over ``shard_axes``
  (None: every manual axis ``x`` varies over)."""
  a = jnp.max(jnp.stack([amax(p) for p in x])) if isinstance(x, tuple) else amax(x)
  (a,) = max_over_shards([a], [shard_axes])
  return scaling.compute_scale(a, jnp.float32(1.0), scaling.fp8_max(dtype))


@dataclasses.dataclass(frozen=True)
class CurrentQuantizer(Quantizer):
  """Current scaling: each tensor cast by its own amax, found by a pass before the cast. No state."""

  def scale(self, state, x, dtype, shard_axes=None):
    del state
    return _current_scale(x, dtype, shard_axes)


@dataclasses.dataclass(frozen=True)
class DelayedQuantizer(Quantizer):
  """Delayed scaling: each tensor cast with the scale its amax history gave at the step before; the backward pass
  rolls this step's amaxes into the histories and derives the next scales.

  Attributes:
    calibrating: a calibration pass (``te_jax.autocast.calibration_pass``): tensors are cast by their own amax (as
      current scaling casts them) and the state still records them.
  """

  calibrating: bool = False
  stateful = True

  @property
  def fused_cast(self) -> bool:
    return not self.calibrating

  def check_state(self, states: dict) -> None:
    for name, state in states.items():
      if state is None:
        raise ValueError(f"DelayedScaling needs {name} (a te_jax.DenseFp8Meta) with the layer's scaling state")
      if not isinstance(state, DenseFp8Meta):
        raise TypeError(f"{name} must be a te_jax.DenseFp8Meta, got {type(state).__name__}")

  def scale(self, state, x, dtype, shard_axes=None):
    if self.calibrating:
      return _current_scale(x, dtype, shard_axes)
    return state.scale

  def update(self, items):
    """Returns the new metas, of the types given, updated together (one batched computation).

    A non-finite amax never enters a history: when any amax of the call is NaN or infinite, every state of the call
    stays as it was. A step whose loss is not finite has non-finite output gradients in every layer, so such a step
    leaves the whole FP8 state unchanged, as ``optax.apply_if_finite`` leaves the parameters."""
    recipe = self.recipe
    states = [s for meta, *_ in items for s in meta]
    # Inside shard_map: the amax of the whole tensor wherever the state is replicated (as under jax.jit).
    amaxes = [a for _, *amaxes in items for a in amaxes]
    amaxes = max_over_shards(amaxes, [varying_axes(a) - varying_axes(s.amax_history) for a, s in zip(amaxes, states)])
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    new = update_scale_states(states, amaxes, [fwd, fwd, bwd] * len(items), margin=recipe.margin,
                              algo=recipe.amax_compute_algo)
    finite = jnp.all(jnp.isfinite(jnp.stack(amaxes)))
    new = [scaling.ScaleState(jnp.where(finite, n.amax_history, s.amax_history), jnp.where(finite, n.scale, s.scale))
           for n, s in zip(new, states)]
    return [type(meta)(*new[3 * i:3 * i + 3]) for i, (meta, *_) in enumerate(items)]


_QUANTIZERS = {DelayedScaling: DelayedQuantizer, Float8CurrentScaling: CurrentQuantizer}


@functools.lru_cache(maxsize=None)
def _make(recipe: Recipe, calibrating: bool) -> Quantizer:
  cls = _QUANTIZERS.get(type(recipe))
  if cls is None:
    raise TypeError(f"no quantizer for the recipe {recipe!r}: one of {', '.join(c.__name__ for c in _QUANTIZERS)}")
  return cls(recipe, calibrating) if cls is DelayedQuantizer else cls(recipe)


def quantizer_for(recipe: Recipe, calibrating: bool = False) -> Quantizer:
  """The quantizer of ``recipe`` (in a calibration pass with ``calibrating``)."""
  return _make(recipe, bool(calibrating))
