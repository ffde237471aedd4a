"""te_jax.dense: ``x @ kernel + bias`` with FP8 GEMMs in the forward and backward passes.

- Outside autocast: exactly ``lax.dot_general`` (+ bias) in x's dtype.
- FP8 (DelayedScaling and Float8CurrentScaling, HYBRID and E4M3): values and gradients against a float64 numpy
  reference that applies the same quantization (ml_dtypes casts); on inputs whose quantization is exact, against the
  plain float64 math within float32 accumulation rounding; on generic inputs, within the FP8 quantization bound.
- The gradient of ``fp8_meta`` is the updated delayed-scaling state, bitwise against a hand computation; and over 5
  optimizer steps of a te_flax.DenseGeneral the amax histories and scales follow a hand replay.
- Rows not a multiple of 16 (padded inside), argument errors, FP8 residuals, the custom calls in the compiled HLO.
- On a GPU (``@pytest.mark.gpu``): the CUDA path against the reference path on the CPU.

The numpy helpers at the top are also used by test_flax_dense.py.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from conftest import F32_U
from te_jax.fused import linear
from te_jax.ops.gemm import gemm
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Format, MMParams
from te_jax._core.scaling import ScaleState

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
CPU = jax.devices("cpu")[0]
HISTORY = 4

RECIPES = {
    "delayed-hybrid": DelayedScaling(amax_history_len=HISTORY),
    "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=HISTORY),
    "current-hybrid": Float8CurrentScaling(),
    "current-e4m3": Float8CurrentScaling(fp8_format=Format.E4M3),
}

# (x shape, axis, kernel shape): trailing axis, rows not a multiple of 16, two contracting axes, a non-trailing axis.
FP8_SHAPES = {
    "2d": ((32, 48), -1, (48, 32)),
    "7-rows": ((7, 32), -1, (32, 16)),
    "3x5-rows": ((3, 5, 32), -1, (32, 16)),
    "multi-axis": ((2, 3, 4, 32), (-2, -1), (4, 32, 16)),
    "axis-1": ((3, 32, 5), 1, (32, 16)),
}


# ---- numpy helpers (float64 references and bounds) -----------------------------------------------------------------


def fp8_max(dtype) -> float:
  return float(ml_dtypes.finfo(dtype).max)


def mantissa_bits(dtype) -> int:
  return {jnp.dtype(E4M3): 3, jnp.dtype(E5M2): 2}[jnp.dtype(dtype)]


def min_normal_exp(dtype) -> int:
  return {jnp.dtype(E4M3): -6, jnp.dtype(E5M2): -14}[jnp.dtype(dtype)]


def gamma(n: int) -> float:
  """Higham's gamma_n = n u / (1 - n u) for float32: the bound of n roundings in a row (sums, products)."""
  return n * F32_U / (1 - n * F32_U)


def qdq(v, scale, dtype) -> np.ndarray:
  """What the FP8 path computes with: ``v * scale`` clipped and cast (ml_dtypes, round to nearest even), then
  dequantized exactly in float64 by the float32 ``1/scale`` the GEMM receives."""
  scale = np.float32(scale)
  m = np.float32(fp8_max(dtype))
  q = np.clip(np.asarray(v).astype(np.float32) * scale, -m, m).astype(dtype)
  return q.astype(np.float64) * np.float64(np.float32(1.0) / scale)


def quant_error(v, scale, dtype) -> np.ndarray:
  """Elementwise bound of |qdq(v) - v| without clipping: half an ulp relative (2^-(p+1) for p mantissa bits) for
  normal numbers, half the subnormal spacing (2^(emin-p-1), divided by the scale) below them, plus the float32
  rounding of ``v * scale`` and of the dequantization (2 * 2^-24 relative)."""
  p, emin = mantissa_bits(dtype), min_normal_exp(dtype)
  v = np.abs(np.asarray(v).astype(np.float64))
  # No clipping beyond the float32 rounding of fp8_max / amax (current scaling's scale) times amax.
  assert np.all(v * np.float64(scale) <= fp8_max(dtype) * (1 + 2 * F32_U)), "quant_error assumes no clipping"
  return v * (2.0 ** -(p + 1) + 2 * F32_U) + 2.0 ** (emin - p - 1) / np.float64(scale)


def current_scale(v, dtype) -> np.float32:
  """Float8CurrentScaling's scale: fp8_max / amax, in float32."""
  return np.float32(fp8_max(dtype)) / np.max(np.abs(np.asarray(v).astype(np.float32)))


def to_2d(x, axis):
  """x with the contracting axes last, folded to (M, K), in float64."""
  axis = (axis,) if isinstance(axis, int) else axis
  axes = tuple(a % x.ndim for a in axis)
  rest = tuple(a for a in range(x.ndim) if a not in axes)
  xt = np.transpose(np.asarray(x).astype(np.float64), rest + axes)
  return xt.reshape(-1, math.prod(x.shape[a] for a in axes)), xt.shape[: len(rest)]


def dense_reference(x, kernel, bias, g, axis, scales=None, fmt=None):
  """float64 values and gradients of ``dense``, with the FP8 path's quantization when ``scales`` (x, kernel, g) is
  given. Returns dicts of out, dx, dkernel, dbias (in x's layout) and of their float32 rounding bounds."""
  x2, batch = to_2d(x, axis)
  k2 = np.asarray(kernel).astype(np.float64).reshape(x2.shape[1], -1)
  g2 = np.asarray(g).astype(np.float64).reshape(x2.shape[0], -1)
  if scales is not None:
    sx, sk, sg = scales
    xq, kq, gq = qdq(x2, sx, fmt.fwd_dtype), qdq(k2, sk, fmt.fwd_dtype), qdq(g2, sg, fmt.bwd_dtype)
  else:
    xq, kq, gq = x2, k2, g2
  m, k = x2.shape
  n = k2.shape[1]
  b = np.zeros(n) if bias is None else np.asarray(bias).astype(np.float64).reshape(n)
  out = xq @ kq + b
  dx2 = gq @ kq.T
  dk = xq.T @ gq
  db = g2.sum(axis=0)  # the bias gradient is the column sum of the unquantized gradient
  # Two extra roundings per term in the FP8 path (the float32 dequantization of each operand).
  bounds = {
      "out": gamma(k + 3) * (np.abs(xq) @ np.abs(kq) + np.abs(b)),
      "dx": gamma(n + 2) * (np.abs(gq) @ np.abs(kq).T),
      "dkernel": gamma(m + 2) * (np.abs(xq).T @ np.abs(gq)),
      "dbias": gamma(m) * np.abs(g2).sum(axis=0),
  }
  values = {"out": out, "dx": dx2, "dkernel": dk, "dbias": db}
  return _to_layouts(values, x, kernel, axis, batch), _to_layouts(bounds, x, kernel, axis, batch)


def _to_layouts(d, x, kernel, axis, batch):
  axis = (axis,) if isinstance(axis, int) else axis
  axes = tuple(a % x.ndim for a in axis)
  rest = tuple(a for a in range(x.ndim) if a not in axes)
  features = kernel.shape[len(axes):]
  dx = d["dx"].reshape(*batch, *(x.shape[a] for a in axes))
  return {"out": d["out"].reshape(*batch, *features), "dx": np.transpose(dx, np.argsort(rest + axes)),
          "dkernel": d["dkernel"].reshape(kernel.shape), "dbias": d["dbias"].reshape(features)}


def quantization_bounds(x, kernel, g, axis, scales, fmt, accum_u=0.0):
  """Bounds of |FP8 result - float64 result| from the quantization of x, kernel and g at ``scales``, propagated
  through each GEMM: |a^ b^ - a b| <= e_a |b| + |a^| e_b, summed over the contraction. With ``accum_u``, plus n *
  accum_u * sum|a^||b^| for an accumulator of that unit roundoff over n terms (the FP8 tensor cores')."""
  fwd, bwd = fmt.fwd_dtype, fmt.bwd_dtype
  x2, batch = to_2d(x, axis)
  k2 = np.asarray(kernel).astype(np.float64).reshape(x2.shape[1], -1)
  g2 = np.asarray(g).astype(np.float64).reshape(x2.shape[0], -1)
  ex, ek, eg = (quant_error(v, s, d) for v, s, d in zip((x2, k2, g2), scales, (fwd, fwd, bwd)))
  xq, kq, gq = qdq(x2, scales[0], fwd), qdq(k2, scales[1], fwd), qdq(g2, scales[2], bwd)
  (m, k), n = x2.shape, k2.shape[1]
  bounds = {
      "out": ex @ np.abs(k2) + np.abs(xq) @ ek + k * accum_u * (np.abs(xq) @ np.abs(kq)),
      "dx": eg @ np.abs(k2).T + np.abs(gq) @ ek.T + n * accum_u * (np.abs(gq) @ np.abs(kq).T),
      "dkernel": ex.T @ np.abs(g2) + np.abs(xq).T @ eg + m * accum_u * (np.abs(xq).T @ np.abs(gq)),
      "dbias": np.zeros(n),
  }
  return _to_layouts(bounds, x, kernel, axis, batch)


def assert_within(actual, expected64, bound, what: str):
  actual = np.asarray(actual).astype(np.float64)
  assert actual.shape == expected64.shape, (what, actual.shape, expected64.shape)
  err = np.abs(actual - expected64)
  bound = np.broadcast_to(bound, err.shape)
  bad = np.flatnonzero(err > bound)
  assert bad.size == 0, (f"{what}: {bad.size} of {err.size} over the bound; worst at {bad[np.argmax(err.flat[bad])]}"
                         f": err {err.flat[bad].max():.4g}, bound {bound.flat[bad[np.argmax(err.flat[bad])]]:.4g}")


def grid_values(shape, amax: float, mbits: int, min_exp: int, seed: int) -> np.ndarray:
  """Random values ``+-2^e (1 + j / 2^mbits)`` with ``min_exp <= e < log2(amax)``, one of them set to ``amax``: with
  mbits=3 they are E4M3 numbers, with mbits=2 E5M2 (and E4M3) numbers."""
  rng = np.random.default_rng(seed)
  top = int(np.floor(np.log2(amax)))
  e = rng.integers(min_exp, top, shape)
  j = rng.integers(0, 2**mbits, shape)
  v = rng.choice([-1.0, 1.0], shape) * np.exp2(e) * (1 + j / 2**mbits)
  v.flat[rng.integers(v.size)] = amax
  return v.astype(np.float32)


def exact_inputs(x_shape, kernel_shape, seed: int):
  """x, kernel and an output gradient whose FP8 quantization is exact under every recipe tested here.

  amax = 1.75 * 2^e = fp8_max * 2^-k for both E4M3 (448 = 1.75 * 2^8) and E5M2 (57344 = 1.75 * 2^15), so current
  scaling's scale fp8_max / amax is a power of two, and a grid value times a power of two that stays under fp8_max
  and above the smallest normal is again a grid value. At scale 1 (the initial delayed-scaling state) every value is
  a normal FP8 number already. The gradient is on the E5M2 grid, which the E4M3 grid holds at these magnitudes.
  """
  x = grid_values(x_shape, 28.0, 3, -2, seed)  # E4M3 grid, current scale 16
  kernel = grid_values(kernel_shape, 1.75, 3, -4, seed + 1)  # E4M3 grid, current scale 256
  return x, kernel


def exact_grad(out_shape, seed: int):
  return grid_values(out_shape, 7.0, 2, -3, seed)  # E5M2 grid, current scale 64 (E4M3) or 8192 (E5M2)


def dense_vjp(x, kernel, bias, g, meta, rec, axis, device=CPU):
  """Values and all gradients of te_jax.dense under ``rec``, jitted on ``device``."""
  put = functools.partial(jax.device_put, device=device)

  @jax.jit
  def f(x, kernel, bias, meta, g):
    y, vjp = jax.vjp(lambda x, k, b, m: te_jax.dense(x, k, b, axis=axis, fp8_meta=m), x, kernel, bias, meta)
    return y, vjp(g)

  with te_jax.autocast(enabled=True, recipe=rec):
    y, (dx, dk, db, dmeta) = f(put(x), put(kernel), put(bias), put(meta), put(g))
  return {"out": y, "dx": dx, "dkernel": dk, "dbias": db}, dmeta


def make_meta(scales, histories) -> te_jax.DenseFp8Meta:
  return te_jax.DenseFp8Meta(*(ScaleState(jnp.asarray(h, jnp.float32), jnp.float32(s))
                               for s, h in zip(scales, histories)))


def hand_update(history, new_amax, fp8_dtype, margin=0, algo="max"):
  """Delayed scaling by hand: roll the new amax in at element 0, then fp8_max / (amax * 2^margin) in float32."""
  history = np.concatenate([[np.float32(new_amax)], np.asarray(history, np.float32)[:-1]]).astype(np.float32)
  amax = history.max() if algo == "max" else history[0]
  return history, np.float32(fp8_max(fp8_dtype)) / (np.float32(amax) * np.float32(2.0**margin))


# ---- without autocast ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,axis,kernel_shape", [
    ((4, 32), -1, (32, 16)),
    ((2, 3, 4, 32), (-2, -1), (4, 32, 16)),
    ((3, 32, 5), 1, (32, 16)),
    ((3, 32, 5), (1,), (32, 2, 8)),
], ids=["last", "multi", "axis1", "axis1-2d-features"])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_without_autocast_is_dot_general(x_shape, axis, kernel_shape, x_dtype, with_bias):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape), x_dtype)
  kernel = jnp.asarray(rng.standard_normal(kernel_shape), jnp.float32)
  features = kernel_shape[len(axis) if isinstance(axis, tuple) else 1:]
  bias = jnp.asarray(rng.standard_normal(features), jnp.float32) if with_bias else None
  out = jax.jit(lambda x, k, b: te_jax.dense(x, k, b, axis=axis))(x, kernel, bias)
  axes = tuple(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))
  expected = jax.lax.dot_general(x, kernel.astype(x_dtype), ((axes, tuple(range(len(axes)))), ((), ())))
  if with_bias:
    expected = expected + bias.astype(x_dtype)
  assert out.dtype == x_dtype
  np.testing.assert_array_equal(np.asarray(out).astype(np.float32), np.asarray(expected).astype(np.float32))
  # Anchored independently: float64 math on the operands cast to x's dtype, within the float32 accumulation and two
  # roundings to x's dtype: of the product x @ kernel, then of the sum with the bias.
  cast = lambda a: None if a is None else np.asarray(jnp.asarray(a).astype(x_dtype))
  ref, bound = dense_reference(np.asarray(x), cast(kernel), cast(bias), np.zeros(out.shape), axis)
  product = ref["out"] - (0 if bias is None else cast(bias).astype(np.float64))
  u_out = F32_U if x_dtype == jnp.float32 else 2.0**-8
  rounding = u_out * (np.abs(product) + np.abs(ref["out"]))
  assert_within(out, ref["out"], bound["out"] * (1 + 2 * u_out) + rounding, "out")


# ---- FP8: exact quantization --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("rec", RECIPES)
@pytest.mark.fast_cases(5)
def test_fp8_exact_inputs_equal_float32_math(shape, rec):
  """When the quantization is exact, FP8 dense is the float32 math up to float32 accumulation rounding."""
  x_shape, axis, kernel_shape = FP8_SHAPES[shape]
  x, kernel = exact_inputs(x_shape, kernel_shape, seed=1)
  n_in = 1 if isinstance(axis, int) else len(axis)
  bias = np.random.default_rng(2).standard_normal(kernel_shape[n_in:]).astype(np.float32)
  batch = tuple(d for i, d in enumerate(x_shape) if i not in {a % len(x_shape) for a in np.atleast_1d(axis)})
  g = exact_grad(batch + kernel_shape[n_in:], seed=3)
  meta = te_jax.DenseFp8Meta.create(HISTORY)  # scales 1
  r = RECIPES[rec]
  if isinstance(r, DelayedScaling):
    scales = (1.0, 1.0, 1.0)
  else:
    scales = (current_scale(x, r.fp8_format.fwd_dtype), current_scale(kernel, r.fp8_format.fwd_dtype),
              current_scale(g, r.fp8_format.bwd_dtype))
    assert all(math.log2(s).is_integer() and s > 1 for s in scales)
  ours, _ = dense_vjp(x, kernel, bias, g, meta, r, axis)
  quantized, _ = dense_reference(x, kernel, bias, g, axis, scales, r.fp8_format)
  exact, bounds = dense_reference(x, kernel, bias, g, axis)
  for name in ("out", "dx", "dkernel", "dbias"):
    np.testing.assert_array_equal(quantized[name], exact[name], err_msg=f"{name}: the quantization is not exact")
    assert ours[name].dtype == jnp.float32, name
    assert_within(ours[name], exact[name], bounds[name], name)


# ---- FP8: generic inputs -------------------------------------------------------------------------------------------


def generic_inputs(x_shape, kernel_shape, out_shape, x_dtype, seed):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(x_shape) * np.exp2(rng.uniform(-4, 4, x_shape))).astype(x_dtype)
  kernel = (rng.standard_normal(kernel_shape) / 8).astype(np.float32)
  bias = rng.standard_normal(kernel_shape[-1:]).astype(np.float32)
  g = (rng.standard_normal(out_shape) * 1e-3).astype(x_dtype)
  return x, kernel, bias, g


@pytest.mark.parametrize("rec", RECIPES)
@pytest.mark.parametrize("x_dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", ["2d", "7-rows", "multi-axis"])
@pytest.mark.fast_cases(6)
def test_fp8_generic_inputs(rec, x_dtype, shape):
  """Against the same quantization in float64: float32 accumulation rounding (plus the output's own rounding);
  against the unquantized float64 math: the FP8 quantization bound. And the updated fp8_meta, bitwise."""
  x_shape, axis, kernel_shape = FP8_SHAPES[shape]
  n_in = 1 if isinstance(axis, int) else len(axis)
  out_shape = x_shape[: len(x_shape) - n_in] + kernel_shape[n_in:]
  x, kernel, bias, g = generic_inputs(x_shape, kernel_shape, out_shape, x_dtype, seed=4)
  r = RECIPES[rec]
  fwd, bwd = r.fp8_format.fwd_dtype, r.fp8_format.bwd_dtype
  amaxes = [np.max(np.abs(v.astype(np.float32))) for v in (x, kernel, g)]
  rng = np.random.default_rng(5)
  histories = [rng.uniform(0.5, 2.0, HISTORY).astype(np.float32) * a for a in amaxes]
  if isinstance(r, DelayedScaling):
    # Stale scales with headroom (no clipping), not powers of two: as after a few steps of training.
    scales = [np.float32(fp8_max(d) / (1.7 * a)) for d, a in zip((fwd, fwd, bwd), amaxes)]
  else:
    scales = [current_scale(v, d) for v, d in zip((x, kernel, g), (fwd, fwd, bwd))]
  meta = make_meta(scales if isinstance(r, DelayedScaling) else [1.5, 2.5, 3.5], histories)
  ours, dmeta = dense_vjp(x, kernel, bias, g, meta, r, axis)

  quantized, bounds = dense_reference(x, kernel, bias, g, axis, scales, r.fp8_format)
  exact, _ = dense_reference(x, kernel, bias, g, axis)
  # out and dx are rounded once to x's dtype; the bias is cast to it before the GEMM adds it (as Flax does).
  u_out = F32_U if x_dtype == np.float32 else 2.0**-8
  rounding = {name: (u_out if name in ("out", "dx") else F32_U) * np.abs(quantized[name]) for name in quantized}
  rounding["out"] = rounding["out"] + u_out * np.abs(bias)
  for name in ("out", "dx", "dkernel", "dbias"):
    assert_within(ours[name], quantized[name], bounds[name] * (1 + u_out) + rounding[name], name)

  qbound = quantization_bounds(x, kernel, g, axis, scales, r.fp8_format)
  for name in ("out", "dx", "dkernel", "dbias"):
    total = qbound[name] + bounds[name] * (1 + u_out) + rounding[name]
    assert_within(ours[name], exact[name], total, f"{name} vs unquantized")
  # And the quantization was not a no-op: the FP8 result differs from the float32 one.
  assert np.abs(np.asarray(ours["out"]).astype(np.float64) - exact["out"]).max() > 0

  # fp8_meta's gradient: the updated state under delayed scaling; under current scaling fp8_meta is unused (its
  # scales were set to nonsense above, and the values still match), so its gradient is zero.
  for i, (role, dtype) in enumerate(zip(("x", "kernel", "grad"), (fwd, fwd, bwd))):
    got = getattr(dmeta, role)
    if isinstance(r, DelayedScaling):
      want_h, want_s = hand_update(histories[i], amaxes[i], dtype)
    else:
      want_h, want_s = np.zeros(HISTORY, np.float32), np.float32(0.0)
    np.testing.assert_array_equal(np.asarray(got.amax_history), want_h, err_msg=f"{role} amax_history")
    np.testing.assert_array_equal(np.asarray(got.scale), want_s, err_msg=f"{role} scale")


@pytest.mark.parametrize("margin,algo", [(0, "max"), (2, "most_recent")])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3], ids=["hybrid", "e4m3"])
def test_fp8_meta_gradient_is_the_updated_state(margin, algo, fmt):
  """The amax of the padded rows' x (zeros never raise it), of the kernel and of the output gradient rolled into
  each history; scale = fp8_max / (amax_from_history * 2^margin), bitwise."""
  r = DelayedScaling(margin=margin, fp8_format=fmt, amax_history_len=3, amax_compute_algo=algo)
  x = -np.abs(np.random.default_rng(6).standard_normal((7, 32)).astype(np.float32)) * 3  # amax from a negative
  kernel = np.random.default_rng(7).standard_normal((32, 16)).astype(np.float32)
  g = np.random.default_rng(8).standard_normal((7, 16)).astype(np.float32) * 100
  histories = [np.float32([1e6, 0, 0]), np.float32([0.5, 0.25, 0.125]), np.float32([0, 0, 0])]
  meta = make_meta([1.0, 1.0, 1.0], histories)
  _, dmeta = dense_vjp(x, kernel, None, g, meta, r, -1)
  for role, v, h, dtype in zip(("x", "kernel", "grad"), (x, kernel, g), histories,
                               (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype)):
    want_h, want_s = hand_update(h, np.abs(v).max(), dtype, margin, algo)
    got = getattr(dmeta, role)
    np.testing.assert_array_equal(np.asarray(got.amax_history), want_h, err_msg=role)
    np.testing.assert_array_equal(np.asarray(got.scale), want_s, err_msg=role)
  if algo == "max":  # the old 1e6 still dominates x's history
    assert np.asarray(dmeta.x.scale) == np.float32(448.0) / (np.float32(1e6) * np.float32(2.0**margin))


def test_fp8_padding_matches_unpadded():
  """7 rows (padded to 16 inside) give the rows of the 16-row call with 9 zero rows appended: the padding is zeros
  and never reaches the output, amaxes or gradients."""
  x, kernel = exact_inputs((7, 32), (32, 16), seed=9)
  g = exact_grad((7, 16), seed=10)
  bias = np.ones(16, np.float32)
  r = RECIPES["current-hybrid"]
  meta = te_jax.DenseFp8Meta.create(HISTORY)
  small, _ = dense_vjp(x, kernel, bias, g, meta, r, -1)
  pad = lambda a: np.concatenate([a, np.zeros((9, a.shape[1]), a.dtype)])
  full, _ = dense_vjp(pad(x), kernel, bias, pad(g), meta, r, -1)
  for name in ("out", "dx"):
    np.testing.assert_array_equal(np.asarray(small[name]), np.asarray(full[name])[:7], err_msg=name)
  for name in ("dkernel", "dbias"):
    np.testing.assert_array_equal(np.asarray(small[name]), np.asarray(full[name]), err_msg=name)


# ---- delayed scaling over 5 optimizer steps ------------------------------------------------------------------------


@pytest.mark.slow  # multi-step training
@pytest.mark.parametrize("margin,algo", [(0, "max"), (1, "most_recent")])
def test_amax_and_scale_recurrence_over_5_steps(margin, algo):
  """A te_flax.DenseGeneral trained 5 steps with optax.sgd under DelayedScaling(amax_history_len=3): the amax
  histories and scales follow a hand replay, and each step's forward uses the scale of the step before."""
  fmt = Format.HYBRID
  r = DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo)
  model = te_flax.DenseGeneral(features=16, dtype=jnp.float32)
  rng = np.random.default_rng(11)
  # x's amax goes up and down, so "max" over the history and "most_recent" give different scales.
  xs = [(rng.standard_normal((8, 32)) * f).astype(np.float32) for f in (3.0, 1.0, 2.0, 0.5, 1.5)]
  cs = [(rng.standard_normal((8, 16)) * 10.0 ** (t - 2)).astype(np.float32) for t in range(5)]  # dloss/dy

  with te_jax.autocast(enabled=True, recipe=r):
    variables = jax.jit(model.init)(jax.random.key(0), xs[0])
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.5))

    @jax.jit
    def step(state, x, c):
      def loss(v):
        y = model.apply(v, x)
        return jnp.sum(y * c), y

      (_, y), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
      return state.apply_gradients(grads=grads), y

    hist = {role: np.zeros(3, np.float32) for role in ("x", "kernel", "grad")}
    scale = {role: np.float32(1.0) for role in hist}
    kernel_amaxes = []
    for t in range(5):
      kernel = np.asarray(state.params["params"]["kernel"])
      bias = np.asarray(state.params["params"]["bias"])
      amax = {"x": np.abs(xs[t]).max(), "kernel": np.abs(kernel).max(), "grad": np.abs(cs[t]).max()}
      kernel_amaxes.append(amax["kernel"])
      state, y = step(state, xs[t], cs[t])
      # The forward used the scales from the replay so far.
      ref, bounds = dense_reference(xs[t], kernel, bias, cs[t], -1, (scale["x"], scale["kernel"], scale["grad"]),
                                    fmt)
      assert_within(y, ref["out"], bounds["out"], f"step {t} output")
      for role, dtype in zip(hist, (fmt.fwd_dtype, fmt.fwd_dtype, fmt.bwd_dtype)):
        hist[role], scale[role] = hand_update(hist[role], amax[role], dtype, margin, algo)
        got = state.params[te_jax.FP8_COLLECTION]
        np.testing.assert_array_equal(np.asarray(got[f"{role}_amax_history"]), hist[role], err_msg=f"{t} {role}")
        np.testing.assert_array_equal(np.asarray(got[f"{role}_scale"]), scale[role], err_msg=f"{t} {role}")
  assert len(set(kernel_amaxes)) == 5, "the kernel trained, so its amax changed every step"


# ---- errors --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,kernel_shape", [((16, 40), (40, 16)), ((16, 32), (32, 24)), ((16, 3, 8), (3, 8, 16))])
def test_fp8_feature_dims_not_multiple_of_16_run_in_high_precision(x_shape, kernel_shape):
  """FP8 GEMMs need contracted and output sizes that are multiples of 16: other sizes give the high-precision result,
  bit for bit, under any recipe (a delayed-scaling state then comes back as its own gradient, unchanged)."""
  axis = -1 if len(kernel_shape) == 2 else (-2, -1)
  x = jax.random.normal(jax.random.key(0), x_shape)
  k = jax.random.normal(jax.random.key(1), kernel_shape)
  want = te_jax.dense(x, k, axis=axis)
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
    np.testing.assert_array_equal(np.asarray(te_jax.dense(x, k, axis=axis)), np.asarray(want))
  meta = te_jax.DenseFp8Meta.create(4)._replace(x=te_jax.DenseFp8Meta.create(4).x._replace(scale=jnp.float32(3.0)))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    y, g_meta = jax.value_and_grad(lambda m: jnp.sum(te_jax.dense(x, k, axis=axis, fp8_meta=m)), allow_int=True)(meta)
  np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.sum(want)), rtol=1e-6)
  jax.tree.map(np.testing.assert_array_equal, g_meta, meta)


def test_delayed_scaling_needs_fp8_meta():
  with te_jax.autocast(enabled=True, recipe=DelayedScaling()):
    with pytest.raises(ValueError, match=r"DelayedScaling needs fp8_meta"):
      te_jax.dense(jnp.ones((16, 32)), jnp.ones((32, 16)))
  with pytest.raises(ValueError, match=r"DelayedScaling needs fp8_meta"):
    te_jax.dense(jnp.ones((16, 32)), jnp.ones((32, 16)), recipe=DelayedScaling())


@pytest.mark.parametrize("call,match", [
    (lambda: te_jax.dense(jnp.ones((4, 32)), jnp.ones((16, 16))), r"kernel \(16, 16\) must start with"),
    (lambda: te_jax.dense(jnp.ones((4, 32)), jnp.ones((32, 16)), jnp.ones((8,))), r"bias must have shape \(16,\)"),
    (lambda: te_jax.dense(jnp.ones((4, 32)), jnp.ones((32, 16)), axis=2), r"axis 2 is out of range for rank 2"),
    (lambda: te_jax.dense(jnp.ones((4, 32)), jnp.ones((32, 16)), axis=(1, -1)), r"axes repeat"),
    (lambda: te_jax.dense(jnp.ones((16, 32)), jnp.ones((32, 16)), recipe="fp8"), r"recipe must be one of te_jax.recipe.DelayedScaling\(\)"),
], ids=["kernel-shape", "bias-shape", "axis-range", "axis-repeat", "recipe-type"])
def test_argument_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# ---- what is compiled and what is saved ----------------------------------------------------------------------------


def test_fp8_hlo_and_fp8_residuals():
  """The forward quantizes with the CPU handler and feeds FP8 to the GEMM; the backward keeps only FP8 copies of x
  and of the kernel (1 byte per element), no bf16 x."""
  x = jnp.ones((40, 48), jnp.bfloat16)  # M = 40, padded to 48 inside; K = 48; N = 32
  kernel = jnp.ones((48, 32), jnp.float32)
  meta = te_jax.DenseFp8Meta.create(HISTORY)
  f = lambda x, k, m: te_jax.dense(x, k, fp8_meta=m)
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed-hybrid"]):
    x, kernel, meta = jax.device_put((x, kernel, meta), CPU)
    hlo = jax.jit(f).lower(x, kernel, meta).compile().as_text()
    assert hlo.count('custom_call_target="te_quantize_cpu"') == 2  # x and the kernel
    assert "f8e4m3fn[48,48]" in hlo and "f8e4m3fn[48,32]" in hlo  # padded x and the kernel, as E4M3
    grad_hlo = jax.jit(jax.grad(lambda x, k, m: jnp.sum(f(x, k, m)).astype(jnp.float32), argnums=(0, 1, 2))).lower(
        x, kernel, meta).compile().as_text()
    assert grad_hlo.count('custom_call_target="te_quantize_cpu"') == 3  # x, the kernel, the output gradient
    assert "f8e5m2[" in grad_hlo  # the HYBRID gradient

    _, vjp_fn = jax.vjp(f, x, kernel, meta)
  residuals = jax.tree.leaves(vjp_fn)
  big = [(r.dtype, r.shape) for r in residuals if r.size >= 32 * 32]
  assert sorted(big, key=str) == sorted([(jnp.dtype(E4M3), (48, 48)), (jnp.dtype(E4M3), (48, 32))], key=str), big
  # x's transposed FP8 copy (K, padded M) and the FP8 kernel (K, N); nothing else of x's or the kernel's size.


@pytest.mark.parametrize("rec", ["delayed-hybrid", "current-hybrid"])
@pytest.mark.parametrize("split", [(False, True, True), (True, False, False), (False, False, False)])
@pytest.mark.fast_cases(2)
def test_gemm_accumulation_follows_the_recipe(monkeypatch, rec, split):
  """The forward, dgrad and wgrad GEMMs get the fast_accum their recipe's fp8_gemm_* MMParams ask for."""
  calls = []

  def recording_gemm(*args, fast_accum=False, **kwargs):
    calls.append(fast_accum)
    return gemm(*args, fast_accum=fast_accum, **kwargs)

  monkeypatch.setattr(linear, "gemm", recording_gemm)
  params = dict(zip(("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"),
                    (MMParams(use_split_accumulator=s) for s in split)))
  r = dataclasses.replace(RECIPES[rec], **params)
  x, kernel = jnp.ones((32, 48), jnp.bfloat16), jnp.ones((48, 16), jnp.float32)
  meta = te_jax.DenseFp8Meta.create(HISTORY) if rec.startswith("delayed") else None
  with te_jax.autocast(enabled=True, recipe=r):  # the state differentiated with the kernel, as a train step does
    jax.grad(lambda x, k, m: jnp.sum(te_jax.dense(x, k, fp8_meta=m).astype(jnp.float32)), argnums=(0, 1, 2))(
        x, kernel, meta)
  assert calls == [not s for s in split]


# ---- GPU -----------------------------------------------------------------------------------------------------------


def assert_cuda_dense_hlo(hlo: str):
  """Three cuBLASLt GEMMs (forward, dgrad, wgrad) and three CUDA quantizes (x, kernel, the output gradient with its
  bias gradient: te_quantize_dbias_cuda where that is a target of its own), nothing on the reference path."""
  assert hlo.count('custom_call_target="te_gemm_cuda"') == 3
  quantizes = re.findall(r'custom_call_target="(te_quantize_\w*cuda)"', hlo)
  assert len(quantizes) == 3 and "te_quantize_cuda" in quantizes, quantizes
  assert "te_quantize_cpu" not in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("rec", RECIPES)
@pytest.mark.parametrize("shape", ["2d", "7-rows", "multi-axis"])
def test_gpu_dense_matches_reference_path(rec, shape, gpu):
  """Forward and backward on the GPU (CUDA quantize and cuBLASLt GEMM handlers) against the same on
  the CPU (the reference GEMM and the CPU quantize handler, bitwise equal to the reference): both within the FP8
  quantization bound of the float64 math, and the same updated FP8 state (amaxes are exact on both)."""
  x_shape, axis, kernel_shape = FP8_SHAPES[shape]
  n_in = 1 if isinstance(axis, int) else len(axis)
  out_shape = x_shape[: len(x_shape) - n_in] + kernel_shape[n_in:]
  x, kernel, bias, g = generic_inputs(x_shape, kernel_shape, out_shape, ml_dtypes.bfloat16, seed=12)
  r = RECIPES[rec]
  fwd, bwd = r.fp8_format.fwd_dtype, r.fp8_format.bwd_dtype
  amaxes = [np.max(np.abs(v.astype(np.float32))) for v in (x, kernel, g)]
  scales = [np.float32(fp8_max(d) / (1.7 * a)) for d, a in zip((fwd, fwd, bwd), amaxes)]
  if not isinstance(r, DelayedScaling):
    scales = [current_scale(v, d) for v, d in zip((x, kernel, g), (fwd, fwd, bwd))]
  meta = make_meta(scales if isinstance(r, DelayedScaling) else [1.0] * 3, [np.ones(HISTORY, np.float32)] * 3)

  with te_jax.autocast(enabled=True, recipe=r):
    def fwd_bwd(x, k, b, m, g):  # the output too: a vjp alone would let XLA drop the forward GEMM
      out, vjp = jax.vjp(lambda x, k, b, m: te_jax.dense(x, k, b, axis=axis, fp8_meta=m), x, k, b, m)
      return out, vjp(g)

    f = jax.jit(fwd_bwd)
    args = jax.device_put((x, kernel, bias, meta, g), gpu)
    assert_cuda_dense_hlo(f.lower(*args).compile().as_text())
  ours_gpu, dmeta_gpu = dense_vjp(x, kernel, bias, g, meta, r, axis, device=gpu)
  ours_cpu, dmeta_cpu = dense_vjp(x, kernel, bias, g, meta, r, axis, device=CPU)

  exact, bounds = dense_reference(x, kernel, bias, g, axis)
  # FP8 quantization bound, plus the accumulation of a tensor-core FP8 GEMM (about 14 bits retained, see
  # test_gemm.FP8_ACCUM_U) over the same terms, the bf16 rounding of out and dx and of the bias.
  qbound = quantization_bounds(x, kernel, g, axis, scales, r.fp8_format, accum_u=2.0**-14)
  qbound["out"] = qbound["out"] + 2.0**-8 * np.abs(bias)
  for name in ("out", "dx", "dkernel", "dbias"):
    u = 2.0**-8 if name in ("out", "dx") else F32_U
    total = qbound[name] + bounds[name] + u * np.abs(exact[name]) * 2
    assert_within(ours_gpu[name], exact[name], total, f"GPU {name}")
    assert_within(ours_cpu[name], exact[name], total, f"CPU {name}")
  for a, b in zip(jax.tree.leaves(dmeta_gpu), jax.tree.leaves(dmeta_cpu)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
