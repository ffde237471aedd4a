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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_jax._core.dtypes import FP8_DTYPES
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode, scale_inv
from te_jax._core.scaling import compute_scale, fp8_max
from te_jax.ops.quantize import amax_f32, check_input, saturating_cast

__all__ = ["BLOCK_MODES", "E2M1", "block_amax", "quantize_block_ref", "quantize_nvfp4_ref"]

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
  return jnp.where(finite, data, jnp.asarray(jnp.nan, data.dtype))


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
  if not isinstance(mode, ScalingMode) or mode not in BLOCK_MODES:
    raise ValueError(f"mode must be one of {', '.join(m.name for m in BLOCK_MODES)}, got {mode!r}")
  if power_of_two_scales and mode not in (ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128):
    raise ValueError(f"power_of_two_scales applies to BLOCK_1X128 and BLOCK_128X128, not {mode.name} (MXFP8's E8M0 "
                     "scales are powers of two already; NVFP4's are E4M3)")
  if mode is ScalingMode.NVFP4_1X16:
    if dtype is not None and _dtype_or_none(dtype) != E2M1:
      raise ValueError(f"dtype must be float4_e2m1fn for NVFP4_1X16, got {dtype!r}")
    return quantize_nvfp4_ref(x, with_transposed=with_transposed)
  dt = _E4M3 if dtype is None else _dtype_or_none(dtype)
  if dt not in FP8_DTYPES:
    raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2 for {mode.name}, got {dtype!r}")
  if mode is ScalingMode.BLOCK_128X128:
    _check_rank(x, 2, "BLOCK_128X128 (128 x 128 blocks over its last two dims)")
  _check_transposed(x, with_transposed)
  xf = x.astype(jnp.float32)
  if mode is ScalingMode.MXFP8_1X32:
    one = functools.partial(_mxfp8, dtype=dt)
  else:
    one = functools.partial(_fp8_block, block=mode.block, dtype=dt, power_of_two=power_of_two_scales)
  data, inv = one(xf)
  data_t = inv_t = None
  if with_transposed and mode is ScalingMode.BLOCK_128X128:  # square blocks: the same values, transposed
    data_t, inv_t = _swap(data), _swap(inv)
  elif with_transposed:
    data_t, inv_t = one(_swap(xf))
  return QuantizedTensor(data, inv, data_t, inv_t, mode=mode)


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
  xf = x.astype(jnp.float32)
  amax = amax_f32(jnp.where(jnp.isfinite(xf), xf, 0.0)) if global_amax is None else global_amax
  s_enc = compute_scale(amax, jnp.float32(1.0), _E4M3_MAX * _E2M1_MAX)
  s_dec = scale_inv(s_enc)
  bits = None if key is None else jax.random.bits(key, xf.shape, jnp.uint32)
  data, inv = _nvfp4(xf, s_enc, s_dec, block_2d, bits)
  data_t = inv_t = None
  if with_transposed and block_2d:
    grid = _swap(inv[..., ::_NVFP4_2D[0], :])  # the 16 x 16 grid, transposed, in the copy's 1 x 16 layout
    data_t, inv_t = _swap(data), jnp.repeat(grid, _NVFP4_2D[0], axis=-2)[..., :xf.shape[-1], :]
  elif with_transposed:
    bits_t = None if key is None else jax.random.bits(jax.random.fold_in(key, 1), _swap(xf).shape, jnp.uint32)
    data_t, inv_t = _nvfp4(_swap(xf), s_enc, s_dec, False, bits_t)
  return QuantizedTensor(data, inv, data_t, inv_t, global_scale_inv=s_dec, mode=ScalingMode.NVFP4_1X16)


def _dtype_or_none(dtype):
  try:
    return jnp.dtype(dtype)
  except TypeError:
    return None
