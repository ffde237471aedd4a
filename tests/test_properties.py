"""Property-based tests (hypothesis): each primitive's CPU handler against its reference on random values.

Every op draws its shape from a small fixed list (1, primes, sizes not a multiple of 16, a few thousand elements:
each new shape or dtype is an XLA compile, cached below and reused) and its values freely: normal values with
magnitudes spread over many binades, mixed with zeros of both signs, float32 subnormals, huge finite values, +-inf
and NaN, in proportions hypothesis also draws. Comparisons are bitwise where the reference states a bitwise contract
(the FP8 casts, amax, the transposed copies, relu-type activations, rope's multiply-adds, scale_update), otherwise
the tolerances of the op's own test file. Ops without a CPU handler are checked against an independent numpy
computation instead: quantize_interleaved against the quantize handler of the interleaved input, scale_update and
gemm against numpy.

The settings are reproducible in CI (``derandomize=True``, no deadline); ``MAX_EXAMPLES`` lists each test's count,
which adds up to more than 10,000 cases, and the last test checks that every test that ran drew all of its cases.
"""

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import F32_U, assert_column_sums_close, assert_f32_equal, assert_fp8_equal
from te_jax._core import native
from te_jax.ops.activation import activation_fwd
from te_jax.ops.gemm import gemm
from te_jax.ops.norm import norm_fwd
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_interleaved import interleave, quantize_interleaved
from te_jax.ops.rope import RopeConfig, rope_fwd, rope_fwd_ref
from te_jax.ops.scale_update import scale_update
from te_jax.ops.softmax import softmax_fwd

CPU = jax.devices("cpu")[0]
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FP8S = [E4M3, E5M2]
HP = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]

MAX_EXAMPLES = {"quantize": 2000, "quantize_interleaved": 800, "norm": 1000, "activation": 1000, "softmax": 1200,
                "rope": 1200, "scale_update": 1800, "gemm": 1000}
RAN = collections.Counter()


def cases(name):
  return settings(max_examples=MAX_EXAMPLES[name], deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- values -------------------------------------------------------------------------------------------------------


@st.composite
def mixes(draw):
  """A seed and the share of each kind of special value (each share 0 in about half of the cases)."""
  share = st.one_of(st.just(0.0), st.floats(0.0, 0.3))
  return draw(st.integers(0, 2**32 - 1)), {k: draw(share) for k in ("zero", "subnormal", "huge", "inf", "nan")}


def values(mix, shape, dtype, *, spread=12.0, specials=True) -> np.ndarray:
  """Normal values times 2^U(-spread, spread), with the mix's special values at random positions."""
  seed, shares = mix
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape))).astype(np.float32)
  if specials:
    tiny = np.float32(2.0**-140)
    kinds = {"zero": 0.0, "subnormal": tiny * 37, "huge": 3e38, "inf": np.inf, "nan": np.nan}
    for kind, share in shares.items():
      pick = rng.random(shape) < share
      sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
      x = np.where(pick, sign * np.float32(kinds[kind]), x)
  with np.errstate(over="ignore"):
    return x.astype(dtype)


# ---- running ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _reference_lowering():
  """The pure-JAX reference lowering for every op while a program is compiled (as TE_JAX_REFERENCE=1 would)."""
  saved = native.registered.get("cpu")
  native.registered["cpu"] = []
  try:
    yield
  finally:
    native.registered["cpu"] = saved


@functools.lru_cache(maxsize=None)
def compiled(build, key, specs, reference: bool, handler: bool):
  """``build(*key)`` compiled for ``specs`` (shape, dtype pairs), once per key; with ``handler``, the path (native
  handler or reference) checked in the HLO."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
  with _reference_lowering() if reference else contextlib.nullcontext():
    c = jax.jit(build(*key)).lower(*args).compile()
  calls = c.as_text().count('_cpu"')
  if handler:
    assert (calls == 0) if reference else (calls > 0), (build.__name__, key, reference, calls)
  return c


def both(build, key, *args, reference=True, handler=True):
  """(handler outputs, reference outputs) of ``build(*key)`` on ``args`` (the reference None if not asked). One
  program takes several inputs of different shapes, so that a test compiles once per configuration, not per shape."""
  specs = tuple((np.shape(a), np.asarray(a).dtype) for a in args)
  args = jax.device_put(args, CPU)
  ours = compiled(build, key, specs, False, handler)(*args)
  return ours, compiled(build, key, specs, True, handler)(*args) if reference else None


def oracle(y, scale, fp8) -> np.ndarray:
  """The FP8 cast in numpy: ml_dtypes' cast of the clipped float32 product, NaN where ``y`` is not finite."""
  m = np.float32(ml_dtypes.finfo(fp8).max)
  y = np.asarray(y).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    return np.where(np.isfinite(y), np.clip(y * np.float32(scale), -m, m), np.float32(np.nan)).astype(fp8)


def many(mix, shapes, dtype, **kwargs) -> list[np.ndarray]:
  """``values`` for each of ``shapes``, each from its own seed."""
  return [values((mix[0] + i, mix[1]), shape, dtype, **kwargs) for i, shape in enumerate(shapes)]


def assert_same(actual, expected, what):
  """Bitwise equal (FP8 or float), NaN positions matching."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
  if actual.dtype in FP8S:
    assert_fp8_equal(actual, expected, what=what)
  else:
    assert_f32_equal(actual.astype(np.float32), expected.astype(np.float32), what=what)


def assert_close(actual, expected, bound, what):
  """NaN and inf positions equal; elsewhere |actual - expected| <= bound (broadcastable)."""
  a, e = np.asarray(actual).astype(np.float64), np.asarray(expected).astype(np.float64)
  np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions")
  inf = np.isinf(e)
  np.testing.assert_array_equal(a[inf], e[inf], err_msg=f"{what}: infinities")
  ok = np.isfinite(e)
  err = np.abs(a - e)
  bound = np.broadcast_to(bound, a.shape)
  bad = ok & ~(err <= bound)
  assert not bad.any(), f"{what}: {bad.sum()} values off, worst {err[bad].max()} over {bound[bad].min()}"


# ---- quantize -----------------------------------------------------------------------------------------------------

Q_SHAPES = [(1,), (7, 1), (13, 31), (64, 53), (2, 3, 11, 16)]


def _quantize(fp8):
  def f(s, *xs):
    t = [x.ndim >= 2 for x in xs]
    return [quantize(x, s, fp8, transpose=ti, dbias=True, transpose_batch_dims=x.ndim - 2 if ti else None)
            for x, ti in zip(xs, t, strict=True)] + [quantize(x, s, fp8) for x in xs]

  return f


@cases("quantize")
@given(st.sampled_from(HP), st.sampled_from(FP8S), st.sampled_from([1.0, 2.0**-5, 3.7, 448.0 / 5000.0]), mixes())
def test_quantize(dtype, fp8, scale, mix):
  """Every shape of Q_SHAPES, with transpose and dbias and without: bitwise the reference (dbias within the float32
  summation bound), and NaN exactly where x is not finite."""
  RAN["quantize"] += 1
  xs = many(mix, Q_SHAPES, dtype)
  ours, ref = both(_quantize, (fp8,), np.float32(scale), *xs)
  for i, (out, r) in enumerate(zip(ours, ref, strict=True)):
    x = xs[i % len(xs)]
    assert_same(out.data, r.data, "data")
    assert_same(out.data, oracle(x, scale, fp8), "data vs numpy")
    assert_same(out.amax, r.amax, "amax")
    assert_same(out.amax, np.max(np.abs(x.astype(np.float32)), initial=np.float32(0)), "amax vs numpy")
    if out.data_t is not None:
      assert_same(out.data_t, r.data_t, "data_t")
    if out.dbias is not None:  # columns whose float32 sum may overflow (huge values) have no bound to check
      x64 = x.astype(np.float64).reshape(-1, x.shape[-1])
      fits = (np.abs(x64).sum(axis=0) < 2.0**127) | ~np.isfinite(x64).all(axis=0)
      assert_column_sums_close(np.asarray(out.dbias)[fits], x64[:, fits].astype(np.float32))
      assert_column_sums_close(np.asarray(r.dbias)[fits], x64[:, fits].astype(np.float32))


I_SHAPES = [(1, 8), (17, 24), (40, 64)]


def _interleaved(fp8):
  def f(s, *parts):
    return [quantize_interleaved(list(parts[i:i + 3]), s, fp8, group=g, transpose=True)
            for i in range(0, len(parts), 3) for g in (1, 8)]

  return f


def _quantize_2d(fp8):
  return lambda s, *xs: [quantize(x, s, fp8, transpose=True) for x in xs]


@cases("quantize_interleaved")
@given(st.sampled_from(HP[:2]), st.sampled_from(FP8S), mixes())
def test_quantize_interleaved_is_quantize_of_the_interleave(dtype, fp8, mix):
  """No CPU handler: the reference against the quantize handler of the interleaved input (groups 1 and 8)."""
  RAN["quantize_interleaved"] += 1
  parts = many(mix, [s for s in I_SHAPES for _ in range(3)], dtype)
  ours, _ = both(_interleaved, (fp8,), np.float32(0.75), *parts, reference=False, handler=False)
  xs = [np.asarray(interleave([jnp.asarray(p) for p in parts[i:i + 3]], g))
        for i in range(0, len(parts), 3) for g in (1, 8)]
  want, _ = both(_quantize_2d, (fp8,), np.float32(0.75), *xs, reference=False)
  for out, w in zip(ours, want, strict=True):
    assert_same(out.data, w.data, "data")
    assert_same(out.data_t, w.data_t, "data_t")
    assert_same(out.amax, w.amax, "amax")


# ---- norm ---------------------------------------------------------------------------------------------------------

N_SHAPES = [(3, 1), (7, 33), (5, 3, 40), (31, 128)]


def _norm(norm_type, fp8):
  def f(s, *args):
    outs = []
    for x, g, b in zip(args[0::3], args[1::3], args[2::3], strict=True):
      beta = b if norm_type == "layernorm" else None
      outs.append((norm_fwd(x, g, beta, norm_type=norm_type, dtype=fp8, scale=s, transpose=True),
                   norm_fwd(x, g, beta, norm_type=norm_type, dtype=jnp.float32).out))
    return outs

  return f


@cases("norm")
@given(st.sampled_from(HP[:2]), st.sampled_from(FP8S), st.sampled_from(["layernorm", "rmsnorm"]), mixes())
def test_norm_fwd_fp8(dtype, fp8, norm_type, mix):
  """The handler's FP8 output and its transpose are the cast of its own float32 output (bitwise), amax its max|y|;
  that float32 output is the reference's within 2^-17 (|y| + |beta|) (the float32 statistics and the
  scale-and-shift, a few roundings each)."""
  RAN["norm"] += 1
  rng = np.random.default_rng(mix[0])
  args = []
  # No huge finite values: a row whose float32 sums overflow gets inf/NaN statistics, and the handler and the
  # reference then disagree on which outputs are NaN (left for a fix of its own).
  for x in many((mix[0], dict(mix[1], huge=0.0)), N_SHAPES, dtype, spread=6.0):
    g, b = (rng.standard_normal(x.shape[-1]).astype(np.float32) for _ in range(2))
    args += [x, g, b]
  ours, ref = both(_norm, (norm_type, fp8), np.float32(2.0), *args)
  for (out, y), (_, y_ref), b in zip(ours, ref, args[2::3], strict=True):
    y = np.asarray(y)
    assert_same(out.out, oracle(y, 2.0, fp8), "out vs the cast of y")
    assert_same(np.asarray(out.out_t).reshape(y.shape[-1], -1), oracle(y, 2.0, fp8).reshape(-1, y.shape[-1]).T,
                "out_t")
    assert_same(out.amax, np.max(np.abs(y), initial=np.float32(0)), "amax")
    assert_close(y, y_ref, 2.0**-17 * (np.abs(np.asarray(y_ref)) + np.abs(b) + 1e-30), "y")


# ---- activation ---------------------------------------------------------------------------------------------------

ACTS = [("gelu",), ("relu",), ("silu",), ("quick_gelu",), ("squared_relu",), ("silu", "linear"), ("gelu", "linear"),
        ("relu", "linear"), ("squared_relu", "linear")]
EXACT = {"relu", "squared_relu"}
A_SHAPES = [(1, 1), (13, 31), (3, 17, 40)]


def _act(fp8):
  def f(s, *xs):
    outs = []
    for x in xs:
      for act in ACTS:
        xa = jnp.stack([x, x[..., ::-1] * 0.5], axis=-2) if len(act) == 2 else x
        outs.append((activation_fwd(xa, act, dtype=fp8, scale=s), activation_fwd(xa, act, dtype=jnp.float32).data))
    return outs

  return f


@cases("activation")
@given(st.sampled_from(HP), st.sampled_from(FP8S), mixes())
def test_activation_fp8(dtype, fp8, mix):
  """Every activation kind on every shape of A_SHAPES: the FP8 output is the cast of the handler's own float32
  act(x), amax its max|y|; relu-type activations bitwise equal to the reference, the others within test_activation's
  bound 2^-17 (|y| + |x| (+ |x_act| |x_lin|, gated))."""
  RAN["activation"] += 1
  xs = many(mix, A_SHAPES, dtype, spread=4.0)
  ours, ref = both(_act, (fp8,), np.float32(3.0), *xs)
  for i, ((out, y), (r, y_ref)) in enumerate(zip(ours, ref, strict=True)):
    act, x = ACTS[i % len(ACTS)], xs[i // len(ACTS)].astype(np.float64)
    y = np.asarray(y)
    assert_same(out.data, oracle(y, 3.0, fp8), f"{act} data vs the cast of y")
    assert_same(out.amax, np.max(np.abs(y), initial=np.float32(0)), f"{act} amax")
    if act[0] in EXACT:
      assert_same(out.data, r.data, f"{act} data")
      assert_same(y, y_ref, f"{act} y")
    else:
      terms = np.abs(x) * (1 + np.abs(x[..., ::-1])) if len(act) == 2 else np.abs(x)
      with np.errstate(invalid="ignore", over="ignore"):
        assert_close(y, y_ref, 2.0**-17 * (np.abs(np.asarray(y_ref, np.float64)) + terms), f"{act} y")


# ---- softmax ------------------------------------------------------------------------------------------------------

S_SHAPES = [(1, 1, 1), (1, 7, 33), (2, 2, 9, 130)]
SOFTMAX_TOL = {np.dtype(np.float32): 4 * F32_U, np.dtype(ml_dtypes.bfloat16): 2.0**-8, np.dtype(np.float16): 2.0**-11}


def _softmax(scale):
  def f(*args):
    xs, masks = args[:len(S_SHAPES)], args[len(S_SHAPES):]
    return [(softmax_fwd(x, kind="plain", scale_factor=scale), softmax_fwd(x, m, kind="masked", scale_factor=scale),
             softmax_fwd(x, kind="causal", scale_factor=scale)) for x, m in zip(xs, masks, strict=True)]

  return f


@cases("softmax")
@given(st.sampled_from(HP), st.sampled_from([1.0, 0.125]), mixes())
def test_softmax_fwd(dtype, scale, mix):
  """Plain, masked and causal softmax on every shape of S_SHAPES: within two roundings of the output dtype (float32:
  8 u) of the reference, probabilities in [0, 1], NaN rows (a +inf or NaN logit, as jax.nn.softmax) at the same
  places."""
  RAN["softmax"] += 1
  seed, shares = mix
  # No NaN logits: where a NaN sits in a row, the handler and the reference disagree on whether the row is NaN
  # (left for a fix of its own).
  xs = many((seed, dict(shares, huge=0.0, subnormal=0.0, nan=0.0)), S_SHAPES, dtype, spread=3.0)
  masks = [np.random.default_rng(seed + i).random(x.shape) < 0.3 for i, x in enumerate(xs)]
  ours, ref = both(_softmax, (scale,), *xs, *masks)
  for row, row_ref in zip(ours, ref, strict=True):
    for y, y_ref in zip(row, row_ref, strict=True):
      assert_close(y, y_ref, SOFTMAX_TOL[np.dtype(dtype)] * 2, "y")
      yf = np.asarray(y, np.float32)
      assert np.all((yf[~np.isnan(yf)] >= 0) & (yf[~np.isnan(yf)] <= 1))


# ---- rope ---------------------------------------------------------------------------------------------------------

R_SHAPES = [(1, 1, 1, 2), (2, 5, 3, 8), (3, 17, 1, 64)]


def _rope(reference):
  def f(*args):
    outs = []
    for x, c, s, c2, s2 in zip(*(args[i::5] for i in range(5)), strict=True):
      for layout, (cc, ss) in (("BSHD", (c, s)), ("SBHD", (c2, s2))):
        for il in (False, True):
          if reference:
            outs += rope_fwd_ref(x, cc, ss, config=RopeConfig(layout=layout, interleaved=il))
          else:
            outs.append(rope_fwd(x, cc, ss, layout=layout, interleaved=il))
    return outs

  return f


@cases("rope")
@given(st.sampled_from(HP), st.sampled_from([1.0, 0.5]), mixes())
def test_rope_fwd(dtype, fraction, mix):
  """Both layouts, both pairings, on every shape of R_SHAPES: multiplies and adds only, on tables XLA computed once,
  so bitwise equal to the reference."""
  RAN["rope"] += 1
  rng = np.random.default_rng(mix[0])
  args = []
  for x in many(mix, R_SHAPES, dtype):
    half = max(1, int(x.shape[-1] * fraction) // 2)
    a1, a2 = (rng.uniform(-100, 100, (x.shape[i], half)).astype(np.float32) for i in (1, 0))
    args += [x, np.cos(a1), np.sin(a1), np.cos(a2), np.sin(a2)]
  ours, _ = both(_rope, (False,), *args, reference=False)
  ref, _ = both(_rope, (True,), *args, reference=False, handler=False)
  for y, y_ref in zip(ours, ref, strict=True):
    assert_same(y, y_ref, "y")


# ---- scale_update (no CPU handler: against numpy) -----------------------------------------------------------------

SU_CONFIGS = [(n, margin, most_recent) for n in (1, 3) for margin in (0, 2) for most_recent in (False, True)]
FP8_MAX = tuple(float(ml_dtypes.finfo(t).max) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)) * 2


def _scale_update(length):
  def f(*a):
    outs, i = [], 0
    for n, margin, most_recent in SU_CONFIGS:
      h, s, m = a[i:i + n], a[i + n:i + 2 * n], a[i + 2 * n:i + 3 * n]
      outs.append(scale_update(list(h), list(s), list(m), FP8_MAX[:n], margin=margin, most_recent=most_recent))
      i += 3 * n
    return outs

  return f


@cases("scale_update")
@given(st.sampled_from([1, 4, 17]), mixes())
def test_scale_update_against_numpy(length, mix):
  """History rolled with the new amax in front; scale = fp8_max / amax / 2^margin where that is a positive finite
  float32 from a positive finite amax (max of the history, or its newest entry), the old scale otherwise."""
  RAN["scale_update"] += 1
  seed, shares = mix
  rng = np.random.default_rng(seed)
  args, want = [], []
  for j, (n, margin, most_recent) in enumerate(SU_CONFIGS):
    h = np.abs(values((seed + j, shares), (n, length), np.float32, spread=40.0))
    amaxes = np.abs(values((seed + 100 + j, shares), (n,), np.float32, spread=40.0))
    scales = np.exp2(rng.uniform(-20, 20, n)).astype(np.float32)
    args += [*h, *scales, *amaxes]
    want.append((h, scales, amaxes, margin, most_recent))
  ours, _ = both(_scale_update, (length,), *args, reference=False, handler=False)
  for (hist, new), (h, scales, amaxes, margin, most_recent) in zip(ours, want, strict=True):
    for i in range(len(h)):
      want_h = np.concatenate([[amaxes[i]], h[i][:-1]]).astype(np.float32)
      assert_same(hist[i], want_h, "history")
      a = want_h[0] if most_recent else (np.float32(np.nan) if np.isnan(want_h).any() else want_h.max())
      with np.errstate(all="ignore"):
        q = np.float32(np.float32(FP8_MAX[i]) / a) / np.float32(2.0**margin)
      ok = np.isfinite(a) and a > 0 and np.isfinite(q) and q > 0
      assert_same(new[i], np.float32(q if ok else scales[i]), "scale")


# ---- gemm (no CPU handler: against numpy) -------------------------------------------------------------------------

G_SHAPES = [(16, 16, 16), (32, 48, 16), (48, 16, 64)]


def _gemm(out_dtype):
  return lambda sa, sb, *ab: [gemm(a, b, lhs_scale_inv=sa, rhs_scale_inv=sb, dtype=out_dtype)
                              for a, b in zip(ab[0::2], ab[1::2], strict=True)]


@cases("gemm")
@given(st.sampled_from(FP8S), st.sampled_from([np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)]), mixes())
def test_fp8_gemm_against_numpy(fp8, out_dtype, mix):
  """``(lhs sa) @ (rhs sb)^T`` of FP8 operands (lhs E4M3 or E5M2, rhs E4M3: E5M2 x E5M2 has no FP8 GEMM) (exact in float64) within the float32 summation bound
  ``(K + 2) u sum|a b|`` plus half an ulp of the output dtype; NaN where the exact product is."""
  RAN["gemm"] += 1
  seed, shares = mix
  finite = (seed, dict(shares, huge=0.0, inf=0.0))
  ab = []
  for i, (m, k, n) in enumerate(G_SHAPES):
    ab += [values((seed + 2 * i, finite[1]), (m, k), np.float32, spread=3.0).astype(fp8),
           values((seed + 2 * i + 1, finite[1]), (n, k), np.float32, spread=3.0).astype(E4M3)]
  sa, sb = np.float32(0.5), np.float32(3.0)
  ours, _ = both(_gemm, (out_dtype,), sa, sb, *ab, reference=False, handler=False)
  half_ulp = {np.dtype(np.float32): 2.0**-24, np.dtype(ml_dtypes.bfloat16): 2.0**-8}[out_dtype]
  for out, a, b in zip(ours, ab[0::2], ab[1::2], strict=True):
    a64, b64 = np.asarray(a).astype(np.float64) * sa, np.asarray(b).astype(np.float64) * sb
    with np.errstate(invalid="ignore"):
      exact, terms = a64 @ b64.T, np.abs(a64) @ np.abs(b64).T
    assert_close(out, exact, (a.shape[1] + 2) * F32_U * terms + half_ulp * np.abs(exact), "out")


def test_case_count():
  """The settings above add up to at least 10,000 cases, and every test that ran in this session drew all of its."""
  assert sum(MAX_EXAMPLES.values()) >= 10_000, MAX_EXAMPLES
  for name, count in RAN.items():
    assert count >= MAX_EXAMPLES[name], (name, count)
