"""Mixture-of-experts token permutation: the rows of each token's k choices sorted by expert (what a grouped GEMM over
the experts reads, with its ``group_sizes``) and back, weighted by the combine weights.

``permute(x, experts, num_experts)`` takes the tokens ``x`` (..., H) and the experts ``route`` chose for them (..., k)
and lists the T * k choices ("assignments"; assignment ``t * k + j`` is token t's j-th choice) by expert, stably:
within an expert in token order (then in the order of the choice j). Row r of the result is the token row of its
assignment. The groups follow each other in expert order from row 0; ``group_sizes[e]`` is expert e's row count, its
padding rows included. Every shape is static (known from the shapes and options alone), so routing computed under
``jax.jit`` permutes with no host round trip:

- dropless (the default): each expert gets a row per choice that went to it; T * k rows.
- ``capacity_factor``: each expert keeps at most ``capacity = ceil(capacity_factor * T * k / E)`` rows (Switch
  Transformer's expert capacity, arXiv 2101.03961 §2.2, counted in choices: GShard's for k = 2), the first by token
  order; the choices past it are dropped: they get no row, contribute nothing in ``unpermute`` (the weights of the
  others are not renormalized: a token whose every choice was dropped comes out as zeros, its residual connection
  carrying it, as in Switch), and ``plan.dropped`` reports them. Every group has ``capacity`` rows (its rows past its
  kept ones are padding), so the result reshapes to ``(E, capacity, H)``: a batched GEMM, or a fixed-size all-to-all
  of expert parallelism.
- ``align``: each group's row count is rounded up to a multiple of ``align`` with padding rows. Block-scaled FP8
  GEMMs need aligned groups: the weight gradient contracts each expert's rows, and its operands are quantized in
  1 x B blocks along those rows (1 x 128: DeepSeek-V3, arXiv 2412.19437 §3.3), so with ``align=128`` no block
  straddles two experts. ``te_jax.fused.grouped_dense`` aligns the groups itself (a scatter and a gather of the rows,
  into the same buffer size as here); ``align`` places the rows at their aligned offsets in the permutation's own
  gather instead, for a consumer that takes aligned groups as they come. Dropless, the groups then take at most
  ``T * k + min(T * k, E) * (align - 1)`` rows (rounded down to a multiple of ``align``); the rows past
  ``sum(group_sizes)`` belong to no group.

FP8 tokens: ``x`` may be a ``te_jax.QuantizedTensor`` whose scales cover rows one by one (per tensor, or 1 x B
blocks along H: ``BLOCK_1X128``, MXFP8, NVFP4), without a transposed copy: its data rows and scale rows are permuted
alike (a padding row: zero data, scale 1), the order DeepSeek-V3 uses (§3.3: activations are cast to FP8 before they
are dispatched to the experts), so each token is cast once rather than once per choice, and the rows move in one
byte (or half a byte) each. That path is a gather of FP8 values with no gradient: the op that cast them carries it.

Padding rows (in a group or past every group) are zeros, and whatever a GEMM writes in them, ``unpermute`` never
reads them and gives them a zero gradient. ``unpermute(y, plan, weights)`` is token t's ``sum_j weights[t, j] *
y[row of (t, j)]``, accumulated in float32 in the order j = 0, 1, ... (dropped choices skipped), rounded to ``y``'s
dtype.

Gradients (``custom_vjp``): both directions are gathers, written from the plan's two index maps (``row_of``: an
assignment's row; ``assignment``: a row's assignment), never a scatter-add: ``permute``'s input gradient is the sum
over j of the rows of each token's choices (float32, in j order), ``unpermute``'s ``y`` gradient is each row's token
gradient times its weight, and its weight gradient the dot product of the token's gradient with the row.

The index maps come from one stable ``argsort`` of the expert ids, a ``bincount`` and two scatters of distinct
indices. Expert ids outside ``[0, num_experts)`` are checked where they are concrete; traced (under ``jax.jit``)
they are treated as dropped choices (``plan.dropped``), counted for no expert. A CUDA kernel for the plan, the gather
and the weighted sum would be primitives in ``te_jax.ops`` with the functions here as their references.

>>> import jax.numpy as jnp
>>> from te_jax.fused.moe_permute import permute, unpermute
>>> x = jnp.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
>>> rows, group_sizes, plan = permute(x, jnp.array([[1, 0], [1, 2], [0, 1]]), 3)
>>> rows[:, 0].tolist(), group_sizes.tolist()
([1.0, 3.0, 1.0, 2.0, 3.0, 2.0], [2, 3, 1])
>>> unpermute(2 * rows, plan, jnp.array([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]]))[:, 0].tolist()
[2.0, 4.0, 6.0]
>>> rows, group_sizes, plan = permute(x, jnp.array([[1], [1], [1]]), 3, capacity_factor=1.0)
>>> rows[:, 0].tolist(), group_sizes.tolist(), plan.dropped.tolist()
([0.0, 1.0, 0.0], [1, 1, 1], [[False], [True], [True]])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from te_jax._core.explicit import retype, typed_vjp
from te_jax._core.quantized_tensor import QuantizedTensor

__all__ = ["PermuteConfig", "PermutePlan", "expert_capacity", "permute", "permute_plan", "permute_ref", "unpermute",
           "unpermute_ref"]


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float, align: int = 1) -> int:
  """The rows each expert keeps under ``capacity_factor``: ``ceil(capacity_factor * num_tokens * k / num_experts)``
  (the factor taken as the decimal it prints as: ``1.1 * 100 / 2`` is 55, where float arithmetic gives 55.00000000000001
  and 56), at least 1 and at most ``num_tokens * k`` (all an expert can get), rounded up to a multiple of ``align``.

  >>> expert_capacity(100, 1, 2, 1.1), expert_capacity(64, 2, 8, 1.25), expert_capacity(64, 2, 8, 1.25, align=16)
  (55, 20, 32)
  """
  for name, v in (("num_tokens", num_tokens), ("k", k), ("num_experts", num_experts), ("align", align)):
    if not _is_int(v) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float, np.floating, np.integer))
      or not math.isfinite(capacity_factor) or capacity_factor <= 0):
    raise ValueError(f"capacity_factor must be a finite Python float > 0 (or None: dropless), got {capacity_factor!r}")
  a = num_tokens * k
  c = min(max(math.ceil(Fraction(repr(float(capacity_factor))) * a / num_experts), 1), a)
  return -(-c // align) * align


@dataclasses.dataclass(frozen=True)
class PermuteConfig:
  """The static shape of a permutation (``permute`` builds it from its arguments).

  >>> cfg = PermuteConfig(token_shape=(4, 8), k=2, num_experts=8, capacity=None, align=16)
  >>> cfg.num_assignments, cfg.rows
  (64, 176)

  Attributes:
    token_shape: the tokens' leading dims (``x.shape[:-1]``).
    k: the choices per token.
    num_experts: E.
    capacity: the rows of each group (aligned), or None: dropless.
    align: the multiple each group's row count is rounded up to.
  """

  token_shape: tuple[int, ...]
  k: int
  num_experts: int
  capacity: int | None
  align: int

  @property
  def num_tokens(self) -> int:
    return math.prod(self.token_shape)

  @property
  def num_assignments(self) -> int:
    return self.num_tokens * self.k

  @property
  def rows(self) -> int:
    """The rows of the permuted tokens: ``E * capacity``; dropless, the most the aligned groups can take."""
    if self.capacity is not None:
      return self.num_experts * self.capacity
    a, m = self.num_assignments, self.align
    return (a + min(a, self.num_experts) * (m - 1)) // m * m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PermutePlan:
  """How the tokens were permuted: what ``unpermute`` needs (a pytree; ``config`` is static).

  Attributes:
    row_of: ``(*token_shape, k)`` int32, the row holding each choice; ``config.rows`` for a dropped one.
    assignment: ``(rows,)`` int32, the choice (``t * k + j``) each row holds; ``T * k`` for a padding row.
    tokens_per_expert: ``(E,)`` int32, the choices that went to each expert, the dropped ones included.
    config: the ``PermuteConfig``.
  """

  row_of: jax.Array
  assignment: jax.Array
  tokens_per_expert: jax.Array
  config: PermuteConfig = dataclasses.field(metadata=dict(static=True))

  @property
  def dropped(self) -> jax.Array:
    """``(*token_shape, k)`` bool: the choices that got no row (over capacity, or an expert id out of range)."""
    return self.row_of == self.config.rows


def permute_plan(experts: jax.Array, cfg: PermuteConfig) -> tuple[PermutePlan, jax.Array]:
  """The plan of the permutation of ``experts`` (``(*cfg.token_shape, cfg.k)``, integer) and the groups' row counts
  (``(E,)`` int32): the definition of the layout the module's docstring describes."""
  e, a, rows = cfg.num_experts, cfg.num_assignments, cfg.rows
  # The plan sorts every assignment: on Explicit mesh axes, whose sort takes no sharded dim, the ids are gathered
  # first (an Auto mesh's partitioner gathers them itself).
  flat = retype(experts.reshape(a).astype(jnp.int32), P())
  key = jnp.where((flat >= 0) & (flat < e), flat, e)  # out-of-range ids sort last, counted for no expert
  order = jnp.argsort(key, stable=True).astype(jnp.int32)  # sorted position -> assignment
  counts = jnp.bincount(key, length=e + 1).astype(jnp.int32)  # [e]: the out-of-range ids
  starts = jnp.cumsum(counts) - counts
  sorted_key = key[order]
  pos = jnp.arange(a, dtype=jnp.int32) - starts[sorted_key]  # rank within the expert
  valid = sorted_key < e
  if cfg.capacity is not None:
    group_sizes = jnp.full((e,), cfg.capacity, jnp.int32)
    kept = valid & (pos < cfg.capacity)
    dest = sorted_key * cfg.capacity + pos
  else:
    group_sizes = -(-counts[:e] // cfg.align) * cfg.align
    base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])  # [e]: past every group
    kept = valid
    dest = base[sorted_key] + pos
  dest = jnp.where(kept, dest, rows).astype(jnp.int32)
  row_of = jnp.zeros((a,), jnp.int32).at[order].set(dest, unique_indices=True)
  if cfg.capacity is None and cfg.align == 1:  # the rows are the sorted order, the out-of-range ids' turned padding
    assignment = jnp.where(valid, order, a)
  else:  # distinct out-of-range targets for the dropped, so that every index is unique
    target = jnp.where(kept, dest, rows + jnp.arange(a, dtype=jnp.int32))
    assignment = jnp.full((rows,), a, jnp.int32).at[target].set(order, mode="drop", unique_indices=True)
  plan = PermutePlan(row_of.reshape(*cfg.token_shape, cfg.k), assignment, counts[:e], cfg)
  return plan, group_sizes


def _whole(v: jax.Array) -> jax.Array:
  """``v`` gathered whole on Explicit mesh axes (every gather here indexes rows of any token, and jax's sharded
  gather needs its output's layout spelled out); ``v`` itself elsewhere, where the partitioner places the gathers."""
  return retype(v, P())


def permute_ref(x: jax.Array | QuantizedTensor, plan: PermutePlan) -> jax.Array | QuantizedTensor:
  """``(rows, H)``: row r is the token row of its assignment, zeros for a padding row (for a ``QuantizedTensor``:
  its data and row scales so, a padding row's scales 1)."""
  cfg = plan.config
  token = plan.assignment // cfg.k
  if not isinstance(x, QuantizedTensor):
    return jnp.take(_whole(x).reshape(cfg.num_tokens, x.shape[-1]), token, axis=0, mode="fill", fill_value=0)
  data = jnp.take(_whole(x.data).reshape(cfg.num_tokens, x.shape[-1]), token, axis=0, mode="fill", fill_value=0)
  scales = x.scale_inv
  if x.mode.block is not None:
    scales = jnp.take(_whole(scales).reshape(cfg.num_tokens, scales.shape[-1]), token, axis=0, mode="clip")
    pad = (plan.assignment == cfg.num_assignments)[:, None]
    scales = jnp.where(pad, jnp.ones((), scales.dtype), scales)
  return dataclasses.replace(x, data=data, scale_inv=scales)


def _choice_rows(y: jax.Array, row_of: jax.Array, cfg: PermuteConfig) -> jax.Array:
  """``(T, k, H)``: the row of each choice, zeros for a dropped one."""
  return jnp.take(_whole(y), _whole(row_of).reshape(cfg.num_tokens, cfg.k), axis=0, mode="fill", fill_value=0)


def unpermute_ref(y: jax.Array, plan: PermutePlan, weights: jax.Array) -> jax.Array:
  """``(*token_shape, H)`` in ``y``'s dtype: ``sum_j weights[t, j] * y[row of (t, j)]``, float32, in j order."""
  cfg = plan.config
  rows = _choice_rows(y, plan.row_of, cfg).astype(jnp.float32)
  w = _whole(weights).reshape(cfg.num_tokens, cfg.k).astype(jnp.float32)
  out = w[:, 0, None] * rows[:, 0]
  for j in range(1, cfg.k):
    out = out + w[:, j, None] * rows[:, j]
  return out.astype(y.dtype).reshape(*cfg.token_shape, y.shape[-1])


# ---- gradients ---------------------------------------------------------------------------------------------------


class _PermuteResiduals(NamedTuple):
  row_of: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute(cfg: PermuteConfig, x, row_of, assignment, tokens_per_expert):
  return permute_ref(x, PermutePlan(row_of, assignment, tokens_per_expert, cfg))


def _permute_fwd(cfg: PermuteConfig, x, row_of, assignment, tokens_per_expert):
  return _permute(cfg, x, row_of, assignment, tokens_per_expert), _PermuteResiduals(row_of)


def _permute_bwd(cfg: PermuteConfig, r: _PermuteResiduals, g):
  rows = _choice_rows(g, r.row_of, cfg).astype(jnp.float32)  # (T, k, H)
  dx = rows[:, 0]
  for j in range(1, cfg.k):
    dx = dx + rows[:, j]
  return dx.astype(g.dtype).reshape(*cfg.token_shape, g.shape[-1]), None, None, None


_permute.defvjp(*typed_vjp(_permute_fwd, _permute_bwd, nondiff_argnums=(0,)))


class _UnpermuteResiduals(NamedTuple):
  y: jax.Array
  weights: jax.Array
  row_of: jax.Array
  assignment: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute(cfg: PermuteConfig, y, weights, row_of, assignment, tokens_per_expert):
  return unpermute_ref(y, PermutePlan(row_of, assignment, tokens_per_expert, cfg), weights)


def _unpermute_fwd(cfg: PermuteConfig, y, weights, row_of, assignment, tokens_per_expert):
  out = _unpermute(cfg, y, weights, row_of, assignment, tokens_per_expert)
  return out, _UnpermuteResiduals(y, weights, row_of, assignment)


def _unpermute_bwd(cfg: PermuteConfig, r: _UnpermuteResiduals, g):
  g = _whole(g).reshape(cfg.num_tokens, g.shape[-1]).astype(jnp.float32)
  w_rows = jnp.take(_whole(r.weights).reshape(-1).astype(jnp.float32), r.assignment, mode="fill", fill_value=0)
  g_rows = jnp.take(g, r.assignment // cfg.k, axis=0, mode="fill", fill_value=0)
  dy = (w_rows[:, None] * g_rows).astype(r.y.dtype)
  rows = _choice_rows(r.y, r.row_of, cfg).astype(jnp.float32)  # (T, k, H)
  dw = jnp.einsum("th,tkh->tk", g, rows, precision=jax.lax.Precision.HIGHEST)
  return dy, dw.reshape(r.weights.shape).astype(r.weights.dtype), None, None, None


_unpermute.defvjp(*typed_vjp(_unpermute_fwd, _unpermute_bwd, nondiff_argnums=(0,)))


# ---- the API -----------------------------------------------------------------------------------------------------


def _check_experts(experts: jax.Array, num_experts: int):
  if isinstance(experts, jax.core.Tracer):
    return
  ids = np.asarray(experts)
  if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
    bad = ids[(ids < 0) | (ids >= num_experts)]
    raise ValueError(f"permute: experts holds ids outside [0, num_experts={num_experts}) (e.g. {int(bad[0])}); "
                     "pass the num_experts the router chose from")


def _check_quantized(q: QuantizedTensor):
  if q.data_t is not None:
    raise ValueError("permute: a QuantizedTensor x must come without its transposed copy (whose blocks run along the "
                     "tokens, which permute reorders): quantize it without one, or call x.without_transposed()")
  if q.mode.block is not None and q.mode.block[0] > 1:
    raise ValueError(f"permute: a QuantizedTensor x must be scaled per tensor or per row blocks, got {q.mode.name}, "
                     "whose blocks span rows (tokens): quantize the tokens with a 1 x B mode")
  if q.mode.block is not None and q.scale_inv.shape[:-1] != q.shape[:-1]:
    raise ValueError(f"permute: x's scales {q.scale_inv.shape} do not cover its rows {q.shape[:-1]} one by one")


def permute(x: jax.Array | QuantizedTensor, experts: jax.Array, num_experts: int, *,
            capacity_factor: float | None = None, align: int = 1
            ) -> tuple[jax.Array | QuantizedTensor, jax.Array, PermutePlan]:
  """The rows of each token's chosen experts, sorted by expert (the layout is in the module's docstring).

  >>> import jax.numpy as jnp
  >>> rows, group_sizes, plan = permute(jnp.ones((5, 4)), jnp.zeros((5, 2), jnp.int32), 2, align=4)
  >>> rows.shape, group_sizes.tolist(), int(rows.sum())  # 10 rows of expert 0, 2 of padding, 4 past the groups
  ((16, 4), [12, 0], 40)

  Args:
    x: ``(..., H)`` the tokens, a float array or a ``QuantizedTensor`` (per-tensor or 1 x B scales, no transposed
      copy).
    experts: ``(..., k)`` integer, each token's experts (``route``'s ``experts``), the same leading dims as ``x``.
    num_experts: E, the number of groups.
    capacity_factor: None (dropless) or the factor of ``expert_capacity``: each expert keeps at most that many rows.
    align: each group's row count is a multiple of this (1: none; 128 for 1 x 128 FP8 blocks along the tokens).

  Returns:
    ``(rows, group_sizes, plan)``: ``(plan.config.rows, H)`` in ``x``'s dtype (a ``QuantizedTensor`` for one),
    ``(E,)`` int32, what ``unpermute`` needs.
  """
  quantized = isinstance(x, QuantizedTensor)
  if quantized:
    _check_quantized(x)
  else:
    x = jnp.asarray(x)
  experts = jnp.asarray(experts)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"permute: x must be a floating-point array, got {jnp.dtype(x.dtype).name}")
  if not jnp.issubdtype(experts.dtype, jnp.integer):
    raise TypeError(f"permute: experts must be an integer array (route's experts), got {jnp.dtype(experts.dtype).name}")
  if len(x.shape) < 2 or experts.ndim != len(x.shape) or experts.shape[:-1] != tuple(x.shape[:-1]):
    raise ValueError(f"permute: x (..., H) and experts (..., k) must share their leading (token) dims, got x "
                     f"{x.shape} and experts {experts.shape}")
  if not _is_int(num_experts) or num_experts < 1:
    raise ValueError(f"permute: num_experts must be a positive int, got {num_experts!r}")
  if not _is_int(align) or align < 1:
    raise ValueError(f"permute: align must be a positive int (1: no alignment), got {align!r}")
  token_shape, k = tuple(x.shape[:-1]), int(experts.shape[-1])
  if k < 1 or math.prod(token_shape) < 1:
    raise ValueError(f"permute: experts {experts.shape} must hold at least one token and one choice per token")
  _check_experts(experts, num_experts)
  capacity = None
  if capacity_factor is not None:
    capacity = expert_capacity(math.prod(token_shape), k, num_experts, capacity_factor, align)
  cfg = PermuteConfig(token_shape=token_shape, k=k, num_experts=int(num_experts), capacity=capacity, align=int(align))
  plan, group_sizes = permute_plan(experts, cfg)
  if quantized:
    return permute_ref(x, plan), group_sizes, plan
  rows = _permute(cfg, x, plan.row_of, plan.assignment, plan.tokens_per_expert)
  return rows, group_sizes, plan


def unpermute(y: jax.Array, plan: PermutePlan, weights: jax.Array) -> jax.Array:
  """Each token's weighted sum over its chosen experts' rows of ``y`` (the expert outputs, in ``permute``'s rows).

  Args:
    y: ``(plan.config.rows, N)`` float, the rows ``permute`` laid out after the experts (padding rows are ignored).
    plan: ``permute``'s plan.
    weights: ``(..., k)`` float, the combine weights (``route``'s ``weights``), the leading dims of ``permute``'s x.

  Returns:
    ``(..., N)`` in ``y``'s dtype.
  """
  y, weights = jnp.asarray(y), jnp.asarray(weights)
  if not isinstance(plan, PermutePlan):
    raise TypeError(f"unpermute: plan must be the PermutePlan permute returned, got {type(plan).__name__}")
  cfg = plan.config
  if not jnp.issubdtype(y.dtype, jnp.floating):
    raise TypeError(f"unpermute: y must be a floating-point array, got {jnp.dtype(y.dtype).name}")
  if y.ndim != 2 or y.shape[0] != cfg.rows:
    raise ValueError(f"unpermute: y must be (rows, N) with the {cfg.rows} rows permute returned, got {y.shape}")
  if not jnp.issubdtype(weights.dtype, jnp.floating):
    raise TypeError(f"unpermute: weights must be a floating-point array, got {jnp.dtype(weights.dtype).name}")
  if weights.shape != (*cfg.token_shape, cfg.k):
    raise ValueError(f"unpermute: weights must have shape {(*cfg.token_shape, cfg.k)} (the tokens' k choices), got "
                     f"{weights.shape}")
  return _unpermute(cfg, y, weights, plan.row_of, plan.assignment, plan.tokens_per_expert)
