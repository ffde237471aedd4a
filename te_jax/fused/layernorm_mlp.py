"""``layernorm_mlp``: norm -> fc1 -> activation -> fc2, with every GEMM in FP8 and the casts fused into the kernels
that produce each GEMM's input.

Forward under delayed scaling: the norm writes fc1's FP8 input (+ transposed copy + amax); fc1 runs with its bias
in the epilogue; the activation kernel reads fc1's output and writes fc2's FP8 input (+ transposed copy + amax); fc2
runs with its bias (and the residual, when one is given, in the same epilogue). Saved for backward: the FP8 GEMM
inputs (transposed) and kernels, fc1's output (the activation's derivative needs it exactly), the norm's statistics.
Backward: the output gradient's FP8 cast (+ fc2's bias gradient), fc2's dgrad and wgrad, one activation-backward
kernel that writes the FP8 gradient of fc1's output (+ transposed copy + fc1's bias gradient), fc1's dgrad and wgrad,
then the norm's backward kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.explicit import constrain, explicit_mesh, retype, typed_vjp
from te_jax._core.primitive import full_spec
from te_jax._core.manual_axes import to_common_varying
from te_jax.fused.dense import high_precision_dense
from te_jax.fused.linear import (Fp8Config, LinearResiduals, NormSpec, as_arrays, check_checkpoint_name,
                                 check_residual, fp8_dims_aligned, fp8_recipe, input_for, instantiate, keep_state,
                                 keeps_state, linear_bwd, linear_fwd, norm_to_fp8, out_spec_of, pad_rows,
                                 primal_values, residual_rows, state_as_float32, state_like)
from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.ops.activation import activation, activation_bwd, activation_fwd, normalize_activation_type
from te_jax.ops.gemm import output_spec
from te_jax.recipe import Recipe

__all__ = ["activation_params_items", "intermediate_split", "layernorm_mlp", "merge_parts", "split_parts"]

# How the residual reaches fc2's epilogue: none, a given array, or the block's own input (a pre-LN block), whose
# gradient the backward then adds inside the norm's backward kernel.
_NO_RESIDUAL, _GIVEN_RESIDUAL, _INPUT_RESIDUAL = "none", "given", "input"


@dataclasses.dataclass(frozen=True)
class _Config:
  fc1: Fp8Config
  fc2: Fp8Config
  norm: NormSpec
  activation_type: tuple[str, ...]
  gated: bool
  intermediate: int
  residual_kind: str  # one of the three above
  out_rows: tuple[int, int] | None  # (B, S): fc2's output (B, S, H), its rows sharded as the caller constrains them
  # x is (B, S, H): with keep_rows every op runs on those rows as sharded; with grad_sharding fc1's dgrad output
  # (B, S, H) is constrained to it, the norm's backward running on those rows.
  keep_rows: bool = False
  grad_sharding: P | None = None
  intermediate_axes: tuple[str, ...] = ()  # the mesh axes F is split over (a gated layer's parts merged per shard)
  # Explicit mesh axes: the output's sharding the caller asks for (out_sharding), and the output gradient's as the
  # backward GEMMs read it (the rows as the forward GEMMs ran them, where out_sharding scattered them).
  out_spec: P | None = None
  grad_spec: P | None = None
  # The checkpoint names of fc1's output (after a gated split: the residual the activation's backward reads) and of
  # fc2's; None: unnamed.
  ffn1_name: str | None = None
  ffn2_name: str | None = None
  # The activation's parameters (activation_params_items: sorted (name, value) pairs; () for the defaults).
  activation_params: tuple[tuple[str, float], ...] = ()

  @property
  def act_params(self) -> dict[str, float]:
    return dict(self.activation_params)


def _named(x: jax.Array, name: str | None) -> jax.Array:
  """``x`` named ``name`` for ``jax.checkpoint`` policies (``jax.ad_checkpoint.checkpoint_name``); None: as it is."""
  return x if name is None else checkpoint_name(x, name)


def _shard_local(x, body, spec_in: P, spec_out: P, split_axes: tuple[str, ...]):
  return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=spec_in, out_specs=spec_out,
                       axis_names=set(split_axes))(x)


def merge_parts(x: jax.Array, axis: int, split_axes: tuple[str, ...] = ()) -> jax.Array:
  """``x`` with its dims ``axis`` (the parts of a gated layer, P) and ``axis + 1`` (F) merged into one of P * F.

  With F split over the mesh axes ``split_axes`` (tensor parallelism), the merge runs shard by shard: each shard's
  (P, F / n) becomes its own P * F / n entries, so the merged dim stays split over those axes, in an order of its own
  that ``split_parts`` undoes (the order of a GEMM's N or K does not change its result). A plain reshape, which would
  need F whole, otherwise.

  >>> import jax.numpy as jnp
  >>> merge_parts(jnp.zeros((4, 2, 8)), 1).shape
  (4, 16)
  """
  axis %= x.ndim
  merge = lambda v: v.reshape(*v.shape[:axis], -1, *v.shape[axis + 2:])  # noqa: E731
  if not split_axes:
    return merge(x)
  rest = [None] * (x.ndim - axis - 2)
  return _shard_local(x, merge, P(*[None] * (axis + 1), split_axes, *rest), P(*[None] * axis, split_axes, *rest),
                      split_axes)


def split_parts(x: jax.Array, axis: int, parts: int, split_axes: tuple[str, ...] = ()) -> jax.Array:
  """``merge_parts``' inverse: dim ``axis`` of ``x`` (P * F, split over ``split_axes`` in ``merge_parts``' order when
  they are given) split into (P, F).

  >>> import jax.numpy as jnp
  >>> split_parts(jnp.zeros((4, 16)), -1, 2).shape
  (4, 2, 8)
  """
  axis %= x.ndim
  split = lambda v: v.reshape(*v.shape[:axis], parts, -1, *v.shape[axis + 1:])  # noqa: E731
  if not split_axes:
    return split(x)
  rest = [None] * (x.ndim - axis - 1)
  return _shard_local(x, split, P(*[None] * axis, split_axes, *rest), P(*[None] * (axis + 1), split_axes, *rest),
                      split_axes)


class _Residuals(NamedTuple):
  x: jax.Array
  gamma: jax.Array
  beta: jax.Array | None
  mean: jax.Array | None
  rsigma: jax.Array
  h: jax.Array  # fc1's output: the activation's derivative needs it exactly
  fc1: LinearResiduals
  fc2: LinearResiduals
  amax_z: jax.Array  # of the normalized input
  amax_a: jax.Array  # of the activation's output
  meta_1: DenseFp8Meta | None  # as the caller passed them (their dtype is the update's)
  meta_2: DenseFp8Meta | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ln_mlp_fp8(cfg: _Config, x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, residual, meta_1, meta_2):
  return _forward(cfg, x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, residual, meta_1, meta_2)[0]


def _ln_mlp_fp8_fwd(cfg: _Config, *primals):
  return _forward(cfg, *primal_values(primals, trained=(3, 4), states=(8, 9)))


def _forward(cfg: _Config, x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, residual, meta_1_in, meta_2_in):
  meta_1, meta_2 = state_as_float32((meta_1_in, meta_2_in))
  fc1, fc2 = cfg.fc1, cfg.fc2
  x_rows = x if cfg.keep_rows else x.reshape(-1, x.shape[-1])
  if cfg.residual_kind == _INPUT_RESIDUAL:
    residual = x_rows
  z = norm_to_fp8(fc1, cfg.norm, meta_1 and meta_1.x, x_rows, gamma, beta, keep_hp=False)
  h, res_1 = linear_fwd(fc1, z.x, kernel_1, meta_1 and meta_1.kernel, bias_1)
  if cfg.gated:  # the activated half first, as kernel_1's (H, 2, F) lays it out
    h = split_parts(h, -1, 2, cfg.intermediate_axes)
  h = _named(h, cfg.ffn1_name)
  if fc2.quantizer.fused_cast:
    s2 = fc2.quantizer.scale(meta_2.x, None, fc2.fwd_dtype)
    a = activation_fwd(h, cfg.activation_type, dtype=fc2.fwd_dtype, scale=s2, transpose=True, transpose_batch_dims=0,
                       activation_params=cfg.act_params)
  else:  # the activation's amax is needed before its cast (current and block scaling): a second pass
    a_hp = activation_fwd(h, cfg.activation_type, activation_params=cfg.act_params).out
    a = fc2.quantizer.quantize("x", meta_2 and meta_2.x, a_hp, fc2.fwd_dtype, transpose=True, transpose_batch_dims=0)
  y, res_2 = linear_fwd(fc2, a.out, kernel_2, meta_2 and meta_2.kernel, bias_2, residual, out_rows=cfg.out_rows,
                        out_sharding=cfg.out_spec)
  y = _named(y, cfg.ffn2_name)
  return y, _Residuals(x, gamma, beta, z.mean, z.rsigma, h, res_1, res_2, z.amax, a.amax, meta_1_in, meta_2_in)


def _ln_mlp_fp8_bwd(cfg: _Config, r: _Residuals, g):
  g = instantiate(g)
  g_out = g  # with out_rows or keep_rows (B, S, H), sharded like the output
  g = retype(g, cfg.grad_spec)
  if not cfg.keep_rows:
    g = g.reshape(-1, g.shape[-1])
  x, h, res_1, res_2 = r.x, r.h, r.fc1, r.fc2
  meta_1, meta_2 = state_as_float32((r.meta_1, r.meta_2))
  fc1, fc2 = cfg.fc1, cfg.fc2
  qg = fc2.quantizer.quantize("grad", meta_2 and meta_2.grad, g, fc2.bwd_dtype, transpose=True,
                              transpose_batch_dims=0, dbias=fc2.has_bias)
  da, dk2 = linear_bwd(fc2, res_2, qg.out)
  rows = da.shape[:-1]  # (M,), or (B, S) kept
  axes = cfg.intermediate_axes
  if fc1.quantizer.fused_cast:  # gated: the kernel writes (M, 2, F), (2, F, M) and a (2, F) bias gradient, merged
    sg1 = fc1.quantizer.scale(meta_1.grad, None, fc1.bwd_dtype)  # as kernel_1 was
    dh = activation_bwd(da, h, cfg.activation_type, dtype=fc1.bwd_dtype, scale=sg1, transpose=True,
                        transpose_batch_dims=0, dbias=fc1.has_bias, activation_params=cfg.act_params)
    if cfg.gated:
      merged = dataclasses.replace(dh.out, data=merge_parts(dh.out.data, len(rows), axes),
                                   data_t=merge_parts(dh.out.data_t, 0, axes))
      dh = dh._replace(out=merged, dbias=None if dh.dbias is None else merge_parts(dh.dbias, 0, axes))
  else:  # gated: the (M, 2, F) gradient merged before its cast
    dh_hp = activation_bwd(da, h, cfg.activation_type, activation_params=cfg.act_params).out
    dh_hp = merge_parts(dh_hp, len(rows), axes) if cfg.gated else dh_hp
    dh = fc1.quantizer.quantize("grad", meta_1 and meta_1.grad, dh_hp, fc1.bwd_dtype, transpose=True,
                                transpose_batch_dims=0, dbias=fc1.has_bias)
  # dh.out: (M, N) and (N, M), N = F or 2F; with the rows kept (B, S, N) and (N, B, S)
  dgrad_rows = None if cfg.grad_sharding is None else x.shape[:-1]
  dz, dk1 = linear_bwd(fc1, res_1, dh.out, dgrad_rows, cfg.grad_sharding)
  dz = dz.reshape(x.shape)  # x's rows: (M, H), or (B, S, H) as passed
  if cfg.grad_sharding is not None:
    dz = constrain(dz, cfg.grad_sharding)
  dres = g_out.reshape(x.shape) if cfg.residual_kind == _INPUT_RESIDUAL else None
  dx, dgamma, dbeta = cfg.norm.bwd(dz, x, r.mean, r.rsigma, r.gamma, dres=dres)
  db1 = dh.dbias.astype(fc1.bias_dtype) if fc1.has_bias else None
  db2 = qg.dbias.astype(fc2.bias_dtype) if fc2.has_bias else None
  new_1 = new_2 = None
  if meta_1 is not None:
    # One batched update for both GEMMs (fc1 and fc2 share the recipe).
    new = fc1.quantizer.update([(meta_1, r.amax_z, res_1.amax_w, dh.amax),
                                (meta_2, r.amax_a, res_2.amax_w, qg.amax)])
    new_1, new_2 = state_like(tuple(new), (r.meta_1, r.meta_2))
  dbeta = None if dbeta is None else dbeta.astype(r.beta.dtype)
  dres = g_out if cfg.residual_kind == _GIVEN_RESIDUAL else None
  return dx, dgamma.astype(r.gamma.dtype), dbeta, dk1, dk2, db1, db2, dres, new_1, new_2


_ln_mlp_fp8.defvjp(*typed_vjp(_ln_mlp_fp8_fwd, _ln_mlp_fp8_bwd, nondiff_argnums=(0,)), symbolic_zeros=True)


def intermediate_split(intermediate_axes) -> tuple[str, ...]:
  """``layernorm_mlp``'s ``intermediate_axes`` (None, an axis name or a tuple of them) as the tuple ``merge_parts`` and
  ``split_parts`` take: the named axes of the mesh in context that split F, those of more than one device that are
  not manual already (inside ``jax.shard_map`` F is the shard's own and merges as it is)."""
  if intermediate_axes is None:
    return ()
  axes = (intermediate_axes,) if isinstance(intermediate_axes, str) else tuple(intermediate_axes)
  mesh = jax.sharding.get_abstract_mesh()
  if not all(isinstance(a, str) for a in axes) or any(a not in mesh.axis_names for a in axes):
    raise ValueError(f"intermediate_axes must name axes of the mesh in context (jax.set_mesh; axes "
                     f"{mesh.axis_names}), got {intermediate_axes!r}")
  manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}
  return tuple(a for a in axes if a not in manual and mesh.shape[a] > 1)


def activation_params_items(activation_params, activation_type) -> tuple[tuple[str, float], ...]:
  """``activation_params`` (Transformer Engine's dict: ``limit``, ``alpha``, ``glu_linear_offset`` of
  ``("clamped_silu", "clamped_linear")``; None; or this function's own answer) for ``activation_type``, validated
  as ``te_jax.activation`` validates it, as the hashable tuple of its ``(name, value)`` items sorted by name that a
  static config holds (``dict`` of it gives the parameters back; ``()`` the defaults).

  >>> activation_params_items({"limit": 5, "alpha": 1.5}, ("clamped_silu", "clamped_linear"))
  (('alpha', 1.5), ('limit', 5.0))

  Raises:
    TypeError, ValueError: naming ``activation_params``, for what is not a dict (or None), an unknown key, a value
      that is no real number or out of its range, or parameters given to an activation that takes none.
  """
  if activation_params is None:
    given = {}
  elif hasattr(activation_params, "items"):
    given = dict(activation_params.items())
  elif isinstance(activation_params, (tuple, list)) and all(
      isinstance(p, tuple) and len(p) == 2 for p in activation_params):
    given = dict(activation_params)
  else:
    raise TypeError(f"activation_params must be a dict (Transformer Engine's keys 'limit', 'alpha', "
                    f"'glu_linear_offset') or None, got {activation_params!r}")
  act = normalize_activation_type(activation_type)
  if given:  # the checks of te_jax.activation itself, on an abstract input (nothing runs)
    shape = (1, 2, 1) if len(act) == 2 else (1, 1)
    jax.eval_shape(lambda x: activation_fwd(x, act, activation_params=given).out,
                   jax.ShapeDtypeStruct(shape, jnp.float32))
  return tuple(sorted((key, float(value)) for key, value in given.items()))


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    activation_type=("gelu",),
    activation_params=None,
    residual: jax.Array | None = None,
    fp8_meta_1: DenseFp8Meta | None = None,
    fp8_meta_2: DenseFp8Meta | None = None,
    recipe: Recipe | None = None,
    scatter_rows: bool = False,
    keep_rows: bool = False,
    grad_sharding: P | None = None,
    intermediate_axes: str | tuple[str, ...] | None = None,
    out_sharding: P | NamedSharding | None = None,
    quantization_checkpoint_name: str | None = None,
    ffn1_ckpt_name: str | None = None,
    ffn2_ckpt_name: str | None = None,
) -> jax.Array:
  """``fc2(act(fc1(norm(x))))`` over ``x``'s last dim, every GEMM in FP8 under ``autocast``.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.ones((4, 32), jnp.bfloat16)
  >>> k1, k2 = jnp.ones((32, 2, 64)) / 32, jnp.ones((64, 32)) / 64
  >>> te_jax.layernorm_mlp(x, jnp.ones(32), jnp.zeros(32), k1, k2, activation_type=("silu", "linear")).shape
  (4, 32)

  Args:
    x: ``(..., H)`` in the compute dtype.
    gamma, beta: the norm's ``(H,)`` parameters (no beta for RMSNorm).
    kernel_1: ``(H, n, F)`` with ``n`` = 2 for a gated activation (the activated half first), else 1.
    kernel_2: ``(F, H)``.
    bias_1: optional ``(n, F)``; bias_2: optional ``(H,)``.
    norm_type, epsilon, zero_centered_gamma: as in ``te_jax.layernorm``.
    activation_type: one of ``te_jax.ops.activation.ACTIVATION_TYPES``: ``("gelu",)``, ``("silu", "linear")`` for
      SwiGLU, ``("relu", "relu")``, ``("clamped_silu", "clamped_linear")``, ...
    activation_params: the clamped SwiGLU's ``{"limit", "alpha", "glu_linear_offset"}`` (any of them, the rest
      Transformer Engine's defaults 7.0, 1.702, 1.0), as ``te_jax.activation`` and Transformer Engine take them; None
      (or empty) for the other forms, for which any parameter raises.
    residual: optional, ``x``'s shape: added to the output (a residual connection), under FP8 in fc2's GEMM
      epilogue. When it is ``x`` itself (a pre-LN block), its gradient is also added inside the norm's backward
      kernel rather than by a separate pass.
    fp8_meta_1, fp8_meta_2: the delayed-scaling states of fc1 and fc2; required under ``DelayedScaling``.
    recipe: overrides the autocast recipe.
    scatter_rows: ``x`` is (B, S, H) and the caller constrains the output, whose (B, S) sharding fc2 then takes from
      that constraint (``te_jax.ops.gemm.gemm``'s ``scatter_rows``): under tensor parallelism with the residual stream
      sequence-parallel, fc2's partial sums are reduce-scattered onto it. Under FP8 only, and only where B * S
      needs no padding (a multiple of 16); otherwise fc2 all-reduces and XLA slices (the same values).
    keep_rows: ``x`` is (B, S, H) and every op of the layer keeps (B, S) as two dims, sharded as ``x``'s are, instead of
      folding them into the GEMMs' M (``te_jax.layernorm_dense``'s ``keep_rows``: a context-parallel residual stream
      stays on its sequence shards). Under FP8, where B * S needs no padding.
    grad_sharding: ``x`` is (B, S, H) and its gradient is wanted with this sharding (a ``PartitionSpec``), which
      fc1's dgrad GEMM then takes, the norm's backward running on those rows (``te_jax.layernorm_dense``'s
      ``grad_sharding``: under tensor parallelism with a sequence-parallel stream, the input gradient is
      reduce-scattered onto it). Under FP8, where B * S needs no padding.
    intermediate_axes: the mesh axes (of the mesh in context) that F is split over, as kernel_1 is sharded (tensor
      parallelism): a gated kernel's (2, F) then merges into fc1's N shard by shard (``merge_parts``), so that fc1
      stays split; without it such a merge needs F whole and XLA gathers kernel_1.
    out_sharding: the output's sharding, as ``te_jax.dense``'s: on a mesh with Explicit axes its type, fc2 writing
      it so (with ``scatter_rows``, its reduce-scatter onto a sequence-parallel stream), the input read with the rows
      it asks for (the sequence gathered before fc1); on an Auto mesh a sharding constraint.
    quantization_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` of both GEMMs' FP8 tensors saved for
      the backward pass, as ``te_jax.dense``'s (None: ``te_jax.FP8_RESIDUAL``).
    ffn1_ckpt_name, ffn2_ckpt_name: the checkpoint names of fc1's output (the activation's input, ``(..., 2, F)``
      split for a gated activation; saved for the backward pass) and of fc2's output, as Transformer Engine's
      options of those names name them; None: unnamed.

  Returns:
    ``x``'s shape and dtype.
  """
  x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, residual = as_arrays(x, gamma, beta, kernel_1, kernel_2, bias_1,
                                                                          bias_2, residual)
  for arg, name in (("quantization_checkpoint_name", quantization_checkpoint_name),
                    ("ffn1_ckpt_name", ffn1_ckpt_name), ("ffn2_ckpt_name", ffn2_ckpt_name)):
    check_checkpoint_name(name, arg)
  act = normalize_activation_type(activation_type)
  params = activation_params_items(activation_params, act)
  gated = len(act) == 2
  norm = NormSpec(norm_type, float(epsilon), bool(zero_centered_gamma))
  h_dim = x.shape[-1]
  n_act = 2 if gated else 1
  if kernel_1.ndim != 3 or kernel_1.shape[:2] != (h_dim, n_act):
    raise ValueError(f"kernel_1 must be (H={h_dim}, {n_act}, F) for activation_type={act}, got {kernel_1.shape}")
  f_dim = kernel_1.shape[2]
  if kernel_2.shape != (f_dim, h_dim):
    raise ValueError(f"kernel_2 must be (F={f_dim}, H={h_dim}), got {kernel_2.shape}")
  if bias_1 is not None and bias_1.shape != (n_act, f_dim):
    raise ValueError(f"bias_1 must be ({n_act}, {f_dim}), got {bias_1.shape}")
  if bias_2 is not None and bias_2.shape != (h_dim,):
    raise ValueError(f"bias_2 must be ({h_dim},), got {bias_2.shape}")
  check_residual(residual, x.shape)
  if (scatter_rows or keep_rows or grad_sharding is not None) and x.ndim != 3:
    raise ValueError(f"scatter_rows, keep_rows and grad_sharding need x of shape (B, S, H), got {x.shape}")
  if grad_sharding is not None and not isinstance(grad_sharding, P):
    raise TypeError(f"grad_sharding must be a jax.sharding.PartitionSpec, got {type(grad_sharding).__name__}")
  spec = out_spec_of(out_sharding, x.ndim)
  if not scatter_rows:  # scattered, the output's rows are fc2's to lay out: the input's stay as they come
    x, residual = (input_for(x, (x.ndim - 1,), spec),) * 2 if residual is x else (input_for(x, (x.ndim - 1,), spec),
                                                                                 residual)
  recipe = fp8_recipe(recipe, fp8_meta_1=fp8_meta_1, fp8_meta_2=fp8_meta_2)
  split_axes = intermediate_split(intermediate_axes) if gated else ()
  k1 = merge_parts(kernel_1, 1, split_axes)
  b1 = None if bias_1 is None else merge_parts(bias_1, 0, split_axes)
  if recipe is None or not fp8_dims_aligned(h_dim, f_dim):  # high precision; a state kept where FP8 cannot take it
    x_in = keep_state(x, (fp8_meta_1, fp8_meta_2)) if keeps_state(recipe) else x
    z = norm.plain(x_in, gamma, beta)
    h = high_precision_dense(z, k1, b1)
    if gated:
      h = split_parts(h, -1, 2, split_axes)
    h = _named(h, ffn1_ckpt_name)
    y = high_precision_dense(activation(h, act, dict(params)), kernel_2, bias_2, residual=residual, out_sharding=spec)
    return _named(y, ffn2_ckpt_name)
  x2d, pad = pad_rows(x.reshape(-1, h_dim))

  stateful = keeps_state(recipe)
  rows = None if pad else tuple(x.shape[:2])
  out_rows = rows if scatter_rows else None
  keep = bool(keep_rows) and rows is not None
  if residual is x:
    kind, r = _INPUT_RESIDUAL, None
  else:
    r = residual_rows(residual, x2d.shape[0] - pad, h_dim, pad, x.dtype, out_rows or (rows if keep else None))
    kind = _NO_RESIDUAL if r is None else _GIVEN_RESIDUAL
  # fc2's output is the layer's with the rows kept or scattered, or for a 2-D x: typed with the wanted sharding; with
  # the rows scattered, the backward reads the output gradient as fc2 ran (x's rows).
  own = out_rows is not None or keep or (x.ndim == 2 and not pad)
  grad_spec = None
  if out_rows is not None and spec is not None and explicit_mesh(x) is not None:
    xs, k2s = full_spec(jax.typeof(x).sharding, x.ndim), full_spec(jax.typeof(kernel_2).sharding, 2)
    grad_spec = P(*output_spec(xs[:-1], [], [], k2s[1:]))
  qname = quantization_checkpoint_name
  cfg = _Config(Fp8Config.of(recipe, x, kernel_1, bias_1, qname), Fp8Config.of(recipe, x, kernel_2, bias_2, qname),
                norm, act, gated, f_dim, kind, out_rows, keep_rows=keep,
                grad_sharding=None if rows is None else grad_sharding, intermediate_axes=split_axes,
                out_spec=spec if own else None, grad_spec=grad_spec, ffn1_name=ffn1_ckpt_name,
                ffn2_name=ffn2_ckpt_name, activation_params=params)
  x_in = x if keep or cfg.grad_sharding is not None else x2d  # (B, S, H): its gradient's rows come back as two dims too
  x_in, gamma, beta, k1, kernel_2, b1, bias_2, r = to_common_varying(x_in, gamma, beta, k1, kernel_2, b1, bias_2, r)
  y = _ln_mlp_fp8(cfg, x_in, gamma, beta, k1, kernel_2, b1, bias_2, r, fp8_meta_1 if stateful else None,
                  fp8_meta_2 if stateful else None)
  return constrain(y.reshape(x.shape) if y.ndim == 3 else y[: x2d.shape[0] - pad].reshape(x.shape), spec)
