"""NNX ``LayerNorm``, ``LayerNormDenseGeneral`` and ``LayerNormMLP``: the norm fused into the FP8 GEMM after it, on
the same fused ops as ``te_jax.flax``'s modules (parameter names and shapes are theirs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax._core.autocast import resolve_recipe
from te_jax.fused.dense import dense
from te_jax.fused.layernorm_dense import layernorm_dense
from te_jax.fused.layernorm_mlp import layernorm_mlp
from te_jax.modules.axes import Initializer, is_int
from te_jax.modules.layernorm_dense import (LayerNormDenseGeneralOptions, LayerNormOptions, layer_norm,
                                            layernorm_dense_general, layernorm_dense_general_params, norm_params)
from te_jax.nnx.fp8_state import declare_fp8_state, fp8_metas
from te_jax.nnx.params import as_tuple, make_param, resolve_deterministic
from te_jax.nnx.scope import NnxScope
from te_jax.ops.activation import activation, parse_activation_type
from te_jax.recipe import Recipe

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]


def _value(p):
  return None if p is None else p[...]


class LayerNorm(nnx.Module):
  """LayerNorm or RMSNorm over the last dim, in float32 whatever the input and parameter dtypes (one fused kernel
  each way, ``te_jax.layernorm``): te_jax.flax.LayerNorm with ``nnx.LayerNorm``'s constructor.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> layer = te_nnx.LayerNorm(8, norm_type="rmsnorm", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  >>> layer.scale.shape, layer(jnp.ones((2, 8))).dtype
  ((8,), dtype(bfloat16))

  Args:
    num_features: the normalized (last) dim.
    epsilon, norm_type, zero_centered_gamma: as te_jax.flax.LayerNorm's.
    scale_init, bias_init: the parameters' initializers (scale: ones, or zeros under ``zero_centered_gamma``).
    scale_axes, bias_axes: logical axis names (``out_sharding`` metadata).
    dtype: the output dtype (None: the promotion of the input's and ``param_dtype``); param_dtype: the parameters'.
    rngs: the ``params`` stream.
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, norm_type: str = "layernorm",
               zero_centered_gamma: bool = False, scale_init: Initializer | None = None,
               bias_init: Initializer = nnx.initializers.zeros_init(), scale_axes=(), bias_axes=(), dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.options = nnx.static(LayerNormOptions(
        epsilon=epsilon, norm_type=norm_type, zero_centered_gamma=zero_centered_gamma, scale_init=scale_init,
        scale_axes=tuple(scale_axes), bias_init=bias_init, bias_axes=tuple(bias_axes), dtype=dtype,
        param_dtype=param_dtype))
    self.bias = nnx.data(None)
    self.options.params(NnxScope(self, rngs), as_tuple(num_features, "num_features")[0])

  def __call__(self, x: jax.Array) -> jax.Array:
    return layer_norm(NnxScope(self), self.options, x)


class LayerNormDenseGeneral(nnx.Module):
  """LayerNorm/RMSNorm then a dense layer over the last dim; under FP8 the norm writes the GEMM's FP8 input.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> layer = te_nnx.LayerNormDenseGeneral(32, 48, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  >>> layer.kernel.shape, layer.ln_scale.shape, layer(jnp.ones((4, 32), jnp.bfloat16)).shape
  ((32, 48), (32,), (4, 48))

  Args:
    in_features: the hidden size (the last input dim); out_features: int or tuple.
    norm_type, epsilon, zero_centered_gamma, use_bias, return_layernorm_output, unstack_axis: as
      te_jax.flax.LayerNormDenseGeneral's.
    kernel_init, bias_init, kernel_axes, bias_axes: the dense layer's; ln_scale_init, ln_bias_init, ln_scale_axes,
      ln_bias_axes: the norm's.
    input_axes: the logical axis names of a (batch, seq, hidden) residual-stream input, read as
      te_jax.flax.LayerNormDenseGeneral's ``input_axes`` says (sequence and context parallelism).
    dtype, param_dtype, recipe, rngs: as in DenseGeneral.
  """

  def __init__(self, in_features: int, out_features: int | Sequence[int], *, norm_type: str = "layernorm",
               epsilon: float = 1e-6, zero_centered_gamma: bool = False, use_bias: bool = True,
               return_layernorm_output: bool = False, unstack_axis: int | None = None,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), kernel_axes=(), bias_axes=(),
               ln_scale_init: Initializer | None = None, ln_bias_init: Initializer = nnx.initializers.zeros_init(),
               ln_scale_axes=(), ln_bias_axes=(), input_axes=(), dtype: Any = None, param_dtype: Any = jnp.float32,
               recipe: Recipe | None = None, rngs: nnx.Rngs):
    self.options = nnx.static(LayerNormDenseGeneralOptions(
        features=as_tuple(out_features, "out_features"), norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, use_bias=use_bias, return_layernorm_output=return_layernorm_output,
        unstack_axis=unstack_axis, kernel_init=kernel_init, bias_init=bias_init, kernel_axes=tuple(kernel_axes),
        bias_axes=tuple(bias_axes), ln_scale_init=ln_scale_init, ln_scale_axes=tuple(ln_scale_axes),
        ln_bias_init=ln_bias_init, ln_bias_axes=tuple(ln_bias_axes), input_axes=tuple(input_axes), dtype=dtype,
        param_dtype=param_dtype, recipe=recipe))
    self.out_features = self.options.features
    self.ln_bias = self.bias = nnx.data(None)
    layernorm_dense_general_params(NnxScope(self, rngs), self.options, as_tuple(in_features, "in_features")[0],
                                   None)

  def __call__(self, inputs: jax.Array, *, return_input: bool = False):
    """As te_jax.flax.LayerNormDenseGeneral's call."""
    return layernorm_dense_general(NnxScope(self), self.options, inputs, return_input=return_input)


class LayerNormMLP(nnx.Module):
  """LayerNorm/RMSNorm -> fc1 -> activation -> fc2 over the last dim; under FP8 every GEMM is FP8 and each cast is
  fused into the kernel before it (``te_jax.layernorm_mlp``).

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> mlp = te_nnx.LayerNormMLP(32, 64, activation_type=("silu", "linear"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  >>> mlp.wi_kernel.shape, mlp(jnp.ones((4, 32), jnp.bfloat16)).shape
  ((32, 2, 64), (4, 32))

  Args:
    in_features: the hidden size; intermediate_dim: fc1's width.
    activation_type, intermediate_dropout, deterministic, use_bias, return_layernorm_output, norm_type, epsilon,
      zero_centered_gamma: as te_jax.flax.LayerNormMLP's (``deterministic``: the call's, else the module's).
    dropout_rng_name: the stream of ``rngs`` the dropout masks come from.
    kernel_init, bias_init; wi_kernel_axes, wi_bias_axes, wo_kernel_axes, wo_bias_axes; ln_scale_init, ln_bias_init,
      ln_scale_axes, ln_bias_axes: initializers and logical axis names.
    dtype, param_dtype, recipe, rngs: as in DenseGeneral.
  """

  def __init__(self, in_features: int, intermediate_dim: int = 2048, *, activation_type: Sequence[str] = ("gelu",),
               intermediate_dropout: float = 0.0, dropout_rng_name: str = "dropout",
               deterministic: bool | None = None, use_bias: bool = True, return_layernorm_output: bool = False,
               norm_type: str = "layernorm", epsilon: float = 1e-6, zero_centered_gamma: bool = False,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), wi_kernel_axes=(), wi_bias_axes=(),
               wo_kernel_axes=(), wo_bias_axes=(), ln_scale_init: Initializer | None = None,
               ln_bias_init: Initializer = nnx.initializers.zeros_init(), ln_scale_axes=(), ln_bias_axes=(),
               dtype: Any = None, param_dtype: Any = jnp.float32, recipe: Recipe | None = None, rngs: nnx.Rngs):
    hidden = as_tuple(in_features, "in_features")[0]
    if not (is_int(intermediate_dim) and intermediate_dim > 0):
      raise ValueError(f"intermediate_dim must be a positive int, got {intermediate_dim!r}")
    name, gated = parse_activation_type(tuple(activation_type))
    self.act = (name, "linear") if gated else (name,)
    n_act, f = (2 if gated else 1), intermediate_dim
    self.intermediate_dim, self.intermediate_dropout, self.deterministic = f, intermediate_dropout, deterministic
    self.return_layernorm_output = return_layernorm_output
    self.norm_type, self.epsilon, self.zero_centered_gamma = norm_type, epsilon, zero_centered_gamma
    self.dtype, self.param_dtype, self.recipe = dtype, param_dtype, recipe
    self.ln_bias = nnx.data(None)
    norm_params(NnxScope(self, rngs), hidden, norm_type=norm_type, epsilon=epsilon,
                zero_centered_gamma=zero_centered_gamma, scale_init=ln_scale_init, bias_init=ln_bias_init,
                scale_axes=tuple(ln_scale_axes), bias_axes=tuple(ln_bias_axes), param_dtype=param_dtype, prefix="ln_")
    self.wi_kernel = make_param(kernel_init, rngs.params(), (hidden, n_act, f), param_dtype, n_in=1,
                                part_axis=1 if gated else None, axes=wi_kernel_axes)
    self.wo_kernel = make_param(kernel_init, rngs.params(), (f, hidden), param_dtype, n_in=1, axes=wo_kernel_axes)
    self.wi_bias = self.wo_bias = nnx.data(None)
    if use_bias:
      self.wi_bias = make_param(bias_init, rngs.params(), (n_act, f), param_dtype, axes=wi_bias_axes)
      self.wo_bias = make_param(bias_init, rngs.params(), (hidden,), param_dtype, axes=wo_bias_axes)
    self.dropout = nnx.Dropout(intermediate_dropout, rng_collection=dropout_rng_name,
                               rngs=rngs if intermediate_dropout > 0 else None)
    declare_fp8_state(self, recipe, ("wi_", "wo_"))

  def __call__(self, inputs: jax.Array, deterministic: bool | None = None, residual: jax.Array | None = None):
    """As te_jax.flax.LayerNormMLP's call."""
    deterministic = resolve_deterministic(self, deterministic, intermediate_dropout=self.intermediate_dropout)
    gated = len(self.act) == 2
    hidden, f = inputs.shape[-1], self.intermediate_dim
    gamma, beta, k1, k2 = self.ln_scale[...], _value(self.ln_bias), self.wi_kernel[...], self.wo_kernel[...]
    b1, b2 = _value(self.wi_bias), _value(self.wo_bias)
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    recipe = resolve_recipe(self.recipe)
    x, (meta_1, meta_2) = fp8_metas(self, recipe, inputs.astype(dtype), ("wi_", "wo_"))
    if residual is inputs and x.dtype == inputs.dtype:
      residual = x  # the block's own input: layernorm_mlp folds its gradient into the norm's backward
    norm_args = dict(norm_type=self.norm_type, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)
    dropout = self.intermediate_dropout > 0.0 and not deterministic
    if not dropout and not self.return_layernorm_output:
      return layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, activation_type=self.act, residual=residual,
                           fp8_meta_1=meta_1, fp8_meta_2=meta_2, recipe=recipe, **norm_args)
    # Dropout between the activation and fc2, or the norm's output wanted: the parts, each dense still in FP8.
    n_act = 2 if gated else 1
    h = layernorm_dense(x, gamma, beta, k1.reshape(hidden, n_act * f), None if b1 is None else b1.reshape(-1),
                        return_layernorm_output=self.return_layernorm_output, fp8_meta=meta_1, recipe=recipe,
                        **norm_args)
    h, z = h if self.return_layernorm_output else (h, None)
    a = activation(h.reshape(*h.shape[:-1], 2, f) if gated else h, self.act)
    if dropout:
      a = self.dropout(a, deterministic=False)
    y = dense(a, k2, b2, residual=residual, fp8_meta=meta_2, recipe=recipe)
    return (y, z) if self.return_layernorm_output else y
