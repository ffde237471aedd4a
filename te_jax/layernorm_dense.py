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

from te_jax._fp8_linear import (Fp8Config, Unstack, layer_output, linear_bwd, linear_fwd, quantize_grad,
                                state_as_float32, state_like)
from te_jax._manual_axes import to_common_varying
from te_jax.autocast import get_autocast_state
from te_jax.dense import DenseFp8Meta, dense
from te_jax.layernorm import layernorm
from te_jax.ops.norm import check_norm_args, norm_bwd, norm_fwd
from te_jax.ops.gemm import FP8_ALIGN
from te_jax.ops.quantize import quantize
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Recipe

__all__ = ["NormSpec", "layernorm_dense"]


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """The static parameters of the norm in front of a GEMM."""

  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False

  def __post_init__(self):
    check_norm_args(self.norm_type, self.epsilon)

  def fwd(self, x, gamma, beta, **kwargs):
    return norm_fwd(x, gamma, beta, norm_type=self.norm_type, epsilon=self.epsilon,
                    zero_centered_gamma=self.zero_centered_gamma, **kwargs)

  def bwd(self, dz, x, mean, rsigma, gamma, dres=None):
    return norm_bwd(dz, x, mean, rsigma, gamma, norm_type=self.norm_type, zero_centered_gamma=self.zero_centered_gamma,
                    dres=dres)

  def plain(self, x, gamma, beta):
    return layernorm(x, gamma, beta, layernorm_type=self.norm_type, epsilon=self.epsilon,
                     zero_centered_gamma=self.zero_centered_gamma, dtype=x.dtype)


class NormFp8(NamedTuple):
  """The FP8 input of the GEMM after a norm, and what the norm's backward needs."""

  data: jax.Array  # (M, H) FP8
  data_t: jax.Array  # (H, M) FP8
  sx_inv: jax.Array
  amax: jax.Array
  mean: jax.Array | None
  rsigma: jax.Array
  hp: jax.Array | None  # the high-precision normalized tensor, when it was computed


def norm_to_fp8(cfg: Fp8Config, norm: NormSpec, state, x2d, gamma, beta, *, keep_hp: bool) -> NormFp8:
  """Normalizes ``x2d`` (M, H) into the FP8 GEMM input.

  Delayed scaling knows the scale up front, so the norm kernel casts directly. Current scaling needs the amax of the
  normalized tensor first (and ``keep_hp`` asks for that tensor itself), so the norm writes it in the compute dtype
  and a quantize pass follows.
  """
  if cfg.delayed and not keep_hp:
    out = norm.fwd(x2d, gamma, beta, out_dtype=cfg.fwd_dtype, scale=state.scale, transpose=True)
    return NormFp8(out.out, out.out_t, 1.0 / state.scale, out.amax, out.mean, out.rsigma, None)
  out = norm.fwd(x2d, gamma, beta, out_dtype=x2d.dtype)
  s = cfg.scale(state, out.out, cfg.fwd_dtype)
  q = quantize(out.out, s, cfg.fwd_dtype, transpose=True)
  return NormFp8(q.data, q.data_t, 1.0 / s, q.amax, out.mean, out.rsigma, out.out if keep_hp else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ln_dense_fp8(cfg: Fp8Config, norm: NormSpec, keep_hp: bool, pass_input: bool, unstack: Unstack | None, x, gamma,
                  beta, kernel, bias, meta):
  return _ln_dense_fp8_fwd(cfg, norm, keep_hp, pass_input, unstack, x, gamma, beta, kernel, bias, meta)[0]


def _ln_dense_fp8_fwd(cfg, norm, keep_hp, pass_input, unstack, x, gamma, beta, kernel, bias, meta_in):
  meta = state_as_float32(meta_in)
  z = norm_to_fp8(cfg, norm, meta and meta.x, x, gamma, beta, keep_hp=keep_hp)
  out, res = linear_fwd(cfg, z.data, z.data_t, z.sx_inv, kernel, meta and meta.kernel, bias, unstack=unstack)
  return (out, z.hp, x if pass_input else None), (x, gamma, beta, z.mean, z.rsigma, res, z.amax, meta_in)


def _ln_dense_fp8_bwd(cfg, norm, keep_hp, pass_input, unstack, residuals, cotangents):
  x, gamma, beta, mean, rsigma, res, amax_z, meta_in = residuals
  meta = state_as_float32(meta_in)
  g, g_hp, g_x = cotangents
  sg = cfg.scale(meta and meta.grad, g, cfg.bwd_dtype)
  qg = quantize_grad(cfg, g, sg, unstack)
  dz, dw = linear_bwd(cfg, res, qg.data, qg.data_t, 1.0 / sg)
  if keep_hp:  # the returned normalized tensor's own gradient joins the GEMM's
    dz = (dz.astype(jnp.float32) + g_hp.astype(jnp.float32)).astype(dz.dtype)
  # The passed-through input's gradient is added to dx inside the norm's backward kernel.
  dx, dgamma, dbeta = norm.bwd(dz, x, mean, rsigma, gamma, dres=g_x.astype(x.dtype) if pass_input else None)
  dbias = qg.dbias.astype(cfg.bias_dtype) if cfg.has_bias else None
  new_meta = None
  if meta is not None:
    new_meta = state_like(cfg.update_metas([(meta, amax_z, res.amax_w, qg.amax)])[0], meta_in)
  return dx, dgamma.astype(gamma.dtype), None if dbeta is None else dbeta.astype(beta.dtype), dw, dbias, new_meta


_ln_dense_fp8.defvjp(_ln_dense_fp8_fwd, _ln_dense_fp8_bwd)


def resolve_fp8(recipe: Recipe | None, fp8_meta, what: str) -> Recipe | None:
  """The recipe to use (an explicit one, else autocast's), checked, with the state it needs."""
  if recipe is None:
    recipe = get_autocast_state().fp8_recipe
  if recipe is None:
    return None
  if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
    raise ValueError(f"recipe must be DelayedScaling or Float8CurrentScaling, got {type(recipe).__name__}")
  if isinstance(recipe, DelayedScaling) and fp8_meta is None:
    raise ValueError(f"DelayedScaling needs {what} (a DenseFp8Meta) with the layer's scaling state")
  return recipe


def check_fp8_dims(**dims: int) -> None:
  for name, d in dims.items():
    if d % FP8_ALIGN:
      raise ValueError(f"FP8 GEMMs need {name} to be a multiple of {FP8_ALIGN}, got {d}")


def pad_rows(x2d: jax.Array) -> tuple[jax.Array, int]:
  """Zero rows up to a multiple of 16 (the weight-gradient GEMM contracts over rows); zero rows change no amax,
  bias gradient or weight gradient."""
  pad = -x2d.shape[0] % FP8_ALIGN
  return (jnp.pad(x2d, ((0, pad), (0, 0))) if pad else x2d), pad


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
    fp8_meta: the delayed-scaling state (``DenseFp8Meta``); required under ``DelayedScaling``.
    recipe: overrides the autocast recipe.

  Returns:
    ``(..., *features)`` (a tuple of them unstacked, with ``unstack_axis``), then the normalized tensor when
    ``return_layernorm_output``, then ``x`` when ``return_input``.
  """
  norm = NormSpec(norm_type, float(epsilon), bool(zero_centered_gamma))
  h = x.shape[-1]
  if kernel.ndim < 1 or kernel.shape[0] != h:
    raise ValueError(f"kernel must start with x's last dim {h}, got {kernel.shape}")
  features = kernel.shape[1:]
  if bias is not None and bias.shape != features:
    raise ValueError(f"bias must have shape {features}, got {bias.shape}")
  unstack = Unstack.of(unstack_axis, x.ndim - 1 + len(features), features)
  recipe = resolve_fp8(recipe, fp8_meta, "fp8_meta")
  if recipe is None:
    z = norm.plain(x, gamma, beta)
    y = dense(z, kernel, bias, unstack_axis=unstack_axis, recipe=None)
    return _outputs(y, z if return_layernorm_output else None, x if return_input else None)
  n = math.prod(features)
  check_fp8_dims(hidden=h, features=n)
  x2d, pad = pad_rows(x.reshape(-1, h))
  cfg = Fp8Config.of(recipe, x, kernel, bias)
  meta = fp8_meta if isinstance(recipe, DelayedScaling) else None
  b = None if bias is None else bias.reshape(n)
  x2d, gamma, beta, k2d, b = to_common_varying(x2d, gamma, beta, kernel.reshape(h, n), b)  # inside shard_map
  y, z, x_out = _ln_dense_fp8(cfg, norm, bool(return_layernorm_output), bool(return_input), unstack, x2d, gamma, beta,
                              k2d, b, meta)
  m = x2d.shape[0] - pad
  y = layer_output(y, m, x.shape[:-1], features, unstack)
  unpad = lambda v: None if v is None else v[:m].reshape(x.shape)  # noqa: E731
  return _outputs(y, unpad(z), unpad(x_out))


def _outputs(y, z, x):
  """``y``, or the tuple of ``y`` and those of the normalized tensor ``z`` and the input ``x`` that are not None."""
  extra = tuple(v for v in (z, x) if v is not None)
  return (y, *extra) if extra else y
