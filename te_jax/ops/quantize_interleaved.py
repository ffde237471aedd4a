"""``quantize_interleaved``: the FP8 quantize of several arrays' column chunks interleaved, without building it.

A fused QKV projection with a heads-major (H, 3, D) kernel writes each token's q, k and v of one head next to each
other; attention reads q, k and v as separate (..., H, D) arrays, so their gradients come back separately. The
projection's backward needs the output gradient in the projection's layout, as FP8 with its transposed copy: the
interleave of dq, dk and dv in chunks of D. Built by XLA, that interleave is one more pass over the gradient
(written, then read again by the quantize); here the quantize kernel reads each chunk from its part instead.

For parts ``p_0 .. p_{k-1}`` of shape ``(..., C)`` and a ``group`` dividing C, x is

    jnp.stack([p.reshape(..., C // group, group) for p in parts], axis=-2).reshape(..., k * C)

and the results are those of ``quantize(x, ...)``, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.primitive import define_op, full_spec, sequential_batcher
from te_jax.ops.quantize import (CastOutput, QuantizeConfig, amax_f32, check_input, check_scale, every_axis_divides,
                                 holds_whole_groups, make_config, quantize, quantize_abstract_eval,
                                 quantize_native_signature, quantize_ref, shard_plan, unpack)

__all__ = ["MAX_PARTS", "quantize_interleaved", "interleave"]

# The API's limits, checked on every platform: at most MAX_PARTS parts, whose rows side by side hold at most _MAX_COLS
# elements (the CUDA kernel's column arithmetic is 32-bit). tests/test_geometry.py checks that the kernel's capacity
# (te_jax._te_cuda.quantize_interleaved_max_parts and _max_cols) covers them.
MAX_PARTS = 4
_MAX_COLS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class InterleavedConfig:
  """The quantize's own config and the interleave: ``group`` columns of each part in turn."""

  base: QuantizeConfig
  group: int


def interleave(parts: Sequence[jax.Array], group: int) -> jax.Array:
  """x of the module docstring: the parts' column chunks of ``group``, one chunk of each part in turn."""
  lead, c = parts[0].shape[:-1], parts[0].shape[-1]
  stacked = jnp.stack([p.reshape(*lead, c // group, group) for p in parts], axis=-2)
  return stacked.reshape(*lead, len(parts) * c)


def _x_aval(parts) -> jax.core.ShapedArray:
  p = parts[0]
  return p.update(shape=(*p.shape[:-1], len(parts) * p.shape[-1]))


def _reference(scale, *parts, config: InterleavedConfig):
  return quantize_ref(interleave(parts, config.group), scale, config=config.base)


def _interleaved_abstract_eval(scale, *parts, config: InterleavedConfig):
  return quantize_abstract_eval(_x_aval(parts), scale, config=config.base)


def _interleaved_signature(platform, config: InterleavedConfig, avals_in, avals_out):
  scale, *parts = avals_in
  return quantize_native_signature(platform, config.base, [_x_aval(parts), scale], avals_out)


def _local_spec(config: InterleavedConfig, mesh, arg_shapes) -> tuple:
  """The parts' sharding: as the first part's, except that a last dim split inside a group is gathered (a shard must
  hold whole groups for its interleave to be a block of the global one)."""
  part = arg_shapes[1]
  spec = list(full_spec(part.sharding, len(part.shape)))
  if spec[-1] is not None and not holds_whole_groups(mesh, spec[-1], part.shape[-1], config.group):
    spec[-1] = None
  return tuple(spec)


def _partition(config: InterleavedConfig, mesh, arg_shapes, result_shape):
  del result_shape
  spec = _local_spec(config, mesh, arg_shapes)
  out_shardings, reduce = shard_plan(config.base, mesh, spec)

  def lower_fn(scale, *parts):
    return reduce(_QUANTIZE_INTERLEAVED.inner.bind(scale, *parts, config=config))

  part_sharding = NamedSharding(mesh, P(*spec))
  return mesh, lower_fn, out_shardings, (NamedSharding(mesh, P()), *[part_sharding] * (len(arg_shapes) - 1))


def _sharding_rule(config: InterleavedConfig, mesh, value_types, result_types):
  """Leading dims pass through; the last dim of the parts is (h g), of x (h p g): x's last dim may be sharded
  over h, the chunk index, only, and only where every mesh axis divides h; otherwise the parts' last dim and x's
  are unrelated factors kept whole."""
  del result_types
  part_shape = value_types[1].shape
  n_parts = len(value_types) - 1
  h = part_shape[-1] // config.group
  if every_axis_divides(mesh, h):
    part_last, x_last = "(h g)", "(h p g)"
    sizes = {"h": h, "g": config.group, "p": n_parts}
  else:
    part_last, x_last = "c", "n"
    sizes = {"need_replication_factors": ("c", "n")}
  lead = [f"d{i}" for i in range(len(part_shape) - 1)]
  part = " ".join([*lead, part_last])
  x_dims = [*lead, x_last]
  results = [" ".join(x_dims)]
  if config.base.transpose:
    results.append(" ".join(x_dims[i] for i in config.base.transposed_axes(len(x_dims))))
  results.append("")
  if config.base.dbias:
    results.append(x_last)
  rule = f", {', '.join([part] * n_parts)} -> {', '.join(results)}"
  return rule, sizes


def _batcher(args, dims, *, config: InterleavedConfig):
  """vmap: one kernel over the stacked parts when they are all batched and the scale is shared (the batch dim joins
  the leading dims; amax is then a per-element reduction); anything else runs once per element."""
  scale, *parts = args
  scale_dim, *part_dims = dims
  if scale_dim is not None or any(d is None for d in part_dims) or config.base.dbias:
    return sequential_batcher(_QUANTIZE_INTERLEAVED)(args, dims, config=config)
  parts = [jnp.moveaxis(p, d, 0) for p, d in zip(parts, part_dims)]
  base = dataclasses.replace(config.base, batch_ndim=config.base.batch_ndim + 1)
  outs = list(_QUANTIZE_INTERLEAVED.bind(scale, *parts, config=dataclasses.replace(config, base=base)))
  axes = tuple(range(1, parts[0].ndim))
  outs[2 if base.transpose else 1] = jnp.max(jnp.stack([amax_f32(p.astype(jnp.float32), axis=axes)
                                                        for p in parts]), axis=0)
  return outs, [0] * len(outs)


_QUANTIZE_INTERLEAVED = define_op(
    "quantize_interleaved",
    abstract_eval=_interleaved_abstract_eval,
    reference=_reference,
    native_platforms=("cuda",),
    ffi_attributes=lambda config: {"batch_ndim": np.int64(config.base.batch_ndim), "group": np.int64(config.group)},
    native_signature=_interleaved_signature,
    partition=_partition,
    sharding_rule=_sharding_rule,
    batcher=_batcher,
)


def quantize_interleaved(
    parts: Sequence[jax.Array],
    scale: jax.Array | float,
    dtype=jnp.float8_e4m3fn,
    *,
    group: int,
    transpose: bool = False,
    transpose_batch_dims: int | None = None,
    dbias: bool = False,
) -> CastOutput:
  """``quantize(interleave(parts, group), ...)`` in one pass over the parts, never writing the interleave.

  >>> import jax.numpy as jnp, te_jax
  >>> q = te_jax.ops.quantize_interleaved.quantize_interleaved([jnp.ones((2, 4)), -jnp.ones((2, 4))], 1.0, group=2)
  >>> q.out.data.astype(jnp.float32)[0].tolist()
  [1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]

  Args:
    parts: 1 to 4 arrays of one shape ``(..., C)`` and dtype (float32, bfloat16 or float16).
    scale, dtype, transpose, transpose_batch_dims, dbias: as in ``te_jax.ops.quantize.quantize``, for x of shape
      ``(..., len(parts) * C)``.
    group: the chunk width; must divide C.

  Returns:
    ``CastOutput`` of x (see the module docstring).
  """
  if isinstance(parts, jax.Array) or not isinstance(parts, Sequence) or not 1 <= len(parts) <= MAX_PARTS:
    raise ValueError(f"parts must be a sequence of 1 to {MAX_PARTS} arrays, got {type(parts).__name__}")
  parts = [check_input(p, f"parts[{i}]") for i, p in enumerate(parts)]
  shape, dt = parts[0].shape, jnp.dtype(parts[0].dtype)
  for i, p in enumerate(parts[1:], 1):
    if p.shape != shape or jnp.dtype(p.dtype) != dt:
      raise ValueError(f"parts must share one shape and dtype: parts[0] is {dt.name}{list(shape)}, parts[{i}] is "
                       f"{jnp.dtype(p.dtype).name}{list(p.shape)}")
  if not isinstance(group, (int, np.integer)) or group < 1 or shape[-1] % group:
    raise ValueError(f"group must be a positive divisor of the parts' last dim {shape[-1]}, got {group!r}")
  if len(parts) * shape[-1] > _MAX_COLS:
    raise ValueError(f"the interleaved rows must be shorter than 2^31 elements, got {len(parts)} x {shape[-1]}")
  if len(parts) == 1:
    return quantize(parts[0], scale, dtype, transpose=transpose, transpose_batch_dims=transpose_batch_dims,
                    dbias=dbias)
  base = make_config(shape, dtype, transpose, transpose_batch_dims, dbias, "parts")
  config = InterleavedConfig(base, int(group))
  scale = check_scale(scale)
  return unpack(_QUANTIZE_INTERLEAVED.bind(scale, *parts, config=config), base, scale)
