"""``dot_general``: ``jax.lax.dot_general`` with any dimension numbers, its GEMMs in FP8 under ``te_jax.autocast``.

The operands are put into the canonical form of te_jax's GEMM around it: each operand's dims reordered to (batch,
free, contracting), so that every batch index is one (M, K) x (N, K) product. Reorders that are the identity cost
nothing; the others are one transpose of the high-precision operand, before its quantize.

- No batch dims: the GEMM of ``te_jax.dense`` (lhs the layer input, rhs the kernel, every recipe), rhs reordered
  to (contracting, free) in lhs's contracting order.
- Batch dims (attention's ``'BSNH,BTNH->BNTS'``): te_jax's strided batched GEMM (``te_jax.ops.gemm.gemm(...,
  batched=True)``: one cuBLASLt launch for the whole batch, a sharded batch kept sharded with no collective), each
  operand quantized once by te_jax's quantize with one scale for the whole operand (per-tensor recipes:
  ``DelayedScaling``, ``Float8CurrentScaling``) and its per-batch transposed copy written in the same pass, the
  K-major operand of the backward GEMM that contracts its other dim. The backward quantizes the output gradient once
  (with its transposed copy) and runs the dgrad and wgrad on the forward's transposed FP8 copies; the three GEMMs
  accumulate as the recipe's ``fp8_gemm_fprop`` / ``_dgrad`` / ``_wgrad`` say, as ``te_jax.dense``'s do. The rows
  of each batch index are padded with zeros to a multiple of 16 (the weight gradient contracts over them).
  (A ``dot_general`` of the FP8 arrays in float32 is not rewritten by XLA:GPU into its FP8 GEMM: it ran as a
  float32 GEMM, slower than bfloat16.)

The roles of the state are those of ``te_jax.dense``: lhs is ``"x"``, rhs ``"kernel"``, the output gradient
``"grad"``; the updated state leaves the backward pass as ``fp8_meta``'s gradient, as it does there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode
from te_jax._core.scaling import FP8_RESIDUAL
from te_jax.fused.dense import dense, normalize_axes
from te_jax.fused.linear import (Fp8Config, fp8_dims_aligned, fp8_recipe, instantiate, keep_state, keeps_state,
                                 primal_values, state_as_float32, state_like)
from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.ops.gemm import FP8_ALIGN, gemm
from te_jax.recipe import Recipe

__all__ = ["DotGeneralDims", "dot_general"]


@dataclasses.dataclass(frozen=True)
class DotGeneralDims:
  """``jax.lax.dot_general``'s dimension numbers, checked against the operands' shapes and normalized (non-negative,
  tuples), with the reorders into the canonical (batch, free, contracting) form.

  >>> d = DotGeneralDims.of((((2,), (1,)), ((), ())), (2, 8, 32), (4, 32, 16))
  >>> d.lhs_free, d.rhs_free, d.out_shape((2, 8, 32), (4, 32, 16))
  ((0, 1), (0, 2), (2, 8, 4, 16))
  """

  lhs_contract: tuple[int, ...]
  rhs_contract: tuple[int, ...]
  lhs_batch: tuple[int, ...]
  rhs_batch: tuple[int, ...]
  lhs_free: tuple[int, ...]
  rhs_free: tuple[int, ...]

  @classmethod
  def of(cls, dimension_numbers, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> "DotGeneralDims":
    try:
      (lc, rc), (lb, rb) = dimension_numbers
      lc, rc, lb, rb = (tuple(int(a) for a in ((d,) if isinstance(d, int) else d)) for d in (lc, rc, lb, rb))
    except (TypeError, ValueError):
      raise TypeError(f"dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), got "
                      f"{dimension_numbers!r}") from None
    lnd, rnd = len(lhs_shape), len(rhs_shape)
    lc, lb = normalize_axes(lc, lnd, "lhs contracting"), normalize_axes(lb, lnd, "lhs batch")
    rc, rb = normalize_axes(rc, rnd, "rhs contracting"), normalize_axes(rb, rnd, "rhs batch")
    if len(lc) != len(rc) or len(lb) != len(rb):
      raise ValueError(f"dimension_numbers {dimension_numbers!r}: lhs and rhs name different numbers of contracting "
                       "or batch dims")
    for side, c, b in (("lhs", lc, lb), ("rhs", rc, rb)):
      if set(c) & set(b):
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: {side} dims {sorted(set(c) & set(b))} are both "
                         "contracting and batch dims")
    for what, ls, rs in (("contracting", lc, rc), ("batch", lb, rb)):
      sizes = tuple(lhs_shape[a] for a in ls), tuple(rhs_shape[a] for a in rs)
      if sizes[0] != sizes[1]:
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: the {what} dims have sizes {sizes[0]} in lhs "
                         f"{tuple(lhs_shape)} and {sizes[1]} in rhs {tuple(rhs_shape)}")
    free = lambda nd, c, b: tuple(a for a in range(nd) if a not in c and a not in b)  # noqa: E731
    return cls(lc, rc, lb, rb, free(lnd, lc, lb), free(rnd, rc, rb))

  def out_shape(self, lhs_shape, rhs_shape) -> tuple[int, ...]:
    """``jax.lax.dot_general``'s output shape: (batch, lhs free, rhs free)."""
    return tuple(lhs_shape[a] for a in self.lhs_batch + self.lhs_free) + tuple(rhs_shape[a] for a in self.rhs_free)

  @property
  def dimension_numbers(self):
    return (self.lhs_contract, self.rhs_contract), (self.lhs_batch, self.rhs_batch)


def _reorder(x: jax.Array, order: tuple[int, ...]) -> jax.Array:
  return x if order == tuple(range(x.ndim)) else jnp.transpose(x, order)


# ---- the batched FP8 GEMM ----------------------------------------------------------------------------------------


class _BatchedResiduals(NamedTuple):
  lhs_t: QuantizedTensor  # (B, K, M) FP8: the wgrad's rhs
  rhs_t: QuantizedTensor  # (B, K, N) FP8: the dgrad's rhs
  amax_lhs: jax.Array
  amax_rhs: jax.Array
  meta: DenseFp8Meta | None  # as the caller passed it (its dtype is the update's)


def _saved(t: QuantizedTensor) -> QuantizedTensor:
  """A transposed copy kept for the backward pass, its data named ``FP8_RESIDUAL`` for ``jax.checkpoint`` policies."""
  t = t.transposed()
  return dataclasses.replace(t, data=checkpoint_name(t.data, FP8_RESIDUAL))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _batched_fp8(cfg: Fp8Config, lhs, rhs, meta):
  return _batched_forward(cfg, lhs, rhs, meta)[0]


def _batched_fp8_fwd(cfg: Fp8Config, *primals):
  return _batched_forward(cfg, *primal_values(primals, trained=(1,), states=(2,)))


def _batched_forward(fp8: Fp8Config, lhs, rhs, meta_in):
  meta = state_as_float32(meta_in)
  q = fp8.quantizer
  # Each with its per-batch transposed copy ((B, K, M), (B, K, N)), written by the same kernel.
  ql = q.quantize("x", meta and meta.x, lhs, fp8.fwd_dtype, transpose=True)
  qr = q.quantize("kernel", meta and meta.kernel, rhs, fp8.fwd_dtype, shard_axes=fp8.kernel_axes, transpose=True)
  out = gemm(ql.out.without_transposed(), qr.out.without_transposed(), batched=True, dtype=fp8.out_dtype,
             fast_accum=not fp8.recipe.fp8_gemm_fprop.use_split_accumulator)  # (B, M, K) x (B, N, K) -> (B, M, N)
  return out, _BatchedResiduals(_saved(ql.out), _saved(qr.out), ql.amax, qr.amax, meta_in)


def _batched_fp8_bwd(fp8: Fp8Config, r: _BatchedResiduals, g):
  meta = state_as_float32(r.meta)
  recipe = fp8.recipe
  # (B, M, N) and its transposed copy (B, N, M)
  qg = fp8.quantizer.quantize("grad", meta and meta.grad, instantiate(g), fp8.bwd_dtype, transpose=True)
  # g[b] @ rhs[b]: (M, N) x (K, N)^T
  dlhs = gemm(qg.out.without_transposed(), r.rhs_t, batched=True, dtype=fp8.out_dtype,
              fast_accum=not recipe.fp8_gemm_dgrad.use_split_accumulator)
  # g[b]^T @ lhs[b]: (N, M) x (K, M)^T
  drhs = gemm(qg.out.transposed(), r.lhs_t, batched=True, dtype=fp8.kernel_dtype,
              fast_accum=not recipe.fp8_gemm_wgrad.use_split_accumulator)
  new_meta = None
  if meta is not None:
    new_meta = state_like(fp8.quantizer.update([(meta, r.amax_lhs, r.amax_rhs, qg.amax)])[0], r.meta)
  return dlhs, drhs, new_meta


_batched_fp8.defvjp(_batched_fp8_fwd, _batched_fp8_bwd, symbolic_zeros=True)


def _batched(lhs, rhs, d: DotGeneralDims, meta, recipe: Recipe):
  """The (batch, lhs free, rhs free) product of the FP8 batched GEMM."""
  cfg = Fp8Config.of(recipe, lhs, rhs, None)
  modes = {cfg.quantizer.mode_for(role) for role in ("x", "kernel", "grad")}
  if modes != {ScalingMode.PER_TENSOR}:
    raise ValueError(f"te_jax.dot_general with batch dims {d.lhs_batch} (lhs) and {d.rhs_batch} (rhs) runs per-tensor "
                     f"recipes only (DelayedScaling, Float8CurrentScaling), got {type(recipe).__name__}: give this "
                     "call recipe=te_jax.recipe.DelayedScaling() or Float8CurrentScaling(), or run it outside autocast")
  batch = tuple(lhs.shape[a] for a in d.lhs_batch)
  lhs_rows, rhs_rows = (tuple(x.shape[a] for a in free) for x, free in ((lhs, d.lhs_free), (rhs, d.rhs_free)))
  b, m, n, k = math.prod(batch), math.prod(lhs_rows), math.prod(rhs_rows), math.prod(lhs.shape[a] for a in
                                                                                       d.lhs_contract)
  l3 = jnp.reshape(_reorder(lhs, d.lhs_batch + d.lhs_free + d.lhs_contract), (b, m, k))
  r3 = jnp.reshape(_reorder(rhs, d.rhs_batch + d.rhs_free + d.rhs_contract), (b, n, k))
  pad = -m % FP8_ALIGN  # zero rows: no amax, output or gradient changes
  if pad:
    l3 = jnp.pad(l3, ((0, 0), (0, pad), (0, 0)))
  out = _batched_fp8(cfg, l3, r3, meta if keeps_state(recipe) else None)
  return jnp.reshape(out[:, :m] if pad else out, batch + lhs_rows + rhs_rows)


# ---- the op ------------------------------------------------------------------------------------------------------


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, preferred_element_type=None, *,
                fp8_meta: DenseFp8Meta | None = None, recipe: Recipe | None = None,
                out_sharding: P | NamedSharding | None = None) -> jax.Array:
  """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` whose GEMMs (forward, dgrad, wgrad) run in FP8 under
  ``autocast(enabled=True)`` (or an explicit ``recipe``); otherwise ``jax.lax.dot_general`` itself.

  >>> import jax.numpy as jnp, te_jax
  >>> from te_jax.fused.dot_general import dot_general
  >>> q, k = jnp.ones((2, 32, 4, 16)), jnp.ones((2, 48, 4, 16))  # (B, S, N, H), (B, T, N, H)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.Float8CurrentScaling()):
  ...   s = dot_general(k, q, (((3,), (3,)), ((0, 2), (0, 2))))  # jnp.einsum('BTNH,BSNH->BNTS', k, q)
  >>> s.shape
  (2, 4, 48, 32)

  Args:
    lhs, rhs: the operands, float arrays. Under FP8, lhs is quantized as a layer's input (``"x"``), rhs as its kernel
      and the output gradient as ``"grad"``, with ``fp8_meta``'s states; the output is in the promotion of their
      dtypes (``preferred_element_type`` when given).
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``, as ``jax.lax.dot_general``.
    precision: ``jax.lax.dot_general``'s, for the high-precision GEMM (FP8 GEMMs accumulate as the recipe says).
    preferred_element_type: the output dtype (None: the operands' promotion).
    fp8_meta: the GEMM's scaling state (``DenseFp8Meta``) for a recipe that keeps one (``DelayedScaling``).
    recipe: overrides the autocast recipe for this call.
    out_sharding: the output's sharding, as ``jax.lax.dot_general``'s (without batch dims only, where ``te_jax.dense``
      takes it).

  Without batch dims every recipe runs (``te_jax.dense``'s GEMM). With batch dims, te_jax's strided batched FP8 GEMM
  runs every batch index in one launch, and each operand has one scale for the whole of it: per-tensor recipes only
  (a block-scaled one raises, naming the per-tensor recipes to pass for this call). A GEMM whose
  contracted or per-batch output size is not a multiple of 16 runs in high precision, its state handed back
  unchanged, as ``te_jax.dense``'s does.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"te_jax.dot_general: {name} must be a float array, got {x.dtype}")
  d = DotGeneralDims.of(dimension_numbers, lhs.shape, rhs.shape)
  recipe = fp8_recipe(recipe, fp8_meta=fp8_meta)
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  out_dtype = dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  high = functools.partial(jax.lax.dot_general, dimension_numbers=d.dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type)
  if recipe is None:
    return high(lhs, rhs, out_sharding=out_sharding)
  if d.lhs_batch:
    if out_sharding is not None:
      raise ValueError("te_jax.dot_general: out_sharding is taken without batch dims only; constrain the output instead")
    k = math.prod(lhs.shape[a] for a in d.lhs_contract)
    n = math.prod(rhs.shape[a] for a in d.rhs_free)
    if not fp8_dims_aligned(k, n):
      if keeps_state(recipe):
        lhs = keep_state(lhs, fp8_meta)
      return high(lhs, rhs)
    return _batched(lhs.astype(dtype), rhs, d, fp8_meta, recipe).astype(out_dtype)
  kernel = _reorder(rhs, d.rhs_contract + d.rhs_free)
  out = dense(lhs.astype(dtype), kernel, axis=d.lhs_contract, fp8_meta=fp8_meta, recipe=recipe, precision=precision,
              out_sharding=out_sharding)
  return out.astype(out_dtype)
