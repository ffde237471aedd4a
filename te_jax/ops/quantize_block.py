"""Block-scaled quantization: the pure-jnp definitions of the ``BLOCK_1X128``, ``BLOCK_128X128``, ``MXFP8_1X32`` and
``NVFP4_1X16`` casts, each giving a ``QuantizedTensor`` of its mode (``te_jax.ScalingMode`` names the modes and lays out
their scales).

A block is ``mode.block`` elements of the last dim (the row), or of the last two dims for ``BLOCK_128X128`` and NVFP4's
16 x 16 weight blocks, counted from the first element; a dim that is not a multiple of the block ends in a partial
block with a scale of its own. ``amax`` is a block's ``max|x|`` in float32, reduced over the bit patterns as
``te_jax.ops.quantize.amax_f32`` does (subnormals count, any NaN gives NaN). Every step is float32 arithmetic, as the
kernels compute it.

- ``BLOCK_1X128`` / ``BLOCK_128X128`` (DeepSeek-V3, arXiv 2412.19437 §3.3: 1 x 128 tiles for activations and
  gradients, 128 x 128 blocks for weights): ``scale = fp8_max / amax`` by ``te_jax._core.scaling.compute_scale`` with a
  previous scale of 1 (so an amax of 0, or one so small that the scale overflows, gives 1), optionally rounded down to
  a power of two (its float32 exponent alone: then ``scale_inv`` and dequantization are exact); ``data`` is
  ``x * scale`` clamped to +-fp8_max and rounded to nearest, ties to even (``saturating_cast``); ``scale_inv = 1 /
  scale`` in float32.
- ``MXFP8_1X32`` (OCP Microscaling Formats v1.0, §6.3's conversion of a vector to an MX block): the shared exponent
  is ``floor(log2(amax)) - emax_elem`` (emax_elem = 8 for E4M3, 15 for E5M2: the exponent of the element format's
  largest normal), clamped to E8M0's range [-127, 127] (§5.4.1), and ``scale_inv`` is ``2**shared`` in E8M0; the
  elements are ``x / 2**shared`` (a multiply by an exact power of two), clamping normal numbers beyond the element
  format's range to +-max with their sign (§6.3) and otherwise rounding to nearest, ties to even (the OFP8 formats'
  rounding, the one ``saturating_cast`` makes). §6.3 leaves an all-zero block undefined (``log2(0)``): the clamp gives
  it the smallest scale, ``2**-127``, and its elements are zeros. The floor keeps a block's largest elements in the
  element format's top binade, so those above ``fp8_max`` (E4M3: ``amax / 2**shared`` in (448, 512)) clamp to it:
  the spec's known loss, which the cuBLAS / Transformer Engine variant (the exponent rounded up) avoids; this is the
  spec's rule.
- ``NVFP4_1X16`` (NVIDIA's NVFP4 recipe, arXiv 2509.25149 "Pretraining Large Language Models with NVFP4" and its
  appendix on the quantization procedure): E2M1 elements, one E4M3 scale per 1 x 16 block (per 16 x 16 block for
  weights, ``block_2d``, so that a weight and its transpose hold the same values; the scales are stored in the 1 x 16
  layout all the same, each repeated over its block's 16 rows) and one float32 global scale per tensor:
  ``s_enc = 448 * 6 / amax_tensor`` (``compute_scale``, previous scale 1), ``global_scale_inv = s_dec = 1 / s_enc``;
  a block's ``scale_inv = e4m3(amax * (s_enc * (1 / 6)))`` (saturating; the paper's ``amax / 6 * s_enc``, with the
  division by 6 as a multiply by its float32 reciprocal, as Transformer Engine's kernels compute it: XLA rewrites a
  float32 division by a constant into that multiply, so a division could not be the definition); the elements are
  ``x * min(1 / (scale_inv * s_dec), float32 max)`` clamped to +-6 and rounded to nearest, ties to even, or, with a
  PRNG ``key``, stochastically (the paper's choice for gradients): a magnitude ``a`` between neighbours ``lo < hi``
  of E2M1 rounds up with probability ``(a - lo) / (hi - lo)``, the draw being ``u = (bits >> 8) * 2**-24`` of 32 random
  bits per element (``jax.random.bits``), up iff ``u < (a - lo) / (hi - lo)``: unbiased to 2**-24 of a step. Where a
  block's E4M3 scale is 0 (an all-zero block, or one so small next to the tensor's amax that its scale underflows
  E4M3) its elements are zeros, signed as x. The tensor's amax is over its finite elements, so that a NaN or inf
  reaches only its own block (below); ``global_amax`` may be given instead (an amax reduced over shards, say).

Dequantization is ``QuantizedTensor.dequantize``: ``data * scale_inv`` per block (times ``global_scale_inv`` for
NVFP4). Within half an ulp of the element format, times the block's ``scale_inv`` (and float32 rounding, ``scale_inv``
being ``1 / scale`` rounded), it gives back every element except those that clamp at the format's max by more: MXFP8's
(above), and NVFP4's in blocks whose E4M3 scale is subnormal (a block amax below about 2**-15 of the tensor's: the
scale rounds by up to half of itself) or 0 (dequantized to 0).

Non-finite inputs: a block that holds an inf or NaN has a NaN ``scale_inv`` (E8M0 0xFF, E4M3 0x7F, float32 NaN) and
its data is the format's NaN (E2M1, which has none: zeros), so the whole block dequantizes to NaN and a GEMM that reads
it gives NaN where one that read the inf or NaN in BF16 would; the other blocks are as if it were not there. A
quantize cannot raise on values under ``jax.jit``; this keeps the NaN visible instead of training on a finite value in
its place.

The transposed copy (``with_transposed``; x of rank >= 2, whose leading dims are batch dims) is the quantization of
``swapaxes(x, -1, -2)`` over its own rows: for 1 x B blocks its blocks run along x's second-to-last dim, so its bytes
are not the transposed ``data``; for square blocks (128 x 128, NVFP4's 16 x 16) it is exactly the transposed ``data``
with the transposed scale grid. A (batch, sequence, hidden) activation whose GEMM contracts over all its tokens is
reshaped to 2-D first. NVFP4's copy shares the tensor's global scale.

XLA:CPU flushes float32 subnormals to zero in arithmetic (operands and results, not the bit-pattern amax): on the
CPU, inputs below 2**-126 are quantized as zeros wherever they are multiplied by a scale, a ``scale_inv`` below
2**-126 (a block amax below about 2**-117 for ``BLOCK_*``; MXFP8's ``2**-127``) dequantizes to zeros, and so does a
dequantized value below 2**-126. Where XLA keeps subnormals (its GPU backend, the kernels) they keep their values.

>>> import jax.numpy as jnp, te_jax
>>> from te_jax.ops.quantize_block import quantize_block_ref
>>> x = jnp.array([[1.0, -3.0], [0.5, 0.25]], jnp.bfloat16)
>>> q = quantize_block_ref(x, te_jax.ScalingMode.BLOCK_1X128, power_of_two_scales=True)
>>> q.data.dtype.name, q.scale_inv.shape, q.scale_inv.tolist()
('float8_e4m3fn', (2, 1), [[0.0078125], [0.001953125]])
>>> q.dequantize(jnp.float32).tolist()
[[1.0, -3.0], [0.5, 0.25]]
>>> m = quantize_block_ref(x, te_jax.ScalingMode.MXFP8_1X32)
>>> m.scale_inv.dtype.name, m.scale_inv.astype(jnp.float32).tolist(), m.data.astype(jnp.float32).tolist()
('float8_e8m0fnu', [[0.0078125], [0.001953125]], [[128.0, -384.0], [256.0, 128.0]])
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

from te_jax._core.dtypes import FP8_DTYPES
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval, sequential_batcher
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode, scale_inv
from te_jax._core.scaling import compute_scale, fp8_max
from te_jax.ops.quantize import amax_f32, check_input, every_axis_divides, saturating_cast

__all__ = ["BLOCK_MODES", "E2M1", "QuantizeBlockConfig", "block_amax", "check_whole_blocks", "nvfp4_global_amax",
           "nvfp4_global_scale", "quantize_block", "quantize_block_ref", "quantize_nvfp4_ref"]

#: The block-scaled modes ``quantize_block_ref`` writes.
BLOCK_MODES = (ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128, ScalingMode.MXFP8_1X32, ScalingMode.NVFP4_1X16)
#: NVFP4's element format: E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; no inf, no NaN).
E2M1 = jnp.dtype(jnp.float4_e2m1fn)
_E2M1_MAX = 6.0
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_E4M3_MAX = 448.0
_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
_E8M0_BIAS = 127  # E8M0 encodes 2**(byte - 127) for bytes 0..254; 255 is NaN (OCP MX v1.0 §5.4.1)
_F32_MAX = float(np.finfo(np.float32).max)
_NVFP4_2D = (16, 16)


# ---- reference ---------------------------------------------------------------------------------------------------


def block_amax(x: jax.Array, block: tuple[int, int]) -> jax.Array:
  """``max|x|`` in float32 of each (rows, cols) block of x's last dims (rows 1: of the last dim alone), shaped as
  ``ScalingMode.scale_shape`` lays out scales; a partial block at the end counts its own elements. Reduced over bit
  patterns (``amax_f32``): subnormals count and a NaN gives NaN, an inf (without NaN) inf."""
  rows, cols = block
  xf = jnp.asarray(x).astype(jnp.float32)
  pad = [(0, 0)] * xf.ndim
  pad[-1] = (0, -xf.shape[-1] % cols)
  if rows > 1:
    pad[-2] = (0, -xf.shape[-2] % rows)
  p = jnp.pad(xf, pad)  # zeros: they change no amax
  if rows == 1:
    return amax_f32(p.reshape(*p.shape[:-1], p.shape[-1] // cols, cols), axis=-1)
  p = p.reshape(*p.shape[:-2], p.shape[-2] // rows, rows, p.shape[-1] // cols, cols)
  return amax_f32(p, axis=(-3, -1))


def _expand(s: jax.Array, block: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
  """Per-block values broadcast to the elements of data shaped ``shape``."""
  rows, cols = block
  s = jnp.repeat(s, cols, axis=-1)[..., :shape[-1]]
  if rows > 1:
    s = jnp.repeat(s, rows, axis=-2)[..., :shape[-2], :]
  return s


def _floor_pow2(scale: jax.Array) -> jax.Array:
  """The largest power of two <= a positive normal float32: its sign and exponent bits alone (exact, where
  ``exp2(floor(log2(.)))`` depends on log2's rounding)."""
  bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nan_where_not(finite: jax.Array, data: jax.Array) -> jax.Array:
  """``data`` where ``finite``, else the FP8 NaN 0x7F (E4M3 S.1111.111, E5M2 S.11111.11): built from its bits, since a
  float32 NaN converted to E5M2 gives 0x7E through ml_dtypes and 0x7F through XLA."""
  nan = jax.lax.bitcast_convert_type(jnp.uint8(0x7F), data.dtype)
  return jnp.where(finite, data, nan)


def _fp8_block(xf: jax.Array, block: tuple[int, int], dtype, power_of_two: bool):
  """(data, scale_inv) of ``BLOCK_1X128`` / ``BLOCK_128X128``."""
  amax = block_amax(xf, block)
  scale = compute_scale(amax, jnp.float32(1.0), fp8_max(dtype))  # always a positive normal float32
  if power_of_two:
    scale = _floor_pow2(scale)
  finite = jnp.isfinite(amax)
  data = _nan_where_not(_expand(finite, block, xf.shape), saturating_cast(xf, _expand(scale, block, xf.shape), dtype))
  return data, jnp.where(finite, scale_inv(scale), jnp.float32(jnp.nan))


def _emax_elem(dtype) -> int:
  """The exponent of the format's largest normal: 8 for E4M3 (448 = 1.75 * 2**8), 15 for E5M2."""
  return int(np.floor(np.log2(fp8_max(dtype))))


def _mxfp8(xf: jax.Array, dtype):
  """(data, scale_inv) of ``MXFP8_1X32``, OCP MX v1.0 §6.3."""
  block = ScalingMode.MXFP8_1X32.block
  amax = block_amax(xf, block)
  # floor(log2(amax)) is amax's unbiased exponent; a subnormal or zero amax (biased exponent 0) is below -126 and
  # clamps to -127 with any emax_elem, as log2(0) = -inf would.
  biased = (jax.lax.bitcast_convert_type(amax, jnp.uint32) >> 23).astype(jnp.int32)
  shared = jnp.maximum(biased - 127 - _emax_elem(dtype), -_E8M0_BIAS)  # in [-127, 119]: E8M0's range
  finite = jnp.isfinite(amax)
  code = jnp.where(finite, shared + _E8M0_BIAS, 255).astype(jnp.uint8)
  # 2**-shared, built from its exponent bits (biased 8..254: a normal float32), so the multiply is exact.
  inv_shared = jax.lax.bitcast_convert_type(((127 - shared) << 23).astype(jnp.uint32), jnp.float32)
  data = saturating_cast(xf, _expand(inv_shared, block, xf.shape), dtype)
  data = _nan_where_not(_expand(finite, block, xf.shape), data)
  return data, jax.lax.bitcast_convert_type(code, _E8M0)


def _round_e2m1(v: jax.Array, bits: jax.Array | None) -> jax.Array:
  """float32 ``v`` to E2M1, saturating at +-6: to nearest, ties to even, or, given 32 random bits per element,
  stochastically (up iff ``(bits >> 8) * 2**-24 < (|v| - lo) / (hi - lo)``). Signs, zeros included, are kept."""
  if bits is None:
    return jnp.clip(v, -_E2M1_MAX, _E2M1_MAX).astype(E2M1)
  a = jnp.minimum(jnp.abs(v), jnp.float32(_E2M1_MAX))
  step = jnp.where(a >= 4.0, jnp.float32(2.0), jnp.where(a >= 2.0, jnp.float32(1.0), jnp.float32(0.5)))
  lo = jnp.floor(a / step) * step  # exact: step is a power of two
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # uniform in [0, 1), 24 bits: exact in float32
  up = u < (a - lo) / step  # a - lo is exact (lo <= a < lo + step); at a = 6 the fraction is 0
  return jnp.copysign(jnp.where(up, lo + step, lo), v).astype(E2M1)


def _nvfp4(xf: jax.Array, s_enc: jax.Array, s_dec: jax.Array, block_2d: bool, bits: jax.Array | None):
  """(data, scale_inv) of ``NVFP4_1X16`` for the global scale ``s_enc`` (``s_dec = 1 / s_enc``)."""
  block = _NVFP4_2D if block_2d else ScalingMode.NVFP4_1X16.block
  amax = block_amax(xf, block)
  # saturating_cast multiplies amax by s_enc / 6 and clamps at 448 (also where the product overflows); NaN where
  # amax is not finite.
  scale = saturating_cast(amax, s_enc * jnp.float32(1.0 / _E2M1_MAX), _E4M3)
  finite = jnp.isfinite(amax)
  s = scale.astype(jnp.float32)
  enc = jnp.where(s == 0.0, jnp.float32(0.0), jnp.minimum(scale_inv(s * s_dec), jnp.float32(_F32_MAX)))
  q = _round_e2m1(xf * _expand(enc, block, xf.shape), bits)
  data = jnp.where(_expand(finite, block, xf.shape), q, jnp.zeros((), E2M1))
  if block_2d:  # the 1 x 16 layout: each 16 x 16 block's scale on each of its rows
    scale = jnp.repeat(scale, block[0], axis=-2)[..., :xf.shape[-2], :]
  return data, scale


def _swap(a: jax.Array) -> jax.Array:
  return jnp.swapaxes(a, -1, -2)


# ---- public API --------------------------------------------------------------------------------------------------


def _check_rank(x: jax.Array, rank: int, why: str) -> None:
  if x.ndim < rank:
    raise ValueError(f"x must have rank >= {rank} for {why}, got shape {tuple(x.shape)}")


def _check_transposed(x: jax.Array, with_transposed: bool) -> None:
  if with_transposed and x.ndim < 2:
    raise ValueError(f"with_transposed=True needs x of rank >= 2 (it swaps the last two dims), got shape "
                     f"{tuple(x.shape)}")


def _check_mode(mode) -> None:
  if not isinstance(mode, ScalingMode) or mode not in BLOCK_MODES:
    raise ValueError(f"mode must be one of {', '.join(m.name for m in BLOCK_MODES)}, got {mode!r}")


def _checked_dtype(x: jax.Array, mode: ScalingMode, dtype, power_of_two_scales: bool, with_transposed: bool):
  """The element format of an FP8 mode's quantize, its other arguments checked."""
  if power_of_two_scales and mode not in (ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128):
    raise ValueError(f"power_of_two_scales applies to BLOCK_1X128 and BLOCK_128X128, not {mode.name} (MXFP8's E8M0 "
                     "scales are powers of two already; NVFP4's are E4M3)")
  dt = _E4M3 if dtype is None else _dtype_or_none(dtype)
  if dt not in FP8_DTYPES:
    raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2 for {mode.name}, got {dtype!r}")
  if mode is ScalingMode.BLOCK_128X128:
    _check_rank(x, 2, "BLOCK_128X128 (128 x 128 blocks over its last two dims)")
  _check_transposed(x, with_transposed)
  return dt


def _check_nvfp4_args(x: jax.Array, block_2d: bool, with_transposed: bool, global_amax, key):
  """NVFP4's options checked; ``global_amax`` as a float32 scalar (a Python number accepted)."""
  if block_2d:
    _check_rank(x, 2, "block_2d=True (16 x 16 blocks over its last two dims)")
  _check_transposed(x, with_transposed)
  if global_amax is not None:
    if isinstance(global_amax, (int, float)):
      global_amax = jnp.float32(global_amax)
    if not hasattr(global_amax, "dtype") or jnp.dtype(global_amax.dtype) != jnp.float32 or jnp.shape(global_amax):
      raise TypeError(f"global_amax must be a float32 scalar, got "
                      f"{getattr(global_amax, 'dtype', type(global_amax).__name__)} of shape {jnp.shape(global_amax)}")
  if key is not None and not (hasattr(key, "dtype") and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                                                         or key.dtype == jnp.uint32)):
    raise TypeError(f"key must be a jax.random key, got {getattr(key, 'dtype', type(key).__name__)}")
  return global_amax, key


def quantize_block_ref(x: jax.Array, mode: ScalingMode, dtype=None, *, power_of_two_scales: bool = False,
                       with_transposed: bool = False) -> QuantizedTensor:
  """``x`` quantized with block scales of ``mode``, by the rules of this module's docstring.

  Args:
    x: float32, bfloat16 or float16, rank >= 1 (>= 2 for ``BLOCK_128X128``).
    mode: one of ``BLOCK_MODES``.
    dtype: the element format: float8_e4m3fn (the default) or float8_e5m2 for the FP8 modes; float4_e2m1fn (the
      default) for ``NVFP4_1X16``.
    power_of_two_scales: round ``BLOCK_1X128`` / ``BLOCK_128X128`` scales down to powers of two (MXFP8's are powers
      of two already, NVFP4's are E4M3: for them it must be False).
    with_transposed: also quantize ``swapaxes(x, -1, -2)`` over its own rows (``data_t``, ``scale_inv_t``).

  Returns:
    A ``QuantizedTensor`` of ``mode``: ``scale_inv`` shaped ``mode.scale_shape(x.shape)`` in ``mode.scale_dtype``.
    ``NVFP4_1X16`` is ``quantize_nvfp4_ref(x, with_transposed=...)``: 1 x 16 blocks, round to nearest; its other
    options (16 x 16 weight blocks, a given global amax, stochastic rounding) are that function's.
  """
  x = check_input(x)
  _check_mode(mode)
  if mode is ScalingMode.NVFP4_1X16:
    if power_of_two_scales:
      raise ValueError("power_of_two_scales applies to BLOCK_1X128 and BLOCK_128X128, not NVFP4_1X16 (its scales "
                       "are E4M3)")
    if dtype is not None and _dtype_or_none(dtype) != E2M1:
      raise ValueError(f"dtype must be float4_e2m1fn for NVFP4_1X16, got {dtype!r}")
    return quantize_nvfp4_ref(x, with_transposed=with_transposed)
  dt = _checked_dtype(x, mode, dtype, power_of_two_scales, with_transposed)
  return QuantizedTensor(*_fp8_outputs(x.astype(jnp.float32), mode, dt, power_of_two_scales, with_transposed),
                         mode=mode)


def quantize_nvfp4_ref(x: jax.Array, *, block_2d: bool = False, with_transposed: bool = False,
                       global_amax: jax.Array | None = None, key: jax.Array | None = None) -> QuantizedTensor:
  """``x`` quantized to NVFP4 (``ScalingMode.NVFP4_1X16``), by the rules of this module's docstring.

  >>> import jax, jax.numpy as jnp
  >>> from te_jax.ops.quantize_block import quantize_nvfp4_ref
  >>> x = jnp.array([[6.0, 1.0, -0.75, 0.25] * 4], jnp.float32)
  >>> q = quantize_nvfp4_ref(x)
  >>> values = lambda q: q.data.astype(jnp.float32)[0]
  >>> q.global_scale_inv.tolist(), q.scale_inv.astype(jnp.float32).tolist(), values(q)[:4].tolist()
  (0.0022321429569274187, [[448.0]], [6.0, 1.0, -1.0, 0.0])
  >>> s = quantize_nvfp4_ref(x, key=jax.random.key(0))  # stochastic: -0.75 goes to -0.5 or -1, 0.25 to 0 or 0.5
  >>> sorted(set(values(s)[2::4].tolist())), sorted(set(values(s)[3::4].tolist()))
  ([-1.0, -0.5], [0.0, 0.5])

  Args:
    x: float32, bfloat16 or float16, rank >= 1 (>= 2 with ``block_2d`` or ``with_transposed``).
    block_2d: one scale per 16 x 16 block of the last two dims (weights), stored in the 1 x 16 layout (each block's
      scale repeated on its 16 rows), so that the transposed copy holds the same values.
    with_transposed: also quantize ``swapaxes(x, -1, -2)`` over its own rows, with the same global scale (with
      ``block_2d``: the transposed data, with its own 1 x 16 scale layout).
    global_amax: the float32 scalar amax the global scale is computed from; default: ``max|x|`` over x's finite
      elements.
    key: a ``jax.random`` key: the elements round stochastically, from ``jax.random.bits(key, x.shape)`` (the
      transposed copy of 1 x 16 blocks from ``jax.random.fold_in(key, 1)``); None: to nearest, ties to even.

  Returns:
    A ``QuantizedTensor``: E2M1 ``data``, E4M3 ``scale_inv`` shaped ``NVFP4_1X16.scale_shape(x.shape)``, float32
    ``global_scale_inv`` (``1 / s_enc``), and the transposed copy when asked for.
  """
  x = check_input(x)
  global_amax, key = _check_nvfp4_args(x, block_2d, with_transposed, global_amax, key)
  xf = x.astype(jnp.float32)
  s_enc, s_dec = nvfp4_global_scale(nvfp4_global_amax(xf, global_amax))
  bits, bits_t = _nvfp4_bits(key, xf.shape, with_transposed and not block_2d)
  data, inv, data_t, inv_t = _nvfp4_outputs(xf, s_enc, s_dec, bits, bits_t, block_2d, with_transposed)
  return QuantizedTensor(data, inv, data_t, inv_t, global_scale_inv=s_dec, mode=ScalingMode.NVFP4_1X16)


def nvfp4_global_amax(xf: jax.Array, global_amax: jax.Array | None) -> jax.Array:
  """The amax of NVFP4's global scale: ``global_amax``, or else ``max|x|`` over x's finite elements (an XLA
  reduction ahead of the cast: exact on every backend)."""
  return amax_f32(jnp.where(jnp.isfinite(xf), xf, 0.0)) if global_amax is None else global_amax


def nvfp4_global_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """NVFP4's ``(s_enc, s_dec)`` from the global amax: ``448 * 6 / amax`` (``compute_scale``, previous scale 1) and its
  reciprocal. The kernel computes them itself from ``amax`` (IEEE division, as XLA:CPU's; XLA:GPU's float32 division
  of the same jnp can differ in the last bits)."""
  s_enc = compute_scale(amax, jnp.float32(1.0), _E4M3_MAX * _E2M1_MAX)
  return s_enc, scale_inv(s_enc)


def _nvfp4_bits(key, shape, transposed_bits: bool):
  """The stochastic rounding's 32 random bits per element of x (and of the transposed copy of 1 x 16 blocks, from
  ``fold_in(key, 1)``), or Nones without a key."""
  if key is None:
    return None, None
  bits = jax.random.bits(key, shape, jnp.uint32)
  if not transposed_bits:
    return bits, None
  t_shape = (*shape[:-2], shape[-1], shape[-2])
  return bits, jax.random.bits(jax.random.fold_in(key, 1), t_shape, jnp.uint32)


def _fp8_outputs(xf, mode, dt, power_of_two: bool, with_transposed: bool):
  """(data, scale_inv, data_t, scale_inv_t) of an FP8 mode (the transposed pair None without the copy)."""
  if mode is ScalingMode.MXFP8_1X32:
    one = functools.partial(_mxfp8, dtype=dt)
  else:
    one = functools.partial(_fp8_block, block=mode.block, dtype=dt, power_of_two=power_of_two)
  data, inv = one(xf)
  data_t = inv_t = None
  if with_transposed and mode is ScalingMode.BLOCK_128X128:  # square blocks: the same values, transposed
    data_t, inv_t = _swap(data), _swap(inv)
  elif with_transposed:
    data_t, inv_t = one(_swap(xf))
  return data, inv, data_t, inv_t


def _nvfp4_outputs(xf, s_enc, s_dec, bits, bits_t, block_2d: bool, with_transposed: bool):
  """(data, scale_inv, data_t, scale_inv_t) of NVFP4 for the global scale ``s_enc`` (``s_dec = 1 / s_enc``)."""
  data, inv = _nvfp4(xf, s_enc, s_dec, block_2d, bits)
  data_t = inv_t = None
  if with_transposed and block_2d:
    grid = _swap(inv[..., ::_NVFP4_2D[0], :])  # the 16 x 16 grid, transposed, in the copy's 1 x 16 layout
    data_t, inv_t = _swap(data), jnp.repeat(grid, _NVFP4_2D[0], axis=-2)[..., :xf.shape[-1], :]
  elif with_transposed:
    data_t, inv_t = _nvfp4(_swap(xf), s_enc, s_dec, False, bits_t)
  return data, inv, data_t, inv_t


def _dtype_or_none(dtype):
  try:
    return jnp.dtype(dtype)
  except TypeError:
    return None


# ---- primitive -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantizeBlockConfig:
  """Static parameters of one block-scaled quantize.

  Attributes:
    mode: one of ``BLOCK_MODES``.
    out_dtype: the element format (float8_e4m3fn / float8_e5m2; float4_e2m1fn for NVFP4).
    power_of_two_scales: BLOCK_* scales rounded down to powers of two.
    with_transposed: also the transposed copy (``data_t``, ``scale_inv_t``).
    block_2d: NVFP4's 16 x 16 blocks.
    stochastic: NVFP4's stochastic rounding: the operands after ``(x, amax)`` are the random bits of x (and of the
      transposed copy of 1 x 16 blocks).
  """

  mode: ScalingMode
  out_dtype: np.dtype
  power_of_two_scales: bool = False
  with_transposed: bool = False
  block_2d: bool = False
  stochastic: bool = False

  @property
  def nvfp4(self) -> bool:
    return self.mode is ScalingMode.NVFP4_1X16

  @property
  def transposed_bits(self) -> bool:
    """Whether the transposed copy rounds with random bits of its own (1 x 16 blocks; 16 x 16 ones transpose)."""
    return self.stochastic and self.with_transposed and not self.block_2d

  def blocks(self, ndim: int) -> dict[int, int]:
    """The block each blocked dim of x (as an index) is cut into, over the data and, with the copy, its scales."""
    if self.mode is ScalingMode.BLOCK_128X128 or self.block_2d:
      rows, cols = self.mode.block if not self.block_2d else _NVFP4_2D
      return {ndim - 2: rows, ndim - 1: cols}
    cols = self.mode.block[1]
    return {ndim - 1: cols, **({ndim - 2: cols} if self.with_transposed else {})}


def _block_ref(x, *extra, config: QuantizeBlockConfig):
  """The primitive's definition: ``quantize_block_ref`` / ``quantize_nvfp4_ref`` after their argument checks, with
  NVFP4's global amax and random bits as operands, and its global scale's reciprocal (``s_dec``) the last result."""
  xf = x.astype(jnp.float32)
  if not config.nvfp4:
    outs = _fp8_outputs(xf, config.mode, config.out_dtype, config.power_of_two_scales, config.with_transposed)
  else:
    amax, *bits = extra
    bits = bits + [None] * (2 - len(bits))
    s_enc, s_dec = nvfp4_global_scale(amax)
    outs = (*_nvfp4_outputs(xf, s_enc, s_dec, bits[0], bits[1], config.block_2d, config.with_transposed), s_dec)
  return [o for o in outs if o is not None]


def _abstract_eval(x, *extra, config: QuantizeBlockConfig):
  del extra
  mode = config.mode
  outs = [output_aval(x, x.shape, config.out_dtype), output_aval(x, mode.scale_shape(x.shape), mode.scale_dtype)]
  if config.with_transposed:
    t = (*x.shape[:-2], x.shape[-1], x.shape[-2])
    outs += [output_aval(x, t, config.out_dtype), output_aval(x, mode.scale_shape(t), mode.scale_dtype)]
  if config.nvfp4:
    outs.append(output_aval(x, (), jnp.float32))
  return outs


# The CUDA handler's operands after x: amax (NVFP4's float32 scalar), bits, bits_t (uint32); those a call lacks are
# empty. Its results: data, scale_inv, data_t, scale_inv_t, s_dec (NVFP4's float32 scalar), those a call lacks empty.
_EMPTY_OPERANDS = (np.zeros((0,), np.float32), np.zeros((0,), np.uint32), np.zeros((0,), np.uint32))


def _native_signature(platform: str, config: QuantizeBlockConfig, avals_in, avals_out) -> NativeSignature:
  del platform
  empty = lambda dtype: jax.core.ShapedArray((0,), dtype)  # noqa: E731
  results = list(avals_out[:2])
  if config.with_transposed:
    results += list(avals_out[2:4])
  else:
    results += [empty(config.out_dtype), empty(config.mode.scale_dtype)]
  results.append(avals_out[-1] if config.nvfp4 else empty(jnp.float32))
  keep = [0, 1] + [2, 3] * config.with_transposed + [4] * config.nvfp4
  return NativeSignature(extra_operands=_EMPTY_OPERANDS[len(avals_in) - 1:], result_avals=results, keep=keep)


def _attributes(config: QuantizeBlockConfig) -> dict:
  return {"mode": np.int64(config.mode.value), "power_of_two": np.bool_(config.power_of_two_scales),
          "block_2d": np.bool_(config.block_2d)}


def _swap_spec(spec: tuple) -> tuple:
  return (*spec[:-2], spec[-1], spec[-2]) if len(spec) >= 2 else spec


def check_whole_blocks(config: QuantizeBlockConfig, mesh, shape, spec) -> None:
  """Raises a ValueError where x sharded as ``spec`` would cut a block of one of its blocked dims across shards."""
  for d, block in sorted(config.blocks(len(shape)).items()):
    axes = mesh_axes(spec[d])
    if not axes:
      continue
    shards = math.prod(mesh.shape[a] for a in axes)
    if shape[d] % shards or (shape[d] // shards) % block:
      raise ValueError(
          f"quantize_block: x's dim {d} (size {shape[d]}) is sharded over mesh axis {' x '.join(axes)} into "
          f"{shards} shards, which would cut its {config.mode.name} blocks of {block}: each shard must hold whole "
          f"blocks (a dim size a multiple of {shards} * {block}), or leave that dim unsharded")


def _partition(config: QuantizeBlockConfig, mesh, arg_shapes, result_shape):
  """x stays sharded as given (every shard quantizes its own whole blocks, no collective); the outputs shard as
  their dims of x, the copy's with the last two swapped."""
  del result_shape
  x = arg_shapes[0]
  spec = full_spec(x.sharding, len(x.shape))
  check_whole_blocks(config, mesh, x.shape, spec)
  same, swapped = NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P(*_swap_spec(spec)))
  outs = [same, same] + ([swapped, swapped] if config.with_transposed else [])
  outs += [NamedSharding(mesh, P())] * config.nvfp4
  args = [same] + [NamedSharding(mesh, P())] * config.nvfp4
  args += [same] * config.stochastic + [swapped] * config.transposed_bits

  def lower_fn(*operands):
    return tuple(_OP.inner.bind(*operands, config=config))

  return mesh, lower_fn, tuple(outs), tuple(args)


def _sharding_rule(config: QuantizeBlockConfig, mesh, value_types, result_types):
  """Leading dims shared by every operand and result; a blocked dim is ``(n b)`` with its scales' dim ``n`` where it
  holds whole blocks and every mesh axis divides n (so the propagation shards whole blocks only), b never sharded;
  otherwise the scales' dim is a factor of its own (and ``partition`` rejects a sharding that cuts a block)."""
  del result_types
  shape = value_types[0].shape
  nd = len(shape)
  blocks = config.blocks(nd)
  x, scale = [f"d{i}" for i in range(nd)], [f"d{i}" for i in range(nd)]
  scale_t = list(scale)
  sizes: dict = {}
  replicated = []
  for d, b in sorted(blocks.items()):  # Shardy wants the replicated factors in order
    if shape[d] % b == 0 and every_axis_divides(mesh, shape[d] // b):
      n, inner = f"n{d}", f"b{d}"
      x[d] = f"({n} {inner})"
      sizes.update({n: shape[d] // b, inner: b})
      replicated.append(inner)
      blocked = n
    else:
      blocked = f"s{d}"
    # The data's scales block dims of the data's block; the copy's, dims of its own (1 x B: x's rows).
    if d == nd - 1 or config.mode is ScalingMode.BLOCK_128X128:
      scale[d] = blocked if d == nd - 1 or not config.block_2d else x[d]
    if config.mode is ScalingMode.BLOCK_128X128 or d == nd - 2:
      scale_t[d] = blocked
    elif config.block_2d or not config.with_transposed:
      scale_t[d] = x[d]
  if config.block_2d:  # 16 x 16 blocks, stored in the 1 x 16 layout: full rows in both
    scale[nd - 2] = x[nd - 2]
    scale_t[nd - 1] = x[nd - 1]
  elif config.mode is not ScalingMode.BLOCK_128X128:
    scale[nd - 2:nd - 1] = x[nd - 2:nd - 1]
    scale_t[nd - 1] = x[nd - 1]
  x_s, t_s = " ".join(x), " ".join(_swap_spec(tuple(x)))
  operands = [x_s] + [""] * config.nvfp4 + [x_s] * config.stochastic + [t_s] * config.transposed_bits
  results = [x_s, " ".join(scale)]
  if config.with_transposed:
    results += [t_s, " ".join(_swap_spec(tuple(scale_t)))]
  results += [""] * config.nvfp4
  # Shardy takes the sizes of the factors that appear only inside compound dims.
  whole = {dim for mapping in operands + results for dim in mapping.split(" ") if not dim.startswith("(")}
  sizes = {f: n for f, n in sizes.items() if f not in whole}
  if replicated:
    sizes["need_replication_factors"] = tuple(replicated)
  return f"{', '.join(operands)} -> {', '.join(results)}", sizes


def _visible_sharding(x) -> NamedSharding | None:
  """x's NamedSharding where it is known before compilation: a committed array, or a value whose type carries it
  (explicit mesh axes)."""
  sharding = getattr(x, "sharding", None) if not isinstance(x, jax.core.Tracer) else jax.typeof(x).sharding
  return sharding if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1 else None


def _batcher(args, dims, *, config: QuantizeBlockConfig):
  """vmap: a leading dim is a batch dim of every mode, so x's batch dim moves to the front and one call quantizes
  the stack; NVFP4 with a global amax per element (each element's own) runs once per element."""
  if config.nvfp4 and dims[1] is not None:
    return sequential_batcher(_OP)(args, dims, config=config)
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = []
  for i, (a, d) in enumerate(zip(args, dims)):
    if config.nvfp4 and i == 1:
      moved.append(a)
    elif d is None:
      moved.append(jnp.broadcast_to(a, (size, *a.shape)))
    else:
      moved.append(jnp.moveaxis(a, d, 0))
  outs = _OP.bind(*moved, config=config)
  return list(outs), [0] * (len(outs) - config.nvfp4) + [None] * config.nvfp4


_OP = define_op(
    "quantize_block",
    abstract_eval=_abstract_eval,
    reference=_block_ref,
    native_platforms=("cuda",),
    ffi_attributes=_attributes,
    native_signature=_native_signature,
    partition=_partition,
    sharding_rule=_sharding_rule,
    batcher=_batcher,
)


# ---- public API ----------------------------------------------------------------------------------------------------


def quantize_block(x: jax.Array, mode: ScalingMode, dtype=None, *, power_of_two_scales: bool = False,
                   with_transposed: bool = False, block_2d: bool = False, global_amax: jax.Array | None = None,
                   key: jax.Array | None = None) -> QuantizedTensor:
  """``x`` quantized with block scales of ``mode``: bit for bit ``quantize_block_ref`` (``quantize_nvfp4_ref`` for
  NVFP4), as one kernel (the ``te_quantize_block_cuda`` handler) on a GPU.

  >>> import jax.numpy as jnp, te_jax
  >>> from te_jax.ops.quantize_block import quantize_block
  >>> q = quantize_block(jnp.array([[1.0, -3.0], [0.5, 0.25]], jnp.bfloat16), te_jax.ScalingMode.MXFP8_1X32,
  ...                    with_transposed=True)
  >>> q.scale_inv.astype(jnp.float32).tolist(), q.data_t.astype(jnp.float32).tolist()
  ([[0.0078125], [0.001953125]], [[256.0, 128.0], [-384.0, 32.0]])

  Args:
    x: float32, bfloat16 or float16, rank >= 1 (>= 2 for ``BLOCK_128X128``, ``block_2d`` and ``with_transposed``);
      its leading dims are batch dims.
    mode: one of ``BLOCK_MODES``.
    dtype: the element format (default E4M3; E2M1, the only one, for NVFP4).
    power_of_two_scales: BLOCK_* only: scales rounded down to powers of two.
    with_transposed: also quantize ``swapaxes(x, -1, -2)`` over its own rows (``data_t``, ``scale_inv_t``).
    block_2d: NVFP4 only: 16 x 16 blocks.
    global_amax: NVFP4 only: the float32 scalar amax of the global scale (default: ``max|x|`` over x's finite
      elements, an XLA reduction before the cast; under sharding it all-reduces).
    key: NVFP4 only: a ``jax.random`` key for stochastic rounding, from ``jax.random.bits(key, x.shape)`` (and
      ``fold_in(key, 1)`` for the transposed copy of 1 x 16 blocks) drawn here and read by the kernel.

  Returns:
    A ``QuantizedTensor`` of ``mode``, as the reference's.
  """
  x = check_input(x)
  _check_mode(mode)
  if mode is not ScalingMode.NVFP4_1X16:
    for name, value in (("block_2d", block_2d), ("global_amax", global_amax), ("key", key)):
      if value is not None and value is not False:
        raise ValueError(f"{name} applies to NVFP4_1X16 only, not {mode.name}")
    dt = _checked_dtype(x, mode, dtype, power_of_two_scales, with_transposed)
  else:
    if dtype is not None and _dtype_or_none(dtype) != E2M1:
      raise ValueError(f"dtype must be float4_e2m1fn for NVFP4_1X16, got {dtype!r}")
    if power_of_two_scales:
      raise ValueError("power_of_two_scales applies to BLOCK_1X128 and BLOCK_128X128, not NVFP4_1X16 (its scales "
                       "are E4M3)")
    global_amax, key = _check_nvfp4_args(x, block_2d, with_transposed, global_amax, key)
    dt = E2M1
  config = QuantizeBlockConfig(mode, dt, bool(power_of_two_scales), bool(with_transposed), bool(block_2d),
                               key is not None)
  visible = _visible_sharding(x)
  if visible is not None:  # where x's sharding is known here; under jax.jit, partition checks it
    check_whole_blocks(config, visible.mesh, x.shape, full_spec(visible, x.ndim))
  operands = [x]
  if config.nvfp4:
    bits = _nvfp4_bits(key, x.shape, config.transposed_bits)
    operands += [nvfp4_global_amax(x.astype(jnp.float32), global_amax), *(b for b in bits if b is not None)]
  outs = list(_OP.bind(*operands, config=config))
  s_dec = outs.pop() if config.nvfp4 else None
  outs += [None, None]
  return QuantizedTensor(outs[0], outs[1], outs[2], outs[3], global_scale_inv=s_dec, mode=mode)
