"""``LinenScope``: the ``te_jax.modules`` scope of a linen module, its parameters and FP8 state in the module's
variables (created at ``init``, read at ``apply``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from te_jax.flax.fp8_state import fp8_state
from te_jax.flax.params import flat_init, logical, reshaped
from te_jax.modules.axes import Initializer
from te_jax.modules.scope import Scope
from te_jax.recipe import Recipe

__all__ = ["LinenScope", "options_of"]


class LinenScope(Scope):
  """The scope of ``module`` (a linen module inside its ``nn.compact`` call)."""

  def __init__(self, module: nn.Module):
    self.module = module

  @property
  def where(self) -> str:
    return "/".join(map(str, self.module.path)) or type(self.module).__name__

  def param(self, name: str, init: Initializer, shape: tuple[int, ...], dtype: Any, *, n_in: int | None = None,
            part_axis: int | None = None, axes: tuple[str | None, ...] = ()) -> jax.Array:
    if n_in == 0:
      def flat(rng, shape, dtype):
        return reshaped(init(rng, (int(np.prod(shape)),), dtype), shape)
      init_fn = flat
    elif n_in is not None:
      init_fn = flat_init(init, n_in, part_axis)
    else:
      init_fn = init
    return self.module.param(name, logical(init_fn, tuple(axes)), tuple(shape), dtype)

  def declare_fp8_state(self, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",)) -> None:
    del recipe, prefixes  # linen creates the FP8 state at the call, in fp8_state

  def fp8_state(self, recipe, x, prefixes=("",)):
    return fp8_state(self.module, recipe, x, prefixes)

  def declare_dropout(self, name: str, rate: float, rng_name: str) -> None:
    del name, rate, rng_name  # linen creates the dropout at the call

  def dropout(self, name: str, rate: float, rng_name: str, x: jax.Array) -> jax.Array:
    del name  # linen names it as any inline submodule of the calling module (Dropout_0, ...)
    return nn.Dropout(rate, rng_collection=rng_name)(x, deterministic=False)


def options_of(module: nn.Module, options: type):
  """``options`` (a ``te_jax.modules`` options dataclass) from ``module``'s attributes of the same names."""
  return options(**{f.name: getattr(module, f.name) for f in dataclasses.fields(options)})
