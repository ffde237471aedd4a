"""The GEMM of block-scaled tensors: which path runs, the emulation, and the scales in cuBLASLt's layouts.

``te_jax.ops.gemm.gemm`` takes two block-scaled ``QuantizedTensor`` operands (K-major, the blocks along each
operand's last dim, the contracting one) with every option it takes for per-tensor FP8. Two paths:

- **Native**, through cuBLASLt (``te_gemm_cuda``), where the GPU and the shapes allow it (``native_block_reason``):
  BLOCK_1X128 / BLOCK_128X128 operands on compute capability 9.0 (cuBLAS >= 12.9: 1D x 1D, 1D x 2D and 2D x 1D; 2D x
  2D has no kernel), MXFP8 x MXFP8 and NVFP4 x NVFP4 on 10.x. The 10.x path is built and selected by compute
  capability but has never run on this project's machines (no Blackwell GPU).
- **Emulated** everywhere else (the CPU, MXFP8/NVFP4 on Hopper, shapes the kernels do not take): each operand
  dequantized into bfloat16 (``QuantizedTensor.dequantize``) and the high-precision GEMM with float32 accumulation.
  ``emulate`` is that dequantization and the one place it is written; it is also the op's reference.

The kernels' alignment rules (cuBLAS documentation, "cublasLtMatmul" and "128-element 1D and 128x128 2D Block Scaling
For FP8 Data Types"; Transformer Engine's checks before the same cuBLASLt call agree): K a multiple of 16 (the
operands' leading dim), N a multiple of 16 (as te_jax's per-tensor rule; cuBLASLt needs the output's leading dim at 16
bytes), M a multiple of 8, M and N multiples of 4 for the scale layouts. Shapes that miss one take the emulated path;
``block_gemm_path`` says which path a call takes and why.

Scale layouts. A ``QuantizedTensor`` holds its scales in the logical layout (the data's shape with the blocked dims
divided by the block, rounded up); cuBLASLt wants others, made here with XLA ops on the small scale arrays before the
GEMM (``kernel_scales``):

- BLOCK_1X128 (cuBLASLt VEC128_32F): (L, R) with the R rows contiguous, L = ceil(K / 128): the logical (R, L)
  transposed. Kept as (*k dims, *row dims), so that each dim keeps its data dim's sharding and the handler reads the
  same bytes as (L, R).
- BLOCK_128X128 (BLK128x128_32F): (ceil(R / 128), L4), K-major with L padded to a multiple of 4.
- MXFP8 / NVFP4 (VEC32_UE8M0 / VEC16_UE4M3): 128 x 4 tiles, rows padded to 128 and L to 4, each tile 32 x 4 x 4
  (row % 32, row / 32, column), tiles in row-major order; kept as (row tiles, column tiles, 512).

Their cost is measured by ``benchmarks/bench_gemm.py`` (its ``scale layout`` rows; ``benchmarks/DECISIONS.md`` says
what it gave). It is done in XLA rather than in the handler because the handler could only do it in scratch memory it
has no geometry for.

Accumulation: cuBLASLt's block-scaled Hopper kernels have no fast-accumulation variant (with
CUBLASLT_MATMUL_DESC_FAST_ACCUM = 1 the heuristic answers CUBLAS_STATUS_NOT_SUPPORTED on the H100, cuBLAS 13; PyTorch's
``_scaled_mm`` rejects fast accumulation with these scalings for the same reason): each 128-element K block's partial
sum is scaled and added in float32, so ``fast_accum`` selects the same kernel as full precision.

Sharding: the scales shard with their data (the same mesh axes on the corresponding dims); a sharded dim that a
block covers must hold whole blocks per shard (``scale_spec`` raises a ValueError naming the operand, the dim, the
mesh axes and the block), and a sharded K of a 128 x 128 operand whole groups of 4 blocks (cuBLASLt's L4 stride).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.dtypes import FP8_DTYPES
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode

__all__ = ["BLOCK_ALIGN_M", "block_gemm_path", "check_block_operands", "emulate", "gpu_compute_capability",
           "is_block_scaled",
           "kernel_scales", "logical_scales", "native_block_reason", "scale_factors", "scale_spec"]

#: cuBLASLt's block-scaled kernels: M a multiple of this (K and N: te_jax.ops.gemm.FP8_ALIGN).
BLOCK_ALIGN_M = 8
_HOPPER = (ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128)
_BLACKWELL = (ScalingMode.MXFP8_1X32, ScalingMode.NVFP4_1X16)
_E2M1 = jnp.dtype(jnp.float4_e2m1fn)
_E5M2 = jnp.dtype(jnp.float8_e5m2)
_TILE_ROWS, _TILE_COLS = 128, 4  # MXFP8 / NVFP4 scale tiles; also BLOCK_128X128's L4


def is_block_scaled(x) -> bool:
  return isinstance(x, QuantizedTensor) and x.mode is not ScalingMode.PER_TENSOR


def check_block_operands(lhs, rhs) -> None:
  """Raises unless lhs and rhs are block-scaled QuantizedTensors of modes that multiply: BLOCK_1X128 and BLOCK_128X128
  in any pair, MXFP8_1X32 with MXFP8_1X32, NVFP4_1X16 with NVFP4_1X16; each operand's data, scales and NVFP4 global
  scale of its mode's dtypes and shapes."""
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not is_block_scaled(x):
      what = (f"scaled {x.mode.name}" if isinstance(x, QuantizedTensor)
              else f"a {jnp.dtype(x.dtype).name} array" if hasattr(x, "dtype") else f"a {type(x).__name__}")
      other = rhs if name == "lhs" else lhs
      raise ValueError(f"{name} is {what} but {'rhs' if name == 'lhs' else 'lhs'} is scaled {other.mode.name}: a "
                       "block-scaled GEMM needs both operands block-scaled (quantize both with the same recipe)")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    want_data = (_E2M1,) if x.mode is ScalingMode.NVFP4_1X16 else FP8_DTYPES
    if x.dtype not in want_data:
      raise TypeError(f"{name} is scaled {x.mode.name} and must hold {' or '.join(d.name for d in want_data)} data, "
                      f"got {x.dtype.name}")
    if x.data.ndim < 2:
      raise ValueError(f"{name} must have rank >= 2, got shape {x.shape}")
    want = x.mode.scale_shape(x.shape)
    if tuple(jnp.shape(x.scale_inv)) != want or jnp.dtype(x.scale_inv.dtype) != x.mode.scale_dtype:
      raise TypeError(f"{name}.scale_inv must be {x.mode.scale_dtype.name}{list(want)} for {x.mode.name} data of shape "
                      f"{x.shape}, got {jnp.dtype(x.scale_inv.dtype).name}{list(jnp.shape(x.scale_inv))}")
    g = x.global_scale_inv
    if x.mode is ScalingMode.NVFP4_1X16 and (g is None or jnp.shape(g) != () or jnp.dtype(g.dtype) != jnp.float32):
      raise TypeError(f"{name} is NVFP4 and needs a float32 scalar global_scale_inv, got {g!r}")
  pair = (lhs.mode, rhs.mode)
  if not (all(m in _HOPPER for m in pair) or pair[0] is pair[1]):
    raise ValueError(f"lhs is scaled {lhs.mode.name} and rhs {rhs.mode.name}: these do not multiply; block GEMMs take "
                     "BLOCK_1X128 / BLOCK_128X128 in any pair, or both MXFP8_1X32, or both NVFP4_1X16")


def emulate(x: QuantizedTensor) -> jax.Array:
  """The emulated path's operand: ``x`` dequantized into bfloat16 (each scale over its block, NVFP4's global scale
  too), for the high-precision GEMM with float32 accumulation."""
  return x.dequantize(jnp.bfloat16)


def gpu_compute_capability() -> tuple[int, int] | None:
  """The compute capability of the first GPU, or None without one."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return None
  cc = getattr(gpus[0], "compute_capability", None) if gpus else None
  if not cc:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


def native_block_reason(lhs_mode: ScalingMode, rhs_mode: ScalingMode, lhs_shape, rhs_shape, dtypes,
                        cc: tuple[int, int] | None, *, keep_rows: bool = False, contract_dims: int = 1) -> str | None:
  """None where cuBLASLt has a kernel for this block-scaled GEMM on a GPU of compute capability ``cc``, else why not
  (the emulated path runs). Shapes are the operands' data shapes, K-major."""
  if cc is None:
    return "no GPU"
  if all(m in _HOPPER for m in (lhs_mode, rhs_mode)):
    if cc != (9, 0):
      return f"cuBLASLt's 1 x 128 / 128 x 128 block-scaled kernels are for compute capability 9.0, not {cc[0]}.{cc[1]}"
    if lhs_mode is rhs_mode is ScalingMode.BLOCK_128X128:
      return "cuBLASLt has no 128 x 128 x 128 x 128 block-scaled kernel"
  elif lhs_mode is rhs_mode and lhs_mode in _BLACKWELL:
    if cc[0] != 10:
      return f"cuBLASLt's {lhs_mode.name} GEMM is for compute capability 10.x, not {cc[0]}.{cc[1]}"
    if keep_rows or contract_dims != 1:
      return f"{lhs_mode.name}'s tiled scales are laid out over one row dim and one contracting dim"
  else:
    return f"no kernel for {lhs_mode.name} x {rhs_mode.name}"
  if all(jnp.dtype(d) == _E5M2 for d in dtypes):
    return "E5M2 x E5M2 has no FP8 GEMM"
  k = math.prod(lhs_shape[len(lhs_shape) - contract_dims:])
  m = math.prod(lhs_shape[:len(lhs_shape) - contract_dims])
  n = math.prod(rhs_shape[:len(rhs_shape) - contract_dims])
  if m == 0 or n == 0 or k == 0:
    return "an empty dim"
  if m % BLOCK_ALIGN_M or n % 16 or k % 16:
    return f"M={m}, N={n}, K={k}: the kernels need M a multiple of {BLOCK_ALIGN_M}, N and K of 16"
  for name, mode, shape in (("lhs", lhs_mode, lhs_shape), ("rhs", rhs_mode, rhs_shape)):
    cols = mode.block[1]
    if contract_dims > 1 and shape[-1] % cols:
      return f"{name}'s last dim {shape[-1]} is no multiple of its {cols}-element blocks: they do not fold into K's"
    if mode.block[0] > 1:  # blocks over rows too: one contracting dim, and rows folding block by block
      if contract_dims != 1:
        return f"{name}'s {mode.name} blocks cover two contracting dims"
      rows = shape[:-1]
      if len(rows) > 1 and (rows[-1] % mode.block[0] or (name == "lhs" and keep_rows)):
        return f"{name}'s {mode.name} blocks over rows {rows} do not fold into M"
  return None


def block_gemm_path(lhs: QuantizedTensor, rhs: QuantizedTensor, *, keep_rows: bool = False,
                    contract_dims: int = 1) -> str:
  """``"native"`` where ``gemm(lhs, rhs, ...)`` runs cuBLASLt's block-scaled kernel on this machine's GPU (and under
  ``jax.jit`` for the GPU), else ``"emulated: <why>"``."""
  check_block_operands(lhs, rhs)
  if not native.has_target("cuda", "te_gemm_cuda"):
    return "emulated: the CUDA module is not loaded"
  why = native_block_reason(lhs.mode, rhs.mode, lhs.shape, rhs.shape, (lhs.dtype, rhs.dtype), gpu_compute_capability(),
                            keep_rows=keep_rows, contract_dims=contract_dims)
  return "native" if why is None else f"emulated: {why}"


def _padded(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
  pad = [(0, -d % m) for d, m in zip(x.shape, multiples)]
  return jnp.pad(x, pad) if any(p for _, p in pad) else x


def kernel_scales(scale: jax.Array, mode: ScalingMode, data_shape, k_dims: int) -> jax.Array:
  """The logical scales of data of ``data_shape`` (rows first, ``k_dims`` contracted dims last, as the handler's
  operand) in cuBLASLt's layout for ``mode`` (see the module docstring)."""
  n_rows = len(data_shape) - k_dims
  if mode is ScalingMode.BLOCK_1X128:
    return jnp.transpose(scale, (*range(n_rows, scale.ndim), *range(n_rows)))
  s = scale.reshape(math.prod(scale.shape[:-1]), scale.shape[-1])
  if mode is ScalingMode.BLOCK_128X128:
    return _padded(s, (1, _TILE_COLS))
  s = _padded(s, (_TILE_ROWS, _TILE_COLS))
  rt, lt = s.shape[0] // _TILE_ROWS, s.shape[1] // _TILE_COLS
  # (row tile, row / 32 within it, row % 32, column tile, column) -> (row tile, column tile, row % 32, row / 32, column)
  tiles = s.reshape(rt, 4, 32, lt, _TILE_COLS).transpose(0, 3, 2, 1, 4)
  return tiles.reshape(rt, lt, _TILE_ROWS * _TILE_COLS)


def logical_scales(kernel: jax.Array, mode: ScalingMode, data_shape, k_dims: int) -> jax.Array:
  """``kernel_scales``'s inverse: the logical scales of data of ``data_shape`` from cuBLASLt's layout."""
  want = mode.scale_shape(tuple(data_shape))
  n_rows = len(data_shape) - k_dims
  if mode is ScalingMode.BLOCK_1X128:
    n_k = kernel.ndim - n_rows
    return jnp.transpose(kernel, (*range(n_k, kernel.ndim), *range(n_k)))
  rows, cols = math.prod(want[:-1]), want[-1]
  if mode is ScalingMode.BLOCK_128X128:
    return kernel[:, :cols].reshape(want)
  rt, lt = kernel.shape[:2]
  s = kernel.reshape(rt, lt, 32, 4, _TILE_COLS).transpose(0, 3, 2, 1, 4).reshape(rt * _TILE_ROWS, lt * _TILE_COLS)
  return s[:rows, :cols].reshape(want)


def scale_factors(mode: ScalingMode, rows: list[str], ks: list[str], prefix: str) -> str:
  """The Shardy factors of an operand's kernel-layout scales: a 1 x 128 operand's share its rows' and its leading
  contracted dims' factors (the blocked last one gets its own); the others' dims get factors of their own."""
  if mode is ScalingMode.PER_TENSOR:
    return ""
  if mode is ScalingMode.BLOCK_1X128:
    return " ".join([*ks[:-1], f"{prefix}kb", *rows])
  n = 2 if mode is ScalingMode.BLOCK_128X128 else 3
  return " ".join(f"{prefix}s{i}" for i in range(n))


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def scale_spec(mode: ScalingMode, name: str, data_shape, row_axes: list[tuple[str, ...]],
               k_axes: list[tuple[str, ...]], mesh) -> P:
  """The sharding of an operand's kernel-layout scales, from its data's (``row_axes``, ``k_axes``: the mesh axes of
  each row and contracted dim of the handler's operand, ``data_shape``); raises a ValueError where a shard would cut
  a block."""
  if mode is ScalingMode.PER_TENSOR:
    return P()
  n_rows = len(row_axes)
  block_rows, block_cols = mode.block

  def local(d: int, axes) -> int:
    return data_shape[d] // math.prod(mesh.shape[a] for a in axes)

  def need(d: int, axes, multiple: int, what: str):
    if axes and local(d, axes) % multiple:
      raise ValueError(f"{name}'s dim {d} (size {data_shape[d]}) is sharded over mesh axes {axes} into shards of "
                       f"{local(d, axes)}: {mode.name} scaling needs {what} per shard (a multiple of {multiple})")

  last = len(data_shape) - 1
  need(last, k_axes[-1], block_cols, f"whole {block_rows} x {block_cols} blocks")
  if mode is ScalingMode.BLOCK_1X128:
    return P(*(_entry(a) for a in k_axes), *(_entry(a) for a in row_axes))
  if n_rows != 1 or len(k_axes) != 1:
    raise ValueError(f"{name}: {mode.name} scales are laid out for one row dim and one contracted dim")
  need(0, row_axes[0], 128, f"whole {block_rows} x {block_cols} blocks")
  need(last, k_axes[0], block_cols * _TILE_COLS, f"whole groups of {_TILE_COLS} blocks along K (cuBLASLt's stride)")
  entries = (_entry(row_axes[0]), _entry(k_axes[0]))
  return P(*entries) if mode is ScalingMode.BLOCK_128X128 else P(*entries, None)
