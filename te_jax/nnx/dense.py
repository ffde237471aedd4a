"""NNX dense layers whose GEMMs run in FP8 under ``te_jax.autocast``: ``DenseGeneral``, ``Fp8DotGeneral`` (the
``dot_general`` of ``nnx.Linear`` / ``nnx.LinearGeneral``) and ``Fp8Einsum`` (the ``einsum_op`` of ``nnx.Einsum``),
on the same fused ops as ``te_jax.flax``'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from te_jax.fused.dense import normalize_axes
from te_jax.modules.axes import Initializer, is_int
from te_jax.modules.dense import (DenseGeneralOptions, dense_general, dense_general_params, fp8_dot_general,
                                  fp8_einsum)
from te_jax.nnx.fp8_state import declare_fp8_state
from te_jax.nnx.params import as_tuple
from te_jax.modules.scope import fields_of
from te_jax.nnx.scope import NnxScope, builds
from te_jax.recipe import Recipe

__all__ = ["DenseGeneral", "Fp8DotGeneral", "Fp8Einsum"]


@builds(DenseGeneralOptions)
class DenseGeneral(nnx.Module):
  """A dense layer over any input axes, with FP8 GEMMs under ``te_jax.autocast``: ``nnx.LinearGeneral``'s
  constructor (``in_features``, ``out_features``, ``axis``, ``rngs``, ...) and te_jax.flax.DenseGeneral's math.

  >>> import jax.numpy as jnp, te_jax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   layer = te_nnx.DenseGeneral(64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  ...   y = layer(jnp.ones((8, 64)))
  >>> layer.kernel.shape, y.shape, y.dtype
  ((64, 32), (8, 32), dtype(bfloat16))

  The FP8 state (``Fp8State`` variables) is created when the layer is constructed under a ``DelayedScaling`` recipe
  (autocast's or ``recipe=``). The body is te_jax.flax.DenseGeneral's (``te_jax.modules.dense``): with
  ``batch_axis`` or a ``dot_general`` of the caller's, or sizes that are not multiples of 16, the layer computes in
  high precision as Flax's does.

  Args:
    in_features: the sizes of the contracted input axes (int or tuple).
    out_features: the output features (int or tuple).
    axis: the input axes to contract, as many as ``in_features``.
    batch_axis: leading input axes the kernel has too, with their sizes (``{0: n}``: one kernel per index), as in
      ``nnx.LinearGeneral``; te_jax.flax.DenseGeneral's ``batch_dims``.
    use_bias: add a bias.
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``).
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``).
    param_dtype: the parameters' dtype.
    kernel_init: called on the kernel's 2-D (inputs, outputs) shape, as ``nnx.LinearGeneral`` does; wrap it in
      ``nnx.with_partitioning`` for sharding names.
    bias_init: the bias's initializer.
    precision: ``lax.dot_general``'s precision for the high-precision GEMM.
    dot_general, dot_general_cls: a GEMM of the caller's instead of te_jax's (it runs in high precision).
    kernel_axes, bias_axes: logical axis names, as ``out_sharding`` metadata.
    output_axes: logical axis names of the output, one per dim: the output is constrained to them, and a
      sequence-parallel output's rows are sharded as te_jax.flax.DenseGeneral's ``output_axes`` says.
    kernel_metadata, bias_metadata: more metadata for the variables.
    recipe: an FP8 recipe for this layer, overriding autocast's.
    quantization_checkpoint_name: the checkpoint name of the FP8 tensors saved for the backward pass, as
      te_jax.flax.DenseGeneral's (None: ``te_jax.FP8_RESIDUAL``).
    rngs: the ``params`` stream initializes the parameters.
  """

  def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
               axis: int | Sequence[int] = -1, batch_axis: Mapping[int, int] = FrozenDict(), use_bias: bool = True,
               unstack_axis: int | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), precision: Any = None,
               dot_general: Any = None, dot_general_cls: Any = None, kernel_axes: tuple[str | None, ...] = (),
               bias_axes: tuple[str | None, ...] = (), output_axes: tuple[str | None, ...] = (),
               kernel_metadata=None, bias_metadata=None, recipe: Recipe | None = None,
               quantization_checkpoint_name: str | None = None, rngs: nnx.Rngs):
    self.in_features = as_tuple(in_features, "in_features")
    self.axis = tuple(axis) if isinstance(axis, Sequence) else (axis,)
    if len(self.axis) != len(self.in_features):
      raise ValueError(f"in_features {self.in_features} and axis {self.axis} must have the same length")
    batch_axis = dict(batch_axis)
    if sorted(batch_axis) != list(range(len(batch_axis))) or not all(is_int(v) and v > 0 for v in batch_axis.values()):
      raise ValueError(f"batch_axis must map the leading input axes 0, 1, ... to their sizes, got {batch_axis!r}")
    self.batch_axis = FrozenDict(batch_axis)
    self.options = nnx.static(DenseGeneralOptions(
        features=as_tuple(out_features, "out_features"), axis=self.axis, batch_dims=tuple(sorted(batch_axis)),
        unstack_axis=unstack_axis, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
        param_dtype=param_dtype, precision=precision, dot_general=dot_general, dot_general_cls=dot_general_cls,
        kernel_axes=tuple(kernel_axes), bias_axes=tuple(bias_axes), output_axes=tuple(output_axes), recipe=recipe,
        quantization_checkpoint_name=quantization_checkpoint_name))
    self.out_features = self.options.features
    self.bias = nnx.data(None)
    scope = NnxScope(self, rngs, {"kernel": kernel_metadata, "bias": bias_metadata})
    dense_general_params(scope, self.options, tuple(batch_axis[a] for a in sorted(batch_axis)), self.in_features,
                         None)

  @classmethod
  def from_options(cls, options: DenseGeneralOptions, in_features, *, rngs: nnx.Rngs) -> "DenseGeneral":
    """The layer of ``options`` (``te_jax.modules.dense``) over inputs whose contracted axes have ``in_features``."""
    kw = fields_of(options)
    if kw.pop("batch_dims"):
      raise ValueError("DenseGeneral.from_options: give batch_axis (with the sizes) to the constructor instead")
    return cls(in_features, kw.pop("features"), **kw, rngs=rngs)

  def __call__(self, inputs: jax.Array, residual: jax.Array | None = None, out_sharding=None):
    """The layer's output, plus ``residual`` (the output's shape) when given: added in the GEMM's epilogue.

    ``out_sharding`` (a ``PartitionSpec`` of the output's dims, or a ``NamedSharding``), as ``nnx.LinearGeneral``
    takes it: on a mesh with Explicit axes the output's type (the GEMM writes it so: a contraction sharded over the
    axes that shard an output dim ends in a reduce-scatter onto it), on an Auto one a sharding constraint
    (``te_jax.dense``'s ``out_sharding``)."""
    inputs = jnp.asarray(inputs)
    axis = normalize_axes(self.axis, inputs.ndim, "inputs")
    if tuple(inputs.shape[a] for a in axis) != self.in_features:
      raise ValueError(f"inputs of shape {inputs.shape} have {tuple(inputs.shape[a] for a in axis)} on axis "
                       f"{self.axis}, the layer was built for in_features={self.in_features}")
    return dense_general(NnxScope(self), self.options, inputs, residual, out_sharding)


class Fp8DotGeneral(nnx.Module):
  """te_jax's FP8 dense GEMM as the ``dot_general`` of ``nnx.Linear`` / ``nnx.LinearGeneral`` (one instance per
  layer: it holds that GEMM's FP8 state).

  >>> import jax.numpy as jnp, te_jax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   layer = nnx.Linear(32, 16, dot_general=te_nnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
  ...   y = layer(jnp.ones((4, 32)))
  >>> y.shape, layer.dot_general.x_amax_history.shape
  ((4, 16), (16,))

  Takes ``lax.dot_general``'s ``(lhs, rhs, dimension_numbers)`` with any dimension numbers (``nnx.LinearGeneral``'s
  ``batch_axis`` too), lhs quantized as the GEMM's input and rhs as its kernel, through
  ``te_jax.fused.dot_general.dot_general``: with batch dims one batched product of the FP8 operands, under per-tensor
  recipes. It is also ``jnp.einsum``'s ``_dot_general``; for ``nnx.Einsum`` use ``Fp8Einsum``. Outside an enabled
  autocast it is a plain ``lax.dot_general``.

  Args:
    recipe: an FP8 recipe for this GEMM, overriding autocast's (at construction and at the call).
  """

  def __init__(self, recipe: Recipe | None = None):
    self.recipe = recipe
    declare_fp8_state(self, recipe)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    return fp8_dot_general(NnxScope(self), self.recipe, lhs, rhs, dimension_numbers, precision,
                           preferred_element_type, out_sharding=out_sharding)


class Fp8Einsum(nnx.Module):
  """A two-operand einsum as one FP8 GEMM, the ``einsum_op`` of ``nnx.Einsum`` (one instance per layer: it holds that
  GEMM's FP8 state), or called on two activations (``'BSNH,BTNH->BNTS'``, batched over B and N).

  >>> import jax.numpy as jnp, te_jax
  >>> from flax import nnx
  >>> from te_jax.nnx.dense import Fp8Einsum
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   layer = nnx.Einsum('BTD,NDH->BTNH', (4, 32, 16), einsum_op=Fp8Einsum(), rngs=nnx.Rngs(0))
  ...   y = layer(jnp.ones((2, 8, 32)))
  >>> y.shape, layer.einsum_op.x_amax_history.shape
  ((2, 8, 4, 16), (16,))

  Takes ``(subscripts, lhs, rhs)``: ``'lhs,rhs->out'`` with an explicit output and one letter per dim; lhs is
  quantized as the GEMM's input, rhs as its kernel (the order given, whichever ``jnp.einsum`` would pick). Outside an
  enabled autocast it is ``jnp.einsum``'s result computed as one ``lax.dot_general``.

  Args:
    recipe: an FP8 recipe for this GEMM, overriding autocast's (at construction and at the call).
  """

  def __init__(self, recipe: Recipe | None = None):
    self.recipe = recipe
    declare_fp8_state(self, recipe)

  def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None):
    return fp8_einsum(NnxScope(self), self.recipe, subscripts, lhs, rhs, precision, preferred_element_type,
                      out_sharding)
