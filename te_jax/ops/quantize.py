"""FP8 quantization: saturating cast of ``x * scale`` to E4M3/E5M2, with amax, transposed copy and dbias fused.

One pass over ``x`` gives everything an FP8 GEMM and its backward pass need from a high-precision tensor:

- ``data``: ``x * scale`` cast to FP8, saturating (finite values beyond the format's range clamp to +-max; a
  non-finite ``x``, +-inf or NaN, gives NaN);
- ``amax``: ``max|x|`` of the high-precision input, for the next scale;
- ``data_t`` (optional): the same FP8 bytes, transposed. Hopper's FP8 GEMMs need both operands K-major, so the
  dgrad/wgrad GEMMs read this copy instead of an XLA transpose;
- ``dbias`` (optional): the column sums of ``x`` (over every dim but the last) in float32, the bias gradient when
  ``x`` is an output gradient.

Non-finite values stay visible: an inf or NaN in ``x`` gives a NaN in ``data`` at that position (which NaN bit pattern
is not specified: the reference and the CPU handler write the format's positive NaN, 0x7F for E4M3) and an inf or NaN
``amax``; the scaling math then keeps the previous scale (see ``te_jax._core.scaling``), and the NaN reaches the GEMM's
output, as an inf or NaN in a BF16 computation would. Clamping an inf to +-max instead (a plain saturating cast) would
train on a finite value in its place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.dtypes import FP8_DTYPES, HP_DTYPES
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval, sequential_batcher
from te_jax._core.quantized_tensor import QuantizedTensor, scale_inv

__all__ = ["amax", "amax_f32", "CastOutput", "check_input", "check_scale", "every_axis_divides", "FP8_DTYPES",
           "group_parts", "holds_whole_groups", "make_config", "MAX_TRANSPOSE_PARTS", "per_tensor", "quantize",
           "quantize_abstract_eval", "quantize_native_signature", "quantize_ref", "QuantizeConfig",
           "saturating_cast", "shard_plan", "unpack"]

# The most parts ``transpose_parts`` groups the transposed copy into: its consumer, ``gemm(..., rhs_parts=True)``,
# takes at most ``te_jax.ops.gemm.MAX_PARTS`` (the kernel itself has no limit).
MAX_TRANSPOSE_PARTS = 4


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
  """Static parameters of one quantize call.

  Attributes:
    out_dtype: float8_e4m3fn or float8_e5m2.
    transpose: also produce the transposed copy.
    batch_ndim: leading dims of ``x`` that stay in front in the transposed copy; the copy swaps the last dim with the
      block of dims between them: ``x.shape[:b] + x.shape[-1:] + x.shape[b:-1]``.
    dbias: also produce the float32 column sums of ``x``.
    t_parts, t_group: with ``t_parts`` > 1 (a 2-D x only), the transposed copy's rows are grouped by part: x's columns
      come in chunks of ``t_group``, chunk j belonging to part j % t_parts, and the copy is (t_parts, cols / t_parts,
      rows), each part's chunks in order.
  """

  out_dtype: np.dtype
  transpose: bool = False
  batch_ndim: int = 0
  dbias: bool = False
  t_parts: int = 1
  t_group: int = 1

  def transposed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    if self.t_parts > 1:
      return (self.t_parts, shape[1] // self.t_parts, shape[0])
    b = self.batch_ndim
    return (*shape[:b], shape[-1], *shape[b:-1])

  def group_transposed(self, qt: jax.Array) -> jax.Array:
    """The (cols, rows) transposed copy with its rows grouped by part: (t_parts, cols / t_parts, rows)."""
    return group_parts(qt, self.t_parts, self.t_group)

  def transposed_axes(self, ndim: int) -> tuple[int, ...]:
    b = self.batch_ndim
    return (*range(b), ndim - 1, *range(b, ndim - 1))


def group_parts(x: jax.Array, parts: int, group: int) -> jax.Array:
  """(N, ...) whose leading dim comes in chunks of ``group``, chunk j belonging to part j % parts -> (parts,
  N // parts, ...): each part's chunks together, in order."""
  n, rest = x.shape[0], x.shape[1:]
  x = x.reshape(n // (parts * group), parts, group, *rest)
  return jnp.swapaxes(x, 0, 1).reshape(parts, n // parts, *rest)


class CastOutput(NamedTuple):
  """What an op that casts returns (``quantize``, ``activation_fwd`` / ``activation_bwd``); fields not asked for are
  None.

  Attributes:
    out: a ``QuantizedTensor`` for an FP8 output (with its transposed copy when one was asked for), else the array.
    amax: ``max|x|`` of the high-precision values, FP8 outputs only.
    dbias: the float32 column sums, when asked for.
  """

  out: QuantizedTensor | jax.Array
  amax: jax.Array | None
  dbias: jax.Array | None


def per_tensor(data: jax.Array, data_t: jax.Array | None, scale: jax.Array) -> QuantizedTensor:
  """The per-tensor scaled tensor that a cast of ``scale`` wrote as ``data`` (and ``data_t``)."""
  inv = scale_inv(scale)
  return QuantizedTensor(data, inv, data_t, None if data_t is None else inv)


# ---- reference ---------------------------------------------------------------------------------------------------


def amax_f32(xf: jax.Array, axis=None) -> jax.Array:
  """``max|x|`` of float32 ``xf`` as an unsigned max over the bit patterns of ``|x|``.

  Exactly what the kernels compute: integer order equals float order for non-negative floats, every NaN sorts above
  +inf (so any NaN gives a NaN amax), and subnormals count. A float ``jnp.max`` is not that on every backend: XLA:CPU
  flushes subnormals to zero and, past a few thousand elements, can drop NaNs.
  """
  bits = jax.lax.bitcast_convert_type(xf, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
  return jax.lax.bitcast_convert_type(jnp.max(bits, axis=axis, initial=jnp.uint32(0)), jnp.float32)


def saturating_cast(xf: jax.Array, scale, dtype) -> jax.Array:
  """The FP8 cast every te_jax op makes: float32 ``xf * scale`` clamped to the format's largest finite value, then
  rounded to ``dtype`` (to nearest, ties to even); NaN where ``xf`` is not finite.

  A finite ``xf`` beyond the range saturates (also where ``xf * scale`` overflows float32). A non-finite ``xf`` (+-inf,
  NaN) gives the positive NaN of ``dtype``: E4M3 has no inf, and a clamp would turn an inf into +-max, a finite value
  training goes on with; E5M2, which has an inf, follows the same convention, so a non-finite input means NaN in every
  FP8 tensor. The kernels do the same with one select on ``xf`` before the multiply.
  """
  fp8_max = float(jnp.finfo(dtype).max)
  clipped = jnp.clip(xf * scale, -fp8_max, fp8_max)
  return jnp.where(jnp.isfinite(xf), clipped, jnp.float32(jnp.nan)).astype(dtype)


def quantize_ref(x: jax.Array, scale: jax.Array, *, config: QuantizeConfig) -> list[jax.Array]:
  """The pure-jnp definition: the CPU fallback, the test oracle and the documentation of the kernels."""
  xf = x.astype(jnp.float32)
  q = saturating_cast(xf, scale, config.out_dtype)
  outs = [q]
  if config.transpose:
    qt = jnp.transpose(q, config.transposed_axes(x.ndim))
    outs.append(config.group_transposed(qt) if config.t_parts > 1 else qt)
  outs.append(amax_f32(xf))
  if config.dbias:
    outs.append(jnp.sum(xf, axis=tuple(range(x.ndim - 1))))
  return outs


# ---- primitive ---------------------------------------------------------------------------------------------------


def quantize_abstract_eval(x, scale, *, config: QuantizeConfig):
  del scale

  def aval(shape, dtype):
    return output_aval(x, shape, dtype)

  outs = [aval(x.shape, config.out_dtype)]
  if config.transpose:
    outs.append(aval(config.transposed_shape(x.shape), config.out_dtype))
  outs.append(aval((), jnp.float32))
  if config.dbias:
    outs.append(aval(x.shape[-1:], jnp.float32))
  return outs


def quantize_native_signature(platform: str, config: QuantizeConfig, avals_in, avals_out) -> NativeSignature:
  """The handlers always return (q, qt, amax, dbias), the ones not asked for empty; the CUDA one also returns the
  workspace for its dbias partials: column partials, one row per row tile, sized by the module."""
  x = avals_in[0]
  empty_fp8 = jax.core.ShapedArray((0,), config.out_dtype)
  empty_f32 = jax.core.ShapedArray((0,), jnp.float32)
  avals = list(avals_out)
  q, rest = avals[0], avals[1:]
  qt = rest.pop(0) if config.transpose else empty_fp8
  amax_aval = rest.pop(0)
  dbias = rest.pop(0) if config.dbias else empty_f32
  results = [q, qt, amax_aval, dbias]
  if platform == "cuda":
    results.append(native.workspace(platform, "quantize", x.shape, config.batch_ndim) if config.dbias else empty_f32)
  keep = [0] + ([1] if config.transpose else []) + [2] + ([3] if config.dbias else [])
  return NativeSignature(extra_operands=(), result_avals=results, keep=keep)


def shard_plan(config: QuantizeConfig, mesh, spec: tuple):
  """For x sharded as ``spec`` (every dim may stay sharded: the cast is elementwise and the transpose a permutation
  of dims): the outputs' shardings, and the function that adds the collectives to the shard-local outputs (amax
  max-reduced, so that every shard uses the same scale next step; dbias psum-reduced over the row dims)."""
  ndim = len(spec)
  out_shardings = [NamedSharding(mesh, P(*spec))]
  if config.transpose and config.t_parts > 1:  # a shard holds whole chunk groups: its block of every part
    out_shardings.append(NamedSharding(mesh, P(None, spec[1], spec[0])))
  elif config.transpose:
    out_shardings.append(NamedSharding(mesh, P(*(spec[i] for i in config.transposed_axes(ndim)))))
  out_shardings.append(NamedSharding(mesh, P()))
  if config.dbias:
    out_shardings.append(NamedSharding(mesh, P(spec[-1])))
  amax_axes = mesh_axes(*spec)
  sum_axes = mesh_axes(*spec[:-1])

  def reduce(outs):
    outs = list(outs)
    i_amax = 2 if config.transpose else 1
    if amax_axes:
      outs[i_amax] = jax.lax.pmax(outs[i_amax], amax_axes)
    if config.dbias and sum_axes:
      outs[-1] = jax.lax.psum(outs[-1], sum_axes)
    return tuple(outs)

  return tuple(out_shardings), reduce


def holds_whole_groups(mesh, entry, size: int, group: int) -> bool:
  """Whether each shard of a dim of ``size`` sharded as the PartitionSpec ``entry`` says holds whole groups of
  ``group`` consecutive elements: what an op that regroups chunks needs for its shard to be a block of the whole."""
  return (size // math.prod(mesh.shape[a] for a in mesh_axes(entry))) % group == 0


def every_axis_divides(mesh, n: int) -> bool:
  """Whether every mesh axis size divides ``n``. A Shardy rule may only name a chunk-count factor where it does:
  otherwise the propagation can shard it over part of a mesh axis, which no PartitionSpec of the partition callback
  expresses."""
  return all(n % size == 0 for size in mesh.shape.values())


def _partition(config: QuantizeConfig, mesh, arg_shapes, result_shape):
  """x stays sharded as given, except that with grouped transposed rows (t_parts) x's columns are gathered unless
  every shard holds whole groups of t_parts * t_group of them."""
  del result_shape
  spec = full_spec(arg_shapes[0].sharding, len(arg_shapes[0].shape))
  if config.t_parts > 1 and spec[1] is not None and not holds_whole_groups(
      mesh, spec[1], arg_shapes[0].shape[1], config.t_parts * config.t_group):
    spec = (spec[0], None)
  out_shardings, reduce = shard_plan(config, mesh, spec)

  def lower_fn(x, scale):
    return reduce(_QUANTIZE.inner.bind(x, scale, config=config))

  return mesh, lower_fn, out_shardings, (NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P()))


def _sharding_rule(config: QuantizeConfig, mesh, value_types, result_types):
  del result_types
  if config.t_parts > 1:
    return _grouped_sharding_rule(config, mesh, value_types[0].shape)
  ndim = len(value_types[0].shape)
  dims = [f"d{i}" for i in range(ndim)]
  x = " ".join(dims)
  results = [x]
  if config.transpose:
    results.append(" ".join(dims[i] for i in config.transposed_axes(ndim)))
  results.append("")
  if config.dbias:
    results.append(dims[-1])
  return f"{x}, -> {', '.join(results)}"


def _grouped_sharding_rule(config: QuantizeConfig, mesh, shape):
  """With grouped transposed rows: x is ``r (h p g)`` and its copy ``p (h g) r``, only h (the chunk group) sharded,
  where every mesh axis divides it; otherwise x's columns and the copy's rows are unrelated factors kept whole (the
  propagation would shard h over part of a mesh axis, which has no PartitionSpec for the partition callback)."""
  h = shape[1] // (config.t_parts * config.t_group)
  if not every_axis_divides(mesh, h):
    x, qt, sizes = "r c", "p n r", {"need_replication_factors": ("c", "p", "n")}
  else:
    x, qt = "r (h p g)", "p (h g) r"
    sizes = {"h": h, "g": config.t_group, "need_replication_factors": ("p", "g")}
  cols = x.split(" ", 1)[1]
  results = [x, qt, ""] + ([cols] if config.dbias else [])
  return f"{x}, -> {', '.join(results)}", sizes


def _batcher(args, dims, *, config: QuantizeConfig):
  """vmap: one kernel over the stacked input when the scale is shared, so a sharded batch dim stays sharded.

  The FP8 bytes do not depend on the batching (the batch dim just joins the leading dims); the per-element amax and
  dbias are plain reductions over the non-batch dims. A per-element scale runs the op once per element instead.
  """
  x, scale = args
  x_dim, scale_dim = dims
  if scale_dim is not None or x_dim is None or config.t_parts > 1:
    return sequential_batcher(_QUANTIZE)(args, dims, config=config)
  x = jnp.moveaxis(x, x_dim, 0)
  batched = dataclasses.replace(config, batch_ndim=config.batch_ndim + 1, dbias=False)
  outs = list(_QUANTIZE.bind(x, scale, config=batched))
  xf = x.astype(jnp.float32)
  outs[2 if config.transpose else 1] = amax_f32(xf, axis=tuple(range(1, x.ndim)))
  if config.dbias:
    outs.append(jnp.sum(xf, axis=tuple(range(1, x.ndim - 1))))
  return outs, [0] * len(outs)


def _attributes(config: QuantizeConfig) -> dict:
  return {"batch_ndim": np.int64(config.batch_ndim), "t_parts": np.int64(config.t_parts),
          "t_group": np.int64(config.t_group)}


_QUANTIZE = define_op(
    "quantize",
    abstract_eval=quantize_abstract_eval,
    reference=quantize_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    native_signature=quantize_native_signature,
    partition=_partition,
    sharding_rule=_sharding_rule,
    batcher=_batcher,
)


# ---- public API --------------------------------------------------------------------------------------------------


def check_input(x, name: str = "x") -> jax.Array:
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in HP_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(x.dtype).name}")
  if x.ndim == 0:
    raise ValueError(f"{name} must have rank >= 1, got a scalar")
  return x


def check_scale(scale) -> jax.Array:
  if isinstance(scale, float):
    return jnp.float32(scale)
  if not hasattr(scale, "dtype") or jnp.dtype(scale.dtype) != jnp.float32:
    raise TypeError(f"scale must be a float32 scalar, got {getattr(scale, 'dtype', type(scale).__name__)}")
  if jnp.shape(scale) != ():
    raise ValueError(f"scale must be a float32 scalar (shape ()), got shape {jnp.shape(scale)}")
  return scale


def _check_fp8_dtype(dtype) -> np.dtype:
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FP8_DTYPES:
    raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}")
  return dt


def quantize(
    x: jax.Array,
    scale: jax.Array | float,
    dtype=jnp.float8_e4m3fn,
    *,
    transpose: bool = False,
    transpose_batch_dims: int | None = None,
    transpose_parts: tuple[int, int] | None = None,
    dbias: bool = False,
) -> CastOutput:
  """Casts ``x * scale`` to FP8 (saturating) and returns it with ``amax = max|x|``, in one pass over ``x``.

  >>> import jax.numpy as jnp, te_jax
  >>> out = te_jax.ops.quantize.quantize(jnp.array([[1.0, -600.0]], jnp.bfloat16), jnp.float32(1.0), transpose=True)
  >>> out.out.data.astype(jnp.float32).tolist(), out.out.data_t.shape, float(out.amax)
  ([[1.0, -448.0]], (2, 1), 600.0)

  Args:
    x: float32, bfloat16 or float16, rank >= 1; the last dim is the row.
    scale: float32 scalar multiplying ``x`` before the cast.
    dtype: ``jnp.float8_e4m3fn`` (max 448) or ``jnp.float8_e5m2`` (max 57344).
    transpose: also return the transposed FP8 copy in ``data_t``.
    transpose_batch_dims: leading dims of ``x`` kept in front in ``data_t``. The default, ``x.ndim - 2``, swaps the
      last two dims; 0 moves the last dim to the front, the K-major layout of a GEMM that contracts over every
      leading dim (the weight gradient of a dense layer).
    transpose_parts: ``(parts, group)`` for a 2-D ``x`` (rows, cols): ``data_t`` is (parts, cols // parts, rows),
      its rows grouped by part, where x's columns come in chunks of ``group``, chunk j belonging to part j % parts
      (the transposed kernel of an (H, 3, D) QKV projection as three (H * D, hidden) GEMM operands, with
      ``(3, D)``). 2 to ``MAX_TRANSPOSE_PARTS`` (4) parts; cols a multiple of ``parts * group``.
    dbias: also return the float32 column sums of ``x`` (over every dim but the last) in ``dbias``.

  Returns:
    ``CastOutput(out, amax, dbias)``: ``out`` the per-tensor ``QuantizedTensor`` (``data_t`` only when asked for),
    ``dbias`` None unless asked for.
  """
  x = check_input(x)
  config = make_config(x.shape, dtype, transpose, transpose_batch_dims, dbias, "x")
  if transpose_parts is not None:
    config = dataclasses.replace(config, **_check_transpose_parts(transpose_parts, x.shape, transpose,
                                                                  transpose_batch_dims))
  scale = check_scale(scale)
  return unpack(_QUANTIZE.bind(x, scale, config=config), config, scale)


def make_config(shape, dtype, transpose: bool, transpose_batch_dims: int | None, dbias: bool,
                name: str) -> QuantizeConfig:
  """The config of a quantize of an x of ``shape`` (called ``name`` in errors), its arguments checked."""
  out_dtype = _check_fp8_dtype(dtype)
  rank = len(shape)
  batch_ndim = 0
  if transpose:
    if rank < 2:
      raise ValueError(f"transpose=True needs {name} of rank >= 2, got shape {tuple(shape)}")
    batch_ndim = rank - 2 if transpose_batch_dims is None else transpose_batch_dims
    if not 0 <= batch_ndim <= rank - 2:
      raise ValueError(f"transpose_batch_dims must be in [0, {rank - 2}] for {name} of rank {rank}, got {batch_ndim}")
  elif transpose_batch_dims is not None:
    raise ValueError("transpose_batch_dims needs transpose=True")
  return QuantizeConfig(out_dtype=out_dtype, transpose=bool(transpose), batch_ndim=batch_ndim, dbias=bool(dbias))


def _check_transpose_parts(transpose_parts, shape, transpose: bool, transpose_batch_dims) -> dict:
  """``quantize``'s ``transpose_parts`` as QuantizeConfig fields."""
  if not transpose:
    raise ValueError("transpose_parts needs transpose=True")
  if len(shape) != 2 or transpose_batch_dims not in (None, 0):
    raise ValueError(f"transpose_parts needs a 2-D x (and no transpose_batch_dims), got shape {tuple(shape)}")
  if (not isinstance(transpose_parts, tuple) or len(transpose_parts) != 2
      or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in transpose_parts)):
    raise TypeError(f"transpose_parts must be a (parts, group) tuple of ints, got {transpose_parts!r}")
  parts, group = (int(v) for v in transpose_parts)
  if not 2 <= parts <= MAX_TRANSPOSE_PARTS or group < 1 or shape[1] % (parts * group):
    raise ValueError(f"transpose_parts=({parts}, {group}): 2 to {MAX_TRANSPOSE_PARTS} parts, and x's last dim "
                     f"({shape[1]}) a multiple of parts * group")
  return {"t_parts": parts, "t_group": group}


def unpack(outs, config: QuantizeConfig, scale: jax.Array) -> CastOutput:
  """The primitive's results, cast with ``scale``, as ``CastOutput``."""
  outs = list(outs)
  data = outs.pop(0)
  data_t = outs.pop(0) if config.transpose else None
  amax_ = outs.pop(0)
  dbias_ = outs.pop(0) if config.dbias else None
  return CastOutput(per_tensor(data, data_t, scale), amax_, dbias_)


def amax(x: jax.Array) -> jax.Array:
  """``max|x|`` as float32 (NaN if ``x`` holds a NaN; 0 for an empty ``x``), for current scaling.

  A plain reduction (over the bit patterns of ``|x|``, as the kernels do): XLA reads ``x`` once at full bandwidth
  and inserts the all-reduce itself when ``x`` is sharded, so no custom call is needed.
  """
  x = check_input(x)
  return amax_f32(x.astype(jnp.float32))
