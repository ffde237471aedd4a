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
from te_jax.flax.params import Initializer, features_tuple, flat_init, logical, reshaped, rule_shards, sequence_kept
from te_jax.fused.dense import dense, normalize_axes
from te_jax.fused.linear import Unstack
from te_jax.recipe import Recipe

__all__ = ["DenseGeneral", "Fp8DotGeneral"]


class DenseGeneral(nn.Module):
  """A dense layer over any input axes, with FP8 GEMMs under ``te_jax.autocast``.

  Flax's ``nn.DenseGeneral``, attribute for attribute (same parameter names, shapes and default initializers, so a
  checkpoint of one loads into the other; initializers that name their axes with ``nn.with_logical_partitioning``),
  plus logical axis names for sharding and the FP8 state collection.

  >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> layer = te_flax.DenseGeneral(features=32, dtype=jnp.bfloat16)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   variables = layer.init(jax.random.key(0), jnp.ones((8, 64)))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'bias': (32,), 'kernel': (64, 32)}
  >>> sorted(variables[te_jax.FP8_COLLECTION])[:2]
  ['grad_amax_history', 'grad_scale']

  Under FP8 the GEMM is te_jax's, unless it cannot be: with ``batch_dims`` or a ``dot_general`` of the caller's, or
  sizes that are not multiples of 16 (an FP8 GEMM's), the layer computes in high precision as Flax's does and hands
  its FP8 state back unchanged.

  Attributes:
    features: the output features (int or tuple).
    axis: the input axes to contract.
    batch_dims: leading input axes the kernel has too (one kernel per index), as in ``nn.DenseGeneral``.
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``); the
      kernel is then a stack of separate projections (a fused QKV kernel), and ``kernel_init`` initializes each part
      as a kernel of its own (its 2-D shape without the unstacked axis, its own key of ``jax.random.split``).
    use_bias: add a bias.
    kernel_init: initializer of the kernel, called on its 2-D (inputs, outputs) shape as Flax does (per part with
      ``unstack_axis``).
    bias_init: initializer of the bias.
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``, as in Flax).
    param_dtype: the dtype of the parameters.
    precision: ``lax.dot_general``'s precision for the high-precision GEMM.
    dot_general, dot_general_cls: a GEMM of the caller's instead of te_jax's (as in Flax; it runs in high precision).
    kernel_axes: logical axis names of the kernel (``(*input axes, *feature axes)``).
    bias_axes: logical axis names of the bias.
    output_axes: logical axis names of the output (one per dim): the output is constrained to them
      (``nn.with_logical_constraint``). When the output has two non-feature dims (B, S) and the rules shard S (a
      sequence-parallel residual stream), the FP8 GEMM takes its rows' sharding from that constraint rather than from
      the input's, so a row-parallel layer (its contraction sharded over the tensor axis) ends in one reduce-scatter
      onto the stream instead of an all-reduce and a slice (``te_jax.dense``'s ``scatter_rows``). When S is sharded
      over a mesh axis tensor parallelism does not use (context parallelism), the layer keeps (B, S) as two dims
      throughout, sharded as they come (``te_jax.dense``'s ``keep_rows``): the merged (B * S) rows could not be
      sharded that way, and XLA would all-gather the sequence.
    recipe: an FP8 recipe for this layer, overriding autocast's.
  """

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  batch_dims: Sequence[int] = ()
  unstack_axis: int | None = None
  use_bias: bool = True
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  dot_general: Any = None
  dot_general_cls: Any = None
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  output_axes: tuple[str | None, ...] = ()
  recipe: Recipe | None = None

  def _constrained(self, y):
    return nn.with_logical_constraint(y, tuple(self.output_axes)) if self.output_axes else y

  @nn.compact
  def __call__(self, inputs: jax.Array, residual: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """The layer's output, plus ``residual`` (the output's shape) when given: added in the GEMM's epilogue."""
    inputs = jnp.asarray(inputs)
    features = features_tuple(self.features)
    batch_dims = tuple(sorted(normalize_axes(self.batch_dims, inputs.ndim, "batch_dims")))
    if batch_dims != tuple(range(len(batch_dims))):
      raise ValueError(f"batch_dims {self.batch_dims} must be consecutive leading dimensions starting from 0")
    axis = tuple(sorted(normalize_axes(self.axis, inputs.ndim, "inputs")))  # sorted, as Flax does: same kernel shapes
    if set(axis) & set(batch_dims):
      raise ValueError(f"axis {self.axis} and batch_dims {self.batch_dims} overlap")
    if self.dot_general is not None and self.dot_general_cls is not None:
      raise ValueError("give dot_general or dot_general_cls, not both")
    n_batch, n_in = len(batch_dims), len(axis)
    if self.output_axes and (len(self.output_axes) != inputs.ndim - n_in + len(features) or
                             self.unstack_axis is not None):
      raise ValueError(f"output_axes {self.output_axes} must name each of the output's "
                       f"{inputs.ndim - n_in + len(features)} dims, and not with unstack_axis")
    batch_shape = tuple(inputs.shape[a] for a in batch_dims)
    kernel_shape = batch_shape + tuple(inputs.shape[a] for a in axis) + features

    unstack = Unstack.of(self.unstack_axis, inputs.ndim - n_in + len(features), features)
    part_axis = None if unstack is None else n_batch + n_in + unstack.feature_axis
    kernel_init = flat_init(self.kernel_init, n_batch + n_in, part_axis)
    kernel = self.param("kernel", logical(kernel_init, self.kernel_axes), kernel_shape, self.param_dtype)
    bias = None
    if self.use_bias:

      def bias_init(rng, shape, dtype):
        return reshaped(self.bias_init(rng, (int(np.prod(shape)),), dtype), shape)

      bias = self.param("bias", logical(bias_init, self.bias_axes), batch_shape + features, self.param_dtype)
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    x = inputs.astype(dtype)
    custom = self.dot_general or (self.dot_general_cls() if self.dot_general_cls is not None else None)
    if custom is None and not batch_dims:
      recipe = resolve_recipe(self.recipe)
      x, (meta,) = fp8_state(self, recipe, x)
      rows = inputs.ndim - n_in
      scatter = rows == 2 and bool(self.output_axes) and rule_shards(self.output_axes[1])
      return self._constrained(dense(x, kernel, bias, axis=axis, unstack_axis=self.unstack_axis, residual=residual,
                                     fp8_meta=meta, recipe=recipe, precision=self.precision, scatter_rows=scatter,
                                     keep_rows=scatter and sequence_kept(self.output_axes[1])))
    # Flax's own computation: a GEMM te_jax does not run; a state the variables hold is handed back unchanged.
    if self.unstack_axis is not None:
      raise ValueError("unstack_axis needs te_jax's GEMM: no batch_dims, dot_general or dot_general_cls")
    x, _ = fp8_state(self, None, x)
    dims = ((axis, tuple(range(n_batch, n_batch + n_in))), (batch_dims, tuple(range(n_batch))))
    y = (custom or jax.lax.dot_general)(x, kernel.astype(dtype), dims, precision=self.precision)
    if bias is not None:
      y = y + jnp.reshape(bias.astype(y.dtype), batch_shape + (1,) * (x.ndim - n_batch - n_in) + features)
    return self._constrained(y if residual is None else y + residual.astype(y.dtype))


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
