"""NNX ``MoEBlock``: te_jax.flax.MoEBlock's mixture-of-experts MLP (same options, parameter tree and math), built up
front; its expert bias an ``nnx.BatchStat``, its auxiliary losses ``AuxLoss`` variables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax.modules.axes import Initializer
from te_jax.modules.moe import AUX_LOSSES, MoEBlockOptions, MoEState, moe_block, moe_block_params
from te_jax.modules.scope import fields_of
from te_jax.nnx.params import as_tuple
from te_jax.nnx.scope import NnxScope, builds
from te_jax.recipe import Recipe

__all__ = ["AuxLoss", "MoEBlock", "NnxMoEState"]


class AuxLoss(nnx.Intermediate):
  """An auxiliary loss of the last training call (already times its coefficient), for the train step to add to its
  loss: ``sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(model, te_nnx.AuxLoss)))`` inside the differentiated
  function (``nnx.scan`` stacks a layer's losses along its dim)."""


class NnxMoEState(MoEState):
  """The ``MoEState`` of ``module`` (an NNX ``MoEBlock``): its ``expert_bias`` (``nnx.BatchStat``) and one ``AuxLoss``
  attribute per loss, named as the losses (``load_balancing_loss``, ``z_loss``)."""

  def __init__(self, module: nnx.Module, building: bool = False):
    self.module, self.building = module, building

  def declare(self, o):
    if not self.building:
      return
    m = self.module
    m.expert_bias = nnx.BatchStat(jnp.zeros((o.num_experts,), jnp.float32)) if o.use_expert_bias else nnx.data(None)
    for name in AUX_LOSSES:
      setattr(m, name, AuxLoss(jnp.zeros((), jnp.float32)) if name in o.aux_losses else nnx.data(None))

  def expert_bias(self, num_experts):
    return self.module.expert_bias[...]

  def set_expert_bias(self, value):
    self.module.expert_bias[...] = value

  def report(self, name, value, training):
    del training  # an NNX variable can always be written
    var = getattr(self.module, name, None)
    if isinstance(var, AuxLoss):
      var[...] = value
    else:  # taken out of the model (nnx.pop): made again
      setattr(self.module, name, AuxLoss(value))


@builds(MoEBlockOptions)
class MoEBlock(nnx.Module):
  """A mixture-of-experts MLP over the last dim (router, permutation, gated MLP experts on FP8 grouped GEMMs, optional
  shared experts): te_jax.flax.MoEBlock's options and math, with NNX's constructor.

  >>> import jax, jax.numpy as jnp, optax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> moe = te_nnx.MoEBlock(16, num_experts=4, k=2, intermediate_dim=32, load_balancing_coef=1e-2,
  ...                       use_expert_bias=True, rngs=nnx.Rngs(0))
  >>> moe.wi_kernel.shape, moe.expert_bias.shape
  ((4, 16, 2, 32), (4,))
  >>> def loss_fn(model, x):
  ...   y = model(x, deterministic=False)  # training: the expert bias moves, the losses are written
  ...   aux = sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(model, te_nnx.AuxLoss)))
  ...   return jnp.mean(y ** 2) + aux
  >>> loss, grads = te_nnx.value_and_grad(loss_fn)(moe, jnp.ones((2, 8, 16)))
  >>> sorted(nnx.to_pure_dict(grads))
  ['router_kernel', 'wi_kernel', 'wo_kernel']

  The expert bias is an ``nnx.BatchStat`` (not a parameter: ``nnx.Optimizer(..., wrt=nnx.Param)`` leaves it to the
  training calls); ``model.eval()`` / ``model.train()`` set ``deterministic``.

  Args:
    in_features: the hidden size (the inputs' last dim).
    num_experts, k, intermediate_dim, and the keywords: te_jax.flax.MoEBlock's attributes (``deterministic``: the
      call's, else the module's).
    rngs: the ``params`` stream.
  """

  def __init__(self, in_features: int, num_experts: int = 8, k: int = 2, intermediate_dim: int = 2048, *,
               activation_type: Sequence[str] = ("silu", "linear"), score: str = "softmax",
               num_groups: int | None = None, topk_groups: int | None = None, group_topk: int | None = None,
               normalize_topk: bool | None = None, scaling_factor: float = 1.0, use_expert_bias: bool = False,
               expert_bias_update_rate: float = 1e-3, capacity_factor: float | None = None,
               load_balancing_coef: float = 0.0, load_balancing_per_sequence: bool = False, z_loss_coef: float = 0.0,
               shared_intermediate_dim: int | None = None, norm_type: str | None = None, epsilon: float = 1e-6,
               zero_centered_gamma: bool = False, use_bias: bool = False,
               router_init: Initializer = nnx.initializers.lecun_normal(),
               kernel_init: Initializer = nnx.initializers.lecun_normal(),
               bias_init: Initializer = nnx.initializers.zeros_init(), logical_axes: bool = False,
               deterministic: bool | None = None, dtype: Any = None, param_dtype: Any = jnp.float32,
               recipe: Recipe | None = None, rngs: nnx.Rngs):
    self.deterministic = deterministic
    self.options = nnx.static(MoEBlockOptions(
        num_experts=num_experts, k=k, intermediate_dim=intermediate_dim, activation_type=tuple(activation_type),
        score=score, num_groups=num_groups, topk_groups=topk_groups, group_topk=group_topk,
        normalize_topk=normalize_topk, scaling_factor=scaling_factor, use_expert_bias=use_expert_bias,
        expert_bias_update_rate=expert_bias_update_rate, capacity_factor=capacity_factor,
        load_balancing_coef=load_balancing_coef, load_balancing_per_sequence=load_balancing_per_sequence,
        z_loss_coef=z_loss_coef, shared_intermediate_dim=shared_intermediate_dim, norm_type=norm_type,
        epsilon=epsilon, zero_centered_gamma=zero_centered_gamma, use_bias=use_bias, router_init=router_init,
        kernel_init=kernel_init, bias_init=bias_init, logical_axes=logical_axes, dtype=dtype,
        param_dtype=param_dtype, recipe=recipe))
    for name in ("ln_scale", "ln_bias", "wi_bias", "wo_bias", "shared_wi_kernel", "shared_wo_kernel", "shared_wi_bias",
                 "shared_wo_bias"):
      setattr(self, name, nnx.data(None))
    moe_block_params(NnxScope(self, rngs), NnxMoEState(self, building=True), self.options,
                     as_tuple(in_features, "in_features")[0])

  @classmethod
  def from_options(cls, options: MoEBlockOptions, in_features: int, *, rngs: nnx.Rngs) -> "MoEBlock":
    """The block of ``options`` (``te_jax.modules.moe``) over inputs of last dim ``in_features``."""
    return cls(in_features, **fields_of(options), rngs=rngs)

  def __call__(self, inputs: jax.Array, deterministic: bool | None = None) -> jax.Array:
    """As te_jax.flax.MoEBlock's call."""
    mode = self.deterministic if deterministic is None else bool(deterministic)
    return moe_block(NnxScope(self), NnxMoEState(self), self.options, inputs, mode)
