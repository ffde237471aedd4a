"""Flax linen ``LayerNormDenseGeneral``: a norm then a dense layer, the norm writing the FP8 GEMM input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.scope import LinenScope, builds, options_of
from te_jax.flax.te_names import te_names
from te_jax.modules.axes import Initializer
from te_jax.modules.layernorm_dense import LayerNormDenseGeneralOptions, layernorm_dense_general
from te_jax.recipe import Recipe

__all__ = ["LayerNormDenseGeneral"]


@te_names
@builds(LayerNormDenseGeneralOptions)
class LayerNormDenseGeneral(nn.Module):
  """LayerNorm/RMSNorm then a dense layer over the last dim; under FP8 the norm writes the GEMM's FP8 input.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> layer = te_flax.LayerNormDenseGeneral(features=48, dtype=jnp.bfloat16)
  >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 32), jnp.bfloat16))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'bias': (48,), 'kernel': (32, 48), 'ln_bias': (32,), 'ln_scale': (32,)}

  Attributes:
    features: the output features (int or tuple).
    norm_type: "layernorm" or "rmsnorm"; epsilon; zero_centered_gamma (store ``ln_scale - 1``).
    use_bias: add a bias after the GEMM.
    return_layernorm_output: also return the normalized input (for a post-LN residual).
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``); the
      kernel is then a stack of separate projections, each part initialized as a kernel of its own.
    kernel_init, bias_init: the dense layer's initializers (the kernel's on its 2-D shape, as Flax's DenseGeneral;
      with ``unstack_axis``, on each part's, with its own key of ``jax.random.split``).
    kernel_axes, bias_axes: the dense layer's logical axis names.
    ln_scale_init, ln_scale_axes, ln_bias_init, ln_bias_axes: the norm's, as ``LayerNorm``'s ``scale_init``, ...
    input_axes: the logical axis names of a 3-D input that is a residual stream, (batch, seq, hidden) (e.g.
      ``te_jax.flax``'s ``("batch", "seq", "act_embed")``); the layer then reads it as a tensor-parallel layer does:
      its sequence gathered over the tensor-parallel mesh axes (those of "heads" and "mlp": sequence parallelism) and
      kept sharded over any other (context parallelism: every op of the layer on the sequence shards), and hands its
      gradient back on the stream's shards, where the dgrad GEMM reduce-scatters it under sequence parallelism and the
      norm's backward runs on the sequence shards (``te_jax.layernorm_dense``'s ``keep_rows`` and ``grad_sharding``).
      A no-op outside ``nn.logical_axis_rules``.
    dtype: the compute dtype (None: the input's); param_dtype: the parameters'.
    recipe: an FP8 recipe for this layer, overriding autocast's.
    quantization_checkpoint_name: the checkpoint name of the FP8 tensors saved for the backward pass, as in
      DenseGeneral (None: ``te_jax.FP8_RESIDUAL``).
  """

  features: int | Sequence[int]
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  use_bias: bool = True
  return_layernorm_output: bool = False
  unstack_axis: int | None = None
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  ln_scale_init: Initializer | None = None
  ln_scale_axes: tuple[str | None, ...] = ()
  ln_bias_init: Initializer = nn.initializers.zeros_init()
  ln_bias_axes: tuple[str | None, ...] = ()
  input_axes: tuple[str | None, ...] = ()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  recipe: Recipe | None = None
  quantization_checkpoint_name: str | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, *, return_input: bool = False):
    """The layer's output (with ``return_layernorm_output``, also the normalized input); with ``return_input``, also
    ``inputs`` in the compute dtype, last, whose gradient the FP8 backward adds inside the norm's kernel (use it in
    place of ``inputs`` afterwards, e.g. as the residual of a pre-LN block)."""
    return layernorm_dense_general(LinenScope(self), options_of(self, LayerNormDenseGeneralOptions), inputs,
                                   return_input=return_input)
