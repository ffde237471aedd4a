"""LayerNorm and RMSNorm over the last dim: forward (high-precision or FP8 output) and backward.

Forward, per row of ``x`` (every dim but the last is a row dim), in float32:

- statistics: LayerNorm ``mean = sum(x) / n``, ``var = sum((x - mean)^2) / n``; RMSNorm ``var = sum(x^2) / n``;
  ``rsigma = rsqrt(var + epsilon)``;
- the normalized row: ``g = gamma + 1`` under ``zero_centered_gamma`` (gamma stored as gamma - 1; ``norm_fwd`` and
  ``norm_bwd`` add the 1 in float32, and the primitives and references take ``g``), else ``gamma``; LayerNorm
  ``y = fma((x - mean) * rsigma, g, beta)``, RMSNorm ``y = (x * rsigma) * g``;
- the output: ``y`` rounded to bfloat16/float16/float32, or FP8 exactly as ``te_jax.ops.quantize.quantize`` casts ``y``:
  ``y * scale`` cast saturating, ``amax = max|y|`` of the float32 ``y`` (not of a rounded copy), and optionally the
  transposed FP8 copy ``(hidden, *rows)`` that the weight-gradient GEMM of a following dense layer reads;
- ``mean`` (LayerNorm only) and ``rsigma``, float32 per row, for the backward pass.

Backward, with ``xhat = (x - mean) * rsigma`` (RMSNorm ``x * rsigma``) and ``dy = dz * g``:
``dx = ((dy - mean(dy)) - xhat * mean(dy * xhat)) * rsigma`` (RMSNorm without the ``mean(dy)`` term),
``dgamma = sum over rows of dz * xhat``, ``dbeta = sum over rows of dz``, float32. An optional ``dres`` (the gradient
``x`` gets by another path, e.g. a residual connection) is added to ``dx`` in float32 before its rounding, saving the
separate add's pass over memory. The CUDA kernel sums dgamma and
dbeta in a fixed order (per-row-block partials, then a column sum), so every run gives the same bits.

The statistics and the backward reductions are sums whose order the reference leaves to XLA: the kernels agree with
it within float32 summation error. The CUDA forward computes LayerNorm's variance in one pass, ``sum(x^2) / n -
mean^2``, for rows with ``|mean| <= sigma / 8``, where that form's rounding error is the two-pass form's (both
within a few units of float32 roundoff of float64), and the reference's two-pass form for the other rows. Given the
statistics, the rest is elementwise and bitwise the same everywhere: ``y`` (with the one fused multiply-add above,
which is what XLA compiles ``t * g + beta`` to), its cast, amax and the transposed copy.

Range: a row whose statistics leave float32's range (a sum of squares past 3.4e38, |x| from about 1e19 / sqrt(n)) is
outside that agreement. The reference and the CUDA forward, whose sums are float32, get rsigma 0 there: LayerNorm
gives beta and RMSNorm 0, or NaN throughout where the row's sum overflows too; the CPU handler, whose sums are float64,
still normalizes such rows while |x| < 2^125. An inf or NaN in ``x`` gives NaN at its position on every path (in
LayerNorm, the whole row).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.dtypes import HP_DTYPES
from te_jax._core.manual_axes import to_common_varying
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval, sequential_batcher
from te_jax._core.quantized_tensor import QuantizedTensor
from te_jax._core.explicit import typed_vjp
from te_jax.ops.quantize import FP8_DTYPES, QuantizeConfig, per_tensor, quantize_ref

__all__ = ["check_norm_args", "layernorm", "norm_bwd", "norm_bwd_ref", "norm_fwd", "norm_fwd_ref", "NORM_TYPES",
    "NormConfig", "NormOutput"]

NORM_TYPES = ("layernorm", "rmsnorm")
_F32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """Static parameters of one normalization call.

  Attributes:
    norm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance before the reciprocal square root (forward only).
    out_dtype: the forward output dtype: float32, bfloat16, float16, float8_e4m3fn or float8_e5m2.
    transpose: the forward also returns the transposed FP8 copy, shape ``(hidden, *rows)`` (FP8 outputs only).
    dres: the backward takes a gradient to add to dx (backward only).
  """

  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  out_dtype: np.dtype = _F32
  transpose: bool = False
  dres: bool = False

  @property
  def rms(self) -> bool:
    return self.norm_type == "rmsnorm"

  @property
  def fp8(self) -> bool:
    return jnp.dtype(self.out_dtype) in FP8_DTYPES


class NormOutput(NamedTuple):
  """What ``norm_fwd`` returns; fields that do not apply are None.

  Attributes:
    out: the normalized tensor, ``x``'s shape: a ``QuantizedTensor`` for an FP8 output (its transposed copy
      ``(hidden, *rows)`` when asked for), else an array in the output dtype.
    amax: ``max|y|`` of the float32 normalized tensor, FP8 outputs only.
    mean: the float32 row means, shape ``x.shape[:-1]``, LayerNorm only.
    rsigma: the float32 reciprocal standard deviations (RMSNorm: reciprocal root mean squares), ``x.shape[:-1]``.
  """

  out: QuantizedTensor | jax.Array
  amax: jax.Array | None
  mean: jax.Array | None
  rsigma: jax.Array


# ---- reference ---------------------------------------------------------------------------------------------------


def norm_stats_ref(x: jax.Array, *, config: NormConfig) -> tuple[jax.Array | None, jax.Array]:
  """``(mean, rsigma)`` of each row in float32; mean is None for RMSNorm."""
  xf = x.astype(jnp.float32)
  if config.rms:
    return None, jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + jnp.float32(config.epsilon))
  mean = jnp.mean(xf, axis=-1)
  d = xf - mean[..., None]
  return mean, jax.lax.rsqrt(jnp.mean(d * d, axis=-1) + jnp.float32(config.epsilon))


def norm_apply_ref(x, mean, rsigma, gamma, beta, *, config: NormConfig) -> jax.Array:
  """The float32 normalized tensor ``y`` from given statistics and the factor ``gamma`` (``g`` above): the
  elementwise part, bitwise what the kernels do.

  LayerNorm's ``t * g + beta`` compiles to one fused multiply-add on XLA's CPU and GPU backends (they contract it),
  and the kernels compute exactly that, ``fma(t, g, beta)``; tests check the contraction against an exact one.
  """
  xf = x.astype(jnp.float32)
  g = gamma.astype(jnp.float32)
  if config.rms:
    return (xf * rsigma[..., None]) * g
  return ((xf - mean[..., None]) * rsigma[..., None]) * g + beta.astype(jnp.float32)


def norm_fwd_ref(x, gamma, scale, *beta, config: NormConfig) -> list[jax.Array]:
  """The pure-jnp forward: ``[out, (out_t, amax if FP8), (mean if LayerNorm), rsigma]``.

  ``scale`` multiplies ``y`` before an FP8 cast (``quantize_ref``'s semantics exactly); it is unused for
  high-precision outputs. ``beta`` is given for LayerNorm only.
  """
  mean, rsigma = norm_stats_ref(x, config=config)
  y = norm_apply_ref(x, mean, rsigma, gamma, beta[0] if beta else None, config=config)
  if config.fp8:
    outs = quantize_ref(y, scale, config=QuantizeConfig(out_dtype=config.out_dtype, transpose=config.transpose))
  else:
    outs = [y.astype(config.out_dtype)]
  return outs + ([] if config.rms else [mean]) + [rsigma]


def norm_bwd_ref(dz, x, rsigma, gamma, *rest, config: NormConfig) -> list[jax.Array]:
  """The pure-jnp backward: ``[dx (x's dtype), dgamma (float32), dbeta (float32, LayerNorm only)]``.

  ``rest`` is ``mean`` (LayerNorm only), then ``dres`` (``config.dres`` only).
  """
  mean, dres = _bwd_rest(rest, config)
  xf, dzf = x.astype(jnp.float32), dz.astype(jnp.float32)
  r = rsigma[..., None]
  xhat = xf * r if config.rms else (xf - mean[..., None]) * r
  dy = dzf * gamma.astype(jnp.float32)
  c2 = jnp.mean(dy * xhat, axis=-1, keepdims=True)
  if config.rms:
    dx = (dy - xhat * c2) * r
  else:
    dx = ((dy - jnp.mean(dy, axis=-1, keepdims=True)) - xhat * c2) * r
  if dres is not None:
    dx = dx + dres.astype(jnp.float32)
  rows = tuple(range(x.ndim - 1))
  outs = [dx.astype(x.dtype), jnp.sum(dzf * xhat, axis=rows)]
  return outs if config.rms else outs + [jnp.sum(dzf, axis=rows)]


# ---- helpers shared by the primitives ----------------------------------------------------------------------------


def _bwd_rest(rest, config: NormConfig):
  """(mean or None, dres or None) from the backward's operands after gamma."""
  rest = list(rest)
  mean = None if config.rms else rest.pop(0)
  return mean, (rest.pop(0) if config.dres else None)


def _attributes(config: NormConfig) -> dict:
  return {"rmsnorm": np.bool_(config.rms), "epsilon": np.float32(config.epsilon)}


def _bwd_attributes(config: NormConfig) -> dict:
  return {"rmsnorm": np.bool_(config.rms)}


def _gamma_factor(gamma: jax.Array, hidden: int, zero_centered_gamma: bool) -> jax.Array:
  """The float32 factor the ops multiply by: ``gamma + 1`` under ``zero_centered_gamma`` (one float32 add, the same
  bits wherever it runs), else ``gamma``."""
  g = _check_param(gamma, "gamma", hidden).astype(jnp.float32)
  return g + jnp.float32(1.0) if zero_centered_gamma else g


def _empty(dtype) -> jax.core.ShapedArray:
  return jax.core.ShapedArray((0,), dtype)


def _row_dims(ndim: int) -> list[str]:
  return [f"r{i}" for i in range(ndim - 1)]


# ---- forward primitive -------------------------------------------------------------------------------------------


def _fwd_abstract_eval(x, gamma, scale, *beta, config: NormConfig):
  del gamma, scale, beta
  rows = x.shape[:-1]
  outs = [output_aval(x, x.shape, config.out_dtype)]
  if config.transpose:
    outs.append(output_aval(x, (x.shape[-1], *rows), config.out_dtype))
  if config.fp8:
    outs.append(output_aval(x, (), jnp.float32))
  if not config.rms:
    outs.append(output_aval(x, rows, jnp.float32))
  outs.append(output_aval(x, rows, jnp.float32))
  return outs


def _fwd_native_signature(platform: str, config: NormConfig, avals_in, avals_out) -> NativeSignature:
  """The handlers take (x, gamma, scale, beta) and return (out, out_t, amax, mean, rsigma), those that do not apply
  empty: RMSNorm gets an empty beta and returns an empty mean."""
  del platform, avals_in
  rest = list(avals_out)
  out = rest.pop(0)
  out_t = rest.pop(0) if config.transpose else _empty(config.out_dtype)
  amax = rest.pop(0) if config.fp8 else _empty(jnp.float32)
  mean = _empty(jnp.float32) if config.rms else rest.pop(0)
  rsigma = rest.pop(0)
  keep = [0] + ([1] if config.transpose else []) + ([2] if config.fp8 else []) + ([] if config.rms else [3]) + [4]
  extra = (np.zeros((0,), np.float32),) if config.rms else ()
  return NativeSignature(extra_operands=extra, result_avals=[out, out_t, amax, mean, rsigma], keep=keep)


def _row_shardings(mesh, arg_shape):
  """(row spec, x-shaped sharding with the hidden dim gathered, per-row sharding, replicated) for an operand of
  ``arg_shape``'s sharding: the norms keep rows sharded as given and need whole rows."""
  row_spec = full_spec(arg_shape.sharding, len(arg_shape.shape))[:-1]
  return (row_spec, NamedSharding(mesh, P(*row_spec, None)), NamedSharding(mesh, P(*row_spec)),
          NamedSharding(mesh, P()))


def _fwd_partition(config: NormConfig, mesh, arg_shapes, result_shape):
  """Rows stay sharded as given; the hidden dim is gathered (statistics need whole rows); amax is max-reduced."""
  del result_shape
  row_spec, x_sharding, rows, replicated = _row_shardings(mesh, arg_shapes[0])
  out_shardings = [x_sharding]
  if config.transpose:
    out_shardings.append(NamedSharding(mesh, P(None, *row_spec)))
  if config.fp8:
    out_shardings.append(replicated)
  out_shardings += [rows] * (1 if config.rms else 2)
  arg_shardings = [x_sharding, replicated, replicated] + ([] if config.rms else [replicated])
  row_axes = mesh_axes(*row_spec)

  def lower_fn(x, gamma, scale, *beta):
    outs = list(_NORM_FWD.inner.bind(x, gamma, scale, *beta, config=config))
    if config.fp8 and row_axes:  # every shard must use the same scale next step
      i_amax = 2 if config.transpose else 1
      outs[i_amax] = jax.lax.pmax(outs[i_amax], row_axes)
    return tuple(outs)

  return mesh, lower_fn, tuple(out_shardings), tuple(arg_shardings)


def _fwd_sharding_rule(config: NormConfig, mesh, value_types, result_types):
  del mesh, result_types
  rows = _row_dims(len(value_types[0].shape))
  x = " ".join([*rows, "h"])
  operands = [x, "h", ""] + ([] if config.rms else ["h"])
  results = [x]
  if config.transpose:
    results.append(" ".join(["h", *rows]))
  if config.fp8:
    results.append("")
  results += [" ".join(rows)] * (1 if config.rms else 2)
  return f"{', '.join(operands)} -> {', '.join(results)}", {"need_replication_factors": ("h",)}


def _fwd_batcher(args, dims, *, config: NormConfig):
  """vmap: a batched ``x`` is more rows, so one call over the stacked input when the parameters are shared.

  FP8 outputs run once per element instead: amax is per element, and the transposed copy would put the batch dim
  after the hidden dim.
  """
  x_dim, *param_dims = dims
  if config.fp8 or x_dim is None or any(d is not None for d in param_dims):
    return sequential_batcher(_NORM_FWD)(args, dims, config=config)
  x = jnp.moveaxis(args[0], x_dim, 0)
  outs = list(_NORM_FWD.bind(x, *args[1:], config=config))
  return outs, [0] * len(outs)


_NORM_FWD = define_op(
    "norm_fwd",
    abstract_eval=_fwd_abstract_eval,
    reference=norm_fwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    native_signature=_fwd_native_signature,
    partition=_fwd_partition,
    sharding_rule=_fwd_sharding_rule,
    batcher=_fwd_batcher,
)


# ---- backward primitive ------------------------------------------------------------------------------------------


def _bwd_abstract_eval(dz, x, rsigma, gamma, *rest, config: NormConfig):
  del dz, rsigma, rest
  outs = [output_aval(x, x.shape, x.dtype), output_aval(x, gamma.shape, jnp.float32)]
  return outs if config.rms else outs + [output_aval(x, gamma.shape, jnp.float32)]


def _bwd_native_signature(platform: str, config: NormConfig, avals_in, avals_out) -> NativeSignature:
  """The handlers take (dz, x, rsigma, gamma, mean, dres) and return (dx, dgamma, dbeta), RMSNorm's mean and dbeta
  empty, dres empty when not given; the CUDA one also returns its workspace: the float32 dgamma (and dbeta) partials
  of each row block (one per worker of the kernel, sized by the module)."""
  x = avals_in[1]
  results = list(avals_out) + ([_empty(jnp.float32)] if config.rms else [])
  if platform == "cuda":
    results.append(native.workspace(platform, "norm_bwd", x.shape, config.rms))
  given, order, extra = 4, [0, 1, 2, 3], []  # dz, x, rsigma, gamma, then mean and dres where given
  for present, dtype in ((not config.rms, np.float32), (config.dres, x.dtype)):
    if present:
      order.append(given)
      given += 1
    else:
      order.append(len(avals_in) + len(extra))
      extra.append(np.zeros((0,), dtype))
  keep = [0, 1] if config.rms else [0, 1, 2]
  return NativeSignature(extra_operands=extra, result_avals=results, keep=keep, operand_order=order)


def _bwd_partition(config: NormConfig, mesh, arg_shapes, result_shape):
  """Rows stay sharded as dz's are; the hidden dim is gathered; dgamma and dbeta are summed over the row shards."""
  del result_shape
  row_spec, x_sharding, rows, replicated = _row_shardings(mesh, arg_shapes[0])
  arg_shardings = ([x_sharding, x_sharding, rows, replicated] + ([] if config.rms else [rows]) +
                   ([x_sharding] if config.dres else []))
  out_shardings = [x_sharding] + [replicated] * (1 if config.rms else 2)
  row_axes = mesh_axes(*row_spec)

  def lower_fn(dz, x, rsigma, gamma, *rest):
    dx, *params = _NORM_BWD.inner.bind(dz, x, rsigma, gamma, *rest, config=config)
    if row_axes:  # one all-reduce for both parameter gradients
      params = jax.lax.psum(tuple(params), row_axes)
    return (dx, *params)

  return mesh, lower_fn, tuple(out_shardings), tuple(arg_shardings)


def _bwd_sharding_rule(config: NormConfig, mesh, value_types, result_types):
  del mesh, result_types
  rows = _row_dims(len(value_types[0].shape))
  x = " ".join([*rows, "h"])
  r = " ".join(rows)
  operands = [x, x, r, "h"] + ([] if config.rms else [r]) + ([x] if config.dres else [])
  results = [x, "h"] + ([] if config.rms else ["h"])
  return f"{', '.join(operands)} -> {', '.join(results)}", {"need_replication_factors": ("h",)}


_NORM_BWD = define_op(
    "norm_bwd",
    abstract_eval=_bwd_abstract_eval,
    reference=norm_bwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_bwd_attributes,
    native_signature=_bwd_native_signature,
    partition=_bwd_partition,
    sharding_rule=_bwd_sharding_rule,
)  # vmap: sequential (the default), since dgamma and dbeta are per-element sums over rows


# ---- public API --------------------------------------------------------------------------------------------------


def _check_x(x, name: str) -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in HP_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(x.dtype).name}")
  if x.ndim == 0 or x.shape[-1] == 0:
    raise ValueError(f"{name} must have rank >= 1 and a non-empty last dim, got shape {x.shape}")
  return x


def _check_param(p, name: str, hidden: int) -> jax.Array:
  if not hasattr(p, "dtype") or not hasattr(p, "shape"):
    p = jnp.asarray(p)
  if not jnp.issubdtype(p.dtype, jnp.floating) or jnp.dtype(p.dtype) in FP8_DTYPES:
    raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got {jnp.dtype(p.dtype).name}")
  if p.shape != (hidden,):
    raise ValueError(f"{name} must have shape ({hidden},) (x's last dim), got {p.shape}")
  return p


def _check_stats(s, name: str, rows: tuple[int, ...]) -> jax.Array:
  if not hasattr(s, "dtype") or jnp.dtype(s.dtype) != _F32 or tuple(s.shape) != rows:
    raise TypeError(f"{name} must be float32 with shape {rows} (x.shape[:-1]), got "
                    f"{getattr(s, 'dtype', type(s).__name__)} {getattr(s, 'shape', '')}")
  return s


def check_norm_args(norm_type: str, epsilon) -> None:
  if norm_type not in NORM_TYPES:
    raise ValueError(f"norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
  if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating)) or not epsilon >= 0:
    raise ValueError(f"epsilon must be a non-negative Python float, got {epsilon!r}")


def _check_beta(beta, norm_type: str, hidden: int):
  if norm_type == "rmsnorm":
    if beta is not None:
      raise ValueError("beta must be None for norm_type='rmsnorm' (RMSNorm has no bias)")
    return ()
  if beta is None:
    raise ValueError("norm_type='layernorm' needs beta (pass zeros for no bias)")
  return (_check_param(beta, "beta", hidden).astype(jnp.float32),)


def norm_fwd(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    dtype=None,
    scale: jax.Array | float | None = None,
    transpose: bool = False,
) -> NormOutput:
  """Normalizes each row of ``x`` (its last dim) and returns the output with the statistics for the backward pass.

  With an FP8 ``dtype`` the output is cast as ``te_jax.ops.quantize.quantize`` would cast the float32 normalized tensor
  ``y`` (``y * scale``, saturating), with ``amax = max|y|``, all in the same pass over ``x``.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([[1.0, 2.0, 3.0, 6.0]], jnp.bfloat16)
  >>> out = te_jax.ops.norm.norm_fwd(x, jnp.ones(4), jnp.zeros(4), dtype=jnp.float8_e4m3fn, scale=1.0)
  >>> out.out.data.astype(jnp.float32).tolist(), float(out.mean[0]), round(float(out.amax), 3)
  ([[-1.125, -0.5625, 0.0, 1.625]], 3.0, 1.604)

  Args:
    x: float32, bfloat16 or float16, rank >= 1; the last dim is normalized.
    gamma: ``(hidden,)`` scale (gamma - 1 under ``zero_centered_gamma``), any float dtype; used in float32.
    beta: ``(hidden,)`` bias for LayerNorm (required), None for RMSNorm; used in float32.
    norm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance before the reciprocal square root.
    zero_centered_gamma: the op multiplies by ``gamma + 1``.
    dtype: the output dtype: float32, bfloat16, float16 (default: ``x``'s), or float8_e4m3fn / float8_e5m2.
    scale: float32 scalar multiplying ``y`` before an FP8 cast; required for FP8 outputs and only for them.
    transpose: also return the transposed FP8 copy ``(hidden, *rows)`` (FP8 outputs, rank >= 2).

  Returns:
    ``NormOutput(out, amax, mean, rsigma)``.
  """
  x = _check_x(x, "x")
  hidden = x.shape[-1]
  check_norm_args(norm_type, epsilon)
  gamma = _gamma_factor(gamma, hidden, bool(zero_centered_gamma))
  beta = _check_beta(beta, norm_type, hidden)
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  fp8 = out_dtype in FP8_DTYPES
  if not fp8 and out_dtype not in HP_DTYPES:
    raise ValueError(f"dtype must be float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, got {out_dtype}")
  if fp8:
    if scale is None:
      raise ValueError(f"dtype {out_dtype.name} needs scale (the float32 scale of the FP8 cast)")
    if isinstance(scale, float):
      scale = jnp.float32(scale)
    if not hasattr(scale, "dtype") or jnp.dtype(scale.dtype) != _F32 or jnp.shape(scale) != ():
      raise TypeError(f"scale must be a float32 scalar, got {getattr(scale, 'dtype', type(scale).__name__)}")
  elif scale is not None:
    raise ValueError(f"scale applies to FP8 outputs only; dtype is {out_dtype.name}")
  if transpose and (not fp8 or x.ndim < 2):
    raise ValueError(f"transpose=True needs an FP8 dtype and x of rank >= 2, got {out_dtype.name}, {x.shape}")
  config = NormConfig(norm_type, float(epsilon), out_dtype, bool(transpose))
  scale = scale if fp8 else jnp.float32(1.0)  # the handlers take a scale operand; only FP8 casts read it
  outs = list(_NORM_FWD.bind(x, gamma, scale, *beta, config=config))
  out = outs.pop(0)
  out_t = outs.pop(0) if transpose else None
  amax = outs.pop(0) if fp8 else None
  mean = None if config.rms else outs.pop(0)
  return NormOutput(per_tensor(out, out_t, scale) if fp8 else out, amax, mean, outs.pop(0))


def norm_bwd(
    dz: jax.Array,
    x: jax.Array,
    mean: jax.Array | None,
    rsigma: jax.Array,
    gamma: jax.Array,
    *,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    dres: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The gradients of ``norm_fwd``'s output with respect to ``x``, gamma and beta, given its statistics.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([[1.0, 2.0, 3.0, 6.0]])
  >>> fwd = te_jax.ops.norm.norm_fwd(x, jnp.ones(4), jnp.zeros(4))
  >>> dx, dgamma, dbeta = te_jax.ops.norm.norm_bwd(jnp.ones_like(x), x, fwd.mean, fwd.rsigma, jnp.ones(4))
  >>> [round(float(v), 5) for v in dx[0]], dbeta.tolist()
  ([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])

  Args:
    dz: the output gradient, ``x``'s shape, in ``x``'s dtype or float32 (a wider output's gradient loses nothing).
    x: the forward input.
    mean: the forward's row means (LayerNorm), None for RMSNorm.
    rsigma: the forward's reciprocal standard deviations.
    gamma: the forward's gamma (gamma - 1 under ``zero_centered_gamma``).
    norm_type: "layernorm" or "rmsnorm".
    zero_centered_gamma: as in the forward.
    dres: optional, ``x``'s shape and dtype: a gradient of ``x`` from another path (a residual connection), added to
      dx in float32 before dx is rounded to ``x``'s dtype.

  Returns:
    ``(dx, dgamma, dbeta)``: dx in ``x``'s dtype; dgamma and dbeta float32 ``(hidden,)``; dbeta None for RMSNorm.
  """
  x = _check_x(x, "x")
  dz = _check_x(dz, "dz")
  if dz.shape != x.shape or dz.dtype not in (x.dtype, _F32):
    raise TypeError(f"dz must have x's shape {x.shape} and x's dtype ({x.dtype}) or float32, got {dz.shape} "
                    f"{dz.dtype}")
  check_norm_args(norm_type, 0.0)
  if dres is not None and (not hasattr(dres, "dtype") or dres.shape != x.shape or dres.dtype != x.dtype):
    raise TypeError(f"dres must have x's shape {x.shape} and dtype {x.dtype}, got "
                    f"{getattr(dres, 'shape', type(dres).__name__)} {getattr(dres, 'dtype', '')}")
  config = NormConfig(norm_type, dres=dres is not None)
  rows = tuple(x.shape[:-1])
  rsigma = _check_stats(rsigma, "rsigma", rows)
  gamma = _gamma_factor(gamma, x.shape[-1], bool(zero_centered_gamma))
  if config.rms:
    if mean is not None:
      raise ValueError("mean must be None for norm_type='rmsnorm'")
    extra = ()
  else:
    extra = (_check_stats(mean, "mean", rows),)
  extra += () if dres is None else (dres,)
  outs = list(_NORM_BWD.bind(dz, x, rsigma, gamma, *extra, config=config))
  return outs[0], outs[1], None if config.rms else outs[2]


# ---- differentiable layernorm: norm_fwd and norm_bwd as one custom_vjp -------------------------------------------




@dataclasses.dataclass(frozen=True)
class _Config:
  norm: NormConfig  # its out_dtype is the output dtype
  zero_centered_gamma: bool
  beta_dtype: jnp.dtype | None  # dbeta's dtype; None: RMSNorm, no beta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm(cfg: _Config, x, gamma, beta):
  return _layernorm_fwd(cfg, x, gamma, beta)[0]


def _layernorm_fwd(cfg: _Config, x, gamma, beta):
  n = cfg.norm
  out = norm_fwd(x, gamma, beta, norm_type=n.norm_type, epsilon=n.epsilon, zero_centered_gamma=cfg.zero_centered_gamma,
                 dtype=n.out_dtype)
  return out.out, (x, gamma, out.mean, out.rsigma)


def _layernorm_bwd(cfg: _Config, residuals, dz):
  x, gamma, mean, rsigma = residuals
  # The kernels take dz in x's dtype or float32: a gradient of any other dtype goes in as float32, exactly.
  dz = dz if dz.dtype in (x.dtype, jnp.float32) else dz.astype(jnp.float32)
  dx, dgamma, dbeta = norm_bwd(dz, x, mean, rsigma, gamma, norm_type=cfg.norm.norm_type,
                               zero_centered_gamma=cfg.zero_centered_gamma)
  return dx, dgamma.astype(gamma.dtype), None if cfg.beta_dtype is None else dbeta.astype(cfg.beta_dtype)


_layernorm.defvjp(*typed_vjp(_layernorm_fwd, _layernorm_bwd, nondiff_argnums=(0,)))


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    dtype=None,
) -> jax.Array:
  """LayerNorm (``(x - mean) * rsigma * gamma + beta``) or RMSNorm (``x * rsigma * gamma``) over the last dim.

  Statistics and arithmetic in float32 whatever the input and parameter dtypes; gradients come back in the dtype of
  what they differentiate.

  >>> import jax, jax.numpy as jnp, te_jax
  >>> x = jnp.array([[1.0, 2.0, 3.0, 6.0]])
  >>> [round(float(v), 4) for v in te_jax.layernorm(x, jnp.ones(4), jnp.zeros(4))[0]]
  [-1.069, -0.5345, 0.0, 1.6036]
  >>> jax.grad(lambda g: te_jax.layernorm(x, g, norm_type="rmsnorm").sum())(jnp.ones(4)).shape
  (4,)

  Args:
    x: float32, bfloat16 or float16, rank >= 1.
    gamma: ``(hidden,)`` scale; stored as gamma - 1 under ``zero_centered_gamma``.
    beta: ``(hidden,)`` bias, required for LayerNorm; None for RMSNorm.
    norm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance before the reciprocal square root.
    zero_centered_gamma: multiply by ``gamma + 1`` (so a zero-initialized gamma is the identity scale).
    dtype: the output dtype, float32, bfloat16 or float16 (default: ``x``'s). The statistics come from ``x`` as
      given, not from ``x`` rounded to ``dtype``.

  Returns:
    The normalized ``x``, in ``dtype``.
  """
  x = jnp.asarray(x) if not hasattr(x, "dtype") else x
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  if out_dtype not in HP_DTYPES:
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {out_dtype.name}")
  check_norm_args(norm_type, epsilon)
  norm = NormConfig(norm_type, float(epsilon), out_dtype)
  beta_dtype = None if beta is None else jnp.dtype(jnp.asarray(beta).dtype)
  # norm_fwd checks the arrays while tracing
  x, gamma, beta = to_common_varying(x, gamma, beta)  # inside shard_map: as jax's own ops would
  return _layernorm(_Config(norm, bool(zero_centered_gamma), beta_dtype), x, gamma, beta)
