"""``LinenScope``: the ``te_jax.modules`` scope of a linen module, its parameters and FP8 state in the module's
variables (created at ``init``, read at ``apply``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from te_jax.flax.fp8_state import fp8_state
from te_jax.flax.params import flat_init, logical, reshaped
from te_jax.modules.attention_cache import KVCache, append_to_cache
from te_jax.modules.axes import Initializer
from te_jax.modules.scope import Scope, fields_of
from te_jax.recipe import Recipe

__all__ = ["LinenKVCache", "LinenScope", "builds", "options_of"]

# The linen module built from each te_jax.modules options class (``builds``).
_MODULES: dict[type, type] = {}


def builds(options: type):
  """Class decorator: the linen module, whose attributes are ``options``' fields, is the one ``LinenScope.submodule``
  builds from an ``options`` instance."""
  def register(cls):
    _MODULES[options] = cls
    return cls
  return register


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

  def declare_fp8_state(self, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",), *,
                        groups: int | None = None) -> None:
    del recipe, prefixes, groups  # linen creates the FP8 state at the call, in fp8_state

  def fp8_state(self, recipe, x, prefixes=("",), *, groups=None):
    return fp8_state(self.module, recipe, x, prefixes, groups=groups)

  def declare_dropout(self, name: str, rate: float, rng_name: str, broadcast_dims: tuple[int, ...] = ()) -> None:
    del name, rate, rng_name, broadcast_dims  # linen creates the dropout at the call

  def dropout(self, name: str, rate: float, rng_name: str, x: jax.Array, deterministic: bool = False,
              broadcast_dims: tuple[int, ...] = ()) -> jax.Array:
    del name  # linen names it as any inline submodule of the calling module (Dropout_0, ...)
    return nn.Dropout(rate, broadcast_dims=tuple(broadcast_dims), rng_collection=rng_name)(
        x, deterministic=deterministic)

  def declare_rng(self, name: str, rng_name: str, needed: bool) -> None:
    del name, rng_name, needed  # the call draws from the module's rng stream

  def rng(self, name: str, rng_name: str) -> jax.Array:
    del name
    return self.module.make_rng(rng_name)

  def submodule(self, name: str, options, in_features=None, **build):
    del in_features, build  # linen reads the sizes and the rest off the call
    cls = _MODULES.get(type(options))
    if cls is None:
      raise TypeError(f"no te_jax.flax module is built from {type(options).__name__}")
    return cls(**fields_of(options), name=name)


class LinenKVCache(KVCache):
  """The KV cache in the ``"cache"`` collection of ``module`` (an attention layer, inside its call), or read only,
  of its submodule ``child``: ``cached_key``, ``cached_value`` and ``cache_index``, created by ``init`` from the
  first input's shape."""

  def __init__(self, module: nn.Module, child: str | None = None):
    self.module, self.child = module, child

  def _get(self, name: str):
    if self.child is not None:
      return self.module.variables.get("cache", {}).get(self.child, {}).get(name)
    return self.module.get_variable("cache", name) if self.module.has_variable("cache", name) else None

  def key_shape(self):
    key = self._get("cached_key")
    return None if key is None else tuple(key.shape)

  def index(self):
    return self._get("cache_index")

  def append(self, key, value):
    if self.child is not None:
      raise ValueError(f"the KV cache of {self.child!r} is appended to by that layer itself")
    module = self.module
    initialized = module.has_variable("cache", "cached_key")
    cached_k = module.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_v = module.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized:  # init: the cache takes the shape of this (full-length) input
      return key, value
    cached_k.value, cached_v.value, index.value = append_to_cache(cached_k.value, cached_v.value, index.value, key,
                                                                  value)
    return cached_k.value, cached_v.value


def options_of(module: nn.Module, options: type):
  """``options`` (a ``te_jax.modules`` options dataclass) from ``module``'s attributes of the same names."""
  return options(**{f.name: getattr(module, f.name) for f in dataclasses.fields(options)})
