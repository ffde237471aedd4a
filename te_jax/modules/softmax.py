"""The body of the ``Softmax`` modules (``te_jax.flax``, ``te_jax.nnx``): Transformer Engine's ``Softmax`` layer, a
scaled softmax over the last axis of attention logits (B, H, Sq, Sk), on te_jax's softmax kernels
(``te_jax.ops.softmax``).

Per row, for ``softmax_fusion_type``:

- ``"scaled"``: ``softmax(scale_factor * (inputs + bias))``;
- ``"scaled_masked"``: the same with the keys where ``mask`` masks out left out (probability 0); a row with every
  key masked gives zeros;
- ``"scaled_upper_triang_masked"``: causal, key ``j > i`` left out for query ``i`` (top-left aligned).

``bias`` (optional, broadcastable to the inputs) is added in the inputs' dtype before the scale, as Transformer
Engine adds it. ``softmax_type`` "off_by_one" adds a logit of 0 to every row's denominator, "learnable" the call's
``softmax_offset`` (broadcastable to (B, H, Sq, 1), float32; Transformer Engine's module takes it as an argument,
not a parameter), unscaled: ``exp(z_j) / (exp(offset) + sum_k exp(z_k))``; a fully masked row still gives zeros.

**The mask is Transformer Engine's: True (or nonzero) = masked out** (``mask_convention="te"``, the default here,
as the softmax kernels it wraps and the module it ports take it; its ``mask == 1`` for 0/1 masks). The attention
modules default to Flax's convention instead; ``mask_convention="flax"`` (True = attend) is accepted too.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.fused.attention_config import SOFTMAX_TYPES, check_mask_convention, check_softmax_type, masked_out
from te_jax.ops.softmax import scaled_masked_softmax, scaled_softmax, scaled_upper_triang_masked_softmax

__all__ = ["SOFTMAX_FUSION_TYPES", "SoftmaxOptions", "softmax"]

#: Transformer Engine's ``SoftmaxFusionType`` values (its member names, upper case, are accepted too).
SOFTMAX_FUSION_TYPES = ("scaled", "scaled_masked", "scaled_upper_triang_masked")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftmaxOptions:
  """The options of ``Softmax``: the linen module's attributes (documented there, with their defaults)."""

  scale_factor: float
  softmax_fusion_type: str
  softmax_type: str
  mask_convention: str

  def __post_init__(self):
    fusion = self.softmax_fusion_type
    if not isinstance(fusion, str) or fusion.lower() not in SOFTMAX_FUSION_TYPES:
      raise ValueError(f"softmax_fusion_type must be one of {SOFTMAX_FUSION_TYPES}, got {fusion!r}")
    object.__setattr__(self, "softmax_fusion_type", fusion.lower())
    if isinstance(self.softmax_type, str) and self.softmax_type.lower() in SOFTMAX_FUSION_TYPES:
      raise ValueError(f"softmax_type={self.softmax_type!r} is a fusion type: Transformer Engine's Softmax took it "
                       f"as softmax_type before its sink softmax types, and takes it as softmax_fusion_type now; pass "
                       f"softmax_fusion_type={self.softmax_type.lower()!r} (softmax_type is one of {SOFTMAX_TYPES})")
    check_softmax_type(self.softmax_type)
    scale = self.scale_factor
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) or not math.isfinite(
        scale):
      raise ValueError(f"scale_factor must be a finite Python float, got {scale!r}")
    object.__setattr__(self, "scale_factor", float(scale))
    check_mask_convention(self.mask_convention)


def _broadcasts(x, shape: tuple[int, ...]) -> bool:
  try:
    return jnp.broadcast_shapes(tuple(x.shape), shape) == shape
  except ValueError:
    return False


def _check_bias(bias, shape: tuple[int, ...]) -> None:
  if not hasattr(bias, "dtype") or not jnp.issubdtype(bias.dtype, jnp.floating):
    raise TypeError(f"bias must be a floating-point array, got {getattr(bias, 'dtype', type(bias).__name__)}")
  if not _broadcasts(bias, shape):
    raise ValueError(f"bias of shape {tuple(bias.shape)} must broadcast to the inputs' shape {shape}")


def _sink(o: SoftmaxOptions, softmax_offset, shape: tuple[int, ...]):
  """The extra denominator logit: None ("vanilla"), 0 ("off_by_one"), ``softmax_offset`` ("learnable")."""
  if o.softmax_type != "learnable":
    if softmax_offset is not None:
      raise ValueError(f"softmax_offset is the learnable softmax's; softmax_type={o.softmax_type!r} takes none (give "
                       "softmax_type='learnable')")
    return None if o.softmax_type == "vanilla" else jnp.zeros((), jnp.float32)
  rows = (*shape[:-1], 1)
  if softmax_offset is None:
    raise ValueError(f"softmax_type='learnable' needs softmax_offset, the sink logits, broadcastable to {rows} (one "
                     "per head: (1, H, 1, 1)), float32")
  if not hasattr(softmax_offset, "dtype") or not jnp.issubdtype(softmax_offset.dtype, jnp.floating):
    raise TypeError(f"softmax_offset must be a floating-point array, got "
                    f"{getattr(softmax_offset, 'dtype', type(softmax_offset).__name__)}")
  if not _broadcasts(softmax_offset, rows):
    raise ValueError(f"softmax_offset of shape {tuple(softmax_offset.shape)} must broadcast to {rows} (the inputs' "
                     "rows, one logit each)")
  return softmax_offset


def softmax(o: SoftmaxOptions, inputs: jax.Array, mask=None, bias=None, softmax_offset=None) -> jax.Array:
  """``Softmax``'s call (documented on the linen module): the probabilities, the inputs' shape and dtype."""
  if not hasattr(inputs, "dtype") or jnp.dtype(inputs.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"inputs must be a float32, bfloat16 or float16 array, got "
                    f"{getattr(inputs, 'dtype', type(inputs).__name__)}")
  if inputs.ndim < 2:
    raise ValueError(f"inputs must have rank >= 2 ((B, H, Sq, Sk) logits), got shape {tuple(inputs.shape)}")
  shape = tuple(inputs.shape)
  if bias is not None:
    _check_bias(bias, shape)
    inputs = inputs + bias.astype(inputs.dtype)
  if o.softmax_fusion_type == "scaled_masked":
    if mask is None:
      raise ValueError("softmax_fusion_type='scaled_masked' needs a mask (mask_convention="
                       f"{o.mask_convention!r}: True = {'masked out' if o.mask_convention == 'te' else 'attend'})")
    if not hasattr(mask, "shape") or mask.ndim > len(shape) or not _broadcasts(mask, shape) or (
        mask.shape[-1] != shape[-1]):
      raise ValueError(f"mask of shape {getattr(mask, 'shape', None)} must broadcast to the inputs' shape {shape} "
                       "(each dim 1 or the inputs', the last one the inputs')")
    mask = masked_out(mask, o.mask_convention)
  elif mask is not None:
    raise ValueError(f"softmax_fusion_type={o.softmax_fusion_type!r} takes no mask (Transformer Engine's ignores "
                     "it): give softmax_fusion_type='scaled_masked' to apply it")
  sink = _sink(o, softmax_offset, shape)
  if sink is None:
    if o.softmax_fusion_type == "scaled":
      return scaled_softmax(inputs, o.scale_factor)
    if o.softmax_fusion_type == "scaled_masked":
      return scaled_masked_softmax(inputs, mask, o.scale_factor)
    return scaled_upper_triang_masked_softmax(inputs, o.scale_factor)
  # The sink as one more key, never masked, after the scaled logits (it is not scaled): the kernel's probabilities
  # of the real keys, its own dropped.
  z = inputs.astype(jnp.float32) * jnp.float32(o.scale_factor)
  z = jnp.concatenate([z, jnp.broadcast_to(jnp.asarray(sink, jnp.float32), (*shape[:-1], 1))], axis=-1)
  if o.softmax_fusion_type == "scaled_upper_triang_masked":
    mask = jnp.arange(shape[-1])[None, :] > jnp.arange(shape[-2])[:, None]
  if mask is None:
    probs = scaled_softmax(z)
  else:
    probs = scaled_masked_softmax(z, jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 1)]))
  return probs[..., :shape[-1]].astype(inputs.dtype)
