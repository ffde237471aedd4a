"""Flax linen LayerNorm/RMSNorm over the last dim, one fused kernel each way (``te_jax.layernorm``)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.scope import LinenScope, builds, options_of
from te_jax.flax.te_names import te_names
from te_jax.modules.axes import Initializer
from te_jax.modules.layernorm_dense import LayerNormOptions, layer_norm

__all__ = ["LayerNorm"]


@te_names
@builds(LayerNormOptions)
class LayerNorm(nn.Module):
  """LayerNorm or RMSNorm over the last dim, in float32 whatever the input and parameter dtypes.

  Flax's conventions: the parameters are ``scale`` and (LayerNorm only) ``bias``, shaped ``(hidden,)`` like those of
  ``flax.linen.LayerNorm`` / ``flax.linen.RMSNorm``, so checkpoints move between them (add 1 to ``scale`` when
  ``zero_centered_gamma`` is on here and not there); ``dtype`` is the output dtype, by default the promotion of the
  input's and the parameters' dtypes, as Flax's. Logical axis names make the parameters shardable.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> layer = te_flax.LayerNorm(norm_type="rmsnorm", dtype=jnp.bfloat16)
  >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'scale': (8,)}
  >>> layer.apply(variables, jnp.ones((2, 8))).dtype
  dtype(bfloat16)

  Attributes:
    epsilon: added to the variance before the reciprocal square root.
    norm_type: "layernorm" (``(x - mean) * rsigma * scale + bias``) or "rmsnorm" (``x * rsigma * scale``).
    zero_centered_gamma: store ``scale - 1``: the layer multiplies by ``scale + 1``, so the default initializer
      becomes zeros.
    scale_init: initializer of ``scale`` (default: ones, or zeros under ``zero_centered_gamma``).
    scale_axes: logical axis names of ``scale``.
    bias_init: initializer of ``bias`` (LayerNorm only).
    bias_axes: logical axis names of ``bias``.
    dtype: the output dtype (None: the promotion of the input's and ``param_dtype``).
    param_dtype: the dtype of the parameters.
  """

  epsilon: float = 1e-6
  norm_type: str = "layernorm"
  zero_centered_gamma: bool = False
  scale_init: Initializer | None = None
  scale_axes: tuple[str | None, ...] = ()
  bias_init: Initializer = nn.initializers.zeros_init()
  bias_axes: tuple[str | None, ...] = ()
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """Normalizes ``x`` over its last dim.

    Args:
      x: float32, bfloat16 or float16, rank >= 1.

    Returns:
      ``x``'s shape, in ``dtype``.
    """
    return layer_norm(LinenScope(self), options_of(self, LayerNormOptions), x)
