"""The body of ``DenseGeneral``: a dense layer over any input axes whose GEMM runs in FP8 under ``te_jax.autocast``
(``te_jax.flax.DenseGeneral``, ``te_jax.nnx.DenseGeneral``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from te_jax._core.autocast import resolve_recipe
from te_jax.fused.dense import dense, normalize_axes
from te_jax.fused.dot_general import dot_general
from te_jax.fused.linear import Unstack, check_checkpoint_name
from te_jax.modules.axes import Initializer, constrain, explicit_out, features_tuple, rule_shards, sequence_kept
from te_jax.modules.scope import Scope
from te_jax.recipe import Recipe

__all__ = ["DenseGeneralOptions", "dense_general", "dense_general_params", "einsum_dims", "fp8_dot_general", "fp8_einsum",
           "unstack_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseGeneralOptions:
  """The options of ``DenseGeneral``: the linen module's attributes (documented there, with their defaults); the
  NNX module maps its constructor's arguments onto them."""

  features: tuple[int, ...]
  axis: int | Sequence[int]
  batch_dims: Sequence[int]
  unstack_axis: int | None
  use_bias: bool
  kernel_init: Initializer
  bias_init: Initializer
  dtype: Any
  param_dtype: Any
  precision: Any
  dot_general: Any
  dot_general_cls: Any
  kernel_axes: tuple[str | None, ...]
  bias_axes: tuple[str | None, ...]
  output_axes: tuple[str | None, ...]
  recipe: Recipe | None
  quantization_checkpoint_name: str | None

  def __post_init__(self):
    object.__setattr__(self, "features", features_tuple(self.features))
    check_checkpoint_name(self.quantization_checkpoint_name, "quantization_checkpoint_name")
    if self.dot_general is not None and self.dot_general_cls is not None:
      raise ValueError("give dot_general or dot_general_cls, not both")

  @property
  def custom_gemm(self) -> bool:
    """Whether a GEMM of the caller's (``dot_general``, ``dot_general_cls``) runs instead of te_jax's."""
    return self.dot_general is not None or self.dot_general_cls is not None


def unstack_of(unstack_axis: int | None, features: tuple[int, ...], out_ndim: int | None) -> Unstack | None:
  """The ``Unstack`` of a layer's ``unstack_axis`` over an output of rank ``out_ndim`` ending in ``features``; where
  the rank is not known yet (None: an NNX module's constructor), the axis must count from the output's end."""
  if out_ndim is None and unstack_axis is not None and not (isinstance(unstack_axis, int) and unstack_axis < 0):
    raise ValueError(f"unstack_axis must count from the output's end (one of {tuple(range(-len(features), 0))}) "
                     f"where the input's rank is not known, got {unstack_axis!r}")
  return Unstack.of(unstack_axis, len(features) if out_ndim is None else out_ndim, features)


def dense_general_params(scope: Scope, o: DenseGeneralOptions, batch_shape: tuple[int, ...],
                         in_shape: tuple[int, ...], out_ndim: int | None):
  """``(kernel, bias)`` of a layer over inputs whose batch dims have ``batch_shape`` and whose contracted axes have
  ``in_shape``; ``out_ndim`` is the output's rank (None where it is not known yet: ``unstack_axis`` must then count
  from the end). The FP8 state of a layer that runs te_jax's GEMM is declared too."""
  n_batch, n_in = len(batch_shape), len(in_shape)
  unstack = unstack_of(o.unstack_axis, o.features, out_ndim)
  if unstack is not None and (o.custom_gemm or batch_shape):
    raise ValueError("unstack_axis needs te_jax's GEMM: no batch_dims, dot_general or dot_general_cls")
  part_axis = None if unstack is None else n_batch + n_in + unstack.feature_axis
  kernel = scope.param("kernel", o.kernel_init, batch_shape + in_shape + o.features, o.param_dtype,
                       n_in=n_batch + n_in, part_axis=part_axis, axes=o.kernel_axes)
  bias = None
  if o.use_bias:
    bias = scope.param("bias", o.bias_init, batch_shape + o.features, o.param_dtype, n_in=0, axes=o.bias_axes)
  if not (o.custom_gemm or batch_shape):
    scope.declare_fp8_state(o.recipe)
  return kernel, bias


def dense_general(scope: Scope, o: DenseGeneralOptions, inputs: jax.Array, residual: jax.Array | None = None,
                  out_sharding=None):
  """The layer's output for ``inputs``, plus ``residual`` (the output's shape) when given, added in the GEMM's
  epilogue (te_jax's GEMM) or after it; sharded ``out_sharding`` (``te_jax.dense``'s) when given, else, on a mesh
  with Explicit axes, as ``output_axes`` say."""
  inputs = jnp.asarray(inputs)
  batch_dims = tuple(sorted(normalize_axes(o.batch_dims, inputs.ndim, "batch_dims")))
  if batch_dims != tuple(range(len(batch_dims))):
    raise ValueError(f"batch_dims {o.batch_dims} must be consecutive leading dimensions starting from 0")
  axis = tuple(sorted(normalize_axes(o.axis, inputs.ndim, "inputs")))  # sorted, as Flax does: same kernel shapes
  if set(axis) & set(batch_dims):
    raise ValueError(f"axis {o.axis} and batch_dims {o.batch_dims} overlap")
  n_batch, n_in = len(batch_dims), len(axis)
  out_ndim = inputs.ndim - n_in + len(o.features)
  if o.output_axes and (len(o.output_axes) != out_ndim or o.unstack_axis is not None):
    raise ValueError(f"output_axes {o.output_axes} must name each of the output's {out_ndim} dims, and not with "
                     "unstack_axis")
  batch_shape = tuple(inputs.shape[a] for a in batch_dims)
  kernel, bias = dense_general_params(scope, o, batch_shape, tuple(inputs.shape[a] for a in axis), out_ndim)
  dtype = o.dtype or jnp.result_type(inputs.dtype, o.param_dtype)
  x = inputs.astype(dtype)
  custom = o.dot_general or (o.dot_general_cls() if o.dot_general_cls is not None else None)
  if custom is None and not batch_dims:
    recipe = resolve_recipe(o.recipe)
    x, (meta,) = scope.fp8_state(recipe, x)
    rows = inputs.ndim - n_in
    scatter = rows == 2 and bool(o.output_axes) and rule_shards(o.output_axes[1])
    out = out_sharding if out_sharding is not None else explicit_out(o.output_axes)
    return constrain(dense(x, kernel, bias, axis=axis, unstack_axis=o.unstack_axis, residual=residual, fp8_meta=meta,
                           recipe=recipe, precision=o.precision, scatter_rows=scatter,
                           keep_rows=scatter and sequence_kept(o.output_axes[1]), out_sharding=out,
                           quantization_checkpoint_name=o.quantization_checkpoint_name), o.output_axes)
  # Flax's own computation: a GEMM te_jax does not run; a state the variables hold is handed back unchanged.
  x, _ = scope.fp8_state(None, x)
  dims = ((axis, tuple(range(n_batch, n_batch + n_in))), (batch_dims, tuple(range(n_batch))))
  out = {} if out_sharding is None else {"out_sharding": out_sharding}
  y = (custom or jax.lax.dot_general)(x, kernel.astype(dtype), dims, precision=o.precision, **out)
  if bias is not None:
    y = y + jnp.reshape(bias.astype(y.dtype), batch_shape + (1,) * (x.ndim - n_batch - n_in) + o.features)
  return constrain(y if residual is None else y + residual.astype(y.dtype), o.output_axes)


def fp8_dot_general(scope: Scope, recipe: Recipe | None, lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, out_sharding=None, **kwargs):
  """``Fp8DotGeneral``'s call: ``lax.dot_general``'s arguments (``kwargs``: more of them), run as
  ``te_jax.fused.dot_general.dot_general`` (any dimension numbers; lhs the GEMM's input, rhs its kernel) with the
  scope's FP8 state under an enabled autocast (or ``recipe``), as ``lax.dot_general`` otherwise."""
  recipe = resolve_recipe(recipe)
  if recipe is None:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding, **kwargs)
  given = sorted(k for k, v in kwargs.items() if v is not None)
  if given:
    raise ValueError(f"Fp8DotGeneral takes no {', '.join(given)}: shard the input and the kernel instead")
  lhs, (meta,) = scope.fp8_state(recipe, jnp.asarray(lhs))
  return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, fp8_meta=meta, recipe=recipe,
                     out_sharding=out_sharding)


def einsum_dims(subscripts, lhs_ndim: int, rhs_ndim: int):
  """The ``dot_general`` of a two-operand einsum ``'lhs,rhs->out'`` (explicit output, one letter per dim, none
  repeated within an operand): ``(dimension_numbers, summed, order)``, where ``summed`` are each operand's dims summed
  away first (a letter in neither the other operand nor the output) and ``order`` transposes ``dot_general``'s
  (batch, lhs free, rhs free) output into ``out``'s order.

  >>> einsum_dims('BSNH,BTNH->BNTS', 4, 4)
  ((((3,), (3,)), ((0, 2), (0, 2))), ((), ()), (0, 1, 3, 2))
  """
  if not isinstance(subscripts, str):
    raise TypeError(f"einsum subscripts must be a str, got {type(subscripts).__name__}")
  spec = subscripts.replace(" ", "")
  operands, arrow, out = spec.partition("->")
  names = operands.split(",")
  fix = "(for another einsum, pass te_jax's Fp8DotGeneral to jnp.einsum as _dot_general)"
  if not arrow or len(names) != 2 or "." in spec or not all(n.isalpha() for n in names + [out] if n):
    raise ValueError(f"an FP8 einsum takes 'lhs,rhs->out' with letters only (two operands, an explicit output), got "
                     f"{subscripts!r} {fix}")
  ls, rs = names
  for what, n, nd in (("lhs", ls, lhs_ndim), ("rhs", rs, rhs_ndim)):
    if len(set(n)) != len(n) or len(n) != nd:
      raise ValueError(f"einsum {subscripts!r}: {what} {n!r} must name each of its {nd} dims once {fix}")
  if len(set(out)) != len(out) or not set(out) <= set(ls) | set(rs):
    raise ValueError(f"einsum {subscripts!r}: the output {out!r} must name each dim once, from the operands")
  summed = tuple(tuple(i for i, c in enumerate(n) if c not in other and c not in out)
                 for n, other in ((ls, rs), (rs, ls)))
  ls, rs = (''.join(c for i, c in enumerate(n) if i not in drop) for n, drop in zip((ls, rs), summed))
  batch = [c for c in ls if c in rs and c in out]
  contract = [c for c in ls if c in rs and c not in out]
  dims = ((tuple(ls.index(c) for c in contract), tuple(rs.index(c) for c in contract)),
          (tuple(ls.index(c) for c in batch), tuple(rs.index(c) for c in batch)))
  produced = batch + [c for c in ls if c not in rs] + [c for c in rs if c not in ls]
  return dims, summed, tuple(produced.index(c) for c in out)


def fp8_einsum(scope: Scope, recipe: Recipe | None, subscripts: str, lhs, rhs, precision=None,
               preferred_element_type=None, out_sharding=None):
  """``Fp8Einsum``'s call: ``jnp.einsum(subscripts, lhs, rhs)`` as one ``fp8_dot_general`` (lhs the GEMM's input,
  rhs its kernel, whatever order ``jnp.einsum`` would pick), its output transposed into ``subscripts``'s order."""
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dims, (lsum, rsum), order = einsum_dims(subscripts, lhs.ndim, rhs.ndim)
  lhs = jnp.sum(lhs, lsum) if lsum else lhs
  rhs = jnp.sum(rhs, rsum) if rsum else rhs
  if out_sharding is not None and order != tuple(range(len(order))):
    raise ValueError(f"Fp8Einsum: out_sharding needs {subscripts!r}'s output in dot_general's (batch, lhs, rhs) order; "
                     "constrain the output instead")
  y = fp8_dot_general(scope, recipe, lhs, rhs, dims, precision, preferred_element_type, out_sharding)
  return y if order == tuple(range(y.ndim)) else jnp.transpose(y, order)
