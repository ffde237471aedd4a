"""What the linen modules share: parameter declaration (logical axis names attached to initializers, initializers on
a kernel's 2-D shape) and linen's deterministic flag. The logical axis names and the rules'
reading are framework-neutral (``te_jax.modules.axes``); they are listed here too for the linen modules."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from te_jax.modules.axes import (ACT, ACT_EMBED, BATCH, EMBED, HEAD_DIM, HEADS, LOGICAL_AXES, MLP, QKV, SEQ,
                                 Initializer, axes, context_parallel_axes, features_tuple, gather_sequence, is_int,
                                 rule_axes, rule_shards, seq_first_to_batch_first, sequence_kept, stream_input,
                                 stream_sharding)

__all__ = ["ACT", "ACT_EMBED", "BATCH", "EMBED", "HEADS", "HEAD_DIM", "Initializer", "LOGICAL_AXES", "MLP", "QKV",
           "SEQ", "axes", "context_parallel_axes", "features_tuple", "flat_init", "gather_sequence", "is_int",
           "logical", "reshaped", "resolve_deterministic", "rule_axes", "rule_shards",
           "seq_first_to_batch_first", "sequence_kept", "stream_input", "stream_sharding"]


def logical(init: Initializer, axes: tuple[str | None, ...]) -> Initializer:
  """``init`` with logical axis names attached (for ``nn.logical_to_mesh_sharding``), when there are any. An ``init``
  that names its axes itself (``nn.with_logical_partitioning``, as in most partitioned Flax models) keeps them; both
  at once raise."""
  if not axes:
    return init

  def named(rng, shape, dtype):
    value = init(rng, shape, dtype)
    if isinstance(value, meta.AxisMetadata):
      raise ValueError(f"the initializer names the parameter's axes already ({type(value).__name__}) and the module "
                       f"was given axis names {axes} too: give them one way")
    return nn.LogicallyPartitioned(value, axes)

  return named


def flat_init(init: Initializer, n_in: int, part_axis: int | None = None) -> Initializer:
  """``init`` on the 2-D (inputs, outputs) shape, reshaped: fan-in and fan-out as for a plain dense kernel.

  With ``part_axis`` (a feature axis, counted from the kernel's first axis), the kernel stacks separate projections
  along that axis (a fused QKV kernel's q, k and v): each part is initialized as a dense kernel of its own, ``init``
  on ``(inputs, outputs of one part)`` with key ``jax.random.split(rng, parts)[i]``, so that a fan-based initializer
  sees one projection's fan, as for Flax's separate query, key and value kernels. An ``init`` that names its axes
  (``nn.with_logical_partitioning``) keeps its names on the stacked kernel.
  """

  def wrapped(rng, shape, dtype):
    inputs = int(np.prod(shape[:n_in]))
    if part_axis is None:
      return reshaped(init(rng, (inputs, int(np.prod(shape[n_in:]))), dtype), shape)
    part_shape = tuple(shape[:part_axis]) + tuple(shape[part_axis + 1:])
    flat = (inputs, int(np.prod(part_shape[n_in:])))
    parts = [init(key, flat, dtype) for key in jax.random.split(rng, shape[part_axis])]
    stacked = jnp.stack([jnp.reshape(meta.unbox(p), part_shape) for p in parts], axis=part_axis)
    return meta.replace_boxed(parts[0], stacked) if isinstance(parts[0], meta.AxisMetadata) else stacked

  return wrapped


def reshaped(value, shape):
  """An initializer's output reshaped; one that names its axes (``nn.with_logical_partitioning``) keeps its names, as
  Flax's ``nn.DenseGeneral`` keeps them: they then name the reshaped parameter's axes."""
  if isinstance(value, meta.AxisMetadata):
    return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
  return jnp.reshape(value, shape)




def resolve_deterministic(module: nn.Module, deterministic: bool | None, **rates: float) -> bool:
  """Whether a call runs without dropout, as Flax's own modules decide it: from the module's ``deterministic``
  attribute or the call's argument (``nn.merge_param``: one of them, not both). With neither, a module whose dropout
  ``rates`` are all 0 is deterministic; one with dropout raises, so that a train step and an eval step never look the
  same by accident."""
  for name, rate in rates.items():
    if not (isinstance(rate, (int, float, np.floating)) and 0.0 <= rate < 1.0):
      raise ValueError(f"{name} must be in [0, 1), got {rate!r}")
  if isinstance(deterministic, jax.core.Tracer):
    raise ValueError(f"{type(module).__name__}: deterministic is a traced value here (nn.remat and jax.checkpoint trace "
                     "the call's arguments): give it to the module instead, "
                     f"{type(module).__name__}(..., deterministic=True), or as a static argument")
  if module.deterministic is None and deterministic is None:
    if any(rate > 0 for rate in rates.values()):
      active = ", ".join(f"{name}={rate}" for name, rate in rates.items() if rate > 0)
      raise ValueError(f"{type(module).__name__} has dropout ({active}): pass deterministic=True (evaluation) or "
                       "False (training), to the call or to the module")
    return True
  return bool(nn.merge_param("deterministic", module.deterministic, deterministic))
