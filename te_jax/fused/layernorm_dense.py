"""``layernorm_dense``: LayerNorm/RMSNorm then a dense layer, with the norm writing the GEMM's FP8 input directly.

Under delayed scaling the norm kernel produces the FP8 normalized tensor, its transposed copy (for the weight
gradient) and its amax in one pass over ``x``; the high-precision normalized tensor is never written. Backward: the
output gradient's FP8 cast (with the bias gradient), the dgrad and wgrad FP8 GEMMs, then the norm's backward kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.explicit import constrain, typed_vjp
from te_jax._core.manual_axes import to_common_varying
from te_jax.fused.dense import high_precision_dense
from te_jax.fused.linear import (Fp8Config, LinearResiduals, NormSpec, Unstack, as_arrays, check_checkpoint_name,
                                 fp8_dims_aligned, fp8_recipe, input_for, instantiate, keep_state, keeps_state,
                                 layer_output, linear_bwd, linear_fwd, norm_to_fp8, out_spec_of, pad_rows,
                                 primal_values, quantize_grad, state_as_float32, state_like)
from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.recipe import Recipe

__all__ = ["layernorm_dense"]


@dataclasses.dataclass(frozen=True)
class _Config:
  """The static facts of one call: the GEMM's, the norm's, and which extra outputs it returns."""

  fp8: Fp8Config
  norm: NormSpec
  keep_hp: bool  # also return the normalized tensor
  pass_input: bool  # also return x, whose gradient the norm's backward kernel adds
  unstack: Unstack | None
  # x is (B, S, H) (no padding): with keep_rows every op runs on those rows as sharded; with grad_sharding (and
  # without keep_rows, the forward on the 2-D (B * S, H) rows) the dgrad GEMM's (B, S, H) output is constrained to it,
  # and the norm's backward runs on those rows.
  keep_rows: bool = False
  grad_sharding: P | None = None


class _Residuals(NamedTuple):
  x: jax.Array
  gamma: jax.Array
  beta: jax.Array | None
  mean: jax.Array | None
  rsigma: jax.Array
  linear: LinearResiduals
  amax_z: jax.Array
  meta: DenseFp8Meta | None  # as the caller passed it (its dtype is the update's)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ln_dense_fp8(cfg: _Config, x, gamma, beta, kernel, bias, meta):
  return _forward(cfg, x, gamma, beta, kernel, bias, meta)[0]


def _ln_dense_fp8_fwd(cfg: _Config, *primals):
  return _forward(cfg, *primal_values(primals, trained=(3,), states=(5,)))


def _forward(cfg: _Config, x, gamma, beta, kernel, bias, meta_in):
  meta = state_as_float32(meta_in)
  x_rows = x if cfg.keep_rows else x.reshape(-1, x.shape[-1])
  z = norm_to_fp8(cfg.fp8, cfg.norm, meta and meta.x, x_rows, gamma, beta, keep_hp=cfg.keep_hp)
  out, res = linear_fwd(cfg.fp8, z.x, kernel, meta and meta.kernel, bias, unstack=cfg.unstack)
  outputs = (out, z.hp, x if cfg.pass_input else None)
  return outputs, _Residuals(x, gamma, beta, z.mean, z.rsigma, res, z.amax, meta_in)


def _ln_dense_fp8_bwd(cfg: _Config, r: _Residuals, cotangents):
  fp8 = cfg.fp8
  meta = state_as_float32(r.meta)
  g, g_hp, g_x = jax.tree.map(instantiate, cotangents, is_leaf=lambda c: c is None)
  qg = quantize_grad(fp8, g, meta and meta.grad, cfg.unstack)
  dgrad_rows = None if cfg.grad_sharding is None else r.x.shape[:-1]
  dz, dw = linear_bwd(fp8, r.linear, qg.out, dgrad_rows, cfg.grad_sharding)
  if cfg.grad_sharding is not None:
    dz = constrain(dz, cfg.grad_sharding)
  if cfg.keep_hp:  # the returned normalized tensor's own gradient joins the GEMM's
    dz = (dz.astype(jnp.float32) + g_hp.reshape(dz.shape).astype(jnp.float32)).astype(dz.dtype)
  # The passed-through input's gradient is added to dx inside the norm's backward kernel.
  dres = g_x.astype(r.x.dtype) if cfg.pass_input else None
  dx, dgamma, dbeta = cfg.norm.bwd(dz, r.x, r.mean, r.rsigma, r.gamma, dres=dres)
  dbias = qg.dbias.astype(fp8.bias_dtype) if fp8.has_bias else None
  new_meta = None
  if meta is not None:
    new_meta = state_like(fp8.quantizer.update([(meta, r.amax_z, r.linear.amax_w, qg.amax)])[0], r.meta)
  dbeta = None if dbeta is None else dbeta.astype(r.beta.dtype)
  return dx, dgamma.astype(r.gamma.dtype), dbeta, dw, dbias, new_meta


_ln_dense_fp8.defvjp(*typed_vjp(_ln_dense_fp8_fwd, _ln_dense_fp8_bwd, nondiff_argnums=(0,)), symbolic_zeros=True)


def layernorm_dense(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    norm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    return_layernorm_output: bool = False,
    return_input: bool = False,
    unstack_axis: int | None = None,
    fp8_meta: DenseFp8Meta | None = None,
    recipe: Recipe | None = None,
    keep_rows: bool = False,
    grad_sharding: P | None = None,
    out_sharding: P | NamedSharding | None = None,
    quantization_checkpoint_name: str | None = None,
):
  """``norm(x) @ kernel + bias`` over ``x``'s last dim, the norm writing the FP8 GEMM input under ``autocast``.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.ones((4, 32), jnp.bfloat16)
  >>> te_jax.layernorm_dense(x, jnp.ones(32), jnp.zeros(32), jnp.ones((32, 16))).shape
  (4, 16)

  Args:
    x: ``(..., H)`` in the compute dtype (the output has it too).
    gamma, beta: the norm's ``(H,)`` parameters (no beta for RMSNorm).
    kernel: ``(H, *features)``; bias: optional ``features``-shaped.
    norm_type, epsilon, zero_centered_gamma: as in ``te_jax.layernorm``.
    return_layernorm_output: also return the normalized tensor (in ``x``'s dtype); under FP8 this costs an extra
      pass, since the fused kernel writes only FP8.
    return_input: also return ``x`` itself, last: used in place of ``x`` afterwards (the residual connection around
      a pre-LN block), its gradient is added to ``x``'s inside the norm's backward kernel under FP8, instead of by a
      separate pass over memory.
    unstack_axis: a feature axis of the output to return it unstacked along, as in ``te_jax.dense`` (q, k and v of
      an (H, 3, D) QKV projection with ``unstack_axis=-2``).
    fp8_meta: the layer's scaling state (``DenseFp8Meta``), for a recipe that keeps one (``DelayedScaling``).
    recipe: overrides the autocast recipe.
    keep_rows: ``x`` is (B, S, H) and every op of the layer keeps (B, S) as two dims, sharded as ``x``'s are
      (``te_jax.ops.gemm.gemm``'s ``keep_rows``), instead of folding them into the GEMM's M: rows whose batch and
      sequence are sharded over different mesh axes (a context-parallel residual stream) stay where they are, where
      the merged rows would have the sequence all-gathered. Under FP8, where B * S needs no padding (a multiple of
      16); otherwise the layer runs on the 2-D rows (the same values).
    grad_sharding: ``x`` is (B, S, H) and its gradient is wanted with this sharding (a ``PartitionSpec`` of the mesh
      set by ``jax.set_mesh``; a layer reading a residual stream gives the stream's): the dgrad GEMM's (B, S, H) output
      takes it (``gemm``'s ``scatter_rows``) and the norm's backward runs on those rows, its parameters' gradients
      summed over their shards. Under tensor parallelism with a sequence-parallel residual stream, the input
      gradient's partial sums are reduce-scattered onto the stream (half the bytes of an all-reduce, no slice). Under
      FP8, where B * S needs no padding; otherwise XLA reshards the gradient (the same values).
    out_sharding: the output's sharding (of each part, with ``unstack_axis``), as ``te_jax.dense``'s: on a mesh
      with Explicit axes its type, the input read with the rows it asks for (the sequence gathered before the norm
      under sequence parallelism); on an Auto mesh a sharding constraint.
    quantization_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` of the FP8 tensors saved for the
      backward pass, as ``te_jax.dense``'s (None: ``te_jax.FP8_RESIDUAL``).

  Returns:
    ``(..., *features)`` (a tuple of them unstacked, with ``unstack_axis``), then the normalized tensor when
    ``return_layernorm_output``, then ``x`` when ``return_input``.
  """
  x, gamma, beta, kernel, bias = as_arrays(x, gamma, beta, kernel, bias)
  check_checkpoint_name(quantization_checkpoint_name, "quantization_checkpoint_name")
  norm = NormSpec(norm_type, float(epsilon), bool(zero_centered_gamma))
  h = x.shape[-1]
  if kernel.ndim < 1 or kernel.shape[0] != h:
    raise ValueError(f"kernel must start with x's last dim {h}, got {kernel.shape}")
  features = kernel.shape[1:]
  if bias is not None and bias.shape != features:
    raise ValueError(f"bias must have shape {features}, got {bias.shape}")
  unstack = Unstack.of(unstack_axis, x.ndim - 1 + len(features), features)
  if (keep_rows or grad_sharding is not None) and x.ndim != 3:
    raise ValueError(f"keep_rows and grad_sharding need x of shape (B, S, H), got {x.shape}")
  if grad_sharding is not None and not isinstance(grad_sharding, P):
    raise TypeError(f"grad_sharding must be a jax.sharding.PartitionSpec, got {type(grad_sharding).__name__}")
  spec = out_spec_of(out_sharding, x.ndim - 1 + len(features) - (unstack is not None))
  x = input_for(x, (x.ndim - 1,), spec)
  recipe = fp8_recipe(recipe, fp8_meta=fp8_meta)
  n = math.prod(features)
  if recipe is None or not fp8_dims_aligned(h, n, unstack):  # high precision; a state kept where FP8 cannot take the dims
    x_in = keep_state(x, fp8_meta) if keeps_state(recipe) else x
    z = norm.plain(x_in, gamma, beta)
    y = high_precision_dense(z, kernel, bias, unstack_axis=unstack_axis, out_sharding=None if unstack else spec)
    y = tuple(constrain(p, spec) for p in y) if unstack else y
    return _outputs(y, z if return_layernorm_output else None, x if return_input else None)
  x2d, pad = pad_rows(x.reshape(-1, h))
  fp8_cfg = Fp8Config.of(recipe, x, kernel, bias, quantization_checkpoint_name)
  meta = fp8_meta if keeps_state(recipe) else None
  b = None if bias is None else bias.reshape(n)
  rows = tuple(x.shape[:2]) if (keep_rows or grad_sharding is not None) and not pad else None  # x passed (B, S, H)
  x_in, gamma, beta, k2d, b = to_common_varying(x2d if rows is None else x, gamma, beta, kernel.reshape(h, n),
                                                b)  # inside shard_map
  cfg = _Config(fp8_cfg, norm, bool(return_layernorm_output), bool(return_input), unstack,
                keep_rows=bool(keep_rows) and rows is not None,
                grad_sharding=None if rows is None else grad_sharding)
  y, z, x_out = _ln_dense_fp8(cfg, x_in, gamma, beta, k2d, b, meta)
  m = x2d.shape[0] - pad
  y = layer_output(y, m, x.shape[:-1], features, unstack)
  y = tuple(constrain(p, spec) for p in y) if unstack else constrain(y, spec)
  unpad = lambda v: None if v is None else (v if rows else v[:m]).reshape(x.shape)  # noqa: E731
  return _outputs(y, unpad(z), unpad(x_out))


def _outputs(y, z, x):
  """``y``, or the tuple of ``y`` and those of the normalized tensor ``z`` and the input ``x`` that are not None."""
  extra = tuple(v for v in (z, x) if v is not None)
  return (y, *extra) if extra else y
