"""``layernorm``: LayerNorm or RMSNorm over the last dim, differentiable, one fused kernel each way.

Forward: one pass over ``x`` gives the normalized output and the float32 row statistics (``mean``, ``rsigma``),
which are saved for the backward pass with ``x`` and gamma. Backward: one pass over the output gradient and ``x``
gives dx, and the dgamma/dbeta sums in a fixed order (the same bits every run). The math is that of
``te_jax.ops.norm``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from te_jax._manual_axes import to_common_varying
from te_jax.ops.norm import NormConfig, check_norm_args, norm_bwd, norm_fwd

__all__ = ["layernorm"]

_OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Config:
  norm: NormConfig  # its out_dtype is the output dtype
  zero_centered_gamma: bool
  beta_dtype: jnp.dtype | None  # dbeta's dtype; None: RMSNorm, no beta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layernorm(cfg: _Config, x, gamma, beta):
  return _layernorm_fwd(cfg, x, gamma, beta)[0]


def _layernorm_fwd(cfg: _Config, x, gamma, beta):
  n = cfg.norm
  out = norm_fwd(x, gamma, beta, norm_type=n.norm_type, epsilon=n.epsilon, zero_centered_gamma=cfg.zero_centered_gamma,
                 out_dtype=n.out_dtype)
  return out.out, (x, gamma, out.mean, out.rsigma)


def _layernorm_bwd(cfg: _Config, residuals, dz):
  x, gamma, mean, rsigma = residuals
  # The kernels take dz in x's dtype or float32: a gradient of any other dtype goes in as float32, exactly.
  dz = dz if dz.dtype in (x.dtype, jnp.float32) else dz.astype(jnp.float32)
  dx, dgamma, dbeta = norm_bwd(dz, x, mean, rsigma, gamma, norm_type=cfg.norm.norm_type,
                               zero_centered_gamma=cfg.zero_centered_gamma)
  return dx, dgamma.astype(gamma.dtype), None if cfg.beta_dtype is None else dbeta.astype(cfg.beta_dtype)


_layernorm.defvjp(_layernorm_fwd, _layernorm_bwd)


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None = None,
    *,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    dtype=None,
) -> jax.Array:
  """LayerNorm (``(x - mean) * rsigma * gamma + beta``) or RMSNorm (``x * rsigma * gamma``) over the last dim.

  Statistics and arithmetic in float32 whatever the input and parameter dtypes; gradients come back in the dtype of
  what they differentiate.

  >>> import jax, jax.numpy as jnp, te_jax
  >>> x = jnp.array([[1.0, 2.0, 3.0, 6.0]])
  >>> [round(float(v), 4) for v in te_jax.layernorm(x, jnp.ones(4), jnp.zeros(4))[0]]
  [-1.069, -0.5345, 0.0, 1.6036]
  >>> jax.grad(lambda g: te_jax.layernorm(x, g, layernorm_type="rmsnorm").sum())(jnp.ones(4)).shape
  (4,)

  Args:
    x: float32, bfloat16 or float16, rank >= 1.
    gamma: ``(hidden,)`` scale; stored as gamma - 1 under ``zero_centered_gamma``.
    beta: ``(hidden,)`` bias, required for LayerNorm; None for RMSNorm.
    layernorm_type: "layernorm" or "rmsnorm".
    epsilon: added to the variance before the reciprocal square root.
    zero_centered_gamma: multiply by ``gamma + 1`` (so a zero-initialized gamma is the identity scale).
    dtype: the output dtype, float32, bfloat16 or float16 (default: ``x``'s). The statistics come from ``x`` as
      given, not from ``x`` rounded to ``dtype``.

  Returns:
    The normalized ``x``, in ``dtype``.
  """
  x = jnp.asarray(x) if not hasattr(x, "dtype") else x
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  if out_dtype not in _OUT_DTYPES:
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {out_dtype.name}")
  check_norm_args(layernorm_type, epsilon)
  norm = NormConfig(layernorm_type, float(epsilon), out_dtype)
  beta_dtype = None if beta is None else jnp.dtype(jnp.asarray(beta).dtype)
  # norm_fwd checks the arrays while tracing
  x, gamma, beta = to_common_varying(x, gamma, beta)  # inside shard_map: as jax's own ops would
  return _layernorm(_Config(norm, bool(zero_centered_gamma), beta_dtype), x, gamma, beta)
