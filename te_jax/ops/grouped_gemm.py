"""Grouped (ragged) GEMMs of mixture-of-experts layers: one matrix per group of rows, the groups given by their sizes.

The rows of the token operand are sorted by group: group ``g`` holds rows ``[offset_g, offset_g + group_sizes[g])``,
``offset_g`` the sum of the sizes before it, and rows past ``sum(group_sizes)`` belong to no group. The group sizes
are an int32 array, a traced value like any other: nothing here reads them on the host, so a jitted step that routes
tokens (and a CUDA graph of it) is compiled once for every routing. Two forms, both K-major like
``te_jax.ops.gemm.gemm`` (``out = lhs @ rhs^T``, the contracting dim last in both operands):

- ``grouped_gemm(lhs, rhs, group_sizes)``: lhs (M, K), rhs (G, N, K): ``out[m] = lhs[m] @ rhs[g(m)]^T``, (M, N), the
  rows past the groups zeros. A layer's forward GEMM (rhs the transposed kernels (G, N, K)) and its input gradient
  (lhs the output gradient (M, N), rhs the kernels (G, K, N)).
- ``grouped_gemm(lhs, rhs, group_sizes, ragged_contracting=True)``: lhs (K, M), rhs (N, M), both contracted over the
  ragged M: ``out[g] = lhs[:, rows_g] @ rhs[:, rows_g]^T``, (G, K, N), an empty group's matrix zeros. A layer's
  weight gradient (lhs its transposed input, rhs its transposed output gradient).

Sizes that no grouping has (a negative size, or a sum past M) cannot raise under ``jax.jit``, where they are traced:
they make the whole output NaN, so that the loss shows them; concrete sizes are checked here and raise.

Operands are both high-precision (float32, bfloat16, float16) or both ``QuantizedTensor`` values:

- per-tensor scaled (``ScalingMode.PER_TENSOR``, E4M3 / E5M2 data) with one scale per group: ``scale_inv`` is (G,)
  (or a scalar, the same for every group). Scale ``g`` dequantizes group ``g``'s rows of a row-grouped operand
  (lhs of the first form, both operands of the second) and matrix ``g`` of rhs (G, ...). ``quantize_by_group`` casts a
  row-grouped tensor so; the kernels are cast per group by ``vmap`` of the per-tensor quantize.
- block-scaled (the modes of ``te_jax.ops.gemm_block``, scales in the logical layout ``mode.scale_shape``): rhs
  (G, N, K) holds a block grid per matrix (NVFP4's ``global_scale_inv`` a scalar or (G,), one per matrix). The
  blocks run along each operand's last dim: in the second form that is the ragged M, where a block straddling two
  groups would mix their values under one scale; the caller lays the groups out on whole blocks
  (``te_jax.grouped_dense`` pads each group to them).

CUDA handler (``te_grouped_gemm_cuda``, ffi/cuda/grouped_gemm.cu), where the caller promises a ``tile`` that every
group's size is a multiple of: high-precision and per-tensor FP8 operands as cuBLASLt GEMMs of tiles of rows, their
pointers written on the device from the sizes. Rows grouped, one pointer-array launch of every tile; FP8 products
come out unscaled and ``grouped_gemm`` multiplies each row by its group's scales (cuBLASLt has no per-batch scale
there). Contracting, one launch per tile accumulating into its group's float32 matrix, which reads and writes that
matrix once per tile: slow for small tiles, the form a grouped kernel with its sums on chip would serve. Sizes that
break the promise give NaN, as invalid ones do. Block-scaled operands and calls without a tile lower to the
reference.

Reference (the CPU path, the oracle, and the lowering of what the CUDA handler does not take): each
operand dequantized as ``gemm_ref`` does (per-tensor FP8 into float32, by its group's ``scale_inv``; block-scaled
into bfloat16, ``te_jax.ops.gemm_block.emulate``, per matrix for rhs), then per group one float32 ``dot_general``
(``Precision.HIGHEST``) over the whole operand, of which the group's rows are kept (first form) or the other rows
zeroed in both operands (second form). So each output element is its own group's dot product and nothing else: an
inf or NaN in one group's rows or matrix reaches no other group's outputs, where ``jax.lax.ragged_dot``'s masked
formulation (zeros of the other groups times their matrices) would spread it to every row. The cost is G dense
GEMMs, as ``ragged_dot``'s on a CPU.

Sharding: the rows of the first form stay sharded (the output's rows alike, each shard computing its rows' groups,
no collective); its rhs's N may be sharded too (high-precision and per-tensor operands), the output's columns
alike. The second form's M may be sharded (per-shard partial products, one psum), and its K and N (lhs's and rhs's
rows) shard the output's. Everything else (the groups, K of the first form, block-scaled dims) is replicated.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.dtypes import FP8_DTYPES, HP_DTYPES
from te_jax._core import native
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode, scale_inv
from te_jax.ops.gemm_block import check_block_operands, emulate, is_block_scaled
from te_jax.ops.quantize import saturating_cast

# Rows per tile of the CUDA handler in te_jax's layouts: enough rows per tile for one pointer-array launch to fill
# the GPU, few enough that padding each group to a multiple costs little (benchmarks/DECISIONS.md).
NATIVE_TILE = 512

__all__ = ["GROUPED_GEMM_ENV", "NATIVE_TILE", "GroupedGemmConfig", "check_group_sizes", "group_amax", "group_ids",
           "grouped_gemm", "grouped_gemm_ref", "native_tile", "quantize_by_group"]


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
  """Static parameters of one grouped GEMM.

  Attributes:
    out_dtype: the output dtype: bfloat16, float16 or float32.
    ragged_contracting: the second form (lhs (K, M), rhs (N, M), out (G, K, N)); else the first (lhs (M, K), rhs
      (G, N, K), out (M, N)).
    lhs_mode, rhs_mode: each operand's ``ScalingMode``; None for a high-precision operand (both or neither).
    fast_accum: FP8 fast accumulation in the CUDA handler (the reference accumulates in float32 either way).
    tile: every group's size is a multiple of it (the caller's promise; 0: none): the CUDA handler runs tiles of
      this many rows (``grouped_gemm(..., tile=)``); without one the op lowers to the reference everywhere.
    unscaled: per-tensor FP8 operands are read without their ``scale_inv`` (the sum of the FP8 products), which the
      caller applies (``grouped_gemm`` does, per row).
  """

  out_dtype: np.dtype
  ragged_contracting: bool = False
  lhs_mode: ScalingMode | None = None
  rhs_mode: ScalingMode | None = None
  fast_accum: bool = False
  tile: int = 0
  unscaled: bool = False

  @property
  def nvfp4(self) -> bool:
    return self.lhs_mode is ScalingMode.NVFP4_1X16


# ---- reference ---------------------------------------------------------------------------------------------------


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
  """The group of each of ``rows`` rows (int32): ``g`` for group ``g``'s rows, ``G`` for the rows past the groups."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def _valid(group_sizes: jax.Array, rows: int) -> jax.Array:
  """Whether ``group_sizes`` group ``rows`` rows: every size >= 0, their sum <= rows."""
  return jnp.all(group_sizes >= 0) & (jnp.sum(group_sizes) <= rows)


def group_amax(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """``max|x|`` in float32 over each group's rows of ``x`` (rows first), (G,): 0 for an empty group, NaN for one
  holding a NaN; over bit patterns, as ``te_jax.ops.quantize.amax_f32`` (subnormals count)."""
  xf = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(xf, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  row = jnp.max(bits.reshape(bits.shape[0], -1), axis=1, initial=jnp.uint32(0))
  ids = group_ids(group_sizes, x.shape[0])
  # An empty group's max is the identity of an unsigned max, 0: the bits of +0.0.
  per_group = jax.ops.segment_max(row, ids, num_segments=group_sizes.shape[0], indices_are_sorted=True)
  return jax.lax.bitcast_convert_type(per_group, jnp.float32)


def _row_scales(scales: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
  """Each row's float32 entry of the per-group ``scales`` (G,); 1 for the rows past the groups (which no group
  reads)."""
  padded = jnp.concatenate([scales.astype(jnp.float32), jnp.ones((1,), jnp.float32)])
  return padded[group_ids(group_sizes, rows)]


def quantize_by_group(x: jax.Array, scale: jax.Array, group_sizes: jax.Array, dtype, *,
                      transpose: bool = False) -> QuantizedTensor:
  """``x`` (M, ...) rows sorted by group, each group's rows cast to FP8 with its own float32 ``scale`` (G,): the
  saturating cast of ``te_jax.ops.quantize`` (``saturating_cast``), row by row; the rows past the groups with scale
  1. Returns the per-tensor ``QuantizedTensor`` with per-group ``scale_inv`` (G,) and, with ``transpose``, the
  transposed copy of a 2-D x (the same bytes, (cols, M), what the second form of ``grouped_gemm`` contracts)."""
  if x.ndim != 2 and transpose:
    raise ValueError(f"quantize_by_group's transpose needs a 2-D x, got shape {x.shape}")
  xf = x.astype(jnp.float32)
  s = _row_scales(scale, group_sizes, x.shape[0]).reshape(-1, *(1,) * (x.ndim - 1))
  data = saturating_cast(xf, s, dtype)
  inv = scale_inv(scale)
  return QuantizedTensor(data, inv, data.T if transpose else None, inv if transpose else None)


def _dequantized(x, s, g, mode: ScalingMode | None, group_sizes, row_axis: int | None) -> jax.Array:
  """One operand as the GEMM reads it: per-tensor FP8 in float32 times its group's ``scale_inv`` (by the group of
  each index along ``row_axis``; None: matrix g of a (G, ...) operand); block-scaled in bfloat16 (``emulate``, per
  matrix with a (G,) NVFP4 global scale); high precision as it is."""
  if mode is None:
    return x
  if mode is ScalingMode.PER_TENSOR:
    xf = x.astype(jnp.float32)
    if row_axis is None:
      return xf * s.reshape(-1, *(1,) * (x.ndim - 1))
    rs = _row_scales(s, group_sizes, x.shape[row_axis])
    return xf * (rs[:, None] if row_axis == 0 else rs[None, :])
  q = QuantizedTensor(x, s, global_scale_inv=g, mode=mode)
  if g is not None and jnp.ndim(g) == 1:
    return jax.vmap(emulate)(q)
  return emulate(q)


def _dot(a, b) -> jax.Array:
  """a (R, K) . b (C, K)^T in float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


def grouped_gemm_ref(lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv, *global_scale_inv,
                     config: GroupedGemmConfig) -> list[jax.Array]:
  """The pure-jnp definition (see the module docstring): the operands as ``grouped_gemm`` binds them (data, the
  group sizes, scales, and NVFP4's two global scales last); returns ``[out]``."""
  g_lhs, g_rhs = global_scale_inv if config.nvfp4 else (None, None)
  if config.unscaled:
    lhs_scale_inv, rhs_scale_inv = jnp.ones_like(lhs_scale_inv), jnp.ones_like(rhs_scale_inv)
  n_groups = group_sizes.shape[0]
  groups = jnp.arange(n_groups, dtype=jnp.int32)
  if config.ragged_contracting:  # (K, M) and (N, M) -> (G, K, N)
    rows = lhs.shape[1]
    a = _dequantized(lhs, lhs_scale_inv, g_lhs, config.lhs_mode, group_sizes, 1)
    b = _dequantized(rhs, rhs_scale_inv, g_rhs, config.rhs_mode, group_sizes, 1)
    ids = group_ids(group_sizes, rows)

    def one(g):
      keep = (ids == g)[None, :]
      return _dot(jnp.where(keep, a, jnp.zeros((), a.dtype)), jnp.where(keep, b, jnp.zeros((), b.dtype)))

    out = jax.lax.map(one, groups)
  else:  # (M, K) and (G, N, K) -> (M, N)
    rows = lhs.shape[0]
    a = _dequantized(lhs, lhs_scale_inv, g_lhs, config.lhs_mode, group_sizes, 0)
    b = _dequantized(rhs, rhs_scale_inv, g_rhs, config.rhs_mode, group_sizes, None)
    ids = group_ids(group_sizes, rows)

    def step(out, gb):
      g, bg = gb
      return jnp.where((ids == g)[:, None], _dot(a, bg), out), None

    init = jnp.zeros_like(a, shape=(rows, rhs.shape[1]), dtype=jnp.float32)  # inside shard_map: varying as a is
    out, _ = jax.lax.scan(step, init, (groups, b))
  out = jnp.where(_valid(group_sizes, rows), out, jnp.float32(jnp.nan))
  return [out.astype(config.out_dtype)]


# ---- primitive ---------------------------------------------------------------------------------------------------


def _abstract_eval(lhs, rhs, group_sizes, *scales, config: GroupedGemmConfig):
  del scales
  if config.ragged_contracting:
    shape = (group_sizes.shape[0], lhs.shape[0], rhs.shape[0])
  else:
    shape = (lhs.shape[0], rhs.shape[1])
  return [output_aval(lhs, shape, config.out_dtype)]


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _shards(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _local_sizes(group_sizes: jax.Array, rows: int, axes: tuple[str, ...], local_rows: int) -> jax.Array:
  """The group sizes of this shard's ``local_rows`` rows of ``rows``, sharded over mesh ``axes``: each group's rows
  that fall in the shard; all -1 (invalid: a NaN output, as unsharded) where the global sizes are invalid."""
  start = jax.lax.axis_index(axes) * local_rows
  ends = jnp.cumsum(group_sizes)
  begins = ends - group_sizes
  local = jnp.clip(ends - start, 0, local_rows) - jnp.clip(begins - start, 0, local_rows)
  return jnp.where(_valid(group_sizes, rows), local, -1).astype(jnp.int32)


def _partition(config: GroupedGemmConfig, mesh, arg_shapes, result_shape):
  """First form: lhs's rows stay sharded (each shard's group sizes computed from the global ones and its index),
  rhs's N too unless it is block-scaled; no collective. Second form: M stays sharded unless an operand is
  block-scaled (its blocks run along M), each shard's partial products psum-reduced; lhs's and rhs's rows shard the
  output's K and N. Everything else replicated."""
  del result_shape
  lhs_shape = arg_shapes[0].shape
  lhs_spec = full_spec(arg_shapes[0].sharding, 2)
  rhs_spec = full_spec(arg_shapes[1].sharding, len(arg_shapes[1].shape))
  block = config.lhs_mode not in (None, ScalingMode.PER_TENSOR)
  rep = NamedSharding(mesh, P())
  if config.ragged_contracting:
    rows = lhs_shape[1]
    m_axes = () if block else mesh_axes(lhs_spec[1])
    if rows % _shards(mesh, m_axes):
      m_axes = ()
    k_axes = tuple(a for a in mesh_axes(lhs_spec[0]) if a not in m_axes)
    n_axes = tuple(a for a in mesh_axes(rhs_spec[0]) if a not in m_axes + k_axes)
    m, k, n = _entry(m_axes), _entry(k_axes), _entry(n_axes)
    data = [NamedSharding(mesh, P(k, m)), NamedSharding(mesh, P(n, m))]
    scales = [NamedSharding(mesh, P(k, None)) if block else rep, NamedSharding(mesh, P(n, None)) if block else rep]
    out = NamedSharding(mesh, P(None, k, n))
  else:
    rows = lhs_shape[0]
    m_axes = mesh_axes(lhs_spec[0])
    if rows % _shards(mesh, m_axes):
      m_axes = ()
    n_axes = () if block else tuple(a for a in mesh_axes(rhs_spec[1]) if a not in m_axes)
    m, n = _entry(m_axes), _entry(n_axes)
    data = [NamedSharding(mesh, P(m, None)), NamedSharding(mesh, P(None, n, None))]
    scales = [NamedSharding(mesh, P(m, None)) if block else rep, rep]
    out = NamedSharding(mesh, P(m, n))
  local_rows = rows // _shards(mesh, m_axes)
  arg_shardings = (*data, rep, *scales, *(rep,) * (len(arg_shapes) - 5))
  # Each shard's groups are multiples of the tile where its rows are (they start at a multiple of it).
  local = config if not config.tile or local_rows % config.tile == 0 else dataclasses.replace(config, tile=0)

  def lower_fn(lhs, rhs, group_sizes, *rest):
    sizes = _local_sizes(group_sizes, rows, m_axes, local_rows) if m_axes else group_sizes
    (y,) = _GROUPED_GEMM.inner.bind(lhs, rhs, sizes, *rest, config=local)
    if config.ragged_contracting and m_axes:
      y = jax.lax.psum(y, m_axes)
    return (y,)

  return mesh, lower_fn, (out,), arg_shardings


def _scale_factors(shape, mode: ScalingMode | None, rows: str, prefix: str, per_matrix: bool) -> str:
  """The factors of an operand's scales: none for a scalar; ``g`` for per-group ones; a row-grouped block-scaled
  operand's scales share its rows' factor (the first dim), the rest are factors of their own."""
  if not shape:
    return ""
  if mode is ScalingMode.PER_TENSOR:
    return "g"
  if per_matrix:
    return " ".join(["g", *(f"{prefix}{i}" for i in range(1, len(shape)))])
  return " ".join([rows, *(f"{prefix}{i}" for i in range(1, len(shape)))])


def _sharding_rule(config: GroupedGemmConfig, mesh, value_types, result_types):
  """First form ``m k, g n k, g, ... -> m n``; second ``k m, n m, g, ... -> g k n`` with m a reduction factor;
  the group factor, the first form's k and the block scales' own dims replicated (and n, or m in the second form,
  where an operand is block-scaled)."""
  del mesh, result_types
  block = config.lhs_mode not in (None, ScalingMode.PER_TENSOR)
  shapes = [tuple(v.shape) for v in value_types]
  if config.ragged_contracting:
    lhs, rhs, out = "k m", "n m", "g k n"
    scales = [_scale_factors(shapes[3], config.lhs_mode, "k", "ls", False),
              _scale_factors(shapes[4], config.rhs_mode, "n", "rs", False)]
    replicated = ["g"] + (["m"] if block else [])
    extra = {} if block else {"reduction_factors": ("m",)}
  else:
    lhs, rhs, out = "m k", "g n k", "m n"
    scales = [_scale_factors(shapes[3], config.lhs_mode, "m", "ls", False),
              _scale_factors(shapes[4], config.rhs_mode, "n", "rs", True)]
    replicated = ["g", "k"] + (["n"] if block else [])
    extra = {}
  globals_ = [_scale_factors(s, ScalingMode.PER_TENSOR, "", "", True) for s in shapes[5:]]
  operands = [lhs, rhs, "g", *scales, *globals_]
  order = list(dict.fromkeys(f for o in (*operands, out) for f in o.split()))  # Shardy numbers them so
  own = [f for f in order if f[:2] in ("ls", "rs")]
  replicated = sorted(set(replicated + own) & set(order), key=order.index)
  return ", ".join(operands) + " -> " + out, {"need_replication_factors": tuple(replicated), **extra}


def _native_signature(platform: str, config: GroupedGemmConfig, avals_in, avals_out) -> NativeSignature | None:
  """The CUDA handler's signature (a workspace before the output), or None (the reference) for what it does not
  run: no tile, block-scaled operands, scaled FP8 rows-grouped products (it has no per-group scale there), a
  contracting form not in float32."""
  lhs, rhs = avals_in[:2]
  fp8 = config.lhs_mode is ScalingMode.PER_TENSOR
  if (config.tile == 0 or config.lhs_mode not in (None, ScalingMode.PER_TENSOR)
      or (fp8 and not config.ragged_contracting and not config.unscaled)
      or (config.ragged_contracting and jnp.dtype(config.out_dtype) != jnp.float32)):
    return None
  out = avals_out[0]
  if config.ragged_contracting:
    rows, k, n = lhs.shape[1], lhs.shape[0], rhs.shape[0]
  else:
    rows, k, n = lhs.shape[0], lhs.shape[1], rhs.shape[1]
  if rows % config.tile:
    return None
  workspace = native.workspace(platform, "grouped_gemm", bool(config.ragged_contracting), rows, k, n, config.tile,
                               jnp.dtype(out.dtype).itemsize)
  return NativeSignature(extra_operands=(), result_avals=(workspace, jax.core.ShapedArray(out.shape, out.dtype)),
                         keep=(1,))


def _attributes(config: GroupedGemmConfig) -> dict:
  return {"ragged_contracting": np.bool_(config.ragged_contracting), "tile": np.int64(config.tile),
          "fast_accum": np.bool_(config.fast_accum)}


_GROUPED_GEMM = define_op(
    "grouped_gemm",
    abstract_eval=_abstract_eval,
    reference=grouped_gemm_ref,
    # te_grouped_gemm_cuda (ffi/cuda/grouped_gemm.cu) where _native_signature takes the config, else the reference.
    native_platforms=("cuda",),
    ffi_attributes=_attributes,
    native_signature=_native_signature,
    partition=_partition,
    sharding_rule=_sharding_rule,
)


# ---- public API --------------------------------------------------------------------------------------------------


def check_group_sizes(group_sizes, rows: int) -> jax.Array:
  """``group_sizes`` as the int32 (G,) array the op takes; raises unless it is a 1-D integer array of at least one
  group whose values, where they are concrete (not traced), are >= 0 and sum to at most ``rows``."""
  if not hasattr(group_sizes, "dtype") or not hasattr(group_sizes, "shape"):
    group_sizes = jnp.asarray(group_sizes)
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or jnp.ndim(group_sizes) != 1:
    raise TypeError(f"group_sizes must be a 1-D int32 array (G,), got {jnp.dtype(group_sizes.dtype).name}"
                    f"{list(jnp.shape(group_sizes))}")
  if group_sizes.shape[0] < 1:
    raise ValueError("group_sizes must have at least one group, got shape (0,)")
  if not isinstance(group_sizes, jax.core.Tracer):  # concrete: checked here; traced: a NaN output
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any() or sizes.sum() > rows:
      raise ValueError(f"group_sizes must be >= 0 and sum to at most the {rows} grouped rows, got "
                       f"{sizes.tolist()} (sum {sizes.sum()}); the rows past the sum belong to no group")
  return group_sizes.astype(jnp.int32)


def _per_group_scale(x: QuantizedTensor, name: str, groups: int) -> jax.Array:
  s = x.scale_inv
  if not hasattr(s, "dtype") or jnp.dtype(s.dtype) != jnp.float32 or jnp.shape(s) not in ((), (groups,)):
    raise TypeError(f"{name}.scale_inv must be float32 of shape () or ({groups},) (one per group), got "
                    f"{getattr(s, 'dtype', type(s).__name__)}{list(jnp.shape(s))}")
  return jnp.broadcast_to(s, (groups,))


def _kind(x, name: str) -> str:
  """"hp", "fp8" (per-tensor) or "block"; raises for anything else."""
  if isinstance(x, QuantizedTensor):
    if is_block_scaled(x):
      return "block"
    if x.dtype not in FP8_DTYPES:
      raise TypeError(f"{name} must hold float8_e4m3fn or float8_e5m2 data, got {x.dtype.name}")
    return "fp8"
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    raise TypeError(f"{name} must be a jax array or a te_jax QuantizedTensor, got {type(x).__name__}")
  dt = jnp.dtype(x.dtype)
  if dt in FP8_DTYPES:
    raise TypeError(f"{name} is a bare {dt.name} array: pass it as a te_jax QuantizedTensor with its scale_inv")
  if dt not in HP_DTYPES:
    raise TypeError(f"{name} must be bfloat16, float16, float32 or a QuantizedTensor, got {dt.name}")
  return "hp"


def _block_operands(lhs: QuantizedTensor, rhs: QuantizedTensor, groups: int, ragged_contracting: bool):
  """The checks of two block-scaled operands (``gemm_block.check_block_operands``: modes, dtypes, scale shapes),
  with rhs's NVFP4 global scale per matrix allowed; returns the global scales to bind (none but for NVFP4)."""
  g = rhs.global_scale_inv
  per_matrix = (not ragged_contracting and g is not None and jnp.shape(g) == (groups,)
                and jnp.dtype(g.dtype) == jnp.float32)
  check_block_operands(lhs, dataclasses.replace(rhs, global_scale_inv=g[0]) if per_matrix else rhs)
  return (lhs.global_scale_inv, g) if lhs.mode is ScalingMode.NVFP4_1X16 else ()


def grouped_gemm(lhs: jax.Array | QuantizedTensor, rhs: jax.Array | QuantizedTensor, group_sizes: jax.Array, *,
                 dtype=jnp.bfloat16, ragged_contracting: bool = False, fast_accum: bool = False,
                 tile: int | None = None) -> jax.Array:
  """The grouped GEMM of ``lhs`` and ``rhs`` over the groups ``group_sizes`` gives (see the module docstring).

  >>> import jax.numpy as jnp, te_jax
  >>> from te_jax.ops.grouped_gemm import grouped_gemm
  >>> lhs = jnp.ones((5, 16), jnp.bfloat16)
  >>> rhs = jnp.stack([jnp.ones((8, 16)), 2 * jnp.ones((8, 16))]).astype(jnp.bfloat16)  # (G, N, K)
  >>> grouped_gemm(lhs, rhs, jnp.array([1, 3], jnp.int32), dtype=jnp.float32)[:, 0].tolist()
  [16.0, 32.0, 32.0, 32.0, 0.0]
  >>> grouped_gemm(lhs.T, lhs.T, jnp.array([1, 3], jnp.int32), ragged_contracting=True).shape
  (2, 16, 16)

  Args:
    lhs: (M, K), rows sorted by group; with ``ragged_contracting`` (K, M). A high-precision array or a
      ``QuantizedTensor`` (per-tensor with scales () or (G,), or block-scaled).
    rhs: (G, N, K), one matrix per group; with ``ragged_contracting`` (N, M). The same kind as ``lhs``.
    group_sizes: (G,) integers (int32 in the op), >= 0, summing to at most M; may be traced (nothing reads them on
      the host; invalid traced sizes make the output NaN).
    dtype: the output dtype: bfloat16, float16 or float32.
    ragged_contracting: the weight-gradient form: contract lhs (K, M) with rhs (N, M) over each group's rows.
    fast_accum: FP8 fast accumulation where a kernel has it (the reference accumulates in float32 either way).
    tile: the caller's promise that every group's size is a multiple of ``tile`` (a multiple of 16 dividing M), so
      that the CUDA handler can run (tiles of this many rows, high-precision or per-tensor FP8 operands); None: the
      reference on every platform. Concrete sizes that break it raise; traced ones make the output NaN on the GPU.
      Rows grouped, the FP8 products are then scaled per row after the GEMM (``native_tile`` says which tile the
      handler is fast with).

  Returns:
    (M, N), the rows past the groups zeros; with ``ragged_contracting`` (G, K, N), an empty group's zeros.
  """
  kinds = (_kind(lhs, "lhs"), _kind(rhs, "rhs"))
  if kinds[0] != kinds[1]:
    raise TypeError(f"lhs and rhs must be of one kind (both high precision, both per-tensor FP8 or both "
                    f"block-scaled), got {kinds[0]} and {kinds[1]}")
  out_dtype = jnp.dtype(dtype)
  if out_dtype not in HP_DTYPES:
    raise ValueError(f"dtype must be bfloat16, float16 or float32, got {out_dtype.name}")
  lhs_shape, rhs_shape = tuple(lhs.shape), tuple(rhs.shape)
  if ragged_contracting:
    if len(lhs_shape) != 2 or len(rhs_shape) != 2 or lhs_shape[1] != rhs_shape[1]:
      raise ValueError(f"ragged_contracting needs lhs (K, M) and rhs (N, M) of one M, got lhs {lhs_shape} and rhs "
                       f"{rhs_shape}")
    rows = lhs_shape[1]
  else:
    if len(lhs_shape) != 2 or len(rhs_shape) != 3 or lhs_shape[1] != rhs_shape[2]:
      raise ValueError(f"grouped_gemm needs lhs (M, K) and rhs (G, N, K) of one K, got lhs {lhs_shape} and rhs "
                       f"{rhs_shape}")
    rows = lhs_shape[0]
  group_sizes = check_group_sizes(group_sizes, rows)
  groups = group_sizes.shape[0]
  if not ragged_contracting and rhs_shape[0] != groups:
    raise ValueError(f"rhs has {rhs_shape[0]} matrices but group_sizes {groups} groups")
  tile = _check_tile(tile, rows, group_sizes, kinds[0])
  # The handler's contracting form writes float32: the cast to dtype follows.
  bind_dtype = jnp.dtype(jnp.float32) if tile and ragged_contracting else out_dtype
  if kinds[0] == "hp":
    config = GroupedGemmConfig(bind_dtype, bool(ragged_contracting), fast_accum=bool(fast_accum), tile=tile)
    one = jnp.ones((), jnp.float32)
    return _GROUPED_GEMM.bind(lhs, rhs, group_sizes, one, one, config=config)[0].astype(out_dtype)
  if kinds[0] == "fp8":
    if lhs.dtype == rhs.dtype == jnp.dtype(jnp.float8_e5m2):
      raise TypeError("E5M2 x E5M2 has no FP8 GEMM; one operand must be E4M3")
    scales = (_per_group_scale(lhs, "lhs", groups), _per_group_scale(rhs, "rhs", groups))
    extra = ()
  else:
    extra = _block_operands(lhs, rhs, groups, bool(ragged_contracting))
    scales = (lhs.scale_inv, rhs.scale_inv)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if x.data_t is not None:
      raise ValueError(f"{name} carries a transposed copy; pass the operand this GEMM reads (x.without_transposed() "
                       "or x.transposed())")
  unscaled = bool(tile) and kinds[0] == "fp8" and not ragged_contracting
  config = GroupedGemmConfig(jnp.dtype(jnp.float32) if unscaled else bind_dtype, bool(ragged_contracting), lhs.mode,
                             rhs.mode, bool(fast_accum), tile, unscaled)
  out = _GROUPED_GEMM.bind(lhs.data, rhs.data, group_sizes, *scales, *extra, config=config)[0]
  if unscaled:  # each row times its group's two reciprocal scales (rows past the groups are zeros)
    ids = jnp.minimum(group_ids(group_sizes, rows), groups - 1)
    out = out * (scales[0] * scales[1])[ids][:, None]
  return out.astype(out_dtype)


def _check_tile(tile, rows: int, group_sizes: jax.Array, kind: str) -> int:
  """``grouped_gemm``'s ``tile`` as the config's int (0: none), checked."""
  if tile is None or kind == "block":
    return 0
  if not isinstance(tile, int) or isinstance(tile, bool) or tile < 16 or tile % 16 or rows % tile:
    raise ValueError(f"tile must be a multiple of 16 dividing the {rows} grouped rows, got {tile!r}")
  if not isinstance(group_sizes, jax.core.Tracer) and (np.asarray(group_sizes) % tile).any():
    raise ValueError(f"tile={tile}: every group size must be a multiple of it, got {np.asarray(group_sizes).tolist()}")
  return tile


# The CUDA handler is opt-in until its GPU tests (tests/test_grouped_gemm_tiles.py) and benchmark have run on a GPU:
# TE_JAX_GROUPED_GEMM=cuda selects it for te_jax's grouped layouts.
GROUPED_GEMM_ENV = "TE_JAX_GROUPED_GEMM"


def native_tile() -> int:
  """The tile (rows) te_jax's grouped layouts use on this machine: ``NATIVE_TILE`` where the CUDA handler runs (JAX's
  default backend a GPU, te_jax's CUDA module loaded, ``TE_JAX_GROUPED_GEMM=cuda``), else 0 (the reference, which
  needs none)."""
  choice = os.environ.get(GROUPED_GEMM_ENV, "").strip().lower()
  if choice not in ("", "cuda", "reference"):
    raise ValueError(f"{GROUPED_GEMM_ENV}={os.environ[GROUPED_GEMM_ENV]!r}: set it to 'cuda' (te_jax's CUDA grouped "
                     "GEMM) or 'reference' (the default: per-expert GEMMs through XLA)")
  if choice != "cuda" or jax.default_backend() != "gpu" or not native.has_target("cuda", "te_grouped_gemm_cuda"):
    return 0
  return NATIVE_TILE
