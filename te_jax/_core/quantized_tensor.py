"""The quantized tensor value: low-precision data, its scales and how they lay out, and an optional transposed copy.

Every te_jax op that writes or reads FP8 (quantize, the FP8 outputs of norm and activation, the GEMM) takes and
returns a ``QuantizedTensor``. How the scales cover the data is the tensor's ``ScalingMode``:

==================  ===========================  ===============  ===================================================
mode                one scale per                scale dtype      used by
==================  ===========================  ===============  ===================================================
``PER_TENSOR``      the whole tensor             float32          delayed and current scaling
``BLOCK_1X128``     1 x 128 elements of a row    float32          block scaling's activations and gradients
``BLOCK_128X128``   128 x 128 elements           float32          block scaling's weights
``MXFP8_1X32``      1 x 32 elements of a row     E8M0 (2**k)      MXFP8 (OCP Microscaling Formats v1.0)
``NVFP4_1X16``      1 x 16 elements of a row     E4M3, with one   NVFP4 (E2M1 data)
                                                 float32 global
==================  ===========================  ===============  ===================================================

A block covers the last dim (the row, a GEMM's contracting dim) and, for ``BLOCK_128X128``, the one before it too;
the scales are an array of the data's shape with those dims divided by the block, rounded up (a partial block at the
end has a scale of its own). The transposed copy (``data_t``, the K-major operand of the GEMM that contracts over the
other dim) has its own scales, over its own rows: for per-tensor scaling they are the same scalar.

Conventions: ``scale`` multiplies a high-precision tensor before its cast, ``scale_inv = 1 / scale`` dequantizes the
cast (and goes to the GEMM). ``ffi/include/te_jax/scaling_mode.h`` names the same modes for the kernels, with the same
numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import numpy as np

from te_jax._core.dtypes import HP_DTYPES

__all__ = ["QuantizedTensor", "ScalingMode", "scale_inv"]


class ScalingMode(enum.Enum):
  """How a quantized tensor's scales cover its data; the value is the kernels' number for it."""

  PER_TENSOR = 0
  BLOCK_1X128 = 1
  BLOCK_128X128 = 2
  MXFP8_1X32 = 3
  NVFP4_1X16 = 4

  @property
  def block(self) -> tuple[int, int] | None:
    """(rows, cols) of the block one scale covers over the data's last two dims (rows 1: within a row); None for
    per-tensor scaling."""
    return _BLOCKS[self]

  @property
  def scale_dtype(self) -> np.dtype:
    return jnp.dtype(_SCALE_DTYPES[self])

  def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scales of data shaped ``shape``: () per tensor, else the data's with the blocked dims divided
    by the block, rounded up."""
    if self.block is None:
      return ()
    rows, cols = self.block
    if len(shape) < (2 if rows > 1 else 1):
      raise ValueError(f"{self.name} scaling needs data of rank >= {2 if rows > 1 else 1}, got shape {tuple(shape)}")
    out = list(shape)
    out[-1] = math.ceil(shape[-1] / cols)
    if rows > 1:
      out[-2] = math.ceil(shape[-2] / rows)
    return tuple(out)


_BLOCKS = {ScalingMode.PER_TENSOR: None, ScalingMode.BLOCK_1X128: (1, 128), ScalingMode.BLOCK_128X128: (128, 128),
           ScalingMode.MXFP8_1X32: (1, 32), ScalingMode.NVFP4_1X16: (1, 16)}
_SCALE_DTYPES = {ScalingMode.PER_TENSOR: jnp.float32, ScalingMode.BLOCK_1X128: jnp.float32,
                 ScalingMode.BLOCK_128X128: jnp.float32, ScalingMode.MXFP8_1X32: jnp.float8_e8m0fnu,
                 ScalingMode.NVFP4_1X16: jnp.float8_e4m3fn}


def scale_inv(scale: jax.Array) -> jax.Array:
  """``1 / scale``: what dequantizes a tensor cast with ``scale``. The one place it is computed."""
  return 1.0 / scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """A quantized tensor: ``data * scale_inv`` (each scale over its block) approximates the original.

  >>> import jax.numpy as jnp, te_jax
  >>> q = te_jax.ops.quantize.quantize(jnp.array([[1.0, -600.0]], jnp.bfloat16), jnp.float32(0.5)).out
  >>> q.mode.name, q.data.dtype.name, q.dequantize(jnp.float32).tolist()
  ('PER_TENSOR', 'float8_e4m3fn', [[1.0, -576.0]])

  Attributes:
    data: the low-precision values (FP8; E2M1 for NVFP4).
    scale_inv: the reciprocal scales, ``mode.scale_shape(data.shape)``, in ``mode.scale_dtype``.
    data_t: the transposed copy, when one was made (the other GEMM's K-major operand); its layout is the producing
      op's (``transpose_batch_dims``, ``transpose_parts``).
    scale_inv_t: the transposed copy's reciprocal scales (per tensor: the same scalar as ``scale_inv``).
    global_scale_inv: NVFP4's second-level float32 reciprocal scale; None otherwise.
    mode: the ``ScalingMode`` (static: part of the pytree's structure, not a leaf).
  """

  data: jax.Array
  scale_inv: jax.Array
  data_t: jax.Array | None = None
  scale_inv_t: jax.Array | None = None
  global_scale_inv: jax.Array | None = None
  mode: ScalingMode = dataclasses.field(default=ScalingMode.PER_TENSOR, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape)

  @property
  def dtype(self) -> np.dtype:
    return jnp.dtype(self.data.dtype)

  def transposed(self) -> "QuantizedTensor":
    """The transposed copy as a tensor of its own (the operand of the GEMM that contracts over the other dim)."""
    if self.data_t is None:
      raise ValueError("this quantized tensor has no transposed copy: quantize it with transpose=True")
    return QuantizedTensor(self.data_t, self.scale_inv_t, global_scale_inv=self.global_scale_inv, mode=self.mode)

  def without_transposed(self) -> "QuantizedTensor":
    """The tensor without its transposed copy (what a GEMM that reads only ``data`` keeps for the backward pass)."""
    return dataclasses.replace(self, data_t=None, scale_inv_t=None)

  def with_rows(self, *rows: int) -> "QuantizedTensor":
    """The tensor (without a transposed copy) with its leading dims reshaped to ``rows``, its last dim kept: the
    scales' leading dims reshaped alike where they cover rows one by one (per-tensor scales cover any shape)."""
    if self.data_t is not None:
      raise ValueError("with_rows reshapes a tensor without its transposed copy: call without_transposed() first")
    shape = (*rows, self.shape[-1])
    if self.mode.block is None:
      return dataclasses.replace(self, data=self.data.reshape(shape))
    if self.mode.block[0] > 1 and tuple(rows) != self.shape[:-1]:
      raise ValueError(f"{self.mode.name} blocks cover rows too: its rows {self.shape[:-1]} cannot become {rows}")
    return dataclasses.replace(self, data=self.data.reshape(shape),
                               scale_inv=self.scale_inv.reshape(*rows, self.scale_inv.shape[-1]))

  def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
    """``data * scale_inv`` in ``dtype``, computed in float32, each scale broadcast over its block.

    Left to XLA: it fuses the multiply into whatever consumes the result (a GEMM operand, an add)."""
    out = jnp.dtype(dtype)
    if out not in HP_DTYPES:
      raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return (self.data.astype(jnp.float32) * self._expanded(self.scale_inv, self.shape)).astype(out)

  def _expanded(self, scales: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``scales`` as float32 broadcasting against data of ``shape``."""
    s = scales.astype(jnp.float32)
    if self.global_scale_inv is not None:
      s = s * self.global_scale_inv
    if self.mode.block is None:
      return s
    rows, cols = self.mode.block
    s = _repeat(s, cols, -1, shape[-1])
    if rows > 1:
      s = _repeat(s, rows, -2, shape[-2])
    return s


def _repeat(s: jax.Array, k: int, axis: int, size: int) -> jax.Array:
  """``jnp.repeat(s, k, axis)`` cut to ``size`` along ``axis``, as a broadcast and a merge of the new dim into
  ``axis``: the same values, and on Explicit mesh axes a sharded ``axis`` stays sharded (``jnp.repeat`` would ask for
  an ``out_sharding``)."""
  axis %= s.ndim
  e = jnp.broadcast_to(jnp.expand_dims(s, axis + 1), (*s.shape[:axis + 1], k, *s.shape[axis + 1:]))
  e = e.reshape(*s.shape[:axis], s.shape[axis] * k, *s.shape[axis + 1:])
  return e if e.shape[axis] == size else jax.lax.slice_in_dim(e, 0, size, axis=axis)
