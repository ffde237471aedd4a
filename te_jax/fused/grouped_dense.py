"""``grouped_dense``: the expert GEMM of a mixture-of-experts layer, ``x[m] @ kernel[g(m)] + bias[g(m)]`` for tokens
sorted by expert, with FP8 GEMMs in the forward and backward passes.

``x`` (M, K) holds the tokens sorted by group (expert), ``group_sizes`` (G,) how many rows each group has (the rows
past their sum give zeros), ``kernel`` (G, K, N) one matrix per group. The group sizes are traced like any other
value: nothing reads them on the host, so a jitted (and CUDA-graph captured) step is compiled once for every routing.

Under FP8 every tensor is quantized per group:

- per-tensor recipes (``DelayedScaling``, ``Float8CurrentScaling``): each group's rows of ``x`` and of the output
  gradient get a scale of their own (``te_jax.ops.grouped_gemm.quantize_by_group``), from the group's amax under
  current scaling, from the group's state under delayed scaling; each expert's kernel is quantized on its own by the
  recipe's quantizer (``vmap`` over the experts). Delayed scaling keeps one state per expert: ``fp8_meta`` is a
  ``DenseFp8Meta`` whose amax histories are (G, L) and scales (G,) (``grouped_fp8_meta``); the backward pass rolls
  each group's amaxes into its histories, and the new state leaves as ``fp8_meta``'s gradient, as ``te_jax.dense``
  does, so a train step that differentiates the whole variables dict keeps it current. The update of all G states is
  one ``Quantizer.update`` call: when any amax of the step is not finite, every group's state stays as it was.
- block-scaled recipes (``Float8BlockScaling``, ``MXFP8BlockScaling``, ``NVFP4BlockScaling``): the recipe's
  quantizer casts ``x`` and the gradient whole (their blocks run along the features, within a row) and each expert's
  kernel on its own (NVFP4: a global scale per expert). The weight gradient contracts over the tokens, and its
  operands' 1 x B blocks run along them: a block straddling two groups would scale both groups' values by one amax,
  and no grouped kernel could split it.

Why the groups are padded rather than checked: whether a group's size is a multiple of the block is known only at
run time (the sizes are traced), so it cannot raise before XLA runs, and rounding blocks to groups inside the
quantize would give a scale layout of its own. Instead every FP8 GEMM runs on a group-aligned layout: each group's
rows are placed at a multiple of ``align`` (the token block: 128 for 1 x 128 blocks, 32 for MXFP8, 16 for NVFP4; for
per-tensor scaling the CUDA grouped GEMM's tile where it runs, ``te_jax.ops.grouped_gemm.native_tile()``, else
``te_jax.ops.gemm.FP8_ALIGN``, the multiple an FP8 GEMM's contracted dim needs) with zero
rows up to the next one, in a buffer of ``round_up(M + min(G, M) * (align - 1), align)`` rows, the most that any
routing needs. Zero rows change no amax, no output and no gradient (NVFP4's Hadamard transform mixes them into a
block of 16 tokens of their group only, and cancels in the product), so the result is the per-group one exactly;
the padding costs at most ``min(G, M) * (align - 1)`` rows of each GEMM and one scatter and gather of the rows.

Rows laid out once: ``te_jax.permute(..., align=group_align(recipe, kernel.shape))`` already places each group at
a multiple of the alignment, its size rounded up with zero rows. ``grouped_dense(..., groups_aligned=True)`` takes
such rows as they come: the GEMMs run on ``x`` itself, with no scatter or gather, and give the same values as the
padded layout (the zero rows are the same rows). Concrete ``group_sizes`` that are not multiples of
``group_align`` raise; traced ones are the caller's promise: a group that breaks it shares a scale block (or, per
tensor, an FP8 GEMM's 16-row granule) with the next group's rows. A bias is added to every row of a group, its
padding rows too: a consumer that feeds the output to another GEMM zeroes those rows first (their amax counts).

Without FP8 (no autocast, or a K or N that an FP8 GEMM cannot take) the same ``custom_vjp`` runs the grouped GEMMs
in ``x``'s dtype with float32 accumulation, and a delayed-scaling state is handed back unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from te_jax._core import scaling
from te_jax._core.explicit import typed_vjp
from te_jax._core.manual_axes import varying_axes
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode
from te_jax.fused.linear import (Fp8Config, as_arrays, fp8_dims_aligned, fp8_recipe, instantiate, keep_state,
                                 keeps_state, primal_values, state_as_float32, state_like)
from te_jax.fused.quantizer import ROLES, DenseFp8Meta, Quantizer, quantizer_for
from te_jax.ops.gemm import FP8_ALIGN
from te_jax.ops.grouped_gemm import (check_group_sizes, group_amax, group_ids, grouped_gemm, native_tile,
                                     quantize_by_group)
from te_jax.recipe import Recipe

__all__ = ["GroupedConfig", "GroupedResiduals", "QuantizedRows", "check_grouped_meta", "grouped_config",
           "group_align", "grouped_dense", "grouped_dense_bwd", "grouped_dense_fwd", "grouped_fp8_meta",
           "token_align"]


def grouped_fp8_meta(groups: int, history_len: int) -> DenseFp8Meta:
  """A fresh delayed-scaling state of a ``grouped_dense`` of ``groups`` experts: ``DenseFp8Meta`` with (groups,
  history_len) amax histories (zeros) and (groups,) scales (ones), one per expert.

  >>> import te_jax.fused.grouped_dense as gd
  >>> meta = gd.grouped_fp8_meta(4, 16)
  >>> meta.kernel.amax_history.shape, meta.grad.scale.shape
  ((4, 16), (4,))
  """
  if not isinstance(groups, int) or groups < 1:
    raise ValueError(f"groups must be an int >= 1, got {groups!r}")
  one = DenseFp8Meta.create(history_len)
  return jax.tree.map(lambda v: jnp.broadcast_to(v, (groups, *v.shape)), one)


def _quantizer_align(quantizer: Quantizer) -> int:
  """Block-scaled: the token dim's block; per tensor: the CUDA grouped GEMM's tile where it runs
  (``native_tile``), else ``FP8_ALIGN``."""
  blocks = [quantizer.mode_for(role).block for role in ("x", "grad")]
  if all(b is None for b in blocks):
    return max(FP8_ALIGN, native_tile())
  return max([FP8_ALIGN, *(b[1] for b in blocks if b is not None)])


def _tile(cfg: "GroupedConfig", rows: int) -> int | None:
  """The tile the grouped GEMMs promise on a layout of ``rows`` rows (each group a multiple of ``cfg.align``):
  the CUDA handler's where the alignment is a multiple of it, else None (the reference)."""
  tile = native_tile()
  if not tile or cfg.align % tile or rows % cfg.align:
    return None
  return cfg.align


def token_align(fp8: Fp8Config | None) -> int:
  """The multiple each group's rows are padded to in the FP8 layout: the token dim's block of the transposed input
  and gradient (the weight gradient's operands), and at least ``FP8_ALIGN``; 1 without FP8."""
  return 1 if fp8 is None else _quantizer_align(fp8.quantizer)


def group_align(recipe: Recipe | Quantizer | None, kernel_shape: tuple[int, ...] | None = None) -> int:
  """The multiple each group's row count must be for ``grouped_dense(..., groups_aligned=True)`` under ``recipe``
  (or its quantizer; None: no FP8): 1 without FP8 or where the kernel's ``(G, K, N)`` shape has a K or N an FP8
  GEMM cannot take (the GEMMs then run in high precision), else the token dim's block of the weight gradient's
  operands and at least ``te_jax.ops.gemm.FP8_ALIGN``. What ``te_jax.permute``'s ``align`` takes.

  >>> import te_jax.recipe as recipe
  >>> from te_jax.fused.grouped_dense import group_align
  >>> group_align(recipe.DelayedScaling()), group_align(recipe.Float8BlockScaling(), (8, 256, 512))
  (16, 128)
  >>> group_align(recipe.Float8BlockScaling(), (8, 256, 20)), group_align(None)
  (1, 1)
  """
  if recipe is None:
    return 1
  if isinstance(recipe, Recipe):
    recipe = quantizer_for(recipe)
  if not isinstance(recipe, Quantizer):
    raise TypeError(f"group_align: recipe must be a te_jax.recipe Recipe, its Quantizer or None, got "
                    f"{type(recipe).__name__}")
  if kernel_shape is not None:
    if len(kernel_shape) != 3:
      raise ValueError(f"group_align: kernel_shape must be the kernel's (G, K, N), got {tuple(kernel_shape)}")
    if not fp8_dims_aligned(kernel_shape[1], kernel_shape[2]):
      return 1
  return _quantizer_align(recipe)


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
  """The static parameters of one ``grouped_dense`` (``grouped_config`` builds it).

  Attributes:
    fp8: the FP8 GEMMs' config; None: high precision.
    align: each group's rows start at a multiple of it in the GEMMs' layout (``token_align``).
    out_dtype: the compute dtype (x's): the output's and the input gradient's.
    kernel_dtype: the kernel gradient's dtype.
    bias_dtype: the bias gradient's dtype; None: no bias.
    group_axes: inside ``jax.shard_map``, the manual mesh axes the groups are sharded over (expert parallelism: each
      device holds other experts): current scaling's per-group and per-kernel amaxes are max-reduced over the other
      axes their values vary over, never over these, which hold other groups.
    groups_aligned: the rows arrive in the group-aligned layout (each group's size a multiple of ``align``): the
      GEMMs run on them as they are.
  """

  fp8: Fp8Config | None
  align: int
  out_dtype: jnp.dtype
  kernel_dtype: jnp.dtype
  bias_dtype: jnp.dtype | None
  group_axes: frozenset[str] = frozenset()
  groups_aligned: bool = False

  def padded_rows(self, rows: int, groups: int) -> int:
    """The rows of the group-aligned layout: enough for any group sizes summing to at most ``rows``."""
    if self.align == 1:
      return rows
    need = rows + min(groups, rows) * (self.align - 1)
    return -(-need // self.align) * self.align


class _Layout(NamedTuple):
  """Where each row of x goes in the group-aligned layout, and the groups' sizes there."""

  positions: jax.Array | None  # (M,) int32, the padded row count for rows past the groups; None: the identity
  sizes: jax.Array  # (G,) int32: each group's size rounded up to the alignment (all -1 where the sizes are invalid)
  rows: int  # the layout's rows

  def scatter(self, x: jax.Array) -> jax.Array:
    if self.positions is None:
      return x
    return jnp.zeros((self.rows, *x.shape[1:]), x.dtype).at[self.positions].set(x, mode="drop")

  def gather(self, y: jax.Array) -> jax.Array:
    if self.positions is None:
      return y
    return jnp.take(y, self.positions, axis=0, mode="fill", fill_value=0)


def _layout(cfg: GroupedConfig, group_sizes: jax.Array, rows: int) -> _Layout:
  groups = group_sizes.shape[0]
  if cfg.align == 1 or cfg.groups_aligned:
    return _Layout(None, group_sizes, rows)
  padded_rows = cfg.padded_rows(rows, groups)
  sizes = group_sizes.astype(jnp.int32)
  padded = -(-sizes // cfg.align) * cfg.align
  valid = jnp.all(sizes >= 0) & (jnp.sum(sizes) <= rows)
  starts, aligned_starts = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
  ids = group_ids(sizes, rows)
  g = jnp.minimum(ids, groups - 1)
  positions = aligned_starts[g] + jnp.arange(rows, dtype=jnp.int32) - starts[g]
  positions = jnp.where(ids < groups, positions, padded_rows)
  return _Layout(positions, jnp.where(valid, padded, -1), padded_rows)


class QuantizedRows(NamedTuple):
  """Rows (M, K) that arrive already cast by the recipe's quantizer for their role (``"x"`` in the forward pass,
  ``"grad"`` in the backward), such as tokens received in FP8 from another device
  (``te_jax.fused.expert_parallel``), in place of their high-precision values.

  Attributes:
    q: a ``QuantizedTensor`` (M, K) without a transposed copy. Per-tensor recipes: ``scale_inv`` (G,), each group's
      rows cast with the scale ``grouped_dense`` would give them (the group's state under delayed scaling, the
      scale of the group's amax under current scaling). Block-scaled recipes: 1 x B row scales (``BLOCK_1X128``,
      ``MXFP8_1X32``; NVFP4's per-tensor global scale cannot be split by rows).
    amax: per-tensor recipes, (G,) float32, each group's ``max|x|`` before the cast (what delayed scaling records);
      None for block-scaled ones.
  """

  q: QuantizedTensor
  amax: jax.Array | None


class GroupedResiduals(NamedTuple):
  """What ``grouped_dense_fwd`` keeps for ``grouped_dense_bwd``."""

  x_t: QuantizedTensor | jax.Array  # the transposed input (K, rows of the layout), FP8 or x's dtype
  w: QuantizedTensor | jax.Array  # the kernels (G, K, N), FP8 or x's dtype
  group_sizes: jax.Array
  amax_x: jax.Array | None  # (G,) per-tensor recipes only
  amax_w: jax.Array | None
  meta: DenseFp8Meta | None  # as the caller passed it (its dtype is the update's)


def _saved(t):
  """A residual of the backward pass, its data named ``FP8_RESIDUAL`` for ``jax.checkpoint`` policies."""
  if isinstance(t, QuantizedTensor):
    return dataclasses.replace(t.without_transposed(), data=checkpoint_name(t.data, scaling.FP8_RESIDUAL))
  return t


def _quantize_rows(cfg: GroupedConfig, role: str, state, x: jax.Array | QuantizedRows, sizes: jax.Array, dtype):
  """``x`` (rows of the layout, features), its rows grouped by ``sizes``, quantized with its transposed copy; and
  each group's amax for per-tensor recipes (None for block-scaled ones, which keep no state).

  Per tensor, each group's scale is the quantizer's scale of a tensor holding that group's rows: a per-tensor
  quantizer reads a tensor only through its amax (max|x|), so the group's amax, as a tensor of one element, stands
  for its rows (current scaling: the scale from it; delayed scaling: the state's scale, or in a calibration pass the
  scale from it).

  Rows that arrive quantized (``QuantizedRows``, laid out) keep their codes; their transposed copy is the same bytes
  transposed per tensor, and for 1 x B blocks (which run along the tokens in the copy) the cast of their dequantized
  values."""
  quantizer = cfg.fp8.quantizer
  if isinstance(x, QuantizedRows):
    q = x.q
    if q.mode is ScalingMode.PER_TENSOR:
      return dataclasses.replace(q, data_t=q.data.T, scale_inv_t=q.scale_inv), x.amax
    copy = quantizer.quantize(role, None, q.dequantize(cfg.out_dtype).T, dtype).out
    return dataclasses.replace(q, data_t=copy.data, scale_inv_t=copy.scale_inv), None
  if quantizer.mode_for(role) is ScalingMode.PER_TENSOR:
    amax = group_amax(x, sizes)
    axes = varying_axes(amax) - cfg.group_axes if cfg.group_axes else None
    scale = jax.vmap(lambda s, a: quantizer.scale(s, a.reshape(1), dtype, axes))(state, amax)
    return quantize_by_group(x, scale, sizes, dtype, transpose=True), amax
  return quantizer.quantize(role, None, x, dtype, transpose=True, transpose_batch_dims=0).out, None


def _quantize_kernels(cfg: GroupedConfig, state, kernel: jax.Array):
  """Each expert's (K, N) kernel quantized on its own by the recipe's quantizer, with its transposed copy (N, K)."""
  fp8 = cfg.fp8
  axes = fp8.kernel_axes
  if cfg.group_axes:
    axes = (varying_axes(kernel) if axes is None else axes) - cfg.group_axes

  def one(s, w):
    out = fp8.quantizer.quantize("kernel", s, w, fp8.fwd_dtype, shard_axes=axes, transpose=True)
    return out.out, out.amax

  return jax.vmap(one)(state, kernel)


def _scatter_rows(layout: _Layout, x: jax.Array | QuantizedRows) -> jax.Array | QuantizedRows:
  """``x`` in the group-aligned layout; quantized rows with their row scales (the padding rows: zeros, scale 1)."""
  if not isinstance(x, QuantizedRows):
    return layout.scatter(x)
  q = x.q
  if layout.positions is None:
    return x
  data = layout.scatter(q.data)
  if q.mode.block is None:
    return x._replace(q=dataclasses.replace(q, data=data))
  scales = jnp.ones((layout.rows, q.scale_inv.shape[1]), q.scale_inv.dtype).at[layout.positions].set(
      q.scale_inv, mode="drop")
  return x._replace(q=dataclasses.replace(q, data=data, scale_inv=scales))


def _bias_rows(bias: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
  """Each row's group's bias (rows past the groups: zeros), float32."""
  padded = jnp.concatenate([bias.astype(jnp.float32), jnp.zeros((1, bias.shape[1]), jnp.float32)])
  return padded[group_ids(group_sizes, rows)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(cfg: GroupedConfig, x, kernel, bias, group_sizes, meta):
  return grouped_dense_fwd(cfg, x, kernel, bias, group_sizes, meta)[0]


def _grouped_fwd(cfg: GroupedConfig, *primals):
  return grouped_dense_fwd(cfg, *primal_values(primals, trained=(1,), states=(4,)))


def grouped_dense_fwd(cfg: GroupedConfig, x: jax.Array | QuantizedRows, kernel: jax.Array, bias: jax.Array | None,
                      group_sizes: jax.Array, meta_in: DenseFp8Meta | None
                      ) -> tuple[jax.Array, GroupedResiduals]:
  """The forward pass of ``grouped_dense`` (its arguments checked, ``cfg`` from ``grouped_config``): the output and
  what ``grouped_dense_bwd`` needs, for a fused op that runs the grouped GEMM inside its own ``custom_vjp``. Under
  FP8, ``x`` may arrive quantized (``QuantizedRows``)."""
  rows = x.q.shape[0] if isinstance(x, QuantizedRows) else x.shape[0]
  fp8 = cfg.fp8
  layout = _layout(cfg, group_sizes, rows)
  if fp8 is None:
    w = kernel.astype(x.dtype)
    y = grouped_gemm(x, jnp.swapaxes(w, 1, 2), group_sizes, dtype=jnp.float32)
    res = GroupedResiduals(x.T, w, group_sizes, None, None, meta_in)
  else:
    meta = state_as_float32(meta_in)
    qx, amax_x = _quantize_rows(cfg, "x", meta and meta.x, _scatter_rows(layout, x), layout.sizes, fp8.fwd_dtype)
    qw, amax_w = _quantize_kernels(cfg, meta and meta.kernel, kernel)
    y = layout.gather(grouped_gemm(qx.without_transposed(), qw.transposed(), layout.sizes, dtype=jnp.float32,
                                   fast_accum=not fp8.recipe.fp8_gemm_fprop.use_split_accumulator,
                                   tile=_tile(cfg, layout.rows)))
    res = GroupedResiduals(_saved(qx.transposed()), _saved(qw), group_sizes, amax_x, amax_w, meta_in)
  if bias is not None:  # added in float32 to the float32 product, rounded to the output dtype first (as dense's)
    y = y + _bias_rows(bias.astype(cfg.out_dtype), group_sizes, rows)
  return y.astype(cfg.out_dtype), res


def _grouped_bwd(cfg: GroupedConfig, r: GroupedResiduals, g):
  dx, dw, dbias, new_meta = grouped_dense_bwd(cfg, r, instantiate(g))
  return dx, dw, dbias, None, new_meta


def grouped_dense_bwd(cfg: GroupedConfig, r: GroupedResiduals, g: jax.Array | QuantizedRows):
  """The backward pass of ``grouped_dense`` for the output gradient ``g``: ``(dx, dkernel, dbias, new_meta)``
  (``dbias`` None without a bias, ``new_meta`` the updated delayed-scaling state, else None). Under FP8, ``g`` may
  arrive quantized (``QuantizedRows``, without a bias: its gradient would need the high-precision values)."""
  quantized = isinstance(g, QuantizedRows)
  rows, groups = (g.q if quantized else g).shape[0], r.group_sizes.shape[0]
  fp8 = cfg.fp8
  dbias = None
  if quantized and (fp8 is None or cfg.bias_dtype is not None):
    raise ValueError("grouped_dense_bwd: a quantized output gradient needs FP8 GEMMs and no bias")
  if cfg.bias_dtype is not None:
    ids = group_ids(r.group_sizes, rows)
    dbias = jax.ops.segment_sum(g.astype(jnp.float32), ids, num_segments=groups,
                                indices_are_sorted=True).astype(cfg.bias_dtype)
  if fp8 is None:
    dx = grouped_gemm(g, r.w, r.group_sizes, dtype=cfg.out_dtype)
    dw = grouped_gemm(r.x_t, g.T, r.group_sizes, ragged_contracting=True, dtype=cfg.kernel_dtype)
    return dx, dw, dbias, r.meta
  layout = _layout(cfg, r.group_sizes, rows)
  meta = state_as_float32(r.meta)
  recipe = fp8.recipe
  qg, amax_g = _quantize_rows(cfg, "grad", meta and meta.grad, _scatter_rows(layout, g), layout.sizes,
                              fp8.bwd_dtype)
  tile = _tile(cfg, layout.rows)
  dx = layout.gather(grouped_gemm(qg.without_transposed(), r.w, layout.sizes, dtype=cfg.out_dtype,
                                  fast_accum=not recipe.fp8_gemm_dgrad.use_split_accumulator, tile=tile))
  dw = grouped_gemm(r.x_t, qg.transposed(), layout.sizes, ragged_contracting=True, dtype=cfg.kernel_dtype,
                    fast_accum=not recipe.fp8_gemm_wgrad.use_split_accumulator, tile=tile)
  new_meta = None
  if meta is not None:  # one update of every group's state
    items = [(jax.tree.map(lambda v, i=i: v[i], meta), r.amax_x[i], r.amax_w[i], amax_g[i]) for i in range(groups)]
    new = fp8.quantizer.update(items)
    new_meta = state_like(jax.tree.map(lambda *vs: jnp.stack(vs), *new), r.meta)
  return dx, dw, dbias, new_meta


_grouped.defvjp(*typed_vjp(_grouped_fwd, _grouped_bwd, nondiff_argnums=(0,)), symbolic_zeros=True)


def check_grouped_meta(meta: DenseFp8Meta, groups: int, name: str = "fp8_meta") -> None:
  """Raises unless ``meta`` (the caller's argument ``name``) holds one delayed-scaling state per group."""
  for role, state in zip(ROLES, meta, strict=True):  # DenseFp8Meta's fields, in order
    h, s = jnp.shape(state.amax_history), jnp.shape(state.scale)
    if len(h) != 2 or h[0] != groups or s != (groups,):
      raise ValueError(f"{name}.{role} must hold one state per group: an amax history ({groups}, L) and a scale "
                       f"({groups},), got {list(h)} and {list(s)}; create it with grouped_fp8_meta({groups}, L)")


def _check_aligned(group_sizes: jax.Array, align: int) -> None:
  """Raises where concrete ``group_sizes`` are not multiples of ``align`` (traced ones cannot be read)."""
  if align == 1 or isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes)
  bad = np.flatnonzero(sizes % align)
  if bad.size:
    raise ValueError(f"grouped_dense(groups_aligned=True): group_sizes must be multiples of {align} (group_align of "
                     f"this recipe and kernel), got group_sizes[{int(bad[0])}] = {int(sizes[bad[0]])} in "
                     f"{sizes.tolist()}: lay the rows out with te_jax.permute(..., align={align}), or pass "
                     "groups_aligned=False")


def grouped_config(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, recipe: Recipe | None, *,
                   group_axes: frozenset[str] = frozenset(), groups_aligned: bool = False) -> GroupedConfig:
  """The config of the grouped GEMM of ``x`` (M, K) and ``kernel`` (G, K, N) (with ``bias``) under ``recipe`` (as
  ``fp8_recipe`` resolved it; None: high precision): FP8 GEMMs where there is a recipe and they take K and N;
  ``groups_aligned``: ``x``'s groups arrive aligned (``group_align``)."""
  fp8 = None
  if recipe is not None and fp8_dims_aligned(kernel.shape[1], kernel.shape[2]):
    fp8 = Fp8Config.of(recipe, x, kernel, bias)
  return GroupedConfig(fp8, token_align(fp8), jnp.dtype(x.dtype), jnp.dtype(kernel.dtype),
                       None if bias is None else jnp.dtype(bias.dtype), frozenset(group_axes), bool(groups_aligned))


def grouped_dense(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array, bias: jax.Array | None = None, *,
                  fp8_meta: DenseFp8Meta | None = None, recipe: Recipe | None = None,
                  groups_aligned: bool = False) -> jax.Array:
  """``x[m] @ kernel[g] + bias[g]`` for each row ``m`` of group ``g``; the rows past the groups give zeros.

  Under ``autocast(enabled=True)`` (or with an explicit ``recipe``) the forward GEMM and the backward's input and
  weight gradients are FP8 grouped GEMMs with per-group scales (see the module docstring); otherwise grouped GEMMs in
  ``x``'s dtype.

  >>> import jax.numpy as jnp, te_jax
  >>> from te_jax.fused.grouped_dense import grouped_dense
  >>> x = jnp.ones((6, 32), jnp.bfloat16)
  >>> kernel = jnp.stack([jnp.ones((32, 16)), -jnp.ones((32, 16))])  # (G, K, N)
  >>> grouped_dense(x, kernel, jnp.array([2, 3], jnp.int32))[:, 0].tolist()
  [32.0, 32.0, -32.0, -32.0, -32.0, 0.0]

  Args:
    x: (M, K), the tokens sorted by group, in the compute dtype (the output has it too).
    kernel: (G, K, N), one matrix per group, any float dtype (its gradient keeps it).
    group_sizes: (G,) integers, >= 0, summing to at most M: the rows of each group, in order. May be traced
      (invalid traced sizes make the output NaN; concrete ones raise).
    bias: optional (G, N), one bias per group.
    fp8_meta: under a recipe that keeps a state (``DelayedScaling``), the experts' state: a ``DenseFp8Meta`` with
      (G, L) amax histories and (G,) scales (``grouped_fp8_meta``); unused otherwise.
    recipe: overrides the autocast recipe for this call.
    groups_aligned: ``x`` is laid out as ``te_jax.permute(..., align=group_align(recipe, kernel.shape))`` lays it
      out (each group's size a multiple of that, its padding rows zeros): the GEMMs take the rows as they are,
      without a padded copy (see the module docstring; concrete sizes are checked, traced ones are not).

  Returns:
    (M, N) in ``x``'s dtype.
  """
  x, kernel, bias = as_arrays(x, kernel, bias)
  if x.ndim != 2:
    raise ValueError(f"x must be (M, K), the tokens sorted by group, got shape {x.shape}")
  if kernel.ndim != 3 or kernel.shape[1] != x.shape[1]:
    raise ValueError(f"kernel must be (G, K, N) with K = x's {x.shape[1]}, got shape {kernel.shape}")
  if not jnp.issubdtype(kernel.dtype, jnp.floating):
    raise TypeError(f"kernel must be a float array, got {kernel.dtype}")
  groups, _, n = kernel.shape
  group_sizes = check_group_sizes(group_sizes, x.shape[0])
  if tuple(group_sizes.shape) != (groups,):
    raise ValueError(f"group_sizes must be ({groups},), one size per matrix of kernel, got "
                     f"{list(jnp.shape(group_sizes))}")
  if bias is not None and tuple(bias.shape) != (groups, n):
    raise ValueError(f"bias must be ({groups}, {n}), one row per group, got {bias.shape}")
  recipe = fp8_recipe(recipe, fp8_meta=fp8_meta)
  if keeps_state(recipe):
    check_grouped_meta(fp8_meta, groups)
  if not isinstance(groups_aligned, bool):
    raise TypeError(f"groups_aligned must be a bool, got {groups_aligned!r}")
  cfg = grouped_config(x, kernel, bias, recipe, groups_aligned=groups_aligned)
  if groups_aligned:
    _check_aligned(group_sizes, cfg.align)
  if cfg.fp8 is None and keeps_state(recipe):  # a GEMM FP8 cannot take: its state is kept
    x = keep_state(x, fp8_meta)
  meta = fp8_meta if cfg.fp8 is not None and keeps_state(recipe) else None
  return _grouped(cfg, x, kernel, bias, group_sizes, meta)
