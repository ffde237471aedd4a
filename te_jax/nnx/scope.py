"""``NnxScope``: the ``te_jax.modules`` scope of an NNX module, its parameters ``nnx.Param`` attributes and its FP8
state ``Fp8State`` attributes, created in the constructor and read in the call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from te_jax.modules.axes import Initializer
from te_jax.modules.scope import Scope
from te_jax.nnx.fp8_state import declare_fp8_state, fp8_metas
from te_jax.nnx.params import make_param
from te_jax.recipe import Recipe

__all__ = ["NnxScope"]


class NnxScope(Scope):
  """The scope of ``module``: with ``rngs`` (in its constructor) parameters are created from the ``params`` stream,
  in the order the body asks for them; without (in its call) they are read back. ``metadata``: more metadata for
  named variables (``nnx.LinearGeneral``'s ``kernel_metadata``, ``bias_metadata``)."""

  def __init__(self, module: nnx.Module, rngs: nnx.Rngs | None = None,
               metadata: Mapping[str, Mapping[str, Any] | None] | None = None):
    self.module, self.rngs, self.metadata = module, rngs, dict(metadata or {})

  @property
  def where(self) -> str:
    return type(self.module).__name__

  def param(self, name: str, init: Initializer, shape: tuple[int, ...], dtype: Any, *, n_in: int | None = None,
            part_axis: int | None = None, axes: tuple[str | None, ...] = ()) -> jax.Array:
    shape = tuple(shape)
    if self.rngs is not None:
      var = make_param(init, self.rngs.params(), shape, dtype, n_in=n_in, part_axis=part_axis, axes=tuple(axes),
                       metadata=self.metadata.get(name))
      setattr(self.module, name, var)
      return var[...]
    var = getattr(self.module, name, None)
    if not isinstance(var, nnx.Variable):
      raise ValueError(f"{self.where} has no parameter {name!r}: it was built without it (e.g. use_bias=False), or "
                       "its variables were replaced by a state of another layer")
    value = var[...]
    if tuple(value.shape) != shape:
      raise ValueError(f"{self.where}: parameter {name!r} has shape {tuple(value.shape)}, and this input needs "
                       f"{shape}: the layer was built for other sizes (its constructor's in_features, ...)")
    return value

  def declare_fp8_state(self, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",)) -> None:
    if self.rngs is not None:
      declare_fp8_state(self.module, recipe, prefixes)

  def fp8_state(self, recipe, x, prefixes=("",)):
    return fp8_metas(self.module, recipe, x, prefixes)

  def declare_dropout(self, name: str, rate: float, rng_name: str) -> None:
    if self.rngs is not None:
      setattr(self.module, name, nnx.Dropout(rate, rng_collection=rng_name, rngs=self.rngs if rate > 0 else None))

  def dropout(self, name: str, rate: float, rng_name: str, x: jax.Array) -> jax.Array:
    del rate, rng_name  # the module's nnx.Dropout has them
    return getattr(self.module, name)(x, deterministic=False)
