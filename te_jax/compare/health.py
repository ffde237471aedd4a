"""Per-layer FP8 health, taken inside the train step: for each GEMM operand, the share of values that saturate at
the FP8 maximum and the share that flush to zero when cast with the scale the step uses.

With delayed scaling the scale a step casts with is in the FP8 state before the step, so an operand ``x`` with scale
``s`` saturates where ``|x * s| > fp8_max`` and flushes where ``x != 0`` and ``|x * s| <= smallest subnormal / 2``
(round to nearest even sends those to zero, the tie too). Three operand kinds are measured, with no change to the
fused ops or the modules:

- ``{path}/{prefix}kernel``, every GEMM's kernel (E4M3): the parameter ``{prefix}kernel`` beside the state's
  ``{prefix}kernel_scale``;
- ``{path}/x``, the input of every ``te_jax.flax.DenseGeneral`` and ``Fp8DotGeneral`` (E4M3), caught by a Flax
  method interceptor on its ``__call__`` (``input_health``) and sown into the ``fp8_health`` collection, so the
  counters come back from the step's own forward pass (a module applied several times: the largest share of its
  calls); an ``Fp8DotGeneral``'s kernel, its caller's parameter, is counted there too;
- ``{path}/{prefix}grad``, the output gradient of every FP8 GEMM that is a module's output (E5M2 under the HYBRID
  format, E4M3 under E4M3): what the GEMM's backward casts, with the state's ``{prefix}grad_scale``, for its dgrad
  and wgrad. ``grad_health`` intercepts ``DenseGeneral``, ``Fp8DotGeneral``, ``LayerNormDenseGeneral`` (the GEMM
  output, not the normalized input or the input it can also return) and ``LayerNormMLP`` (fc2's output, ``wo_grad``)
  and passes the GEMM's output through an identity whose backward counts its cotangent: the values that saturate,
  the values that flush and all values, in the GEMM's compute dtype (the tensor the backward quantizes, its padding
  rows left out). The counts come back as the gradient of a zero probe, ``{prefix}grad_health`` (``grad_probes``),
  put beside the state in the FP8 collection for the step (``with_grad_probes``), so under ``nn.scan`` they are per
  layer as the state is, and a module applied several times adds its calls' counts (the share of all the values its
  one scale cast).

The inputs of the fused norm + GEMM modules (their normalized input, the MLP's activation) and the MLP's fc1 output
gradient (``wi_grad``: the activation's backward writes it in FP8 inside the fused op) exist only inside the fused
ops; their amax histories, in the state, are reported and plotted instead. Only GEMMs that run in FP8 under delayed
scaling are counted: a layer whose sizes are not multiples of 16, or with ``batch_dims`` or a ``dot_general`` of its
own, computes in high precision and casts no gradient.

Under ``nn.scan`` the state and the kernels have a leading layer axis, and every counter is reported per layer:
``{path}[i]/{operand}`` (``[i,j]`` for nested scans). The input counters need ``HEALTH_COLLECTION`` in the scan's
``variable_axes`` (axis 0) too; without it Flax drops what the scanned layers sow.

>>> import jax.numpy as jnp
>>> saturated, flushed = fp8_shares(jnp.array([1.0, 500.0, 1e-4, 0.0]), jnp.float32(1.0), "e4m3")
>>> float(saturated), float(flushed)
(0.25, 0.25)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax.flax as te_flax
from te_jax._core.autocast import resolve_recipe
from te_jax._core.scaling import ScaleState
from te_jax.fused.dense import normalize_axes
from te_jax.fused.linear import fp8_dims_aligned, state_as_float32
from te_jax.modules.dense import unstack_of
from te_jax.recipe import DelayedScaling

__all__ = [
    "FP8_FORMATS", "GRAD_PROBE", "HEALTH_COLLECTION", "flatten_sown", "fp8_counts", "fp8_shares", "grad_health",
    "grad_probes", "grad_shares", "input_health", "kernel_health", "latest_amaxes", "rows", "with_grad_probes",
]

#: The ``apply`` collection the input counters are sown into.
HEALTH_COLLECTION = "fp8_health"

#: The name (after the GEMM's prefix) of a gradient counter's probe in the FP8 collection.
GRAD_PROBE = "grad_health"

#: Each FP8 format's largest finite value and smallest positive subnormal.
FP8_FORMATS = {"e4m3": (448.0, 2.0**-9), "e5m2": (57344.0, 2.0**-16)}


def _lost(x: jax.Array, scale: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """The masks of ``x``'s values that saturate and that flush when cast to ``fmt`` after multiplying by ``scale``
  (a scale per leading index of ``x`` when it has dims: one per layer of a scanned stack)."""
  if fmt not in FP8_FORMATS:
    raise ValueError(f"fp8_shares: fmt must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
  fp8_max, tiny = FP8_FORMATS[fmt]
  x = jax.lax.stop_gradient(jnp.asarray(x)).astype(jnp.float32)
  scale = jax.lax.stop_gradient(jnp.asarray(scale)).astype(jnp.float32)
  if scale.shape != x.shape[:scale.ndim]:
    raise ValueError(f"fp8_shares: scale {scale.shape} must be a scalar or x's leading dims, x is {x.shape}")
  scaled = jnp.abs(x * scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim)))
  return scaled > fp8_max, (x != 0) & (scaled <= tiny / 2)  # a tie rounds to even: 0


def fp8_shares(x: jax.Array, scale: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """(saturated share, flushed share) of ``x`` cast to FP8 format ``fmt`` ("e4m3" or "e5m2") after multiplying by
  ``scale``; both float32 scalars, shares of all the elements of ``x``. A ``scale`` with dims (``x``'s leading ones:
  a scanned stack's per-layer scales) gives shares of its shape, each over its slice of ``x``."""
  saturated, flushed = _lost(x, scale, fmt)
  axes = tuple(range(jnp.ndim(scale), saturated.ndim))
  return (jnp.mean(saturated.astype(jnp.float32), axis=axes), jnp.mean(flushed.astype(jnp.float32), axis=axes))


def fp8_counts(x: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
  """``[saturated, flushed, all]``: counts of ``x``'s values (as ``fp8_shares`` takes them), float32 (counted in
  int32, so exact up to 2**24 values and within a float32 rounding beyond)."""
  saturated, flushed = _lost(x, scale, fmt)
  counts = [jnp.sum(saturated, dtype=jnp.int32), jnp.sum(flushed, dtype=jnp.int32)]
  return jnp.stack(counts + [jnp.int32(saturated.size)]).astype(jnp.float32)


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
  ``variables`` (the whole variables dict of the step, before the step); under ``nn.scan``, arrays of the scale's
  (per-layer) shape. A state with no parameter beside it (an ``Fp8DotGeneral``'s, whose kernel its caller owns) is
  left to ``input_health``, which sees the kernel the GEMM is handed."""
  state = variables.get(te_jax.FP8_COLLECTION, {})
  out = {}
  for path, scale in _flat(state):
    if not path[-1].endswith("kernel_scale"):
      continue
    kernel = _get(variables.get("params", {}), path[:-1] + (path[-1][:-len("_scale")],))
    if kernel is not None:
      out["/".join(path[:-1] + (path[-1][:-len("_scale")],))] = fp8_shares(kernel, scale, "e4m3")
  return out


def _sow_input(next_fun, args, kwargs, context):
  module = context.module
  if context.method_name == "__call__" and module.has_variable(te_jax.FP8_COLLECTION, "x_scale"):
    # An Fp8DotGeneral's kernel is its caller's parameter, handed over as its second argument.
    operands = (("x",) if isinstance(module, te_flax.DenseGeneral) else
                ("x", "kernel") if isinstance(module, te_flax.Fp8DotGeneral) else ())
    for operand, value in zip(operands, args):
      scale = module.get_variable(te_jax.FP8_COLLECTION, f"{operand}_scale")
      module.sow(HEALTH_COLLECTION, operand, fp8_shares(value, scale, "e4m3"))
  return next_fun(*args, **kwargs)


@contextlib.contextmanager
def input_health():
  """Within it, every ``te_jax.flax.DenseGeneral`` with a delayed-scaling state sows ``(saturated, flushed)`` of its
  input into ``HEALTH_COLLECTION`` (apply with ``mutable=[HEALTH_COLLECTION]`` to get them back), and every
  ``te_jax.flax.Fp8DotGeneral`` those of its input and its kernel."""
  with nn.intercept_methods(_sow_input):
    yield


def flatten_sown(sown: Mapping) -> dict[str, tuple[jax.Array, jax.Array]]:
  """``{"layer/path/x": (saturated, flushed)}`` from the ``HEALTH_COLLECTION`` an apply returned (a module applied
  several times: the largest share of its calls; under ``nn.scan``, one per layer)."""
  out = {}
  for path, calls in _flat(sown):
    out["/".join(path)] = tuple(jnp.max(jnp.stack(v), axis=0) for v in zip(*calls))
  return out


# ----------------------------------------------------------------------------------------------------------------
# Output gradients


def _size(shape) -> int:
  return math.prod(int(d) for d in shape)


def _features(features) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


def _input(args, kwargs, name: str):
  return args[0] if args else kwargs.get(name)


#: The te_jax.flax modules that own FP8 GEMM state.
_GEMM_MODULES = (te_flax.DenseGeneral, te_flax.Fp8DotGeneral, te_flax.LayerNormDenseGeneral, te_flax.LayerNormMLP)


def _gemm_output(module: nn.Module, args, kwargs):
  """``(prefix, compute dtype, takes_first)`` of the FP8 GEMM whose output ``module``'s call returns, or None where
  the call runs no FP8 GEMM under delayed scaling. ``takes_first``: the GEMM output is the first of the returned
  tuple (the rest are other tensors); else it is the whole output (an array, or the parts of an unstacked one).

  The conditions are the modules' and fused ops' own: a ``DenseGeneral`` with ``batch_dims`` or a ``dot_general``
  runs Flax's GEMM, and a GEMM whose contracted or output size is not a multiple of 16 runs in high precision."""
  if not isinstance(module, _GEMM_MODULES) or not isinstance(resolve_recipe(module.recipe), DelayedScaling):
    return None
  if isinstance(module, te_flax.DenseGeneral):
    x = _input(args, kwargs, "inputs")
    if x is None or module.batch_dims or module.dot_general is not None or module.dot_general_cls is not None:
      return None
    x = jnp.asarray(x)
    axes = normalize_axes(module.axis, x.ndim, "inputs")
    features = _features(module.features)
    unstack = unstack_of(module.unstack_axis, features, x.ndim - len(axes) + len(features))
    if not fp8_dims_aligned(_size(x.shape[a] for a in axes), _size(features), unstack):
      return None
    return "", jnp.dtype(module.dtype or jnp.result_type(x.dtype, module.param_dtype)), False
  if isinstance(module, te_flax.Fp8DotGeneral):
    if len(args) < 3:
      return None
    lhs, rhs, ((lhs_contract, rhs_contract), _) = args[0], args[1], args[2]
    if not fp8_dims_aligned(_size(lhs.shape[a] for a in lhs_contract), _size(rhs.shape[len(rhs_contract):])):
      return None
    return "", jnp.dtype(lhs.dtype), False  # the output may be cast to preferred_element_type after the GEMM
  if isinstance(module, te_flax.LayerNormDenseGeneral):
    x = _input(args, kwargs, "inputs")
    features = _features(module.features)
    if x is None or not fp8_dims_aligned(x.shape[-1], _size(features),
                                         unstack_of(module.unstack_axis, features, x.ndim - 1 + len(features))):
      return None
    extra = module.return_layernorm_output or bool(kwargs.get("return_input", False))
    return "", jnp.dtype(module.dtype or jnp.result_type(x.dtype, module.param_dtype)), extra
  if isinstance(module, te_flax.LayerNormMLP):
    x = _input(args, kwargs, "inputs")
    if x is None or not fp8_dims_aligned(x.shape[-1], module.intermediate_dim):
      return None
    dtype = jnp.dtype(module.dtype or jnp.result_type(x.dtype, module.param_dtype))
    return "wo_", dtype, module.return_layernorm_output
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _count_cotangent(fmt: str, dtype, outputs, probe, scale):
  """``outputs`` unchanged; its backward returns ``fp8_counts`` of the cotangent as ``probe``'s gradient."""
  del probe, scale
  return outputs


def _count_cotangent_fwd(fmt, dtype, outputs, probe, scale):
  del probe
  return outputs, scale


def _count_cotangent_bwd(fmt, dtype, scale, g):
  # The cotangent in the GEMM's compute dtype, as the fused op's backward receives it (Fp8DotGeneral may return its
  # output in another dtype), all its parts together (an unstacked output's parts are one GEMM output).
  counts = sum(fp8_counts(part.astype(dtype), scale, fmt) for part in jax.tree.leaves(g))
  return g, counts, jnp.zeros_like(scale)


_count_cotangent.defvjp(_count_cotangent_fwd, _count_cotangent_bwd)


def _count_grad(next_fun, args, kwargs, context):
  module = context.module
  gemm = _gemm_output(module, args, kwargs) if context.method_name == "__call__" else None
  out = next_fun(*args, **kwargs)
  if gemm is None:
    return out
  prefix, dtype, takes_first = gemm
  names = (f"{prefix}{GRAD_PROBE}", f"{prefix}grad_scale", f"{prefix}grad_amax_history")
  if not all(module.has_variable(te_jax.FP8_COLLECTION, n) for n in names):
    return out  # no probe given for this GEMM (with_grad_probes), or no state
  probe, scale, history = (module.get_variable(te_jax.FP8_COLLECTION, n) for n in names)
  # The scale the backward casts with: the state's before the step, read as the fused op reads it (a scale that
  # is not positive is a fresh state's 1).
  scale = jax.lax.stop_gradient(state_as_float32(ScaleState(history, scale)).scale)
  fmt = "e5m2" if resolve_recipe(module.recipe).fp8_format.bwd_dtype == jnp.float8_e5m2 else "e4m3"
  if takes_first:
    return (_count_cotangent(fmt, dtype, out[0], probe, scale), *out[1:])
  return _count_cotangent(fmt, dtype, out, probe, scale)


@contextlib.contextmanager
def grad_health():
  """Within it, every FP8 GEMM output of a te_jax module whose variables hold a probe (``with_grad_probes``) is
  passed through an identity whose backward counts the output gradient's saturated, flushed and total values into
  the probe's gradient (``grad_shares`` turns them into shares)."""
  with nn.intercept_methods(_count_grad):
    yield


def grad_probes(variables: Mapping) -> dict:
  """Zero probes, one per GEMM state in ``variables``' FP8 collection: ``{path: {"{prefix}grad_health": zeros}}``
  of the state's (per-layer) scale shape + (3,), to pass to the step beside the variables."""
  out: dict = {}
  for path, scale in _flat(variables.get(te_jax.FP8_COLLECTION, {})):
    if path[-1].endswith("grad_scale"):
      node = out
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1][:-len("grad_scale")] + GRAD_PROBE] = jnp.zeros(jnp.shape(scale) + (3,), jnp.float32)
  return out


def with_grad_probes(variables: Mapping, probes: Mapping) -> dict:
  """``variables`` with ``probes`` merged into the FP8 collection, for the apply under ``grad_health`` (the gradient
  w.r.t. ``probes`` is then the counts; the variables' own gradient is as without them)."""

  def merge(a: Mapping, b: Mapping) -> dict:
    out = dict(a)
    for key, value in b.items():
      out[key] = merge(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out

  return {**variables, te_jax.FP8_COLLECTION: merge(variables.get(te_jax.FP8_COLLECTION, {}), probes)}


def grad_shares(counts: Mapping) -> dict[str, tuple[jax.Array, jax.Array]]:
  """``{"layer/path/{prefix}grad": (saturated, flushed)}`` from the gradient w.r.t. ``grad_probes``: shares of the
  counted values; NaN where the step counted none (a GEMM that is no module's output, such as the MLP's fc1)."""
  out = {}
  for path, c in _flat(counts):
    total = c[..., 2]
    share = lambda n: jnp.where(total > 0, n / jnp.maximum(total, 1.0), jnp.nan)  # noqa: E731
    out["/".join(path[:-1] + (path[-1][:-len(GRAD_PROBE)] + "grad",))] = (share(c[..., 0]), share(c[..., 1]))
  return out


# ----------------------------------------------------------------------------------------------------------------
# Host side


def _per_layer(name: str, index: tuple[int, ...]) -> str:
  """``name`` ("module/path/operand") of layer ``index`` of a scanned stack: "module/path[i]/operand"."""
  if not index:
    return name
  module, _, operand = name.rpartition("/")
  return f"{module}[{','.join(map(str, index))}]/{operand}"


def rows(shares: Mapping) -> dict[str, list[float]]:
  """``{"layer/path/operand": [saturated, flushed]}`` as floats, from the counters of a step (``kernel_health``,
  ``flatten_sown``, ``grad_shares``): one row per layer of a scanned stack, none where nothing was counted."""
  out = {}
  for name, (saturated, flushed) in shares.items():
    saturated, flushed = np.asarray(saturated), np.asarray(flushed)
    for index in np.ndindex(saturated.shape):
      if not np.isnan(saturated[index]):
        out[_per_layer(name, index)] = [float(saturated[index]), float(flushed[index])]
  return out


def latest_amaxes(variables: Mapping) -> dict[str, float]:
  """``{"layer/path/{prefix}{x,kernel,grad}": amax}``: each delayed-scaling operand's most recent amax (element 0 of
  its history; under ``nn.scan``, per layer, named as ``rows`` names them)."""
  out = {}
  for path, history in _flat(variables.get(te_jax.FP8_COLLECTION, {})):
    if path[-1].endswith("_amax_history"):
      latest = np.asarray(history)[..., 0]
      name = "/".join(path[:-1] + (path[-1][:-len("_amax_history")],))
      out.update({_per_layer(name, index): float(latest[index]) for index in np.ndindex(latest.shape)})
  return out
