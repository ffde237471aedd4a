"""Activations with the FP8 cast fused: forward ``act(x)`` and backward ``g * act'(x)``, each in one pass.

Activations (``ACTIVATIONS``): ``gelu`` (tanh approximation), ``relu``, ``silu``, ``quick_gelu``, ``squared_relu``,
``sigmoid``. Pairs (``ACTIVATION_TYPES`` lists every accepted form), the two halves of the input activated and
multiplied, as Transformer Engine's LayerNormMLP takes them:

- ``(act, "linear")``: GLU variants with a linear second half. ``("silu", "linear")`` is SwiGLU, ``("gelu",
  "linear")`` GeGLU, ``("relu", "linear")`` ReGLU, ``("sigmoid", "linear")`` GLU, ``("linear", "linear")`` the
  bilinear layer. ``("linear", act)`` means the same (the activated half still first), as in Transformer Engine,
  which reverses a pair whose first name is ``"linear"``.
- ``(act, act)``: both halves activated, ``act(a) * act(b)`` (``("relu", "relu")``, ``("gelu", "gelu")``, ...).
- ``("clamped_silu", "clamped_linear")``: the clamped SwiGLU of GPT-OSS, with ``activation_params`` ``limit``
  (7.0), ``alpha`` (1.702) and ``glu_linear_offset`` (1.0), Transformer Engine's names and defaults.

Gated layout: the input is ``(..., 2, N)``, the first half of the pair (``x[..., 0, :]``, ``a`` below) first, the
second (``b``) second; the output is ``(..., N)``. It is the layout of Transformer Engine's LayerNormMLP (its fc1
kernel is ``(K, 2, N)``), and it keeps each shard whole when the hidden dim ``N`` is sharded: with a flat
``(..., 2N)`` layout, sharding the last dim would give one device only first halves and another only second ones.
In memory the two layouts are the same bytes, so a ``(..., 2N)`` array is ``reshape``d for free.

Math, in float32 whatever the input dtype (``z`` and ``s`` below are the kernels' names too)::

  gelu(x)           = x * s,  s = sigmoid(z), z = x * (C1 + C2 * (x * x))   (= 0.5 x (1 + tanh(z / 2)), exactly)
  silu(x)           = x * s,  s = sigmoid(x)
  quick_gelu(x)     = x * s,  s = sigmoid(1.702 * x)
  sigmoid(x)        = s,      s = sigmoid(x)
  relu(x)           = 0 where x <= 0, else x            (NaN stays NaN; -0 gives +0)
  squared_relu(x)   = relu(x) * relu(x)
  linear(x)         = x
  clamped_silu(x)   = c * s,  s = sigmoid(alpha * c), c = limit where x > limit, else x      (NaN stays NaN)
  clamped_linear(x) = c + glu_linear_offset,  c = x clamped to [-limit, limit]             (NaN stays NaN)
  sigmoid(z)        = 1 / (1 + exp(-z))
  pair: y = f(a) * h(b),  dx_a = (g * h(b)) * f'(a),  dx_b = (g * f(a)) * h'(b)

with ``C1 = 2 sqrt(2/pi)``, ``C2 = C1 * 0.044715``, and the derivatives ``act'(x) = s + (x * (s * (1 - s))) * z'(x)``
(``z' = C1 + 3 C2 x^2``, ``1`` for silu, ``1.702`` for quick_gelu, ``alpha`` for clamped_silu, with ``c`` for
``x``), ``s * (1 - s)`` for sigmoid, ``relu(x) + relu(x)`` for squared_relu. ``gg * act'(x)`` is ``gg`` itself for
linear, and a select giving +0 where the derivative is zero: relu's where ``x <= 0``, clamped_silu's where
``x > limit``, clamped_linear's outside ``[-limit, limit]`` (at ``|x| == limit`` the gradient passes, as in
Transformer Engine's kernels). gelu is written with the sigmoid rather than tanh: one transcendental (``exp``) for
every activation and its derivative.

Bitwise agreement: each formula above is a sequence of float32 operations, each rounded once, in the order written;
``activation_fwd_ref`` / ``activation_bwd_ref`` spell them out in jnp. XLA on a GPU computes exactly these
operations (it does not contract a multiply and an add into an FMA, its ``exp`` is libdevice's ``expf`` and its
``1 / d`` is ``rcp.approx.f32``, which the CUDA kernels use too), so the CUDA handlers are bitwise equal to the
reference there. XLA on a CPU uses its own ``exp`` and contracts multiply-adds, so the CPU handler, which computes the
same formulas with the C library's ``expf`` and IEEE division, agrees with the reference bitwise only for the forms
without ``exp`` (relu, squared_relu and linear halves) and within a few float32 roundings for the others.

Outputs: either the high-precision result (float32, bfloat16 or float16), or its FP8 cast exactly as
``te_jax.ops.quantize.quantize`` makes it from the float32 result: ``data`` (saturating cast of ``y * scale``),
``amax`` (max |y| over the float32 result, on bit patterns), optional ``data_t`` (the transposed copy the next GEMM's
weight gradient needs) and, in the backward pass, optional ``dbias`` (float32 column sums of ``dx``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.dtypes import HP_DTYPES
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval
from te_jax._core.explicit import typed_vjp
from te_jax.ops.quantize import FP8_DTYPES, CastOutput, amax_f32, per_tensor, saturating_cast

__all__ = ["activation", "activation_bwd", "activation_bwd_ref", "activation_fwd", "activation_fwd_ref",
    "ActivationConfig", "ACTIVATIONS", "ACTIVATION_TYPES", "CLAMPED_SWIGLU_DEFAULTS", "normalize_activation_type",
    "parse_activation_type"]

#: Activation names, alone or as either half of a pair.
ACTIVATIONS = ("gelu", "relu", "silu", "quick_gelu", "squared_relu", "sigmoid")
# The integer codes of a half's function in the FFI handlers (ffi/include/te_jax/activation_math.h's Act).
_CODES = (*ACTIVATIONS, "linear", "clamped_silu", "clamped_linear")
_CLAMPED = ("clamped_silu", "clamped_linear")
#: Every ``activation_type`` accepted, in its normal form (``normalize_activation_type``).
ACTIVATION_TYPES = (*((a,) for a in ACTIVATIONS), *((a, "linear") for a in (*ACTIVATIONS, "linear")),
                    *((a, a) for a in ACTIVATIONS), _CLAMPED)
#: ``activation_params`` of ``("clamped_silu", "clamped_linear")``: Transformer Engine's names and defaults (GPT-OSS's
#: values).
CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}

# gelu: z = x * (C1 + C2 * x^2) = 2 * sqrt(2/pi) * (x + 0.044715 x^3); z' = C1 + C3 * x^2. float32 constants, the
# same bits as in ffi/include/te_jax/activation_math.h.
_GELU_C1 = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_C2 = np.float32(2.0 * math.sqrt(2.0 / math.pi) * 0.044715)
_GELU_C3 = np.float32(3.0 * 2.0 * math.sqrt(2.0 / math.pi) * 0.044715)
_QUICK_GELU_K = np.float32(1.702)


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
  """Static parameters of one activation call (forward or backward).

  Attributes:
    activation: one of ``ACTIVATIONS``, or a pair's first half (also ``"linear"``, ``"clamped_silu"``).
    gated: a pair ``(activation, gate)``: the (pre-activation) input is ``(..., 2, N)``.
    out_dtype: float8_e4m3fn or float8_e5m2 (with amax), or float32, bfloat16, float16.
    transpose: also produce the transposed FP8 copy.
    batch_ndim: leading dims kept in front in the transposed copy; the feature dims (``N``, or ``(2, N)`` for a
      gated gradient) move in front of the other leading dims.
    dbias: (backward only) also produce the float32 column sums of ``dx``.
    gate: a pair's second half: ``"linear"``, ``activation`` itself, or ``"clamped_linear"``.
    limit, alpha, glu_linear_offset: clamped SwiGLU's parameters (float32 values; unused by the other forms).
  """

  activation: str
  gated: bool
  out_dtype: np.dtype
  transpose: bool = False
  batch_ndim: int = 0
  dbias: bool = False
  gate: str = "linear"
  limit: float = CLAMPED_SWIGLU_DEFAULTS["limit"]
  alpha: float = CLAMPED_SWIGLU_DEFAULTS["alpha"]
  glu_linear_offset: float = CLAMPED_SWIGLU_DEFAULTS["glu_linear_offset"]

  @property
  def fp8(self) -> bool:
    return jnp.dtype(self.out_dtype) in FP8_DTYPES

  def transposed_axes(self, ndim: int, feature_ndim: int) -> tuple[int, ...]:
    b, lead = self.batch_ndim, ndim - feature_ndim
    return (*range(b), *range(lead, ndim), *range(b, lead))


# ---- reference ---------------------------------------------------------------------------------------------------


def _sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def _clamp_above(x, c: ActivationConfig):
  """``min(x, limit)`` as a select: NaN stays NaN."""
  limit = np.float32(c.limit)
  return jnp.where(x > limit, limit, x)


def _act(x, name: str, c: ActivationConfig):
  """act(x) of float32 ``x``, and the sigmoid ``s`` its derivative reuses (None where there is none)."""
  if name == "gelu":
    s = _sigmoid(x * (_GELU_C1 + _GELU_C2 * (x * x)))
    return x * s, s
  if name == "silu":
    s = _sigmoid(x)
    return x * s, s
  if name == "quick_gelu":
    s = _sigmoid(_QUICK_GELU_K * x)
    return x * s, s
  if name == "sigmoid":
    s = _sigmoid(x)
    return s, s
  if name == "clamped_silu":
    xc = _clamp_above(x, c)
    s = _sigmoid(np.float32(c.alpha) * xc)
    return xc * s, s
  if name == "linear":
    return x, None
  if name == "clamped_linear":
    limit = np.float32(c.limit)
    xc = jnp.where(x < -limit, -limit, _clamp_above(x, c))
    return xc + np.float32(c.glu_linear_offset), None
  r = jnp.where(x <= 0, jnp.float32(0), x)
  return (r, None) if name == "relu" else (r * r, None)


def _times_dact(gg, x, name: str, c: ActivationConfig):
  """``gg * act'(x)`` of float32 ``gg`` and ``x``: the incoming gradient times the activation's derivative."""
  zero = jnp.float32(0)
  if name == "relu":
    return jnp.where(x > 0, gg, zero)  # a select, not gg * 0: +0 (not -0) where x <= 0
  if name == "squared_relu":
    r = jnp.where(x <= 0, zero, x)
    return gg * (r + r)
  if name == "linear":
    return gg
  if name == "clamped_linear":
    limit = np.float32(c.limit)
    return jnp.where((x > limit) | (x < -limit), zero, gg)
  s = _act(x, name, c)[1]
  if name == "sigmoid":
    return gg * (s * (1.0 - s))
  xc = _clamp_above(x, c) if name == "clamped_silu" else x
  t = xc * (s * (1.0 - s))
  if name == "gelu":
    t = t * (_GELU_C1 + _GELU_C3 * (x * x))
  elif name == "quick_gelu":
    t = t * _QUICK_GELU_K
  elif name == "clamped_silu":
    return jnp.where(x > np.float32(c.limit), zero, gg * (s + t * np.float32(c.alpha)))
  return gg * (s + t)


def _outputs(y, scale, config: ActivationConfig, feature_ndim: int, dbias: bool) -> list[jax.Array]:
  """The cast of float32 ``y``: ``te_jax.ops.quantize.quantize``'s outputs for an FP8 ``out_dtype``, else ``y`` cast."""
  if not config.fp8:
    outs = [y.astype(config.out_dtype)]
  else:
    q = saturating_cast(y, scale, config.out_dtype)
    outs = [q]
    if config.transpose:
      outs.append(jnp.transpose(q, config.transposed_axes(y.ndim, feature_ndim)))
    outs.append(amax_f32(y))
  if dbias:
    outs.append(jnp.sum(y, axis=tuple(range(y.ndim - feature_ndim))))
  return outs


def activation_fwd_ref(x: jax.Array, scale: jax.Array, *, config: ActivationConfig) -> list[jax.Array]:
  """The pure-jnp forward: the CPU fallback, the test oracle and the documentation of the kernels."""
  xf = x.astype(jnp.float32)
  if config.gated:
    y = _act(xf[..., 0, :], config.activation, config)[0] * _act(xf[..., 1, :], config.gate, config)[0]
  else:
    y = _act(xf, config.activation, config)[0]
  return _outputs(y, scale, config, 1, dbias=False)


def activation_bwd_ref(g: jax.Array, x: jax.Array, scale: jax.Array, *, config: ActivationConfig) -> list[jax.Array]:
  """The pure-jnp backward: ``dx = g * act'(x)`` (both halves when gated), cast like the forward output."""
  gf, xf = g.astype(jnp.float32), x.astype(jnp.float32)
  f, h, c = config.activation, config.gate, config
  if config.gated:
    a, b = xf[..., 0, :], xf[..., 1, :]
    dx = jnp.stack([_times_dact(gf * _act(b, h, c)[0], a, f, c), _times_dact(gf * _act(a, f, c)[0], b, h, c)],
                   axis=-2)
  else:
    dx = _times_dact(gf, xf, f, c)
  return _outputs(dx, scale, config, 2 if config.gated else 1, dbias=config.dbias)


# ---- primitives --------------------------------------------------------------------------------------------------


def _cast_avals(like, shape, feature_ndim: int, config: ActivationConfig, dbias: bool):
  def aval(s, dtype):
    return output_aval(like, s, dtype)

  outs = [aval(shape, config.out_dtype)]
  if config.fp8:
    if config.transpose:
      outs.append(aval(tuple(shape[i] for i in config.transposed_axes(len(shape), feature_ndim)), config.out_dtype))
    outs.append(aval((), jnp.float32))
  if dbias:
    outs.append(aval(tuple(shape[len(shape) - feature_ndim:]), jnp.float32))
  return outs


def _fwd_abstract_eval(x, scale, *, config: ActivationConfig):
  del scale
  shape = x.shape[:-2] + x.shape[-1:] if config.gated else x.shape
  return _cast_avals(x, shape, 1, config, dbias=False)


def _bwd_abstract_eval(g, x, scale, *, config: ActivationConfig):
  del g, scale
  return _cast_avals(x, x.shape, 2 if config.gated else 1, config, dbias=config.dbias)


def _signature(platform: str, config: ActivationConfig, x, avals_out, *, backward: bool) -> NativeSignature:
  """The handlers return (out, out_t, amax) forward and (dx, dx_t, amax, dbias, [workspace]) backward, the ones not
  asked for empty; the CUDA backward one also returns its dbias workspace for the input ``x``: column partials, one
  row per row tile, then completion counters, sized by the module."""
  out_dtype = config.out_dtype
  empty_out = jax.core.ShapedArray((0,), out_dtype)
  empty_f32 = jax.core.ShapedArray((0,), jnp.float32)
  rest = list(avals_out)
  out = rest.pop(0)
  out_t = rest.pop(0) if config.fp8 and config.transpose else empty_out
  amax = rest.pop(0) if config.fp8 else jax.core.ShapedArray((), jnp.float32)
  results = [out, out_t, amax]
  keep = [0] + ([1] if config.fp8 and config.transpose else []) + ([2] if config.fp8 else [])
  if backward:
    dbias = rest.pop(0) if config.dbias else empty_f32
    results.append(dbias)
    keep += [3] if config.dbias else []
    if platform == "cuda":
      results.append(native.workspace(platform, "act_bwd", x.shape, config.gated, config.batch_ndim) if config.dbias
                     else empty_f32)
  return NativeSignature(extra_operands=(), result_avals=results, keep=keep)


def _fwd_signature(platform, config, avals_in, avals_out):
  return _signature(platform, config, avals_in[0], avals_out, backward=False)


def _bwd_signature(platform, config, avals_in, avals_out):
  return _signature(platform, config, avals_in[1], avals_out, backward=True)


def _attributes(config: ActivationConfig) -> dict:
  return {
      "act": np.int64(_CODES.index(config.activation)),
      "gated": np.bool_(config.gated),
      "batch_ndim": np.int64(config.batch_ndim),
      "gate": np.int64(_CODES.index(config.gate)),
      "limit": np.float32(config.limit),
      "alpha": np.float32(config.alpha),
      "glu_linear_offset": np.float32(config.glu_linear_offset),
  }


# ---- sharding ----------------------------------------------------------------------------------------------------


def _cast_shardings(mesh, out_spec, feature_ndim: int, config: ActivationConfig, dbias: bool) -> list:
  out = [NamedSharding(mesh, P(*out_spec))]
  if config.fp8:
    if config.transpose:
      axes = config.transposed_axes(len(out_spec), feature_ndim)
      out.append(NamedSharding(mesh, P(*(out_spec[i] for i in axes))))
    out.append(NamedSharding(mesh, P()))
  if dbias:
    out.append(NamedSharding(mesh, P(*out_spec[len(out_spec) - feature_ndim:])))
  return out


def _reduce(outs: list, config: ActivationConfig, spec, feature_ndim: int, dbias: bool) -> tuple:
  """amax max-reduced over every sharded dim (every shard must use the same scale next step); dbias summed over the
  sharded leading dims."""
  outs = list(outs)
  amax_axes = mesh_axes(*spec)
  if config.fp8 and amax_axes:
    i = 2 if config.transpose else 1
    outs[i] = jax.lax.pmax(outs[i], amax_axes)
  sum_axes = mesh_axes(*spec[:len(spec) - feature_ndim])
  if dbias and sum_axes:
    outs[-1] = jax.lax.psum(outs[-1], sum_axes)
  return tuple(outs)


def _input_and_output_specs(config: ActivationConfig, x_shape) -> tuple[tuple, tuple]:
  """The partition specs of the pre-activation input, as ``x_shape`` is sharded but with a gated pair's axis of
  (..., 2, N) replicated (it pairs the halves), and of the activation's output (that axis dropped)."""
  spec = full_spec(x_shape.sharding, len(x_shape.shape))
  if not config.gated:
    return spec, spec
  spec = spec[:-2] + (None, spec[-1])
  return spec, spec[:-2] + spec[-1:]


def _fwd_partition(config: ActivationConfig, mesh, arg_shapes, result_shape):
  """Elementwise: every dim of x may stay sharded except the gate dim of (..., 2, N), which pairs the halves."""
  del result_shape
  spec, out_spec = _input_and_output_specs(config, arg_shapes[0])
  x_sharding = NamedSharding(mesh, P(*spec))
  out_shardings = _cast_shardings(mesh, out_spec, 1, config, dbias=False)

  def lower_fn(x, scale):
    outs = _ACT_FWD.inner.bind(x, scale, config=config)
    return _reduce(outs, config, out_spec, 1, dbias=False)

  return mesh, lower_fn, tuple(out_shardings), (x_sharding, NamedSharding(mesh, P()))


def _bwd_partition(config: ActivationConfig, mesh, arg_shapes, result_shape):
  """x's sharding (gate dim replicated) decides; g follows it."""
  del result_shape
  spec, g_spec = _input_and_output_specs(config, arg_shapes[1])
  feature_ndim = 2 if config.gated else 1
  out_shardings = _cast_shardings(mesh, spec, feature_ndim, config, dbias=config.dbias)

  def lower_fn(g, x, scale):
    outs = _ACT_BWD.inner.bind(g, x, scale, config=config)
    return _reduce(outs, config, spec, feature_ndim, dbias=config.dbias)

  arg_shardings = (NamedSharding(mesh, P(*g_spec)), NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P()))
  return mesh, lower_fn, tuple(out_shardings), arg_shardings


def _cast_rule(dims: list[str], feature_ndim: int, config: ActivationConfig, dbias: bool) -> list[str]:
  results = [" ".join(dims)]
  if config.fp8:
    if config.transpose:
      results.append(" ".join(dims[i] for i in config.transposed_axes(len(dims), feature_ndim)))
    results.append("")
  if dbias:
    results.append(" ".join(dims[len(dims) - feature_ndim:]))
  return results


def _gated_dims(ndim: int, gated: bool) -> tuple[list[str], list[str]]:
  """Factor names of the pre-activation input (a gated pair's axis is "k", never sharded) and of the output."""
  dims = [f"d{i}" for i in range(ndim)]
  if not gated:
    return dims, dims
  dims[-2] = "k"
  return dims, dims[:-2] + dims[-1:]


def _fwd_sharding_rule(config: ActivationConfig, mesh, value_types, result_types):
  del mesh, result_types
  dims, out = _gated_dims(len(value_types[0].shape), config.gated)
  rule = f"{' '.join(dims)}, -> {', '.join(_cast_rule(out, 1, config, dbias=False))}"
  return rule, dict(need_replication_factors=("k",) if config.gated else ())


def _bwd_sharding_rule(config: ActivationConfig, mesh, value_types, result_types):
  del mesh, result_types
  dims, g = _gated_dims(len(value_types[1].shape), config.gated)
  results = _cast_rule(dims, 2 if config.gated else 1, config, dbias=config.dbias)
  rule = f"{' '.join(g)}, {' '.join(dims)}, -> {', '.join(results)}"
  return rule, dict(need_replication_factors=("k",) if config.gated else ())


# The default vmap rule (one call per batch element) is the right one: amax and dbias are reductions over each
# element's whole input.
_ACT_FWD = define_op(
    "act_fwd",
    abstract_eval=_fwd_abstract_eval,
    reference=activation_fwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    native_signature=_fwd_signature,
    partition=_fwd_partition,
    sharding_rule=_fwd_sharding_rule,
)

_ACT_BWD = define_op(
    "act_bwd",
    abstract_eval=_bwd_abstract_eval,
    reference=activation_bwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    native_signature=_bwd_signature,
    partition=_bwd_partition,
    sharding_rule=_bwd_sharding_rule,
)


# ---- public API --------------------------------------------------------------------------------------------------


def _names(activation_type) -> tuple | None:
  names = (activation_type,) if isinstance(activation_type, str) else activation_type
  try:
    names = tuple(names)
  except TypeError:
    return None
  # Transformer Engine reverses a pair whose first name is the linear half: the activated half stays first.
  if len(names) == 2 and names[0] in ("linear", "clamped_linear") and names[1] != names[0]:
    names = names[::-1]
  return names if names in ACTIVATION_TYPES else None


def normalize_activation_type(activation_type) -> tuple[str, ...]:
  """The normal form of ``activation_type``, one of ``ACTIVATION_TYPES``: a bare name is a 1-tuple, ``("linear",
  act)`` is ``(act, "linear")`` (and ``("clamped_linear", "clamped_silu")`` the clamped pair).

  >>> from te_jax.ops.activation import normalize_activation_type
  >>> normalize_activation_type("gelu"), normalize_activation_type(["linear", "silu"])
  (('gelu',), ('silu', 'linear'))

  Raises:
    ValueError: naming ``activation_type`` and the accepted forms, for anything else.
  """
  names = _names(activation_type)
  if names is None:
    raise ValueError(f"activation_type must be (act,), (act, 'linear') or (act, act) with act in {ACTIVATIONS}, "
                     f"('linear', 'linear') or {_CLAMPED} (te_jax.ops.activation.ACTIVATION_TYPES), "
                     f"got {activation_type!r}")
  return names


def parse_activation_type(activation_type) -> tuple[str, bool]:
  """``("gelu",)`` -> ("gelu", False); ``("silu", "linear")`` -> ("silu", True); a bare name is taken as a 1-tuple.
  For the callers that take only an activation and its GLU form ``(act, "linear")``; ``normalize_activation_type``
  takes every form.

  Raises:
    ValueError: naming ``activation_type``, for anything else (a pair with both halves activated or clamped too:
      the caller has no use for its second half's function).
  """
  names = normalize_activation_type(activation_type)
  if len(names) == 2 and names[1] != "linear":
    raise ValueError(f"activation_type must be (act,) or (act, 'linear') here, got {activation_type!r}: a pair "
                     "whose second half is activated or clamped needs te_jax.activation or LayerNormMLP")
  return names[0], len(names) == 2


def _params(names: tuple[str, ...], activation_params) -> tuple[float, float, float]:
  """``(limit, alpha, glu_linear_offset)`` as float32 values: ``activation_params`` over the defaults."""
  given = {} if activation_params is None else activation_params
  if not hasattr(given, "items"):
    raise TypeError(f"activation_params must be a dict or None, got {type(given).__name__}")
  if given and names != _CLAMPED:
    raise ValueError(f"activation_params apply to activation_type={_CLAMPED} only, got {dict(given)!r} for "
                     f"{names}")
  params = dict(CLAMPED_SWIGLU_DEFAULTS)
  for key, value in given.items():
    if key not in params:
      raise ValueError(f"activation_params: unknown key {key!r}; {_CLAMPED} takes {tuple(params)}")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
      raise TypeError(f"activation_params[{key!r}] must be a real number, got {value!r}")
    params[key] = float(np.float32(value))
  limit, alpha, offset = params["limit"], params["alpha"], params["glu_linear_offset"]
  if not limit > 0:
    raise ValueError(f"activation_params['limit'] must be > 0 (the clamp range is [-limit, limit]), got {limit!r}")
  for key in ("alpha", "glu_linear_offset"):
    if not math.isfinite(params[key]):
      raise ValueError(f"activation_params[{key!r}] must be finite, got {params[key]!r}")
  return limit, alpha, offset


def _check_array(x, name: str, min_ndim: int) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in HP_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(x.dtype).name}")
  if x.ndim < min_ndim:
    raise ValueError(f"{name} must have rank >= {min_ndim}, got shape {x.shape}")
  return x


def _check_gated(x, gated: bool, name: str):
  if gated and x.shape[-2] != 2:
    raise ValueError(f"{name} of a gated activation must be (..., 2, N) (activated half first), got shape {x.shape}")


def _config(names, params, dtype, default_dtype, scale, transpose, transpose_batch_dims, lead_ndim: int,
            dbias: bool = False) -> tuple[ActivationConfig, jax.Array]:
  try:
    out_dtype = jnp.dtype(default_dtype if dtype is None else dtype)
  except TypeError:
    out_dtype = None
  if out_dtype not in (*FP8_DTYPES, *HP_DTYPES):
    raise ValueError(f"dtype must be float8_e4m3fn, float8_e5m2, float32, bfloat16 or float16, got {dtype!r}")
  fp8 = out_dtype in FP8_DTYPES
  if fp8:
    if scale is None:
      raise ValueError("scale is required for an FP8 dtype")
    if isinstance(scale, float):
      scale = jnp.float32(scale)
    if not hasattr(scale, "dtype") or jnp.dtype(scale.dtype) != jnp.float32 or jnp.shape(scale) != ():
      raise TypeError(f"scale must be a float32 scalar, got {getattr(scale, 'dtype', type(scale).__name__)} "
                      f"of shape {jnp.shape(scale)}")
  elif scale is not None or transpose:
    raise ValueError("scale and transpose need an FP8 dtype (float8_e4m3fn or float8_e5m2)")
  else:
    scale = jnp.float32(1.0)  # unused: no cast
  batch_ndim = 0
  if transpose:
    if lead_ndim < 1:
      raise ValueError("transpose=True needs at least one leading (row) dim before the features")
    batch_ndim = lead_ndim - 1 if transpose_batch_dims is None else transpose_batch_dims
    if not 0 <= batch_ndim <= lead_ndim - 1:
      raise ValueError(f"transpose_batch_dims must be in [0, {lead_ndim - 1}], got {batch_ndim}")
  elif transpose_batch_dims is not None:
    raise ValueError("transpose_batch_dims needs transpose=True")
  limit, alpha, offset = params
  config = ActivationConfig(activation=names[0], gated=len(names) == 2, out_dtype=out_dtype,
                            transpose=bool(transpose), batch_ndim=batch_ndim, dbias=bool(dbias),
                            gate=names[1] if len(names) == 2 else "linear", limit=limit, alpha=alpha,
                            glu_linear_offset=offset)
  return config, scale


def _result(outs, config: ActivationConfig, scale, dbias: bool) -> CastOutput:
  outs = list(outs)
  data = outs.pop(0)
  data_t = outs.pop(0) if config.fp8 and config.transpose else None
  amax = outs.pop(0) if config.fp8 else None
  out = per_tensor(data, data_t, scale) if config.fp8 else data
  return CastOutput(out, amax, outs.pop(0) if dbias else None)


def activation_fwd(
    x: jax.Array,
    activation_type=("gelu",),
    *,
    dtype=None,
    scale: jax.Array | float | None = None,
    transpose: bool = False,
    transpose_batch_dims: int | None = None,
    activation_params=None,
) -> CastOutput:
  """``act(x)`` (``f(x[..., 0, :]) * h(x[..., 1, :])`` for a pair ``(f, h)``), in float32, cast in the same pass.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-1.0, 0.0, 2.0, 1000.0]], jnp.bfloat16)
  >>> te_jax.ops.activation.activation_fwd(x, ("relu",)).out.tolist()
  [[0.0, 0.0, 2.0, 1000.0]]
  >>> out = te_jax.ops.activation.activation_fwd(x, ("relu",), dtype=jnp.float8_e4m3fn, scale=1.0, transpose=True)
  >>> out.out.data.astype(jnp.float32).tolist(), out.out.data_t.shape, float(out.amax)
  ([[0.0, 0.0, 2.0, 448.0]], (4, 1), 1000.0)

  Args:
    x: float32, bfloat16 or float16; ``(..., N)``, or ``(..., 2, N)`` for a pair (its first half first).
    activation_type: one of ``ACTIVATION_TYPES`` (``normalize_activation_type``'s forms): ``(act,)``, ``(act,
      "linear")``, ``(act, act)`` with ``act`` one of ``ACTIVATIONS``, ``("linear", "linear")``, ``("clamped_silu",
      "clamped_linear")``.
    dtype: the output dtype: ``x.dtype`` by default; float32, bfloat16, float16, or an FP8 dtype (then ``scale``
      is required and ``amax`` is returned).
    scale: float32 scalar multiplying the float32 activation before the FP8 cast.
    transpose: also make the transposed FP8 copy (``out.data_t``; FP8 only).
    transpose_batch_dims: leading dims kept in front in ``data_t`` (default: all but the last leading dim, so the
      last two dims of a 2-D output swap); 0 moves the features in front of every leading dim.
    activation_params: ``("clamped_silu", "clamped_linear")``'s ``{"limit", "alpha", "glu_linear_offset"}`` (any of
      them; the rest ``CLAMPED_SWIGLU_DEFAULTS``), as Transformer Engine's; None or empty for the other forms.

  Returns:
    ``CastOutput(out, amax, None)``: ``out`` is ``(..., N)``, a ``QuantizedTensor`` for an FP8 ``dtype`` (with
    amax), else an array.
  """
  names = normalize_activation_type(activation_type)
  params = _params(names, activation_params)
  gated = len(names) == 2
  x = _check_array(x, "x", 2 if gated else 1)
  _check_gated(x, gated, "x")
  lead_ndim = x.ndim - (2 if gated else 1)
  config, scale = _config(names, params, dtype, x.dtype, scale, transpose, transpose_batch_dims, lead_ndim)
  return _result(_ACT_FWD.bind(x, scale, config=config), config, scale, dbias=False)


def activation_bwd(
    g: jax.Array,
    x: jax.Array,
    activation_type=("gelu",),
    *,
    dtype=None,
    scale: jax.Array | float | None = None,
    transpose: bool = False,
    transpose_batch_dims: int | None = None,
    dbias: bool = False,
    activation_params=None,
) -> CastOutput:
  """``dx = g * act'(x)`` in float32 (both halves of a gated pair), cast in the same pass; optional dbias.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-1.0, 2.0]], jnp.float32)
  >>> te_jax.ops.activation.activation_bwd(jnp.full((1, 2), 3.0), x, ("relu",), dbias=True).out.tolist()
  [[0.0, 3.0]]

  Args:
    g: the gradient of the activation's output: ``(..., N)``, float32, bfloat16 or float16.
    x: the activation's input (saved by the forward pass): ``(..., N)``, or ``(..., 2, N)`` when gated.
    activation_type: as in ``activation_fwd``.
    dtype: the dtype of ``dx``: ``g.dtype`` by default, or float32, bfloat16, float16, or an FP8 dtype (then
      ``scale`` is required and ``amax`` is returned).
    scale: float32 scalar multiplying ``dx`` before the FP8 cast.
    transpose: also make the transposed FP8 copy of ``dx`` (``out.data_t``): the feature dims (``N``, or ``(2, N)``
      when gated) move in front of the leading dims after the first ``transpose_batch_dims``.
    transpose_batch_dims: as in ``activation_fwd``.
    dbias: also return the float32 column sums of ``dx`` (over the leading dims), shaped like the feature dims.
    activation_params: as in ``activation_fwd``.

  Returns:
    ``CastOutput(dx, amax, dbias)``, ``dx`` shaped like ``x`` (a ``QuantizedTensor`` for an FP8 ``dtype``);
    fields not asked for are None.
  """
  names = normalize_activation_type(activation_type)
  params = _params(names, activation_params)
  gated = len(names) == 2
  x = _check_array(x, "x", 2 if gated else 1)
  g = _check_array(g, "g", 1)
  _check_gated(x, gated, "x")
  want = x.shape[:-2] + x.shape[-1:] if gated else x.shape
  if g.shape != want:
    raise ValueError(f"g must have the activation output's shape {want} for x of shape {x.shape}, got {g.shape}")
  if g.dtype != x.dtype:
    raise TypeError(f"g must have x's dtype {jnp.dtype(x.dtype).name}, got {jnp.dtype(g.dtype).name}")
  lead_ndim = x.ndim - (2 if gated else 1)
  config, scale = _config(names, params, dtype, g.dtype, scale, transpose, transpose_batch_dims, lead_ndim,
                          dbias=dbias)
  return _result(_ACT_BWD.bind(g, x, scale, config=config), config, scale, dbias=bool(dbias))


# ---- differentiable activation: activation_fwd and activation_bwd as one custom_vjp ------------------------------


# The parameters travel as a tuple of (name, value) items: a custom_vjp's static arguments must hash.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(x, activation_type, params):
  return activation_fwd(x, activation_type, activation_params=dict(params)).out


def _activation_fwd(x, activation_type, params):
  return activation_fwd(x, activation_type, activation_params=dict(params)).out, x


def _activation_bwd(activation_type, params, x, g):
  return (activation_bwd(g.astype(x.dtype), x, activation_type, activation_params=dict(params)).out,)


_activation.defvjp(*typed_vjp(_activation_fwd, _activation_bwd, nondiff_argnums=(1, 2)))


def activation(x: jax.Array, activation_type=("gelu",), activation_params=None) -> jax.Array:
  """``act(x)``, or ``f(x[..., 0, :]) * h(x[..., 1, :])`` for a pair ``(f, h)``, in ``x``'s dtype (float32 math
  inside).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-2.0, 0.5], [3.0, 4.0]], jnp.float32)
  >>> te_jax.activation(x, ("relu",)).tolist()
  [[0.0, 0.5], [3.0, 4.0]]
  >>> te_jax.activation(x.reshape(1, 2, 2), ("relu", "linear")).tolist()  # ReGLU: relu(x[0]) * x[1]
  [[0.0, 2.0]]
  >>> te_jax.activation(x.reshape(1, 2, 2), ("relu", "relu")).tolist()  # relu(x[0]) * relu(x[1])
  [[0.0, 2.0]]
  >>> y = te_jax.activation(jnp.array([[[9.0], [-9.0]]]), ("clamped_silu", "clamped_linear"),
  ...                       {"limit": 7.0, "alpha": 1.702})  # silu_alpha(min(9, 7)) * (clip(-9, -7, 7) + 1)
  >>> round(float(y[0, 0]), 2)
  -42.0
  >>> jax.grad(lambda x: te_jax.activation(x, ("relu",)).sum())(x).tolist()
  [[0.0, 1.0], [1.0, 1.0]]

  Args:
    x: float32, bfloat16 or float16; ``(..., N)``, or ``(..., 2, N)`` for a pair (its first half first).
    activation_type: one of ``te_jax.ops.activation.ACTIVATION_TYPES`` (see ``activation_fwd``):
      ``("silu", "linear")`` is SwiGLU, ``("gelu", "linear")`` GeGLU, ``("relu", "linear")`` ReGLU, ``("sigmoid",
      "linear")`` GLU, ``("relu", "relu")`` both halves activated, ``("clamped_silu", "clamped_linear")`` GPT-OSS's
      clamped SwiGLU.
    activation_params: the clamped SwiGLU's ``limit``, ``alpha``, ``glu_linear_offset`` (Transformer Engine's
      names; defaults ``CLAMPED_SWIGLU_DEFAULTS``); None for the other forms.

  Returns:
    ``(..., N)`` in ``x``'s dtype.
  """
  names = normalize_activation_type(activation_type)
  limit, alpha, offset = _params(names, activation_params)
  params = (("limit", limit), ("alpha", alpha), ("glu_linear_offset", offset)) if names == _CLAMPED else ()
  return _activation(x, names, params)
