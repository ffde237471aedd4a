"""quantize, QuantizedTensor (and its dequantize) and amax.

- The CPU FFI handler against the pure-jnp reference ``quantize_ref``: bitwise for the FP8 bytes, the transposed copy
  and amax; dbias within the bound of float32 summation.
- The reference itself against ml_dtypes/numpy and hand-computed values, so that the oracle is anchored independently.
- jit, vmap, eager; argument checks; dequantize and amax against numpy.
- QuantizedTensor itself: a pytree with a static mode, its transposed copy, and its scale layouts (per tensor, 1x128
  and 128x128 blocks) against numpy.
- On a GPU (``@pytest.mark.gpu``): the CUDA handler against the reference run on the same GPU.
"""

import collections
import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
from conftest import assert_column_sums_close, assert_f32_equal, assert_fp8_equal, fp8_bits
from te_jax._core import native as te_native
from te_jax.ops.quantize import QuantizeConfig, quantize_ref
from te_jax import QuantizedTensor, ScalingMode
from te_jax.ops.quantize import CastOutput, quantize

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FP8 = pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
IN_DTYPES = pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
CPU = jax.devices("cpu")[0]

# Odd sizes, 1 element, rows not a multiple of 16, rank 1..4.
SHAPES = [(1,), (7,), (1, 1), (1, 17), (17, 1), (5, 7), (13, 31), (16, 16), (33, 130), (2, 3, 5), (3, 17, 33),
          (2, 3, 5, 7), (2, 1, 9, 40)]


# ---- helpers -------------------------------------------------------------------------------------------------------


class Flat(NamedTuple):
  """A quantize's results side by side, as the tests compare them."""

  data: jax.Array
  data_t: jax.Array | None
  amax: jax.Array
  dbias: jax.Array | None


def flat(c: CastOutput) -> Flat:
  """``quantize``'s CastOutput as (data, data_t, amax, dbias)."""
  return Flat(c.out.data, c.out.data_t, c.amax, c.dbias)


def fp8_max(fp8) -> float:
  return float(ml_dtypes.finfo(fp8).max)


def random_input(shape, dtype, seed: int) -> np.ndarray:
  """Normal values with magnitudes spread over 2^-12 .. 2^12: below, across and above both FP8 ranges at scale 1."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, 12, shape))
  return x.astype(dtype)


def numpy_quantize(x, scale, fp8) -> np.ndarray:
  """The oracle's oracle: ml_dtypes' round-to-nearest-even cast of the clipped float32 product, NaN where x is not
  finite (inf included: FP8 keeps a non-finite input visible instead of clamping it to +-max)."""
  m = np.float32(fp8_max(fp8))
  xf = np.asarray(x).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    return np.where(np.isfinite(xf), np.clip(xf * np.float32(scale), -m, m), np.float32(np.nan)).astype(fp8)


def numpy_amax(x) -> np.float32:
  """max|x| in float32; NaN if x holds one, 0 if x is empty."""
  return np.max(np.abs(np.asarray(x).astype(np.float32)), initial=np.float32(0))


def t_axes(ndim: int, batch_dims: int) -> tuple:
  """``x.shape[:b] + x.shape[-1:] + x.shape[b:-1]``, written independently of QuantizeConfig."""
  return tuple(range(batch_dims)) + (ndim - 1,) + tuple(range(batch_dims, ndim - 1))


def native_many(xs, scale, fp8, *, device=CPU, **kwargs) -> list[Flat]:
  """quantize on each of ``xs``, in one jitted program on ``device`` (one compile for many shapes); asserts
  that the compiled program calls the native handler once per input, and that each result is a per-tensor
  QuantizedTensor whose scale_inv (and, with a transposed copy, scale_inv_t) is 1 / scale."""
  args = ([jax.device_put(x, device) for x in xs], jax.device_put(np.float32(scale), device))
  compiled = jax.jit(lambda xs, s: [quantize(x, s, fp8, **kwargs) for x in xs]).lower(*args).compile()
  target = {"cpu": "te_quantize_cpu", "gpu": "te_quantize_cuda"}[device.platform]
  assert compiled.as_text().count(f'custom_call_target="{target}"') == len(xs), target
  outs = compiled(*args)
  inv = np.float32(1) / np.float32(scale)
  if abs(inv) < np.finfo(np.float32).tiny:  # a subnormal 1 / scale (scale > 2^126): XLA:CPU flushes it to zero
    inv = np.float32(0) if device.platform == "cpu" else inv
  for out in outs:
    assert isinstance(out, CastOutput) and isinstance(out.out, QuantizedTensor), type(out)
    assert out.out.mode is ScalingMode.PER_TENSOR and out.out.global_scale_inv is None
    assert_f32_equal(out.out.scale_inv, inv, what="scale_inv")
    if out.out.data_t is None:
      assert out.out.scale_inv_t is None
    else:
      assert_f32_equal(out.out.scale_inv_t, inv, what="scale_inv_t")
  return [flat(out) for out in outs]


def native(x, scale, fp8, *, device=CPU, **kwargs) -> Flat:
  """quantize, jitted, on ``device``; asserts that the compiled program calls the native handler once."""
  return native_many([x], scale, fp8, device=device, **kwargs)[0]


def reference_many(xs, scale, fp8, *, transpose=False, transpose_batch_dims=None, dbias=False, device=CPU):
  """quantize_ref on each of ``xs``, in one jitted program on ``device``, returned as Flat tuples."""

  def one(x, s):
    batch = x.ndim - 2 if transpose_batch_dims is None else transpose_batch_dims
    config = QuantizeConfig(out_dtype=jnp.dtype(fp8), transpose=transpose, batch_ndim=batch if transpose else 0,
                            dbias=dbias)
    outs = list(quantize_ref(x, s, config=config))
    data = outs.pop(0)
    data_t = outs.pop(0) if transpose else None
    amax = outs.pop(0)
    return Flat(data, data_t, amax, outs.pop(0) if dbias else None)

  args = ([jax.device_put(x, device) for x in xs], jax.device_put(np.float32(scale), device))
  return jax.jit(lambda xs, s: [one(x, s) for x in xs])(*args)


def reference(x, scale, fp8, *, device=CPU, **kwargs) -> Flat:
  """quantize_ref, jitted, on ``device``, returned as a Flat."""
  return reference_many([x], scale, fp8, device=device, **kwargs)[0]


def assert_many_match_reference(xs, scale, fp8, *, device=CPU, check_reference_amax=True, **kwargs):
  """The handler on ``device`` vs the reference on ``device`` for each of ``xs`` (one compile of each for all);
  also the transposed copy vs numpy's transpose of the handler's data, and amax vs numpy."""
  outs = native_many(xs, scale, fp8, device=device, **kwargs)
  refs = reference_many(xs, scale, fp8, device=device, **kwargs)
  for x, out, ref in zip(xs, outs, refs, strict=True):
    _check_against_reference(x, out, ref, check_reference_amax, **kwargs)
  return outs


def assert_matches_reference(x, scale, fp8, *, device=CPU, check_reference_amax=True, **kwargs):
  """``assert_many_match_reference`` for one input."""
  return assert_many_match_reference([x], scale, fp8, device=device, check_reference_amax=check_reference_amax,
                                     **kwargs)[0]


def _check_against_reference(x, out, ref, check_reference_amax, **kwargs):
  shape = f"shape {np.shape(x)}"
  assert_fp8_equal(out.data, ref.data, what=f"data, {shape}")
  assert_f32_equal(out.amax, numpy_amax(x), what=f"amax vs numpy, {shape}")
  if check_reference_amax:
    assert_f32_equal(out.amax, ref.amax, what=f"amax, {shape}")
  if kwargs.get("transpose"):
    b = kwargs.get("transpose_batch_dims")
    axes = t_axes(np.ndim(x), np.ndim(x) - 2 if b is None else b)
    assert_fp8_equal(out.data_t, np.transpose(np.asarray(out.data), axes), what=f"data_t vs transpose(data), {shape}")
    assert_fp8_equal(out.data_t, ref.data_t, what=f"data_t, {shape}")
  else:
    assert out.data_t is None
  if kwargs.get("dbias"):
    assert_column_sums_close(out.dbias, x)
    assert_column_sums_close(ref.dbias, x)
  else:
    assert out.dbias is None


@pytest.fixture(autouse=True)
def _cpu_handler_registered():
  """Every test here means the native CPU handler: a silent fallback to the reference must fail, not pass."""
  assert te_native.has_target("cpu", "te_quantize_cpu"), te_native.load_errors


# ---- CPU handler vs reference --------------------------------------------------------------------------------------


@pytest.mark.parametrize("extras", [{}, {"transpose": True, "dbias": True}], ids=["plain", "t+dbias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@IN_DTYPES
@FP8
@pytest.mark.fast_cases(30)
def test_cpu_matches_reference(shape, dtype, fp8, extras):
  if len(shape) == 1:
    extras = {k: v for k, v in extras.items() if k != "transpose"}
  x = random_input(shape, dtype, seed=len(shape) * 1000 + sum(shape))
  assert_matches_reference(x, 1.0, fp8, **extras)


@pytest.mark.parametrize("shape,batch_dims", [((4, 9), 0), ((3, 17, 33), None), ((3, 17, 33), 0), ((3, 17, 33), 1),
                                              ((2, 3, 5, 7), None), ((2, 3, 5, 7), 0), ((2, 3, 5, 7), 1)], ids=str)
@pytest.mark.parametrize("dbias", [False, True], ids=["", "dbias"])
@pytest.mark.parametrize("dtype,fp8", [(ml_dtypes.bfloat16, E4M3), (np.float32, E5M2)], ids=["bf16-e4m3", "f32-e5m2"])
@pytest.mark.fast_cases(6)
def test_cpu_transpose_modes(shape, batch_dims, dbias, dtype, fp8):
  x = random_input(shape, dtype, seed=7)
  out = assert_matches_reference(x, 0.75, fp8, transpose=True, transpose_batch_dims=batch_dims, dbias=dbias)
  b = len(shape) - 2 if batch_dims is None else batch_dims
  assert out.data_t.shape == shape[:b] + shape[-1:] + shape[b:-1]


def grouped_transpose(data, parts: int, group: int) -> np.ndarray:
  """numpy: the (rows, cols) data's transposed copy with its rows grouped by part, as ``transpose_parts`` asks."""
  data_t = np.asarray(data).T
  cols, rows = data_t.shape
  chunks = data_t.reshape(cols // group, group, rows)
  return np.stack([chunks[i::parts].reshape(cols // parts, rows) for i in range(parts)])


def check_transpose_parts(x, fp8, parts: int, group: int, dbias: bool, device=CPU):
  """The handler on ``device`` against the reference there and against numpy's grouping of its own data."""
  out = native(x, 0.75, fp8, device=device, transpose=True, transpose_parts=(parts, group), dbias=dbias)
  config = QuantizeConfig(out_dtype=jnp.dtype(fp8), transpose=True, dbias=dbias, t_parts=parts, t_group=group)
  ref = jax.jit(lambda x, s: quantize_ref(x, s, config=config))(jax.device_put(x, device), np.float32(0.75))
  rows, cols = x.shape
  assert out.data_t.shape == (parts, cols // parts, rows)
  assert_fp8_equal(out.data, ref[0], what="data")
  assert_fp8_equal(out.data_t, grouped_transpose(out.data, parts, group), what="data_t vs grouping of data")
  assert_fp8_equal(out.data_t, ref[1], what="data_t")
  assert_f32_equal(out.amax, numpy_amax(x), what="amax")
  if dbias:
    assert_column_sums_close(out.dbias, x)


# (x shape, (parts, group)): the 128-tile kernel (rows % 8, cols % 8, group % 8), ragged tiles, and groups that are
# not multiples of 8 (the 32-tile kernel).
TRANSPOSE_PARTS_CASES = [((64, 384), (3, 16)), ((136, 768), (3, 128)), ((24, 96), (2, 48)), ((33, 48), (2, 8)),
                         ((17, 60), (3, 5)), ((8, 64), (4, 16))]


@pytest.mark.parametrize("shape,parts", TRANSPOSE_PARTS_CASES, ids=str)
@pytest.mark.parametrize("dbias", [False, True], ids=["", "dbias"])
@pytest.mark.parametrize("dtype,fp8", [(ml_dtypes.bfloat16, E4M3), (np.float32, E5M2)], ids=["bf16-e4m3", "f32-e5m2"])
@pytest.mark.fast_cases(6)
def test_cpu_transpose_parts(shape, parts, dbias, dtype, fp8):
  check_transpose_parts(random_input(shape, dtype, seed=9), fp8, *parts, dbias)


# (cols shard, collectives): shards of 48 columns hold whole groups of 3 x 16 and stay sharded; shards of 48 columns
# split groups of 3 x 32, so x's columns are gathered first.
@pytest.mark.parametrize("parts,want", [((3, 16), {}), ((3, 32), {"all-gather": 1})], ids=["whole", "split"])
def test_sharded_transpose_parts(parts, want):
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
  x = random_input((64, 384), np.float32, seed=10)
  x_s = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x")))
  f = jax.jit(lambda x: quantize(x, np.float32(0.5), E4M3, transpose=True, transpose_parts=parts))
  compiled = f.lower(x_s).compile()
  out = flat(compiled(x_s))
  found = collections.Counter(re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(",
                                         compiled.as_text()))
  assert set(found) - {"all-reduce"} == set(want), found  # the amax is max-reduced either way
  if not want:
    assert out.data_t.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x", None)), 3), out.data_t.sharding
  whole = native(x, 0.5, E4M3, transpose=True, transpose_parts=parts)
  assert_fp8_equal(out.data_t, whole.data_t, what="sharded data_t")
  assert_f32_equal(out.amax, whole.amax, what="sharded amax")


@pytest.mark.parametrize("scale", [1.0, 0.75, 2.0**-10, 3000.0])
@IN_DTYPES
@FP8
def test_cpu_scales(scale, dtype, fp8):
  assert_matches_reference(random_input((19, 23), dtype, seed=3), scale, fp8, transpose=True, dbias=True)


def special_values(fp8, dtype=np.float32) -> np.ndarray:
  """Values at the edges of ``fp8`` (for scale 1): saturation, subnormals, ties, signed zeros, inf, NaN; float16 turns
  the largest into inf."""
  m = fp8_max(fp8)
  tiny = float(ml_dtypes.finfo(fp8).smallest_subnormal)
  v = [0.0, m, np.nextafter(np.float32(m), np.float32(np.inf)), 1.0625 * m, 1.5 * m, 1e30, np.inf,
       tiny, 0.5 * tiny, 0.50001 * tiny, 0.49999 * tiny, 1.5 * tiny, 2.5 * tiny, 3.5 * tiny, 100 * tiny / 3,
       1.0, 1.0625, 1.1875, 1.03125, 1.09375, 3.0 / 7.0, 2.0**-6, 2.0**-14]
  v = np.array(v, np.float32)
  v = np.concatenate([v, -v, [np.nan, -np.nan, np.float32(np.nan) * 0]]).astype(np.float32)
  with np.errstate(over="ignore"):
    return v.astype(dtype)


@pytest.mark.parametrize("scale", [1.0, 2.0**-4], ids=["s1", "s1/16"])
@IN_DTYPES
@FP8
def test_cpu_special_values(dtype, fp8, scale):
  v = special_values(fp8) / np.float32(scale)  # powers of two: exact
  with np.errstate(over="ignore"):  # float16: the largest values become inf
    x = np.resize(v, (7, len(v) // 7 + 3)).astype(dtype)  # wraps around: every value, rows and cols odd
  out = assert_matches_reference(x, scale, fp8, transpose=True)
  assert np.isnan(np.asarray(out.amax))
  finite = x[np.isfinite(x.astype(np.float32))]
  out = assert_matches_reference(finite, scale, fp8)  # no NaN: amax is the largest finite |x|
  assert_f32_equal(out.amax, np.max(np.abs(finite.astype(np.float32))))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-8, 448.0 / 3.0])
@FP8
def test_every_16bit_input(dtype, fp8, scale):
  """Every bf16/f16 bit pattern, through the handler, the reference and ml_dtypes.

  amax (NaN: the input holds NaNs) is checked against numpy only: the reference's amax loses NaNs on XLA:CPU at this
  size, see test_reference_amax_propagates_nan.
  """
  x = np.arange(2**16, dtype=np.uint16).view(dtype).reshape(256, 256)
  out = assert_matches_reference(x, scale, fp8, transpose=True, check_reference_amax=False)
  assert np.isnan(np.asarray(out.amax))
  assert_fp8_equal(out.data, numpy_quantize(x, scale, fp8), what="data vs ml_dtypes")


def fp8_grid(fp8) -> tuple[np.ndarray, np.ndarray]:
  """The finite non-negative FP8 values in order, and the float32 midpoints between neighbours."""
  codes = np.arange(256, dtype=np.uint8)
  values = codes.view(fp8).astype(np.float32)
  values = values[np.isfinite(values) & (codes < 0x80)]
  return values, (values[:-1] + values[1:]) / 2  # exact: adjacent values are at most one binade apart


@FP8
def test_cpu_ties_round_half_to_even(fp8):
  """float32 midpoints between neighbouring FP8 values go to the even code; one ulp off them, to the nearer one."""
  values, mid = fp8_grid(fp8)
  up = np.nextafter(mid, np.float32(np.inf))
  down = np.nextafter(mid, np.float32(0))
  x = np.concatenate([values, mid, up, down])
  x = np.concatenate([x, -x])
  out = assert_matches_reference(x, 1.0, fp8)
  q = fp8_bits(out.data)
  n = len(values) - 1
  at_mid = q[len(values):len(values) + n]
  assert np.all(at_mid % 2 == 0), "a tie went to an odd code"
  lo = np.arange(n, dtype=np.uint8)  # for non-negative FP8 values the code is the index in `values`
  assert np.all((at_mid == lo) | (at_mid == lo + 1))
  np.testing.assert_array_equal(q[len(values) + n:len(values) + 2 * n], lo + 1)  # just above a midpoint: up
  np.testing.assert_array_equal(q[len(values) + 2 * n:len(values) + 3 * n], lo)  # just below: down


def test_cpu_float32_subnormal_inputs_cast():
  """float32 subnormal inputs: the cast agrees with the reference (XLA:CPU flushes them to zero, and so does the
  handler, which runs under XLA's float environment)."""
  x = np.array([[2.0**-130, -(2.0**-140)], [2.0**-149, 1.0]], np.float32)
  assert_matches_reference(x, 2.0**127, E4M3, transpose=True)


def test_cpu_amax_of_float32_subnormals():
  """max|x| is the largest subnormal, as numpy says (the handler reduces bit patterns, which no float mode flushes)."""
  x = np.array([[2.0**-130, -(2.0**-140)], [2.0**-149, 0.0]], np.float32)
  assert_f32_equal(native(x, 1.0, E4M3).amax, np.float32(2.0**-130))


# A float jnp.max on XLA:CPU flushes subnormals and, past a few thousand elements, drops NaNs: the reference's amax
# must not (it reduces the bit patterns of |x|, as the kernels do).
def test_reference_amax_of_float32_subnormals():
  x = np.array([[2.0**-130, -(2.0**-140)], [2.0**-149, 0.0]], np.float32)
  assert_f32_equal(reference(x, 1.0, E4M3).amax, np.float32(2.0**-130))


@pytest.mark.parametrize("amax_of", ["quantize_ref", "te_jax.ops.quantize.amax"])
def test_reference_amax_propagates_nan(amax_of):
  x = np.ones((64, 64), np.float32)
  x[63, 63] = np.nan  # a float max-reduce on XLA:CPU gives 0.0 here (4096 elements)
  got = reference(x, 1.0, E4M3).amax if amax_of == "quantize_ref" else te_jax.ops.quantize.amax(jax.device_put(x, CPU))
  assert np.isnan(np.asarray(got)), got


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,)], ids=str)
def test_cpu_empty(shape):
  extras = {"transpose": True} if len(shape) > 1 else {}
  out = assert_matches_reference(np.zeros(shape, np.float32), 1.0, E4M3, dbias=True, **extras)
  assert float(out.amax) == 0.0


@pytest.mark.slow
def test_cpu_more_than_2_pow_24_elements():
  x = random_input((4097, 4099), np.float32, seed=24)
  assert x.size > 2**24
  assert_matches_reference(x, 1.0 / 16, E4M3, transpose=True, dbias=True)


# ---- the reference itself ------------------------------------------------------------------------------------------


@IN_DTYPES
@FP8
def test_reference_matches_ml_dtypes(dtype, fp8):
  # < 4096 elements: test_reference_amax_propagates_nan says why
  x = np.concatenate([random_input((2000,), dtype, seed=11), special_values(fp8, dtype)])
  for scale in [1.0, 0.3, 2.0**-6]:
    ref = reference(x, scale, fp8)
    assert_fp8_equal(ref.data, numpy_quantize(x, scale, fp8))
    assert_f32_equal(ref.amax, np.max(np.abs(x.astype(np.float32))))
    assert np.isnan(np.asarray(ref.amax))  # special_values holds NaN


@pytest.mark.parametrize("fp8,x,expected", [
    (E4M3, 1.0625, 1.0),  # tie between 1 and 1.125: even mantissa
    (E4M3, 1.1875, 1.25),  # tie between 1.125 and 1.25: even mantissa
    (E4M3, 470.0, 448.0),  # nearer 480, which E4M3FN lacks (that code is NaN): saturates
    (E4M3, -np.inf, np.nan),  # not clamped to -448: a non-finite input stays visible as NaN
    (E4M3, 3e38, 448.0),  # finite, beyond the range: saturates
    (E4M3, 2.0**-10, 0.0),  # half the smallest subnormal: ties to zero
    (E4M3, 3 * 2.0**-10, 2.0**-8),  # 1.5 subnormal steps: ties to 2 steps
    (E4M3, -0.0, -0.0),
    (E5M2, 1.125, 1.0),  # E5M2 has 2 mantissa bits: 1, 1.25, ...
    (E5M2, 61440.0, 57344.0),  # the tie between 57344 and 65536 (inf in E5M2) rounds up: saturates
    (E5M2, np.inf, np.nan),  # E5M2 has inf, but one convention for both formats: NaN
    (E5M2, 2.0**-17, 0.0),  # half the smallest subnormal 2^-16
    (E5M2, 3 * 2.0**-17, 2.0**-15),
])
def test_hand_computed_values(fp8, x, expected):
  x = np.array([x], np.float32)
  for out in (reference(x, 1.0, fp8).data, native(x, 1.0, fp8).data, numpy_quantize(x, 1.0, fp8)):
    got = np.asarray(out).astype(np.float32)
    if np.isnan(expected):
      assert np.isnan(got[0]), (x, got)
    else:
      assert got.view(np.uint32)[0] == np.float32(expected).view(np.uint32), (x, got, expected)


# ---- jit, vmap, eager ----------------------------------------------------------------------------------------------


def test_eager_equals_jit():
  x = jax.device_put(random_input((9, 11), ml_dtypes.bfloat16, seed=1), CPU)
  eager = flat(quantize(x, jnp.float32(0.5), E5M2, transpose=True, dbias=True))
  jitted = native(x, 0.5, E5M2, transpose=True, dbias=True)
  assert_fp8_equal(eager.data, jitted.data)
  assert_fp8_equal(eager.data_t, jitted.data_t, what="data_t")
  assert_f32_equal(eager.amax, jitted.amax)
  assert_f32_equal(eager.dbias, jitted.dbias, what="dbias")  # the same handler: the same summation order


@pytest.mark.parametrize("scale_batched", [False, True], ids=["scale", "scales"])
@pytest.mark.parametrize("in_axis", [0, 1])
def test_vmap_is_per_element(in_axis, scale_batched):
  x = random_input((3, 4, 9, 10), ml_dtypes.bfloat16, seed=5)
  scales = np.array([1.0, 0.25, 4.0, 2.0**-6], np.float32)[: x.shape[in_axis]]
  f = lambda x, s: quantize(x, s, E4M3, transpose=True, dbias=True)  # noqa: E731
  s_axis = 0 if scale_batched else None
  s_arg = scales if scale_batched else np.float32(0.5)
  out = flat(jax.jit(jax.vmap(f, in_axes=(in_axis, s_axis)))(jax.device_put(x, CPU), s_arg))
  for i in range(x.shape[in_axis]):
    xi = np.take(x, i, axis=in_axis)
    ref = reference(xi, scales[i] if scale_batched else 0.5, E4M3, transpose=True, dbias=True)
    assert_fp8_equal(out.data[i], ref.data)
    assert_fp8_equal(out.data_t[i], ref.data_t, what="data_t")
    assert_f32_equal(out.amax[i], ref.amax)  # the amax of element i alone, not of the whole batch
    assert_column_sums_close(out.dbias[i], xi)


def test_nested_vmap():
  x = random_input((2, 3, 5, 6), np.float32, seed=9)
  out = flat(jax.vmap(jax.vmap(lambda x: quantize(x, 1.0, E4M3, transpose=True)))(jax.device_put(x, CPU)))
  assert out.amax.shape == (2, 3)
  for i in range(2):
    for j in range(3):
      ref = reference(x[i, j], 1.0, E4M3, transpose=True)
      assert_fp8_equal(out.data[i, j], ref.data)
      assert_fp8_equal(out.data_t[i, j], ref.data_t, what="data_t")
      assert_f32_equal(out.amax[i, j], ref.amax)


def test_scale_accepts_python_numpy_and_jax_float32():
  x = jax.device_put(random_input((4, 6), np.float32, seed=2), CPU)
  expected = fp8_bits(quantize(x, jnp.float32(0.5)).out.data)
  for s in [0.5, np.float32(0.5), jnp.asarray(0.5)]:
    np.testing.assert_array_equal(fp8_bits(quantize(x, s).out.data), expected)


def test_fields_not_asked_for_are_none():
  out = quantize(jnp.ones((2, 3), jnp.float32), 1.0)
  assert out.out.data_t is None and out.out.scale_inv_t is None and out.dbias is None
  assert out.out.data.dtype == E4M3 and out.amax.dtype == jnp.float32 and out.amax.shape == ()
  assert out.out.mode is ScalingMode.PER_TENSOR and out.out.scale_inv.dtype == jnp.float32
  assert out.out.scale_inv.shape == ()


# ---- argument checks -----------------------------------------------------------------------------------------------


def test_transpose_parts_limit_is_the_batched_gemms():
  """transpose_parts makes the operand of gemm(..., rhs_parts=True): it takes as many parts as that GEMM does."""
  from te_jax.ops.gemm import MAX_PARTS  # noqa: PLC0415
  from te_jax.ops.quantize import MAX_TRANSPOSE_PARTS  # noqa: PLC0415

  assert MAX_TRANSPOSE_PARTS == MAX_PARTS


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((jnp.ones((2, 2), jnp.int32), 1.0), {}, TypeError, "^x must be float32"),
    ((np.ones((2, 2), np.float64), 1.0), {}, TypeError, "^x must be float32"),
    ((jnp.float32(1.0), 1.0), {}, ValueError, "^x must have rank >= 1"),
    ((jnp.ones((2, 2)), np.array(1.0, np.float64)), {}, TypeError, "^scale must be a float32 scalar"),
    ((jnp.ones((2, 2)), 1), {}, TypeError, "^scale must be a float32 scalar"),
    ((jnp.ones((2, 2)), jnp.ones((1,), jnp.float32)), {}, ValueError, r"^scale must be a float32 scalar \(shape"),
    ((jnp.ones((2, 2)), 1.0, jnp.float8_e4m3fnuz), {}, ValueError, "^dtype must be float8_e4m3fn or float8_e5m2"),
    ((jnp.ones((2, 2)), 1.0, jnp.bfloat16), {}, ValueError, "^dtype must be float8_e4m3fn or float8_e5m2"),
    ((jnp.ones((3,)), 1.0), {"transpose": True}, ValueError, "^transpose=True needs x of rank >= 2"),
    ((jnp.ones((2, 3, 4)), 1.0), {"transpose": True, "transpose_batch_dims": 2}, ValueError,
     r"^transpose_batch_dims must be in \[0, 1\]"),
    ((jnp.ones((2, 3, 4)), 1.0), {"transpose": True, "transpose_batch_dims": -1}, ValueError,
     "^transpose_batch_dims must be in"),
    ((jnp.ones((2, 3, 4)), 1.0), {"transpose_batch_dims": 0}, ValueError, "^transpose_batch_dims needs transpose"),
    ((jnp.ones((4, 48)), 1.0), {"transpose_parts": (3, 16)}, ValueError, "^transpose_parts needs transpose=True"),
    ((jnp.ones((2, 4, 48)), 1.0), {"transpose": True, "transpose_parts": (3, 16)}, ValueError,
     r"^transpose_parts needs a 2-D x"),
    ((jnp.ones((4, 48)), 1.0), {"transpose": True, "transpose_parts": 3}, TypeError,
     r"^transpose_parts must be a \(parts, group\) tuple of ints"),
    ((jnp.ones((4, 48)), 1.0), {"transpose": True, "transpose_parts": (5, 8)}, ValueError, r"2 to 4 parts"),
    ((jnp.ones((4, 48)), 1.0), {"transpose": True, "transpose_parts": (3, 32)}, ValueError,
     r"x's last dim \(48\) a multiple of parts \* group"),
], ids=["int-x", "f64-x", "rank0", "f64-scale", "int-scale", "scale-shape", "fnuz", "bf16-out", "t-rank1",
        "batch-too-big", "batch-negative", "batch-without-t", "parts-without-t", "parts-3d", "parts-not-pair",
        "parts-five", "parts-not-dividing"])
def test_bad_arguments_raise_before_xla(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    quantize(*args, **kwargs)
  with pytest.raises(error, match=match):  # under jit: at trace time, with the same message
    jax.jit(lambda: quantize(*args, **kwargs))()


# ---- dequantize and amax -------------------------------------------------------------------------------------------


def assert_hp_equal(got, want, what: str = "dequantized"):
  """Bitwise equal float32/bfloat16/float16 arrays of one dtype and shape, any NaN matching any NaN."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=f"{what}: NaN positions")
  bits = np.uint16 if want.dtype != np.float32 else np.uint32
  np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits), err_msg=what)


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@FP8
def test_dequantize_matches_numpy(fp8, out_dtype):
  q = np.arange(256, dtype=np.uint8).view(fp8).reshape(16, 16)  # every code, NaN included
  for scale_inv in [1.0, 1.0 / 448.0, 3.0]:
    got = QuantizedTensor(jnp.asarray(q), jnp.float32(scale_inv)).dequantize(out_dtype)
    with np.errstate(over="ignore"):  # 3 * 57344 is inf in float16, in XLA too
      want = (q.astype(np.float32) * np.float32(scale_inv)).astype(out_dtype)
    assert got.dtype == out_dtype
    assert_hp_equal(got, want)


def test_quantize_dequantize_round_trip():
  x = random_input((8, 8), np.float32, seed=4) / 64  # within E4M3 range at scale 1 after the divide
  q = quantize(jnp.asarray(x), 4.0).out
  assert_f32_equal(q.scale_inv, np.float32(0.25), what="scale_inv")  # the quantize's own 1 / scale dequantizes
  y = np.asarray(q.dequantize(jnp.float32))
  np.testing.assert_array_equal(y, numpy_quantize(x, 4.0, E4M3).astype(np.float32) * np.float32(0.25))


def test_dequantize_default_dtype_is_bfloat16():
  q = QuantizedTensor(jnp.asarray(np.array([1.0, -3.5], np.float32).astype(E4M3)), jnp.float32(0.5))
  got = q.dequantize()
  assert got.dtype == jnp.bfloat16
  assert_hp_equal(got, np.array([0.5, -1.75], ml_dtypes.bfloat16))


# The removed ``dequantize(q, scale_inv, dtype)`` also raised for a non-FP8 ``q`` (TypeError) and a float64 scale_inv
# (TypeError); QuantizedTensor.dequantize checks only the output dtype, so only that case is left.
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, np.float64], ids=["int8", "fp8", "f64"])
def test_dequantize_bad_dtype(dtype):
  q = QuantizedTensor(jnp.ones((2,), E4M3), jnp.float32(1.0))
  with pytest.raises(ValueError, match="^dtype must be float32, bfloat16 or float16"):
    q.dequantize(dtype)
  with pytest.raises(ValueError, match="^dtype must be float32, bfloat16 or float16"):  # at trace time too
    jax.jit(lambda q: q.dequantize(dtype))(q)


@IN_DTYPES
@pytest.mark.parametrize("shape", [(1,), (7, 13), (2, 3, 5)], ids=str)
def test_amax_matches_numpy(dtype, shape):
  x = random_input(shape, dtype, seed=8)
  assert_f32_equal(te_jax.ops.quantize.amax(jnp.asarray(x)), np.max(np.abs(x.astype(np.float32))))
  x.flat[-1] = np.nan
  assert np.isnan(te_jax.ops.quantize.amax(jnp.asarray(x)))
  x.flat[-1] = -np.inf
  assert te_jax.ops.quantize.amax(jnp.asarray(x)) == np.inf


def test_amax_edge_cases():
  assert te_jax.ops.quantize.amax(jnp.zeros((0, 3), jnp.float32)) == 0.0
  assert_f32_equal(te_jax.ops.quantize.amax(jnp.array([-0.0], jnp.bfloat16)), np.float32(0.0))  # +0, float32
  with pytest.raises(TypeError, match="^x must be float32"):
    te_jax.ops.quantize.amax(jnp.ones((2,), jnp.int32))


# ---- QuantizedTensor -----------------------------------------------------------------------------------------------


def random_fp8(shape, fp8, seed: int) -> np.ndarray:
  """Random FP8 codes, every one possible (NaN, and for E5M2 inf, included)."""
  return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8).view(fp8)


def random_scale_inv(shape, seed: int) -> np.ndarray:
  """float32 reciprocal scales over 2^-8 .. 2^8, not powers of two: the products round."""
  rng = np.random.default_rng(seed)
  return (np.exp2(rng.uniform(-8, 8, shape))).astype(np.float32)


def numpy_dequantize_blocks(data, scale_inv, block, out_dtype) -> np.ndarray:
  """numpy: ``data * scale_inv`` with scale ``[..., bi, bj]`` applied to the elements ``[..., bi * rows:(bi + 1) *
  rows, bj * cols:(bj + 1) * cols]`` (rows 1: ``[..., r, bj]`` to ``[..., r, bj * cols:(bj + 1) * cols]``), block by
  block, in float32, then cast to ``out_dtype``."""
  rows, cols = block
  xf = np.asarray(data).astype(np.float32)
  s = np.asarray(scale_inv, np.float32)
  out = np.empty_like(xf)
  if rows == 1:
    for bj in range(s.shape[-1]):
      cs = slice(bj * cols, (bj + 1) * cols)
      out[..., cs] = xf[..., cs] * s[..., bj:bj + 1]
  else:
    for bi in range(s.shape[-2]):
      for bj in range(s.shape[-1]):
        rs, cs = slice(bi * rows, (bi + 1) * rows), slice(bj * cols, (bj + 1) * cols)
        out[..., rs, cs] = xf[..., rs, cs] * s[..., bi:bi + 1, bj:bj + 1]
  with np.errstate(over="ignore", invalid="ignore"):
    return out.astype(out_dtype)


def test_quantized_tensor_is_a_pytree_with_a_static_mode():
  data = jnp.asarray(random_fp8((3, 300), E4M3, seed=1))
  s = jnp.asarray(random_scale_inv((3, 3), seed=2))
  q = QuantizedTensor(data, s, mode=ScalingMode.BLOCK_1X128)
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 2 and leaves[0] is data and leaves[1] is s  # None fields and the mode are not leaves
  assert jax.tree_util.tree_unflatten(treedef, leaves).mode is ScalingMode.BLOCK_1X128
  per_tensor = QuantizedTensor(data, jnp.float32(1.0))
  assert jax.tree_util.tree_structure(per_tensor) != treedef  # the mode is part of the structure

  traced_modes = []

  def f(q):
    traced_modes.append(q.mode)  # static: a Python value while tracing, not a tracer
    return q

  for t in (q, per_tensor, quantize(jnp.ones((4, 6)), 0.5, E5M2, transpose=True).out):
    out = jax.jit(f)(t)
    assert isinstance(out, QuantizedTensor) and out.mode is t.mode
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(t)
    assert_fp8_equal(out.data, t.data)
    assert_f32_equal(out.scale_inv, t.scale_inv, what="scale_inv")
    assert (out.data_t is None) == (t.data_t is None) and (out.scale_inv_t is None) == (t.scale_inv_t is None)
    if t.data_t is not None:
      assert_fp8_equal(out.data_t, t.data_t, what="data_t")
      assert_f32_equal(out.scale_inv_t, t.scale_inv_t, what="scale_inv_t")
  assert traced_modes == [ScalingMode.BLOCK_1X128, ScalingMode.PER_TENSOR, ScalingMode.PER_TENSOR]
  assert q.shape == (3, 300) and q.dtype == E4M3


def test_quantized_tensor_transposed_and_without_transposed():
  x = random_input((5, 7), np.float32, seed=3) / 64
  q = quantize(jnp.asarray(x), 2.0, E4M3, transpose=True).out
  t = q.transposed()
  assert isinstance(t, QuantizedTensor) and t.mode is ScalingMode.PER_TENSOR
  assert t.shape == (7, 5) and t.data_t is None and t.scale_inv_t is None
  assert_fp8_equal(t.data, q.data_t)
  assert_fp8_equal(t.data, np.asarray(q.data).T, what="transposed data")
  assert_f32_equal(t.scale_inv, np.float32(0.5), what="scale_inv")
  assert_hp_equal(t.dequantize(jnp.float32), np.asarray(q.dequantize(jnp.float32)).T)

  d = q.without_transposed()
  assert d.data_t is None and d.scale_inv_t is None and d.mode is q.mode
  assert d.data is q.data and d.scale_inv is q.scale_inv
  assert q.data_t is not None  # a copy: q itself keeps its transposed copy
  with pytest.raises(ValueError, match="has no transposed copy"):
    d.transposed()
  with pytest.raises(ValueError, match="has no transposed copy"):
    quantize(jnp.asarray(x), 2.0).out.transposed()


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", [(7,), (5, 9), (2, 3, 4)], ids=str)
@FP8
def test_per_tensor_dequantize_matches_numpy(fp8, shape, out_dtype):
  assert ScalingMode.PER_TENSOR.scale_shape(shape) == ()
  assert ScalingMode.PER_TENSOR.block is None and ScalingMode.PER_TENSOR.scale_dtype == np.float32
  data = random_fp8(shape, fp8, seed=len(shape))
  s = np.float32(0.3)
  got = QuantizedTensor(jnp.asarray(data), jnp.float32(s)).dequantize(out_dtype)
  with np.errstate(over="ignore", invalid="ignore"):
    want = (data.astype(np.float32) * s).astype(out_dtype)
  assert_hp_equal(got, want)


# Shapes that are not multiples of the block (a partial block at the end of a row, and of the rows for 128x128),
# blocks of one element, ranks 1 to 4.
BLOCK_CASES = [
    (ScalingMode.BLOCK_1X128, (1,), (1,)),
    (ScalingMode.BLOCK_1X128, (127,), (1,)),
    (ScalingMode.BLOCK_1X128, (129,), (2,)),
    (ScalingMode.BLOCK_1X128, (3, 300), (3, 3)),
    (ScalingMode.BLOCK_1X128, (4, 256), (4, 2)),
    (ScalingMode.BLOCK_1X128, (2, 5, 129), (2, 5, 2)),
    (ScalingMode.BLOCK_128X128, (1, 1), (1, 1)),
    (ScalingMode.BLOCK_128X128, (130, 257), (2, 3)),
    (ScalingMode.BLOCK_128X128, (256, 128), (2, 1)),
    (ScalingMode.BLOCK_128X128, (2, 200, 100), (2, 2, 1)),
    (ScalingMode.BLOCK_128X128, (2, 1, 129, 3), (2, 1, 2, 1)),
]


@pytest.mark.parametrize("mode,shape,scale_shape", BLOCK_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_block_scale_shape(mode, shape, scale_shape):
  assert mode.scale_shape(shape) == scale_shape
  rows, cols = mode.block
  assert scale_shape[-1] == math.ceil(shape[-1] / cols)
  if rows > 1:
    assert scale_shape[-2] == math.ceil(shape[-2] / rows)
  assert mode.scale_dtype == np.float32


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("mode,shape,scale_shape", BLOCK_CASES, ids=lambda v: getattr(v, "name", str(v)))
@FP8
@pytest.mark.fast_cases(10)
def test_block_dequantize_matches_numpy(fp8, mode, shape, scale_shape, out_dtype):
  data = random_fp8(shape, fp8, seed=sum(shape))
  s = random_scale_inv(scale_shape, seed=len(shape))
  q = QuantizedTensor(jnp.asarray(data), jnp.asarray(s), mode=mode)
  want = numpy_dequantize_blocks(data, s, mode.block, out_dtype)
  assert_hp_equal(q.dequantize(out_dtype), want)
  assert_hp_equal(jax.jit(lambda q: q.dequantize(out_dtype))(q), want, what="dequantized under jit")


def test_block_dequantize_scales_cover_their_block():
  """Each scale multiplies exactly its block: ones dequantize to the scale of the block they are in, the partial
  blocks at the end included."""
  s = np.array([[2.0, 3.0, 5.0], [7.0, 11.0, 13.0]], np.float32)
  got = np.asarray(QuantizedTensor(jnp.ones((130, 257), E4M3), jnp.asarray(s),
                                   mode=ScalingMode.BLOCK_128X128).dequantize(jnp.float32))
  rows = np.array([0, 127, 128, 129])
  cols = np.array([0, 127, 128, 255, 256])
  want = s[rows[:, None] // 128, cols[None, :] // 128]
  np.testing.assert_array_equal(got[rows[:, None], cols[None, :]], want)
  got = np.asarray(QuantizedTensor(jnp.ones((2, 257), E4M3), jnp.asarray(s),
                                   mode=ScalingMode.BLOCK_1X128).dequantize(jnp.float32))
  np.testing.assert_array_equal(got[:, cols], s[:, cols // 128])


@pytest.mark.parametrize("mode,shape", [(ScalingMode.BLOCK_1X128, ()), (ScalingMode.BLOCK_128X128, (5,)),
                                        (ScalingMode.BLOCK_128X128, ())], ids=str)
def test_block_scale_shape_needs_rank(mode, shape):
  with pytest.raises(ValueError, match=f"^{mode.name} scaling needs data of rank >= "):
    mode.scale_shape(shape)


# ---- CUDA handler vs reference on the GPU --------------------------------------------------------------------------

# Odd shapes (generic 32x32-tile kernel) and shapes with cols % 8 == 0 and rows % 8 == 0 (fast 128x128-tile kernel),
# with partial tiles; (1001, 1000) takes the fast kernel without transpose and the generic one with it.
GPU_SHAPES = [(7,), (1, 1), (17, 1), (5, 7), (33, 130), (3, 17, 33), (2, 3, 5, 7), (8, 8), (200, 264),
              (1001, 1000), (1000, 1001), (4, 136, 128)]
GPU_LARGE = [((16384, 8192), ml_dtypes.bfloat16), ((3, 1000, 4096), ml_dtypes.bfloat16),
             ((3, 1000, 4096), np.float32), ((4096, 4104), np.float16), ((4097, 4099), np.float32)]
# Each is its own kernel instantiation.
GPU_EXTRAS = {"plain": {}, "t": {"transpose": True}, "dbias": {"dbias": True},
              "t+dbias": {"transpose": True, "dbias": True}}


def assert_cuda_handler(x, fp8, gpu, **kwargs):
  assert te_native.has_target("cuda", "te_quantize_cuda"), te_native.load_errors
  return assert_matches_reference(x, 1.0, fp8, device=gpu, **kwargs)


# All shapes of a configuration go through one compiled program: GPU time goes to the kernels, not to compiles.
@pytest.mark.gpu
@pytest.mark.parametrize("extras", list(GPU_EXTRAS.values()), ids=list(GPU_EXTRAS))
@IN_DTYPES
@FP8
def test_gpu_matches_reference(extras, dtype, fp8, gpu):
  assert te_native.has_target("cuda", "te_quantize_cuda"), te_native.load_errors
  shapes = [s for s in GPU_SHAPES if len(s) > 1 or not extras.get("transpose")]  # no transposed copy of a vector
  xs = [random_input(shape, dtype, seed=sum(shape)) for shape in shapes]
  assert_many_match_reference(xs, 1.0, fp8, device=gpu, **extras)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", GPU_LARGE, ids=lambda v: str(v) if isinstance(v, tuple) else None)
@FP8
def test_gpu_large(shape, dtype, fp8, gpu):
  assert_cuda_handler(_large_input(shape, dtype), fp8, gpu, transpose=True, dbias=True)


@functools.lru_cache(maxsize=1)  # generated once for both formats (the largest takes seconds); never mutated
def _large_input(shape, dtype) -> np.ndarray:
  return random_input(shape, dtype, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,batch_dims", [((3, 17, 33), 0), ((2, 3, 5, 7), 0), ((2, 3, 5, 7), 1),
                                              ((4, 64, 128), 0), ((2, 3, 64, 128), 1), ((2, 3, 64, 128), 0)], ids=str)
@pytest.mark.parametrize("dbias", [False, True], ids=["", "dbias"])
def test_gpu_transpose_modes(shape, batch_dims, dbias, gpu):
  x = random_input(shape, ml_dtypes.bfloat16, seed=2)
  assert_cuda_handler(x, E4M3, gpu, transpose=True, transpose_batch_dims=batch_dims, dbias=dbias)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,parts", TRANSPOSE_PARTS_CASES + [((4096, 12288), (3, 128))], ids=str)
@pytest.mark.parametrize("dbias", [False, True], ids=["", "dbias"])
@pytest.mark.parametrize("dtype,fp8", [(ml_dtypes.bfloat16, E4M3), (np.float32, E4M3), (np.float32, E5M2)],
                         ids=["bf16-e4m3", "f32-e4m3", "f32-e5m2"])
def test_gpu_transpose_parts(shape, parts, dbias, dtype, fp8, gpu):
  assert te_native.has_target("cuda", "te_quantize_cuda"), te_native.load_errors
  check_transpose_parts(random_input(shape, dtype, seed=11), fp8, *parts, dbias, device=gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [7, 64], ids=["generic", "fast"])
@IN_DTYPES
@FP8
def test_gpu_special_values(dtype, fp8, cols, gpu):
  values, mid = fp8_grid(fp8)
  v = np.concatenate([special_values(fp8), values, mid, -mid, np.nextafter(mid, np.float32(np.inf))])
  with np.errstate(over="ignore"):
    x = np.resize(v, (8 * (len(v) // (8 * cols) + 1), cols)).astype(dtype)
  out = assert_cuda_handler(x, fp8, gpu, transpose=True)
  assert np.isnan(np.asarray(out.amax))
  finite = np.where(np.isfinite(x.astype(np.float32)), x, 0).astype(dtype)
  out = assert_cuda_handler(finite, fp8, gpu, transpose=True, dbias=True)
  assert_fp8_equal(out.data, numpy_quantize(finite, 1.0, fp8), what="data vs ml_dtypes")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 1001)], ids=str)
def test_gpu_dbias_is_deterministic(shape, gpu):
  x = jax.device_put(random_input(shape, np.float32, seed=6), gpu)
  f = jax.jit(lambda x: quantize(x, 1.0, E4M3, transpose=True, dbias=True).dbias)
  first = np.asarray(f(x))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(f(x)).view(np.uint32), first.view(np.uint32))
