"""Flax linen layers that fuse a norm into the GEMMs after it: LayerNormDenseGeneral and LayerNormMLP."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.activation import activation
from te_jax.dense import dense
from te_jax.flax._fp8_state import dense_fp8_meta, resolve_recipe
from te_jax.flax.dense import _features, _is_int, _logical
from te_jax.layernorm_dense import layernorm_dense
from te_jax.layernorm_mlp import layernorm_mlp
from te_jax.ops.activation import parse_activation_type
from te_jax.recipe import Recipe

Initializer = Callable[..., jax.Array]


def _norm_params(module: nn.Module, hidden: int):
  """The norm's ``scale`` and (LayerNorm only) ``bias``, named as te_flax.LayerNorm and Flax name them."""
  scale_init = module.scale_init or (nn.initializers.zeros_init() if module.zero_centered_gamma
                                     else nn.initializers.ones_init())
  scale = module.param("scale", _logical(scale_init, module.scale_axes), (hidden,), module.param_dtype)
  bias = None
  if module.layernorm_type == "layernorm":
    bias = module.param("ln_bias", _logical(nn.initializers.zeros_init(), module.scale_axes), (hidden,),
                        module.param_dtype)
  return scale, bias


def _flat_init(init: Initializer, n_in: int) -> Initializer:
  """``init`` on the 2-D (inputs, outputs) shape, reshaped: fan-in and fan-out as for a plain dense kernel."""

  def wrapped(rng, shape, dtype):
    flat = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
    return jnp.reshape(init(rng, flat, dtype), shape)

  return wrapped


class LayerNormDenseGeneral(nn.Module):
  """LayerNorm/RMSNorm then a dense layer over the last dim; under FP8 the norm writes the GEMM's FP8 input.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> layer = te_flax.LayerNormDenseGeneral(features=48, dtype=jnp.bfloat16)
  >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 32), jnp.bfloat16))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'bias': (48,), 'kernel': (32, 48), 'ln_bias': (32,), 'scale': (32,)}

  Attributes:
    features: the output features (int or tuple).
    layernorm_type: "layernorm" or "rmsnorm"; epsilon; zero_centered_gamma (store scale - 1).
    use_bias: add a bias after the GEMM.
    return_layernorm_output: also return the normalized input (for a post-LN residual).
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``).
    kernel_init, bias_init, scale_init: initializers (the kernel's on its 2-D shape, as Flax's DenseGeneral).
    kernel_axes, bias_axes, scale_axes: logical axis names.
    dtype: the compute dtype (None: the input's); param_dtype: the parameters'.
    recipe: an FP8 recipe for this layer, overriding autocast's.
  """

  features: int | Sequence[int]
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  use_bias: bool = True
  return_layernorm_output: bool = False
  unstack_axis: int | None = None
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  scale_init: Initializer | None = None
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  scale_axes: tuple[str | None, ...] = ()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, *, return_input: bool = False):
    """The layer's output (with ``return_layernorm_output``, also the normalized input); with ``return_input``, also
    ``inputs`` in the compute dtype, last, whose gradient the FP8 backward adds inside the norm's kernel (use it in
    place of ``inputs`` afterwards, e.g. as the residual of a pre-LN block)."""
    features = _features(self.features)
    hidden = inputs.shape[-1]
    gamma, beta = _norm_params(self, hidden)
    kernel = self.param("kernel", _logical(_flat_init(self.kernel_init, 1), self.kernel_axes), (hidden, *features),
                        self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", _logical(self.bias_init, self.bias_axes), features, self.param_dtype)
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    recipe = resolve_recipe(self.recipe)
    return layernorm_dense(inputs.astype(dtype), gamma, beta, kernel, bias, norm_type=self.layernorm_type,
                           epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
                           return_layernorm_output=self.return_layernorm_output, return_input=return_input,
                           unstack_axis=self.unstack_axis, fp8_meta=dense_fp8_meta(self, recipe), recipe=recipe)


class LayerNormMLP(nn.Module):
  """LayerNorm/RMSNorm -> fc1 -> activation -> fc2 over the last dim; under FP8 every GEMM is FP8 and each cast is
  fused into the kernel before it.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> mlp = te_flax.LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"), dtype=jnp.bfloat16)
  >>> variables = mlp.init(jax.random.key(0), jnp.ones((4, 32), jnp.bfloat16))
  >>> jax.tree.map(jnp.shape, variables["params"])["wi_kernel"], mlp.apply(variables, jnp.ones((4, 32))).shape
  ((32, 2, 64), (4, 32))

  Attributes:
    intermediate_dim: fc1's width F.
    activations: ``("gelu",)``, ``("relu",)``, ... or a gated pair ``("silu", "linear")`` (SwiGLU), ``("gelu",
      "linear")`` (GeGLU), ``("relu", "linear")`` (ReGLU).
    intermediate_dropout_rate: dropout on the activation output (needs the "dropout" rng unless deterministic);
      when it is active the layer runs as its parts (norm, dense, activation, dropout, dense), each still FP8.
    return_layernorm_output: also return the normalized input (for a residual taken after the norm); the layer then
      runs as its parts too.
    use_bias: biases on fc1 and fc2.
    layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes: the norm's, as in LayerNorm.
    kernel_init, bias_init: initializers; kernel_axes_1 / kernel_axes_2 / bias_axes_1 / bias_axes_2: logical names
      (kernel_1 is (hidden, n_activations, intermediate), kernel_2 (intermediate, hidden)).
    dtype, param_dtype, recipe: as in DenseGeneral.
  """

  intermediate_dim: int = 2048
  activations: Sequence[str] = ("gelu",)
  intermediate_dropout_rate: float = 0.0
  use_bias: bool = True
  return_layernorm_output: bool = False
  layernorm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  scale_init: Initializer | None = None
  scale_axes: tuple[str | None, ...] = ()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  kernel_axes_1: tuple[str | None, ...] = ()
  kernel_axes_2: tuple[str | None, ...] = ()
  bias_axes_1: tuple[str | None, ...] = ()
  bias_axes_2: tuple[str | None, ...] = ()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: bool = True, residual: jax.Array | None = None):
    """The MLP of ``inputs``, plus ``residual`` (``inputs``' shape) when given: added in fc2's epilogue. With
    ``return_layernorm_output``, the pair (that, the normalized input)."""
    name, gated = parse_activation_type(tuple(self.activations))
    if not (_is_int(self.intermediate_dim) and self.intermediate_dim > 0):
      raise ValueError(f"intermediate_dim must be a positive int, got {self.intermediate_dim!r}")
    if not 0.0 <= self.intermediate_dropout_rate < 1.0:
      raise ValueError(f"intermediate_dropout_rate must be in [0, 1), got {self.intermediate_dropout_rate}")
    act = (name, "linear") if gated else (name,)
    n_act = 2 if gated else 1
    hidden, f = inputs.shape[-1], self.intermediate_dim
    gamma, beta = _norm_params(self, hidden)
    k1 = self.param("wi_kernel", _logical(_flat_init(self.kernel_init, 1), self.kernel_axes_1), (hidden, n_act, f),
                    self.param_dtype)
    k2 = self.param("wo_kernel", _logical(_flat_init(self.kernel_init, 1), self.kernel_axes_2), (f, hidden),
                    self.param_dtype)
    b1 = b2 = None
    if self.use_bias:
      b1 = self.param("wi_bias", _logical(self.bias_init, self.bias_axes_1), (n_act, f), self.param_dtype)
      b2 = self.param("wo_bias", _logical(self.bias_init, self.bias_axes_2), (hidden,), self.param_dtype)
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    x = inputs.astype(dtype)
    if residual is inputs and x.dtype == inputs.dtype:
      residual = x  # the block's own input: layernorm_mlp folds its gradient into the norm's backward
    recipe = resolve_recipe(self.recipe)
    meta_1 = dense_fp8_meta(self, recipe, prefix="wi_")
    meta_2 = dense_fp8_meta(self, recipe, prefix="wo_")
    norm_args = dict(norm_type=self.layernorm_type, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)
    dropout = self.intermediate_dropout_rate > 0.0 and not deterministic
    if not dropout and not self.return_layernorm_output:
      return layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, activation_type=act, residual=residual,
                           fp8_meta_1=meta_1, fp8_meta_2=meta_2, recipe=recipe, **norm_args)
    # Dropout between the activation and fc2, or the norm's output wanted: the parts, each dense still in FP8.
    h = layernorm_dense(x, gamma, beta, k1.reshape(hidden, n_act * f), None if b1 is None else b1.reshape(-1),
                        return_layernorm_output=self.return_layernorm_output, fp8_meta=meta_1, recipe=recipe,
                        **norm_args)
    h, z = h if self.return_layernorm_output else (h, None)
    a = activation(h.reshape(*h.shape[:-1], 2, f) if gated else h, act)
    if dropout:
      a = nn.Dropout(rate=self.intermediate_dropout_rate)(a, deterministic=False)
    y = dense(a, k2, b2, residual=residual, fp8_meta=meta_2, recipe=recipe)
    return (y, z) if self.return_layernorm_output else y
