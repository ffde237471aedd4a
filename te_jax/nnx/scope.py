"""``NnxScope``: the ``te_jax.modules`` scope of an NNX module, its parameters ``nnx.Param`` attributes and its FP8
state ``Fp8State`` attributes, created in the constructor and read in the call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from te_jax.modules.attention_cache import KVCache, append_to_cache, require_cache
from te_jax.modules.axes import Initializer
from te_jax.modules.scope import Scope
from te_jax.nnx.fp8_state import declare_fp8_state, fp8_metas
from te_jax.nnx.params import make_param
from te_jax.recipe import Recipe

__all__ = ["NnxKVCache", "NnxScope", "builds"]

# The NNX module built from each te_jax.modules options class (``builds``).
_MODULES: dict[type, type] = {}


def builds(options: type):
  """Class decorator: the NNX module, whose ``from_options(options, in_features, *, rngs, **build)`` constructs it,
  is the one ``NnxScope.submodule`` builds from an ``options`` instance."""
  def register(cls):
    _MODULES[options] = cls
    return cls
  return register


class NnxScope(Scope):
  """The scope of ``module``: ``building`` (in its constructor; by default where ``rngs`` are given) variables and
  submodules are created, parameters from the ``params`` stream in the order the body asks for them; otherwise (in
  its call) they are read back. ``metadata``: more metadata for named variables (``nnx.LinearGeneral``'s
  ``kernel_metadata``, ``bias_metadata``)."""

  def __init__(self, module: nnx.Module, rngs: nnx.Rngs | None = None,
               metadata: Mapping[str, Mapping[str, Any] | None] | None = None, *, building: bool | None = None):
    self.module, self.rngs, self.metadata = module, rngs, dict(metadata or {})
    self.building = rngs is not None if building is None else building

  @property
  def where(self) -> str:
    return type(self.module).__name__

  def param(self, name: str, init: Initializer, shape: tuple[int, ...], dtype: Any, *, n_in: int | None = None,
            part_axis: int | None = None, axes: tuple[str | None, ...] = ()) -> jax.Array:
    shape = tuple(shape)
    if self.building:
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

  def declare_fp8_state(self, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",), *,
                        groups: int | None = None) -> None:
    if self.building:
      declare_fp8_state(self.module, recipe, prefixes, groups=groups)

  def fp8_state(self, recipe, x, prefixes=("",), *, groups=None):
    return fp8_metas(self.module, recipe, x, prefixes, groups=groups)

  def declare_dropout(self, name: str, rate: float, rng_name: str, broadcast_dims: tuple[int, ...] = ()) -> None:
    if self.building:
      setattr(self.module, name, nnx.Dropout(rate, broadcast_dims=tuple(broadcast_dims), rng_collection=rng_name,
                                             rngs=self.rngs if rate > 0 else None))

  def dropout(self, name: str, rate: float, rng_name: str, x: jax.Array, deterministic: bool = False,
              broadcast_dims: tuple[int, ...] = ()) -> jax.Array:
    del rate, rng_name, broadcast_dims  # the module's nnx.Dropout has them
    return getattr(self.module, name)(x, deterministic=deterministic)

  def declare_rng(self, name: str, rng_name: str, needed: bool) -> None:
    if not self.building:
      return
    if needed and self.rngs is None:
      raise ValueError(f"{self.where} needs rngs: its {rng_name!r} stream draws the dropout masks")
    setattr(self.module, name, self.rngs[rng_name].fork() if needed else nnx.data(None))

  def rng(self, name: str, rng_name: str) -> jax.Array:
    del rng_name  # the stream declare_rng forked
    return getattr(self.module, name)()

  def submodule(self, name: str, options, in_features=None, **build):
    if not self.building:
      return getattr(self.module, name)
    cls = _MODULES.get(type(options))
    if cls is None:
      raise TypeError(f"no te_jax.nnx module is built from {type(options).__name__}")
    child = cls.from_options(options, in_features, rngs=self.rngs, **build)
    setattr(self.module, name, child)
    return child


class NnxKVCache(KVCache):
  """The KV cache of ``module`` (an attention layer): its ``nnx.Cache`` variables ``cached_key``, ``cached_value``
  and ``cache_index``, which its ``init_cache`` creates."""

  def __init__(self, module: nnx.Module):
    self.module = module

  def key_shape(self):
    require_cache(self.module.cache_index is not None)
    return tuple(self.module.cached_key.shape)

  def index(self):
    return self.module.cache_index[...]

  def append(self, key, value):
    m = self.module
    m.cached_key[...], m.cached_value[...], m.cache_index[...] = append_to_cache(
        m.cached_key[...], m.cached_value[...], m.cache_index[...], key, value)
    return m.cached_key[...], m.cached_value[...]
