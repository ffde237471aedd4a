"""NNX dense layers whose GEMMs run in FP8 under ``te_jax.autocast``: ``DenseGeneral`` and ``Fp8DotGeneral`` (the
``dot_general`` of ``nnx.Linear`` / ``nnx.LinearGeneral``), on the same fused op as ``te_jax.flax``'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax._core.autocast import resolve_recipe
from te_jax.flax.params import Initializer
from te_jax.fused.dense import dense, normalize_axes
from te_jax.nnx.fp8_state import declare_fp8_state, fp8_metas
from te_jax.nnx.params import as_tuple, make_param, part_axis
from te_jax.recipe import Recipe

__all__ = ["DenseGeneral", "Fp8DotGeneral"]


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
  (autocast's or ``recipe=``). A GEMM whose sizes are not multiples of 16 runs in high precision.

  Args:
    in_features: the sizes of the contracted input axes (int or tuple).
    out_features: the output features (int or tuple).
    axis: the input axes to contract, as many as ``in_features``.
    use_bias: add a bias.
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``).
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``).
    param_dtype: the parameters' dtype.
    kernel_init: called on the kernel's 2-D (inputs, outputs) shape, as ``nnx.LinearGeneral`` does; wrap it in
      ``nnx.with_partitioning`` for sharding names.
    bias_init: the bias's initializer.
    precision: ``lax.dot_general``'s precision for the high-precision GEMM.
    kernel_axes, bias_axes: logical axis names, as ``out_sharding`` metadata.
    kernel_metadata, bias_metadata: more metadata for the variables.
    recipe: an FP8 recipe for this layer, overriding autocast's.
    rngs: the ``params`` stream initializes the parameters.
  """

  def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
               axis: int | Sequence[int] = -1, use_bias: bool = True, unstack_axis: int | None = None,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), precision: Any = None,
               kernel_axes: tuple[str | None, ...] = (), bias_axes: tuple[str | None, ...] = (),
               kernel_metadata=None, bias_metadata=None, recipe: Recipe | None = None, rngs: nnx.Rngs):
    self.in_features = as_tuple(in_features, "in_features")
    self.out_features = as_tuple(out_features, "out_features")
    self.axis = tuple(axis) if isinstance(axis, Sequence) else (axis,)
    if len(self.axis) != len(self.in_features):
      raise ValueError(f"in_features {self.in_features} and axis {self.axis} must have the same length")
    self.unstack_axis = unstack_axis
    self.dtype, self.param_dtype, self.precision, self.recipe = dtype, param_dtype, precision, recipe
    self.kernel = make_param(kernel_init, rngs.params(), self.in_features + self.out_features, param_dtype,
                             n_in=len(self.in_features), part_axis=part_axis(unstack_axis, len(self.in_features), self.out_features), axes=kernel_axes, metadata=kernel_metadata)
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = make_param(bias_init, rngs.params(), self.out_features, param_dtype, n_in=0, axes=bias_axes,
                             metadata=bias_metadata)
    declare_fp8_state(self, recipe)

  def __call__(self, inputs: jax.Array, residual: jax.Array | None = None):
    """The layer's output, plus ``residual`` (the output's shape) when given: added in the GEMM's epilogue."""
    inputs = jnp.asarray(inputs)
    axis = normalize_axes(self.axis, inputs.ndim, "inputs")
    if tuple(inputs.shape[a] for a in axis) != self.in_features:
      raise ValueError(f"inputs of shape {inputs.shape} have {tuple(inputs.shape[a] for a in axis)} on axis "
                       f"{self.axis}, the layer was built for in_features={self.in_features}")
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    recipe = resolve_recipe(self.recipe)
    x, (meta,) = fp8_metas(self, recipe, inputs.astype(dtype))
    bias = None if self.bias is None else self.bias[...]
    return dense(x, self.kernel[...], bias, axis=tuple(axis), unstack_axis=self.unstack_axis, residual=residual,
                 fp8_meta=meta, recipe=recipe, precision=self.precision)


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

  Takes ``(lhs, rhs, dimension_numbers)`` with the contracting dims of ``rhs`` leading and no batch dims (what
  ``nnx.Linear`` and ``nnx.LinearGeneral`` without ``batch_axis`` pass). Outside an enabled autocast it is a plain
  ``lax.dot_general``.

  Args:
    recipe: an FP8 recipe for this GEMM, overriding autocast's (at construction and at the call).
  """

  def __init__(self, recipe: Recipe | None = None):
    self.recipe = recipe
    declare_fp8_state(self, recipe)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    recipe = resolve_recipe(self.recipe)
    if recipe is None:
      return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    if out_sharding is not None:
      raise ValueError("Fp8DotGeneral takes no out_sharding: shard the input and the kernel instead")
    if lhs_batch or rhs_batch or tuple(rhs_contract) != tuple(range(len(rhs_contract))):
      raise ValueError(f"Fp8DotGeneral takes no batch dims and rhs contracting dims leading, got {dimension_numbers}")
    lhs, (meta,) = fp8_metas(self, recipe, lhs)
    out = dense(lhs, rhs, axis=tuple(lhs_contract), fp8_meta=meta, recipe=recipe)
    return out if preferred_element_type is None else out.astype(preferred_element_type)
