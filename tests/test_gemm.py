"""gemm: ``out = lhs @ rhs^T`` (K-major operands), FP8 or bfloat16/float16/float32, with a bias epilogue.

- Values against a float64 numpy reference, with flash-attention's rule (the tolerance rule (CONTRIBUTING.md)):
  ``err(ours, f64) <= 2 * err(baseline, f64) + noise``, errors as the max absolute error over the output. The
  baseline is the same math at our precision (operands in their dtype, float32 accumulation, bias in float32, one
  cast to the output dtype): an independent jnp einsum on CPU, ``gemm_ref`` jitted on the same GPU on a GPU. FP8
  operands are made by ``quantize`` and their float64 values are the dequantized FP8 bytes, so the comparison
  measures the GEMM, not the quantization.
- ``rhs_parts``: equal to one GEMM per part, on CPU bitwise and on a GPU (one cuBLASLt pointer-array batched GEMM)
  within the same bounds as the single GEMM.
- ``batched``: each batch index within the single GEMM's bound of its exact product (CPU: the reference; GPU: one
  cuBLASLt strided batched GEMM); a sharded batch, M or N keeps its sharding with no collective, a sharded K one
  all-reduce.
- Argument checks, raised in Python with messages that name the problem.
- Under ``jax.jit`` on 8 CPU devices: column- and row-parallel GEMMs hold exactly the collectives they need.
- On a GPU (``@pytest.mark.gpu``): the cuBLASLt handler, including M not a multiple of 16 with FP8, 4096^3,
  fast accumulation, the custom call in the compiled HLO, bitwise determinism, and a first call captured into one of
  XLA's command buffers.
"""

import collections
import functools
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import F32_U
from te_jax import QuantizedTensor, ScalingMode
from te_jax._core import native
from te_jax.ops.gemm import GemmConfig, gemm_ref
from te_jax.ops.gemm import gemm
from te_jax.ops.quantize import quantize

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
CPU = jax.devices("cpu")[0]
CPU_DEVICES = jax.devices("cpu")

HP_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
OUT_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
FP8_PAIRS = {"e4m3xe4m3": (E4M3, E4M3), "e5m2xe4m3": (E5M2, E4M3), "e4m3xe5m2": (E4M3, E5M2)}
HLO_TYPE = {E4M3: "f8e4m3fn[", E5M2: "f8e5m2["}
LAYOUTS = {"nn": (False, False), "tn": (True, False), "nt": (False, True), "tt": (True, True)}

# Unit roundoff of the accumulator of Hopper's FP8 tensor cores: about 14 bits are retained (DeepSeek-V3 technical
# report, section 3.3.2), well short of float32's 24. cuBLASLt promotes partial sums to float32 only every few
# k-blocks (and never with fast accumulation), so the FP8 GEMM's noise term uses this roundoff instead of float32's.
FP8_ACCUM_U = 2.0**-14


# ---- operands and references ---------------------------------------------------------------------------------------


class Operand:
  """A GEMM operand as stored (``array``) and its exact float64 value in the logical (rows..., K) layout."""

  def __init__(self, array, logical64, scale_inv=None):
    self.array = array
    self.logical64 = logical64  # (*rows, K)
    self.scale_inv = scale_inv

  @property
  def matrix64(self) -> np.ndarray:
    """(rows, K) in float64."""
    return self.logical64.reshape(-1, self.logical64.shape[-1])

  def arg(self, put=None, array=None):
    """The operand as ``gemm`` takes it: the stored array (or ``array``, a placed copy of it), as a
    ``QuantizedTensor`` with its scale_inv when FP8; ``put`` places the array and the scale_inv."""
    put = put or (lambda x: x)
    data = put(self.array) if array is None else array
    return data if self.scale_inv is None else QuantizedTensor(data, put(self.scale_inv))


def hp_operand(rows: tuple, k: int, dtype, transposed: bool, seed: int) -> Operand:
  """Normal values in ``dtype``; stored with K first when ``transposed`` (rows keep their order)."""
  rng = np.random.default_rng(seed)
  logical = rng.standard_normal((*rows, k)).astype(dtype)
  stored = np.moveaxis(logical, -1, 0) if transposed else logical
  return Operand(np.ascontiguousarray(stored), logical.astype(np.float64))


def fp8_operand(rows: tuple, k: int, fp8, seed: int) -> Operand:
  """FP8 bytes from ``quantize`` at a scale that is not a power of two (so scale_inv != 1 is exercised),
  with their exact float64 values ``data * scale_inv``."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((*rows, k)) * 3.0).astype(np.float32)
  scale = np.float32(0.8 * float(ml_dtypes.finfo(fp8).max) / np.abs(x).max())
  data = quantize(jax.device_put(x, CPU), jax.device_put(scale, CPU), fp8).out.data
  scale_inv = np.float32(1.0) / scale
  assert scale_inv != 1.0
  data = np.asarray(data)
  return Operand(data, data.astype(np.float64) * np.float64(scale_inv), scale_inv)


def exact64(lhs: Operand, rhs: Operand, bias64, rows=slice(None)) -> tuple[np.ndarray, np.ndarray]:
  """The exact result (float64; each product of two operands is exact in float64, sums round at 2^-53) and
  ``sum_k |a_ik b_jk|``, which scales every accumulation error bound; ``rows`` selects rows of the result."""
  a, b = lhs.matrix64[rows], rhs.matrix64
  out = a @ b.T
  if bias64 is not None:
    out = out + bias64
  return out, np.abs(a) @ np.abs(b).T


def max_err(actual, expected64) -> float:
  actual = np.asarray(actual).astype(np.float64)
  assert np.all(np.isfinite(actual)), "non-finite output"
  return float(np.max(np.abs(actual - expected64))) if actual.size else 0.0


def assert_gemm_close(ours, baseline, lhs: Operand, rhs: Operand, bias64, *, accum_u=F32_U, rows=slice(None)):
  """err(ours) <= 2 * err(baseline) + noise, both against the float64 result.

  noise = sqrt(K) * accum_u * max sum|a||b|: the probabilistic bound of a sum of K rounded terms (Higham & Mary,
  "A new approach to probabilistic rounding error analysis", 2019, with lambda = 1), which covers two correct
  float32 (or FP8 tensor-core) accumulations in different orders being on different sides of each other.
  """
  k = lhs.matrix64.shape[-1]
  exact, abs_prod = exact64(lhs, rhs, bias64, rows)
  m_rows = np.asarray(ours).reshape(-1, exact.shape[-1])[rows]
  b_rows = np.asarray(baseline).reshape(-1, exact.shape[-1])[rows]
  err, err_base = max_err(m_rows, exact), max_err(b_rows, exact)
  noise = math.sqrt(k) * accum_u * float(abs_prod.max(initial=0.0))
  assert err <= 2 * err_base + noise, f"err {err:.3g} > 2 * baseline err {err_base:.3g} + noise {noise:.3g}"
  return err, err_base


def jnp_same_math(lhs: Operand, rhs: Operand, bias, out_dtype, transpose_lhs, transpose_rhs):
  """The GEMM's math at its precision, written independently of te_jax: einsum over the stored layouts with float32
  accumulation at HIGHEST precision (no TF32 on a GPU), bias cast to the output dtype and added in float32, one
  final cast."""
  a, b = lhs.array, rhs.array
  if lhs.scale_inv is not None:
    a = jnp.asarray(a).astype(jnp.float32) * lhs.scale_inv
    b = jnp.asarray(b).astype(jnp.float32) * rhs.scale_inv
  a_sub = "k" + "mn"[: a.ndim - 1] if transpose_lhs else "mn"[: a.ndim - 1] + "k"
  b_sub = "k" + "pq"[: b.ndim - 1] if transpose_rhs else "pq"[: b.ndim - 1] + "k"
  out_sub = "mn"[: a.ndim - 1] + "pq"[: b.ndim - 1]
  out = jnp.einsum(f"{a_sub},{b_sub}->{out_sub}", a, b, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
  if bias is not None:
    rhs_rows = rhs.logical64.shape[:-1]  # the bias is (N,) with N the flattened rhs rows
    out = out + jnp.asarray(bias).astype(out_dtype).astype(jnp.float32).reshape(rhs_rows)
  return out.astype(out_dtype)


def random_bias(n: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def bias64_of(bias, out_dtype):
  """The bias as the GEMM sees it: cast to the output dtype."""
  return None if bias is None else np.asarray(jnp.asarray(bias).astype(out_dtype)).astype(np.float64)


def run_gemm(lhs: Operand, rhs: Operand, bias, out_dtype, device=CPU, **kwargs):
  """gemm, jitted, on ``device``; returns (out, compiled HLO text)."""
  put = functools.partial(jax.device_put, device=device)
  args = [lhs.arg(put), rhs.arg(put)]
  b = None if bias is None else put(bias)

  def f(a, r, b):
    return gemm(a, r, bias=b, dtype=out_dtype, **kwargs)

  compiled = jax.jit(f).lower(*args, b).compile()
  return compiled(*args, b), compiled.as_text()


# ---- CPU: the reference lowering against float64 ------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.fast_cases(12)
def test_high_precision_values(layout, dtype, out, with_bias):
  tl, tr = LAYOUTS[layout]
  m, k, n = 24, 40, 20  # no multiple of 16 needed outside FP8
  lhs = hp_operand((m,), k, HP_DTYPES[dtype], tl, seed=1)
  rhs = hp_operand((n,), k, HP_DTYPES[dtype], tr, seed=2)
  bias = random_bias(n, seed=3) if with_bias else None
  out_dtype = OUT_DTYPES[out]
  ours, _ = run_gemm(lhs, rhs, bias, out_dtype, transpose_lhs=tl, transpose_rhs=tr)
  assert ours.shape == (m, n) and ours.dtype == out_dtype
  base = jnp_same_math(lhs, rhs, bias, out_dtype, tl, tr)
  assert_gemm_close(ours, base, lhs, rhs, bias64_of(bias, out_dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_batch_dims_fold_into_rows(layout, dtype):
  """Rank-3 operands: lhs (2, 5, K) and rhs (3, 16, K) (or K first when transposed) give (2, 5, 3, 16)."""
  tl, tr = LAYOUTS[layout]
  lhs = hp_operand((2, 5), 48, HP_DTYPES[dtype], tl, seed=4)
  rhs = hp_operand((3, 16), 48, HP_DTYPES[dtype], tr, seed=5)
  bias = random_bias(48, seed=6)
  ours, _ = run_gemm(lhs, rhs, bias, jnp.float32, transpose_lhs=tl, transpose_rhs=tr)
  assert ours.shape == (2, 5, 3, 16)
  base = jnp_same_math(lhs, rhs, bias, jnp.float32, tl, tr)
  assert base.shape == ours.shape
  assert_gemm_close(ours, base, lhs, rhs, bias64_of(bias, jnp.float32))


@pytest.mark.parametrize("pair", FP8_PAIRS)
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("lhs_rows,rhs_rows", [((24,), (32,)), ((3, 7), (2, 16))], ids=["2d", "3d"])
@pytest.mark.fast_cases(8)
def test_fp8_values(pair, out, with_bias, lhs_rows, rhs_rows):
  lhs_dtype, rhs_dtype = FP8_PAIRS[pair]
  k = 64
  lhs = fp8_operand(lhs_rows, k, lhs_dtype, seed=7)
  rhs = fp8_operand(rhs_rows, k, rhs_dtype, seed=8)
  n = math.prod(rhs_rows)
  bias = random_bias(n, seed=9) if with_bias else None
  out_dtype = OUT_DTYPES[out]
  ours, hlo = run_gemm(lhs, rhs, bias, out_dtype)
  assert ours.shape == (*lhs_rows, *rhs_rows) and ours.dtype == out_dtype
  for dt in (lhs_dtype, rhs_dtype):  # the operands reach the GEMM as FP8, not widened beforehand
    assert HLO_TYPE[dt] in hlo, HLO_TYPE[dt]
  base = jnp_same_math(lhs, rhs, bias, out_dtype, False, False)
  assert_gemm_close(ours, base, lhs, rhs, bias64_of(bias, out_dtype))


def test_fp8_scale_inv_is_applied():
  """Doubling lhs's scale_inv doubles the result exactly (a power of two changes no rounding)."""
  lhs = fp8_operand((16,), 32, E4M3, seed=10)
  rhs = fp8_operand((16,), 32, E4M3, seed=11)
  one, _ = run_gemm(lhs, rhs, None, jnp.float32)
  twice = Operand(lhs.array, lhs.logical64 * 2, lhs.scale_inv * np.float32(2))
  two, _ = run_gemm(twice, rhs, None, jnp.float32)
  np.testing.assert_array_equal(np.asarray(two), 2 * np.asarray(one))


def residual_case(kind: str, with_bias: bool, out_dtype, m=24, k=64, n=32):
  """Operands, bias and an (m, n) residual, with the float64 sum the GEMM's epilogue adds (both cast to the output
  dtype first)."""
  if kind == "fp8":
    lhs, rhs = fp8_operand((m,), k, E4M3, seed=50), fp8_operand((n,), k, E5M2, seed=51)
  else:
    lhs, rhs = hp_operand((m,), k, ml_dtypes.bfloat16, False, seed=50), hp_operand((n,), k, ml_dtypes.bfloat16,
                                                                                   False, seed=51)
  bias = random_bias(n, seed=52) if with_bias else None
  residual = (np.random.default_rng(53).standard_normal((m, n)) * 8).astype(np.float32)
  added64 = np.asarray(jnp.asarray(residual).astype(out_dtype)).astype(np.float64)
  if bias is not None:
    added64 = added64 + bias64_of(bias, out_dtype)
  return lhs, rhs, bias, residual, added64


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_residual_values(kind, out, with_bias):
  out_dtype = OUT_DTYPES[out]
  lhs, rhs, bias, residual, added64 = residual_case(kind, with_bias, out_dtype)
  ours, _ = run_gemm(lhs, rhs, bias, out_dtype, residual=residual)
  base = (jnp_same_math(lhs, rhs, None, jnp.float32, False, False) + added64).astype(out_dtype)
  assert_gemm_close(ours, base, lhs, rhs, added64, accum_u=FP8_ACCUM_U if kind == "fp8" else F32_U)


def test_residual_shape_is_checked():
  with pytest.raises(ValueError, match="residual must have the output's shape"):
    gemm(jnp.ones((4, 16)), jnp.ones((8, 16)), residual=jnp.ones((8, 4)))


def test_zero_k_gives_bias_plus_residual():
  out = gemm(jnp.ones((4, 0)), jnp.ones((8, 0)), bias=jnp.arange(8.0), residual=jnp.ones((4, 8)),
                    dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.arange(8.0) + 1, (4, 8)))


def test_jnp_baseline_matches_float64():
  """The baseline itself is anchored: on small integers every product and sum is exact in float32."""
  rng = np.random.default_rng(12)
  for tl, tr in LAYOUTS.values():
    a = rng.integers(-8, 8, (6, 16)).astype(np.float32)
    b = rng.integers(-8, 8, (5, 16)).astype(np.float32)
    lhs = Operand(a.T.copy() if tl else a, a.astype(np.float64))
    rhs = Operand(b.T.copy() if tr else b, b.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(jnp_same_math(lhs, rhs, None, jnp.float32, tl, tr)), a @ b.T)
    ours, _ = run_gemm(lhs, rhs, None, jnp.float32, transpose_lhs=tl, transpose_rhs=tr)
    np.testing.assert_array_equal(np.asarray(ours), a @ b.T)


def parts_case(kind: str, n_parts: int, m=24, k=64, n=32, seed=60):
  """lhs (m, K) and rhs (P, n, K) operands of ``kind`` (f32, bf16, fp8: E4M3 x E5M2), with each part's Operand."""
  if kind == "fp8":
    lhs, rhs = fp8_operand((m,), k, E4M3, seed=seed), fp8_operand((n_parts, n), k, E5M2, seed=seed + 1)
  else:
    dt = HP_DTYPES[kind]
    lhs, rhs = hp_operand((m,), k, dt, False, seed), hp_operand((n_parts, n), k, dt, False, seed + 1)
  parts = [Operand(rhs.array[i], rhs.logical64[i], rhs.scale_inv) for i in range(n_parts)]
  return lhs, rhs, parts


@pytest.mark.parametrize("n_parts", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.fast_cases(6)
def test_parts_are_the_per_part_gemms(n_parts, kind, with_bias):
  lhs, rhs, parts = parts_case(kind, n_parts)
  bias = np.stack([random_bias(32, seed=62 + i) for i in range(n_parts)]) if with_bias else None
  ours, _ = run_gemm(lhs, rhs, bias, jnp.bfloat16, rhs_parts=True)
  assert isinstance(ours, tuple) and len(ours) == n_parts
  for i, (got, part) in enumerate(zip(ours, parts)):
    want, _ = run_gemm(lhs, part, None if bias is None else bias[i], jnp.bfloat16)
    assert got.shape == (24, 32) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_parts_keep_lhs_and_rhs_rows():
  lhs = hp_operand((2, 5), 32, np.float32, False, seed=63)
  rhs = hp_operand((3, 4, 16), 32, np.float32, False, seed=64)  # 3 parts of (4, 16) rows
  ours, _ = run_gemm(lhs, rhs, None, jnp.float32, rhs_parts=True)
  for i, got in enumerate(ours):
    want, _ = run_gemm(lhs, Operand(rhs.array[i], rhs.logical64[i]), None, jnp.float32)
    assert got.shape == (2, 5, 4, 16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_eager_and_vmap():
  lhs = hp_operand((8,), 16, np.float32, False, seed=13)
  rhs = hp_operand((4,), 16, np.float32, False, seed=14)
  jitted, _ = run_gemm(lhs, rhs, None, jnp.float32)
  eager = gemm(jax.device_put(lhs.array, CPU), jax.device_put(rhs.array, CPU), dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
  stacked = np.stack([lhs.array, 2 * lhs.array])
  mapped = jax.vmap(lambda a: gemm(a, rhs.array, dtype=jnp.float32))(jax.device_put(stacked, CPU))
  np.testing.assert_array_equal(np.asarray(mapped[0]), np.asarray(jitted))
  np.testing.assert_array_equal(np.asarray(mapped[1]), 2 * np.asarray(jitted))


# ---- argument checks -----------------------------------------------------------------------------------------------


def _f8(shape, dtype=E4M3):
  """A bare FP8 array (no scale_inv)."""
  return jnp.zeros(shape, dtype)


ONE = jnp.float32(1.0)


def _q8(shape, dtype=E4M3, scale_inv=ONE):
  """An FP8 operand: zeros as a per-tensor QuantizedTensor."""
  return QuantizedTensor(_f8(shape, dtype), scale_inv)


BF = functools.partial(jnp.zeros, dtype=jnp.bfloat16)
ERROR_CASES = {
    "fp8-without-scale-inv": (lambda: gemm(_f8((16, 32)), _q8((16, 32))),
                              TypeError, r"lhs is a bare float8_e4m3fn array: pass it as a te_jax QuantizedTensor"),
    "fp8-rhs-without-scale-inv": (lambda: gemm(_q8((16, 32)), _f8((16, 32))),
                                  TypeError, r"rhs is a bare float8_e4m3fn array: pass it as a te_jax QuantizedTensor"),
    "fp8-e5m2-without-scale-inv": (lambda: gemm(_q8((16, 32)), _f8((16, 32), E5M2)),
                                   TypeError, r"rhs is a bare float8_e5m2 array"),
    "scale-inv-for-bf16": (lambda: gemm(QuantizedTensor(BF((16, 32)), ONE), BF((16, 32))),
                           TypeError, r"lhs must hold float8_e4m3fn or float8_e5m2 data, got bfloat16"),
    "scale-inv-not-f32-scalar": (lambda: gemm(_q8((16, 32), scale_inv=jnp.ones((1,))), _q8((16, 32))),
                                 TypeError, r"lhs\.scale_inv must be a float32 scalar"),
    "rhs-scale-inv-not-f32-scalar": (lambda: gemm(_q8((16, 32)), _q8((16, 32), scale_inv=jnp.ones((16,)))),
                                     TypeError, r"rhs\.scale_inv must be a float32 scalar"),
    "scale-inv-not-f32": (lambda: gemm(_q8((16, 32), scale_inv=jnp.ones((), jnp.bfloat16)), _q8((16, 32))),
                          TypeError, r"lhs\.scale_inv must be a float32 scalar, got .*bfloat16"),
    "rhs-scale-inv-not-f32": (lambda: gemm(_q8((16, 32)), _q8((16, 32), scale_inv=jnp.ones((), jnp.float16))),
                              TypeError, r"rhs\.scale_inv must be a float32 scalar, got .*float16"),
    "scale-inv-python-float": (lambda: gemm(_q8((16, 32), scale_inv=1.0), _q8((16, 32))),
                               TypeError, r"lhs\.scale_inv must be a float32 scalar"),
    "mixed-fp8-bf16": (lambda: gemm(_q8((16, 32)), BF((16, 32))),
                       TypeError, r"both be FP8 or both not"),
    "e5m2xe5m2": (lambda: gemm(_q8((16, 32), E5M2), _q8((16, 32), E5M2)),
                  TypeError, r"E5M2 x E5M2 has no FP8 GEMM"),
    "fp8-transpose-lhs": (lambda: gemm(_q8((32, 16)), _q8((16, 32)), transpose_lhs=True),
                          ValueError, r"FP8 operands must be K-major"),
    "fp8-transpose-rhs": (lambda: gemm(_q8((16, 32)), _q8((32, 16)), transpose_rhs=True),
                          ValueError, r"FP8 operands must be K-major"),
    "k-mismatch": (lambda: gemm(BF((16, 32)), BF((16, 48))),
                   ValueError, r"contracting dims differ: lhs \(16, 32\) has K=32, rhs \(16, 48\) has K=48"),
    "k-mismatch-transposed": (lambda: gemm(BF((32, 16)), BF((16, 48)), transpose_lhs=True),
                              ValueError, r"contracting dims differ"),
    "fp8-k-not-16": (lambda: gemm(_q8((16, 40)), _q8((16, 40))),
                     ValueError, r"multiples of 16, got K=40, N=16"),
    "fp8-n-not-16": (lambda: gemm(_q8((16, 32)), _q8((24, 32))),
                     ValueError, r"multiples of 16, got K=32, N=24"),
    "bad-out-dtype": (lambda: gemm(BF((16, 32)), BF((16, 32)), dtype=jnp.int8),
                      ValueError, r"dtype must be bfloat16, float16 or float32, got int8"),
    "fp8-out-dtype": (lambda: gemm(BF((16, 32)), BF((16, 32)), dtype=E4M3),
                      ValueError, r"dtype must be .* got float8_e4m3fn"),
    "bias-wrong-shape": (lambda: gemm(BF((16, 32)), BF((24, 32)), bias=jnp.zeros((16,))),
                         ValueError, r"bias must have shape \(24,\), got \(16,\)"),
    "bias-2d": (lambda: gemm(BF((16, 32)), BF((24, 32)), bias=jnp.zeros((1, 24))),
                ValueError, r"bias must have shape \(24,\)"),
    "rank1-lhs": (lambda: gemm(BF((32,)), BF((16, 32))), ValueError, r"lhs must have rank >= 2"),
    "rank1-rhs": (lambda: gemm(BF((16, 32)), BF((32,))), ValueError, r"rhs must have rank >= 2"),
    "int-operand": (lambda: gemm(jnp.zeros((16, 32), jnp.int8), BF((16, 32))),
                    TypeError, r"lhs must be bfloat16, float16, float32 or a QuantizedTensor, got int8"),
    "parts-2d-rhs": (lambda: gemm(BF((16, 32)), BF((48, 32)), rhs_parts=True),
                     ValueError, r"rhs_parts needs rhs of shape \(P, \.\.\., K\) with 1 <= P <= 4, got \(48, 32\)"),
    "parts-too-many": (lambda: gemm(BF((16, 32)), BF((5, 16, 32)), rhs_parts=True),
                       ValueError, r"1 <= P <= 4, got \(5, 16, 32\)"),
    "parts-transposed": (lambda: gemm(BF((16, 32)), BF((3, 32, 16)), rhs_parts=True, transpose_rhs=True),
                         ValueError, r"rhs_parts needs an untransposed rhs"),
    "parts-residual": (lambda: gemm(BF((16, 32)), BF((3, 16, 32)), residual=BF((16, 16)), rhs_parts=True),
                       ValueError, r"rhs_parts and residual exclude each other"),
    "parts-bias-shape": (lambda: gemm(BF((16, 32)), BF((3, 16, 32)), bias=jnp.zeros((48,)), rhs_parts=True),
                         ValueError, r"with rhs_parts, bias must have shape \(3, 16\), got \(48,\)"),
    "parts-fp8-n-not-16": (lambda: gemm(_q8((16, 32)), _q8((3, 8, 32)), rhs_parts=True),
                           ValueError, r"multiples of 16, got K=32, N=8"),
    "parts-k-mismatch": (lambda: gemm(BF((16, 32)), BF((3, 16, 48)), rhs_parts=True),
                         ValueError, r"contracting dims differ"),
    "scatter-rows-2d-lhs": (lambda: gemm(BF((16, 32)), BF((16, 32)), scatter_rows=True),
                            ValueError, r"scatter_rows needs lhs \(B, S, K\), untransposed, and no rhs_parts"),
    "scatter-rows-transposed": (lambda: gemm(BF((32, 2, 8)), BF((16, 32)), transpose_lhs=True, scatter_rows=True),
                                ValueError, r"scatter_rows needs lhs .* transposed"),
    "scatter-rows-parts": (lambda: gemm(BF((2, 8, 32)), BF((3, 16, 32)), rhs_parts=True, scatter_rows=True),
                           ValueError, r"scatter_rows needs lhs .* with rhs_parts"),
    "batched-bias": (lambda: gemm(BF((2, 8, 32)), BF((2, 16, 32)), bias=jnp.zeros((16,)), batched=True),
                     ValueError, r"batched=True takes no bias .* only dtype and fast_accum"),
    "batched-options": (lambda: gemm(BF((2, 32, 8)), BF((2, 16, 32)), transpose_lhs=True, contract_dims=2,
                                     batched=True),
                        ValueError, r"batched=True takes no transpose_lhs, contract_dims"),
    "batched-2d": (lambda: gemm(BF((8, 32)), BF((16, 32)), batched=True),
                   ValueError, r"batched=True needs lhs \(B, M, K\) and rhs \(B, N, K\) .* got lhs \(8, 32\)"),
    "batched-b-mismatch": (lambda: gemm(BF((2, 8, 32)), BF((3, 16, 32)), batched=True),
                           ValueError, r"of the same B and K, got lhs \(2, 8, 32\) and rhs \(3, 16, 32\)"),
    "batched-fp8-n-not-16": (lambda: gemm(_q8((2, 8, 32)), _q8((2, 24, 32)), batched=True),
                             ValueError, r"multiples of 16, got K=32, N=24"),
    "batched-mixed": (lambda: gemm(_q8((2, 8, 32)), BF((2, 16, 32)), batched=True),
                      TypeError, r"both be FP8 or both not"),
    "batched-e5m2xe5m2": (lambda: gemm(_q8((2, 8, 32), E5M2), _q8((2, 16, 32), E5M2), batched=True),
                          TypeError, r"E5M2 x E5M2 has no FP8 GEMM"),
    "batched-block-scaled": (lambda: gemm(_block_scaled((2, 16, 256), ScalingMode.BLOCK_1X128),
                                          _block_scaled((2, 16, 256), ScalingMode.BLOCK_1X128), batched=True),
                             ValueError, r"batched=True takes per-tensor scaled operands, got lhs scaled BLOCK_1X128"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_argument_errors(case):
  call, exc, match = ERROR_CASES[case]
  with pytest.raises(exc, match=match):
    call()
  with pytest.raises(exc, match=match):  # raised while tracing, before anything is lowered
    jax.jit(call).lower()


def _block_scaled(shape, mode):
  """An FP8 operand of zeros whose scales are laid out per ``mode`` (ones, in the mode's scale dtype)."""
  return QuantizedTensor(_f8(shape), jnp.ones(mode.scale_shape(shape), mode.scale_dtype), mode=mode)


@pytest.mark.parametrize("mode", [m for m in ScalingMode if m is not ScalingMode.PER_TENSOR], ids=lambda m: m.name)
@pytest.mark.parametrize("operand", ["lhs", "rhs"])
@pytest.mark.parametrize("rhs_parts", [False, True], ids=["", "parts"])
def test_block_scaled_with_per_tensor_is_rejected(mode, operand, rhs_parts):
  """A block-scaled operand (any mode) with a per-tensor one is a ValueError that names both modes, raised in Python,
  eagerly and under jax.jit (block-scaled pairs: tests/test_gemm_block.py)."""
  rhs_shape = (2, 32, 256) if rhs_parts else (32, 256)
  lhs = _block_scaled((16, 256), mode) if operand == "lhs" else _q8((16, 256))
  rhs = _block_scaled(rhs_shape, mode) if operand == "rhs" else _q8(rhs_shape)
  call = functools.partial(gemm, lhs, rhs, rhs_parts=rhs_parts)
  other = "rhs" if operand == "lhs" else "lhs"
  match = (rf"{other} is scaled PER_TENSOR but {operand} is scaled {mode.name}: a block-scaled GEMM needs both "
           "operands block-scaled")
  with pytest.raises(ValueError, match=match):
    call()
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda a, b: gemm(a, b, rhs_parts=rhs_parts)).lower(lhs, rhs)


# ---- sharding on 8 CPU devices -------------------------------------------------------------------------------------

_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")

# (name, lhs spec, rhs spec, out spec asked for (None: the partitioner's), out spec expected, collectives expected)
SHARDING_CASES = {
    "column-parallel": (P(), P("x", None), None, P(None, "x"), {}),
    "row-parallel": (P(None, "x"), P(None, "x"), None, P(), {"all-reduce": 1}),
    "row-parallel-scatter": (P(None, "x"), P(None, "x"), P("x", None), P("x", None), {"reduce-scatter": 1}),
    # a weight gradient whose columns are sharded: scattered over N
    "row-parallel-scatter-n": (P(None, "x"), P(None, "x"), P(None, "x"), P(None, "x"), {"reduce-scatter": 1}),
    # FSDP: lhs's rows and rhs's K on the same axis; the rows stay sharded and rhs is all-gathered (in its dtype)
    "fsdp": (P("x", None), P(None, "x"), None, P("x", None), {"all-gather": 1}),
}


@pytest.mark.parametrize("case", SHARDING_CASES)
@pytest.mark.parametrize("kind", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.fast_cases(8)
def test_sharded_gemm(case, kind, with_bias):
  """Collectives in the compiled HLO, output sharding, and values equal to the unsharded GEMM.

  Tolerance: the output is float32, and a sharded K reorders the float32 sum of the same K products (8 local sums of
  K/8, then an all-reduce of 8 partials). Any order is within gamma_{K-1} * sum|a||b| of the exact sum (Higham,
  Accuracy and Stability of Numerical Algorithms, eq. 4.4), so the two results are within twice that.
  """
  lhs_spec, rhs_spec, out_spec, want_spec, want = SHARDING_CASES[case]
  mesh = Mesh(np.array(CPU_DEVICES), ("x",))
  m, k, n = 64, 256, 128  # the shards: 8 rows, 32 K, 16 N
  if kind == "fp8":
    lhs, rhs = fp8_operand((m,), k, E4M3, seed=20), fp8_operand((n,), k, E4M3, seed=21)
  else:
    lhs = hp_operand((m,), k, HP_DTYPES[kind], False, seed=20)
    rhs = hp_operand((n,), k, HP_DTYPES[kind], False, seed=21)
  bias = random_bias(n, seed=22) if with_bias else None

  def f(a, b, bias):
    return gemm(a, b, bias=bias, dtype=jnp.float32)

  a_s = lhs.arg(array=jax.device_put(lhs.array, NamedSharding(mesh, lhs_spec)))
  b_s = rhs.arg(array=jax.device_put(rhs.array, NamedSharding(mesh, rhs_spec)))
  jitted = jax.jit(f, out_shardings=None if out_spec is None else NamedSharding(mesh, out_spec))
  compiled = jitted.lower(a_s, b_s, bias).compile()
  out = compiled(a_s, b_s, bias)
  hlo = compiled.as_text()

  assert collections.Counter(_COLLECTIVE.findall(hlo)) == collections.Counter(want), _COLLECTIVE.findall(hlo)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2), out.sharding
  ref, _ = run_gemm(lhs, rhs, bias, jnp.float32)  # unsharded, one device
  _, abs_prod = exact64(lhs, rhs, bias64_of(bias, jnp.float32))
  gamma = (k - 1) * F32_U / (1 - (k - 1) * F32_U)
  bound = 2 * gamma * (abs_prod + (0 if bias is None else np.abs(bias)))
  diff = np.abs(np.asarray(out).astype(np.float64) - np.asarray(ref).astype(np.float64))
  assert np.all(diff <= bound), f"max diff {diff.max():.3g}, bound there {bound.flat[np.argmax(diff)]:.3g}"


@pytest.mark.parametrize("case", SHARDING_CASES)
def test_sharded_gemm_adds_the_residual_once(case):
  """With K sharded, the residual goes on after the reduction, once; otherwise in each shard's epilogue."""
  lhs_spec, rhs_spec, out_spec, want_spec, want = SHARDING_CASES[case]
  mesh = Mesh(np.array(CPU_DEVICES), ("x",))
  lhs, rhs = hp_operand((64,), 256, np.float32, False, seed=23), hp_operand((128,), 256, np.float32, False, seed=24)
  residual = np.full((64, 128), 1000.0, np.float32)
  out_sharding = None if out_spec is None else NamedSharding(mesh, out_spec)
  f = jax.jit(lambda a, b, r: gemm(a, b, residual=r, dtype=jnp.float32), out_shardings=out_sharding)
  compiled = f.lower(jax.device_put(lhs.array, NamedSharding(mesh, lhs_spec)),
                     jax.device_put(rhs.array, NamedSharding(mesh, rhs_spec)), residual).compile()
  out = compiled(jax.device_put(lhs.array, NamedSharding(mesh, lhs_spec)),
                 jax.device_put(rhs.array, NamedSharding(mesh, rhs_spec)), residual)
  assert collections.Counter(_COLLECTIVE.findall(compiled.as_text())) == collections.Counter(want)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 2), out.sharding
  exact, abs_prod = exact64(lhs, rhs, residual.astype(np.float64))
  k = 256
  bound = 2 * (k - 1) * F32_U / (1 - (k - 1) * F32_U) * abs_prod + 1000.0 * F32_U * 2
  assert np.all(np.abs(np.asarray(out) - exact) <= bound)


def test_scatter_rows_unsharded_is_the_gemm():
  """scatter_rows changes only how the output's rows may be sharded: on one device the same values, bit for bit, with
  the bias and a residual in the epilogue."""
  lhs, rhs = fp8_operand((4, 8), 64, E4M3, seed=25), fp8_operand((32,), 64, E4M3, seed=26)
  bias, residual = random_bias(32, seed=27), np.random.default_rng(28).standard_normal((4, 8, 32)).astype(np.float32)
  plain, _ = run_gemm(lhs, rhs, bias, jnp.float32, residual=residual)
  split, _ = run_gemm(lhs, rhs, bias, jnp.float32, residual=residual, scatter_rows=True)
  assert split.shape == plain.shape == (4, 8, 32)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(plain))


@pytest.mark.parametrize("scatter_rows", [True, False], ids=["scatter-rows", "merged-rows"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_sequence_parallel_row_parallel_gemm(scatter_rows, with_bias):
  """A row-parallel GEMM onto a sequence-parallel stream: lhs (B, S, K) with B over 'data' and K over 'tensor', the
  output (and residual) wanted (B, S, N) with B over 'data' and S over 'tensor'. With scatter_rows the partial sums
  are reduce-scattered onto S; without, the (B * S, N) rows cannot carry that sharding: the partitioner all-gathers
  the residual onto them, all-reduces, then slices. The same values either way, bias and residual added once."""
  mesh = Mesh(np.array(CPU_DEVICES).reshape(2, 4), ("data", "tensor"))
  b, s, k, n = 4, 16, 128, 32
  lhs, rhs = fp8_operand((b, s), k, E4M3, seed=29), fp8_operand((n,), k, E4M3, seed=30)
  residual = np.full((b, s, n), 1000.0, np.float32)
  bias = random_bias(n, seed=31) if with_bias else np.zeros(n, np.float32)
  stream = NamedSharding(mesh, P("data", "tensor", None))
  args = (jax.device_put(lhs.array, NamedSharding(mesh, P("data", None, "tensor"))),
          jax.device_put(rhs.array, NamedSharding(mesh, P(None, "tensor"))), jax.device_put(residual, stream))
  f = jax.jit(lambda a, w, r: gemm(lhs.arg(array=a), rhs.arg(array=w), residual=r,
                                   bias=bias if with_bias else None, dtype=jnp.float32, scatter_rows=scatter_rows),
              out_shardings=stream)
  compiled = f.lower(*args).compile()
  out = compiled(*args)
  found = collections.Counter(_COLLECTIVE.findall(compiled.as_text()))
  assert found == collections.Counter({"reduce-scatter": 1} if scatter_rows else {"all-gather": 1, "all-reduce": 1})
  assert "dynamic-slice" in compiled.as_text() or scatter_rows
  assert out.sharding.is_equivalent_to(stream, 3)
  exact, abs_prod = exact64(lhs, rhs, bias.astype(np.float64))
  bound = 2 * (k - 1) * F32_U / (1 - (k - 1) * F32_U) * (abs_prod + np.abs(bias)) + 1000.0 * F32_U * 2  # as above
  assert np.all(np.abs(np.asarray(out).reshape(b * s, n) - 1000.0 - exact) <= bound)


# (lhs spec, rhs spec (P, N, K), collectives expected): each part's rows sharded (column parallel, as with the heads
# of a QKV kernel sharded) need none; a sharded K ends in psums (one per part, which XLA may combine); a sharded
# part dim is gathered.
PARTS_SHARDING_CASES = {
    "column-parallel": (P(), P(None, "x", None), {}),
    "row-parallel": (P(None, "x"), P(None, None, "x"), None),
    "parts-dim-sharded": (P(), P("x", None, None), {"all-gather": 1}),
}


@pytest.mark.parametrize("case", PARTS_SHARDING_CASES)
def test_sharded_parts_gemm(case):
  lhs_spec, rhs_spec, want = PARTS_SHARDING_CASES[case]
  # 4 parts sharded over the 4-device axis of a 4 x 2 mesh; 3 parts on a mesh of 8 devices along "x" otherwise.
  n_parts, mesh_shape = (4, (4, 2)) if case == "parts-dim-sharded" else (3, (8, 1))
  mesh = Mesh(np.array(CPU_DEVICES).reshape(mesh_shape), ("x", "y"))
  m, k, n = 64, 256, 128
  lhs, rhs, parts = parts_case("fp8", n_parts, m, k, n, seed=65)

  def f(a, b):
    return gemm(a, b, dtype=jnp.float32, rhs_parts=True)

  a_s = lhs.arg(array=jax.device_put(lhs.array, NamedSharding(mesh, lhs_spec)))
  b_s = rhs.arg(array=jax.device_put(rhs.array, NamedSharding(mesh, rhs_spec)))
  compiled = jax.jit(f).lower(a_s, b_s).compile()
  outs = compiled(a_s, b_s)
  found = collections.Counter(_COLLECTIVE.findall(compiled.as_text()))
  if want is None:
    assert set(found) == {"all-reduce"}, found
  else:
    assert found == collections.Counter(want), found
  if case == "column-parallel":
    assert all(o.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x")), 2) for o in outs)
  gamma = (k - 1) * F32_U / (1 - (k - 1) * F32_U)  # a sharded K reorders the float32 sums: see test_sharded_gemm
  for out, part in zip(outs, parts):
    ref, _ = run_gemm(lhs, part, None, jnp.float32)  # unsharded, one device
    _, abs_prod = exact64(lhs, part, None)
    assert out.shape == (m, n)
    assert np.all(np.abs(np.asarray(out).astype(np.float64) - np.asarray(ref)) <= 2 * gamma * abs_prod)


# ---- batched ------------------------------------------------------------------------------------------------------


def batched_case(kind: str, b: int, m: int, k: int, n: int, seed: int) -> tuple[Operand, Operand, float]:
  """(lhs (B, M, K), rhs (B, N, K), the accumulator's unit roundoff) of ``kind``: a high-precision dtype or an FP8
  pair."""
  if kind in FP8_PAIRS:
    lhs_fp8, rhs_fp8 = FP8_PAIRS[kind]
    return fp8_operand((b, m), k, lhs_fp8, seed), fp8_operand((b, n), k, rhs_fp8, seed + 1), FP8_ACCUM_U
  dtype = HP_DTYPES[kind]
  return hp_operand((b, m), k, dtype, False, seed), hp_operand((b, n), k, dtype, False, seed + 1), F32_U


def batch_index(x: Operand, i: int) -> Operand:
  return Operand(x.array[i], x.logical64[i], x.scale_inv)


def assert_batched_close(ours, lhs: Operand, rhs: Operand, baseline, accum_u):
  """Each batch index within the tolerance rule of its own GEMM; ``baseline(lhs_i, rhs_i)`` is the same math."""
  for i in range(lhs.array.shape[0]):
    li, ri = batch_index(lhs, i), batch_index(rhs, i)
    assert_gemm_close(ours[i], baseline(li, ri), li, ri, None, accum_u=accum_u)


@pytest.mark.parametrize("kind", ["f32", "bf16", *FP8_PAIRS])
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.fast_cases(4)
def test_batched_values(kind, out):
  """(B, M, K) x (B, N, K): each index the GEMM of its matrices (M = 5: no multiple of 16), under jax.jit."""
  lhs, rhs, _ = batched_case(kind, 3, 5, 64, 32, seed=80)
  ours, _ = run_gemm(lhs, rhs, None, OUT_DTYPES[out], batched=True)
  assert ours.shape == (3, 5, 32) and ours.dtype == OUT_DTYPES[out]
  # The reference path accumulates in float32 whatever the operands, so the float32 noise term.
  assert_batched_close(ours, lhs, rhs, lambda a, b: jnp_same_math(a, b, None, OUT_DTYPES[out], False, False), F32_U)


def test_batched_vmap_and_zero_k():
  """vmap over the batched GEMM is the GEMM per outer index; K = 0 gives zeros."""
  lhs, rhs, _ = batched_case("f32", 2, 8, 32, 16, seed=82)
  f = functools.partial(gemm, batched=True, dtype=jnp.float32)
  stacked = jax.vmap(f)(jnp.stack([lhs.array, 2 * lhs.array]), jnp.stack([rhs.array, rhs.array]))
  np.testing.assert_array_equal(np.asarray(stacked[0]), np.asarray(f(lhs.array, rhs.array)))
  np.testing.assert_array_equal(np.asarray(stacked[1]), np.asarray(f(2 * lhs.array, rhs.array)))
  zero = f(jnp.zeros((2, 8, 0)), jnp.zeros((2, 16, 0)))
  assert zero.shape == (2, 8, 16) and not np.any(np.asarray(zero))


# (lhs spec, rhs spec, output spec expected, collectives expected): the batch, M or N sharded stays so; K: one psum.
BATCHED_SHARDING_CASES = {
    "batch": (P("x"), P("x"), P("x", None, None), {}),
    "batch-of-lhs": (P("x"), P(), P("x", None, None), {}),
    "rows": (P(None, "x"), P(), P(None, "x", None), {}),
    "cols": (P(), P(None, "x"), P(None, None, "x"), {}),
    "k": (P(None, None, "x"), P(None, None, "x"), P(), {"all-reduce": 1}),
}


@pytest.mark.parametrize("case", BATCHED_SHARDING_CASES)
@pytest.mark.parametrize("kind", ["f32", "e4m3xe4m3"])
def test_sharded_batched_gemm(case, kind):
  """On 8 CPU devices: the collectives, the output's sharding, and the values: those of the unsharded GEMM bit for bit
  where the batch is sharded (each shard runs whole batch indices, the same GEMMs), elsewhere within the
  reordered-sum bound of test_sharded_gemm (XLA:CPU's dot tiles a shard's smaller M or N differently, and a sharded K
  adds 8 partial sums)."""
  lhs_spec, rhs_spec, want_spec, want = BATCHED_SHARDING_CASES[case]
  mesh = Mesh(np.array(CPU_DEVICES), ("x",))
  b, m, k, n = 8, 16, 128, 128
  lhs, rhs, _ = batched_case(kind, b, m, k, n, seed=84)
  a_s = lhs.arg(array=jax.device_put(lhs.array, NamedSharding(mesh, lhs_spec)))
  b_s = rhs.arg(array=jax.device_put(rhs.array, NamedSharding(mesh, rhs_spec)))
  compiled = jax.jit(lambda a, r: gemm(a, r, dtype=jnp.float32, batched=True)).lower(a_s, b_s).compile()
  out = compiled(a_s, b_s)
  assert collections.Counter(_COLLECTIVE.findall(compiled.as_text())) == collections.Counter(want)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), 3), out.sharding
  ref, _ = run_gemm(lhs, rhs, None, jnp.float32, batched=True)  # unsharded, one device
  if case.startswith("batch"):
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    return
  gamma = (k - 1) * F32_U / (1 - (k - 1) * F32_U)
  abs_prod = np.einsum("bmk,bnk->bmn", np.abs(lhs.logical64), np.abs(rhs.logical64))
  assert np.all(np.abs(np.asarray(out).astype(np.float64) - np.asarray(ref)) <= 2 * gamma * abs_prod)


# ---- GPU: the cuBLASLt handler -------------------------------------------------------------------------------------


def assert_calls_cublas(hlo: str):
  assert native.has_target("cuda", "te_gemm_cuda"), native.load_errors
  assert hlo.count('custom_call_target="te_gemm_cuda"') == 1, "te_gemm_cuda is not in the compiled HLO"


def cuda_gemm(lhs: Operand, rhs: Operand, bias, out_dtype, gpu, **kwargs):
  """gemm on the GPU, asserting that it runs the cuBLASLt handler once."""
  out, hlo = run_gemm(lhs, rhs, bias, out_dtype, device=gpu, **kwargs)
  assert_calls_cublas(hlo)
  return out


def gpu_reference(lhs: Operand, rhs: Operand, bias, out_dtype, gpu, transpose_lhs=False, transpose_rhs=False,
                  residual=None):
  """gemm_ref jitted on the same GPU (XLA's own GEMM at HIGHEST precision): the baseline on a GPU."""
  a = lhs.array.reshape(lhs.array.shape[0], -1) if transpose_lhs else lhs.array.reshape(-1, lhs.array.shape[-1])
  b = rhs.array.reshape(rhs.array.shape[0], -1) if transpose_rhs else rhs.array.reshape(-1, rhs.array.shape[-1])
  config = GemmConfig(jnp.dtype(out_dtype), transpose_lhs, transpose_rhs, bias is not None,
                      has_residual=residual is not None)
  one = np.float32(1.0)
  args = [a, b, one if lhs.scale_inv is None else lhs.scale_inv, one if rhs.scale_inv is None else rhs.scale_inv]
  if bias is not None:
    args.append(np.asarray(jnp.asarray(bias).astype(out_dtype)))
  if residual is not None:
    args.append(np.asarray(jnp.asarray(residual).astype(out_dtype)))
  (out,) = jax.jit(functools.partial(gemm_ref, config=config))(*(jax.device_put(x, gpu) for x in args))
  return out


def check_gpu_high_precision(layout, dtype, out_dtype, with_bias, mkn, gpu):
  tl, tr = LAYOUTS[layout]
  m, k, n = mkn
  lhs = hp_operand((m,), k, HP_DTYPES[dtype], tl, seed=30)
  rhs = hp_operand((n,), k, HP_DTYPES[dtype], tr, seed=31)
  bias = random_bias(n, seed=32) if with_bias else None
  ours = cuda_gemm(lhs, rhs, bias, out_dtype, gpu, transpose_lhs=tl, transpose_rhs=tr)
  assert ours.shape == (m, n) and ours.dtype == out_dtype
  base = gpu_reference(lhs, rhs, bias, out_dtype, gpu, tl, tr)
  assert_gemm_close(ours, base, lhs, rhs, bias64_of(bias, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gpu_high_precision(layout, dtype, out, with_bias, gpu):
  check_gpu_high_precision(layout, dtype, OUT_DTYPES[out], with_bias, (17, 64, 48), gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("mkn", [(24, 40, 20), (1, 8, 8), (1000, 1024, 768)], ids=str)
def test_gpu_high_precision_shapes(layout, dtype, mkn, gpu):
  check_gpu_high_precision(layout, dtype, jnp.float32, True, mkn, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_batch_dims_fold_into_rows(layout, gpu):
  tl, tr = LAYOUTS[layout]
  lhs = hp_operand((2, 5), 48, ml_dtypes.bfloat16, tl, seed=33)
  rhs = hp_operand((3, 16), 48, ml_dtypes.bfloat16, tr, seed=34)
  ours = cuda_gemm(lhs, rhs, None, jnp.float32, gpu, transpose_lhs=tl, transpose_rhs=tr)
  assert ours.shape == (2, 5, 3, 16)
  base = gpu_reference(lhs, rhs, None, jnp.float32, gpu, tl, tr)
  assert_gemm_close(ours, base, lhs, rhs, None)


# M = 8, 17, 1000: not multiples of 16. cuBLASLt's FP8 alignment rule is on the leading dims of the stored operands
# (K for both, N for the output); M is not one, so these must run. K and N stay multiples of 16 (the wrapper's rule).
GPU_FP8_SHAPES = [(8, 32, 16), (17, 64, 48), (1000, 1024, 768), (1, 16, 16), (16, 16, 16), (256, 4096, 512)]


def check_gpu_fp8(pair, out_dtype, with_bias, fast_accum, mkn, gpu):
  m, k, n = mkn
  lhs = fp8_operand((m,), k, FP8_PAIRS[pair][0], seed=35)
  rhs = fp8_operand((n,), k, FP8_PAIRS[pair][1], seed=36)
  bias = random_bias(n, seed=37) if with_bias else None
  ours = cuda_gemm(lhs, rhs, bias, out_dtype, gpu, fast_accum=fast_accum)
  assert ours.shape == (m, n) and ours.dtype == out_dtype
  base = gpu_reference(lhs, rhs, bias, out_dtype, gpu)
  assert_gemm_close(ours, base, lhs, rhs, bias64_of(bias, out_dtype), accum_u=FP8_ACCUM_U)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", FP8_PAIRS)
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
def test_gpu_fp8(pair, out, with_bias, fast_accum, gpu):
  check_gpu_fp8(pair, OUT_DTYPES[out], with_bias, fast_accum, (17, 64, 48), gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", FP8_PAIRS)
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
@pytest.mark.parametrize("mkn", GPU_FP8_SHAPES, ids=str)
def test_gpu_fp8_shapes(pair, fast_accum, mkn, gpu):
  check_gpu_fp8(pair, jnp.bfloat16, True, fast_accum, mkn, gpu)


# (M, K, P, N): small, M not a multiple of 16, the GPT layer's QKV projection (M = batch 4 x sequence 2048, K = hidden
# 4096, 3 parts of 32 heads x 128), 2 and 4 parts.
GPU_PARTS_SHAPES = [(17, 64, 3, 32), (1000, 1024, 3, 512), (8192, 4096, 3, 4096), (40, 256, 2, 144), (64, 128, 4, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "e4m3xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
@pytest.mark.parametrize("shape", GPU_PARTS_SHAPES, ids=str)
def test_gpu_parts(kind, fast_accum, shape, gpu):
  """One te_gemm_cuda call (one batched cuBLASLt GEMM) writes every part, each within the single GEMM's bound of the
  exact result, and two calls give the same bits."""
  m, k, n_parts, n = shape
  if kind == "bf16":
    lhs = hp_operand((m,), k, ml_dtypes.bfloat16, False, 68)
    rhs = hp_operand((n_parts, n), k, ml_dtypes.bfloat16, False, 69)
    accum_u = F32_U
  else:
    lhs, rhs = fp8_operand((m,), k, FP8_PAIRS[kind][0], seed=68), fp8_operand((n_parts, n), k, FP8_PAIRS[kind][1], 69)
    accum_u = FP8_ACCUM_U
  ours, hlo = run_gemm(lhs, rhs, None, jnp.bfloat16, device=gpu, fast_accum=fast_accum, rhs_parts=True)
  assert_calls_cublas(hlo)
  again, _ = run_gemm(lhs, rhs, None, jnp.bfloat16, device=gpu, fast_accum=fast_accum, rhs_parts=True)
  rows = slice(None, None, 64) if m > 1000 else slice(None)  # the float64 GEMM on the host is the slow part
  for i, (got, repeat) in enumerate(zip(ours, again)):
    part = Operand(rhs.array[i], rhs.logical64[i], rhs.scale_inv)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(repeat).view(np.uint16))
    assert_gemm_close(got, gpu_reference(lhs, part, None, jnp.bfloat16, gpu), lhs, part, None, accum_u=accum_u,
                      rows=rows)


@pytest.mark.gpu
def test_gpu_parts_with_bias(gpu):
  """With a bias, one GEMM per part (cuBLASLt's batched GEMM has no bias epilogue), each with its own bias."""
  lhs, rhs = fp8_operand((40,), 128, E4M3, seed=71), fp8_operand((3, 64), 128, E4M3, seed=72)
  bias = np.stack([random_bias(64, seed=73 + i) for i in range(3)])
  ours, hlo = run_gemm(lhs, rhs, bias, jnp.bfloat16, device=gpu, rhs_parts=True)
  assert hlo.count('custom_call_target="te_gemm_cuda"') == 3
  for i, got in enumerate(ours):
    part = Operand(rhs.array[i], rhs.logical64[i], rhs.scale_inv)
    assert_gemm_close(got, gpu_reference(lhs, part, bias[i], jnp.bfloat16, gpu), lhs, part,
                      bias64_of(bias[i], jnp.bfloat16), accum_u=FP8_ACCUM_U)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("out", OUT_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("mkn", [(24, 64, 32), (1000, 1024, 768)], ids=str)
def test_gpu_residual(kind, out, with_bias, mkn, gpu):
  out_dtype = OUT_DTYPES[out]
  m, k, n = mkn
  lhs, rhs, bias, residual, added64 = residual_case(kind, with_bias, out_dtype, m, k, n)
  ours = cuda_gemm(lhs, rhs, bias, out_dtype, gpu, residual=residual)
  base = gpu_reference(lhs, rhs, bias, out_dtype, gpu, residual=residual)
  assert_gemm_close(ours, base, lhs, rhs, added64, accum_u=FP8_ACCUM_U if kind == "fp8" else F32_U)


@pytest.mark.gpu
def test_gpu_scatter_rows(gpu):
  """With scatter_rows the handler still writes (M, N) and the lowering reshapes it to (B, S, N): the same bytes as
  without, bias and residual included."""
  lhs, rhs = fp8_operand((4, 24), 64, E4M3, seed=66), fp8_operand((48,), 64, E4M3, seed=67)
  bias = random_bias(48, seed=68)
  residual = np.random.default_rng(69).standard_normal((4, 24, 48)).astype(np.float32)
  plain = cuda_gemm(lhs, rhs, bias, jnp.bfloat16, gpu, residual=residual)
  split = cuda_gemm(lhs, rhs, bias, jnp.bfloat16, gpu, residual=residual, scatter_rows=True)
  assert split.shape == (4, 24, 48)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(plain))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "e4m3xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
def test_gpu_large_and_deterministic(kind, fast_accum, gpu):
  """4096^3: values against float64 on every 16th row (the float64 GEMM on the host is the slow part), and two
  calls of the same compiled GEMM give the same bits."""
  m = k = n = 4096
  if kind == "bf16":
    lhs = hp_operand((m,), k, ml_dtypes.bfloat16, False, seed=38)
    rhs = hp_operand((n,), k, ml_dtypes.bfloat16, False, seed=39)
    accum_u = F32_U
  else:
    lhs = fp8_operand((m,), k, FP8_PAIRS[kind][0], seed=38)
    rhs = fp8_operand((n,), k, FP8_PAIRS[kind][1], seed=39)
    accum_u = FP8_ACCUM_U
  bias = random_bias(n, seed=40)
  put = functools.partial(jax.device_put, device=gpu)
  f = jax.jit(lambda a, b, bias: gemm(a, b, bias=bias, dtype=jnp.bfloat16, fast_accum=fast_accum))
  args = (lhs.arg(put), rhs.arg(put), put(bias))
  compiled = f.lower(*args).compile()
  assert_calls_cublas(compiled.as_text())
  first = np.asarray(compiled(*args))
  second = np.asarray(compiled(*args))
  np.testing.assert_array_equal(first.view(np.uint16), second.view(np.uint16), err_msg="not deterministic")
  base = gpu_reference(lhs, rhs, bias, jnp.bfloat16, gpu)
  assert_gemm_close(first, base, lhs, rhs, bias64_of(bias, jnp.bfloat16), accum_u=accum_u, rows=slice(None, None, 16))


# A fresh process whose te_gemm calls XLA may put into its command buffers (CUDA graphs; a graph of every size): each
# problem's algorithm is timed once (on a private stream, so that it also works where the first call is captured; on
# the H200 with JAX 0.11.2 the first calls of this program ran uncaptured), and the GEMMs' values and bits are those
# of the uncaptured calls.
_CAPTURED_FIRST_CALL = r"""
import json
import jax, jax.numpy as jnp, numpy as np
import te_jax
from te_jax import _te_cuda
from te_jax.ops.gemm import gemm
from te_jax.ops.quantize import quantize

a = jax.random.normal(jax.random.key(0), (512, 256), jnp.float32)
b = jax.random.normal(jax.random.key(1), (384, 256), jnp.float32)
def f(a, b):
  y = gemm(jnp.sin(a), jnp.cos(b), dtype=jnp.float32)
  p, q = gemm(jnp.cos(a), jnp.sin(b).reshape(2, 192, 256), dtype=jnp.float32, rhs_parts=True)  # batched
  y = y + jnp.concatenate([p, q], axis=1)
  return jnp.tanh(gemm(y, jnp.cos(b).T * 0.01, dtype=jnp.float32) + 1.0)
def ref(a, b):
  hi = jax.lax.Precision.HIGHEST
  y = jnp.dot(jnp.sin(a), jnp.cos(b).T, precision=hi)
  y = y + jnp.dot(jnp.cos(a), jnp.sin(b).T, precision=hi)
  return jnp.tanh(jnp.dot(y, jnp.cos(b) * 0.01, precision=hi) + 1.0)
jf = jax.jit(f)
first, second = np.asarray(jf(a, b)), np.asarray(jf(a, b))
want = np.asarray(jax.jit(ref)(a, b))
plans = _te_cuda.gemm_plans()  # how each GEMM problem's algorithm was chosen, at its first call
print(json.dumps({"plans": plans, "max_err": float(np.max(np.abs(first - want))),
                  "same_bits": bool(np.array_equal(first.view(np.uint32), second.view(np.uint32)))}))
"""


@pytest.mark.gpu
def test_gpu_gemm_in_command_buffers(gpu):
  del gpu  # the subprocess uses the default (GPU) backend
  # The test process holds most of the GPU's memory already: the child allocates as it goes.
  env = {**os.environ, "XLA_FLAGS": "--xla_gpu_graph_min_graph_size=1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  proc = subprocess.run([sys.executable, "-c", _CAPTURED_FIRST_CALL], capture_output=True, text=True, env=env,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  shapes = {(p["m"], p["n"], p["k"], p["parts"]): p for p in result["plans"]}
  assert set(shapes) == {(512, 384, 256, 1), (512, 192, 256, 2), (512, 256, 384, 1)}, result["plans"]
  for p in shapes.values():  # timed among several candidates (whether or not the first call was captured)
    assert p["candidates"] > 1 and 0 <= p["chosen"] < p["candidates"], result["plans"]
  assert result["max_err"] <= 1e-4, result
  assert result["same_bits"], result


# (B, M, K, N): small with M = 17, attention's logits of 4 x 16 heads at 512 tokens (M = N = 512, K = head dim 128),
# one index of rows not a multiple of 16 in a large batch.
GPU_BATCHED_SHAPES = [(2, 17, 64, 48), (64, 512, 128, 512), (3, 1000, 1024, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "e4m3xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
@pytest.mark.parametrize("shape", GPU_BATCHED_SHAPES, ids=str)
def test_gpu_batched(kind, fast_accum, shape, gpu):
  """One te_gemm_cuda call (one cuBLASLt strided batched GEMM) for the whole batch, each index within the single
  GEMM's bound of its exact product (the FP8 accumulator's noise term for FP8), two calls with the same bits, and the
  plan cached with its batch count."""
  from te_jax import _te_cuda  # the CUDA module: imported here, where the gpu mark found a GPU

  b, m, k, n = shape
  lhs, rhs, accum_u = batched_case(kind, b, m, k, n, seed=86)
  ours, hlo = run_gemm(lhs, rhs, None, jnp.bfloat16, device=gpu, fast_accum=fast_accum, batched=True)
  assert_calls_cublas(hlo)
  again, _ = run_gemm(lhs, rhs, None, jnp.bfloat16, device=gpu, fast_accum=fast_accum, batched=True)
  assert ours.shape == (b, m, n) and ours.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), np.asarray(again).view(np.uint16))
  picks = range(b) if b <= 4 else (0, b // 2, b - 1)  # the float64 GEMMs on the host are the slow part
  for i in picks:
    li, ri = batch_index(lhs, i), batch_index(rhs, i)
    assert_gemm_close(ours[i], gpu_reference(li, ri, None, jnp.bfloat16, gpu), li, ri, None, accum_u=accum_u)
  assert any(p["batch"] == b and (p["m"], p["n"], p["k"]) == (m, n, k) for p in _te_cuda.gemm_plans())
