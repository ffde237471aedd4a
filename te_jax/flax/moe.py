"""Flax linen ``MoEBlock``: a mixture-of-experts MLP (router, dropless or capacity-limited permutation, gated MLP
experts on FP8 grouped GEMMs, optional shared experts), the FFN of a Mixtral- or DeepSeek-style layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.scope import LinenScope, builds, options_of
from te_jax.modules.axes import Initializer
from te_jax.modules.moe import MoEBlockOptions, MoEState, moe_block
from te_jax.recipe import Recipe

__all__ = ["AUX_LOSS_COLLECTION", "EXPERT_BIAS_COLLECTION", "LinenMoEState", "MoEBlock"]

# Where a linen MoEBlock keeps its expert bias (Flax's collection of non-trained statistics, as nn.BatchNorm's) and
# sows its auxiliary losses.
EXPERT_BIAS_COLLECTION = "batch_stats"
AUX_LOSS_COLLECTION = "aux_loss"


class LinenMoEState(MoEState):
  """The ``MoEState`` of ``module`` (a linen ``MoEBlock``, inside its call): the expert bias in
  ``EXPERT_BIAS_COLLECTION``, the losses sown into ``AUX_LOSS_COLLECTION``."""

  def __init__(self, module: nn.Module):
    self.module = module

  def declare(self, o):
    del o  # linen creates the variables at the call

  def expert_bias(self, num_experts):
    return self.module.variable(EXPERT_BIAS_COLLECTION, "expert_bias", jnp.zeros, (num_experts,), jnp.float32).value

  def set_expert_bias(self, value):
    if self.module.is_initializing():
      return
    if not self.module.is_mutable_collection(EXPERT_BIAS_COLLECTION):
      raise ValueError(f"{LinenScope(self.module).where}: the MoE block updates its expert bias in training "
                       f"(deterministic=False): apply with mutable=[{EXPERT_BIAS_COLLECTION!r}] and keep the "
                       "returned variables for the next step (or pass deterministic=True to evaluate)")
    self.module.put_variable(EXPERT_BIAS_COLLECTION, "expert_bias", value)

  def report(self, name, value, training):
    if self.module.is_initializing():
      return
    if not self.module.sow(AUX_LOSS_COLLECTION, name, value) and training:
      raise ValueError(f"{LinenScope(self.module).where}: the MoE block reports {name} in training "
                       f"(deterministic=False): apply with mutable=[{AUX_LOSS_COLLECTION!r}] and add the sum of that "
                       "collection's leaves to the loss (or set its coefficient to 0)")


@builds(MoEBlockOptions)
class MoEBlock(nn.Module):
  """A mixture-of-experts MLP over the last dim: a float32 router picks ``k`` of ``num_experts`` gated MLP experts
  per token, the experts run as FP8 grouped GEMMs under ``te_jax.autocast`` (per-expert scales), their outputs are
  summed with the combine weights, optionally with shared experts that every token goes through (the steps are in
  ``te_jax.modules.moe``'s docstring). A Mixtral layer's FFN is ``x + MoEBlock(num_experts=8, k=2,
  normalize_topk=True, norm_type="rmsnorm")(x)``; DeepSeek-V3's adds ``score="sigmoid"``, groups, the expert bias,
  a scaling factor and ``shared_intermediate_dim``.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> moe = te_flax.MoEBlock(num_experts=4, k=2, intermediate_dim=32, dtype=jnp.bfloat16)
  >>> x = jnp.ones((2, 8, 16), jnp.bfloat16)
  >>> variables = moe.init(jax.random.key(0), x)
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'router_kernel': (16, 4), 'wi_kernel': (4, 16, 2, 32), 'wo_kernel': (4, 32, 16)}
  >>> moe.apply(variables, x).shape
  (2, 8, 16)

  A train step with the auxiliary losses and DeepSeek-V3's expert bias: the losses, each times its coefficient, are
  sown into the ``"aux_loss"`` collection (``AUX_LOSS_COLLECTION``) for the step to add; the bias lives in
  ``"batch_stats"`` (``EXPERT_BIAS_COLLECTION``), out of the optimizer's reach, and a training call
  (``deterministic=False``) returns it moved by ``te_jax.update_expert_bias`` with the step's load:

  >>> import optax, te_jax
  >>> moe = te_flax.MoEBlock(num_experts=4, k=2, intermediate_dim=32, load_balancing_coef=1e-2,
  ...                        use_expert_bias=True)
  >>> variables = moe.init(jax.random.key(0), x)
  >>> params, stats = {"params": variables["params"]}, {"batch_stats": variables["batch_stats"]}
  >>> def loss_fn(params, stats, x):
  ...   y, new = moe.apply({**params, **stats}, x, deterministic=False, mutable=["aux_loss", "batch_stats"])
  ...   aux = sum(jnp.sum(v) for v in jax.tree.leaves(new["aux_loss"]))
  ...   return jnp.mean(y.astype(jnp.float32) ** 2) + aux, {"batch_stats": new["batch_stats"]}
  >>> grads, stats = jax.grad(loss_fn, has_aux=True)(params, stats, x)
  >>> stats["batch_stats"]["expert_bias"].shape
  (4,)

  With ``nn.scan`` over layers, list ``"batch_stats"`` and ``"aux_loss"`` in ``variable_axes`` (with
  ``te_jax.FP8_COLLECTION``); under FP8 the variables dict differentiated by the step holds the FP8 state too, as
  for every te_jax module.

  Attributes:
    num_experts: E, the routed experts.
    k: the experts each token goes to.
    intermediate_dim: each expert's width F.
    activation_type: the experts' activation: ``("silu", "linear")`` (SwiGLU, Mixtral's and DeepSeek's), another
      gated pair, or a single activation (``("gelu",)``).
    score, num_groups, topk_groups, group_topk, normalize_topk, scaling_factor: the routing, as ``te_jax.route``
      takes them (softmax or sigmoid scores; group-limited choice; the chosen weights divided by their sum, then
      scaled).
    use_expert_bias: DeepSeek-V3's auxiliary-loss-free balancing: an (E,) bias added to the scores to choose the
      experts (never to weigh them), in ``"batch_stats"``, not trained.
    expert_bias_update_rate: how far a training call moves each expert's bias (``te_jax.update_expert_bias``'s rate,
      V3's gamma): down for the experts that got more than the mean load, up for those that got less.
    capacity_factor: None (dropless) or the factor of ``te_jax.expert_capacity``: each expert takes at most that many
      of the step's choices, by token order; the others are dropped (they add nothing; the residual carries them).
    load_balancing_coef: the coefficient of ``te_jax.load_balancing_loss``; 0: not computed.
    load_balancing_per_sequence: that loss per sequence (the second-to-last input dim), DeepSeek-V3's
      sequence-wise one.
    z_loss_coef: the coefficient of ``te_jax.z_loss`` of the router logits; 0: not computed.
    shared_intermediate_dim: the width of the shared experts (a dense gated MLP every token goes through, added to
      the routed output; DeepSeek: the number of shared experts times their width); None: none.
    norm_type: a pre-norm of the input, ``"layernorm"`` or ``"rmsnorm"``, which the router, the experts and the
      shared experts read; None: none (the input as it is).
    epsilon, zero_centered_gamma: the pre-norm's.
    use_bias: biases on the experts' and the shared experts' GEMMs.
    router_init: the router kernel's (H, E) initializer.
    kernel_init: the experts' and shared experts' kernel initializer, called on one expert's 2-D (inputs,
      outputs) shape with a key of its own (each half of a gated pair too).
    bias_init: their biases' initializer.
    logical_axes: name the parameters' axes with te_jax's logical names: ``router_kernel`` (embed, None),
      ``wi_kernel`` (expert, embed, act, mlp), ``wo_kernel`` (expert, mlp, embed), the shared experts' as
      ``LayerNormMLP``'s.
    deterministic: whether the call evaluates (True) or trains (False: the expert bias moves, the losses must be
      collected); or give it to the call (one of the two). Needed when the block has losses or a bias to update.
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``); the router computes in
      float32 whatever it is.
    param_dtype: the parameters' dtype.
    recipe: an FP8 recipe overriding autocast's.
  """

  num_experts: int = 8
  k: int = 2
  intermediate_dim: int = 2048
  activation_type: Sequence[str] = ("silu", "linear")
  score: str = "softmax"
  num_groups: int | None = None
  topk_groups: int | None = None
  group_topk: int | None = None
  normalize_topk: bool | None = None
  scaling_factor: float = 1.0
  use_expert_bias: bool = False
  expert_bias_update_rate: float = 1e-3
  capacity_factor: float | None = None
  load_balancing_coef: float = 0.0
  load_balancing_per_sequence: bool = False
  z_loss_coef: float = 0.0
  shared_intermediate_dim: int | None = None
  norm_type: str | None = None
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  use_bias: bool = False
  router_init: Initializer = nn.initializers.lecun_normal()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  logical_axes: bool = False
  deterministic: bool | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: bool | None = None) -> jax.Array:
    """The block's output for ``inputs`` (..., hidden), the input's shape in the compute dtype."""
    if isinstance(deterministic, jax.core.Tracer):
      raise ValueError("MoEBlock: deterministic is a traced value here (nn.remat and jax.checkpoint trace the call's "
                       "arguments): give it to the module instead, MoEBlock(..., deterministic=True), or as a static "
                       "argument")
    given = (self.deterministic, deterministic)
    mode = None if given == (None, None) else bool(nn.merge_param("deterministic", *given))
    if mode is None and self.is_initializing():
      mode = True  # init neither updates the bias nor sows
    return moe_block(LinenScope(self), LinenMoEState(self), options_of(self, MoEBlockOptions), inputs, mode)
