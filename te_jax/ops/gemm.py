"""GEMM through cuBLASLt: FP8 (E4M3/E5M2, per-tensor scales) and bf16/fp16/fp32, with bias and residual epilogues.

``gemm(lhs, rhs)`` computes ``out[M, N] = lhs[M, K] @ rhs[N, K]^T``: both operands K-major (contracting dim
last), the layout Hopper's FP8 tensor cores need. Leading dims of ``lhs`` fold into M, of ``rhs`` into N. FP8
operands are ``QuantizedTensor`` values, dequantized inside the GEMM by their ``scale_inv``. A residual (M, N) is added in the
epilogue (cuBLASLt's C input with beta = 1), so a residual connection costs no pass of its own. bf16/fp16/fp32
operands may also be
given transposed (``lhs`` as (K, M...), ``rhs`` as (K, N...)); FP8 operands may not, use the transposed copy
``te_jax.ops.quantize.quantize(..., transpose=True)`` makes (``QuantizedTensor.transposed()``).

FP8 shapes: cuBLASLt's FP8 kernels need K and N to be multiples of 16 (the leading dims of the stored
operands); such shapes are rejected with a ValueError, never padded behind the caller's back (``dense`` pads the
rows it owns). On CPU, and wherever the CUDA module is missing, the reference runs: dequantize, dot in float32,
add bias, cast.

``gemm(lhs, rhs, rhs_parts=True)`` with ``rhs`` (P, N, K) returns the P products ``lhs @ rhs[p]^T`` as separate
arrays (the q, k and v of a fused QKV projection, each where attention reads it) from one cuBLASLt launch, a
pointer-array batched GEMM sharing lhs, with no slicing of a stacked output afterwards (the benchmark ``gemm``
compares it with P GEMMs of N columns and with one of P * N).

``gemm(lhs, rhs, scatter_rows=True)`` with ``lhs`` (B, S, K) keeps the output's rows as the two dims (B, S), sharded
as the output's consumer asks rather than as lhs's rows are: a row-parallel GEMM whose caller constrains its output to
a sequence-parallel residual stream (batch over the data axes, sequence over the tensor axis) ends in one
reduce-scatter onto it. Its (M, N) view cannot say that: batch over 'data' and sequence over 'tensor' is no sharding of
the merged rows, so the partitioner would all-reduce and then slice.

``gemm(lhs, rhs, keep_rows=True)`` keeps lhs's leading dims (B, S, ...) as dims of their own, each sharded as lhs's is
(the output's rows sharded alike), instead of folding them into M: rows whose batch and sequence are sharded over
different mesh axes (context parallelism) are no sharding of the merged (B * S) rows either, and folding them would
all-gather the sequence. ``contract_dims=2`` contracts the last two dims of both operands, the kept (B, S) rows of a
weight gradient's transposed operands (K, B, S) and (N, B, S); each contracted dim keeps its sharding and the
partial sums are reduced over all of their mesh axes. The handler sees the same bytes as the 2-D GEMM.

``gemm(lhs, rhs, batched=True)`` with ``lhs`` (B, M, K) and ``rhs`` (B, N, K) returns (B, M, N), ``out[b] = lhs[b] @
rhs[b]^T``: one cuBLASLt strided batched GEMM (per-tensor scales, one per operand for the whole batch; no bias,
residual or transposes), the batched products of attention (``'BSNH,BTNH->BNTS'``). Its batch dim stays sharded as
the operands shard it, with no collective.

Block-scaled operands (``QuantizedTensor`` of BLOCK_1X128, BLOCK_128X128, MXFP8_1X32 or NVFP4_1X16, both operands)
take the same options; cuBLASLt runs them where it has a kernel (1 x 128 and 128 x 128 on Hopper, MXFP8 and NVFP4 on
cc 10.x), the emulation (bfloat16 dequantization, then the high-precision GEMM) elsewhere: see
``te_jax.ops.gemm_block``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.autocast import get_autocast_state
from te_jax._core.dtypes import HP_DTYPES
from te_jax._core.explicit import constrain, retype
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode
from te_jax.ops.gemm_block import (check_block_operands, emulate, gpu_compute_capability, is_block_scaled,
                                   kernel_scales, logical_scales, native_block_reason, scale_factors, scale_spec)
from te_jax.ops.quantize import FP8_DTYPES

__all__ = ["FP8_ALIGN", "MAX_PARTS", "gemm", "gemm_ref", "GemmConfig", "output_spec"]

# cuBLASLt FP8: K and N (the stored operands' leading dims) multiples of 16. The FP8 layers therefore also pad their
# tokens to a multiple of it: the weight-gradient GEMM contracts over them.
FP8_ALIGN = 16
# The API's limit on rhs_parts, checked on every platform; tests/test_geometry.py checks that the CUDA kernel's capacity
# (te_jax._te_cuda.gemm_max_parts) covers it.
MAX_PARTS = 4


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Static parameters of one GEMM.

  Attributes:
    dtype: the output dtype: bfloat16, float16 or float32.
    transpose_lhs: lhs is stored (K, M) (bf16/fp16/fp32 only).
    transpose_rhs: rhs is stored (K, N) (bf16/fp16/fp32 only).
    has_bias: a (N,) bias in ``out_dtype`` follows the scales, added in float32 before the output cast.
    fast_accum: FP8 fast accumulation (cuBLASLt FAST_ACCUM): faster, with fewer accumulator promotions.
    has_residual: an (M, N) residual in ``out_dtype`` is the last operand, added in float32 before the output cast.
    parts: with ``parts`` > 1, rhs is (parts, N, K) and there are ``parts`` outputs (M, N); else one.
    out_rows: (B, S) with B * S = M: the output is (B, S, N) and its rows' sharding is left to its consumer (the
      sharding rule does not tie it to lhs's rows); a residual is (B, S, N) too. None: the output is (M, N).
    k_dims: how many trailing dims of each (untransposed) operand are contracted; lhs's dims before them are its rows
      (one dim, M, or several kept apart: (B, S)), the output's too: ``(*rows, N)``.
    lhs_mode, rhs_mode: the ``ScalingMode`` of each operand's scales; block modes pass them in cuBLASLt's layout
      (``te_jax.ops.gemm_block.kernel_scales``), both block-scaled or neither.
    out_spec: the output's sharding a caller asked for (``out_sharding``): on Explicit mesh axes the output's type is
      what ``_partition`` makes of it (a reduce-scatter onto it where K's axes shard it).
    deterministic: cuBLASLt's heuristic algorithm, never the fastest one timed at the first call (whose choice can
      differ from one process to the next): ``autocast(deterministic=True)``.
    batched: lhs (B, M, K), rhs (B, N, K), the output (B, M, N): a strided batch of GEMMs, per-tensor scales, no
      bias, residual, parts or transposes.
  """

  out_dtype: np.dtype
  transpose_lhs: bool = False
  transpose_rhs: bool = False
  has_bias: bool = False
  fast_accum: bool = False
  has_residual: bool = False
  parts: int = 1
  out_rows: tuple[int, int] | None = None
  k_dims: int = 1
  lhs_mode: ScalingMode = ScalingMode.PER_TENSOR
  rhs_mode: ScalingMode = ScalingMode.PER_TENSOR
  out_spec: P | None = None
  deterministic: bool = False
  batched: bool = False


def _split(shape, transposed: bool, k_dims: int, parts: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(row dims, contracted dims) of an operand: a 2-D transposed one is (K, rows), any other (*rows, *K) with
  ``k_dims`` contracted dims; a rhs with parts loses its leading part dim first."""
  shape = tuple(shape[1:] if parts else shape)
  if transposed:
    return shape[1:], shape[:1]
  return shape[:len(shape) - k_dims], shape[len(shape) - k_dims:]


def _mk(shape, transposed, k_dims: int = 1, parts: bool = False) -> tuple[int, int]:
  """(rows, K) of an operand, each folded into one number."""
  rows, k = _split(shape, transposed, k_dims, parts)
  return math.prod(rows), math.prod(k)


# ---- reference ---------------------------------------------------------------------------------------------------


def gemm_ref(lhs, rhs, lhs_scale_inv, rhs_scale_inv, *rest, config: GemmConfig) -> list[jax.Array]:
  """Dequantize (FP8 operands), ``lhs @ rhs^T`` accumulated in float32, add bias and residual, cast.

  Block-scaled operands (scales in cuBLASLt's layout) are dequantized as the emulated path does: into bfloat16.
  Batched: the same per batch index, one dot_general over the batch dim."""
  if config.batched:
    a, b = lhs, rhs
    if jnp.dtype(a.dtype) in FP8_DTYPES:
      a, b = a.astype(jnp.float32) * lhs_scale_inv, b.astype(jnp.float32) * rhs_scale_inv
    out = jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return [out.astype(config.out_dtype)]
  if config.parts > 1:  # no bias or residual with parts
    return [gemm_ref(lhs, part, lhs_scale_inv, rhs_scale_inv, config=dataclasses.replace(config, parts=1))[0]
            for part in rhs]
  rows, _ = _split(lhs.shape, config.transpose_lhs, config.k_dims)
  if config.lhs_mode is not ScalingMode.PER_TENSOR:
    lhs, rhs = (emulate(QuantizedTensor(x, logical_scales(s, mode, x.shape, config.k_dims), mode=mode))
                for x, s, mode in ((lhs, lhs_scale_inv, config.lhs_mode), (rhs, rhs_scale_inv, config.rhs_mode)))
  a = lhs.T if config.transpose_lhs else lhs.reshape(_mk(lhs.shape, False, config.k_dims))
  b = rhs.T if config.transpose_rhs else rhs.reshape(_mk(rhs.shape, False, config.k_dims))
  if jnp.dtype(a.dtype) in FP8_DTYPES:
    a = a.astype(jnp.float32) * lhs_scale_inv
    b = b.astype(jnp.float32) * rhs_scale_inv
  out = jax.lax.dot_general(
      a, b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
  )
  if config.has_bias:
    out = out + rest[0].astype(jnp.float32)
  if config.has_residual:
    out = out + rest[-1].astype(jnp.float32).reshape(out.shape)
  out = out.astype(config.out_dtype)
  return [out.reshape(*(config.out_rows or rows), out.shape[1])]


# ---- primitive ---------------------------------------------------------------------------------------------------


def _abstract_eval(lhs, rhs, lhs_scale_inv, rhs_scale_inv, *rest, config: GemmConfig):
  del lhs_scale_inv, rhs_scale_inv, rest
  if config.batched:
    return [output_aval(lhs, (*lhs.shape[:2], rhs.shape[1]), config.out_dtype)]
  rows, _ = _split(lhs.shape, config.transpose_lhs, config.k_dims)
  n, _ = _mk(rhs.shape, config.transpose_rhs, config.k_dims, parts=config.parts > 1)
  return [output_aval(lhs, (*(config.out_rows or rows), n), config.out_dtype)] * config.parts


def _native_signature(platform: str, config: GemmConfig, avals_in, avals_out) -> NativeSignature:
  """The handler always takes bias and residual operands (empty when there are none), in that order, and returns its
  workspace first (cuBLASLt's, then a batched GEMM's pointer arrays, sized by the module), then the output or its
  parts."""
  empty = np.zeros((0,), config.out_dtype)
  n = len(avals_in)  # lhs, rhs, the two scales, then the bias and the residual that are there
  bias = n - 1 - config.has_residual if config.has_bias else n  # index in (operands, extras)
  residual = n - 1 if config.has_residual else n + (not config.has_bias)
  extra = (empty,) * ((not config.has_bias) + (not config.has_residual))
  workspace = native.workspace(platform, "gemm", config.parts)
  if config.batched:  # (B, M, K), (B, N, K) -> (B, M, N) as they are
    out = jax.core.ShapedArray(avals_out[0].shape, avals_out[0].dtype)
    return NativeSignature(extra_operands=extra, result_avals=(workspace, out), keep=(1,),
                           operand_order=(0, 1, 2, 3, bias, residual))
  # The handler reads 2-D operands ((M, K) and (N, K), or (parts, N, K)) and writes (M, N) outputs: kept rows,
  # several contracted dims and out_rows are reshapes of the same bytes, which the lowering makes.
  lhs, rhs = avals_in[:2]
  parts = (config.parts,) if config.parts > 1 else ()
  shapes = [lhs.shape if config.transpose_lhs else _mk(lhs.shape, False, config.k_dims),
            rhs.shape if config.transpose_rhs else (*parts, *_mk(rhs.shape, False, config.k_dims, bool(parts))),
            *(a.shape for a in avals_in[2:])]
  for i, (data, mode) in enumerate(((lhs, config.lhs_mode), (rhs, config.rhs_mode))):
    del data
    scale = avals_in[2 + i].shape
    if mode is ScalingMode.BLOCK_1X128:  # (*k, *rows) -> (L, R): the same bytes
      shapes[2 + i] = (math.prod(scale[:config.k_dims]), math.prod(scale[config.k_dims:]))
    elif mode is not ScalingMode.PER_TENSOR:
      shapes[2 + i] = (math.prod(scale),)
  if config.has_residual:
    shapes[-1] = (math.prod(avals_in[-1].shape[:-1]), avals_in[-1].shape[-1])
  outs = [jax.core.ShapedArray((math.prod(a.shape[:-1]), a.shape[-1]), a.dtype) for a in avals_out]
  return NativeSignature(extra_operands=extra, result_avals=(workspace, *outs),
                         keep=tuple(range(1, 1 + len(avals_out))), operand_order=(0, 1, 2, 3, bias, residual),
                         operand_shapes=tuple(tuple(sh) for sh in shapes))


def _attributes(config: GemmConfig) -> dict:
  return {
      "transpose_lhs": np.bool_(config.transpose_lhs),
      "transpose_rhs": np.bool_(config.transpose_rhs),
      "fast_accum": np.bool_(config.fast_accum),
      "lhs_scaling_mode": np.int64(config.lhs_mode.value),
      "rhs_scaling_mode": np.int64(config.rhs_mode.value),
      "deterministic": np.bool_(config.deterministic),
  }


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _partition(config: GemmConfig, mesh, arg_shapes, result_shape):
  """Rows of lhs and of rhs stay sharded as given; a sharded K ends in one psum (or psum_scatter over a dim of the
  output).

  When lhs and rhs shard K differently, lhs's choice wins and rhs is resharded to match, except that a mesh axis
  sharding lhs's rows is kept there and rhs is all-gathered over it instead (FSDP: a weight sharded over the axis that
  shards the batch is gathered where it is used, in the dtype it has here, FP8 under an FP8 recipe, rather than the
  activations being resharded). A mesh axis used twice (say M and N both on 'model') is kept where the output is
  wanted sharded over it, else on M. With parts, rhs's part dim is never sharded (each shard computes its block of
  every part). Several contracted dims (``k_dims``) each keep their sharding, as several row dims do.

  When the output is wanted with a dim sharded over some of K's axes after that dim's own (sequence parallelism:
  M over the tensor axis; FSDP: a weight gradient's rows or columns over the axis that sharded the batch), the partial
  sums are reduce-scattered onto it over those axes (after a psum over K's other axes) instead of all-reduced.

  With ``out_rows`` (B, S), the output's (B, S) sharding is its consumer's: lhs's rows are sharded as B is (and, for
  a 3-D lhs (B, S, K), S as the output's S without K's axes), and when S is sharded over K's axes after those the
  partial sums are reduce-scattered onto it (sequence parallelism); any other S sharding of a 2-D lhs's output is left
  to XLA (a local slice).
  """
  if config.batched:
    return _partition_batched(config, mesh, arg_shapes)
  parts = config.parts > 1
  lhs_spec = full_spec(arg_shapes[0].sharding, len(arg_shapes[0].shape))
  rhs_spec = full_spec(arg_shapes[1].sharding, len(arg_shapes[1].shape))[int(parts):]
  n_k = config.k_dims
  m_l, k_l = (lhs_spec[1:], lhs_spec[:1]) if config.transpose_lhs else (lhs_spec[:-n_k], lhs_spec[-n_k:])
  n_r, k_r = (rhs_spec[1], rhs_spec[:1]) if config.transpose_rhs else (rhs_spec[0], rhs_spec[1:])
  k_dims: list[tuple[str, ...]] = []  # the mesh axes of each contracted dim
  for kl, kr in zip(k_l, k_r):
    axes = mesh_axes(kl) or tuple(a for a in mesh_axes(kr) if a not in mesh_axes(*m_l))
    k_dims.append(tuple(a for a in axes if a not in mesh_axes(*k_dims)))
  k_axes = mesh_axes(*k_dims)
  free = config.out_rows is not None
  out_spec = full_spec(result_shape[0].sharding, (2 if free else len(m_l)) + 1)
  n_axes = tuple(a for a in mesh_axes(n_r) if a not in k_axes and a in mesh_axes(out_spec[-1]))
  rows: list[tuple[str, ...]] = []  # the mesh axes of each of lhs's row dims
  for entry in (out_spec[:len(m_l)] if free else m_l):
    rows.append(tuple(a for a in mesh_axes(entry) if a not in k_axes + n_axes + mesh_axes(*rows)))
  n_axes += tuple(a for a in mesh_axes(n_r) if a not in k_axes + n_axes + mesh_axes(*rows))
  scatter, scatter_axes, rest = None, (), k_axes  # the dim reduce-scattered onto, over which axes; psum over rest
  if free:  # (B, S, N): reduce-scatter onto S when the consumer shards it over K's axes after the ones lhs keeps
    s_out = tuple(a for a in mesh_axes(out_spec[1]) if a not in rows[0] + n_axes)
    kept = rows[1] if len(rows) > 1 else ()  # a 2-D lhs's rows cannot keep S's sharding
    if k_axes and s_out == kept + k_axes:
      scatter, scatter_axes, rest = 1, k_axes, ()
    out_dims = [rows[0], kept, n_axes]
  else:
    out_dims = [*rows, n_axes]
    for d, (entry, own) in enumerate(zip(out_spec, out_dims)):
      wanted = mesh_axes(entry)
      extra = wanted[len(own):]
      if k_axes and extra and wanted[:len(own)] == own and all(a in k_axes for a in extra):
        scatter, scatter_axes, rest = d, extra, tuple(a for a in k_axes if a not in extra)
        break
  if scatter is not None:
    out_dims[scatter] = out_dims[scatter] + scatter_axes
  k_entries, n = [_entry(a) for a in k_dims], _entry(n_axes)
  row_entries = [_entry(a) for a in rows]
  lhs_sharding = NamedSharding(mesh, P(*k_entries, *row_entries) if config.transpose_lhs
                               else P(*row_entries, *k_entries))
  rhs_sharding = NamedSharding(mesh, P(*((None,) if parts else ()), *((*k_entries, n) if config.transpose_rhs
                                                                       else (n, *k_entries))))
  out_sharding = NamedSharding(mesh, P(*(_entry(a) for a in out_dims)))
  scalar = NamedSharding(mesh, P())
  # Block scales shard with their data (the handler's 2-D view of lhs: kept rows, else one).
  lhs_local_shape = (arg_shapes[0].shape if config.lhs_mode is ScalingMode.PER_TENSOR
                     else tuple(arg_shapes[0].shape))
  lhs_scale = NamedSharding(mesh, scale_spec(config.lhs_mode, "lhs", lhs_local_shape, rows, k_dims, mesh))
  rhs_scale = NamedSharding(mesh, scale_spec(config.rhs_mode, "rhs", tuple(arg_shapes[1].shape), [n_axes], k_dims,
                                             mesh))
  local_rows = None
  if free:  # one shard's (B, S) before the reduce-scatter
    local_rows = tuple(size // math.prod(mesh.shape[a] for a in axes) for size, axes in zip(config.out_rows,
                                                                                             (rows[0], kept)))
  arg_shardings = [lhs_sharding, rhs_sharding, lhs_scale, rhs_scale]
  if config.has_bias:
    arg_shardings.append(NamedSharding(mesh, P(out_sharding.spec[-1])))
  if config.has_residual:
    arg_shardings.append(out_sharding)
  # With K sharded, the epilogues go on once, after the reduction.
  local_config = dataclasses.replace(config, has_bias=config.has_bias and not k_axes,
                                     has_residual=config.has_residual and not k_axes, out_rows=local_rows)

  def reduce(out, addends):
    # Partial sums reduce in the output dtype, as cuBLASLt's split-K would; bias and residual go on after.
    if rest:
      out = jax.lax.psum(out, rest)
    if scatter is not None:
      out = jax.lax.psum_scatter(out, scatter_axes, scatter_dimension=scatter, tiled=True)
    if addends:
      out = out.astype(jnp.float32)
      for r in addends:
        out = out + r.astype(jnp.float32)
      out = out.astype(config.out_dtype)
    return out

  def lower_fn(lhs, rhs, lhs_scale_inv, rhs_scale_inv, *rest):
    outs = _GEMM.inner.bind(lhs, rhs, lhs_scale_inv, rhs_scale_inv, *([] if k_axes else rest), config=local_config)
    if not k_axes:
      return tuple(outs)
    return tuple(reduce(out, rest) for out in outs)  # rest is empty with parts

  return mesh, lower_fn, (out_sharding,) * config.parts, tuple(arg_shardings)


def _partition_batched(config: GemmConfig, mesh, arg_shapes):
  """The batched GEMM's partition: the batch dim sharded as lhs's (else rhs's), which both operands and the output
  then share, with no collective; M as lhs's, N as rhs's, each less the axes used before; a sharded K (lhs's axes,
  else rhs's) ends in one psum of the partial sums, in the output dtype, as the 2-D GEMM's does."""
  lhs_spec, rhs_spec = (full_spec(a.sharding, 3) for a in arg_shapes[:2])
  used: list[str] = []

  def take(*entries):  # the first entry's mesh axes not used yet (falling back to the next), now used
    for entry in entries:
      axes = tuple(a for a in mesh_axes(entry) if a not in used)
      if axes:
        used.extend(axes)
        return axes
    return ()

  b = take(lhs_spec[0], rhs_spec[0])
  k = take(lhs_spec[2], rhs_spec[2])
  m, n = take(lhs_spec[1]), take(rhs_spec[1])
  b, m, n, k_entry = _entry(b), _entry(m), _entry(n), _entry(k)
  scalar = NamedSharding(mesh, P())
  arg_shardings = (NamedSharding(mesh, P(b, m, k_entry)), NamedSharding(mesh, P(b, n, k_entry)), scalar, scalar)

  def lower_fn(lhs, rhs, lhs_scale_inv, rhs_scale_inv):
    (out,) = _GEMM.inner.bind(lhs, rhs, lhs_scale_inv, rhs_scale_inv, config=config)
    return (jax.lax.psum(out, k) if k else out,)

  return mesh, lower_fn, (NamedSharding(mesh, P(b, m, n)),), arg_shardings


def output_spec(rows, k_lhs, k_rhs, cols) -> tuple:
  """The sharding of a contraction's output where nothing asks for another, from its operands' PartitionSpec entries
  (``rows``: lhs's row dims; ``k_lhs``, ``k_rhs``: each contracted dim of lhs and of rhs; ``cols``: rhs's column
  dims): ``gemm``'s partition's choice, which its output's type says on Explicit mesh axes. A contracted dim is
  sharded over lhs's mesh axes for it, else over rhs's less the rows' (the partial sums are all-reduced over
  those); each row dim keeps its axes but the contraction's, each column dim its own but the contraction's and
  the rows' (earlier dims first). te_jax's high-precision GEMMs type their outputs the same way, so a layer's
  output has one type whichever path computes it."""
  k_axes: list[str] = []
  for kl, kr in zip(k_lhs, k_rhs, strict=True):
    axes = mesh_axes(kl) or tuple(a for a in mesh_axes(kr) if a not in mesh_axes(*rows))
    k_axes += [a for a in axes if a not in k_axes]
  used, out = list(k_axes), []
  for entry in (*rows, *cols):
    kept = tuple(a for a in mesh_axes(entry) if a not in used)
    used += kept
    out.append(_entry(kept))
  return tuple(out)


def _wanted_sharding(config: GemmConfig):
  return None if config.out_spec is None else [config.out_spec] * config.parts


def _sharding_rule(config: GemmConfig, mesh, value_types, result_types):
  """``m k, n k -> m n``; with parts, ``m k, p n k -> m n, m n, ...`` with p kept whole; kept row dims and several
  contracted dims are factors of their own (``m0 m1 k``, ``k n0 n1``...)."""
  del mesh, result_types
  if config.batched:
    return "b m k, b n k, , -> b m n", {"reduction_factors": ("k",)}
  n_rows = 1 if config.transpose_lhs else len(value_types[0].shape) - config.k_dims
  m = "m" if n_rows == 1 else " ".join(f"m{i}" for i in range(n_rows))
  k = "k" if config.k_dims == 1 else " ".join(f"k{i}" for i in range(config.k_dims))
  lhs = f"{k} {m}" if config.transpose_lhs else f"{m} {k}"
  rhs = ("p " if config.parts > 1 else "") + (f"{k} n" if config.transpose_rhs else f"n {k}")
  out = f"{m} n" if config.out_rows is None else "b s n"  # out_rows: factors of their own, set by the consumer
  scales = [scale_factors(config.lhs_mode, m.split(), k.split(), "l"), scale_factors(config.rhs_mode, ["n"], k.split(),
                                                                                     "r")]
  operands = [lhs, rhs, *scales] + (["n"] if config.has_bias else []) + ([out] if config.has_residual else [])
  extra = {"need_replication_factors": ("p",)} if config.parts > 1 else {}
  return ", ".join(operands) + " -> " + ", ".join([out] * config.parts), {"reduction_factors": tuple(k.split()),
                                                                          **extra}


_GEMM = define_op(
    "gemm",
    abstract_eval=_abstract_eval,
    reference=gemm_ref,
    native_platforms=("cuda",),
    ffi_attributes=_attributes,
    native_signature=_native_signature,
    partition=_partition,
    sharding_rule=_sharding_rule,
    wanted_sharding=_wanted_sharding,
)


# ---- public API --------------------------------------------------------------------------------------------------


def _operand(x, name: str) -> tuple[jax.Array, jax.Array | None]:
  """An operand as (data, scale_inv): a per-tensor ``QuantizedTensor``'s, or a high-precision array with None."""
  if isinstance(x, QuantizedTensor):
    if x.mode is not ScalingMode.PER_TENSOR:
      raise ValueError(f"{name} is scaled {x.mode.name}; te_jax's GEMM takes per-tensor scaled operands")
    if x.dtype not in FP8_DTYPES:
      raise TypeError(f"{name} must hold float8_e4m3fn or float8_e5m2 data, got {x.dtype.name}")
    s = x.scale_inv
    if not hasattr(s, "dtype") or jnp.dtype(s.dtype) != jnp.float32 or jnp.shape(s) != ():
      raise TypeError(f"{name}.scale_inv must be a float32 scalar, got {getattr(s, 'dtype', s)!r}")
    return x.data, s
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a jax array or a te_jax QuantizedTensor, got {type(x).__name__}")
  dt = jnp.dtype(x.dtype)
  if dt in FP8_DTYPES:
    raise TypeError(f"{name} is a bare {dt.name} array: pass it as a te_jax QuantizedTensor with its scale_inv "
                    "(what te_jax.ops.quantize.quantize returns)")
  if dt not in HP_DTYPES:
    raise TypeError(f"{name} must be bfloat16, float16, float32 or a QuantizedTensor, got {dt.name}")
  return x, None


def _native_output(in_dtype, out_dtype, fp8: bool) -> tuple[jnp.dtype, bool]:
  """The output dtype to run cuBLASLt with, and whether the bias can go in its epilogue.

  cuBLASLt (compute and scale type float32) takes 16-bit operands to their own type or to float32, float32 operands
  to float32, and FP8 operands to bfloat16, float16 or float32, the bias epilogue of the last only with a 16-bit
  bias. Any other output dtype comes from a float32 GEMM and one XLA cast, with the same numerics: the float32
  accumulator plus the bias, rounded once.
  """
  f32 = jnp.dtype(jnp.float32)
  if fp8:
    return out_dtype, out_dtype != f32
  return (out_dtype if out_dtype in (in_dtype, f32) else f32), True


def gemm(
    lhs: jax.Array | QuantizedTensor,
    rhs: jax.Array | QuantizedTensor,
    *,
    bias: jax.Array | None = None,
    residual: jax.Array | None = None,
    dtype=jnp.bfloat16,
    transpose_lhs: bool = False,
    transpose_rhs: bool = False,
    fast_accum: bool = False,
    rhs_parts: bool = False,
    scatter_rows: bool = False,
    keep_rows: bool = False,
    contract_dims: int = 1,
    out_sharding: P | NamedSharding | None = None,
    batched: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
  """``lhs @ rhs^T`` contracting the last dim of both (or the first, for transposed high-precision operands).

  >>> import jax.numpy as jnp, te_jax
  >>> te_jax.ops.gemm.gemm(jnp.ones((32, 16), jnp.bfloat16), jnp.ones((48, 16), jnp.bfloat16)).shape
  (32, 48)
  >>> from te_jax.ops.gemm import gemm
  >>> q, k, v = gemm(jnp.ones((32, 16), jnp.bfloat16), jnp.ones((3, 48, 16), jnp.bfloat16), rhs_parts=True)
  >>> v.shape
  (32, 48)

  Args:
    lhs: (..., K), or (K, ...) with ``transpose_lhs``: a ``QuantizedTensor`` (FP8 per tensor, or block-scaled: see
      ``te_jax.ops.gemm_block``), or a bfloat16, float16 or float32 array.
    rhs: (..., K), or (K, ...) with ``transpose_rhs``; the same kind (FP8 or not) as ``lhs``.
    bias: optional (N,) bias, cast to ``dtype``, fused into the GEMM epilogue.
    residual: optional, shaped as the output (or (M, N)), cast to ``dtype``, added in the epilogue: the output
      is ``lhs @ rhs^T + bias + residual`` rounded once.
    dtype: the output dtype: bfloat16, float16 or float32.
    transpose_lhs, transpose_rhs: the operand is stored with K first (not for FP8).
    fast_accum: FP8 fast accumulation (forward GEMMs); full-precision accumulation otherwise. Block-scaled operands
      run cuBLASLt's block-scaled kernels, which have no fast-accumulation variant (the heuristic answers
      NOT_SUPPORTED): they add each K block's partial sum, scaled by its blocks' scales, in float32, which is what
      full-precision accumulation means for per-tensor FP8; so ``fast_accum`` changes nothing there (the same
      kernel, the same bits) and only the emulated path's high-precision GEMM sees it (where it is a no-op too).
    rhs_parts: ``rhs`` is (P, ..., K) with 1 <= P <= MAX_PARTS, untransposed: returns the P products
      ``lhs @ rhs[p]^T`` as a tuple, from one batched cuBLASLt launch. ``bias`` is then (P, N), one row per part
      (cuBLASLt's batched GEMM has no bias epilogue, so with a bias each part is a GEMM of its own); no residual.
    scatter_rows: ``lhs`` is (B, S, K), untransposed, and the output's (B, S) keep their own sharding, the one its
      consumer asks for, not lhs's: with K sharded over the mesh axes that shard S there (a row-parallel GEMM whose
      output the caller constrains to a sequence-parallel residual stream), one reduce-scatter onto S. Only for an
      output its caller constrains: nothing else tells the partitioner how to shard the rows.
    keep_rows: lhs's non-contracting dims (untransposed) stay dims of their own, each sharded as lhs's is, the output's
      alike, instead of folding into M (whose sharding could not say "batch over one mesh axis, sequence over
      another": a context-parallel residual stream). With ``scatter_rows`` lhs's S keeps the output's S sharding
      without K's axes.
    contract_dims: how many trailing dims of both (untransposed) operands are contracted, each keeping its sharding
      (the (B, S) rows of a weight gradient's transposed operands (K, B, S) and (N, B, S)); K is their product.
    out_sharding: the output's sharding, a ``PartitionSpec`` of the mesh in context (or a ``NamedSharding``), as
      ``jax.lax.dot_general``'s ``out_sharding``: the GEMM lays its output out so (a K sharded over the axes that
      shard an output dim there ends in a reduce-scatter onto it instead of an all-reduce), and on a mesh with
      Explicit axes the output's type says it. Without it the output is typed with ``output_spec``'s sharding.
      Not with ``rhs_parts``.
    batched: ``lhs`` is (B, M, K) and ``rhs`` (B, N, K), both untransposed, per-tensor FP8 or both high precision:
      returns (B, M, N), ``out[b] = lhs[b] @ rhs[b]^T``, one strided batched cuBLASLt GEMM (one scale per operand for
      the whole batch). A sharded batch stays sharded, with no collective. With no other option but ``dtype`` and
      ``fast_accum``.

  Returns:
    ``(*lhs_rows, *rhs_rows)``: lhs's non-contracting dims, then rhs's; with ``rhs_parts``, a tuple of P arrays
    ``(*lhs_rows, *rhs.shape[1:-1])``.
  """
  if batched:
    given = {name: v for name, v in (("bias", bias), ("residual", residual), ("transpose_lhs", transpose_lhs),
                                     ("transpose_rhs", transpose_rhs), ("rhs_parts", rhs_parts),
                                     ("scatter_rows", scatter_rows), ("keep_rows", keep_rows),
                                     ("out_sharding", out_sharding)) if v is not None and v is not False}
    if contract_dims != 1:
      given["contract_dims"] = contract_dims
    if given:
      raise ValueError(f"gemm: batched=True takes no {', '.join(given)} (got {given}); only dtype and fast_accum")
    return _gemm_batched(lhs, rhs, dtype, fast_accum)
  opts = dict(bias=bias, residual=residual, dtype=dtype, transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
              fast_accum=fast_accum, rhs_parts=rhs_parts, scatter_rows=scatter_rows, keep_rows=keep_rows,
              contract_dims=contract_dims)
  if out_sharding is not None:
    if rhs_parts:
      raise ValueError("gemm: out_sharding and rhs_parts exclude each other (constrain each part instead)")
    if not isinstance(out_sharding, (P, NamedSharding)):
      raise TypeError(f"out_sharding must be a jax.sharding.PartitionSpec or NamedSharding, got "
                      f"{type(out_sharding).__name__}")
    opts["out_spec"] = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
  if is_block_scaled(lhs) or is_block_scaled(rhs):
    out = _gemm_block(lhs, rhs, **opts)
  else:
    lhs, lhs_scale_inv = _operand(lhs, "lhs")
    rhs, rhs_scale_inv = _operand(rhs, "rhs")
    out = _gemm_body(lhs, rhs, lhs_scale_inv, rhs_scale_inv, **opts)
  return out if out_sharding is None else constrain(out, out_sharding)


def _gemm_body(lhs, rhs, lhs_scale_inv, rhs_scale_inv, *, bias, residual, dtype, transpose_lhs, transpose_rhs,
               fast_accum, rhs_parts, scatter_rows, keep_rows, contract_dims,
               modes=(ScalingMode.PER_TENSOR, ScalingMode.PER_TENSOR), out_spec=None):
  """gemm's checks and its GEMM on (data, scale_inv) operands; block-scaled ones (``modes``) with their logical
  scales, on the native path only."""
  block = modes[0] is not ScalingMode.PER_TENSOR
  if scatter_rows and (rhs_parts or transpose_lhs or lhs.ndim != 3):
    raise ValueError(f"scatter_rows needs lhs (B, S, K), untransposed, and no rhs_parts; got lhs {lhs.shape}"
                     f"{' transposed' if transpose_lhs else ''}{' with rhs_parts' if rhs_parts else ''}")
  if not (isinstance(contract_dims, int) and contract_dims >= 1):
    raise ValueError(f"contract_dims must be a positive int, got {contract_dims!r}")
  if (keep_rows or contract_dims > 1) and (transpose_lhs or transpose_rhs):
    raise ValueError("keep_rows and contract_dims > 1 need untransposed operands")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if contract_dims > 1 and x.ndim < contract_dims + 1:
      raise ValueError(f"contract_dims={contract_dims} needs {name} of rank >= {contract_dims + 1}, got {x.shape}")
  if rhs_parts:
    if contract_dims != 1:
      raise ValueError("rhs_parts contracts one dim: contract_dims must be 1")
    return _gemm_parts(lhs, rhs, lhs_scale_inv, rhs_scale_inv, bias, residual, dtype, transpose_lhs,
                       transpose_rhs, fast_accum, keep_rows)
  lhs_fp8, rhs_fp8 = lhs_scale_inv is not None, rhs_scale_inv is not None
  if lhs_fp8 != rhs_fp8:
    raise TypeError(f"lhs and rhs must both be FP8 or both not, got {lhs.dtype} and {rhs.dtype}")
  out_dtype = jnp.dtype(dtype)
  if out_dtype not in HP_DTYPES:
    raise ValueError(f"dtype must be bfloat16, float16 or float32, got {out_dtype.name}")
  if lhs_fp8 and not block and jnp.dtype(lhs.dtype) == jnp.float8_e5m2 and jnp.dtype(rhs.dtype) == jnp.float8_e5m2:
    raise TypeError("E5M2 x E5M2 has no FP8 GEMM; one operand must be E4M3")
  if lhs_fp8 and (transpose_lhs or transpose_rhs):
    raise ValueError("FP8 operands must be K-major: pass the transposed FP8 copy instead of transpose_lhs/rhs")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.ndim < 2:
      raise ValueError(f"{name} must have rank >= 2, got shape {x.shape}")

  a = lhs if keep_rows else _fold(lhs, transpose_lhs, contract_dims)
  b = _fold(rhs, transpose_rhs, contract_dims)
  (m, k), (n, k_b) = _mk(a.shape, transpose_lhs, contract_dims), _mk(b.shape, transpose_rhs, contract_dims)
  if contract_dims > 1 and a.shape[-contract_dims:] != b.shape[-contract_dims:]:
    raise ValueError(f"contracting dims differ: lhs {lhs.shape} and rhs {rhs.shape} (contract_dims={contract_dims})")
  if k != k_b:
    raise ValueError(f"contracting dims differ: lhs {lhs.shape} has K={k}, rhs {rhs.shape} has K={k_b}")
  if lhs_fp8 and (k % FP8_ALIGN or n % FP8_ALIGN):
    raise ValueError(f"FP8 GEMM needs K and N to be multiples of {FP8_ALIGN}, got K={k}, N={n}")
  if bias is not None and bias.shape != (n,):
    raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
  lhs_rows = lhs.shape[1:] if transpose_lhs else lhs.shape[:lhs.ndim - contract_dims]
  rhs_rows = rhs.shape[1:] if transpose_rhs else rhs.shape[:rhs.ndim - contract_dims]
  assert math.prod(lhs_rows) == m and math.prod(rhs_rows) == n
  if residual is not None and tuple(residual.shape) not in ((*lhs_rows, *rhs_rows), (m, n)):
    raise ValueError(f"residual must have the output's shape {(*lhs_rows, *rhs_rows)} (or {(m, n)}), got "
                     f"{residual.shape}")
  out_rows = tuple(lhs_rows) if scatter_rows else None
  residual = None if residual is None else residual.reshape(*(out_rows or _split(a.shape, transpose_lhs,
                                                                                 contract_dims)[0]), n)
  gemm_dtype, fuse = _native_output(jnp.dtype(lhs.dtype), out_dtype, lhs_fp8)
  fuse = fuse and k > 0  # with K = 0 the handler only zeroes the output
  fuse_bias = fuse and bias is not None
  fuse_residual = k > 0 and gemm_dtype == out_dtype and residual is not None
  # A wanted output sharding types the GEMM's own output where that is the caller's: N one dim, the rows as lhs's.
  own = len(rhs_rows) == 1 and tuple(out_rows or _split(a.shape, transpose_lhs, contract_dims)[0]) == tuple(lhs_rows)
  config = GemmConfig(gemm_dtype, bool(transpose_lhs), bool(transpose_rhs), fuse_bias, bool(fast_accum),
                      fuse_residual, out_rows=out_rows, k_dims=contract_dims, lhs_mode=modes[0], rhs_mode=modes[1],
                      out_spec=P(*out_spec) if own and out_spec is not None else None,
                      deterministic=get_autocast_state().deterministic)
  if block:  # the logical scales folded as the data is, then in cuBLASLt's layout
    scales = []
    for x, folded, s, mode in ((lhs, a, lhs_scale_inv, modes[0]), (rhs, b, rhs_scale_inv, modes[1])):
      if mode.block[0] == 1:  # rows unblocked: they fold as the data's do
        s = s.reshape(*folded.shape[:folded.ndim - contract_dims], *s.shape[x.ndim - contract_dims:])
      scales.append(kernel_scales(s, mode, folded.shape, contract_dims))
  else:
    scales = _scales(lhs_fp8, lhs_scale_inv, rhs_scale_inv)
  operands = [a, b, *scales]
  if fuse_bias:  # the bias is rounded to out_dtype first in every path
    operands.append(bias.astype(out_dtype).astype(gemm_dtype))
  if fuse_residual:
    operands.append(residual.astype(out_dtype))
  (out,) = _GEMM.bind(*operands, config=config)
  unfused = [a for a, fused in ((bias, fuse_bias), (residual, fuse_residual)) if a is not None and not fused]
  if unfused:  # added in float32, in the epilogue's order, then cast once (each laid out as the output's dims)
    out = out.astype(jnp.float32)
    out_spec = full_spec(jax.typeof(out).sharding, out.ndim)
    for addend in unfused:
      addend = retype(addend.reshape(out.shape[out.ndim - addend.ndim:]), P(*out_spec[out.ndim - addend.ndim:]))
      out = out + addend.astype(out_dtype).astype(jnp.float32)
  return out.astype(out_dtype).reshape(*lhs_rows, *rhs_rows)


def _gemm_batched(lhs, rhs, dtype, fast_accum) -> jax.Array:
  """``gemm(..., batched=True)``: checks, then one strided batched GEMM."""
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if isinstance(x, QuantizedTensor) and x.mode is not ScalingMode.PER_TENSOR:
      raise ValueError(f"gemm: batched=True takes per-tensor scaled operands, got {name} scaled {x.mode.name}: "
                       "quantize it per tensor (te_jax.ops.quantize.quantize)")
  (lhs, lhs_scale_inv), (rhs, rhs_scale_inv) = _operand(lhs, "lhs"), _operand(rhs, "rhs")
  fp8 = lhs_scale_inv is not None
  if fp8 != (rhs_scale_inv is not None):
    raise TypeError(f"lhs and rhs must both be FP8 or both not, got {lhs.dtype} and {rhs.dtype}")
  out_dtype = jnp.dtype(dtype)
  if out_dtype not in HP_DTYPES:
    raise ValueError(f"dtype must be bfloat16, float16 or float32, got {out_dtype.name}")
  if fp8 and jnp.dtype(lhs.dtype) == jnp.float8_e5m2 and jnp.dtype(rhs.dtype) == jnp.float8_e5m2:
    raise TypeError("E5M2 x E5M2 has no FP8 GEMM; one operand must be E4M3")
  if lhs.ndim != 3 or rhs.ndim != 3 or lhs.shape[0] != rhs.shape[0] or lhs.shape[2] != rhs.shape[2]:
    raise ValueError(f"gemm: batched=True needs lhs (B, M, K) and rhs (B, N, K) of the same B and K, got lhs "
                     f"{lhs.shape} and rhs {rhs.shape}")
  k, n = lhs.shape[2], rhs.shape[1]
  if fp8 and (k % FP8_ALIGN or n % FP8_ALIGN):
    raise ValueError(f"FP8 GEMM needs K and N to be multiples of {FP8_ALIGN}, got K={k}, N={n}")
  gemm_dtype, _ = _native_output(jnp.dtype(lhs.dtype), out_dtype, fp8)
  config = GemmConfig(gemm_dtype, fast_accum=bool(fast_accum), deterministic=get_autocast_state().deterministic,
                      batched=True)
  (out,) = _GEMM.bind(lhs, rhs, *_scales(fp8, lhs_scale_inv, rhs_scale_inv), config=config)
  return out.astype(out_dtype)


def _fold(x, transposed, contract_dims: int = 1):
  """An operand with its non-contracting dims folded into one: (K, rows) transposed, else (rows, *K)."""
  if transposed:
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))
  lead = x.ndim - contract_dims
  return x.reshape(math.prod(x.shape[:lead]), *x.shape[lead:])


def _scales(fp8: bool, lhs_scale_inv, rhs_scale_inv):
  one = jnp.ones((), jnp.float32)
  return (lhs_scale_inv, rhs_scale_inv) if fp8 else (one, one)


def _as_operand(data: jax.Array, scale_inv: jax.Array | None):
  """``_operand``'s inverse: (data, scale_inv) as ``gemm`` takes it."""
  return data if scale_inv is None else QuantizedTensor(data, scale_inv)


def _gemm_parts(lhs, rhs, lhs_scale_inv, rhs_scale_inv, bias, residual, out_dtype, transpose_lhs, transpose_rhs,
                fast_accum, keep_rows) -> tuple[jax.Array, ...]:
  """``gemm(..., rhs_parts=True)``: checks, then one batched GEMM (or, with a bias, one GEMM per part)."""
  if transpose_rhs:
    raise ValueError("rhs_parts needs an untransposed rhs (P, ..., K)")
  if residual is not None:
    raise ValueError("rhs_parts and residual exclude each other")
  if rhs.ndim < 3 or not 1 <= rhs.shape[0] <= MAX_PARTS:
    raise ValueError(f"rhs_parts needs rhs of shape (P, ..., K) with 1 <= P <= {MAX_PARTS}, got {rhs.shape}")
  n_parts, part_rows = rhs.shape[0], rhs.shape[1:-1]
  n = math.prod(part_rows)
  if bias is not None and bias.shape != (n_parts, n):
    raise ValueError(f"with rhs_parts, bias must have shape ({n_parts}, {n}), got {bias.shape}")
  if bias is not None or n_parts == 1:
    return tuple(gemm(_as_operand(lhs, lhs_scale_inv), _as_operand(rhs[i], rhs_scale_inv),
                      bias=None if bias is None else bias[i], dtype=out_dtype, transpose_lhs=transpose_lhs,
                      fast_accum=fast_accum, keep_rows=keep_rows)
                 for i in range(n_parts))
  # The checks of one part's GEMM (dtypes, scales, shapes), traced only for its shape.
  part_out = jax.eval_shape(lambda a, b: gemm(a, b, dtype=out_dtype, transpose_lhs=transpose_lhs,
                                              fast_accum=fast_accum),
                            _as_operand(lhs, lhs_scale_inv), _as_operand(rhs[0], rhs_scale_inv))
  fp8 = jnp.dtype(lhs.dtype) in FP8_DTYPES
  a = lhs if keep_rows else _fold(lhs, transpose_lhs)
  m, k = _mk(a.shape, transpose_lhs)
  gemm_dtype, _ = _native_output(jnp.dtype(lhs.dtype), jnp.dtype(out_dtype), fp8)
  if k == 0:
    return tuple(jnp.zeros(part_out.shape, out_dtype) for _ in range(n_parts))
  config = GemmConfig(gemm_dtype, bool(transpose_lhs), False, False, bool(fast_accum), False, n_parts,
                      deterministic=get_autocast_state().deterministic)
  outs = _GEMM.bind(a, rhs.reshape(n_parts, n, k), *_scales(fp8, lhs_scale_inv, rhs_scale_inv), config=config)
  return tuple(o.astype(out_dtype).reshape(part_out.shape) for o in outs)


def _part(x: QuantizedTensor, i: int) -> QuantizedTensor:
  """Part ``i`` of a block-scaled (P, ..., K) operand, with its scales."""
  return QuantizedTensor(x.data[i], x.scale_inv[i], global_scale_inv=x.global_scale_inv, mode=x.mode)


def _gemm_block(lhs, rhs, out_spec=None, **opts) -> jax.Array | tuple[jax.Array, ...]:
  """``gemm`` of block-scaled operands: cuBLASLt where it has a kernel for them (``gemm_block.native_block_reason``)
  and the program is lowered for CUDA, else the emulation: both operands dequantized into bfloat16, then the
  high-precision GEMM with every option as given."""
  check_block_operands(lhs, rhs)
  if opts["transpose_lhs"] or opts["transpose_rhs"]:
    raise ValueError("FP8 operands must be K-major: pass the transposed FP8 copy instead of transpose_lhs/rhs")

  def emulated(a, b):
    return gemm(emulate(a), emulate(b), **opts, out_sharding=None if out_spec is None else P(*out_spec))

  if opts["rhs_parts"]:
    # The checks of rhs_parts, on the emulated operands; then one GEMM per part: cuBLASLt's pointer-array batched
    # GEMM takes per-tensor scales only.
    jax.eval_shape(emulated, lhs, rhs)
    bias = opts["bias"]
    part_opts = {**opts, "rhs_parts": False}
    return tuple(gemm(lhs, _part(rhs, i), **{**part_opts, "bias": None if bias is None else bias[i]})
                 for i in range(rhs.shape[0]))
  why = native_block_reason(lhs.mode, rhs.mode, lhs.shape, rhs.shape, (lhs.dtype, rhs.dtype), gpu_compute_capability(),
                            keep_rows=opts["keep_rows"], contract_dims=opts["contract_dims"])
  if not native.has_target("cuda", "te_gemm_cuda") or why is not None:
    return emulated(lhs, rhs)

  # cuBLASLt has no fast-accumulation block-scaled kernel (its heuristic answers NOT_SUPPORTED on the H100, cuBLAS
  # 13): its kernels add each K block's partial sum, scaled, in float32 whatever fast_accum says.
  native_opts = {**opts, "fast_accum": False, "out_spec": out_spec}

  def native_gemm(a, b):
    if a.mode is not ScalingMode.NVFP4_1X16:
      return _gemm_body(a.data, b.data, a.scale_inv, b.scale_inv, modes=(a.mode, b.mode), **native_opts)
    # NVFP4: the two global scales multiply the float32 product, then the epilogue's additions, one cast.
    out = _gemm_body(a.data, b.data, a.scale_inv, b.scale_inv, modes=(a.mode, b.mode),
                     **{**native_opts, "bias": None, "residual": None, "dtype": jnp.float32})
    out = out * (a.global_scale_inv * b.global_scale_inv)
    out_dtype = jnp.dtype(opts["dtype"])
    for addend in (opts["bias"], opts["residual"]):
      if addend is not None:
        out = out + addend.astype(out_dtype).astype(jnp.float32).reshape(
            out.shape if addend.ndim > 1 else addend.shape)
    return out.astype(out_dtype)

  return jax.lax.platform_dependent(lhs, rhs, cuda=native_gemm, default=emulated)
