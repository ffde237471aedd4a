"""norm_fwd / norm_bwd (LayerNorm and RMSNorm, te_jax.ops.norm) and the differentiable te_jax.layernorm.

- The statistics (mean, rsigma) and dx are sums: against float64 under the tolerance rule (CONTRIBUTING.md),
  ``err(ours, f64) <= 2 * err(the jnp reference in float32, f64) + noise``. dgamma/dbeta, sums over rows whose order
  the kernels choose, are held to the a-priori bound of any float32 summation order (as quantize's dbias).
- Given the statistics, the rest is elementwise and checked bitwise: the normalized output in every dtype, the FP8
  bytes, amax and the transposed copy, against the reference's elementwise part run on XLA:CPU from the handler's
  own mean and rsigma. The reference's fused multiply-add is checked against an exact one.
- CPU handler (every dtype pair, odd shapes, special values), the reference itself, jit/eager, vmap, gradients
  (custom_vjp against autodiff of the reference, check_grads), argument errors, 8 CPU devices (rows sharded:
  bitwise equal to unsharded, exactly the expected collectives), shard_map.
- On a GPU (``@pytest.mark.gpu``): the CUDA handlers, one compiled program per configuration for many shapes (the
  fast register-held kernels, the generic kernels, partial row blocks, the transposed copy), and the backward sums'
  determinism.
"""

import collections
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import F32_U, assert_f32_equal, assert_fp8_equal, check_per_tensor
from te_jax._core import native
from te_jax.ops.norm import NormConfig, norm_apply_ref, norm_bwd_ref, norm_fwd_ref, norm_stats_ref
from te_jax.ops.quantize import FP8_DTYPES, QuantizeConfig, quantize_ref
from te_jax.ops.norm import NormOutput, norm_bwd, norm_fwd
from test_sharding import _BAD_COLLECTIVES, all_reduces

CPU = jax.devices("cpu")[0]
BF16, F16, F32 = ml_dtypes.bfloat16, np.float16, np.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
IN_DTYPES = {"f32": F32, "bf16": BF16, "f16": F16}
OUT_DTYPES = {"f32": F32, "bf16": BF16, "f16": F16, "e4m3": E4M3, "e5m2": E5M2}
NORM_TYPES = ("layernorm", "rmsnorm")
EPS = 1e-5
# FP8 scales that push the largest |y| (~6) past the format's max, so that saturation is exercised.
FP8_SCALE = {jnp.dtype(E4M3): 100.0, jnp.dtype(E5M2): 12000.0}

# Odd hidden sizes, rows not a multiple of anything, rank 1..4.
CPU_SHAPES = [(8,), (1, 1), (3, 7), (5, 16), (4, 33), (17, 128), (2, 3, 40), (9, 1000), (2, 3, 5, 24), (1, 4096)]


# ---- inputs and float64 truth --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)  # the GPU tests reuse the same inputs across output dtypes; never mutated
def make_case(shape, dtype, seed: int):
  """x with a different mean (-4..4) and spread (2^-4..2^4) per row; gamma around 1, beta around 0 (float32)."""
  rng = np.random.default_rng(seed)
  rows = shape[:-1] + (1,)
  x = rng.uniform(-4, 4, rows) + np.exp2(rng.uniform(-4, 4, rows)) * rng.standard_normal(shape)
  hidden = shape[-1]
  gamma = rng.uniform(0.5, 1.5, hidden).astype(F32)
  beta = (0.5 * rng.standard_normal(hidden)).astype(F32)
  return x.astype(dtype), gamma, beta


def stats64(x, norm_type: str, eps: float = EPS):
  """(mean, rsigma) in float64; mean is None for RMSNorm."""
  x = np.asarray(x).astype(np.float64)
  with np.errstate(invalid="ignore"):  # rows holding inf or NaN: NaN statistics
    return _stats64(x, norm_type, eps)


def _stats64(x, norm_type, eps):
  if norm_type == "rmsnorm":
    return None, 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
  mean = np.mean(x, axis=-1)
  return mean, 1.0 / np.sqrt(np.mean((x - mean[..., None]) ** 2, axis=-1) + eps)


def higham(n: int) -> float:
  """gamma_n = n u / (1 - n u): the bound of n float32 roundings in a row (Higham, Accuracy and Stability, 3.1)."""
  return n * F32_U / (1 - n * F32_U)


def assert_rule(ours, ref32, truth, scale, what: str, noise: float):
  """The tolerance rule (CONTRIBUTING.md) on errors normalized by ``scale`` (broadcastable): err(ours) <= 2 err(ref32)
  + noise.

  noise: the float32 roundings after the sums, which both sides pay but not in the same places (a few units of
  F32_U); it matters where the float32 reference happens to be nearly exact.
  """
  truth = np.asarray(truth, np.float64)
  err = lambda v: np.max(np.abs(np.asarray(v).astype(np.float64) - truth) / scale, initial=0.0)  # noqa: E731
  e_ours, e_ref = err(ours), err(ref32)
  assert e_ours <= 2 * e_ref + noise, f"{what}: error {e_ours:.3g} > 2 * {e_ref:.3g} (float32 reference) + {noise:.3g}"


def assert_same_bits(actual, expected, what: str):
  """Bitwise equal arrays of any float dtype, NaN positions matching (any NaN bits)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, expected.dtype,
                                                                               actual.shape, expected.shape)
  if actual.dtype in FP8_DTYPES:
    assert_fp8_equal(actual, expected, what=what)
    return
  nan = np.isnan(expected.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(actual.astype(np.float32)), nan, err_msg=f"{what}: NaN positions")
  uint = {2: np.uint16, 4: np.uint32}[actual.dtype.itemsize]
  bad = np.flatnonzero((actual.view(uint) != expected.view(uint)) & ~nan)
  assert bad.size == 0, (f"{what}: {bad.size} of {actual.size} differ; first at {bad[0]}: "
                         f"{actual.flat[bad[0]]!r} != {expected.flat[bad[0]]!r}")


def fma_f32(a, b, c) -> np.ndarray:
  """``a * b + c`` rounded once to float32 (float32 inputs), computed exactly: the product is exact in float64, the
  sum's float64 rounding error is recovered (TwoSum), and it decides the rare float32 ties."""
  a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
  p = a * b
  s = p + c
  bb = s - p
  e = (p - (s - bb)) + (c - bb)
  r = s.astype(np.float32)
  toward = np.where(s > r, np.float32(np.inf), np.float32(-np.inf))
  other = np.nextafter(r, toward.astype(np.float32))
  tie = (s != r) & ((r.astype(np.float64) + other.astype(np.float64)) / 2 == s) & (e != 0)
  up = np.where(r > other, r, other)
  down = np.where(r > other, other, r)
  return np.where(tie, np.where(e > 0, up, down), r).astype(np.float32)


# ---- running the handlers and the reference ------------------------------------------------------------------------


class Fwd(NamedTuple):
  """norm_fwd's results side by side, as the tests compare them; fields that do not apply are None."""

  out: jax.Array  # an FP8 output's data, else the array
  out_t: jax.Array | None  # an FP8 output's transposed copy
  amax: jax.Array | None
  mean: jax.Array | None
  rsigma: jax.Array
  scale_inv: jax.Array | None = None  # an FP8 output's 1 / scale


def fwd_flat(o: NormOutput) -> Fwd:
  """A NormOutput as Fwd: an FP8 ``out`` is a per-tensor QuantizedTensor (whose transposed copy, when there is one,
  has the same scale), a high-precision one the array itself."""
  if isinstance(o.out, te_jax.QuantizedTensor):
    q = o.out
    check_per_tensor(q)
    return Fwd(q.data, q.data_t, o.amax, o.mean, o.rsigma, q.scale_inv)
  assert o.amax is None, "amax comes with FP8 outputs only"
  return Fwd(o.out, None, o.amax, o.mean, o.rsigma)


def fwd_kwargs(norm_type, out_dtype, transpose=False, **extra):
  out_dtype = jnp.dtype(out_dtype)
  fp8 = out_dtype in FP8_DTYPES
  return dict(norm_type=norm_type, epsilon=EPS, dtype=out_dtype, transpose=transpose,
              scale=np.float32(FP8_SCALE[out_dtype]) if fp8 else None, **extra)


def native_fwd_many(cases, *, device=CPU) -> list[Fwd]:
  """norm_fwd on each ``(x, gamma, beta, kwargs)``, in one jitted program on ``device`` (one compile for many
  shapes); asserts that the compiled program calls the native handler once per case."""
  args = [tuple(jax.device_put(a, device) for a in c[:3]) for c in cases]

  def run(args):
    outs = []
    for (x, g, b), (*_, kw) in zip(args, cases):
      kw = dict(kw)
      scale = kw.pop("scale")
      outs.append(norm_fwd(x, g, b if kw["norm_type"] == "layernorm" else None,
                                  scale=None if scale is None else jnp.float32(scale), **kw))
    return outs

  compiled = jax.jit(run).lower(args).compile()
  target = {"cpu": "te_norm_fwd_cpu", "gpu": "te_norm_fwd_cuda"}[device.platform]
  assert compiled.as_text().count(f'custom_call_target="{target}"') == len(cases), target
  return [fwd_flat(o) for o in compiled(args)]


def config_of(kw) -> NormConfig:
  return NormConfig(kw["norm_type"], kw["epsilon"], jnp.dtype(kw["dtype"]), kw.get("transpose", False))


def factor_of(gamma, kw):
  """The float32 factor the references take: gamma + 1 under zero_centered_gamma."""
  g = jnp.asarray(gamma, jnp.float32)
  return g + 1.0 if kw.get("zero_centered_gamma") else g


def reference_stats_many(cases):
  """The float32 reference's (mean, rsigma) of each case on XLA:CPU, in one jitted program."""
  fn = jax.jit(lambda xs: [norm_stats_ref(x, config=config_of(c[3])) for x, c in zip(xs, cases)])
  return fn([jax.device_put(c[0], CPU) for c in cases])


def expected_outputs_many(cases, outs):
  """What the handler must return given its own statistics: the reference's elementwise part on XLA:CPU, cast as
  ``quantize_ref`` casts (FP8) or rounded (16/32-bit): a list of (out, out_t or None, amax or None)."""

  def one(x, g, b, mean, rsigma, kw):
    config = config_of(kw)
    y = norm_apply_ref(x, mean, rsigma, factor_of(g, kw), b, config=config)
    if not config.fp8:
      return y.astype(config.out_dtype), None, None
    q = quantize_ref(y, jnp.float32(kw["scale"]), config=QuantizeConfig(config.out_dtype, transpose=config.transpose))
    return q[0], q[1] if config.transpose else None, q[-1]

  def run(args):
    return [one(*a, c[3]) for a, c in zip(args, cases)]

  args = [tuple(jax.device_put(np.asarray(v), CPU) if v is not None else None
                for v in (c[0], c[1], c[2], o.mean, o.rsigma)) for c, o in zip(cases, outs)]
  return jax.jit(run)(args)


def check_fwd_many(cases, *, device=CPU):
  """The handler on ``device`` against float64 (statistics) and, bitwise, against the reference's elementwise part
  on its own statistics; returns the handler's outputs."""
  outs = native_fwd_many(cases, device=device)
  refs = reference_stats_many(cases)
  expected = expected_outputs_many(cases, outs)
  for (x, _, _, kw), out, (ref_mean, ref_rsigma), (e_out, e_t, e_amax) in zip(cases, outs, refs, expected):
    what = f"{np.shape(x)} {np.asarray(x).dtype}->{jnp.dtype(kw['dtype']).name} {kw['norm_type']}"
    mean64, rsigma64 = stats64(x, kw["norm_type"], kw["epsilon"])
    finite = np.isfinite(rsigma64)
    if kw["norm_type"] == "layernorm":
      spread = np.mean(np.abs(np.asarray(x).astype(np.float64)), axis=-1)  # the scale of the sum's error
      assert_rule(np.asarray(out.mean)[finite], np.asarray(ref_mean)[finite], mean64[finite], spread[finite] + 1e-30,
                  f"mean, {what}", noise=2 * F32_U)  # the division by n and the result's rounding
    else:
      assert out.mean is None
    # The division by n, + epsilon, the reciprocal square root and the result's rounding.
    assert_rule(np.asarray(out.rsigma)[finite], np.asarray(ref_rsigma)[finite], rsigma64[finite],
                np.maximum(rsigma64[finite], 1e-30), f"rsigma (relative), {what}", noise=4 * F32_U)
    assert_same_bits(out.out, e_out, f"out, {what}")
    if e_amax is None:
      assert out.amax is None and out.out_t is None and out.scale_inv is None
      continue
    assert_f32_equal(out.amax, e_amax, what=f"amax, {what}")
    assert_f32_equal(out.scale_inv, np.float32(1) / np.float32(kw["scale"]), what=f"scale_inv, {what}")
    if kw.get("transpose"):
      assert_fp8_equal(out.out_t, e_t, what=f"out_t, {what}")
      rows = np.asarray(out.out).reshape(-1, np.shape(x)[-1])
      assert_fp8_equal(np.asarray(out.out_t).reshape(np.shape(x)[-1], -1), rows.T, what=f"out_t vs out.T, {what}")
    else:
      assert out.out_t is None
  return outs


def bwd_case(shape, dtype, norm_type, seed, zero_centered=False, dz_dtype=None, dres=False):
  """(dz, x, mean, rsigma, gamma, kwargs): the statistics from the CPU handler's forward (the bwd takes any); dz in
  ``dz_dtype`` (default x's); with ``dres``, kwargs hold a gradient to add to dx (x's dtype)."""
  x, gamma, beta = make_case(shape, dtype, seed)
  g = gamma - 1 if zero_centered else gamma
  fwd = norm_fwd(jax.device_put(x, CPU), g, beta if norm_type == "layernorm" else None, norm_type=norm_type,
                        epsilon=EPS, zero_centered_gamma=zero_centered)
  dz = np.random.default_rng(seed + 1).standard_normal(shape).astype(dz_dtype or dtype)
  mean = None if fwd.mean is None else np.asarray(fwd.mean)
  kw = dict(norm_type=norm_type, zero_centered_gamma=zero_centered)
  if dres:
    kw["dres"] = (4 * np.random.default_rng(seed + 2).standard_normal(shape)).astype(dtype)
  return dz, x, mean, np.asarray(fwd.rsigma), g, kw


def bwd64(dz, x, mean, rsigma, gamma, kw):
  """dx, dgamma, dbeta and the per-term magnitudes of the dgamma/dbeta sums, in float64, from the given statistics."""
  dz, x = (np.asarray(v).astype(np.float64) for v in (dz, x))
  g = np.asarray(gamma, np.float64) + (1.0 if kw["zero_centered_gamma"] else 0.0)
  r = np.asarray(rsigma, np.float64)[..., None]
  xhat = x * r if mean is None else (x - np.asarray(mean, np.float64)[..., None]) * r
  dy = dz * g
  c2 = np.mean(dy * xhat, axis=-1, keepdims=True)
  c1 = 0.0 if mean is None else np.mean(dy, axis=-1, keepdims=True)
  dx = (dy - c1 - xhat * c2) * r
  dx_scale = np.abs(dy).max(axis=-1, keepdims=True, initial=0.0) * r
  if "dres" in kw:
    dres = np.asarray(kw["dres"]).astype(np.float64)
    dx, dx_scale = dx + dres, dx_scale + np.abs(dres).max(axis=-1, keepdims=True, initial=0.0)
  rows = tuple(range(x.ndim - 1))
  return (dx, np.sum(dz * xhat, axis=rows), np.sum(dz, axis=rows), np.sum(np.abs(dz * xhat), axis=rows),
          np.sum(np.abs(dz), axis=rows), dx_scale)


def native_bwd_many(cases, *, device=CPU):
  args = [tuple(None if a is None else jax.device_put(a, device) for a in c[:5]) for c in cases]

  def run(args):
    return [norm_bwd(*a, **c[5]) for a, c in zip(args, cases)]

  compiled = jax.jit(run).lower(args).compile()
  target = {"cpu": "te_norm_bwd_cpu", "gpu": "te_norm_bwd_cuda"}[device.platform]
  assert compiled.as_text().count(f'custom_call_target="{target}"') == len(cases), target
  return compiled(args)


def reference_bwd_many(cases):
  def one(dz, x, mean, rsigma, gamma, kw):
    config = NormConfig(kw["norm_type"], dres="dres" in kw)
    rest = ([] if mean is None else [mean]) + ([kw["dres"]] if "dres" in kw else [])
    return norm_bwd_ref(dz, x, rsigma, factor_of(gamma, kw), *rest, config=config)

  args = [tuple(None if a is None else jax.device_put(a, CPU) for a in c[:5]) for c in cases]
  return jax.jit(lambda args: [one(*a, c[5]) for a, c in zip(args, cases)])(args)


def check_dres_leaves_params(cases, outs, *, device=CPU):
  """The dgamma and dbeta of ``outs`` (cases with a dres) are the same bits as those of the cases without it."""
  plain = native_bwd_many([c[:5] + ({k: v for k, v in c[5].items() if k != "dres"},) for c in cases], device=device)
  for got, want in zip(outs, plain):
    for a, b in zip(got[1:], want[1:]):
      assert (a is None) == (b is None) and (a is None or np.array_equal(np.asarray(a), np.asarray(b)))


def check_bwd_many(cases, *, device=CPU):
  outs = native_bwd_many(cases, device=device)
  refs = reference_bwd_many(cases)
  for (dz, x, mean, rsigma, gamma, kw), (dx, dgamma, dbeta), ref in zip(cases, outs, refs):
    what = f"{np.shape(x)} {np.asarray(x).dtype} {kw}"
    dx64, dg64, db64, dg_mag, db_mag, dx_scale = bwd64(dz, x, mean, rsigma, gamma, kw)
    assert dx.dtype == np.asarray(x).dtype and dx.shape == np.shape(x)
    # The divisions by n, the two subtractions, the products and the result's rounding, relative to max|dy| rsigma.
    assert_rule(dx, ref[0], dx64, dx_scale + 1e-30, f"dx, {what}", noise=4 * F32_U)
    # dgamma: n terms each from 3 roundings (x - mean, * rsigma, * dz) summed in any order.
    n = math.prod(np.shape(x)[:-1])
    for name, got, exact, mag, k in (("dgamma", dgamma, dg64, dg_mag, 3), ("dbeta", dbeta, db64, db_mag, 0)):
      if name == "dbeta" and kw["norm_type"] == "rmsnorm":
        assert got is None
        continue
      got = np.asarray(got)
      assert got.dtype == np.float32 and got.shape == (np.shape(x)[-1],)
      bound = higham(n + k) * mag
      assert np.all(np.abs(got - exact) <= bound), f"{name}, {what}: {np.max(np.abs(got - exact) - bound)} over"
  return outs


@pytest.fixture(autouse=True)
def _cpu_handlers_registered():
  """Every test here means the native CPU handlers: a silent fallback to the reference must fail, not pass."""
  assert native.has_target("cpu", "te_norm_fwd_cpu") and native.has_target("cpu", "te_norm_bwd_cpu"), \
      native.load_errors


# ---- CPU handlers against the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.fast_cases(3)
def test_cpu_fwd(dtype, out):
  cases = []
  for i, shape in enumerate(CPU_SHAPES):
    x, g, b = make_case(shape, IN_DTYPES[dtype], seed=i)
    for norm_type in NORM_TYPES:
      transpose = jnp.dtype(OUT_DTYPES[out]) in FP8_DTYPES and len(shape) > 1
      cases.append((x, g, b, fwd_kwargs(norm_type, OUT_DTYPES[out], transpose=transpose)))
  check_fwd_many(cases)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_cpu_zero_centered_gamma_and_epsilon(norm_type):
  x, g, b = make_case((6, 40), BF16, seed=3)
  cases = [(x, g - 1, b, fwd_kwargs(norm_type, E4M3, transpose=True, zero_centered_gamma=True)),
           (x, g - 1, b, fwd_kwargs(norm_type, BF16, zero_centered_gamma=True)),
           (x, g, b, {**fwd_kwargs(norm_type, F32), "epsilon": 10.0})]
  outs = check_fwd_many(cases)
  plain = fwd_flat(norm_fwd(jax.device_put(x, CPU), g, b if norm_type == "layernorm" else None,
                           norm_type=norm_type, epsilon=EPS, dtype=BF16))
  assert_same_bits(outs[1].out, plain.out, "gamma - 1 with zero_centered_gamma == gamma")


def special_rows(dtype) -> np.ndarray:
  """Rows that stress the statistics: constant (variance 0), a large offset with a tiny spread, zeros, huge and tiny
  magnitudes, one inf, one NaN."""
  n = 24
  rng = np.random.default_rng(5)
  rows = [np.full(n, 3.0), 1000.0 + 0.01 * rng.standard_normal(n), np.zeros(n), 1e4 * rng.standard_normal(n),
          1e-3 * rng.standard_normal(n), np.where(np.arange(n) == 5, np.inf, 1.0),
          np.where(np.arange(n) == 7, np.nan, 1.0), -np.arange(n, dtype=np.float64)]
  return np.stack(rows).astype(dtype)


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_cpu_special_values(dtype, norm_type):
  x = special_rows(IN_DTYPES[dtype])
  _, g, b = make_case(x.shape, F32, seed=1)
  outs = check_fwd_many([(x, g, b, fwd_kwargs(norm_type, E4M3, transpose=True)),
                         (x, g, b, fwd_kwargs(norm_type, IN_DTYPES[dtype]))])
  assert np.isnan(np.asarray(outs[0].amax))  # a NaN row
  y = np.asarray(outs[1].out).astype(np.float32)
  assert np.all(np.isnan(y[6])) and np.all(np.isfinite(y[[0, 1, 2, 3, 4, 7]]))
  if norm_type == "layernorm":
    assert np.all(np.isnan(y[5]))  # mean inf: inf - inf
    np.testing.assert_array_equal(y[0], b.astype(IN_DTYPES[dtype]).astype(np.float32))  # variance 0: beta
  else:
    np.testing.assert_array_equal(np.isnan(y[5]), np.arange(x.shape[1]) == 5)  # rsigma 0: inf * 0 only there


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 8)], ids=str)
def test_cpu_no_rows(shape):
  x = np.zeros(shape, BF16)
  out = fwd_flat(norm_fwd(jax.device_put(x, CPU), np.ones(shape[-1], F32), np.zeros(shape[-1], F32), dtype=E4M3,
                          scale=1.0, transpose=True))
  assert out.out.shape == shape and out.out_t.shape == (shape[-1], *shape[:-1]) and float(out.amax) == 0.0
  assert out.mean.shape == out.rsigma.shape == shape[:-1]
  dx, dgamma, dbeta = norm_bwd(x, x, out.mean, out.rsigma, np.ones(shape[-1], F32))
  assert dx.shape == shape and not np.any(np.asarray(dgamma)) and not np.any(np.asarray(dbeta))


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "gamma-1"])
@pytest.mark.parametrize("dtype,dz_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F16, F32)],
                         ids=["f32", "bf16", "f16", "bf16-dz-f32", "f16-dz-f32"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.fast_cases(4)
def test_cpu_bwd(norm_type, dtype, dz_dtype, zero_centered):
  cases = [bwd_case(shape, dtype, norm_type, seed=i, zero_centered=zero_centered, dz_dtype=dz_dtype)
           for i, shape in enumerate(CPU_SHAPES)]
  check_bwd_many(cases)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.fast_cases(2)
def test_cpu_bwd_dres(norm_type, dtype):
  """A residual gradient added to dx (in float32, one rounding); dgamma and dbeta as without it."""
  cases = [bwd_case(shape, dtype, norm_type, seed=i, dres=True) for i, shape in enumerate(CPU_SHAPES)]
  check_dres_leaves_params(cases, check_bwd_many(cases))


def test_bwd_dres_errors():
  dz, x, mean, rsigma, g, kw = bwd_case((4, 16), BF16, "layernorm", seed=3)
  with pytest.raises(TypeError, match="dres must have x's shape"):
    norm_bwd(dz, x, mean, rsigma, g, **kw, dres=np.zeros((4, 16), np.float32))
  with pytest.raises(TypeError, match="dres must have x's shape"):
    norm_bwd(dz, x, mean, rsigma, g, **kw, dres=np.zeros((4, 8), BF16))


# ---- the reference itself ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_reference_apply_is_one_fma(norm_type):
  """norm_apply_ref on XLA:CPU is exactly fma((x - mean) * rsigma, g, beta) (RMSNorm: two products), the formula
  the kernels implement: were XLA to stop contracting the multiply-add, this fails first."""
  x, g, b = make_case((64, 257), F32, seed=11)
  config = NormConfig(norm_type, EPS)
  mean, rsigma = (None if v is None else np.asarray(v) for v in norm_stats_ref(jnp.asarray(x), config=config))
  y = jax.jit(lambda *a: norm_apply_ref(*a, config=config))(x, mean, rsigma, g, b)
  if norm_type == "rmsnorm":
    want = (x * rsigma[:, None]) * g
  else:
    want = fma_f32((x - mean[:, None]) * rsigma[:, None], g, b)
  assert_same_bits(y, want, "y")


def test_fma_f32_helper():
  """The exact-fma helper where float64 alone would round twice: p + c = 1 + 2^-23 + 2^-24 - 2^-70 rounds in float64
  to the float32 tie 1 + 2^-23 + 2^-24 (which would then go to the even 1 + 2^-22); exactly, it is below the tie."""
  a, b, c = np.float32(2.0**-24 * (1 + 2.0**-23)), np.float32(1 - 2.0**-23), np.float32(1 + 2.0**-23)
  assert fma_f32(a, b, c) == c
  assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2.0**-22)  # the double rounding
  one = np.float32(1.0)
  assert fma_f32(np.float32(2.0**-24), one, one) == one  # an exact tie: to even
  assert fma_f32(np.float32(2.0**-24 + 2.0**-40), one, one) == np.nextafter(one, np.float32(2))  # above the tie


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_reference_against_float64(norm_type):
  """The oracle's oracle: the reference's statistics within the float32 bounds of the float64 ones, its output
  within two roundings of the float64 formula."""
  x, g, b = make_case((16, 300), F32, seed=4)
  config = NormConfig(norm_type, EPS)
  outs = jax.jit(lambda *a: norm_fwd_ref(*a, config=config))(x, g, np.float32(1), *([b] if norm_type == "layernorm"
                                                                                    else []))
  mean64, rsigma64 = stats64(x, norm_type)
  n = x.shape[-1]
  if norm_type == "layernorm":
    assert np.all(np.abs(outs[1] - mean64) <= higham(n + 1) * np.mean(np.abs(x), axis=-1))
  assert np.all(np.abs(outs[-1] / rsigma64 - 1) <= higham(n + 6))  # the sum, 4 roundings, a few ulp of rsqrt
  xhat = x.astype(np.float64) * rsigma64[:, None] if mean64 is None else (x - mean64[:, None]) * rsigma64[:, None]
  y64 = xhat * g + (0 if mean64 is None else b)
  # The mean's error (up to gamma_n mean|x|) moves every x - mean of the row: times rsigma, it is part of the bound.
  shift = np.abs(g) * rsigma64[:, None] * np.mean(np.abs(x), axis=-1, keepdims=True)
  assert np.all(np.abs(outs[0] - y64) <= higham(n + 10) * (np.abs(xhat * g) + np.abs(b) + shift))


# ---- jit, eager, vmap ----------------------------------------------------------------------------------------------


def test_eager_equals_jit():
  x, g, b = make_case((5, 48), BF16, seed=2)
  x = jax.device_put(x, CPU)
  kw = dict(dtype=E5M2, scale=jnp.float32(3.0), transpose=True, epsilon=EPS)
  eager = fwd_flat(norm_fwd(x, g, b, **kw))
  jitted = fwd_flat(jax.jit(lambda x: norm_fwd(x, g, b, **kw))(x))
  for a, c in zip(eager, jitted):
    assert_same_bits(a, c, "eager vs jit")


@pytest.mark.parametrize("in_axis", [0, 1])
def test_vmap_high_precision_is_one_call(in_axis):
  """A batched x with shared parameters is just more rows: one handler call, bitwise the per-element results."""
  x, g, b = make_case((3, 4, 40), BF16, seed=6)
  f = jax.jit(jax.vmap(lambda x: norm_fwd(x, g, b, epsilon=EPS), in_axes=in_axis))
  assert f.lower(x).compile().as_text().count('custom_call_target="te_norm_fwd_cpu"') == 1
  out = fwd_flat(f(jax.device_put(x, CPU)))
  for i in range(x.shape[in_axis]):
    ref = fwd_flat(norm_fwd(jax.device_put(np.take(x, i, axis=in_axis), CPU), g, b, epsilon=EPS))
    for a, c in zip(out, ref):
      if c is not None:
        assert_same_bits(a[i], c, "vmapped element")


def test_vmap_fp8_is_per_element():
  """FP8: amax and the transposed copy are per element (one call per element), with per-element scales too."""
  x, g, _ = make_case((3, 6, 16), F16, seed=7)
  scales = np.array([1.0, 30.0, 300.0], F32)
  f = jax.vmap(lambda x, s: norm_fwd(x, g, norm_type="rmsnorm", dtype=E4M3, scale=s, transpose=True))
  out = fwd_flat(jax.jit(f)(jax.device_put(x, CPU), scales))
  for i in range(3):
    ref = fwd_flat(norm_fwd(jax.device_put(x[i], CPU), g, norm_type="rmsnorm", dtype=E4M3, scale=scales[i],
                            transpose=True))
    assert_fp8_equal(out.out[i], ref.out)
    assert_fp8_equal(out.out_t[i], ref.out_t, what="out_t")
    assert_f32_equal(out.amax[i], ref.amax)


def test_vmap_of_grad_is_per_example():
  x, g, b = make_case((4, 5, 24), F32, seed=8)

  def loss(x, g, b):
    return jnp.sum(te_jax.layernorm(x, g, b, epsilon=EPS) ** 2)

  per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(x, g, b)
  for i in range(4):
    one = jax.grad(loss, argnums=(0, 1, 2))(x[i], g, b)
    for a, c in zip(per_example, one):
      np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(c))  # the same handler on the same rows


# ---- the differentiable op -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "gamma-1"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_layernorm_forward_is_norm_fwd(norm_type, zero_centered):
  x, g, b = make_case((3, 5, 64), BF16, seed=9)
  beta = b if norm_type == "layernorm" else None
  y = te_jax.layernorm(x, g, beta, norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zero_centered,
                       dtype=jnp.float32)
  want = norm_fwd(x, g, beta, norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zero_centered,
                  dtype=jnp.float32)
  assert not isinstance(want.out, te_jax.QuantizedTensor)
  assert_same_bits(y, want.out, "layernorm")


@pytest.mark.parametrize("param_dtype", [F32, BF16], ids=["f32-params", "bf16-params"])
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.fast_cases(3)
def test_gradients_against_autodiff_of_reference(norm_type, dtype, param_dtype):
  """custom_vjp gradients against jax.grad of the pure-jnp forward, both against the float64 gradients of the same
  function: the tolerance rule (CONTRIBUTING.md); each gradient in the dtype of what it differentiates."""
  x, g, b = make_case((6, 96), IN_DTYPES[dtype], seed=10)
  g, b = g.astype(param_dtype), b.astype(param_dtype)
  dz = np.random.default_rng(0).standard_normal(x.shape).astype(F32)
  config = NormConfig(norm_type, EPS, out_dtype=jnp.dtype(jnp.float32))
  rms = norm_type == "rmsnorm"

  def ours(x, g, b):
    return jnp.sum(te_jax.layernorm(x, g, None if rms else b, norm_type=norm_type, epsilon=EPS,
                                    dtype=jnp.float32) * dz)

  def theirs(x, g, b):
    gf = g.astype(jnp.float32)
    return jnp.sum(norm_fwd_ref(x, gf, jnp.float32(1), *([] if rms else [b.astype(jnp.float32)]),
                                config=config)[0] * dz)

  args = (jax.device_put(x, CPU), jax.device_put(g, CPU), jax.device_put(b, CPU))
  got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(*args)
  ref = jax.jit(jax.grad(theirs, argnums=(0, 1, 2)))(*args)
  mean64, rsigma64 = stats64(x, norm_type)
  want = bwd64(dz, x, mean64, rsigma64, g, {"zero_centered_gamma": False})[:3]  # float64, analytically
  for name, a, r, w, like in zip(("dx", "dgamma", "dbeta"), got, ref, want, (x, g, b)):
    if name == "dbeta" and rms:
      assert not np.any(np.asarray(a))  # b is unused for RMSNorm
      continue
    assert a.dtype == like.dtype, (name, a.dtype, like.dtype)
    w = np.asarray(w)
    scale = np.max(np.abs(w)) + 1e-30
    eps_out = float(jnp.finfo(like.dtype).eps)  # both round to the gradient's dtype: one rounding of noise
    assert_rule(a, r, w, scale, f"{name}, {norm_type} {dtype}", noise=2 * F32_U + eps_out)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_check_grads(norm_type):
  x, g, b = make_case((3, 16), F32, seed=12)
  beta = b if norm_type == "layernorm" else None
  f = lambda x, g, *b: te_jax.layernorm(x, g, *b, norm_type=norm_type, epsilon=EPS)  # noqa: E731
  args = (x, g) + ((beta,) if beta is not None else ())
  jax.test_util.check_grads(f, args, order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_layernorm_saves_no_normalized_output():
  """The residuals are x, gamma and the float32 statistics: no second copy of the output is kept."""
  x, g, b = make_case((4, 32), BF16, seed=13)
  _, vjp = jax.vjp(lambda x: te_jax.layernorm(x, g, b), x)
  leaves = jax.tree.leaves(vjp)
  assert sorted((leaf.shape, str(leaf.dtype)) for leaf in leaves if hasattr(leaf, "shape")) == sorted(
      [((4, 32), "bfloat16"), ((32,), "float32"), ((4,), "float32"), ((4,), "float32")])


# ---- argument checks -----------------------------------------------------------------------------------------------

_ONES = jnp.ones((2, 8), jnp.float32)
_G = jnp.ones((8,), jnp.float32)


@pytest.mark.parametrize("fn,args,kwargs,error,match", [
    (norm_fwd, (jnp.ones((2, 8), jnp.int32), _G, _G), {}, TypeError, "^x must be float32"),
    (norm_fwd, (jnp.float32(1), _G, _G), {}, ValueError, "^x must have rank >= 1"),
    (norm_fwd, (jnp.ones((2, 0)), _G, _G), {}, ValueError, "^x must have rank >= 1 and a non-empty"),
    (norm_fwd, (_ONES, jnp.ones((7,)), _G), {}, ValueError, r"^gamma must have shape \(8,\)"),
    (norm_fwd, (_ONES, jnp.ones((8,), jnp.int32), _G), {}, TypeError, "^gamma must be a float"),
    (norm_fwd, (_ONES, _G, None), {}, ValueError, "^norm_type='layernorm' needs beta"),
    (norm_fwd, (_ONES, _G, _G), {"norm_type": "rmsnorm"}, ValueError, "^beta must be None"),
    (norm_fwd, (_ONES, _G, _G), {"norm_type": "batchnorm"}, ValueError, "^norm_type must be"),
    (norm_fwd, (_ONES, _G, _G), {"epsilon": -1.0}, ValueError, "^epsilon must be a non-negative"),
    (norm_fwd, (_ONES, _G, _G), {"epsilon": jnp.float32(1e-5)}, ValueError, "^epsilon must be"),
    (norm_fwd, (_ONES, _G, _G), {"dtype": E4M3}, ValueError, "^dtype float8_e4m3fn needs scale"),
    (norm_fwd, (_ONES, _G, _G), {"dtype": E4M3, "scale": 1}, TypeError, "^scale must be a float32"),
    (norm_fwd, (_ONES, _G, _G), {"scale": 1.0}, ValueError, "^scale applies to FP8 outputs only"),
    (norm_fwd, (_ONES, _G, _G), {"dtype": jnp.int8}, ValueError, "^dtype must be"),
    (norm_fwd, (_ONES, _G, _G), {"transpose": True}, ValueError, "^transpose=True needs an FP8"),
    (norm_fwd, (_G, _G, _G), {"dtype": E4M3, "scale": 1.0, "transpose": True}, ValueError,
     "^transpose=True needs"),
    (norm_bwd, (_ONES, _ONES, None, jnp.ones((2,)), _G), {}, TypeError, "^mean must be float32 with shape"),
    (norm_bwd, (_ONES, _ONES, jnp.ones((2,)), jnp.ones((3,)), _G), {}, TypeError, "^rsigma must be"),
    (norm_bwd, (_ONES, _ONES, jnp.ones((2,)), jnp.ones((2,)), _G), {"norm_type": "rmsnorm"}, ValueError,
     "^mean must be None"),
    (norm_bwd, (_ONES.astype(jnp.bfloat16), _ONES, None, jnp.ones((2,)), _G), {"norm_type": "rmsnorm"},
     TypeError, "^dz must have x's shape"),
    (te_jax.layernorm, (_ONES, _G, _G), {"dtype": E4M3}, ValueError, "^dtype must be float32, bfloat16 or float16"),
    (te_jax.layernorm, (_ONES, _G, _G), {"norm_type": "rms"}, ValueError, "^norm_type must be"),
    (te_jax.layernorm, (_ONES, _G, None), {}, ValueError, "^norm_type='layernorm' needs beta"),
], ids=["int-x", "rank0", "empty-hidden", "gamma-shape", "int-gamma", "no-beta", "rms-beta", "norm-type",
        "negative-eps", "array-eps", "fp8-no-scale", "int-scale", "hp-scale", "int-out", "hp-transpose",
        "rank1-transpose", "bwd-no-mean", "bwd-rsigma-shape", "bwd-rms-mean", "bwd-dz-dtype", "layernorm-fp8",
        "layernorm-type", "layernorm-no-beta"])
def test_bad_arguments_raise_before_xla(fn, args, kwargs, error, match):
  with pytest.raises(error, match=match):
    fn(*args, **kwargs)
  with pytest.raises(error, match=match):  # under jit: at trace time, with the same message
    jax.jit(lambda: fn(*args, **kwargs))()


# ---- 8 CPU devices -------------------------------------------------------------------------------------------------

FWD_SHARDING = [
    ((8,), ("x",), (8 * 3, 40), P("x", None)),  # rows
    ((4, 2), ("a", "b"), (4 * 3, 2 * 5, 24), P("a", "b", None)),  # two row dims
    ((4, 2), ("a", "b"), (8 * 2, 24), P(("a", "b"), None)),  # rows over both axes
    ((4, 2), ("a", "b"), (4 * 3, 24), P("a", None)),  # rows, replicated over b
    ((8,), ("x",), (6, 8 * 4), P(None, "x")),  # hidden: gathered (statistics need whole rows)
    ((2, 2, 2), ("a", "b", "c"), (6, 10), P()),  # replicated: no collective at all
]


def _mesh(mesh_shape, names):
  return Mesh(np.array(jax.devices("cpu")).reshape(mesh_shape), names)


def _row_axes(spec, ndim):
  spec = tuple(spec) + (None,) * (ndim - len(spec))
  axes = set()
  for e in spec[:-1]:
    axes.update(() if e is None else (e if isinstance(e, tuple) else (e,)))
  return axes, spec


@pytest.mark.parametrize("out", ["e4m3+t", "bf16"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("mesh_shape,names,shape,spec", FWD_SHARDING, ids=lambda v: str(v).replace(" ", ""))
def test_sharded_fwd_equals_unsharded(mesh_shape, names, shape, spec, norm_type, out):
  mesh = _mesh(mesh_shape, names)
  x, g, b = make_case(shape, BF16, seed=14)
  fp8 = out == "e4m3+t"
  kw = dict(norm_type=norm_type, epsilon=EPS, dtype=E4M3 if fp8 else BF16, scale=jnp.float32(50) if fp8 else None,
            transpose=fp8)
  beta = b if norm_type == "layernorm" else None
  f = jax.jit(lambda x: norm_fwd(x, g, beta, **kw))
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  compiled = f.lower(xs).compile()
  got = fwd_flat(compiled(xs))
  want = fwd_flat(f(jax.device_put(x, CPU)))
  for name, a, c in zip(Fwd._fields, got, want, strict=True):
    if c is not None:
      assert_same_bits(a, c, name)  # whole rows on every shard: the same bits
  row_axes, full = _row_axes(spec, len(shape))
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_norm_fwd_cpu"') == 1
  if full[-1] is None:
    assert got.out.sharding.is_equivalent_to(NamedSharding(mesh, P(*full[:-1], None)), len(shape))
    assert got.rsigma.sharding.is_equivalent_to(NamedSharding(mesh, P(*full[:-1])), len(shape) - 1)
    assert not _BAD_COLLECTIVES.search(hlo), _BAD_COLLECTIVES.search(hlo).group(0)
  else:  # a sharded hidden dim is gathered before the handler (it needs whole rows), the only collective
    assert "all-gather" in hlo and not _BAD_COLLECTIVES.search(hlo.replace("all-gather", ""))
  expected = collections.Counter({"maximum": 1} if fp8 and row_axes else {})
  assert all_reduces(hlo) == expected


@pytest.mark.parametrize("dres", [False, True], ids=["plain", "dres"])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("mesh_shape,names,shape,spec", FWD_SHARDING[:4], ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.fast_cases(4)
def test_sharded_bwd(mesh_shape, names, shape, spec, norm_type, dres):
  """dx bitwise as unsharded; dgamma/dbeta summed over the row shards by one all-reduce (within the bound of any
  summation order); a dres sharded like x stays shard-local."""
  mesh = _mesh(mesh_shape, names)
  dz, x, mean, rsigma, g, kw = bwd_case(shape, BF16, norm_type, seed=15, dres=dres)
  r = kw.pop("dres", None)
  f = jax.jit(lambda dz, x, mean, rsigma, r: norm_bwd(dz, x, mean, rsigma, g, **kw, dres=r))
  full_sharding = NamedSharding(mesh, spec)
  row_sharding = NamedSharding(mesh, P(*tuple(spec)[:len(shape) - 1]))
  args = (jax.device_put(dz, full_sharding), jax.device_put(x, full_sharding),
          None if mean is None else jax.device_put(mean, row_sharding), jax.device_put(rsigma, row_sharding),
          None if r is None else jax.device_put(r, full_sharding))
  compiled = f.lower(*args).compile()
  dx, dgamma, dbeta = compiled(*args)
  want = f(*(None if a is None else jax.device_put(np.asarray(a), CPU) for a in (dz, x, mean, rsigma, r)))
  if r is not None:
    kw["dres"] = r
  assert_same_bits(dx, want[0], "dx")
  check_bwd_many([(dz, x, mean, rsigma, g, kw)])  # the bounds, on the unsharded handler
  _, dg64, db64, dg_mag, db_mag, _ = bwd64(dz, x, mean, rsigma, g, kw)
  n = math.prod(shape[:-1])
  assert np.all(np.abs(np.asarray(dgamma) - dg64) <= higham(n + 3) * dg_mag)
  if norm_type == "layernorm":
    assert np.all(np.abs(np.asarray(dbeta) - db64) <= higham(n) * db_mag)
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_norm_bwd_cpu"') == 1
  assert not _BAD_COLLECTIVES.search(hlo), _BAD_COLLECTIVES.search(hlo).group(0)
  assert all_reduces(hlo) == collections.Counter({"add": 1})


def test_shard_map_outputs_keep_varying_axes():
  mesh = _mesh((8,), ("x",))
  x, g, b = make_case((16, 24), BF16, seed=16)

  def local(x):
    out = fwd_flat(norm_fwd(x, g, b, dtype=E4M3, scale=jnp.float32(10), transpose=True))
    for v in out[:-1]:  # all but scale_inv, 1 / the replicated scale
      assert jax.typeof(v).manual_axis_type.varying == {"x"}, jax.typeof(v)
    dx, dgamma, dbeta = norm_bwd(x, x, out.mean, out.rsigma, g)
    for v in (dx, dgamma, dbeta):
      assert jax.typeof(v).manual_axis_type.varying == {"x"}, jax.typeof(v)
    return out.out, jax.lax.pmax(out.amax, "x"), jax.lax.psum(dgamma, "x")

  q, amax, _ = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P(), P())))(x)
  want = fwd_flat(norm_fwd(jax.device_put(x, CPU), g, b, dtype=E4M3, scale=jnp.float32(10)))
  assert_fp8_equal(q, want.out)
  assert_f32_equal(amax, want.amax)


# ---- CUDA handlers -------------------------------------------------------------------------------------------------

# The fast kernels (hidden % 8 == 0) with 1, 2 and 4 chunks per thread, sub-warp rows (hidden 8..128), multi-warp
# rows up to 512 threads, several rows per block with a partial last block, the transposed copy through the tiled
# FP8 transpose kernel (rows and hidden multiples of 16: (32, 1024), (64, 2048)) and staged in the normalizing
# kernel otherwise (e.g. (17, 4096), (301, 64)); backward workers with several rows each and idle
# workers in the last block ((600, 4096), (5000, 512)); the generic kernels (hidden % 8 != 0, or beyond the fast
# kernels: 16-bit hidden > 16384, float32 backward > 8192); 1-element rows; and more row groups than the device holds
# blocks at once, which the RMSNorm forward's resident blocks loop over ((40001, 256): 32 rows per block, the last
# group partial; (1100, 8192): one row per block, a partial last pass).
GPU_SHAPES = [(1, 128), (3, 136), (5, 16), (301, 64), (7, 1000), (2, 3, 768), (32, 1024), (17, 4096), (48, 5120),
              (9, 8192), (5, 12288), (3, 16384), (4, 1001), (3, 7), (2, 20000), (6, 1), (1000, 8), (64, 2048),
              (600, 4096), (5000, 512), (40001, 256), (1100, 8192)]


def assert_cuda_targets():
  assert native.has_target("cuda", "te_norm_fwd_cuda") and native.has_target("cuda", "te_norm_bwd_cuda"), \
      native.load_errors


# One compiled program per (input, output) dtype pair for every shape, both norm types and, for FP8, the transposed
# copy: GPU time goes to the kernels, not to compiles.
@pytest.mark.gpu
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_gpu_fwd(dtype, out, gpu):
  assert_cuda_targets()
  fp8 = jnp.dtype(OUT_DTYPES[out]) in FP8_DTYPES
  cases = []
  for i, shape in enumerate(GPU_SHAPES):
    x, g, b = make_case(shape, IN_DTYPES[dtype], seed=i)
    for norm_type in NORM_TYPES:
      cases.append((x, g, b, fwd_kwargs(norm_type, OUT_DTYPES[out])))
      if fp8:
        cases.append((x, g, b, fwd_kwargs(norm_type, OUT_DTYPES[out], transpose=True)))
  check_fwd_many(cases, device=gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_gpu_fwd_special_values_and_zero_centered(dtype, gpu):
  assert_cuda_targets()
  x = special_rows(IN_DTYPES[dtype])
  _, g, b = make_case(x.shape, F32, seed=1)
  cases = []
  for norm_type in NORM_TYPES:
    cases += [(x, g, b, fwd_kwargs(norm_type, E4M3, transpose=True)), (x, g, b, fwd_kwargs(norm_type, F32)),
              (x, g - 1, b, fwd_kwargs(norm_type, BF16, zero_centered_gamma=True))]
  outs = check_fwd_many(cases, device=gpu)
  assert np.isnan(np.asarray(outs[0].amax))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,dz_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F16, F32)],
                         ids=["f32", "bf16", "f16", "bf16-dz-f32", "f16-dz-f32"])
def test_gpu_bwd(dtype, dz_dtype, gpu):
  assert_cuda_targets()
  cases = [bwd_case(shape, dtype, norm_type, seed=i, zero_centered=i % 2 == 1, dz_dtype=dz_dtype)
           for i, shape in enumerate(GPU_SHAPES) for norm_type in NORM_TYPES]
  check_bwd_many(cases, device=gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_gpu_bwd_dres(dtype, gpu):
  """dres through the ring (1 chunk per thread of 16-bit inputs, float32) and loaded in the normalize pass (2 and 4
  chunks), and in the any-shape kernel; dgamma/dbeta the same bits as without it."""
  assert_cuda_targets()
  cases = [bwd_case(shape, dtype, norm_type, seed=i, zero_centered=i % 2 == 1, dres=True)
           for i, shape in enumerate(GPU_SHAPES) for norm_type in NORM_TYPES]
  check_dres_leaves_params(cases, check_bwd_many(cases, device=gpu), device=gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_gpu_one_pass_statistics(dtype, gpu):
  """Rows whose |mean| / sigma spans the forward's one-pass bound (1/8): the variance as msq - mean^2 below it, the
  two-pass one above, decided row by row (one row per block, rows sharing a warp or a block's barriers), under the
  same rule as every other row; all-equal rows (variance 0, |mean| > 0) take the two-pass form."""
  assert_cuda_targets()
  rng = np.random.default_rng(23)
  cases = []
  for shape in [(512, 8192), (300, 2048), (1000, 64), (700, 1024), (97, 16)]:
    rows = shape[0]
    sigma = np.exp2(rng.uniform(-4, 4, (rows, 1)))
    ratio = rng.uniform(0.0, 0.25, (rows, 1)) * rng.choice([-1.0, 1.0], (rows, 1))
    x = ratio * sigma + sigma * rng.standard_normal(shape)
    # Constant rows of powers of two: every summation order gives their exact mean, so the reference's is exact too.
    x[::17] = rng.choice([-1.0, 1.0], (len(x[::17]), 1)) * np.exp2(rng.integers(-3, 4, (len(x[::17]), 1)))
    _, g, b = make_case(shape, F32, seed=rows)
    x = x.astype(IN_DTYPES[dtype])
    cases += [(x, g, b, fwd_kwargs("layernorm", E4M3)), (x, g, b, fwd_kwargs("layernorm", BF16))]
  check_fwd_many(cases, device=gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_gpu_large_and_deterministic(norm_type, gpu):
  """The benchmark's shape class (many rows, hidden 8192: 8 rows per backward worker) forward and backward, and the
  backward's outputs the same bits on every run (fixed-order sums)."""
  assert_cuda_targets()
  x, g, b = make_case((2048, 8192), BF16, seed=17)
  check_fwd_many([(x, g, b, fwd_kwargs(norm_type, E4M3, transpose=True))], device=gpu)
  case = bwd_case((2048, 8192), BF16, norm_type, seed=18)
  first = check_bwd_many([case], device=gpu)[0]
  args = [None if a is None else jax.device_put(a, gpu) for a in case[:5]]
  f = jax.jit(lambda *a: norm_bwd(*a, **case[5]))
  for _ in range(3):
    again = f(*args)
    for a, c in zip(again, first):
      if c is not None:
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
                                      np.asarray(c).view(np.uint16 if c.dtype.itemsize == 2 else np.uint32))


@pytest.mark.gpu
def test_gpu_layernorm_grad_matches_cpu(gpu):
  """The differentiable op end to end on the GPU against the same on the CPU handlers (the tolerance rule
  (CONTRIBUTING.md) against float64 autodiff would be the same check as on CPU; here: within float32 summation error
  of each other)."""
  x, g, b = make_case((64, 1024), BF16, seed=19)
  f = jax.grad(lambda x, g, b: jnp.sum(te_jax.layernorm(x, g, b, epsilon=EPS).astype(jnp.float32) ** 2),
               argnums=(0, 1, 2))
  on = lambda d: jax.jit(f)(*(jax.device_put(a, d) for a in (x, g, b)))  # noqa: E731
  for a, c in zip(on(gpu), on(CPU)):
    a, c = np.asarray(a).astype(np.float64), np.asarray(c).astype(np.float64)
    assert np.max(np.abs(a - c)) <= 2 ** -7 * np.max(np.abs(c)), "two bf16 ulps of the largest gradient"
