"""Per-layer FP8 health, taken inside the train step: for each GEMM operand, the share of values that saturate at
the FP8 maximum and the share that flush to zero when cast with the scale the step uses.

With delayed scaling the scale a step casts with is in the FP8 state before the step, so an operand ``x`` with scale
``s`` saturates where ``|x * s| > fp8_max`` and flushes where ``x != 0`` and ``|x * s| <= smallest subnormal / 2``
(round to nearest even sends those to zero, the tie too). Two operand kinds are measured, with no change to the
fused ops:

- every GEMM's kernel (E4M3): the parameter ``{prefix}kernel`` beside the state's ``{prefix}kernel_scale``;
- the input of every ``te_jax.flax.DenseGeneral`` (E4M3), caught by a Flax method interceptor on its ``__call__``
  and sown into the ``fp8_health`` collection, so the counters come back from the step's own forward pass.

The inputs of the fused norm + GEMM modules (their normalized input, the MLP's activation) and the E5M2 gradients
exist only inside the fused ops; their amax histories, in the state, are reported and plotted instead.

>>> import jax.numpy as jnp
>>> saturated, flushed = fp8_shares(jnp.array([1.0, 500.0, 1e-4, 0.0]), jnp.float32(1.0), "e4m3")
>>> float(saturated), float(flushed)
(0.25, 0.25)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax.flax as te_flax

__all__ = [
    "FP8_FORMATS", "HEALTH_COLLECTION", "flatten_sown", "fp8_shares", "input_health", "kernel_health", "latest_amaxes",
]

#: The ``apply`` collection the input counters are sown into.
HEALTH_COLLECTION = "fp8_health"

#: Each FP8 format's largest finite value and smallest positive subnormal.
FP8_FORMATS = {"e4m3": (448.0, 2.0**-9), "e5m2": (57344.0, 2.0**-16)}


def fp8_shares(x: jax.Array, scale: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """(saturated share, flushed share) of ``x`` cast to FP8 format ``fmt`` ("e4m3" or "e5m2") after multiplying by
  ``scale``; both float32 scalars, shares of all the elements of ``x``."""
  if fmt not in FP8_FORMATS:
    raise ValueError(f"fp8_shares: fmt must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
  fp8_max, tiny = FP8_FORMATS[fmt]
  x = jax.lax.stop_gradient(jnp.asarray(x)).astype(jnp.float32)
  scaled = jnp.abs(x * jax.lax.stop_gradient(scale).astype(jnp.float32))
  saturated = jnp.mean((scaled > fp8_max).astype(jnp.float32))
  flushed = jnp.mean(((x != 0) & (scaled <= tiny / 2)).astype(jnp.float32))  # a tie rounds to even: 0
  return saturated, flushed


def _flat(tree: Mapping, path: tuple[str, ...] = ()):
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from _flat(value, path + (key,))
    else:
      yield path + (key,), value


def _get(tree: Mapping, path: tuple[str, ...]):
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return None
    tree = tree[key]
  return tree


def kernel_health(variables: Mapping) -> dict[str, tuple[jax.Array, jax.Array]]:
  """``{"layer/path/kernel": (saturated, flushed)}`` for every GEMM kernel that has a delayed-scaling state in
  ``variables`` (the whole variables dict of the step, before the step)."""
  state = variables.get(te_jax.FP8_COLLECTION, {})
  out = {}
  for path, scale in _flat(state):
    if not path[-1].endswith("kernel_scale"):
      continue
    kernel = _get(variables.get("params", {}), path[:-1] + (path[-1][:-len("_scale")],))
    if kernel is None:
      raise ValueError(f"kernel_health: the FP8 state {'/'.join(path)} has no parameter "
                       f"{'/'.join(path[:-1] + (path[-1][:-len('_scale')],))} beside it")
    out["/".join(path[:-1] + (path[-1][:-len("_scale")],))] = fp8_shares(kernel, scale, "e4m3")
  return out


def _sow_input(next_fun, args, kwargs, context):
  module = context.module
  if (context.method_name == "__call__" and isinstance(module, te_flax.DenseGeneral) and args
      and module.has_variable(te_jax.FP8_COLLECTION, "x_scale")):
    scale = module.get_variable(te_jax.FP8_COLLECTION, "x_scale")
    module.sow(HEALTH_COLLECTION, "x", fp8_shares(args[0], scale, "e4m3"))
  return next_fun(*args, **kwargs)


@contextlib.contextmanager
def input_health():
  """Within it, every ``te_jax.flax.DenseGeneral`` with a delayed-scaling state sows ``(saturated, flushed)`` of its
  input into ``HEALTH_COLLECTION`` (apply with ``mutable=[HEALTH_COLLECTION]`` to get them back)."""
  with nn.intercept_methods(_sow_input):
    yield


def flatten_sown(sown: Mapping) -> dict[str, tuple[jax.Array, jax.Array]]:
  """``{"layer/path/x": (saturated, flushed)}`` from the ``HEALTH_COLLECTION`` an apply returned (a module applied
  several times: the largest share of its calls)."""
  out = {}
  for path, calls in _flat(sown):
    out["/".join(path)] = tuple(jnp.max(jnp.stack(v)) for v in zip(*calls))
  return out


def latest_amaxes(variables: Mapping) -> dict[str, float]:
  """``{"layer/path/{prefix}{x,kernel,grad}": amax}``: each delayed-scaling operand's most recent amax (element 0 of
  its history)."""
  state = variables.get(te_jax.FP8_COLLECTION, {})
  return {"/".join(path[:-1] + (path[-1][:-len("_amax_history")],)): float(np.asarray(history)[0])
          for path, history in _flat(state) if path[-1].endswith("_amax_history")}
