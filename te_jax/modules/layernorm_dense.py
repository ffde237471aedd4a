"""The bodies of ``LayerNorm`` and ``LayerNormDenseGeneral``: a norm over the last dim, and a norm whose output is
the FP8 input of the dense layer after it (``te_jax.flax`` and ``te_jax.nnx``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from te_jax._core.autocast import resolve_recipe
from te_jax.fused.layernorm_dense import layernorm_dense
from te_jax.fused.linear import check_checkpoint_name
from te_jax.modules.axes import (Initializer, features_tuple, rule_shards, sequence_kept, stream_input,
                                 stream_sharding)
from te_jax.modules.dense import unstack_of
from te_jax.modules.scope import Scope
from te_jax.ops.norm import check_norm_args, layernorm
from te_jax.recipe import Recipe

__all__ = ["LayerNormDenseGeneralOptions", "LayerNormOptions", "layer_norm", "layernorm_dense_general",
           "layernorm_dense_general_params", "norm_params"]


def norm_params(scope: Scope, hidden: int, *, norm_type: str, epsilon: float, zero_centered_gamma: bool,
                scale_init: Initializer | None, bias_init: Initializer, scale_axes: tuple[str | None, ...],
                bias_axes: tuple[str | None, ...], param_dtype: Any, prefix: str = ""):
  """The ``(hidden,)`` parameters of a norm: ``{prefix}scale`` and, for LayerNorm, ``{prefix}bias``. The scale's
  initializer defaults to ones, or zeros under ``zero_centered_gamma`` (the norm multiplies by ``scale + 1``)."""
  check_norm_args(norm_type, epsilon)
  scale_init = scale_init or (jax.nn.initializers.zeros if zero_centered_gamma else jax.nn.initializers.ones)
  scale = scope.param(f"{prefix}scale", scale_init, (hidden,), param_dtype, axes=scale_axes)
  bias = None
  if norm_type == "layernorm":
    bias = scope.param(f"{prefix}bias", bias_init, (hidden,), param_dtype, axes=bias_axes)
  return scale, bias


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerNormOptions:
  """The options of ``LayerNorm``: the linen module's attributes (documented there, with their defaults)."""

  epsilon: float
  norm_type: str
  zero_centered_gamma: bool
  scale_init: Initializer | None
  scale_axes: tuple[str | None, ...]
  bias_init: Initializer
  bias_axes: tuple[str | None, ...]
  dtype: Any
  param_dtype: Any

  def params(self, scope: Scope, hidden: int):
    return norm_params(scope, hidden, norm_type=self.norm_type, epsilon=self.epsilon,
                       zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
                       bias_init=self.bias_init, scale_axes=tuple(self.scale_axes), bias_axes=tuple(self.bias_axes),
                       param_dtype=self.param_dtype)


def layer_norm(scope: Scope, o: LayerNormOptions, x: jax.Array) -> jax.Array:
  """``LayerNorm``'s call: ``x`` normalized over its last dim, in ``o.dtype`` (None: the promotion of the input's
  and the parameters' dtypes)."""
  scale, bias = o.params(scope, x.shape[-1])
  dtype = o.dtype or jnp.result_type(x.dtype, o.param_dtype)
  return layernorm(x, scale, bias, norm_type=o.norm_type, epsilon=o.epsilon, zero_centered_gamma=o.zero_centered_gamma,
                   dtype=dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerNormDenseGeneralOptions:
  """The options of ``LayerNormDenseGeneral``: the linen module's attributes (documented there, with their
  defaults); the NNX module maps its constructor's arguments onto them."""

  features: tuple[int, ...]
  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  use_bias: bool
  return_layernorm_output: bool
  unstack_axis: int | None
  kernel_init: Initializer
  bias_init: Initializer
  kernel_axes: tuple[str | None, ...]
  bias_axes: tuple[str | None, ...]
  ln_scale_init: Initializer | None
  ln_scale_axes: tuple[str | None, ...]
  ln_bias_init: Initializer
  ln_bias_axes: tuple[str | None, ...]
  input_axes: tuple[str | None, ...]
  dtype: Any
  param_dtype: Any
  recipe: Recipe | None
  quantization_checkpoint_name: str | None

  def __post_init__(self):
    object.__setattr__(self, "features", features_tuple(self.features))
    check_checkpoint_name(self.quantization_checkpoint_name, "quantization_checkpoint_name")


def layernorm_dense_general_params(scope: Scope, o: LayerNormDenseGeneralOptions, hidden: int, out_ndim: int | None):
  """``(gamma, beta, kernel, bias)`` of a layer over inputs of last dim ``hidden`` (``out_ndim``: the output's rank,
  None where not known yet), and its FP8 state."""
  gamma, beta = norm_params(scope, hidden, norm_type=o.norm_type, epsilon=o.epsilon,
                            zero_centered_gamma=o.zero_centered_gamma, scale_init=o.ln_scale_init,
                            bias_init=o.ln_bias_init, scale_axes=tuple(o.ln_scale_axes),
                            bias_axes=tuple(o.ln_bias_axes), param_dtype=o.param_dtype, prefix="ln_")
  unstack = unstack_of(o.unstack_axis, o.features, out_ndim)
  part_axis = None if unstack is None else 1 + unstack.feature_axis
  kernel = scope.param("kernel", o.kernel_init, (hidden, *o.features), o.param_dtype, n_in=1, part_axis=part_axis,
                       axes=tuple(o.kernel_axes))
  bias = None
  if o.use_bias:
    bias = scope.param("bias", o.bias_init, o.features, o.param_dtype, axes=tuple(o.bias_axes))
  scope.declare_fp8_state(o.recipe)
  return gamma, beta, kernel, bias


def layernorm_dense_general(scope: Scope, o: LayerNormDenseGeneralOptions, inputs: jax.Array, *,
                            return_input: bool = False):
  """``LayerNormDenseGeneral``'s call (documented on the linen module)."""
  stream = tuple(o.input_axes)
  if stream and (len(stream) != 3 or inputs.ndim != 3):
    raise ValueError(f"input_axes {o.input_axes} names a (batch, seq, hidden) input; the input is {inputs.shape}")
  if stream:
    inputs = stream_input(inputs, stream, 1)
  gamma, beta, kernel, bias = layernorm_dense_general_params(scope, o, inputs.shape[-1],
                                                             inputs.ndim - 1 + len(o.features))
  dtype = o.dtype or jnp.result_type(inputs.dtype, o.param_dtype)
  recipe = resolve_recipe(o.recipe)
  x, (meta,) = scope.fp8_state(recipe, inputs.astype(dtype))
  scatter = bool(stream) and rule_shards(stream[1])
  return layernorm_dense(x, gamma, beta, kernel, bias, norm_type=o.norm_type, epsilon=o.epsilon,
                         zero_centered_gamma=o.zero_centered_gamma,
                         return_layernorm_output=o.return_layernorm_output, return_input=return_input,
                         unstack_axis=o.unstack_axis, fp8_meta=meta, recipe=recipe,
                         keep_rows=scatter and sequence_kept(stream[1]),
                         grad_sharding=stream_sharding(stream) if scatter else None,
                         quantization_checkpoint_name=o.quantization_checkpoint_name)
