"""Flax NNX ``Softmax``: Transformer Engine's ``Softmax`` layer, as te_jax.flax.Softmax (the same arguments and
math, the body ``te_jax.modules.softmax``)."""

from __future__ import annotations

import jax
from flax import nnx

from te_jax.modules.scope import fields_of
from te_jax.modules.softmax import SoftmaxOptions, softmax
from te_jax.nnx.scope import builds

__all__ = ["Softmax"]


@builds(SoftmaxOptions)
class Softmax(nnx.Module):
  """Softmax over the last axis of logits (B, H, Sq, Sk), as te_jax.flax.Softmax (whose arguments these are): the
  mask is Transformer Engine's, True = masked out, unless ``mask_convention="flax"``. No parameters.

  >>> import jax.numpy as jnp, te_jax.nnx as te_nnx
  >>> sm = te_nnx.Softmax(softmax_fusion_type="scaled_upper_triang_masked")
  >>> sm(jnp.zeros((1, 1, 2, 2))).tolist()
  [[[[1.0, 0.0], [0.5, 0.5]]]]
  """

  def __init__(self, *, scale_factor: float = 1.0, softmax_fusion_type: str = "scaled",
               softmax_type: str = "vanilla", mask_convention: str = "te"):
    self.options = nnx.static(SoftmaxOptions(scale_factor=scale_factor, softmax_fusion_type=softmax_fusion_type,
                                             softmax_type=softmax_type, mask_convention=mask_convention))

  @classmethod
  def from_options(cls, options: SoftmaxOptions, in_features=None, *, rngs: nnx.Rngs | None = None) -> "Softmax":
    """The softmax of ``options`` (``te_jax.modules.softmax``); it has no sizes to take, and no parameters."""
    del in_features, rngs
    return cls(**fields_of(options))

  def __call__(self, inputs: jax.Array, mask: jax.Array | None = None, bias: jax.Array | None = None,
               softmax_offset: jax.Array | None = None) -> jax.Array:
    """As te_jax.flax.Softmax's call."""
    return softmax(self.options, inputs, mask, bias, softmax_offset)
