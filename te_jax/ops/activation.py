"""Activations with the FP8 cast fused: forward ``act(x)`` and backward ``g * act'(x)``, each in one pass.

Activations: ``gelu`` (tanh approximation), ``relu``, ``silu``, ``quick_gelu``, ``squared_relu``, and the gated pairs
``(act, "linear")``: ``("silu", "linear")`` is SwiGLU, ``("gelu", "linear")`` GeGLU, ``("relu", "linear")`` ReGLU
(``quick_gelu`` and ``squared_relu`` pair the same way).

Gated layout: the input is ``(..., 2, N)``, the activated half first (``x[..., 0, :]``), the linear half second; the
output is ``(..., N)``. It is the layout of Transformer Engine's LayerNormMLP (its fc1 kernel is ``(K, 2, N)``), and
it keeps each shard whole when the hidden dim ``N`` is sharded: with a flat ``(..., 2N)`` layout, sharding the last
dim would give one device only activated values and another only linear ones. In memory the two layouts are the
same bytes, so a ``(..., 2N)`` array is ``reshape``d for free.

Math, in float32 whatever the input dtype (``z`` and ``s`` below are the kernels' names too)::

  gelu(x)         = x * s,  s = sigmoid(z), z = x * (C1 + C2 * (x * x))   (= 0.5 x (1 + tanh(z / 2)), exactly)
  silu(x)         = x * s,  s = sigmoid(x)
  quick_gelu(x)   = x * s,  s = sigmoid(1.702 * x)
  relu(x)         = 0 where x <= 0, else x            (NaN stays NaN; -0 gives +0)
  squared_relu(x) = relu(x) * relu(x)
  sigmoid(z)      = 1 / (1 + exp(-z))
  gated: y = act(a) * b,  dx_a = (g * b) * act'(a),  dx_b = g * act(a)

with ``C1 = 2 sqrt(2/pi)``, ``C2 = C1 * 0.044715``, and the derivatives ``act'(x) = s + (x * (s * (1 - s))) * z'(x)``
(``z' = C1 + 3 C2 x^2``, ``1`` for silu, ``1.702`` for quick_gelu), ``relu(x) + relu(x)`` for squared_relu; relu's
gradient is a select, ``g`` where ``x > 0`` and +0 elsewhere (XLA turns ``g * (x > 0)`` into that select too). gelu
is written with the sigmoid rather than tanh: one transcendental (``exp``) for every activation and its derivative.

Bitwise agreement: each formula above is a sequence of float32 operations, each rounded once, in the order written;
``activation_fwd_ref`` / ``activation_bwd_ref`` spell them out in jnp. XLA on a GPU computes exactly these
operations (it does not contract a multiply and an add into an FMA, its ``exp`` is libdevice's ``expf`` and its
``1 / d`` is ``rcp.approx.f32``, which the CUDA kernels use too), so the CUDA handlers are bitwise equal to the
reference there. XLA on a CPU uses its own ``exp`` and contracts multiply-adds, so the CPU handler, which computes the
same formulas with the C library's ``expf`` and IEEE division, agrees with the reference bitwise only for relu and
squared_relu (plain or gated) and within a few float32 roundings for the others.

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
    "ActivationConfig", "ACTIVATIONS", "parse_activation_type"]

#: Activation names, in the order of their integer codes in the FFI handlers.
ACTIVATIONS = ("gelu", "relu", "silu", "quick_gelu", "squared_relu")

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
    activation: one of ``ACTIVATIONS``.
    gated: the ``(activation, "linear")`` pair: the (pre-activation) input is ``(..., 2, N)``.
    out_dtype: float8_e4m3fn or float8_e5m2 (with amax), or float32, bfloat16, float16.
    transpose: also produce the transposed FP8 copy.
    batch_ndim: leading dims kept in front in the transposed copy; the feature dims (``N``, or ``(2, N)`` for a
      gated gradient) move in front of the other leading dims.
    dbias: (backward only) also produce the float32 column sums of ``dx``.
  """

  activation: str
  gated: bool
  out_dtype: np.dtype
  transpose: bool = False
  batch_ndim: int = 0
  dbias: bool = False

  @property
  def fp8(self) -> bool:
    return jnp.dtype(self.out_dtype) in FP8_DTYPES

  def transposed_axes(self, ndim: int, feature_ndim: int) -> tuple[int, ...]:
    b, lead = self.batch_ndim, ndim - feature_ndim
    return (*range(b), *range(lead, ndim), *range(b, lead))


# ---- reference ---------------------------------------------------------------------------------------------------


def _sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def _act(x, name: str):
  """act(x) of float32 ``x``, and the sigmoid ``s`` its derivative reuses (None for relu and squared_relu)."""
  if name == "gelu":
    s = _sigmoid(x * (_GELU_C1 + _GELU_C2 * (x * x)))
    return x * s, s
  if name == "silu":
    s = _sigmoid(x)
    return x * s, s
  if name == "quick_gelu":
    s = _sigmoid(_QUICK_GELU_K * x)
    return x * s, s
  r = jnp.where(x <= 0, jnp.float32(0), x)
  return (r, None) if name == "relu" else (r * r, None)


def _times_dact(gg, x, name: str):
  """``gg * act'(x)`` of float32 ``gg`` and ``x``: the incoming gradient times the activation's derivative."""
  if name == "relu":
    return jnp.where(x > 0, gg, jnp.float32(0))  # a select, not gg * 0: +0 (not -0) where x <= 0
  if name == "squared_relu":
    r = jnp.where(x <= 0, jnp.float32(0), x)
    return gg * (r + r)
  s = _act(x, name)[1]
  t = x * (s * (1.0 - s))
  if name == "gelu":
    t = t * (_GELU_C1 + _GELU_C3 * (x * x))
  elif name == "quick_gelu":
    t = t * _QUICK_GELU_K
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
    y = _act(xf[..., 0, :], config.activation)[0] * xf[..., 1, :]
  else:
    y = _act(xf, config.activation)[0]
  return _outputs(y, scale, config, 1, dbias=False)


def activation_bwd_ref(g: jax.Array, x: jax.Array, scale: jax.Array, *, config: ActivationConfig) -> list[jax.Array]:
  """The pure-jnp backward: ``dx = g * act'(x)`` (both halves when gated), cast like the forward output."""
  gf, xf = g.astype(jnp.float32), x.astype(jnp.float32)
  if config.gated:
    a, b = xf[..., 0, :], xf[..., 1, :]
    dx = jnp.stack([_times_dact(gf * b, a, config.activation), gf * _act(a, config.activation)[0]], axis=-2)
  else:
    dx = _times_dact(gf, xf, config.activation)
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
      "act": np.int64(ACTIVATIONS.index(config.activation)),
      "gated": np.bool_(config.gated),
      "batch_ndim": np.int64(config.batch_ndim),
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


def parse_activation_type(activation_type) -> tuple[str, bool]:
  """``("gelu",)`` -> ("gelu", False); ``("silu", "linear")`` -> ("silu", True); a bare name is taken as a 1-tuple.

  Raises:
    ValueError: naming ``activation_type``, for anything else.
  """
  names = (activation_type,) if isinstance(activation_type, str) else activation_type
  try:
    names = tuple(names)
  except TypeError:
    names = None
  ok = names is not None and all(isinstance(n, str) for n in names) and (
      (len(names) == 1 and names[0] in ACTIVATIONS) or
      (len(names) == 2 and names[0] in ACTIVATIONS and names[1] == "linear"))
  if not ok:
    raise ValueError(f"activation_type must be (act,) or (act, 'linear') with act in {ACTIVATIONS}, "
                     f"got {activation_type!r}")
  return names[0], len(names) == 2


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


def _config(activation_type, dtype, default_dtype, scale, transpose, transpose_batch_dims, lead_ndim: int,
            dbias: bool = False) -> tuple[ActivationConfig, jax.Array]:
  name, gated = parse_activation_type(activation_type)
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
  config = ActivationConfig(activation=name, gated=gated, out_dtype=out_dtype, transpose=bool(transpose),
                            batch_ndim=batch_ndim, dbias=bool(dbias))
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
) -> CastOutput:
  """``act(x)`` (``act(x[..., 0, :]) * x[..., 1, :]`` when gated), computed in float32, cast in the same pass.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-1.0, 0.0, 2.0, 1000.0]], jnp.bfloat16)
  >>> te_jax.ops.activation.activation_fwd(x, ("relu",)).out.tolist()
  [[0.0, 0.0, 2.0, 1000.0]]
  >>> out = te_jax.ops.activation.activation_fwd(x, ("relu",), dtype=jnp.float8_e4m3fn, scale=1.0, transpose=True)
  >>> out.out.data.astype(jnp.float32).tolist(), out.out.data_t.shape, float(out.amax)
  ([[0.0, 0.0, 2.0, 448.0]], (4, 1), 1000.0)

  Args:
    x: float32, bfloat16 or float16; ``(..., N)``, or ``(..., 2, N)`` for a gated pair (activated half first).
    activation_type: ``(act,)`` or ``(act, "linear")``, ``act`` one of ``ACTIVATIONS``.
    dtype: the output dtype: ``x.dtype`` by default; float32, bfloat16, float16, or an FP8 dtype (then ``scale``
      is required and ``amax`` is returned).
    scale: float32 scalar multiplying the float32 activation before the FP8 cast.
    transpose: also make the transposed FP8 copy (``out.data_t``; FP8 only).
    transpose_batch_dims: leading dims kept in front in ``data_t`` (default: all but the last leading dim, so the
      last two dims of a 2-D output swap); 0 moves the features in front of every leading dim.

  Returns:
    ``CastOutput(out, amax, None)``: ``out`` is ``(..., N)``, a ``QuantizedTensor`` for an FP8 ``dtype`` (with
    amax), else an array.
  """
  _, gated = parse_activation_type(activation_type)
  x = _check_array(x, "x", 2 if gated else 1)
  _check_gated(x, gated, "x")
  lead_ndim = x.ndim - (2 if gated else 1)
  config, scale = _config(activation_type, dtype, x.dtype, scale, transpose, transpose_batch_dims, lead_ndim)
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

  Returns:
    ``CastOutput(dx, amax, dbias)``, ``dx`` shaped like ``x`` (a ``QuantizedTensor`` for an FP8 ``dtype``);
    fields not asked for are None.
  """
  _, gated = parse_activation_type(activation_type)
  x = _check_array(x, "x", 2 if gated else 1)
  g = _check_array(g, "g", 1)
  _check_gated(x, gated, "x")
  want = x.shape[:-2] + x.shape[-1:] if gated else x.shape
  if g.shape != want:
    raise ValueError(f"g must have the activation output's shape {want} for x of shape {x.shape}, got {g.shape}")
  if g.dtype != x.dtype:
    raise TypeError(f"g must have x's dtype {jnp.dtype(x.dtype).name}, got {jnp.dtype(g.dtype).name}")
  lead_ndim = x.ndim - (2 if gated else 1)
  config, scale = _config(activation_type, dtype, g.dtype, scale, transpose, transpose_batch_dims, lead_ndim,
                          dbias=dbias)
  return _result(_ACT_BWD.bind(g, x, scale, config=config), config, scale, dbias=bool(dbias))


# ---- differentiable activation: activation_fwd and activation_bwd as one custom_vjp ------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(x, activation_type):
  return activation_fwd(x, activation_type).out


def _activation_fwd(x, activation_type):
  return activation_fwd(x, activation_type).out, x


def _activation_bwd(activation_type, x, g):
  return (activation_bwd(g.astype(x.dtype), x, activation_type).out,)


_activation.defvjp(*typed_vjp(_activation_fwd, _activation_bwd, nondiff_argnums=(1,)))


def activation(x: jax.Array, activation_type=("gelu",)) -> jax.Array:
  """``act(x)``, or ``act(x[..., 0, :]) * x[..., 1, :]`` for a gated pair, in ``x``'s dtype (float32 math inside).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> x = jnp.array([[-2.0, 0.5], [3.0, 4.0]], jnp.float32)
  >>> te_jax.activation(x, ("relu",)).tolist()
  [[0.0, 0.5], [3.0, 4.0]]
  >>> te_jax.activation(x.reshape(1, 2, 2), ("relu", "linear")).tolist()  # ReGLU: relu(x[0]) * x[1]
  [[0.0, 2.0]]
  >>> jax.grad(lambda x: te_jax.activation(x, ("relu",)).sum())(x).tolist()
  [[0.0, 1.0], [1.0, 1.0]]

  Args:
    x: float32, bfloat16 or float16; ``(..., N)``, or ``(..., 2, N)`` for a gated pair (activated half first).
    activation_type: ``(act,)`` or ``(act, "linear")`` with ``act`` one of ``te_jax.ops.activation.ACTIVATIONS``:
      ``("silu", "linear")`` is SwiGLU, ``("gelu", "linear")`` GeGLU, ``("relu", "linear")`` ReGLU.

  Returns:
    ``(..., N)`` in ``x``'s dtype.
  """
  names = parse_activation_type(activation_type)
  normalized = (names[0], "linear") if names[1] else (names[0],)
  return _activation(x, normalized)
