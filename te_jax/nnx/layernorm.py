"""NNX ``LayerNorm``, ``LayerNormDenseGeneral`` and ``LayerNormMLP``: the norm fused into the FP8 GEMM after it, on
the same fused ops as ``te_jax.flax``'s modules (parameter names and shapes are theirs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.modules.axes import Initializer
from te_jax.modules.layernorm_dense import (LayerNormDenseGeneralOptions, LayerNormOptions, layer_norm,
                                            layernorm_dense_general, layernorm_dense_general_params)
from te_jax.modules.layernorm_mlp import LayerNormMLPOptions, layernorm_mlp_block, layernorm_mlp_params
from te_jax.nnx.params import as_tuple, resolve_deterministic
from te_jax.modules.scope import fields_of
from te_jax.nnx.scope import NnxScope, builds
from te_jax.recipe import Recipe

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]


@builds(LayerNormOptions)
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

  @classmethod
  def from_options(cls, options: LayerNormOptions, in_features: int, *, rngs: nnx.Rngs) -> "LayerNorm":
    """The norm of ``options`` (``te_jax.modules.layernorm_dense``) over ``in_features``."""
    return cls(in_features, **fields_of(options), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return layer_norm(NnxScope(self), self.options, x)


@builds(LayerNormDenseGeneralOptions)
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
    dtype, param_dtype, recipe, quantization_checkpoint_name, rngs: as in DenseGeneral.
  """

  def __init__(self, in_features: int, out_features: int | Sequence[int], *, norm_type: str = "layernorm",
               epsilon: float = 1e-6, zero_centered_gamma: bool = False, use_bias: bool = True,
               return_layernorm_output: bool = False, unstack_axis: int | None = None,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), kernel_axes=(), bias_axes=(),
               ln_scale_init: Initializer | None = None, ln_bias_init: Initializer = nnx.initializers.zeros_init(),
               ln_scale_axes=(), ln_bias_axes=(), input_axes=(), dtype: Any = None, param_dtype: Any = jnp.float32,
               recipe: Recipe | None = None, quantization_checkpoint_name: str | None = None, rngs: nnx.Rngs):
    self.options = nnx.static(LayerNormDenseGeneralOptions(
        features=as_tuple(out_features, "out_features"), norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, use_bias=use_bias, return_layernorm_output=return_layernorm_output,
        unstack_axis=unstack_axis, kernel_init=kernel_init, bias_init=bias_init, kernel_axes=tuple(kernel_axes),
        bias_axes=tuple(bias_axes), ln_scale_init=ln_scale_init, ln_scale_axes=tuple(ln_scale_axes),
        ln_bias_init=ln_bias_init, ln_bias_axes=tuple(ln_bias_axes), input_axes=tuple(input_axes), dtype=dtype,
        param_dtype=param_dtype, recipe=recipe, quantization_checkpoint_name=quantization_checkpoint_name))
    self.out_features = self.options.features
    self.ln_bias = self.bias = nnx.data(None)
    layernorm_dense_general_params(NnxScope(self, rngs), self.options, as_tuple(in_features, "in_features")[0],
                                   None)

  @classmethod
  def from_options(cls, options: LayerNormDenseGeneralOptions, in_features: int, *,
                   rngs: nnx.Rngs) -> "LayerNormDenseGeneral":
    """The layer of ``options`` (``te_jax.modules.layernorm_dense``) over inputs of last dim ``in_features``."""
    kw = fields_of(options)
    return cls(in_features, kw.pop("features"), **kw, rngs=rngs)

  def __call__(self, inputs: jax.Array, *, return_input: bool = False):
    """As te_jax.flax.LayerNormDenseGeneral's call."""
    return layernorm_dense_general(NnxScope(self), self.options, inputs, return_input=return_input)


@builds(LayerNormMLPOptions)
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
    activation_type, activation_params, intermediate_dropout, intermediate_dropout_dims, deterministic, use_bias,
      return_layernorm_output, norm_type, epsilon, zero_centered_gamma: as te_jax.flax.LayerNormMLP's
      (``deterministic``: the call's, else the module's).
    dropout_rng_name: the stream of ``rngs`` the dropout masks come from.
    kernel_init, bias_init; wi_kernel_axes, wi_bias_axes, wo_kernel_axes, wo_bias_axes; ln_scale_init, ln_bias_init,
      ln_scale_axes, ln_bias_axes: initializers and logical axis names.
    logical_axes, transpose_batch_sequence: te_jax's logical names on every parameter, and a 3-D input read as a
      residual stream (sequence and context parallelism), as te_jax.flax.LayerNormMLP's.
    dtype, param_dtype, recipe, rngs: as in DenseGeneral.
    quantization_checkpoint_name, ffn1_ckpt_name, ffn2_ckpt_name: checkpoint names, as te_jax.flax.LayerNormMLP's.
  """

  def __init__(self, in_features: int, intermediate_dim: int = 2048, *, activation_type: Sequence[str] = ("gelu",),
               activation_params: Mapping[str, float] | None = None, intermediate_dropout: float = 0.0,
               intermediate_dropout_dims: Sequence[int] = (), dropout_rng_name: str = "dropout",
               deterministic: bool | None = None, use_bias: bool = True, return_layernorm_output: bool = False,
               norm_type: str = "layernorm", epsilon: float = 1e-6, zero_centered_gamma: bool = False,
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), wi_kernel_axes=(), wi_bias_axes=(),
               wo_kernel_axes=(), wo_bias_axes=(), ln_scale_init: Initializer | None = None,
               ln_bias_init: Initializer = nnx.initializers.zeros_init(), ln_scale_axes=(), ln_bias_axes=(),
               logical_axes: bool = False, transpose_batch_sequence: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32, recipe: Recipe | None = None,
               quantization_checkpoint_name: str | None = None, ffn1_ckpt_name: str | None = "ffn1",
               ffn2_ckpt_name: str | None = "ffn2", rngs: nnx.Rngs):
    self.deterministic = deterministic
    self.options = nnx.static(LayerNormMLPOptions(
        intermediate_dim=intermediate_dim, activation_type=tuple(activation_type), activation_params=activation_params,
        intermediate_dropout=intermediate_dropout, intermediate_dropout_dims=intermediate_dropout_dims,
        dropout_rng_name=dropout_rng_name, use_bias=use_bias,
        return_layernorm_output=return_layernorm_output, norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, ln_scale_init=ln_scale_init, ln_scale_axes=tuple(ln_scale_axes),
        ln_bias_init=ln_bias_init, ln_bias_axes=tuple(ln_bias_axes), kernel_init=kernel_init, bias_init=bias_init,
        wi_kernel_axes=tuple(wi_kernel_axes), wi_bias_axes=tuple(wi_bias_axes), wo_kernel_axes=tuple(wo_kernel_axes),
        wo_bias_axes=tuple(wo_bias_axes), logical_axes=logical_axes, transpose_batch_sequence=transpose_batch_sequence,
        dtype=dtype, param_dtype=param_dtype, recipe=recipe, quantization_checkpoint_name=quantization_checkpoint_name,
        ffn1_ckpt_name=ffn1_ckpt_name, ffn2_ckpt_name=ffn2_ckpt_name))
    self.intermediate_dim, self.intermediate_dropout = intermediate_dim, intermediate_dropout
    self.ln_bias = self.wi_bias = self.wo_bias = nnx.data(None)
    layernorm_mlp_params(NnxScope(self, rngs), self.options, as_tuple(in_features, "in_features")[0])

  @classmethod
  def from_options(cls, options: LayerNormMLPOptions, in_features: int, *, rngs: nnx.Rngs) -> "LayerNormMLP":
    """The MLP of ``options`` (``te_jax.modules.layernorm_mlp``) over inputs of last dim ``in_features``."""
    return cls(in_features, **fields_of(options), rngs=rngs)

  def __call__(self, inputs: jax.Array, deterministic: bool | None = None, residual: jax.Array | None = None):
    """As te_jax.flax.LayerNormMLP's call."""
    deterministic = resolve_deterministic(self, deterministic, intermediate_dropout=self.intermediate_dropout)
    return layernorm_mlp_block(NnxScope(self), self.options, inputs, deterministic, residual)
