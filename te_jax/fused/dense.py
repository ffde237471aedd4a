"""``dense``: ``x @ kernel + bias`` with FP8 GEMMs in the forward and backward passes.

Forward: one pass over ``x`` makes its E4M3 copy, its transposed copy (for the weight gradient) and its amax; one
pass over the kernel does the same; one FP8 GEMM (fast accumulation) with the bias in its epilogue. Only the FP8
transposed ``x`` and the FP8 kernel are saved for the backward pass: 1 byte per element instead of 2.

Backward: one pass over the output gradient makes its FP8 copy (E5M2 under HYBRID), its transposed copy, its amax
and the bias gradient; then the dgrad and wgrad FP8 GEMMs (full-precision accumulation). The weight gradient comes
out in the kernel's dtype (float32 for float32 parameters).

Delayed scaling: the scales come from ``fp8_meta`` and the updated state (amax histories rolled, new scales) is
returned as ``fp8_meta``'s gradient, so a train step that differentiates with respect to the whole variables dict
(``flax.training.train_state.TrainState``) keeps the state current with no extra code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.explicit import constrain, explicit_mesh, reshape, retype, typed_vjp
from te_jax._core.manual_axes import to_common_varying
from te_jax._core.primitive import full_spec
from te_jax.fused.linear import (Fp8Config, LinearResiduals, Unstack, as_arrays, check_checkpoint_name, check_residual,
                                 fp8_dims_aligned, fp8_recipe, input_for, instantiate, keep_state, keeps_state,
                                 layer_output, linear_bwd, linear_fwd, out_spec_of, pad_rows, primal_values,
                                 quantize_grad, residual_rows, state_as_float32, state_like)
from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.ops.gemm import output_spec
from te_jax.recipe import Recipe

__all__ = ["dense", "high_precision_dense", "normalize_axes"]


@dataclasses.dataclass(frozen=True)
class _Config:
  fp8: Fp8Config
  unstack: Unstack | None
  has_residual: bool
  out_rows: tuple[int, int] | None  # (B, S): the output (B, S, N), its rows sharded as the caller constrains them
  keep_rows: bool = False  # x is (B, S, K): every op keeps the two dims, sharded as they come
  out_spec: P | None = None  # the GEMM output's sharding the caller asks for (out_sharding)
  grad_spec: P | None = None  # Explicit axes: the output gradient as the backward GEMMs read it (rows unscattered)


class _Residuals(NamedTuple):
  linear: LinearResiduals
  amax_x: jax.Array
  meta: DenseFp8Meta | None  # as the caller passed it (its dtype is the update's)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_fp8(cfg: _Config, x, kernel, bias, residual, meta):
  return _forward(cfg, x, kernel, bias, residual, meta)[0]


def _dense_fp8_fwd(cfg: _Config, *primals):
  return _forward(cfg, *primal_values(primals, trained=(1,), states=(4,)))


def _forward(cfg: _Config, x, kernel, bias, residual, meta_in):
  fp8 = cfg.fp8
  meta = state_as_float32(meta_in)
  # (M, K) and (K, M), or kept rows
  qx = fp8.quantizer.quantize("x", meta and meta.x, x, fp8.fwd_dtype, transpose=True, transpose_batch_dims=0)
  out, res = linear_fwd(fp8, qx.out, kernel, meta and meta.kernel, bias, residual, cfg.unstack, cfg.out_rows,
                        out_sharding=cfg.out_spec)
  return out, _Residuals(res, qx.amax, meta_in)


def _dense_fp8_bwd(cfg: _Config, r: _Residuals, g):
  g = tuple(map(instantiate, g)) if isinstance(g, tuple) else instantiate(g)
  g_out = g
  g = retype(g, cfg.grad_spec)
  if cfg.out_rows is not None and not cfg.keep_rows:  # (B, S, N), sharded like the output
    g = reshape(g, (-1, g.shape[-1]))
  fp8 = cfg.fp8
  meta = state_as_float32(r.meta)
  qg = quantize_grad(fp8, g, meta and meta.grad, cfg.unstack)  # (M, N) and (N, M)
  dx, dw = linear_bwd(fp8, r.linear, qg.out)
  dbias = qg.dbias.astype(fp8.bias_dtype) if fp8.has_bias else None
  new_meta = None
  if meta is not None:
    new_meta = state_like(fp8.quantizer.update([(meta, r.amax_x, r.linear.amax_w, qg.amax)])[0], r.meta)
  return dx, dw, dbias, (g_out if cfg.has_residual else None), new_meta


_dense_fp8.defvjp(*typed_vjp(_dense_fp8_fwd, _dense_fp8_bwd, nondiff_argnums=(0,)), symbolic_zeros=True)


def normalize_axes(axes: int | Sequence[int], ndim: int, name: str) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  out = []
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"{name} axis {a} is out of range for rank {ndim}")
    out.append(a % ndim)
  if len(set(out)) != len(out):
    raise ValueError(f"{name} axes repeat: {axes}")
  return tuple(out)


def high_precision_dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                         axes: tuple[int, ...] = (-1,), unstack_axis: int | None = None,
                         residual: jax.Array | None = None, precision=None,
                         out_sharding: P | NamedSharding | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """``dense`` without FP8, whatever the autocast: a ``dot_general`` in ``x``'s dtype contracting ``x``'s ``axes``
  (normalized) with ``kernel``'s leading dims, plus ``bias`` and ``residual``; unstacked along ``unstack_axis``. The
  path of a GEMM an FP8 layer cannot run in FP8 (its caller keeps the state).

  On a mesh with Explicit axes the ``dot_general`` runs inside a ``jax.sharding.auto_axes`` boundary whose output is
  typed ``out_sharding`` (default: ``te_jax.ops.gemm.output_spec``, the FP8 GEMM's type): jax's explicit
  ``dot_general`` takes neither a contraction sharded differently on its two sides (a weight sharded over the batch's
  axis, FSDP) nor a sharded one without an ``out_sharding``, which the partitioner resolves as on an Auto mesh."""
  axes = normalize_axes(axes, x.ndim, "x")
  dims = ((axes, tuple(range(len(axes)))), ((), ()))
  mesh = explicit_mesh(x, kernel)
  if mesh is None:
    y = jax.lax.dot_general(x, kernel.astype(x.dtype), dims, precision=precision)
    y = constrain(y, out_sharding)
  else:
    xs, ks = full_spec(jax.typeof(x).sharding, x.ndim), full_spec(jax.typeof(kernel).sharding, kernel.ndim)
    rows = [xs[a] for a in range(x.ndim) if a not in axes]
    spec = P(*output_spec(rows, [xs[a] for a in axes], ks[:len(axes)], ks[len(axes):]))
    if out_sharding is not None:
      spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    dot = jax.sharding.auto_axes(lambda a, b: jax.lax.dot_general(a, b.astype(a.dtype), dims, precision=precision),
                                 out_sharding=NamedSharding(mesh, spec))
    y = dot(x, kernel)
  y_spec = full_spec(jax.typeof(y).sharding, y.ndim)
  if bias is not None:  # laid out as the output's feature dims
    y = y + retype(bias, P(*y_spec[y.ndim - bias.ndim:])).astype(y.dtype)
  if residual is not None:
    y = y + retype(residual, P(*y_spec)).astype(y.dtype)
  return y if unstack_axis is None else tuple(jnp.unstack(y, axis=unstack_axis))


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    axis: int | Sequence[int] = -1,
    unstack_axis: int | None = None,
    residual: jax.Array | None = None,
    fp8_meta: DenseFp8Meta | None = None,
    recipe: Recipe | None = None,
    precision=None,
    scatter_rows: bool = False,
    keep_rows: bool = False,
    out_sharding: P | NamedSharding | None = None,
    quantization_checkpoint_name: str | None = None,
) -> jax.Array | tuple[jax.Array, ...]:
  """``x @ kernel + bias``, contracting ``x``'s ``axis`` dims with ``kernel``'s leading dims (Flax's DenseGeneral).

  Under ``autocast(enabled=True)`` (or with an explicit ``recipe``) both GEMMs of the layer and its backward
  pass run in FP8; otherwise it is a plain ``dot_general`` in ``x``'s dtype.

  >>> import jax.numpy as jnp, te_jax
  >>> te_jax.dense(jnp.ones((4, 32), jnp.bfloat16), jnp.ones((32, 16))).shape
  (4, 16)

  Args:
    x: the input, in the compute dtype (the output has it too).
    kernel: ``(*x.shape[axis], *features)``, any float dtype (its gradient keeps it).
    bias: optional ``features``-shaped bias.
    axis: the dims of ``x`` to contract.
    unstack_axis: a feature axis of the output to return it unstacked along, as ``jnp.unstack(y, unstack_axis)``
      would (a fused QKV projection's (..., H, 3, D) output as q, k, v with ``unstack_axis=-2``). Under FP8 the
      backward then reads the parts' gradients straight into the GEMM's FP8 operand, never stacking them.
    residual: optional, the output's shape: added to the output (a residual connection); under FP8 in the GEMM's
      epilogue, so ``x @ kernel + bias + residual`` is rounded once and costs no pass of its own.
    fp8_meta: the layer's scaling state (``DenseFp8Meta``), for a recipe that keeps one (``DelayedScaling``);
      unused otherwise.
    recipe: overrides the autocast recipe for this call.
    precision: ``lax.dot_general``'s precision for the high-precision GEMM (FP8 GEMMs accumulate as the recipe says).
    scatter_rows: ``x``'s dims other than ``axis`` are two, (B, S), and the caller constrains the output, whose (B, S)
      sharding the GEMM then takes from that constraint (``te_jax.ops.gemm.gemm``'s ``scatter_rows``): a row-parallel
      GEMM (K sharded over the tensor axis) reduce-scatters onto a sequence-parallel residual stream. Under FP8 only,
      and only where B * S needs no padding (a multiple of 16); otherwise it all-reduces and XLA slices (the same
      values).
    keep_rows: ``x``'s dims other than ``axis`` are two, (B, S), and every op of the layer keeps them as two dims,
      sharded as ``x``'s are, instead of folding them into the GEMM's M (``te_jax.ops.gemm.gemm``'s ``keep_rows``):
      rows whose batch and sequence are sharded over different mesh axes (a context-parallel residual stream) are no
      sharding of the merged rows, which would have the sequence all-gathered. Under FP8, where B * S needs no
      padding.
    out_sharding: the output's sharding, a ``PartitionSpec`` of its dims (or a ``NamedSharding``), as Flax's
      ``nnx.Linear`` passes it to ``jax.lax.dot_general``: on a mesh with Explicit axes the output's type; on an
      Auto one a sharding constraint. The GEMM writes its output so where it can (a K sharded over the axes that
      shard the output's dim ends in a reduce-scatter onto it, not an all-reduce). Without it, on Explicit axes,
      the output keeps x's row shardings and the kernel's feature shardings less the contraction's mesh axes (its
      partial sums are all-reduced over them): ``te_jax.ops.gemm.output_spec``, in FP8 and high precision alike.
    quantization_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` of the FP8 tensors saved for the
      backward pass (the transposed FP8 input and the FP8 kernel), for ``jax.checkpoint`` policies (Transformer
      Engine's option of that name); None: ``te_jax.FP8_RESIDUAL``.

  A GEMM whose contracted or output size is not a multiple of 16 (which FP8 GEMMs need: a classifier's 4-way head,
  an odd hidden size) runs in high precision even under FP8, and its state is handed back unchanged.

  Returns:
    ``(*x's other dims, *features)`` in ``x``'s dtype (a tuple of them unstacked, with ``unstack_axis``).
  """
  x, kernel, bias, residual = as_arrays(x, kernel, bias, residual)
  check_checkpoint_name(quantization_checkpoint_name, "quantization_checkpoint_name")
  axes = normalize_axes(axis, x.ndim, "x")
  n_contract = len(axes)
  if kernel.ndim <= n_contract - 1 or kernel.shape[:n_contract] != tuple(x.shape[a] for a in axes):
    raise ValueError(
        f"kernel {kernel.shape} must start with x's contracting dims {tuple(x.shape[a] for a in axes)} (axis={axis})"
    )
  features = kernel.shape[n_contract:]
  if bias is not None and bias.shape != features:
    raise ValueError(f"bias must have shape {features}, got {bias.shape}")
  unstack = Unstack.of(unstack_axis, x.ndim - n_contract + len(features), features)
  if unstack is not None and residual is not None:
    raise ValueError("dense: unstack_axis and residual exclude each other")
  if scatter_rows and (unstack is not None or x.ndim - n_contract != 2):
    raise ValueError(f"dense: scatter_rows needs two non-contracted dims of x (B, S) and no unstack_axis; x is "
                     f"{x.shape}, axis={axis}, unstack_axis={unstack_axis}")
  if keep_rows and x.ndim - n_contract != 2:
    raise ValueError(f"dense: keep_rows needs two non-contracted dims of x (B, S); x is {x.shape}, axis={axis}")
  check_residual(residual, tuple(x.shape[a] for a in range(x.ndim) if a not in axes) + tuple(features))
  spec = out_spec_of(out_sharding, x.ndim - n_contract + len(features)) if unstack is None else None
  if out_sharding is not None and unstack is not None:
    raise ValueError("dense: out_sharding and unstack_axis exclude each other (constrain each part instead)")
  if not scatter_rows:  # scattered, the output's rows are the GEMM's to lay out: x's stay as they come
    x = input_for(x, axes, spec)
  recipe = fp8_recipe(recipe, fp8_meta=fp8_meta)
  k, n = math.prod(kernel.shape[:n_contract]), math.prod(features)
  if recipe is None or not fp8_dims_aligned(k, n, unstack):
    if keeps_state(recipe):  # a GEMM FP8 cannot take: its state is kept
      x = keep_state(x, fp8_meta)
    return high_precision_dense(x, kernel, bias, axes=axes, unstack_axis=unstack_axis, residual=residual,
                                precision=precision, out_sharding=spec)
  # Contracting dims last, then fold into 2-D: (M, K) @ (K, N).
  batch_axes = tuple(a for a in range(x.ndim) if a not in axes)
  if axes != tuple(range(x.ndim - n_contract, x.ndim)):
    x = jnp.transpose(x, batch_axes + axes)
  batch_shape = tuple(x.shape[: len(batch_axes)])
  m = math.prod(batch_shape)
  x2d, pad = pad_rows(reshape(x, (m, k)))
  b = None if bias is None else bias.reshape(n)
  cfg = Fp8Config.of(recipe, x, kernel, bias, quantization_checkpoint_name)
  meta = fp8_meta if keeps_state(recipe) else None
  out_rows = batch_shape if scatter_rows and not pad else None
  keep = bool(keep_rows) and not pad
  r = residual_rows(residual, m, n, pad, x.dtype, out_rows or (batch_shape if keep else None))
  x_in = reshape(x, (*batch_shape, k)) if keep else x2d
  x_in, k2d, b, r = to_common_varying(x_in, reshape(kernel, (k, n)), b, r)  # inside shard_map: as jax's dot would
  # The GEMM's output is the layer's where its rows are x's (or kept, or scattered) and N is one dim: it is typed
  # with the wanted sharding; with the rows scattered, the backward reads the output gradient as the GEMM ran.
  own = len(features) == 1 and (out_rows is not None or keep or (len(batch_shape) == 1 and not pad))
  grad_spec = None
  if out_rows is not None and spec is not None and explicit_mesh(x) is not None:
    xs, ks = full_spec(jax.typeof(x).sharding, x.ndim), full_spec(jax.typeof(kernel).sharding, kernel.ndim)
    grad_spec = P(*output_spec(xs[:len(batch_shape)], xs[len(batch_shape):], ks[:n_contract], ks[n_contract:]))
  y = _dense_fp8(_Config(cfg, unstack, r is not None, out_rows, keep, spec if own else None, grad_spec), x_in, k2d,
                 b, r, meta)
  if out_rows is not None:
    return constrain(reshape(y, (*batch_shape, *features)), spec)
  y = layer_output(y, m, batch_shape, features, unstack)
  return y if unstack is not None else constrain(y, spec)
