"""Flax linen ``Softmax``: Transformer Engine's ``Softmax`` layer (scaled, masked or causal softmax of attention
logits) on te_jax's softmax kernels; the body is ``te_jax.modules.softmax``."""

from __future__ import annotations

import flax.linen as nn
import jax

from te_jax.flax.scope import builds, options_of
from te_jax.modules.softmax import SoftmaxOptions, softmax

__all__ = ["Softmax"]


@builds(SoftmaxOptions)
class Softmax(nn.Module):
  """Softmax over the last axis of logits (B, H, Sq, Sk), as Transformer Engine's ``Softmax``: the inputs plus
  ``bias`` (in the inputs' dtype), scaled by ``scale_factor``, masked as ``softmax_fusion_type`` says, in float32
  inside, the output in the inputs' dtype. No parameters.

  **The mask is Transformer Engine's, True (or nonzero) = masked out**, as Transformer Engine's module and te_jax's
  softmax kernels take it (te_jax's attention modules take Flax's, True = attend, by default): ``mask_convention``
  says which.

  >>> import jax.numpy as jnp, te_jax.flax as te_flax
  >>> sm = te_flax.Softmax(scale_factor=1.0, softmax_fusion_type="scaled_masked")
  >>> mask = jnp.array([[[[False, True, False], [True, True, True]]]])    # True = masked out
  >>> sm.apply({}, jnp.zeros((1, 1, 2, 3)), mask).tolist()
  [[[[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]]]

  Attributes:
    scale_factor: the logits' scale (default 1.0).
    softmax_fusion_type: "scaled" (no mask), "scaled_masked" (the call's ``mask``) or "scaled_upper_triang_masked"
      (causal, key ``j > i`` masked for query ``i``); Transformer Engine's ``SoftmaxFusionType`` values (its upper
      case member names too). A row with every key masked gives zeros.
    softmax_type: "vanilla" (default); "off_by_one", one more logit of 0 in every denominator; "learnable", the
      call's ``softmax_offset`` there (unscaled), as Transformer Engine's.
    mask_convention: "te" (default here), True or nonzero = masked out; "flax", True or nonzero = attend.
  """

  scale_factor: float = 1.0
  softmax_fusion_type: str = "scaled"
  softmax_type: str = "vanilla"
  mask_convention: str = "te"

  def __call__(self, inputs: jax.Array, mask: jax.Array | None = None, bias: jax.Array | None = None,
               softmax_offset: jax.Array | None = None) -> jax.Array:
    """The softmax of ``inputs`` (rank >= 2, float32, bfloat16 or float16).

    Args:
      inputs: the logits, (B, H, Sq, Sk) (any rank >= 2; the last axis is the softmax's).
      mask: for "scaled_masked" only (the others raise): bool, int or float in ``mask_convention``, broadcastable to
        the inputs (each dim 1 or the inputs', the last one the inputs'), e.g. (B, 1, Sq, Sk).
      bias: added to the inputs before the scale, broadcastable to them.
      softmax_offset: "learnable"'s sink logits, broadcastable to (B, H, Sq, 1) (e.g. (1, H, 1, 1)); differentiable.

    Returns:
      The probabilities, the inputs' shape and dtype.
    """
    return softmax(options_of(self, SoftmaxOptions), inputs, mask, bias, softmax_offset)
