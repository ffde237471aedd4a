"""Quantizers: what each recipe does to a tensor, in one class per recipe.

A quantizer says how a tensor's scale is found (from a kept state, or from the tensor itself), whether the kernel that
produces the tensor (a norm, an activation, the quantize of a gradient) can cast it in the same pass, what state it
keeps between steps (the variables the linen and NNX modules hold for each GEMM, ``state_variables``) and how the
backward pass updates that state. ``quantizer_for`` picks the quantizer of a recipe, the one place that looks at the
recipe's type: the fused ops and the modules ask the quantizer, never the recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax._core import scaling
from te_jax._core.manual_axes import max_over_shards, varying_axes
from te_jax._core.quantized_tensor import ScalingMode
from te_jax.ops.quantize import amax
from te_jax.ops.scale_update import update_scale_states
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["CurrentQuantizer", "DelayedQuantizer", "DenseFp8Meta", "Quantizer", "StateVariable", "quantizer_for",
           "state_combine"]


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


# How the updates of a state variable combine when a step applies its layer several times (shared weights, a module
# called twice), by the kind its name ends with: amax histories by max, scales by min (the scale of the max-combined
# history). A quantizer whose state has another kind of variable names it here.
_COMBINE = {"amax_history": "max", "scale": "min"}


def state_combine(name: str) -> str | None:
  """How the updates of the state variable ``name`` (any GEMM prefix before it: ``wi_x_scale``) combine over the
  applications of its layer in one step, ``"max"`` or ``"min"``, whichever recipe declared it; None where no
  quantizer's state has a variable of that kind.

  >>> state_combine("x_amax_history"), state_combine("wo_grad_scale"), state_combine("kernel")
  ('max', 'min', None)
  """
  return next((combine for kind, combine in _COMBINE.items() if name.endswith(f"_{kind}")), None)


@dataclasses.dataclass(frozen=True)
class StateVariable:
  """One variable of a GEMM's state, as the linen modules (in ``te_jax.FP8_COLLECTION``) and the NNX modules (an
  ``Fp8State`` attribute) hold it, under the GEMM's prefix (``wi_``, ``wo_``, or none).

  >>> var = quantizer_for(DelayedScaling(amax_history_len=16)).state_variables[0]
  >>> var.name, var.shape, var.combine, var.init(var.shape, var.dtype).shape
  ('x_amax_history', (16,), 'max', (16,))

  Attributes:
    name: its name after the prefix.
    shape: its shape in one layer (a state stacked by ``nn.scan`` or ``nnx.vmap`` adds leading dims).
    dtype: its dtype.
    init: ``init(shape, dtype)``, its value in a fresh state.
    shape_from: what in the recipe sets the shape, as an error says it (``"amax_history_len is 16"``); empty where
      the shape is fixed.
  """

  name: str
  shape: tuple[int, ...]
  dtype: jax.typing.DTypeLike
  init: Callable
  shape_from: str = ""

  def __post_init__(self):
    if state_combine(self.name) is None:
      raise ValueError(f"state variable {self.name!r}: its name ends with none of the kinds {', '.join(_COMBINE)}")

  @property
  def combine(self) -> str:
    """How its updates combine over several applications of the layer in a step (``state_combine``)."""
    return state_combine(self.name)

  def wrong_shape(self, name: str, shape) -> str:
    """The error for a held value of this variable (``name``, with its prefix) whose shape is ``shape``."""
    want = (f"the recipe's {self.shape_from}, which gives {self.shape}" if self.shape_from else
            f"the recipe keeps it at {self.shape}")
    return f"{name} has shape {tuple(shape)}, but {want}"


@dataclasses.dataclass(frozen=True)
class Quantizer:
  """The per-tensor quantizer's interface; the subclasses say how the scale is found.

  Attributes:
    recipe: the recipe it quantizes for (its formats and margin).
    mode: the ``ScalingMode`` of the tensors it makes.
    state_variables: the variables of one GEMM's state, in the order the modules create them (which is the order of
      the linen collection and of the NNX module's attributes); none where it keeps no state.
    stateful: it keeps a state per GEMM (``state_variables``), updated by the backward pass.
    fused_cast: the scale is known before the kernel that produces a tensor runs, so that kernel casts it in its own
      pass; otherwise the tensor is written in high precision and quantized by a second pass.
  """

  recipe: Recipe
  mode = ScalingMode.PER_TENSOR
  fused_cast = False

  @property
  def state_variables(self) -> tuple[StateVariable, ...]:
    return ()

  @property
  def stateful(self) -> bool:
    return bool(self.state_variables)

  def state_meta(self, values: Sequence[jax.Array]):
    """The state the fused ops take (``te_jax.DenseFp8Meta`` for delayed scaling) from the values of
    ``state_variables``, in that order (as the module hands them over: views whose updates combine as
    ``StateVariable.combine`` says)."""
    raise TypeError(f"{type(self).__name__} keeps no state")

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

  @property
  def fused_cast(self) -> bool:
    return not self.calibrating

  @property
  def state_variables(self) -> tuple[StateVariable, ...]:
    """For each of the GEMM's input, kernel and output gradient (``DenseFp8Meta``'s fields, in order), its float32
    amax history (zeros, ``amax_history_len`` long) and its float32 scale (1)."""
    length = self.recipe.amax_history_len
    return tuple(v for tensor in DenseFp8Meta._fields for v in (
        StateVariable(f"{tensor}_amax_history", (length,), jnp.float32, jnp.zeros, f"amax_history_len is {length}"),
        StateVariable(f"{tensor}_scale", (), jnp.float32, jnp.ones)))

  def state_meta(self, values):
    histories, scales = values[0::2], values[1::2]
    return DenseFp8Meta(*(scaling.ScaleState(h, s) for h, s in zip(histories, scales, strict=True)))

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
