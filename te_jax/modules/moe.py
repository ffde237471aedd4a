"""The body of ``MoEBlock`` (``te_jax.flax``, ``te_jax.nnx``): a mixture-of-experts MLP, the FFN of a Mixtral- or
DeepSeek-style layer.

For tokens ``x`` (..., H), in order:

1. optionally a pre-norm (``norm_type``): LayerNorm or RMSNorm, whose output every later step reads;
2. the router: ``logits = x @ router_kernel`` (H, E) in float32 whatever the compute dtype (a handful of columns,
   never FP8: the expert choice is a top-k of them), then ``te_jax.route`` (softmax or sigmoid scores, the expert
   bias, group-limited choice, normalized and scaled weights);
3. ``te_jax.permute``: each token's k choices listed by expert (dropless by default; at most ``capacity`` rows per
   expert with ``capacity_factor``, the rest dropped), each expert's rows placed at a multiple of what the FP8
   grouped GEMMs need (``te_jax.fused.grouped_dense.group_align``), so that the rows are laid out once, by the
   permutation's gather, and both grouped GEMMs take them as they are (``groups_aligned=True``; with a capacity that
   is not a multiple of the alignment, the grouped GEMMs align the groups themselves);
4. the experts, gated MLPs: ``te_jax.grouped_dense`` with ``wi_kernel`` (E, H, n, F), the activation
   (``activation_type``; n = 2 for a gated pair), ``te_jax.grouped_dense`` with ``wo_kernel`` (E, F, H); under
   ``te_jax.autocast`` both are FP8 grouped GEMMs with per-expert scales (delayed scaling: one state per expert, the
   ``wi_`` and ``wo_`` FP8 state with a leading (E,) dim); the padding rows of the groups are zeroed after the
   first GEMM's bias, so that they add nothing to the second's amaxes;
5. ``te_jax.unpermute``: each token's sum of its experts' rows times the combine weights;
6. optionally shared experts (``shared_intermediate_dim``, DeepSeek's): one dense gated MLP over every token
   (``shared_wi_kernel`` (H, n, Fs), ``shared_wo_kernel`` (Fs, H), FP8 ``te_jax.dense`` GEMMs), the routed output
   added in its second GEMM's epilogue.

What the framework keeps its own way goes through ``MoEState``: the expert bias (DeepSeek-V3's auxiliary-loss-free
balancing, arXiv 2412.19437 §2.1.2), a non-trained variable that the training call moves by
``te_jax.update_expert_bias`` with the step's load (linen: ``"batch_stats"``; NNX: ``nnx.BatchStat``); and the
auxiliary losses, each already multiplied by its coefficient, which the train step adds to its loss (linen: sown
into the ``"aux_loss"`` collection; NNX: ``AuxLoss`` variables).

Sharding: with ``logical_axes=True`` the experts' kernels and biases carry the ``"expert"`` logical axis name
(``te_jax.modules.axes.EXPERT``) on their leading dim, which ``te_jax.flax.logical_axis_rules(expert=...)`` maps
to a mesh axis (the same rules shard the tokens over it with the batch); the permutation and the grouped GEMMs are
written for every expert and token, and XLA's partitioner places them (``te_jax.fused.expert_parallel`` is the
shard_map form with all-to-all dispatch).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from te_jax._core.autocast import resolve_recipe
from te_jax._core.explicit import retype
from te_jax.fused.dense import dense
from te_jax.fused.grouped_dense import group_align, grouped_dense
from te_jax.fused.moe_permute import expert_capacity, permute, unpermute
from te_jax.fused.moe_router import RouterConfig, load_balancing_loss, route, update_expert_bias, z_loss
from te_jax.modules.axes import ACT, EMBED, EXPERT, MLP, Initializer, axes, is_int
from te_jax.modules.layernorm_dense import norm_params
from te_jax.modules.scope import Scope
from te_jax.ops.activation import activation, parse_activation_type
from te_jax.ops.norm import layernorm
from te_jax.recipe import Recipe

__all__ = ["AUX_LOSSES", "MoEBlockOptions", "MoEState", "expert_init", "moe_block", "moe_block_params"]

# The auxiliary losses a block reports, by name: the option holding each one's coefficient.
AUX_LOSSES = {"load_balancing_loss": "load_balancing_coef", "z_loss": "z_loss_coef"}

_NORMS = (None, "layernorm", "rmsnorm")


def _is_float(v) -> bool:
  number = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, (bool, np.bool_))
  return number and math.isfinite(v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEBlockOptions:
  """The options of ``MoEBlock``: the linen module's attributes (documented there, with their defaults) but
  ``deterministic``, which each framework resolves its own way; the NNX module maps its constructor's arguments onto
  them."""

  num_experts: int
  k: int
  intermediate_dim: int
  activation_type: Sequence[str]
  score: str
  num_groups: int | None
  topk_groups: int | None
  group_topk: int | None
  normalize_topk: bool | None
  scaling_factor: float
  use_expert_bias: bool
  expert_bias_update_rate: float
  capacity_factor: float | None
  load_balancing_coef: float
  load_balancing_per_sequence: bool
  z_loss_coef: float
  shared_intermediate_dim: int | None
  norm_type: str | None
  epsilon: float
  zero_centered_gamma: bool
  use_bias: bool
  router_init: Initializer
  kernel_init: Initializer
  bias_init: Initializer
  logical_axes: bool
  dtype: Any
  param_dtype: Any
  recipe: Recipe | None

  def __post_init__(self):
    object.__setattr__(self, "activation_type", tuple(self.activation_type))
    for name in ("num_experts", "intermediate_dim"):
      v = getattr(self, name)
      if not (is_int(v) and v > 0):
        raise ValueError(f"MoEBlock: {name} must be a positive int, got {v!r}")
    if not (is_int(self.k) and 1 <= self.k <= self.num_experts):
      raise ValueError(f"MoEBlock: k={self.k!r} must be an int between 1 and num_experts={self.num_experts}")
    if self.shared_intermediate_dim is not None and not (
        is_int(self.shared_intermediate_dim) and self.shared_intermediate_dim > 0):
      raise ValueError(f"MoEBlock: shared_intermediate_dim must be a positive int (or None: no shared experts), got "
                       f"{self.shared_intermediate_dim!r}")
    parse_activation_type(self.activation_type)
    try:
      self.router_config
    except (TypeError, ValueError) as e:  # route's checks, in the module's words
      raise type(e)(str(e).replace("route: ", "MoEBlock: ").replace("logits.shape[-1]", "num_experts")) from None
    if self.capacity_factor is not None:
      expert_capacity(1, 1, 1, self.capacity_factor)  # raises naming capacity_factor
    for name in ("load_balancing_coef", "z_loss_coef", "expert_bias_update_rate"):
      v = getattr(self, name)
      if not (_is_float(v) and v >= 0):
        raise ValueError(f"MoEBlock: {name} must be a finite float >= 0, got {v!r}")
    if self.norm_type not in _NORMS:
      raise ValueError(f"MoEBlock: norm_type must be one of {_NORMS} (None: no pre-norm), got {self.norm_type!r}")

  @property
  def router_config(self) -> RouterConfig:
    return RouterConfig(num_experts=self.num_experts, k=self.k, score=self.score, num_groups=self.num_groups,
                        topk_groups=self.topk_groups, group_topk=self.group_topk, normalize_topk=self.normalize_topk,
                        scaling_factor=self.scaling_factor)

  @property
  def act(self) -> tuple[str, ...]:
    name, gated = parse_activation_type(self.activation_type)
    return (name, "linear") if gated else (name,)

  @property
  def aux_losses(self) -> tuple[str, ...]:
    """The auxiliary losses the block reports: those with a coefficient above 0."""
    return tuple(name for name, coef in AUX_LOSSES.items() if getattr(self, coef) > 0)

  @property
  def updates_expert_bias(self) -> bool:
    return self.use_expert_bias and self.expert_bias_update_rate > 0

  @property
  def needs_mode(self) -> bool:
    """Whether a call must know if it is training: it then updates the expert bias or reports losses it must not
    lose."""
    return self.updates_expert_bias or bool(self.aux_losses)


class MoEState(abc.ABC):
  """What an MoE block keeps its framework's own way (the body reads and writes it through this)."""

  @abc.abstractmethod
  def declare(self, o: MoEBlockOptions) -> None:
    """Where the framework creates variables ahead of the call (NNX): the expert bias (``use_expert_bias``) and a
    variable per auxiliary loss. A no-op where the call creates them (linen)."""

  @abc.abstractmethod
  def expert_bias(self, num_experts: int) -> jax.Array:
    """The ``(num_experts,)`` float32 expert bias (zeros when created)."""

  @abc.abstractmethod
  def set_expert_bias(self, value: jax.Array) -> None:
    """Stores the next step's expert bias (linen: not while initializing, and the collection must be mutable)."""

  @abc.abstractmethod
  def report(self, name: str, value: jax.Array, training: bool) -> None:
    """Hands the auxiliary loss ``name`` (a float32 scalar, times its coefficient) to the train step; where it cannot
    (linen: its collection not mutable), raises when ``training``, else drops it."""


def expert_init(init: Initializer, n_in: int, part_axis: int | None = None) -> Initializer:
  """An initializer of a stack of E kernels (E, *kernel): expert e's is ``init``'s kernel for key
  ``jax.random.split(key, E)[e]``, drawn on its 2-D (inputs, outputs) shape (the first ``n_in`` dims its inputs) as
  Flax's dense layers draw theirs, so that a fan-based initializer sees one expert's fan; with ``part_axis`` (a
  feature axis of the kernel, without the experts' dim), each of its parts (a gated pair) is a kernel of its own, of
  key ``jax.random.split(key_e, parts)[p]``.

  >>> import jax, jax.numpy as jnp
  >>> init = expert_init(jax.nn.initializers.lecun_normal(), 1)
  >>> w = init(jax.random.key(0), (4, 8, 16), jnp.float32)
  >>> w.shape, bool(jnp.all(w[1] == jax.nn.initializers.lecun_normal()(jax.random.split(jax.random.key(0), 4)[1],
  ...                                                                  (8, 16))))
  ((4, 8, 16), True)
  """

  def one(key, shape, dtype):
    inputs = math.prod(shape[:n_in])
    if part_axis is None:
      return jnp.reshape(init(key, (inputs, math.prod(shape[n_in:])), dtype), shape)
    part_shape = shape[:part_axis] + shape[part_axis + 1:]
    flat = (inputs, math.prod(part_shape[n_in:]))
    parts = [jnp.reshape(init(kp, flat, dtype), part_shape) for kp in jax.random.split(key, shape[part_axis])]
    return jnp.stack(parts, axis=part_axis)

  def stacked(key, shape, dtype):
    shape = tuple(shape)
    return jax.vmap(lambda k: one(k, shape[1:], dtype))(jax.random.split(key, shape[0]))

  return stacked


def moe_block_params(scope: Scope, state: MoEState, o: MoEBlockOptions, hidden: int):
  """The block's parameters over inputs of last dim ``hidden``, in creation order, as a dict by name (absent ones
  None); its FP8 state (the experts' per expert) and its framework state (``state.declare``)."""
  e, f, n_act = o.num_experts, o.intermediate_dim, len(o.act)
  named = o.logical_axes
  p: dict[str, jax.Array | None] = dict.fromkeys(("ln_scale", "ln_bias", "wi_bias", "wo_bias", "shared_wi_kernel",
                                                  "shared_wo_kernel", "shared_wi_bias", "shared_wo_bias"))
  if o.norm_type is not None:
    p["ln_scale"], p["ln_bias"] = norm_params(
        scope, hidden, norm_type=o.norm_type, epsilon=o.epsilon, zero_centered_gamma=o.zero_centered_gamma,
        scale_init=None, bias_init=jax.nn.initializers.zeros, scale_axes=axes(named, EMBED),
        bias_axes=axes(named, EMBED), param_dtype=o.param_dtype, prefix="ln_")
  p["router_kernel"] = scope.param("router_kernel", o.router_init, (hidden, e), o.param_dtype, n_in=1,
                                   axes=axes(named, EMBED, None))
  part = 1 if n_act > 1 else None
  p["wi_kernel"] = scope.param("wi_kernel", expert_init(o.kernel_init, 1, part), (e, hidden, n_act, f),
                               o.param_dtype, axes=axes(named, EXPERT, EMBED, ACT, MLP))
  p["wo_kernel"] = scope.param("wo_kernel", expert_init(o.kernel_init, 1), (e, f, hidden), o.param_dtype,
                               axes=axes(named, EXPERT, MLP, EMBED))
  if o.use_bias:
    p["wi_bias"] = scope.param("wi_bias", o.bias_init, (e, n_act, f), o.param_dtype, axes=axes(named, EXPERT, ACT, MLP))
    p["wo_bias"] = scope.param("wo_bias", o.bias_init, (e, hidden), o.param_dtype, axes=axes(named, EXPERT, EMBED))
  if o.shared_intermediate_dim is not None:
    fs = o.shared_intermediate_dim
    p["shared_wi_kernel"] = scope.param("shared_wi_kernel", o.kernel_init, (hidden, n_act, fs), o.param_dtype,
                                        n_in=1, part_axis=part, axes=axes(named, EMBED, ACT, MLP))
    p["shared_wo_kernel"] = scope.param("shared_wo_kernel", o.kernel_init, (fs, hidden), o.param_dtype, n_in=1,
                                        axes=axes(named, MLP, EMBED))
    if o.use_bias:
      p["shared_wi_bias"] = scope.param("shared_wi_bias", o.bias_init, (n_act, fs), o.param_dtype,
                                        axes=axes(named, ACT, MLP))
      p["shared_wo_bias"] = scope.param("shared_wo_bias", o.bias_init, (hidden,), o.param_dtype,
                                        axes=axes(named, EMBED))
    scope.declare_fp8_state(o.recipe, ("shared_wi_", "shared_wo_"))
  scope.declare_fp8_state(o.recipe, ("wi_", "wo_"), groups=e)
  state.declare(o)
  return p


def _merged(a: jax.Array | None, lead: int) -> jax.Array | None:
  """``a`` with its dims from ``lead`` on merged into one (a gated kernel's (n, F) into one GEMM's n * F)."""
  return None if a is None else a.reshape(*a.shape[:lead], -1)


def _gated_mlp(h: jax.Array, act: tuple[str, ...]) -> jax.Array:
  return activation(h.reshape(*h.shape[:-1], 2, -1) if len(act) == 2 else h, act)


def _rows_align(recipe: Recipe | None, o: MoEBlockOptions, num_tokens: int, kernel_shapes) -> int:
  """The multiple ``permute`` places the experts' groups at for both grouped GEMMs to take them as they are
  (``group_align``, the larger of the two: each is a power of two); 1 where a capacity is not a multiple of it
  (aligning would raise the capacity, changing which choices are dropped)."""
  align = max(group_align(recipe, shape) for shape in kernel_shapes)
  if o.capacity_factor is not None and expert_capacity(num_tokens, o.k, o.num_experts, o.capacity_factor) % align:
    return 1
  return align


def moe_block(scope: Scope, state: MoEState, o: MoEBlockOptions, inputs: jax.Array,
              deterministic: bool | None) -> jax.Array:
  """``MoEBlock``'s call (documented on the linen module); ``deterministic`` as the framework resolved it (None:
  given nowhere)."""
  inputs = jnp.asarray(inputs)
  if inputs.ndim < 2 or not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise ValueError(f"MoEBlock: inputs must be float tokens (..., hidden) with at least one leading dim, got "
                     f"{inputs.dtype} {inputs.shape}")
  if deterministic is None and o.needs_mode:
    doing = " and ".join(([f"reports {', '.join(o.aux_losses)}"] if o.aux_losses else []) +
                         (["updates its expert bias"] if o.updates_expert_bias else []))
    raise ValueError(f"{scope.where}: the MoE block {doing} in training: pass deterministic=False (training) or "
                     "True (evaluation), to the call or to the module")
  training = deterministic is False
  hidden, e, f = inputs.shape[-1], o.num_experts, o.intermediate_dim
  p = moe_block_params(scope, state, o, hidden)
  dtype = o.dtype or jnp.result_type(inputs.dtype, o.param_dtype)
  recipe = resolve_recipe(o.recipe)
  x = inputs.astype(dtype)
  if o.norm_type is not None:
    x = layernorm(x, p["ln_scale"], p["ln_bias"], norm_type=o.norm_type, epsilon=o.epsilon,
                  zero_centered_gamma=o.zero_centered_gamma, dtype=dtype)
  x, (meta_wi, meta_wo) = scope.fp8_state(recipe, x, ("wi_", "wo_"), groups=e)
  if o.shared_intermediate_dim is not None:
    x, (meta_swi, meta_swo) = scope.fp8_state(recipe, x, ("shared_wi_", "shared_wo_"))

  tokens = x.reshape(-1, hidden)
  logits = jax.lax.dot_general(tokens.astype(jnp.float32), p["router_kernel"].astype(jnp.float32),
                               (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
  cfg = o.router_config
  bias = state.expert_bias(e) if o.use_expert_bias else None
  routing = route(logits, o.k, score=cfg.score, num_groups=cfg.num_groups, topk_groups=cfg.topk_groups,
                  group_topk=cfg.group_topk, expert_bias=bias, normalize_topk=cfg.normalize_topk,
                  scaling_factor=cfg.scaling_factor)
  wi = _merged(p["wi_kernel"], 2)
  align = _rows_align(recipe, o, tokens.shape[0], (wi.shape, p["wo_kernel"].shape))
  rows, group_sizes, plan = permute(tokens, routing.experts, e, capacity_factor=o.capacity_factor, align=align)
  aligned = align > 1
  h = grouped_dense(rows, wi, group_sizes, _merged(p["wi_bias"], 1), fp8_meta=meta_wi, recipe=recipe,
                    groups_aligned=aligned)
  if o.use_bias and (aligned or o.capacity_factor is not None):  # the padding rows: zeros again
    h = jnp.where((plan.assignment < plan.config.num_assignments)[:, None], h, jnp.zeros((), h.dtype))
  y_rows = grouped_dense(_gated_mlp(h, o.act), p["wo_kernel"], group_sizes, p["wo_bias"], fp8_meta=meta_wo,
                         recipe=recipe, groups_aligned=aligned)
  y = unpermute(y_rows, plan, routing.weights)
  if o.shared_intermediate_dim is not None:
    hs = dense(tokens, _merged(p["shared_wi_kernel"], 1), _merged(p["shared_wi_bias"], 0), fp8_meta=meta_swi,
               recipe=recipe)
    y = dense(_gated_mlp(hs, o.act), p["shared_wo_kernel"], p["shared_wo_bias"], residual=y, fp8_meta=meta_swo,
              recipe=recipe)

  if o.aux_losses:
    # the loss counts the choices with a scatter, which on Explicit mesh axes takes whole operands
    scores = retype(routing.scores, P()).reshape(*inputs.shape[:-1], e)
    experts = retype(routing.experts, P()).reshape(*inputs.shape[:-1], o.k)
    values = {"load_balancing_loss": lambda: load_balancing_loss(scores, experts,
                                                                  per_sequence=o.load_balancing_per_sequence),
              "z_loss": lambda: z_loss(logits)}
    for name in o.aux_losses:
      state.report(name, jnp.float32(getattr(o, AUX_LOSSES[name])) * values[name](), training)
  if training and o.updates_expert_bias:
    state.set_expert_bias(update_expert_bias(bias, plan.tokens_per_expert, o.expert_bias_update_rate))
  return y.reshape(inputs.shape[:-1] + (hidden,))
