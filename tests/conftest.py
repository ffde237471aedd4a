"""Test setup shared by every test file: 8 forced CPU devices, the ``gpu`` marker, and comparison helpers.

pytest imports this file before any test module, so the XLA flag below is set before jax is first imported: the
sharding tests get 8 CPU devices, and the single-device tests run on device 0 of them. The helpers are imported by
the test modules (``from conftest import ...``; pytest puts tests/ on sys.path).
"""

import functools
import math
import os

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}".strip()

import jax  # noqa: E402 - after XLA_FLAGS
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Unit roundoff of float32 (round to nearest).
F32_U = 2.0**-24


def assert_within_rule(ours, ref32, ref64, what):
  """CONTRIBUTING.md's tolerance rule: ``max|ours - ref64| <= 2 max|ref32 - ref64| + 4 u max|ref64|`` (ref32 the same
  math in float32, ref64 in float64)."""
  ours, ref32, ref64 = (np.asarray(a, np.float64) for a in (ours, ref32, ref64))
  assert ours.shape == ref64.shape, (what, ours.shape, ref64.shape)
  err, err32 = np.max(np.abs(ours - ref64)), np.max(np.abs(ref32 - ref64))
  noise = 4 * F32_U * np.max(np.abs(ref64))
  assert err <= 2 * err32 + noise, f"{what}: error {err:.3g} > 2 * {err32:.3g} + {noise:.3g}"


# ---- jax.random draws of rank >= 2, drawn flat ------------------------------------------------------------------
#
# XLA:CPU takes 1-8 s to compile jax.random.normal or truncated_normal for a new shape of rank 3 or 4 (LLVM
# optimizing the per-dimension counter arithmetic of the partitionable threefry), 0.4 s for the same count drawn 1-D.
# Flax's initializers draw every kernel that way (eagerly, one program per shape), which made parameter
# initialization a large share of the CPU suite. The threefry counter of an element is its index in the flattened
# array, so the flat draw reshaped is the same values bit for bit (test_harness.py checks it against the functions
# replaced). Only plain calls are redirected: an out_sharding, non-scalar bounds or a shape of rank < 2 go through
# unchanged.

_REAL_DRAWS = {name: getattr(jax.random, name) for name in ("normal", "truncated_normal")}


def _flat_shape(shape):
  if isinstance(shape, (tuple, list)) and len(shape) >= 2 and all(isinstance(d, (int, np.integer)) for d in shape):
    return (math.prod(shape),), tuple(int(d) for d in shape)
  return None


def _flat_normal(key, shape=(), dtype=None, *, out_sharding=None):
  flat = None if out_sharding is not None else _flat_shape(shape)
  if flat is None:
    return _REAL_DRAWS["normal"](key, shape, dtype, out_sharding=out_sharding)
  return _REAL_DRAWS["normal"](key, flat[0], dtype).reshape(flat[1])


def _flat_truncated_normal(key, lower, upper, shape=None, dtype=None, *, out_sharding=None):
  flat = None if out_sharding is not None or np.ndim(lower) or np.ndim(upper) else _flat_shape(shape)
  if flat is None:
    return _REAL_DRAWS["truncated_normal"](key, lower, upper, shape, dtype, out_sharding=out_sharding)
  return _REAL_DRAWS["truncated_normal"](key, lower, upper, flat[0], dtype).reshape(flat[1])


def _install_flat_draws():
  import jax._src.random as jax_random_impl  # noqa: PLC0415 - where jax.nn.initializers (and so Flax) look them up

  for module in (jax.random, jax_random_impl):
    module.normal, module.truncated_normal = _flat_normal, _flat_truncated_normal


_install_flat_draws()


def _gpus() -> list:
  return [d for d in jax.devices() if d.platform == "gpu"]


def _mark_extra_cases_slow(items):
  """``@pytest.mark.fast_cases(n)`` on a parametrized test: ``n`` of its cases, spread evenly over the collection order
  (the first and, for n >= 2, the last among them), stay in the quick suite; the others are marked slow, so that
  scripts/test.sh runs a few representatives and CI's slow step the whole grid. GPU cases are left as they are (the
  GPU machine runs them all)."""
  groups = {}
  for item in items:
    marker = item.get_closest_marker("fast_cases")
    if marker is not None and hasattr(item, "callspec") and "gpu" not in item.keywords:
      groups.setdefault((item.path, item.cls, item.originalname), (marker, []))[1].append(item)
  for marker, cases in groups.values():
    (n,) = marker.args
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"fast_cases takes a count >= 1, got {n!r} on {cases[0].originalname}")
    keep = {round(i * (len(cases) - 1) / (n - 1)) for i in range(n)} if n > 1 else {0}
    for i, item in enumerate(cases):
      if i not in keep:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(config, items):
  """Marks the extra cases of ``fast_cases`` tests slow; skips ``@pytest.mark.gpu`` tests only when jax sees no GPU
  (with a GPU they run, and fail if anything is off)."""
  del config
  _mark_extra_cases_slow(items)
  if _gpus():
    return
  skip = pytest.mark.skip(reason="no GPU in jax.devices()")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_addoption(parser):
  parser.addoption("--failures-now", action="store_true",
                   help="print each failure's traceback as soon as it happens (for time-limited GPU runs)")


def pytest_runtest_logreport(report):
  if report.failed and getattr(report, "_failures_now", False):
    print(f"\nFAILED {report.nodeid}\n{report.longreprtext[-3000:]}\n", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  outcome.get_result()._failures_now = item.config.getoption("--failures-now")


@pytest.fixture
def gpu():
  """The first GPU device (gpu tests are skipped before this runs when there is none)."""
  return _gpus()[0]


# ---- comparison helpers --------------------------------------------------------------------------------------------


def fp8_bits(a) -> np.ndarray:
  """The raw bytes of an FP8 array."""
  return np.asarray(a).view(np.uint8)


def isnan(a) -> np.ndarray:
  return np.isnan(np.asarray(a).astype(np.float32))


def assert_fp8_equal(actual, expected, what: str = "data"):
  """Bitwise equal FP8 arrays, except that a NaN may be any NaN: NaN positions must match, not NaN bit patterns."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  nan = isnan(expected)
  np.testing.assert_array_equal(isnan(actual), nan, err_msg=f"{what}: NaN positions")
  bad = np.flatnonzero((fp8_bits(actual) != fp8_bits(expected)) & ~nan)
  assert bad.size == 0, (
      f"{what}: {bad.size} of {actual.size} bytes differ; first at flat index {bad[0]}: "
      f"{fp8_bits(actual).flat[bad[0]]:#04x} != {fp8_bits(expected).flat[bad[0]]:#04x}")


def assert_f32_equal(actual, expected, what: str = "amax"):
  """Bitwise equal float32 values, any NaN matching any NaN."""
  actual = np.asarray(actual, dtype=np.float32)
  expected = np.asarray(expected, dtype=np.float32)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  nan = np.isnan(expected)
  np.testing.assert_array_equal(np.isnan(actual), nan, err_msg=f"{what}: NaN positions")
  np.testing.assert_array_equal(actual.view(np.uint32)[~nan], expected.view(np.uint32)[~nan], err_msg=what)


def check_per_tensor(q):
  """``q``, an op's FP8 output, is a per-tensor ``te_jax.QuantizedTensor`` whose transposed copy, when there is one,
  has the same scale (checked where the values are concrete, not traced under shard_map)."""
  import te_jax  # noqa: PLC0415 - after XLA_FLAGS

  assert q.mode is te_jax.ScalingMode.PER_TENSOR and q.global_scale_inv is None, q.mode
  assert (q.data_t is None) == (q.scale_inv_t is None)
  if q.data_t is not None and not isinstance(q.scale_inv, jax.core.Tracer):
    assert_f32_equal(q.scale_inv_t, q.scale_inv, what="scale_inv_t")


def assert_column_sums_close(dbias, x):
  """``dbias`` is a float32 sum of ``x`` over every dim but the last, in any order.

  The tolerance is the a-priori bound of any float32 summation order (Higham, Accuracy and Stability of Numerical
  Algorithms, eq. 4.4): ``|computed - exact| <= gamma_{n-1} * sum|x_i|`` with ``gamma_k = k*u / (1 - k*u)``,
  u = 2^-24, n the number of terms, plus ``(2n - 1) 2^-126``: XLA:CPU runs programs, custom-call handlers included,
  with flush-to-zero and denormals-are-zero, so each of the n terms and n - 1 partial sums may lose a subnormal
  (less than 2^-126). ``x`` (float32, bfloat16 or float16) is exact in float64, so the float64 sum stands in for the
  exact one (its own error is ~2^-29 times smaller).

  Overflow: a finite column whose sum|x| reaches 2^127 has no bound (a partial sum may overflow, to an inf of either
  sign, then NaN). A column holding inf or NaN must come out non-finite: the float64 sum's +-inf or NaN, in any order,
  where its finite terms cannot overflow (their sum|x| < 2^127); otherwise that or NaN (a partial sum of finite terms
  that overflowed to the other infinity, meeting the inf).
  """
  shape = np.shape(x)
  x64 = np.asarray(x).astype(np.float64).reshape(int(np.prod(shape[:-1])), shape[-1])
  n = x64.shape[0]
  finite = np.isfinite(x64).all(axis=0)
  with np.errstate(invalid="ignore"):
    exact = x64.sum(axis=0)
  magnitude = np.where(np.isfinite(x64), np.abs(x64), 0.0).sum(axis=0)  # sum|x| of the finite terms
  k = max(n - 1, 0)
  bound = k * F32_U / (1 - k * F32_U) * magnitude + max(2 * n - 1, 0) * 2.0**-126
  dbias = np.asarray(dbias)
  assert dbias.dtype == np.float32 and dbias.shape == exact.shape, (dbias.dtype, dbias.shape, exact.shape)
  d = dbias.astype(np.float64)
  fits = magnitude < 2.0**127
  assert not np.isfinite(d[~finite]).any(), "dbias: a column holding inf or NaN has a finite sum"
  assert_f32_equal(d[~finite & fits], exact[~finite & fits], what="dbias, non-finite columns")
  either = ~finite & ~fits & ~np.isnan(d)  # where NaN is allowed and did not come: the sum's inf
  np.testing.assert_array_equal(d[either], exact[either], err_msg="dbias, non-finite columns that may overflow")
  checked = finite & fits
  err = np.abs(d[checked] - exact[checked])
  worst = np.argmax(err - bound[checked]) if err.size else 0
  assert np.all(err <= bound[checked]), f"dbias: error {err[worst]} over the bound {bound[checked][worst]}"


@functools.lru_cache(maxsize=None)
def _normal_pool(size: int):
  """One compiled program per power-of-two ``size``: ``jax.random.normal(key, (size,))`` for any key."""
  return jax.jit(lambda key: jax.random.normal(key, (size,), jnp.float32))


def random_normal(seed, shape, dtype=np.float32) -> jax.Array:
  """``jax.random.normal(jax.random.key(seed), shape, float32).astype(dtype)``, bit for bit, without compiling a
  program per shape: the threefry counter runs over the flattened array, so the values are a prefix of a 1-D draw
  (reshaped, cast with ml_dtypes' round-to-nearest-even as XLA casts). The multi-dimensional draw took XLA:CPU 1-8 s
  to compile for each new shape of rank 3 or 4 (LLVM optimizing its index arithmetic), a 1-D draw 0.4 s once.
  ``seed`` may be an int or a key."""
  key = jax.random.key(seed) if isinstance(seed, int) else seed
  n = math.prod(shape)
  pool = _normal_pool(max(1024, 1 << max(n - 1, 0).bit_length()))
  return jnp.asarray(np.asarray(pool(key))[:n].reshape(shape).astype(dtype))


def rel_error(a, b) -> float:
  """||a - b|| / ||b|| in float64 (0-norm ``b`` guarded)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
