"""What the NNX modules share: parameters created from an initializer (on a kernel's 2-D shape, as Flax's dense
layers do) with their sharding metadata, and the deterministic flag of modules with dropout."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib

from te_jax.modules.axes import Initializer, is_int

__all__ = ["as_tuple", "make_param", "resolve_deterministic"]


def as_tuple(x, name: str) -> tuple[int, ...]:
  """``x`` (an int or a sequence of ints) as a tuple of positive ints, or a ValueError that names it."""
  out = tuple(x) if isinstance(x, Sequence) and not isinstance(x, str) else (x,)
  if not out or not all(is_int(f) and f > 0 for f in out):
    raise ValueError(f"{name} must be a positive int or a non-empty sequence of them, got {x!r}")
  return tuple(int(f) for f in out)


def make_param(init: Initializer, rng, shape: tuple[int, ...], dtype, *, n_in: int | None = None,
               part_axis: int | None = None, axes: tuple[str | None, ...] = (), metadata=None) -> nnx.Param:
  """``nnx.Param`` of ``init(rng, shape, dtype)``; with ``n_in``, ``init`` sees the 2-D ``(prod(shape[:n_in]),
  prod(shape[n_in:]))`` shape (``n_in=0``: the flat
  ``(prod(shape),)``) and its value is reshaped (fan-in and fan-out as for a plain dense kernel, as
  ``nnx.LinearGeneral`` and te_jax.flax's modules do). Sharding: an initializer wrapped in ``nnx.with_partitioning``
  keeps its names; ``axes`` (logical names from a module's ``logical_axes``) become ``out_sharding`` metadata; both
  at once raise. ``metadata``: more metadata for the variable (``kernel_metadata`` of ``nnx.LinearGeneral``).
  ``part_axis`` (a feature axis of a kernel, with ``n_in``): the kernel stacks separate projections along it (a fused
  QKV kernel's q, k and v; a gated MLP's two inputs), each initialized as a kernel of its own with key
  ``jax.random.split(rng, parts)[i]``, as te_jax.flax's ``flat_init`` does."""
  if n_in is None:
    init_shape = shape
  elif n_in == 0:  # a bias: its flat (features,) shape, as Flax's dense layers initialize it
    init_shape = (int(np.prod(shape)),)
  else:
    init_shape = (int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:])))
  if part_axis is None:
    value = init(rng, init_shape, dtype)
  else:
    part_shape = tuple(shape[:part_axis]) + tuple(shape[part_axis + 1:])
    flat = (init_shape[0], int(np.prod(part_shape[n_in:])))
    parts = [init(key, flat, dtype) for key in jax.random.split(rng, shape[part_axis])]
    raw = [p.raw_value if isinstance(p, variablelib.VariableMetadata) else p for p in parts]
    value = jnp.stack([jnp.reshape(r, part_shape) for r in raw], axis=part_axis)
    if isinstance(parts[0], variablelib.VariableMetadata):
      parts[0].raw_value, value = value, parts[0]
  extra = dict(metadata or {})
  if isinstance(value, variablelib.VariableMetadata):
    if axes:
      raise ValueError(f"the initializer names the parameter's axes already and the module was given axis names "
                       f"{axes} too: give them one way")
    value.raw_value = jnp.reshape(value.raw_value, shape)
  else:
    value = jnp.reshape(value, shape)
    if axes:
      extra["out_sharding"] = tuple(axes)
  return nnx.Param(value, **extra)


def resolve_deterministic(module, deterministic: bool | None, **rates: float) -> bool:
  """Whether a call runs without dropout, as NNX's ``nnx.Dropout`` decides it: the call's ``deterministic``, else the
  module's. With neither, a module whose dropout ``rates`` are all 0 is deterministic; one with dropout raises, so a
  train step and an eval step never look the same by accident."""
  for name, rate in rates.items():
    if not (isinstance(rate, (int, float, np.floating)) and 0.0 <= rate < 1.0):
      raise ValueError(f"{name} must be in [0, 1), got {rate!r}")
  if deterministic is None:
    deterministic = module.deterministic
  if deterministic is None:
    if any(rate > 0 for rate in rates.values()):
      active = ", ".join(f"{name}={rate}" for name, rate in rates.items() if rate > 0)
      raise ValueError(f"{type(module).__name__} has dropout ({active}): pass deterministic=True (evaluation) or "
                       "False (training), to the call or to the module")
    return True
  return bool(deterministic)
