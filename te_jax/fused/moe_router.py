"""Mixture-of-experts routing: which ``k`` experts each token goes to, with what combine weights, and the losses that
keep the experts balanced.

Everything here is plain jnp in float32 and is differentiated by JAX itself: the expert choice is a ``lax.top_k``
whose indices carry no gradient, and the combine weights are the chosen experts' scores (gathered, then optionally
normalized and scaled), so the gradient reaches the router logits through the chosen experts' scores alone, as the
papers define the gate (Switch Transformer, arXiv 2101.03961 §2.1; DeepSeek-V3, arXiv 2412.19437 §2.1.2).

``route`` in order, for each token's row of logits ``u`` (E experts):

1. ``scores = softmax(u)`` or ``sigmoid(u)`` in float32 (``score``): the affinities ``s``.
2. ``selection = scores + expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing bias, §2.1.2: used to choose
   the experts, never in the combine weights), or ``scores`` without a bias.
3. Group-limited routing (``num_groups`` G, ``topk_groups`` M; DeepSeek-V2's device-limited routing, arXiv
   2405.04434 §2.2.2, and V3's node-limited routing, §2.1.2): the experts are G consecutive groups of E / G; a group's
   score is the sum of its ``group_topk`` highest selection scores (V3: the highest K / M, where each of M nodes holds
   the top experts; V2: its single highest, ``group_topk=1``); the M best groups stay, the other groups' experts are
   set to -inf.
4. ``experts``: the k highest selection scores, in descending order; ties go to the lower expert index (and
   equal group scores to the lower group), as ``lax.top_k`` orders them.
5. ``weights``: the chosen experts' ``scores`` (without the bias); with ``normalize_topk`` divided by their sum
   (V3 §2.1.2; for softmax scores the same as a softmax over the chosen logits, Mixtral's gate), in float32 as a
   multiply by the sum's reciprocal (the sum at least the smallest normal float32, so that sigmoid scores that all
   underflowed give zeros, not NaN), then times ``scaling_factor`` (V3's routed scaling factor).

The losses take what ``route`` returns and give the unscaled loss: the caller multiplies by its coefficient.

>>> import jax.numpy as jnp
>>> from te_jax.fused.moe_router import route, load_balancing_loss, z_loss
>>> r = route(jnp.array([[2.0, 0.0, 1.0, 0.0], [0.0, 3.0, 0.0, 3.0]]), 2, normalize_topk=True)
>>> r.experts.tolist()
[[0, 2], [1, 3]]
>>> [[round(w, 4) for w in row] for row in r.weights.tolist()]
[[0.7311, 0.2689], [0.5, 0.5]]
>>> round(float(load_balancing_loss(r.scores, r.experts)), 4), round(float(z_loss(jnp.zeros((3, 4)))), 4)
(1.0, 1.9218)
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RouterConfig", "Routing", "load_balancing_loss", "route", "tokens_per_expert", "update_expert_bias",
           "z_loss"]

_SCORES = ("softmax", "sigmoid")
_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32: a sum of weights that underflowed divides by it


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """The static parameters of ``route`` (see its arguments), checked on construction.

  >>> RouterConfig(num_experts=8, k=2, num_groups=4, topk_groups=2).group_topk
  1
  """

  num_experts: int
  k: int
  score: str = "softmax"
  num_groups: int | None = None
  topk_groups: int | None = None
  group_topk: int | None = None
  normalize_topk: bool | None = None
  scaling_factor: float = 1.0

  def __post_init__(self):
    e, k = self.num_experts, self.k
    if not _is_int(e) or e < 1:
      raise ValueError(f"route: the logits' last dim (the number of experts) must be >= 1, got {e!r}")
    if not _is_int(k) or not 1 <= k <= e:
      raise ValueError(f"route: k={k!r} must be an int between 1 and the number of experts (logits.shape[-1]={e})")
    if self.score not in _SCORES:
      raise ValueError(f"route: score={self.score!r} must be one of {_SCORES}")
    if (self.num_groups is None) != (self.topk_groups is None):
      raise ValueError(f"route: num_groups={self.num_groups!r} and topk_groups={self.topk_groups!r} come together "
                       "(group-limited routing needs both); pass both or neither")
    if self.num_groups is None:
      if self.group_topk is not None:
        raise ValueError(f"route: group_topk={self.group_topk!r} needs num_groups and topk_groups")
    else:
      g, m = self.num_groups, self.topk_groups
      if not _is_int(g) or g < 1 or e % g:
        raise ValueError(f"route: num_groups={g!r} must be a positive int dividing the number of experts "
                         f"(logits.shape[-1]={e})")
      if not _is_int(m) or not 1 <= m <= g:
        raise ValueError(f"route: topk_groups={m!r} must be an int between 1 and num_groups={g}")
      if k > m * (e // g):
        raise ValueError(f"route: k={k} experts cannot be chosen from topk_groups={m} groups of {e // g} experts; "
                         f"raise topk_groups to at least {-(-k // (e // g))}")
      gk = self.group_topk
      if gk is None:
        object.__setattr__(self, "group_topk", min(max(k // m, 1), e // g))
      elif not _is_int(gk) or not 1 <= gk <= e // g:
        raise ValueError(f"route: group_topk={gk!r} must be an int between 1 and the group size {e // g}")
    if self.normalize_topk is None:
      object.__setattr__(self, "normalize_topk", self.score == "sigmoid")
    elif not isinstance(self.normalize_topk, (bool, np.bool_)):
      raise TypeError(f"route: normalize_topk must be a bool (or None), got {self.normalize_topk!r}")
    s = self.scaling_factor
    if isinstance(s, bool) or not isinstance(s, (int, float, np.floating, np.integer)) or not math.isfinite(s):
      raise TypeError(f"route: scaling_factor must be a finite Python float, got {s!r}")
    object.__setattr__(self, "scaling_factor", float(s))

  @property
  def grouped(self) -> bool:
    return self.num_groups is not None


class Routing(NamedTuple):
  """What ``route`` returns.

  Attributes:
    experts: ``(..., k)`` int32, each token's chosen experts, best first.
    weights: ``(..., k)`` float32, the combine weights of those experts (differentiable).
    scores: ``(..., E)`` float32, every expert's score (softmax or sigmoid of the logits, without the bias): what
      ``load_balancing_loss`` takes.
  """

  experts: jax.Array
  weights: jax.Array
  scores: jax.Array


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_float(name: str, a: jax.Array, fn: str = "route"):
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{fn}: {name} must be a floating-point array, got {jnp.dtype(a.dtype).name}")


def _scores(logits: jax.Array, score: str) -> jax.Array:
  u = logits.astype(jnp.float32)
  return jax.nn.softmax(u, axis=-1) if score == "softmax" else jax.nn.sigmoid(u)


def _limit_groups(selection: jax.Array, cfg: RouterConfig) -> jax.Array:
  """``selection`` with the experts outside each token's ``topk_groups`` best groups set to -inf."""
  g = cfg.num_groups
  grouped = selection.reshape(*selection.shape[:-1], g, cfg.num_experts // g)
  group_score = jnp.sum(jax.lax.top_k(grouped, cfg.group_topk)[0], axis=-1)  # (..., G)
  _, best = jax.lax.top_k(group_score, cfg.topk_groups)  # (..., M)
  keep = jnp.any(best[..., :, None] == jnp.arange(g), axis=-2)  # (..., G)
  return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(selection.shape)


def route(
    logits: jax.Array,
    k: int,
    *,
    score: str = "softmax",
    num_groups: int | None = None,
    topk_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: jax.Array | None = None,
    normalize_topk: bool | None = None,
    scaling_factor: float = 1.0,
) -> Routing:
  """Top-k routing of each token over ``logits.shape[-1]`` experts (the steps are in the module's docstring).

  >>> import jax.numpy as jnp
  >>> r = route(jnp.array([[0.0, 1.0, 2.0, 3.0]]), 1, score="sigmoid", expert_bias=jnp.array([3.0, 0, 0, 0]))
  >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()]  # the bias chooses, the score weighs
  ([[0]], [1.0])
  >>> r = route(jnp.array([[0.0, 1.0, 2.0, 3.0]]), 1, score="sigmoid", normalize_topk=False)
  >>> r.experts.tolist(), round(float(r.weights[0, 0]), 4)
  ([[3]], 0.9526)

  Args:
    logits: ``(..., E)`` router logits, any float dtype (the scores are computed in float32).
    k: how many experts each token goes to, 1 <= k <= E.
    score: ``"softmax"`` (Switch, GShard, Mixtral, DeepSeek-V2) or ``"sigmoid"`` (DeepSeek-V3).
    num_groups: group-limited routing: the experts form this many groups of consecutive experts (devices or nodes).
    topk_groups: with ``num_groups``, how many groups each token may route to.
    group_topk: with ``num_groups``, how many of a group's highest selection scores add up to its score; default
      ``k // topk_groups`` (at least 1, at most the group size), V3's rule; 1 is V2's (a group's highest score).
    expert_bias: ``(E,)`` float, added to the scores to choose the experts only (V3's balancing bias, updated by
      ``update_expert_bias``, not by gradients: it gets none).
    normalize_topk: divide the k weights by their sum; default True for sigmoid scores (V3), False for softmax
      (Switch, V2; pass True for Mixtral's gate).
    scaling_factor: multiplies the weights (V3's routed scaling factor, after the normalization).

  Returns:
    ``Routing(experts, weights, scores)``.
  """
  logits = jnp.asarray(logits)
  _check_float("logits", logits)
  if logits.ndim < 1:
    raise ValueError("route: logits must have the experts as their last dim, got a scalar")
  cfg = RouterConfig(num_experts=int(logits.shape[-1]), k=k, score=score, num_groups=num_groups,
                     topk_groups=topk_groups, group_topk=group_topk, normalize_topk=normalize_topk,
                     scaling_factor=scaling_factor)
  if expert_bias is not None:
    expert_bias = jnp.asarray(expert_bias)
    _check_float("expert_bias", expert_bias)
    if expert_bias.shape != (cfg.num_experts,):
      raise ValueError(f"route: expert_bias must have shape ({cfg.num_experts},) (one per expert), "
                       f"got {expert_bias.shape}")
  return route_ref(logits, cfg, expert_bias)


def route_ref(logits: jax.Array, cfg: RouterConfig, expert_bias: jax.Array | None = None) -> Routing:
  """``route`` without the argument checks: the definition (the module's docstring gives its steps)."""
  scores = _scores(logits, cfg.score)
  selection = scores
  if expert_bias is not None:
    selection = selection + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))
  selection = jax.lax.stop_gradient(selection)  # only indices come out of it
  if cfg.grouped:
    selection = _limit_groups(selection, cfg)
  _, experts = jax.lax.top_k(selection, cfg.k)
  experts = experts.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.normalize_topk:
    # Times the reciprocal of the sum, as XLA computes a division by a broadcast row value anyway.
    weights = weights * (1.0 / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), _TINY))
  if cfg.scaling_factor != 1.0:
    weights = weights * jnp.float32(cfg.scaling_factor)
  return Routing(experts, weights, scores)


def _check_routing(fn: str, scores: jax.Array, experts: jax.Array):
  _check_float("scores", scores, fn)
  if not jnp.issubdtype(experts.dtype, jnp.integer):
    raise TypeError(f"{fn}: experts must be an integer array (route's experts), got {jnp.dtype(experts.dtype).name}")
  if scores.ndim < 2 or experts.shape[:-1] != scores.shape[:-1]:
    raise ValueError(f"{fn}: scores (..., E) and experts (..., k) must share their leading (token) dims, got "
                     f"scores {scores.shape} and experts {experts.shape}")


def tokens_per_expert(experts: jax.Array, num_experts: int) -> jax.Array:
  """``(num_experts,)`` int32: how many of the ``(..., k)`` choices in ``experts`` went to each expert (ids outside
  ``[0, num_experts)`` count for none).

  >>> tokens_per_expert(jnp.array([[0, 2], [2, 1]]), 4).tolist()
  [1, 1, 2, 0]
  """
  if not _is_int(num_experts) or num_experts < 1:
    raise ValueError(f"tokens_per_expert: num_experts must be a positive int, got {num_experts!r}")
  experts = jnp.asarray(experts)
  if not jnp.issubdtype(experts.dtype, jnp.integer):
    raise TypeError(f"tokens_per_expert: experts must be an integer array, got {jnp.dtype(experts.dtype).name}")
  return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)


def load_balancing_loss(scores: jax.Array, experts: jax.Array, *, per_sequence: bool = False) -> jax.Array:
  """The auxiliary load-balancing loss ``E * sum_i f_i * P_i`` (float32 scalar; 1 when every expert gets the same
  share of choices and of score).

  ``f_i`` is the share of the ``T * k`` choices that went to expert i (Switch Transformer, arXiv 2101.03961 eq. 4-6,
  whose k = 1; DeepSeek-V2's expert-level balance loss, arXiv 2405.04434 §2.2.3, for k > 1: ``count_i / (T k)``)
  and carries no gradient; ``P_i`` is the mean over the T tokens of expert i's score normalized over the experts
  (``s / sum_j s_j``: DeepSeek-V3's, §2.1.2, for sigmoid scores; for softmax scores the normalization changes only the
  last bits), through which the gradient flows.

  >>> import jax.numpy as jnp
  >>> float(load_balancing_loss(jnp.full((4, 2), 0.5), jnp.array([[0], [1], [0], [1]])))
  1.0

  Args:
    scores: ``(..., T, E)`` the scores ``route`` returns.
    experts: ``(..., T, k)`` the experts ``route`` chose.
    per_sequence: DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2): ``f`` and ``P`` over each
      sequence (the second-to-last dim, T) on its own, the loss averaged over the sequences (the leading dims);
      otherwise over every token at once. ``f`` counts the experts given (the choice ``route`` made, its bias
      included).
  """
  scores, experts = jnp.asarray(scores), jnp.asarray(experts)
  _check_routing("load_balancing_loss", scores, experts)
  e, k = scores.shape[-1], experts.shape[-1]
  s = scores.astype(jnp.float32)
  s = s / jnp.maximum(jnp.sum(s, axis=-1, keepdims=True), _TINY)
  if not per_sequence:
    s, experts = s.reshape(1, -1, e), experts.reshape(1, -1, k)
  else:
    s, experts = s.reshape(-1, *s.shape[-2:]), experts.reshape(-1, *experts.shape[-2:])
  t = s.shape[-2]
  counts = jax.vmap(lambda ex: jnp.bincount(ex.reshape(-1), length=e))(experts).astype(jnp.float32)  # (B, E)
  f = counts / jnp.float32(t * k)
  p = jnp.mean(s, axis=-2)  # (B, E)
  return jnp.mean(jnp.float32(e) * jnp.sum(f * p, axis=-1))


def z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE's router z-loss (arXiv 2202.08906 eq. 5): the mean over tokens of ``logsumexp(logits)**2``, float32.

  >>> import jax.numpy as jnp
  >>> float(z_loss(jnp.zeros((2, 1))))
  0.0

  Args:
    logits: ``(..., E)`` router logits, any float dtype (computed in float32).
  """
  logits = jnp.asarray(logits)
  _check_float("logits", logits, "z_loss")
  if logits.ndim < 1 or logits.shape[-1] < 1:
    raise ValueError(f"z_loss: logits must be (..., E) with E >= 1, got shape {logits.shape}")
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def update_expert_bias(expert_bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's bias update (arXiv 2412.19437 §2.1.2): after each step, ``rate`` (their gamma) less for the experts
  that got more than the mean count, ``rate`` more for those that got fewer, unchanged for those at the mean.

  >>> import jax.numpy as jnp
  >>> update_expert_bias(jnp.zeros(3), jnp.array([5, 2, 2]), 0.5).tolist()
  [-0.5, 0.5, 0.5]

  Args:
    expert_bias: ``(E,)`` float, the bias ``route`` takes.
    tokens_per_expert: ``(E,)`` the load of the step (``tokens_per_expert(routing.experts, E)``, summed over
      data-parallel replicas by the caller).
    rate: the update speed, a Python float.
  """
  expert_bias, tokens_per_expert = jnp.asarray(expert_bias), jnp.asarray(tokens_per_expert)
  _check_float("expert_bias", expert_bias, "update_expert_bias")
  if expert_bias.ndim != 1 or tokens_per_expert.shape != expert_bias.shape:
    raise ValueError(f"update_expert_bias: expert_bias and tokens_per_expert must both be (E,), got "
                     f"{expert_bias.shape} and {tokens_per_expert.shape}")
  if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating, np.integer)) or not math.isfinite(rate):
    raise TypeError(f"update_expert_bias: rate must be a finite Python float, got {rate!r}")
  load = tokens_per_expert.astype(jnp.float32)
  step = jnp.sign(jnp.mean(load) - load) * jnp.float32(rate)
  return (expert_bias.astype(jnp.float32) + step).astype(expert_bias.dtype)
