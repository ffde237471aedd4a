"""Flax linen dense layers whose GEMMs run in FP8 under ``te_jax.autocast``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax._core.autocast import resolve_recipe
from te_jax.flax.fp8_state import fp8_state
from te_jax.flax.params import Initializer, features_tuple, logical
from te_jax.fused.dense import dense, normalize_axes
from te_jax.recipe import Recipe

__all__ = ["DenseGeneral", "Fp8DotGeneral"]


class DenseGeneral(nn.Module):
  """A dense layer over any input axes, with FP8 GEMMs under ``te_jax.autocast``.

  Flax's ``nn.DenseGeneral`` conventions (same parameter names, shapes and default initializers, so a checkpoint
  of one loads into the other), plus logical axis names for sharding and the FP8 state collection.

  >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> layer = te_flax.DenseGeneral(features=32, dtype=jnp.bfloat16)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   variables = layer.init(jax.random.key(0), jnp.ones((8, 64)))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'bias': (32,), 'kernel': (64, 32)}
  >>> sorted(variables[te_jax.FP8_COLLECTION])[:2]
  ['grad_amax_history', 'grad_scale']

  Attributes:
    features: the output features (int or tuple).
    axis: the input axes to contract.
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``).
    use_bias: add a bias.
    kernel_init: initializer of the kernel, called on its 2-D (inputs, outputs) shape as Flax does.
    bias_init: initializer of the bias.
    dtype: the compute dtype (None: the input's).
    param_dtype: the dtype of the parameters.
    kernel_axes: logical axis names of the kernel (``(*input axes, *feature axes)``).
    bias_axes: logical axis names of the bias.
    recipe: an FP8 recipe for this layer, overriding autocast's.
  """

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  unstack_axis: int | None = None
  use_bias: bool = True
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, residual: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """The layer's output, plus ``residual`` (the output's shape) when given: added in the GEMM's epilogue."""
    features = features_tuple(self.features)
    axis = tuple(sorted(normalize_axes(self.axis, inputs.ndim, "inputs")))  # sorted, as Flax does: same kernel shapes
    kernel_shape = tuple(inputs.shape[a] for a in axis) + features
    n_in = len(axis)

    def kernel_init(rng, shape, dtype):
      flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
      return jnp.reshape(self.kernel_init(rng, flat, dtype), shape)

    kernel = self.param("kernel", logical(kernel_init, self.kernel_axes), kernel_shape, self.param_dtype)
    bias = None
    if self.use_bias:

      def bias_init(rng, shape, dtype):
        return jnp.reshape(self.bias_init(rng, (int(np.prod(shape)),), dtype), shape)

      bias = self.param("bias", logical(bias_init, self.bias_axes), features, self.param_dtype)
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    recipe = resolve_recipe(self.recipe)
    x, (meta,) = fp8_state(self, recipe, inputs.astype(dtype))
    return dense(x, kernel, bias, axis=axis, unstack_axis=self.unstack_axis, residual=residual, fp8_meta=meta,
                 recipe=recipe)


class Fp8DotGeneral(nn.Module):
  """te_jax's FP8 dense GEMM as a ``dot_general_cls`` for Flax's own layers.

  >>> import flax.linen as nn, jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> layer = nn.Dense(16, dot_general_cls=te_flax.Fp8DotGeneral)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((4, 32)))
  >>> y.shape
  (4, 16)

  Takes ``(lhs, rhs, dimension_numbers)`` with the contracting dims of ``rhs`` leading and no batch dims (what
  ``nn.Dense`` and ``nn.DenseGeneral`` pass). Outside an enabled autocast it is a plain ``lax.dot_general``.

  Attributes:
    recipe: an FP8 recipe for this GEMM, overriding autocast's.
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    recipe = resolve_recipe(self.recipe)
    if recipe is None:
      return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type)
    if lhs_batch or rhs_batch or tuple(rhs_contract) != tuple(range(len(rhs_contract))):
      raise ValueError(
          f"Fp8DotGeneral takes no batch dims and rhs contracting dims leading, got {dimension_numbers}"
      )
    lhs, (meta,) = fp8_state(self, recipe, lhs)
    out = dense(lhs, rhs, axis=tuple(lhs_contract), fp8_meta=meta, recipe=recipe)
    return out if preferred_element_type is None else out.astype(preferred_element_type)
