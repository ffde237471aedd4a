"""FP8 scaling state math, the one place where scales are computed (``te_jax.ops.scale_update`` runs it for many
tensors as one op, its reference built from the functions here), and the Flax collection the state lives in.

Conventions (those of Transformer Engine's delayed scaling):

- ``scale = fp8_max / (amax * 2**margin)`` multiplies a tensor before its FP8 cast; ``scale_inv = 1 / scale``
  dequantizes it (and goes to the GEMM).
- An amax of zero, or one that is not finite (NaN, inf), keeps the previous scale; so does an amax so small that
  the scale would overflow float32, or so large that it would be 0.
- The amax history is a float32 vector whose element 0 is the most recent amax. Delayed scaling rolls the amax of
  the step just taken into it, then derives the next step's scale from it with ``max`` (over the whole history) or
  ``most_recent`` (element 0).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "FP8_COLLECTION",
    "FP8_RESIDUAL",
    "AmaxComputeAlgo",
    "ScaleState",
    "fp8_max",
    "compute_scale",
    "roll_amax_history",
    "amax_from_history",
]

#: The Flax variable collection of the modules' FP8 state: Flax's ``_overwrite_with_gradient``
#: (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``), whose "gradients" ``TrainState.apply_gradients`` writes over the
#: variables instead of handing them to the optimizer.
FP8_COLLECTION = "_overwrite_with_gradient"

#: The ``jax.ad_checkpoint.checkpoint_name`` of the FP8 tensors a layer's backward pass reads (its transposed FP8
#: input and its FP8 kernel): ``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names(
#: te_jax.FP8_RESIDUAL))`` keeps these (half the bytes of their bf16 originals) and recomputes the rest of the forward.
FP8_RESIDUAL = "te_jax_fp8_residual"

AmaxComputeAlgo = Literal["max", "most_recent"]


class ScaleState(NamedTuple):
  """Delayed-scaling state of one tensor: its amax history and the scale for the next step."""

  amax_history: jax.Array  # float32 (history_len,), element 0 most recent
  scale: jax.Array  # float32 ()

  @classmethod
  def create(cls, history_len: int) -> "ScaleState":
    if history_len < 1:
      raise ValueError(f"history_len must be >= 1, got {history_len}")
    return cls(jnp.zeros((history_len,), jnp.float32), jnp.ones((), jnp.float32))

  @property
  def scale_inv(self) -> jax.Array:
    return 1.0 / self.scale


def fp8_max(dtype) -> float:
  """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
  return float(jnp.finfo(dtype).max)


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max_value, margin: float = 0) -> jax.Array:
  """``fp8_max / (amax * 2**margin)``, or ``scale`` unchanged where amax is 0 or not finite, or where the new scale
  would not be a positive finite float32 (elementwise: ``fp8_max_value`` may be a float or an array broadcasting with
  ``amax``). Computed as ``fp8_max / amax * 2**-margin`` (``2**-margin`` rounded once to float32): for an integer
  margin the same bits as the division wherever the scale is a normal float32, for any margin the same bits on every
  backend (XLA turns a division by a constant into a multiplication by its reciprocal), and no overflow of
  ``amax * 2**margin`` (which would give a scale of 0) for a huge amax."""
  amax = jnp.asarray(amax, jnp.float32)
  new = jnp.asarray(fp8_max_value, jnp.float32) / amax * jnp.float32(2.0**-margin)
  ok = (amax > 0.0) & jnp.isfinite(amax) & jnp.isfinite(new) & (new > 0.0)
  return jnp.where(ok, new, scale).astype(jnp.float32)


def roll_amax_history(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Puts ``amax`` at element 0 and shifts the rest back by one, dropping the oldest."""
  return jnp.concatenate([jnp.reshape(amax, (1,)).astype(history.dtype), history[:-1]])


def amax_from_history(history: jax.Array, algo: AmaxComputeAlgo = "max") -> jax.Array:
  """The amax a scale is computed from: the history's max, or its most recent entry.

  A NaN anywhere in the history makes ``max`` NaN, so the scale is kept until the NaN rolls out of the history. The
  NaN is put back explicitly: XLA:CPU's max reduction can drop it (a history of 4096 entries does).
  """
  if algo == "max":
    return jnp.where(jnp.isnan(history).any(), jnp.asarray(jnp.nan, history.dtype), jnp.max(history))
  if algo == "most_recent":
    return history[0]
  raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")
