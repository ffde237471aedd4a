"""FP8 scaling state math, the one place where scales are computed (``update_scale_states`` runs it as one op,
``te_jax.ops.scale_update``, whose reference is built from the functions here).

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

from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "AmaxComputeAlgo",
    "ScaleState",
    "fp8_max",
    "compute_scale",
    "roll_amax_history",
    "amax_from_history",
    "update_scale_state",
    "update_scale_states",
]

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


def compute_scale(amax: jax.Array, scale: jax.Array, fp8_max_value, margin: int = 0) -> jax.Array:
  """``fp8_max / (amax * 2**margin)``, or ``scale`` unchanged where amax is 0 or not finite, or where the new scale
  would not be a positive finite float32 (elementwise: ``fp8_max_value`` may be a float or an array broadcasting with
  ``amax``). Computed as ``fp8_max / amax / 2**margin``: the same bits wherever the scale is a normal float32, and
  no overflow of ``amax * 2**margin`` (which would give a scale of 0) for a huge amax."""
  amax = jnp.asarray(amax, jnp.float32)
  new = jnp.asarray(fp8_max_value, jnp.float32) / amax / jnp.float32(2.0**margin)
  ok = (amax > 0.0) & jnp.isfinite(amax) & jnp.isfinite(new) & (new > 0.0)
  return jnp.where(ok, new, scale).astype(jnp.float32)


def roll_amax_history(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Puts ``amax`` at element 0 and shifts the rest back by one, dropping the oldest."""
  return jnp.concatenate([jnp.reshape(amax, (1,)).astype(history.dtype), history[:-1]])


def amax_from_history(history: jax.Array, algo: AmaxComputeAlgo = "max") -> jax.Array:
  """The amax a scale is computed from: the history's max, or its most recent entry.

  A NaN anywhere in the history makes ``max`` NaN, so the scale is kept until the NaN rolls out of the history.
  """
  if algo == "max":
    return jnp.max(history)
  if algo == "most_recent":
    return history[0]
  raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")


def update_scale_state(
    state: ScaleState,
    amax: jax.Array,
    fp8_dtype,
    *,
    margin: int = 0,
    algo: AmaxComputeAlgo = "max",
) -> ScaleState:
  """One delayed-scaling step: roll ``amax`` into the history, then derive the next scale from it."""
  return update_scale_states([state], [amax], [fp8_dtype], margin=margin, algo=algo)[0]


def update_scale_states(
    states: Sequence[ScaleState],
    amaxes: Sequence[jax.Array],
    fp8_dtypes: Sequence,
    *,
    margin: int = 0,
    algo: AmaxComputeAlgo = "max",
) -> list[ScaleState]:
  """``update_scale_state`` of several tensors (histories of one length) as one op: the same values, from one
  kernel launch on a GPU with the CUDA module (``te_jax.ops.scale_update``) instead of a few launches per tensor."""
  from te_jax.ops.scale_update import scale_update  # noqa: PLC0415 - the op's reference uses this module

  if algo not in ("max", "most_recent"):
    raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")
  histories, scales = scale_update([s.amax_history for s in states], [s.scale for s in states], amaxes,
                                   [fp8_max(d) for d in fp8_dtypes], margin=margin, most_recent=algo == "most_recent")
  return [ScaleState(h, s) for h, s in zip(histories, scales)]
