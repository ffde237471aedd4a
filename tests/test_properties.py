"""Property-based tests (hypothesis): each primitive's CPU handler against its reference on random values.

Every op takes a small fixed list of shapes at once (size-1 dims, odd sizes, rows not a multiple of 16, ranks 1 to 4,
up to a few thousand elements) and draws its values freely: normal values with magnitudes spread over many binades,
mixed with zeros of both signs, subnormals of the input dtype, huge finite values, +-inf and NaN, in proportions
hypothesis also draws (none of them in about a quarter of the cases). Comparisons are bitwise where the reference
states a bitwise contract (the FP8 casts, amax, the transposed copies, relu-type activations, rope's multiply-adds,
scale_update); otherwise within the tolerance the op's module or test file states, with its reason next to it. Ops
without a CPU handler are checked against an independent computation instead: quantize_interleaved against the quantize
handler of the interleaved input, scale_update and gemm against numpy.

XLA:CPU runs programs, custom-call handlers included, with flush-to-zero and denormals-are-zero: a float32 subnormal
counts as 0 in arithmetic, so the tolerances of sums and normalizations allow 2^-126 per rounding (amax works on the
bits, and the FP8 casts round such values to 0 either way).

Example counts come from the profile that HYPOTHESIS_PROFILE names: "fast" (the default, about 1,100 cases: CI and
every run of the suite) or "thorough" (ten times as many, more than 10,000). Both draw the same way each run
(``derandomize=True``) and have no deadline. A program is compiled once per configuration (op, dtype, format) and
takes every shape of its list at once; a reference program only computes what its test compares (the reference's FP8
casts are quantize's, compared bitwise there). test_case_count checks that the cases hold what the strategies are for.
"""

import collections
import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import F32_U, assert_column_sums_close, assert_f32_equal, assert_fp8_equal
from te_jax import QuantizedTensor
from te_jax._core import native
from te_jax.ops.activation import activation_fwd
from te_jax.ops.gemm import gemm
from te_jax.ops.norm import norm_fwd
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_interleaved import quantize_interleaved
from te_jax.ops.rope import RopeConfig, rope_fwd, rope_fwd_ref
from te_jax.ops.scale_update import scale_update
from te_jax.ops.softmax import softmax_fwd

CPU = jax.devices("cpu")[0]
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FP8S = [E4M3, E5M2]
HP = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]

# ---- profiles -------------------------------------------------------------------------------------------------------

for _name in ("fast", "thorough"):
  settings.register_profile(_name, deadline=None, derandomize=True, database=None,
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")
if PROFILE not in ("fast", "thorough"):
  raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: tests/test_properties.py knows 'fast' (default) and 'thorough'")

#: Cases per test in each profile: (fast, thorough).
EXAMPLES = {"quantize": (200, 2000), "quantize_interleaved": (80, 800), "norm": (100, 1000), "activation": (100, 1000),
            "softmax": (120, 1200), "rope": (120, 1200), "scale_update": (180, 1800), "gemm": (100, 1000)}


def examples(name) -> int:
  return EXAMPLES[name][PROFILE == "thorough"]


def cases(name):
  return settings(settings.get_profile(PROFILE), max_examples=examples(name))


# ---- values -------------------------------------------------------------------------------------------------------

KINDS = ("zero", "subnormal", "huge", "inf", "nan")


@st.composite
def mixes(draw):
  """A seed and the share of each kind of special value: none at all in about a quarter of the cases, otherwise each
  share 0 in about half of them."""
  seed = draw(st.integers(0, 2**32 - 1))
  if draw(st.integers(0, 3)) == 3:
    return seed, dict.fromkeys(KINDS, 0.0)
  share = st.one_of(st.just(0.0), st.floats(0.0, 0.3))
  return seed, {k: draw(share) for k in KINDS}


def values(mix, shape, dtype, *, spread=12.0, huge=3e38) -> np.ndarray:
  """Normal values times 2^U(-spread, spread), with the mix's special values at random positions, each of either
  sign: 0, a subnormal of ``dtype`` (37 of its smallest steps), ``huge`` (at most the dtype's largest finite value),
  inf and NaN."""
  seed, shares = mix
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape))).astype(np.float32)
  info = ml_dtypes.finfo(dtype)
  special = {"zero": 0.0, "subnormal": float(info.smallest_subnormal) * 37, "huge": min(huge, float(info.max)),
             "inf": np.inf, "nan": np.nan}
  for kind, share in shares.items():
    pick = rng.random(shape) < share
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0).astype(np.float32)
    x = np.where(pick, sign * np.float32(special[kind]), x)
  with np.errstate(over="ignore"):
    return x.astype(dtype)


def many(mix, shapes, dtype, **kwargs) -> list[np.ndarray]:
  """``values`` for each of ``shapes``, each from its own seed."""
  return [values((mix[0] + i, mix[1]), shape, dtype, **kwargs) for i, shape in enumerate(shapes)]


# ---- what the cases hold ------------------------------------------------------------------------------------------

#: Per test: the cases run in this session, and in how many of them the inputs held each kind of value (see
#: ``value_kinds``) and each sampled dtype, format or variant. test_case_count checks them.
RAN = collections.Counter()
SEEN = collections.defaultdict(collections.Counter)
#: Per test: the function that makes a case's inputs from the drawn arguments (returning the arrays of drawn values
#: first), and the strategies it is drawn from.
PROPERTIES = {}


def value_kinds(a) -> set[str]:
  """Which kinds of values ``a`` holds: nan, inf, huge (finite, |x| >= 2^99 or half of a's dtype's largest value),
  subnormal (of a's own dtype), zero."""
  a = np.asarray(a)
  f, info = np.abs(a.astype(np.float32)), ml_dtypes.finfo(a.dtype)
  found = {"nan": np.isnan(f).any(), "inf": np.isinf(f).any(),
           "huge": (np.isfinite(f) & (f >= min(2.0**99, float(info.max) / 2))).any(),
           "subnormal": ((f > 0) & (f < float(info.smallest_normal))).any(), "zero": (f == 0).any()}
  return {k for k, v in found.items() if v}


def label(arg) -> str | None:
  """The name a drawn argument is counted under: dtypes and strings (formats, norm types); None for the rest."""
  if isinstance(arg, str):
    return arg
  if isinstance(arg, np.dtype):
    return arg.name
  return None


def case(name, *args):
  """The inputs of one case of test ``name``, its value kinds and labels counted."""
  inputs = PROPERTIES[name][0](*args)
  kinds = set().union(*(value_kinds(a) for a in inputs[0]))
  kinds.add("non-finite" if kinds & {"nan", "inf"} else "finite")
  if not kinds & set(KINDS):
    kinds.add("plain")
  SEEN[name].update(kinds | {label(a) for a in args} - {None})
  RAN[name] += 1
  return inputs


def prop(name, make_inputs, *strategies):
  """Test ``name``: ``make_inputs`` registered, the profile's settings, hypothesis drawing ``strategies``."""
  PROPERTIES[name] = (make_inputs, strategies)

  def decorate(test):
    return cases(name)(given(*strategies)(test))

  return decorate


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
def compiled(build, key, specs, reference: bool, check: bool):
  """``build(*key)`` compiled for ``specs`` (shape, dtype pairs), once per key; lowered through the native handlers,
  or with ``reference`` the pure-JAX reference; with ``check``, that path checked in the HLO."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
  with _reference_lowering() if reference else contextlib.nullcontext():
    c = jax.jit(build(*key)).lower(*args).compile()
  calls = c.as_text().count('_cpu"')
  if check:
    assert (calls == 0) if reference else (calls > 0), (build.__name__, key, reference, calls)
  return c


def run(build, key, *args, reference=False, check=True):
  """The outputs of ``build(*key)`` on ``args``, through the handlers (or the reference lowering). One program takes
  several inputs of different shapes, so that a test compiles once per configuration, not per shape."""
  specs = tuple((np.shape(a), np.asarray(a).dtype) for a in args)
  return compiled(build, key, specs, reference, check)(*jax.device_put(args, CPU))


def oracle(y, scale, fp8) -> np.ndarray:
  """The FP8 cast in numpy: ml_dtypes' cast of the clipped float32 product, NaN where ``y`` is not finite."""
  m = np.float32(ml_dtypes.finfo(fp8).max)
  y = np.asarray(y).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    return np.where(np.isfinite(y), np.clip(y * np.float32(scale), -m, m), np.float32(np.nan)).astype(fp8)


def np_amax(y) -> np.float32:
  return np.max(np.abs(np.asarray(y).astype(np.float32)), initial=np.float32(0))


def assert_same(actual, expected, what):
  """Bitwise equal (FP8 or float), NaN positions matching."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
  if actual.dtype in FP8S:
    assert_fp8_equal(actual, expected, what=what)
  else:
    assert_f32_equal(actual.astype(np.float32), expected.astype(np.float32), what=what)


def assert_close(actual, expected, bound, what, where=None):
  """NaN and inf positions equal; elsewhere |actual - expected| <= bound (broadcastable); only ``where`` (a
  broadcastable mask) if given."""
  a, e = np.asarray(actual).astype(np.float64), np.asarray(expected).astype(np.float64)
  where = np.ones(a.shape, bool) if where is None else np.broadcast_to(where, a.shape)
  np.testing.assert_array_equal(np.isnan(a)[where], np.isnan(e)[where], err_msg=f"{what}: NaN positions")
  inf = np.isinf(e) & where
  np.testing.assert_array_equal(a[inf], e[inf], err_msg=f"{what}: infinities")
  ok = np.isfinite(e) & where
  err = np.abs(a - e)
  bound = np.broadcast_to(bound, a.shape)
  bad = ok & ~(err <= bound)
  assert not bad.any(), f"{what}: {bad.sum()} values off, worst {err[bad].max()} over {bound[bad].min()}"


def higham(n: int) -> float:
  """gamma_n = n u / (1 - n u): the bound of n float32 roundings in a row (Higham, Accuracy and Stability, 3.1)."""
  return n * F32_U / (1 - n * F32_U)


# ---- quantize -----------------------------------------------------------------------------------------------------

Q_SHAPES = [(1,), (7, 1), (13, 31), (64, 53), (2, 3, 11, 16)]


def _quantize(fp8, reference):
  """Each x with dbias and (rank >= 2) its transposed copy; the handler program also without them (the kernel's plain
  path). Without them the reference is the same function of x (one cast, one amax), so it computes them once."""
  def f(s, *xs):
    full = [quantize(x, s, fp8, transpose=x.ndim >= 2, dbias=True,
                     transpose_batch_dims=x.ndim - 2 if x.ndim >= 2 else None) for x in xs]
    return full if reference else full + [quantize(x, s, fp8) for x in xs]

  return f


def quantize_inputs(dtype, fp8, scale, mix):
  del fp8, scale
  return (many(mix, Q_SHAPES, dtype),)


@prop("quantize", quantize_inputs, st.sampled_from(HP), st.sampled_from(FP8S),
      st.sampled_from([1.0, 2.0**-5, 3.7, 448.0 / 5000.0]), mixes())
def test_quantize(dtype, fp8, scale, mix):
  """Every shape of Q_SHAPES, with transpose and dbias and without: data, data_t and amax bitwise the reference and
  numpy (NaN exactly where x is not finite), dbias within the float32 summation bound (conftest's
  assert_column_sums_close, which says what a column that holds inf or NaN, or may overflow, must give)."""
  (xs,) = case("quantize", dtype, fp8, scale, mix)
  s = np.float32(scale)
  ours = run(_quantize, (fp8, False), s, *xs)
  ref = run(_quantize, (fp8, True), s, *xs, reference=True)
  for i, x in enumerate(xs):
    want, r = oracle(x, scale, fp8), ref[i]
    for out in (ours[i], ours[len(xs) + i]):
      assert_same(out.out.data, r.out.data, "data")
      assert_same(out.out.data, want, "data vs numpy")
      assert_same(out.amax, r.amax, "amax")
      assert_same(out.amax, np_amax(x), "amax vs numpy")
    if x.ndim >= 2:
      assert_same(ours[i].out.data_t, r.out.data_t, "data_t")
      assert_same(ours[i].out.data_t, want.swapaxes(-1, -2), "data_t vs numpy")
    assert_column_sums_close(np.asarray(ours[i].dbias), x)
    assert_column_sums_close(np.asarray(r.dbias), x)


# ---- quantize_interleaved (no CPU handler) ------------------------------------------------------------------------

I_SHAPES = [(1, 8), (17, 24), (40, 64)]


def _interleaved(fp8):
  def f(s, *parts):
    return [quantize_interleaved(list(parts[i:i + 3]), s, fp8, group=g, transpose=True)
            for i in range(0, len(parts), 3) for g in (1, 8)]

  return f


def _quantize_2d(fp8):
  return lambda s, *xs: [quantize(x, s, fp8, transpose=True) for x in xs]


def numpy_interleave(parts, group: int) -> np.ndarray:
  """The parts' column chunks of ``group``, one chunk of each part in turn (te_jax.ops.quantize_interleaved's x)."""
  rows, cols = parts[0].shape
  return np.stack([p.reshape(rows, cols // group, group) for p in parts], axis=-2).reshape(rows, len(parts) * cols)


def interleaved_inputs(dtype, fp8, mix):
  del fp8
  return (many(mix, [s for s in I_SHAPES for _ in range(3)], dtype),)


@prop("quantize_interleaved", interleaved_inputs, st.sampled_from(HP[:2]), st.sampled_from(FP8S), mixes())
def test_quantize_interleaved_is_quantize_of_the_interleave(dtype, fp8, mix):
  """No CPU handler: the reference against the quantize handler of the interleaved input (groups 1 and 8)."""
  (parts,) = case("quantize_interleaved", dtype, fp8, mix)
  ours = run(_interleaved, (fp8,), np.float32(0.75), *parts, check=False)
  xs = [numpy_interleave(parts[i:i + 3], g) for i in range(0, len(parts), 3) for g in (1, 8)]
  want = run(_quantize_2d, (fp8,), np.float32(0.75), *xs)
  for out, w in zip(ours, want, strict=True):
    assert_same(out.out.data, w.out.data, "data")
    assert_same(out.out.data_t, w.out.data_t, "data_t")
    assert_same(out.amax, w.amax, "amax")


# ---- norm ---------------------------------------------------------------------------------------------------------

N_SHAPES = [(3, 1), (7, 33), (5, 3, 40), (31, 128)]
EPS = 1e-6  # norm_fwd's default epsilon
# The norm's huge values: far beyond what float32 statistics hold (a row holding one has a sum of squares past
# float32's range), well inside what the CPU handler's float64 statistics and float32 elementwise part hold (|x| <
# 2^125: x - mean and sigma stay finite, rsigma a normal float32). Beyond that, no implementation has a defined result
# (x - mean itself may overflow float32).
NORM_HUGE = 2.0**100


def _norm(norm_type, fp8):
  """Each (x, gamma, beta): the float32 output, and with ``fp8`` first the FP8 output with its transposed copy."""
  def f(s, *args):
    outs = []
    for x, g, b in zip(args[0::3], args[1::3], args[2::3], strict=True):
      beta = b if norm_type == "layernorm" else None
      y = norm_fwd(x, g, beta, norm_type=norm_type, dtype=jnp.float32, epsilon=EPS).out
      outs.append(y if fp8 is None else
                  (norm_fwd(x, g, beta, norm_type=norm_type, dtype=fp8, scale=s, transpose=True, epsilon=EPS), y))
    return outs

  return f


def norm64(x, g, b):
  """The float64 normalization of float64 ``x`` (``b`` None for RMSNorm), and the bound of test_norm's
  test_reference_against_float64 for a float32 computation of it: gamma_{n+10} (|xhat g| + |beta| + the shift
  |g| rsigma mean|x| that the mean's error (up to gamma_n mean|x|) gives every x - mean of the row), plus 2^-122 (1 +
  rsigma |g|) for flush-to-zero (a subnormal x, the mean, each product)."""
  with np.errstate(all="ignore"):
    mean = 0.0 if b is None else np.mean(x, axis=-1, keepdims=True)
    rs = 1.0 / np.sqrt(np.mean((x - mean) ** 2, axis=-1, keepdims=True) + float(np.float32(EPS)))
    t = (x - mean) * rs * g
    shift = 0.0 if b is None else np.abs(g) * rs * np.mean(np.abs(x), axis=-1, keepdims=True)
    bb = 0.0 if b is None else b
    bound = higham(x.shape[-1] + 10) * (np.abs(t) + np.abs(bb) + shift) + 2.0**-122 * (1 + rs * np.abs(g))
  return t + bb, bound


def norm_inputs(dtype, fp8, norm_type, mix):
  del fp8, norm_type
  rng = np.random.default_rng(mix[0])
  xs = many(mix, N_SHAPES, dtype, spread=6.0, huge=NORM_HUGE)
  params = [tuple(rng.standard_normal(x.shape[-1]).astype(np.float32) for _ in range(2)) for x in xs]
  return xs, params


def fits_float32_statistics(x64) -> np.ndarray:
  """Per row (keepdims): whether no float32 sum of the statistics can overflow: n (2 max|x|)^2 < 2^126 bounds
  sum(x), sum((x - mean)^2) and sum(x^2) in any order. NaN/inf entries count as 0 (those rows are NaN anyway)."""
  big = np.max(np.abs(np.where(np.isfinite(x64), x64, 0.0)), axis=-1, keepdims=True)
  return 4.0 * x64.shape[-1] * big**2 < 2.0**126


def beyond_float32_statistics(xs) -> bool:
  """Whether a row of finite values of ``xs`` has statistics that float32 sums may not hold."""
  rows = [x.astype(np.float64) for x in xs]
  return any((np.isfinite(x).all(-1, keepdims=True) & ~fits_float32_statistics(x)).any() for x in rows)


@prop("norm", norm_inputs, st.sampled_from(HP[:2]), st.sampled_from(FP8S), st.sampled_from(["layernorm", "rmsnorm"]),
      mixes())
def test_norm_fwd_fp8(dtype, fp8, norm_type, mix):
  """The handler's FP8 output and its transpose are the cast of its own float32 output y (bitwise), amax its max|y|.
  Rows of finite x: y within norm64's bound of the float64 normalization, for the handler (float64 statistics) on
  every such row, for the reference on rows whose float32 statistics cannot overflow. The reference's float32 sums
  overflow on the others (rows holding NORM_HUGE): they are left out of its comparison here, and
  test_norm_beyond_float32_statistics says what both give there. Rows holding inf or NaN: y NaN there (LayerNorm:
  the whole row), the same positions NaN in the handler and the reference."""
  xs, params = case("norm", dtype, fp8, norm_type, mix)
  if beyond_float32_statistics(xs):
    SEEN["norm"]["stats overflow"] += 1
  args = [a for x, (g, b) in zip(xs, params, strict=True) for a in (x, g, b)]
  ours = run(_norm, (norm_type, fp8), np.float32(2.0), *args)
  ref = run(_norm, (norm_type, None), np.float32(2.0), *args, reference=True)
  for (out, y), y_ref, x, (g, b) in zip(ours, ref, xs, params, strict=True):
    y, y_ref, x64 = np.asarray(y), np.asarray(y_ref), x.astype(np.float64)
    assert_same(out.out.data, oracle(y, 2.0, fp8), "out vs the cast of y")
    assert_same(np.asarray(out.out.data_t).reshape(y.shape[-1], -1), oracle(y, 2.0, fp8).reshape(-1, y.shape[-1]).T,
                "out_t")
    assert_same(out.amax, np_amax(y), "amax")
    y64, bound = norm64(x64, g, b if norm_type == "layernorm" else None)
    finite = np.isfinite(x64).all(axis=-1, keepdims=True)
    fits = fits_float32_statistics(x64)
    assert_close(y, y64, bound, "y (handler) vs float64", where=finite)
    assert_close(y_ref, y64, bound, "y (reference) vs float64", where=finite & fits)
    rows = np.broadcast_to(~finite, y.shape)
    np.testing.assert_array_equal(np.isnan(y)[rows], np.isnan(y_ref)[rows], err_msg="NaN positions, rows with inf/NaN")
    assert np.isnan(y[~np.isfinite(x64)]).all(), "a non-finite x gives NaN"
    if norm_type == "layernorm":
      assert np.isnan(y[rows]).all(), "LayerNorm: a row holding inf or NaN is NaN"


def test_norm_beyond_float32_statistics():
  """The rows test_norm_fwd_fp8 leaves out of the reference's comparison: finite x (below 2^125) whose float32 sum of
  squares overflows. The CPU handler's float64 statistics normalize them (within norm64's bound); the reference's
  float32 ones overflow: rsigma 0, so LayerNorm gives beta and RMSNorm 0, or LayerNorm NaN throughout where the row's
  sum overflows too (the mean is inf). A row with an inf gives NaN on both paths (LayerNorm: the whole row; RMSNorm:
  the inf itself, rsigma being 0)."""
  n = 40
  x = np.resize(np.array([0.5, -1.0, 2.0, 0.0, 3.0, -0.25, 1.5], np.float32), (4, n))
  x[0, :2] = [2.0**100, -2.0**100]  # the sum of squares overflows float32, the sum does not
  x[1, :20] = 2.0**124  # both do: the reference's mean is inf
  x[2, [0, 5]] = [1e20, -1e20]
  x[3, 3] = np.inf
  g = np.linspace(0.5, 1.5, n).astype(np.float32)
  b = np.linspace(-1, 1, n).astype(np.float32)
  for norm_type in ("layernorm", "rmsnorm"):
    layer = norm_type == "layernorm"
    (y,) = run(_norm, (norm_type, None), np.float32(1), x, g, b)
    (y_ref,) = run(_norm, (norm_type, None), np.float32(1), x, g, b, reference=True)
    y, y_ref = np.asarray(y), np.asarray(y_ref)
    assert not fits_float32_statistics(x[:3].astype(np.float64)).any()
    y64, bound = norm64(x[:3].astype(np.float64), g, b if layer else None)
    assert_close(y[:3], y64, bound, f"{norm_type}: the handler on rows beyond float32 statistics")
    if layer:
      np.testing.assert_array_equal(y_ref[[0, 2]], np.broadcast_to(b, (2, n)))
      assert np.isnan(y_ref[1]).all() and np.isnan(y[3]).all() and np.isnan(y_ref[3]).all()
    else:
      np.testing.assert_array_equal(y_ref[:3], 0.0)
      for yy in (y, y_ref):
        assert np.isnan(yy[3, 3]) and np.all(np.delete(yy[3], 3) == 0.0)


# ---- activation ---------------------------------------------------------------------------------------------------

ACTS = [("gelu",), ("relu",), ("silu",), ("quick_gelu",), ("squared_relu",), ("silu", "linear"), ("gelu", "linear"),
        ("relu", "linear"), ("squared_relu", "linear")]
EXACT = {"relu", "squared_relu"}
A_SHAPES = [(1, 1), (13, 31), (3, 17, 40)]


def _act(fp8):
  """Every activation kind on each x: the float32 act(x), and with ``fp8`` first the FP8 output (gated kinds take
  x next to its reversal times 0.5)."""
  def f(s, *xs):
    outs = []
    for x in xs:
      for act in ACTS:
        xa = jnp.stack([x, x[..., ::-1] * 0.5], axis=-2) if len(act) == 2 else x
        y = activation_fwd(xa, act, dtype=jnp.float32).out
        outs.append(y if fp8 is None else (activation_fwd(xa, act, dtype=fp8, scale=s), y))
    return outs

  return f


def activation_inputs(dtype, fp8, mix):
  del fp8
  return (many(mix, A_SHAPES, dtype, spread=4.0),)


@prop("activation", activation_inputs, st.sampled_from(HP), st.sampled_from(FP8S), mixes())
def test_activation_fp8(dtype, fp8, mix):
  """Every activation kind on every shape of A_SHAPES: the FP8 output is the cast of the handler's own float32
  act(x), amax its max|y|; relu-type activations bitwise equal to the reference, the others within test_activation's
  bound 2^-17 (|y| + |x| (+ |x_act| |x_lin|, gated))."""
  (xs,) = case("activation", dtype, fp8, mix)
  ours = run(_act, (fp8,), np.float32(3.0), *xs)
  ref = run(_act, (None,), np.float32(3.0), *xs, reference=True)
  for i, ((out, y), y_ref) in enumerate(zip(ours, ref, strict=True)):
    act, x = ACTS[i % len(ACTS)], xs[i // len(ACTS)].astype(np.float64)
    y = np.asarray(y)
    assert_same(out.out.data, oracle(y, 3.0, fp8), f"{act} data vs the cast of y")
    assert_same(out.amax, np_amax(y), f"{act} amax")
    if act[0] in EXACT:
      assert_same(y, y_ref, f"{act} y")
    else:
      with np.errstate(invalid="ignore", over="ignore"):
        terms = np.abs(x) * (1 + np.abs(x[..., ::-1])) if len(act) == 2 else np.abs(x)
        assert_close(y, y_ref, 2.0**-17 * (np.abs(np.asarray(y_ref, np.float64)) + terms), f"{act} y")


# ---- softmax ------------------------------------------------------------------------------------------------------

S_SHAPES = [(1, 1, 1), (1, 7, 33), (2, 2, 9, 130)]
SOFTMAX_KINDS = ("plain", "masked", "causal")


def _softmax(scale):
  def f(*args):
    xs, masks = args[:len(S_SHAPES)], args[len(S_SHAPES):]
    return [(softmax_fwd(x, kind="plain", scale_factor=scale), softmax_fwd(x, m, kind="masked", scale_factor=scale),
             softmax_fwd(x, kind="causal", scale_factor=scale)) for x, m in zip(xs, masks, strict=True)]

  return f


def softmax64(x, masked, scale) -> np.ndarray:
  """The formulas of te_jax.ops.softmax in float64 (``masked``: True = masked out) on the float32 ``scale * x``."""
  z = (x.astype(np.float32) * np.float32(scale)).astype(np.float64)
  z = np.where(masked, -np.inf, z)
  with np.errstate(invalid="ignore", over="ignore"):
    m = np.max(z, axis=-1, keepdims=True)
    empty = m == -np.inf
    e = np.exp(z - np.where(empty, 0.0, m))
    return np.where(empty, 0.0, e / np.sum(e, axis=-1, keepdims=True))


def softmax_inputs(dtype, scale, mix):
  del scale
  xs = many(mix, S_SHAPES, dtype, spread=3.0, huge=float(ml_dtypes.finfo(dtype).max) / 2)
  masks = [np.random.default_rng(mix[0] + i).random(x.shape) < 0.3 for i, x in enumerate(xs)]
  return xs, masks


@prop("softmax", softmax_inputs, st.sampled_from(HP), st.sampled_from([1.0, 0.125]), mixes())
def test_softmax_fwd(dtype, scale, mix):
  """Plain, masked and causal softmax on every shape of S_SHAPES, against the float64 formulas: NaN rows exactly
  where they have them (a +inf logit, or a NaN one where it is not masked, makes the whole row NaN), masked positions
  of the other rows exactly 0, probabilities in [0, 1], and te_jax.ops.softmax's tolerance rule: the handler's largest
  error at most twice the reference's (at the same input and output dtype) plus 4 float32 roundings of the largest
  output."""
  xs, masks = case("softmax", dtype, scale, mix)
  ours = run(_softmax, (scale,), *xs, *masks)
  ref = run(_softmax, (scale,), *xs, *masks, reference=True)
  for x, mask, outs, refs in zip(xs, masks, ours, ref, strict=True):
    causal = np.arange(x.shape[-1])[None, :] > np.arange(x.shape[-2])[:, None]
    for kind, y, y_ref in zip(SOFTMAX_KINDS, outs, refs, strict=True):
      masked = {"plain": np.zeros(x.shape, bool), "masked": mask, "causal": np.broadcast_to(causal, x.shape)}[kind]
      y64 = softmax64(x, masked, scale)
      nan = np.isnan(y64)
      errs = []
      for name, v in (("handler", y), ("reference", y_ref)):
        v = np.asarray(v).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(v), nan, err_msg=f"{kind} {name}: NaN positions")
        assert np.all(v[masked & ~nan] == 0.0), f"{kind} {name}: masked positions must be exactly 0"
        assert np.all((v[~nan] >= 0) & (v[~nan] <= 1)), f"{kind} {name}: not a probability"
        errs.append(np.max(np.abs(v - y64)[~nan], initial=0.0))
      noise = 4 * F32_U * np.max(y64[~nan], initial=0.0)
      assert errs[0] <= 2 * errs[1] + noise, f"{kind} {x.shape}: error {errs[0]} > 2 * {errs[1]} + {noise}"


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


def rope_inputs(dtype, fraction, mix):
  rng = np.random.default_rng(mix[0])
  xs, tables = many(mix, R_SHAPES, dtype), []
  for x in xs:
    half = max(1, int(x.shape[-1] * fraction) // 2)
    a1, a2 = (rng.uniform(-100, 100, (x.shape[i], half)).astype(np.float32) for i in (1, 0))
    tables.append((np.cos(a1), np.sin(a1), np.cos(a2), np.sin(a2)))
  return xs, tables


@prop("rope", rope_inputs, st.sampled_from(HP), st.sampled_from([1.0, 0.5]), mixes())
def test_rope_fwd(dtype, fraction, mix):
  """Both layouts, both pairings, on every shape of R_SHAPES: multiplies and adds only, on tables XLA computed once,
  so bitwise equal to the reference."""
  xs, tables = case("rope", dtype, fraction, mix)
  args = [a for x, t in zip(xs, tables, strict=True) for a in (x, *t)]
  ours = run(_rope, (False,), *args)
  ref = run(_rope, (True,), *args, check=False)
  for y, y_ref in zip(ours, ref, strict=True):
    assert_same(y, y_ref, "y")


# ---- scale_update (no CPU handler: against numpy) -----------------------------------------------------------------

SU_CONFIGS = [(n, margin, most_recent) for n in (1, 3) for margin in (0, 2) for most_recent in (False, True)]
FP8_MAX = tuple(float(ml_dtypes.finfo(t).max) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)) * 2


def _scale_update(length):
  del length

  def f(*a):
    outs, i = [], 0
    for n, margin, most_recent in SU_CONFIGS:
      h, s, m = a[i:i + n], a[i + n:i + 2 * n], a[i + 2 * n:i + 3 * n]
      outs.append(scale_update(list(h), list(s), list(m), FP8_MAX[:n], margin=margin, most_recent=most_recent))
      i += 3 * n
    return outs

  return f


def scale_update_inputs(length, mix):
  seed, shares = mix
  rng = np.random.default_rng(seed)
  drawn, configs = [], []
  for j, (n, _, _) in enumerate(SU_CONFIGS):
    h = np.abs(values((seed + j, shares), (n, length), np.float32, spread=40.0))
    amaxes = np.abs(values((seed + 100 + j, shares), (n,), np.float32, spread=40.0))
    scales = np.exp2(rng.uniform(-20, 20, n)).astype(np.float32)
    drawn += [h, amaxes]
    configs.append((h, scales, amaxes))
  return drawn, configs


@prop("scale_update", scale_update_inputs, st.sampled_from([1, 4, 17]), mixes())
def test_scale_update_against_numpy(length, mix):
  """History rolled with the new amax in front; scale = fp8_max / amax / 2^margin where that is a positive finite
  float32 from a positive finite amax (max of the history, or its newest entry), the old scale otherwise."""
  _, configs = case("scale_update", length, mix)
  args = [a for h, scales, amaxes in configs for a in (*h, *scales, *amaxes)]
  ours = run(_scale_update, (length,), *args, check=False)
  for (hist, new), (h, scales, amaxes), (_, margin, most_recent) in zip(ours, configs, SU_CONFIGS, strict=True):
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
  return lambda sa, sb, *ab: [gemm(QuantizedTensor(a, sa), QuantizedTensor(b, sb), dtype=out_dtype)
                              for a, b in zip(ab[0::2], ab[1::2], strict=True)]


def gemm_inputs(fp8, out_dtype, mix):
  del out_dtype
  seed, shares = mix
  finite = dict(shares, huge=0.0, inf=0.0)  # FP8 operands: NaN, zeros and E4M3/E5M2's own range
  ab = []
  for i, (m, k, n) in enumerate(G_SHAPES):
    ab += [values((seed + 2 * i, finite), (m, k), np.float32, spread=3.0).astype(fp8),
           values((seed + 2 * i + 1, finite), (n, k), np.float32, spread=3.0).astype(E4M3)]
  return (ab,)


@prop("gemm", gemm_inputs, st.sampled_from(FP8S), st.sampled_from([np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)]),
      mixes())
def test_fp8_gemm_against_numpy(fp8, out_dtype, mix):
  """``(lhs sa) @ (rhs sb)^T`` of FP8 operands (lhs E4M3 or E5M2, rhs E4M3: E5M2 x E5M2 has no FP8 GEMM) (exact in
  float64) within the float32 summation bound ``(K + 2) u sum|a b|`` plus half an ulp of the output dtype; NaN where
  the exact product is."""
  (ab,) = case("gemm", fp8, out_dtype, mix)
  sa, sb = np.float32(0.5), np.float32(3.0)
  ours = run(_gemm, (out_dtype,), sa, sb, *ab, check=False)
  half_ulp = {np.dtype(np.float32): 2.0**-24, np.dtype(ml_dtypes.bfloat16): 2.0**-8}[out_dtype]
  for out, a, b in zip(ours, ab[0::2], ab[1::2], strict=True):
    a64, b64 = np.asarray(a).astype(np.float64) * sa, np.asarray(b).astype(np.float64) * sb
    with np.errstate(invalid="ignore"):
      exact, terms = a64 @ b64.T, np.abs(a64) @ np.abs(b64).T
    assert_close(out, exact, (a.shape[1] + 2) * F32_U * terms + half_ulp * np.abs(exact), "out")


# ---- the cases themselves -----------------------------------------------------------------------------------------

SPECIAL = {"nan", "inf", "huge", "subnormal", "zero", "finite", "non-finite", "plain"}
#: What each test's cases must hold, each in at least MIN_SHARE of them: every kind of special value it draws, cases
#: without any, and every dtype, format and variant it samples. gemm's FP8 operands have no inf or huge values, and
#: always some zeros and FP8 subnormals (the casts of small values). norm also needs rows beyond float32 statistics
#: (counted by the test).
REQUIRED = {
    "quantize": SPECIAL | {d.name for d in HP + FP8S},
    "quantize_interleaved": SPECIAL | {d.name for d in HP[:2] + FP8S},
    "norm": SPECIAL | {d.name for d in HP[:2] + FP8S} | {"layernorm", "rmsnorm", "stats overflow"},
    "activation": SPECIAL | {d.name for d in HP + FP8S},
    "softmax": SPECIAL | {d.name for d in HP},
    "rope": SPECIAL | {d.name for d in HP},
    "scale_update": SPECIAL,
    "gemm": {"nan", "zero", "finite", "non-finite", "float32", "bfloat16"} | {d.name for d in FP8S},
}
MIN_SHARE = 0.05
#: The ops whose shapes are free: the lists must hold size-1 dims, odd sizes, rows off the 16-element vector width and
#: rank >= 3 (quantize_interleaved and gemm need multiples of their group and of 16).
FREE_SHAPES = {"quantize": Q_SHAPES, "norm": N_SHAPES, "activation": A_SHAPES, "softmax": S_SHAPES, "rope": R_SHAPES}


def draw_cases(name):
  """Draws the inputs of test ``name``'s cases (the profile's count, its strategies) without running the op."""
  _, strategies = PROPERTIES[name]

  @cases(name)
  @given(st.tuples(*strategies))
  def draw(args):
    inputs = case(name, *args)
    if name == "norm" and beyond_float32_statistics(inputs[0]):  # what the test counts itself
      SEEN[name]["stats overflow"] += 1

  draw()


def test_case_count():
  """Every property test's cases hold what its strategies are for: each kind of special value it draws (NaN, +-inf,
  huge, subnormal, zero), cases with no special value and cases with no inf or NaN, every dtype, format and variant it
  samples, each in at least MIN_SHARE of the cases; and the shape lists hold the odd shapes. A test that did not run
  all of its cases in this session (deselected, or failed) has its inputs drawn here instead."""
  assert set(REQUIRED) == set(PROPERTIES) == set(EXAMPLES)
  for name, shapes in FREE_SHAPES.items():
    dims = [d for s in shapes for d in s]
    assert 1 in dims and any(d > 1 and d % 2 for d in dims), (name, shapes)
    assert any(s[-1] % 16 for s in shapes) and any(len(s) >= 3 for s in shapes), (name, shapes)
  for name in PROPERTIES:
    if RAN[name] < examples(name):
      RAN[name], SEEN[name] = 0, collections.Counter()
      draw_cases(name)
    assert RAN[name] >= examples(name), (name, RAN[name])
    few = {k: SEEN[name][k] for k in REQUIRED[name] if SEEN[name][k] < MIN_SHARE * RAN[name]}
    assert not few, f"{name}: in {RAN[name]} cases, too few with {few}"

