"""Quantizers: what each recipe does to a tensor, in one class per recipe.

A quantizer says how a tensor of each role in a GEMM (its input ``"x"``, its ``"kernel"``, the output gradient
``"grad"``) is quantized (``quantize``: its scaling mode, element format and scales), whether the kernel that
produces the tensor (a norm, an activation) can cast it in the same pass because its scale is known up front
(``fused_cast``), what state it keeps between steps (the variables the linen and NNX modules hold for each GEMM,
``state_variables``) and how the backward pass updates that state. ``quantizer_for`` picks the quantizer of a recipe,
the one place that looks at the recipe's type: the fused ops and the modules ask the quantizer, never the recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

import numpy as np

from te_jax._core import scaling
from te_jax._core.manual_axes import max_over_shards, varying_axes
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode
from te_jax.ops.quantize import CastOutput, amax, amax_f32, check_input, group_parts, make_config, quantize
from te_jax.ops.quantize_interleaved import interleave, quantize_interleaved
from te_jax.ops import quantize_block as block_ops
from te_jax.ops.scale_update import update_scale_states
from te_jax.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                           NVFP4BlockScaling, Recipe)

__all__ = ["BlockQuantizer", "CurrentQuantizer", "DelayedQuantizer", "DenseFp8Meta", "MXFP8Quantizer",
           "NVFP4Quantizer", "Quantizer", "ROLES", "StateVariable", "quantizer_for", "state_combine"]

#: The roles of the tensors of one GEMM a quantizer quantizes: the layer input, the kernel, the output gradient.
ROLES = ("x", "kernel", "grad")


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
  def fwd_dtype(self):
    """The element format of the forward tensors (inputs, kernels)."""
    return self.recipe.fp8_format.fwd_dtype

  @property
  def bwd_dtype(self):
    """The element format of the gradients."""
    return self.recipe.fp8_format.bwd_dtype

  def mode_for(self, role: str) -> ScalingMode:
    """The ``ScalingMode`` of the tensors of ``role`` (one of ``ROLES``)."""
    return self.mode

  def quantize(self, role: str, state, x: jax.Array, dtype, *, shard_axes: frozenset[str] | None = None,
               transpose: bool = False, transpose_batch_dims: int | None = None,
               transpose_parts: tuple[int, int] | None = None, dbias: bool = False) -> CastOutput:
    """``x``, a tensor of ``role`` whose state (None where the quantizer keeps none) is ``state``, quantized to
    ``dtype``, with ``te_jax.ops.quantize.quantize``'s options (``transpose``: the transposed copy, laid out by
    ``transpose_batch_dims`` and ``transpose_parts``; ``dbias``: the float32 column sums). Per tensor: the scale
    (``scale``) and one quantize pass."""
    del role
    scale = self.scale(state, x, dtype, shard_axes)
    return quantize(x, scale, dtype, transpose=transpose, transpose_batch_dims=transpose_batch_dims,
                    transpose_parts=transpose_parts, dbias=dbias)

  def quantize_parts(self, role: str, state, parts: tuple[jax.Array, ...], dtype, *, group: int,
                     **options) -> CastOutput:
    """``quantize`` of ``te_jax.ops.quantize_interleaved.interleave(parts, group)`` (the GEMM layout of an output
    handed out in parts); per tensor in one pass over the parts, never writing the interleave."""
    del role
    scale = self.scale(state, tuple(parts), dtype)
    return quantize_interleaved(parts, scale, dtype, group=group, **options)

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


# ---- block scaling -----------------------------------------------------------------------------------------------


def _transposed_layout(x: jax.Array, transpose_batch_dims: int | None, transpose_parts) -> jax.Array:
  """The transposed copy's high-precision values, laid out as ``quantize`` lays out ``data_t``."""
  config = make_config(x.shape, jnp.float8_e4m3fn, True, transpose_batch_dims, False, "x")
  xt = jnp.transpose(x, config.transposed_axes(x.ndim))
  return xt if transpose_parts is None else group_parts(xt, *transpose_parts)


@dataclasses.dataclass(frozen=True)
class BlockQuantizer(Quantizer):
  """Block scaling (``Float8BlockScaling``): inputs and gradients per 1 x 128 tile of a row, kernels per 128 x 128
  block, every scale from its block's amax in the quantize itself (so no state, and no fused cast: a norm or an
  activation writes its output in high precision, then the quantize runs). The transposed copy is quantized over its
  own rows (for 128 x 128 blocks: the same values, transposed)."""

  def mode_for(self, role):
    return ScalingMode.BLOCK_128X128 if role == "kernel" else ScalingMode.BLOCK_1X128

  def scale(self, state, x, dtype, shard_axes=None):
    raise TypeError(f"{type(self).__name__} has no per-tensor scale: its quantize finds the scales of each block")

  def _cast(self, role: str, x: jax.Array, dtype, with_transposed: bool, **nvfp4) -> QuantizedTensor:
    return block_ops.quantize_block(x, self.mode_for(role), dtype, power_of_two_scales=self._power_of_two(),
                                    with_transposed=with_transposed, **nvfp4)

  def _power_of_two(self) -> bool:
    return self.recipe.power_of_two_scales

  def _casts(self, role: str, x: jax.Array, xt: jax.Array | None, dtype) -> QuantizedTensor:
    """``x`` quantized, with its transposed copy from ``xt`` (the copy's values, laid out; None: no copy)."""
    if xt is None:
      return self._cast(role, x, dtype, False)
    if x.ndim == 2 and xt.shape == x.shape[::-1]:  # the plain transpose: one call makes both
      return self._cast(role, x, dtype, True)
    q, qt = self._cast(role, x, dtype, False), self._cast(role, xt, dtype, False)
    return dataclasses.replace(q, data_t=qt.data, scale_inv_t=qt.scale_inv)

  def quantize(self, role, state, x, dtype, *, shard_axes=None, transpose=False, transpose_batch_dims=None,
               transpose_parts=None, dbias=False):
    del state, shard_axes  # block scales are local to their block: nothing to reduce over shards
    if role not in ROLES:
      raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    x = check_input(x)
    if not transpose and (transpose_batch_dims is not None or transpose_parts is not None):
      raise ValueError("transpose_batch_dims and transpose_parts need transpose=True")
    xt = _transposed_layout(x, transpose_batch_dims, transpose_parts) if transpose else None
    out = self._casts(role, x, xt, dtype)
    sums = jnp.sum(x.astype(jnp.float32), axis=tuple(range(x.ndim - 1))) if dbias else None
    return CastOutput(out, None, sums)

  def quantize_parts(self, role, state, parts, dtype, *, group, **options):
    return self.quantize(role, state, interleave([check_input(p) for p in parts], group), dtype, **options)


@dataclasses.dataclass(frozen=True)
class MXFP8Quantizer(BlockQuantizer):
  """MXFP8 (``MXFP8BlockScaling``): every tensor per 1 x 32 elements of a row with an E8M0 scale, each direction of a
  tensor with its own scales."""

  def mode_for(self, role):
    return ScalingMode.MXFP8_1X32

  def _power_of_two(self) -> bool:
    return False  # E8M0 scales are powers of two already


# The random Hadamard transform's block: 16 tokens, NVFP4's block.
_RHT = 16
# The salt of the stochastic rounding's key, folded with the bits of the gradient's amax (the draw changes with the
# gradient, step to step, with no state to carry).
_SR_SALT = 0x4E5646


def _hadamard(seed: int) -> np.ndarray:
  """The 16 x 16 orthonormal Hadamard matrix (Sylvester's construction, divided by 4) with its rows' signs flipped by
  16 random signs of ``seed``: an orthogonal matrix Q, so (a Q)(b Q)^T = a b^T."""
  h = np.ones((1, 1))
  while h.shape[0] < _RHT:
    h = np.block([[h, h], [h, -h]])
  signs = np.where(np.random.default_rng(seed).random(_RHT) < 0.5, -1.0, 1.0)
  return (signs[:, None] * h / np.sqrt(_RHT)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class NVFP4Quantizer(BlockQuantizer):
  """NVFP4 (``NVFP4BlockScaling``): E2M1 values, an E4M3 scale per 1 x 16 elements (kernels per 16 x 16 block with
  ``weight_block_2d``) and one float32 scale per tensor, shared by both directions of the tensor (the larger of their
  amaxes sets it). Gradients round stochastically with ``stochastic_rounding``, the key drawn from a salt and the bits
  of the gradient's amax. With ``random_hadamard_transform``, the transposed copies of the input and the gradient
  (the weight-gradient GEMM's operands, contracted over the tokens) are multiplied by one orthogonal 16 x 16 matrix
  over each block of 16 tokens before their cast; the product is unchanged and outliers are spread over the block."""

  @property
  def fwd_dtype(self):
    return block_ops.E2M1

  @property
  def bwd_dtype(self):
    return block_ops.E2M1

  def mode_for(self, role):
    return ScalingMode.NVFP4_1X16

  def _rht(self, xt: jax.Array) -> jax.Array:
    n = xt.shape[-1]
    if n % _RHT:
      raise ValueError(f"NVFP4BlockScaling(random_hadamard_transform=True) transforms the weight gradient's operands "
                       f"over blocks of {_RHT} tokens, but this GEMM contracts over {n} tokens in its last dim; make "
                       f"the sequence a multiple of {_RHT} or pass random_hadamard_transform=False")
    q = jnp.asarray(_hadamard(self.recipe.hadamard_seed))
    blocks = xt.astype(jnp.float32).reshape(*xt.shape[:-1], n // _RHT, _RHT)
    return jnp.matmul(blocks, q, precision=jax.lax.Precision.HIGHEST).reshape(xt.shape)

  def _casts(self, role, x, xt, dtype):
    if jnp.dtype(dtype) != block_ops.E2M1:
      raise ValueError(f"NVFP4BlockScaling quantizes to float4_e2m1fn, got dtype {dtype!r}")
    recipe = self.recipe
    block_2d = role == "kernel" and recipe.weight_block_2d
    finite_amax = lambda v: amax_f32(jnp.where(jnp.isfinite(v), v, 0.0).astype(jnp.float32))  # noqa: E731
    global_amax = finite_amax(x)  # a transposed copy holds the same values, so the same amax
    if xt is not None and role != "kernel" and recipe.random_hadamard_transform:
      xt = self._rht(xt)  # values of their own: the larger amax sets the shared global scale
      global_amax = jnp.maximum(global_amax, finite_amax(xt))
    key = None
    if role == "grad" and recipe.stochastic_rounding:
      key = jax.random.fold_in(jax.random.key(_SR_SALT), jax.lax.bitcast_convert_type(global_amax, jnp.uint32))
    cast = functools.partial(block_ops.quantize_block, mode=ScalingMode.NVFP4_1X16, dtype=block_ops.E2M1,
                             global_amax=global_amax)
    if xt is None:
      return cast(x, block_2d=block_2d, key=key)
    if block_2d and x.ndim == 2 and xt.shape == x.shape[::-1]:  # 16 x 16 blocks: the copy is the transposed values
      return cast(x, block_2d=True, with_transposed=True, key=key)
    q = cast(x, block_2d=block_2d, key=key)
    qt = cast(xt, block_2d=block_2d, key=None if key is None else jax.random.fold_in(key, 1))
    return dataclasses.replace(q, data_t=qt.data, scale_inv_t=qt.scale_inv)


_QUANTIZERS = {DelayedScaling: DelayedQuantizer, Float8CurrentScaling: CurrentQuantizer,
               Float8BlockScaling: BlockQuantizer, MXFP8BlockScaling: MXFP8Quantizer,
               NVFP4BlockScaling: NVFP4Quantizer}


@functools.lru_cache(maxsize=None)
def _make(recipe: Recipe, calibrating: bool) -> Quantizer:
  cls = _QUANTIZERS.get(type(recipe))
  if cls is None:
    raise TypeError(f"no quantizer for the recipe {recipe!r}: one of {', '.join(c.__name__ for c in _QUANTIZERS)}")
  return cls(recipe, calibrating) if cls is DelayedQuantizer else cls(recipe)


def quantizer_for(recipe: Recipe, calibrating: bool = False) -> Quantizer:
  """The quantizer of ``recipe`` (in a calibration pass with ``calibrating``)."""
  return _make(recipe, bool(calibrating))
