"""Mixture-of-experts routing (te_jax.fused.moe_router) and token permutation (te_jax.fused.moe_permute).

References: small NumPy programs that state each result directly (a stable sort of the negated selection scores for
the top-k choice, Python loops over the assignments for the permutation's layout), compared bit for bit where the
operations are the same: choices, layouts, gathers, the sums of k rows in j order, the weights' float32 arithmetic.

Tolerances, where the order of a float32 computation is XLA's to choose:
- a weighted sum of k rows (``unpermute``; XLA:CPU may contract a multiply and an add into one FMA): the a-priori
  bound of any order of a k-term dot product, ``|computed - exact| <= gamma_k * sum_j |w_j y_j|`` with ``gamma_k = k u
  / (1 - k u)``, u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5), plus the final rounding
  to the output dtype (its unit roundoff times the result) and 2^-126 per term for XLA:CPU's flush of subnormals;
- the losses and the gradients through a GEMM: the tolerance rule of CONTRIBUTING.md, ``err(ours, f64) <= 2 *
  err(ref32, f64) + noise`` against an independent float32 evaluation of the same formula (NumPy, or a dense one-hot
  jnp program), ``noise`` 4 float32 roundings of the largest magnitude.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
from conftest import F32_U, assert_within_rule
from te_jax.fused.grouped_dense import grouped_dense
from te_jax.fused.moe_permute import (PermuteConfig, PermutePlan, expert_capacity, permute, permute_ref, unpermute,
                                      unpermute_ref)
from te_jax.fused.moe_router import (RouterConfig, load_balancing_loss, route, tokens_per_expert, update_expert_bias,
                                     z_loss)
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_block import quantize_block_ref

TINY = np.float32(np.finfo(np.float32).tiny)

# Jitted entry points: one compile per case instead of one per jnp op (eager dispatch compiles each op on its own,
# which would take most of this file's time). The argument checks run at trace time all the same.
route_j = jax.jit(route, static_argnums=1, static_argnames=("score", "num_groups", "topk_groups", "group_topk",
                                                            "normalize_topk", "scaling_factor"))
permute_j = jax.jit(permute, static_argnums=2, static_argnames=("capacity_factor", "align"))
unpermute_j = jax.jit(unpermute)


def rng_logits(seed, shape, spread=2.0, dtype=np.float32):
  return (spread * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


# ---- NumPy references ------------------------------------------------------------------------------------------------


def np_route(scores, k, bias=None, num_groups=None, topk_groups=None, group_topk=None, normalize=False, scaling=1.0):
  """The choice and weights from float32 scores (..., E): the steps of moe_router's docstring, in float32."""
  scores = np.asarray(scores, np.float32)
  e = scores.shape[-1]
  sel = scores + np.asarray(bias, np.float32) if bias is not None else scores.copy()
  if num_groups is not None:
    grouped = sel.reshape(*sel.shape[:-1], num_groups, e // num_groups)
    top = -np.sort(-grouped, axis=-1)[..., :group_topk]
    gscore = top[..., 0]
    for i in range(1, group_topk):
      gscore = gscore + top[..., i]
    best = np.argsort(-gscore, axis=-1, kind="stable")[..., :topk_groups]
    keep = np.zeros(gscore.shape, bool)
    np.put_along_axis(keep, best, True, axis=-1)
    sel = np.where(keep[..., None], grouped, -np.inf).reshape(sel.shape).astype(np.float32)
  experts = np.argsort(-sel, axis=-1, kind="stable")[..., :k]
  w = np.take_along_axis(scores, experts, axis=-1)
  if normalize:
    total = w[..., 0]
    for j in range(1, k):
      total = total + w[..., j]
    w = w * (np.float32(1) / np.maximum(total, TINY))[..., None]
  if scaling != 1.0:
    w = w * np.float32(scaling)
  return experts, w


def np_scores(logits, score, dtype):
  u = np.asarray(logits, np.float32).astype(dtype)
  if score == "sigmoid":
    return 1 / (1 + np.exp(-u))
  e = np.exp(u - np.max(u, axis=-1, keepdims=True))
  return e / np.sum(e, axis=-1, keepdims=True)


def np_layout(experts, num_experts, capacity=None, align=1):
  """(assignment of each row, row of each assignment, group sizes, rows) by loops over the assignments."""
  ex = np.asarray(experts).reshape(-1)
  a = ex.size
  members = [[i for i in range(a) if ex[i] == e] for e in range(num_experts)]
  if capacity is None:
    sizes = [-(-len(m) // align) * align for m in members]
    rows = (a + min(a, num_experts) * (align - 1)) // align * align
  else:
    sizes, rows = [capacity] * num_experts, num_experts * capacity
  assignment, row_of = np.full(rows, a), np.full(a, rows)
  start = 0
  for e in range(num_experts):
    for p, i in enumerate(members[e][:sizes[e]]):
      assignment[start + p], row_of[i] = i, start + p
    start += sizes[e]
  return assignment, row_of.reshape(np.shape(experts)), np.asarray(sizes), rows


def np_lb_loss(scores, experts, per_sequence, dtype):
  """load_balancing_loss's formula in ``dtype`` (float32 or float64), by NumPy."""
  s = np.asarray(scores, dtype)
  s = s / np.sum(s, axis=-1, keepdims=True)
  e, k = s.shape[-1], experts.shape[-1]
  if per_sequence:
    s, ex = s.reshape(-1, *s.shape[-2:]), experts.reshape(-1, *experts.shape[-2:])
  else:
    s, ex = s.reshape(1, -1, e), experts.reshape(1, -1, k)
  t = s.shape[1]
  f = np.stack([np.bincount(row.reshape(-1), minlength=e) for row in ex]).astype(dtype) / dtype(t * k)
  return np.mean(dtype(e) * np.sum(f * np.mean(s, axis=1), axis=-1))


# ---- routing -----------------------------------------------------------------------------------------------------


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("score,k,shape", [("softmax", 1, (7, 5)), ("softmax", 2, (2, 6, 8)),
                                           ("sigmoid", 2, (9, 16)), ("softmax", 8, (5, 8)),
                                           ("softmax", 3, (1, 3)), ("sigmoid", 4, (3, 4, 32))])
def test_topk_choice_and_weights(score, k, shape):
  logits = rng_logits(k, shape, dtype=ml_dtypes.bfloat16)
  for normalize in (False, True):
    r = route_j(logits, k, score=score, normalize_topk=normalize, scaling_factor=2.5)
    assert_within_rule(r.scores, np_scores(logits, score, np.float32), np_scores(logits, score, np.float64), score)
    experts, w = np_route(r.scores, k, normalize=normalize, scaling=2.5)
    assert r.experts.dtype == jnp.int32 and r.experts.shape == (*shape[:-1], k)
    np.testing.assert_array_equal(np.asarray(r.experts), experts)
    np.testing.assert_array_equal(np.asarray(r.weights), w)
    assert r.weights.dtype == jnp.float32


def test_ties_go_to_the_lower_index():
  logits = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 5.0]], np.float32)
  assert route(logits, 3).experts.tolist() == [[0, 1, 2], [1, 2, 0], [0, 2, 3]]  # eager
  assert route(logits, 1, score="sigmoid").experts.tolist() == [[0], [1], [0]]


def test_default_normalization_follows_the_score():
  logits = rng_logits(1, (6, 8))
  soft, sig = route_j(logits, 2), route_j(logits, 2, score="sigmoid")
  np.testing.assert_array_equal(np.asarray(soft.weights), np_route(soft.scores, 2)[1])
  np.testing.assert_array_equal(np.asarray(sig.weights), np_route(sig.scores, 2, normalize=True)[1])
  # Mixtral's gate, a softmax over the chosen logits: normalized softmax scores (one rounding per operation apart).
  mixtral = jax.nn.softmax(jnp.take_along_axis(jnp.asarray(logits), soft.experts, axis=-1), axis=-1)
  np.testing.assert_allclose(np.asarray(route_j(logits, 2, normalize_topk=True).weights), np.asarray(mixtral),
                             rtol=16 * F32_U)


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("score,e,g,m,k,gk", [("sigmoid", 16, 4, 2, 4, None), ("softmax", 12, 3, 1, 2, 1),
                                              ("sigmoid", 32, 8, 4, 8, 3), ("softmax", 8, 8, 3, 3, None)])
def test_group_limited_choice(score, e, g, m, k, gk):
  logits = rng_logits(e + k, (2, 5, e))
  bias = rng_logits(7, (e,), spread=0.1)
  r = route_j(logits, k, score=score, num_groups=g, topk_groups=m, group_topk=gk, expert_bias=bias)
  group_topk = RouterConfig(num_experts=e, k=k, num_groups=g, topk_groups=m, group_topk=gk).group_topk
  experts, w = np_route(r.scores, k, bias, g, m, group_topk, normalize=score == "sigmoid")
  np.testing.assert_array_equal(np.asarray(r.experts), experts)
  np.testing.assert_array_equal(np.asarray(r.weights), w)
  groups = np.asarray(r.experts) // (e // g)
  assert max(len(set(row)) for row in groups.reshape(-1, k)) <= m


def test_group_score_rule_decides():
  """Group 0 holds the single best expert, group 1 the best pair: V2's rule (a group's highest score) keeps group 0,
  V3's (the sum of its k / M highest) group 1; plain top-k takes from both."""
  logits = np.array([[4.0, -4.0, -4.0, -4.0, 2.0, 2.0, -4.0, -4.0]], np.float32)
  common = dict(score="sigmoid", num_groups=4, topk_groups=1)
  assert route_j(logits, 2, group_topk=1, **common).experts.tolist() == [[0, 1]]
  assert route_j(logits, 2, **common).experts.tolist() == [[4, 5]]
  assert route_j(logits, 2, score="sigmoid").experts.tolist() == [[0, 4]]


def test_bias_chooses_but_does_not_weigh():
  logits = rng_logits(3, (10, 8))
  bias = np.zeros(8, np.float32)
  bias[5] = 10.0
  plain = route_j(logits, 2, score="sigmoid")
  biased = route_j(logits, 2, score="sigmoid", expert_bias=bias)
  assert np.all(np.asarray(biased.experts)[:, 0] == 5)
  np.testing.assert_array_equal(np.asarray(biased.scores), np.asarray(plain.scores))
  _, w = np_route(plain.scores, 2, bias, normalize=True)
  np.testing.assert_array_equal(np.asarray(biased.weights), w)
  d_bias = jax.grad(lambda b: jnp.sum(route_j(logits, 2, score="sigmoid", expert_bias=b).weights ** 2))(bias)
  np.testing.assert_array_equal(np.asarray(d_bias), np.zeros(8, np.float32))


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("score,normalize", [("sigmoid", True), ("softmax", False)])
def test_weight_gradients_match_a_dense_one_hot_gate(score, normalize):
  """The gradient through the combine weights equals jax.grad of the gate written densely: the one-hot mask of the
  chosen experts (fixed) times every score."""
  logits = jnp.asarray(rng_logits(5, (6, 8)))
  c = jnp.asarray(rng_logits(6, (6, 2)))
  experts = route_j(logits, 2, score=score).experts  # both run op by op (eagerly): the same ops give the same bits

  def ours(u):
    return jnp.sum(c * route(u, 2, score=score, normalize_topk=normalize, scaling_factor=1.5).weights)

  def dense(u):
    s = jax.nn.softmax(u, axis=-1) if score == "softmax" else jax.nn.sigmoid(u)
    w = jnp.sum(jax.nn.one_hot(experts, 8) * s[:, None, :], axis=-1)
    if normalize:
      w = w * (1 / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), TINY))
    return jnp.sum(c * (w * 1.5))

  np.testing.assert_array_equal(np.asarray(jax.grad(ours)(logits)), np.asarray(jax.grad(dense)(logits)))


# ---- losses ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_sequence", [False, True])
def test_load_balancing_loss_formula(per_sequence):
  logits = rng_logits(8, (3, 10, 6))
  for score in ("softmax", "sigmoid"):
    r = route_j(logits, 2, score=score)
    ours = jax.jit(load_balancing_loss, static_argnames="per_sequence")(r.scores, r.experts, per_sequence=per_sequence)
    assert ours.dtype == jnp.float32 and ours.shape == ()
    ex = np.asarray(r.experts)
    assert_within_rule(ours, np_lb_loss(r.scores, ex, per_sequence, np.float32),
                       np_lb_loss(r.scores, ex, per_sequence, np.float64), f"{score} loss")
  balanced = np.full((4, 3), 1 / 3, np.float32)
  assert float(load_balancing_loss(balanced, np.array([[0], [1], [2], [0]]))) == pytest.approx(1.0, abs=4 * F32_U)
  # Everything on one expert that holds all the score: E times the balanced value.
  skewed = np.eye(3, dtype=np.float32)[[0, 0, 0, 0]]
  assert float(load_balancing_loss(skewed, np.zeros((4, 1), np.int32))) == 3.0


def test_per_sequence_loss_differs_from_the_batch_loss():
  """Two sequences, each on its own expert: balanced over the batch (1), each unbalanced on its own (E = 2)."""
  scores = np.stack([np.tile([[1.0, 0.0]], (4, 1)), np.tile([[0.0, 1.0]], (4, 1))]).astype(np.float32)
  experts = np.stack([np.zeros((4, 1), np.int32), np.ones((4, 1), np.int32)])
  loss = jax.jit(load_balancing_loss, static_argnames="per_sequence")
  assert float(loss(scores, experts)) == 1.0
  assert float(loss(scores, experts, per_sequence=True)) == 2.0


def np_lb_grad(scores, experts, dtype):
  """d load_balancing_loss(per_sequence=True) / d scores by its formula: with g_i = E f_i / (T B) and S = sum_j s_j,
  dL/ds_m = (g_m - sum_i g_i s_i / S) / S."""
  s = np.asarray(scores, dtype)
  b, t, e = s.shape
  k = experts.shape[-1]
  f = np.stack([np.bincount(row.reshape(-1), minlength=e) for row in experts]).astype(dtype) / dtype(t * k)
  g = (dtype(e) * f / dtype(t * b))[:, None, :]  # (B, 1, E)
  total = np.sum(s, axis=-1, keepdims=True)
  return (g - np.sum(g * s, axis=-1, keepdims=True) / total) / total


def test_loss_gradients():
  """The gradients of both losses against their formulas: the load-balancing loss with respect to its scores (f is
  a count: no gradient), the z-loss with respect to the logits (2 lse softmax(u) / T)."""
  logits = rng_logits(9, (2, 6, 4))
  for score in ("softmax", "sigmoid"):
    r = route_j(logits, 2, score=score)
    ex = np.asarray(r.experts)
    ours = jax.jit(jax.grad(lambda s, ex=ex: load_balancing_loss(s, ex, per_sequence=True)))(r.scores)
    assert_within_rule(ours, np_lb_grad(r.scores, ex, np.float32), np_lb_grad(r.scores, ex, np.float64), score)

  def z_grad(u, dtype):
    u = np.asarray(u, dtype)
    m = np.max(u, axis=-1, keepdims=True)
    e = np.exp(u - m)
    total = np.sum(e, axis=-1, keepdims=True)
    return dtype(2) * (np.log(total) + m) * (e / total) / dtype(12)

  ours = jax.jit(jax.grad(z_loss))(logits)
  assert_within_rule(ours, z_grad(logits, np.float32), z_grad(logits, np.float64), "z_loss gradient")


def test_z_loss_formula():
  logits = rng_logits(10, (5, 7, 9), spread=6.0, dtype=ml_dtypes.bfloat16)
  u = np.asarray(logits, np.float64)

  def formula(v, dtype):
    m = np.max(v, axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(v - m), axis=-1)) + m[..., 0]
    return np.mean(np.square(lse.astype(dtype)))

  ours = jax.jit(z_loss)(logits)
  assert ours.dtype == jnp.float32
  assert_within_rule(ours, formula(u.astype(np.float32), np.float32), formula(u, np.float64), "z_loss")


def test_tokens_per_expert_and_bias_update():
  experts = np.array([[0, 3], [3, 1], [3, 0], [2, 3]])
  load = tokens_per_expert(experts, 5)
  assert load.dtype == jnp.int32 and load.tolist() == [2, 1, 1, 4, 0]
  bias = np.array([0.5, 0.0, -1.0, 0.25, 0.0], np.float32)
  new = update_expert_bias(bias, load, 0.125)  # mean load 1.6
  np.testing.assert_array_equal(np.asarray(new), bias + np.float32(0.125) * np.array([-1, 1, 1, -1, 1], np.float32))
  assert update_expert_bias(bias, np.full(5, 3), 0.125).tolist() == bias.tolist()  # at the mean: unchanged


# ---- permutation -------------------------------------------------------------------------------------------------


def routed(seed, token_shape, k, e, dtype=np.float32, hidden=6):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((*token_shape, hidden)).astype(dtype)
  experts = np.argsort(rng.random((*token_shape, e)), axis=-1)[..., :k].astype(np.int32)  # k distinct per token
  w = rng.random((*token_shape, k)).astype(np.float32)
  return x, experts, w


@pytest.mark.fast_cases(4)
@pytest.mark.parametrize("token_shape,k,e,capacity_factor,align", [
    ((7,), 1, 4, None, 1), ((3, 5), 2, 4, None, 1), ((13,), 2, 6, None, 4), ((2, 9), 3, 8, None, 16),
    ((12,), 2, 4, 1.0, 1), ((11,), 1, 3, 0.5, 1), ((4, 4), 2, 8, 1.25, 4), ((1,), 1, 1, None, 1),
    ((5,), 4, 4, 2.0, 1), ((6,), 1, 64, None, 8)])
def test_permute_layout(token_shape, k, e, capacity_factor, align):
  x, experts, _ = routed(e * k, token_shape, k, e, dtype=ml_dtypes.bfloat16)
  rows, group_sizes, plan = permute_j(x, experts, e, capacity_factor=capacity_factor, align=align)
  t = math.prod(token_shape)
  capacity = None if capacity_factor is None else expert_capacity(t, k, e, capacity_factor, align)
  assignment, row_of, sizes, n_rows = np_layout(experts, e, capacity, align)
  assert rows.shape == (n_rows, x.shape[-1]) and rows.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(plan.assignment), assignment)
  np.testing.assert_array_equal(np.asarray(plan.row_of), row_of)
  assert group_sizes.dtype == jnp.int32 and group_sizes.tolist() == sizes.tolist()
  assert np.all(sizes % align == 0) and sizes.sum() <= n_rows
  np.testing.assert_array_equal(np.asarray(plan.tokens_per_expert), np.bincount(experts.reshape(-1), minlength=e))
  tokens = np.concatenate([x.reshape(t, -1), np.zeros((1, x.shape[-1]), x.dtype)])
  np.testing.assert_array_equal(np.asarray(rows), tokens[assignment // k])  # padding rows: the zero row
  np.testing.assert_array_equal(np.asarray(plan.dropped), row_of == n_rows)
  if capacity_factor is None:
    assert not np.asarray(plan.dropped).any()


def test_capacity_drops_by_token_order():
  experts = np.array([[2], [0], [2], [2], [1], [2], [0]], np.int32)
  x = np.arange(7, dtype=np.float32)[:, None] + 1
  rows, group_sizes, plan = permute(x, experts, 3, capacity_factor=6 / 7)  # eager; capacity ceil(6/7 * 7 / 3) = 2
  assert group_sizes.tolist() == [2, 2, 2]
  assert rows[:, 0].tolist() == [2.0, 7.0, 5.0, 0.0, 1.0, 3.0]  # expert 2 keeps tokens 0 and 2, drops 3 and 5
  assert np.asarray(plan.dropped)[:, 0].tolist() == [False, False, False, True, False, True, False]
  out = unpermute(rows * 10, plan, np.ones((7, 1), np.float32))
  assert out[:, 0].tolist() == [10.0, 20.0, 30.0, 0.0, 50.0, 0.0, 70.0]


def weighted_sum_bound(out, y_rows, w, out_dtype):
  """|out - exact| within the a-priori bound of a k-term float32 dot product and the rounding to ``out_dtype``."""
  y64, w64 = np.asarray(y_rows, np.float64), np.asarray(w, np.float64)
  exact = np.einsum("...k,...kh->...h", w64, y64)
  k = w64.shape[-1]
  gamma = k * F32_U / (1 - k * F32_U)
  u_out = 2.0**-8 if out_dtype == ml_dtypes.bfloat16 else F32_U
  bound = u_out * np.abs(exact) + (1 + u_out) * (gamma * np.einsum("...k,...kh->...h", np.abs(w64), np.abs(y64))
                                                 + k * 2.0**-126)
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound), np.max(np.abs(out - exact) - bound)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("capacity_factor,align", [(None, 1), (None, 8), (0.75, 1)])
def test_round_trip(dtype, capacity_factor, align):
  # k = 1 with weight 1: the tokens back, bit for bit (the dropped ones as zeros).
  x, experts, _ = routed(1, (4, 5), 1, 4, dtype=dtype)
  rows, _, plan = permute_j(x, experts, 4, capacity_factor=capacity_factor, align=align)
  back = unpermute_j(rows, plan, np.ones((4, 5, 1), np.float32))
  assert back.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(back), np.where(np.asarray(plan.dropped), 0, x).astype(dtype))
  # k = 2: each token's weighted sum of its two (transformed) rows.
  x, experts, w = routed(2, (4, 5), 2, 4, dtype=dtype)
  rows, _, plan = permute_j(x, experts, 4, capacity_factor=capacity_factor, align=align)
  y = (np.asarray(rows, np.float32) * np.arange(1, rows.shape[0] + 1, dtype=np.float32)[:, None]).astype(dtype)
  out = unpermute_j(y, plan, w)
  y_pad = np.concatenate([y, np.zeros((1, y.shape[1]), dtype)])
  weighted_sum_bound(out, y_pad[np.asarray(plan.row_of)], w, dtype)
  assert out.dtype == dtype and out.shape == x.shape
  np.testing.assert_array_equal(np.asarray(jax.jit(unpermute_ref)(y, plan, w)), np.asarray(out))  # the definition


def dense_moe(x, experts, w, kernels, keep):
  """The MoE layer written densely: every token through every expert, masked by the one-hot of its (kept) choices."""
  e = kernels.shape[0]
  all_out = jnp.einsum("th,ehn->ten", x, kernels, precision=jax.lax.Precision.HIGHEST)
  gate = jnp.sum(jax.nn.one_hot(experts, e) * (w * keep)[..., None], axis=1)  # (T, E)
  return jnp.einsum("te,ten->tn", gate, all_out, precision=jax.lax.Precision.HIGHEST)


def sorted_moe(x, experts, w, kernels, capacity_factor, align):
  """The MoE layer on the permuted rows, each row's expert found from the group sizes, its GEMM row by row."""
  e = kernels.shape[0]
  rows, group_sizes, plan = permute(x, experts, e, capacity_factor=capacity_factor, align=align)
  bounds = jnp.cumsum(group_sizes)
  row_expert = jnp.searchsorted(bounds, jnp.arange(rows.shape[0]), side="right")  # past the groups: e (no kernel)
  per_row = jnp.take(kernels, row_expert, axis=0, mode="fill", fill_value=0)
  y = jnp.einsum("rh,rhn->rn", rows, per_row, precision=jax.lax.Precision.HIGHEST)
  return unpermute(y, plan, w), plan


def grouped_moe(x, experts, w, kernels, capacity_factor, align):
  """The same layer on te_jax's grouped GEMM: what permute's rows and group sizes feed directly."""
  rows, group_sizes, plan = permute(x, experts, kernels.shape[0], capacity_factor=capacity_factor, align=align)
  return unpermute(grouped_dense(rows, kernels, group_sizes), plan, w), plan


def np_moe_grads(x, experts, w, kernels, keep, c):
  """The gradients of sum(c * moe(x)), by their formulas (in the inputs' dtype: float64)."""
  wk = w * keep
  t, k = experts.shape
  dx, dw, dk = np.zeros_like(x), np.zeros_like(w), np.zeros_like(kernels)
  for i in range(t):
    for j in range(k):
      kern = kernels[experts[i, j]]
      dx[i] += wk[i, j] * (kern @ c[i])
      dw[i, j] = keep[i, j] * (x[i] @ kern @ c[i])
      dk[experts[i, j]] += wk[i, j] * np.outer(x[i], c[i])
  return dx, dw, dk


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("capacity_factor,align,experts_gemm", [
    (1.0, 2, sorted_moe), (None, 1, sorted_moe), (None, 4, sorted_moe), (0.6, 1, sorted_moe),
    (None, 1, grouped_moe), (0.6, 4, grouped_moe)], ids=lambda v: getattr(v, "__name__", None))
def test_gradients_match_the_dense_moe(capacity_factor, align, experts_gemm):
  """A whole MoE layer (permute, one GEMM per expert, unpermute; the GEMM by rows here or te_jax's grouped_dense)
  against the layer written densely: forward and the gradients of x, the combine weights and the kernels."""
  t, k, e, h, n = 10, 2, 4, 5, 3
  x, experts, w = routed(3, (t,), k, e, hidden=h)
  kernels = np.random.default_rng(4).standard_normal((e, h, n)).astype(np.float32)
  c = np.random.default_rng(5).standard_normal((t, n)).astype(np.float32)
  ours_out, plan = jax.jit(experts_gemm, static_argnums=(4, 5))(x, experts, w, kernels, capacity_factor, align)
  keep = (~np.asarray(plan.dropped)).astype(np.float32)
  x64, w64, k64 = x.astype(np.float64), (w * keep).astype(np.float64), kernels.astype(np.float64)
  out64 = np.stack([sum(w64[i, j] * (x64[i] @ k64[experts[i, j]]) for j in range(k)) for i in range(t)])
  assert_within_rule(ours_out, jax.jit(dense_moe)(x, experts, w, kernels, keep), out64, "forward")

  def loss(fn):
    return lambda x_, w_, k_: jnp.sum(c * fn(x_, w_, k_))

  ours = jax.jit(jax.grad(loss(lambda *a: experts_gemm(a[0], experts, a[1], a[2], capacity_factor, align)[0]),
                          argnums=(0, 1, 2)))(x, w, kernels)
  dense = jax.jit(jax.grad(loss(lambda *a: dense_moe(a[0], experts, a[1], a[2], keep)), argnums=(0, 1, 2)))(
      x, w, kernels)
  exact = np_moe_grads(x64, experts, w.astype(np.float64), k64, keep.astype(np.float64), c.astype(np.float64))
  for name, o, d, want in zip(("dx", "dw", "dkernel"), ours, dense, exact):
    assert_within_rule(o, d, want, name)


def test_permute_gradients_are_sums_of_rows():
  """permute's input gradient: the sum of each token's rows' gradients in j order (float32), bit for bit."""
  x, experts, _ = routed(6, (9,), 3, 5)
  _, _, plan = permute_j(x, experts, 5, capacity_factor=0.7)
  g = np.random.default_rng(7).standard_normal((plan.config.rows, x.shape[1])).astype(np.float32)
  dx = jax.jit(jax.grad(lambda x_: jnp.sum(g * permute(x_, experts, 5, capacity_factor=0.7)[0])))(x)
  g_pad = np.concatenate([g, np.zeros((1, g.shape[1]), np.float32)])[np.asarray(plan.row_of)]
  want = g_pad[:, 0]
  for j in range(1, 3):
    want = want + g_pad[:, j]
  np.testing.assert_array_equal(np.asarray(dx), want)
  # unpermute's y gradient: each row's token gradient times its weight; padding and dropped rows get zeros.
  w = np.random.default_rng(8).random((9, 3)).astype(np.float32)
  ct = np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)
  dy = jax.jit(jax.grad(lambda y: jnp.sum(ct * unpermute(y, plan, w))))(g)
  a = np.asarray(plan.assignment)
  w_rows = np.concatenate([w.reshape(-1), [0.0]]).astype(np.float32)[a]
  ct_rows = np.concatenate([ct, np.zeros((1, ct.shape[1]), np.float32)])[a // 3]
  np.testing.assert_array_equal(np.asarray(dy), w_rows[:, None] * ct_rows)


def test_jit_with_traced_routing():
  """One compile serves any routing: every shape is static, and the layout matches the eager one."""
  traces = []

  @jax.jit
  def layer(x, logits):
    traces.append(1)
    r = route(logits, 2, score="sigmoid", num_groups=2, topk_groups=1)
    rows, group_sizes, plan = permute(x, r.experts, 8, align=4)
    return unpermute(rows * 2, plan, r.weights), rows, group_sizes, plan

  x = rng_logits(11, (3, 4, 6))
  for seed in (12, 13):
    logits = rng_logits(seed, (3, 4, 8))
    out, rows, group_sizes, plan = layer(x, logits)
    r = route_j(logits, 2, score="sigmoid", num_groups=2, topk_groups=1)
    want_rows, want_sizes, want_plan = permute_j(x, r.experts, 8, align=4)
    assert rows.shape == (24 + 8 * 3, 6) and out.shape == x.shape
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))
    np.testing.assert_array_equal(np.asarray(group_sizes), np.asarray(want_sizes))
    np.testing.assert_array_equal(np.asarray(plan.row_of), np.asarray(want_plan.row_of))
  assert len(traces) == 1


def test_out_of_range_ids_under_jit_are_dropped():
  experts = np.array([[0, 5], [1, -1], [1, 0]], np.int32)
  with pytest.raises(ValueError, match=r"experts holds ids outside \[0, num_experts=2\) \(e.g. 5\)"):
    permute(np.ones((3, 2), np.float32), experts, 2)  # eager: the ids are checked
  rows, group_sizes, plan = jax.jit(lambda x, e: permute(x, e, 2))(np.ones((3, 2), np.float32), experts)
  assert group_sizes.tolist() == [2, 2] and plan.tokens_per_expert.tolist() == [2, 2]
  assert np.asarray(plan.dropped).tolist() == [[False, True], [False, True], [False, False]]
  assert np.asarray(rows)[:, 0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_vmap_permutes_each_batch_on_its_own():
  x, experts, w = routed(14, (3, 6), 2, 4)

  def layer(x_, e_, w_):
    rows, _, plan = permute(x_, e_, 4)
    return unpermute(rows * 3, plan, w_)

  out = jax.jit(jax.vmap(layer))(x, experts, w)
  for b in range(3):
    rows, _, plan = permute_j(x[b], experts[b], 4)
    np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(unpermute_j(rows * 3, plan, w[b])))


def test_capacity_and_rows():
  assert expert_capacity(100, 1, 2, 1.1) == 55
  assert expert_capacity(8, 2, 4, 100.0) == 16  # at most every choice
  assert expert_capacity(3, 1, 16, 0.1) == 1
  assert expert_capacity(3, 1, 16, 0.1, align=128) == 128
  cfg = PermuteConfig(token_shape=(2, 3), k=2, num_experts=3, capacity=None, align=128)
  assert cfg.rows == (12 + 3 * 127) // 128 * 128
  x = np.ones((2, 3, 4), np.float32)
  rows, group_sizes, plan = permute_j(x, np.zeros((2, 3, 2), np.int32), 3, align=128)
  assert plan.config == cfg and rows.shape == (384, 4) and group_sizes.tolist() == [128, 0, 0]
  assert float(rows.sum()) == 48.0  # 12 rows of ones, the rest padding
  np.testing.assert_array_equal(np.asarray(jax.jit(permute_ref)(x, plan)), np.asarray(rows))


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("mode", ["PER_TENSOR", "BLOCK_1X128", "MXFP8_1X32", "NVFP4_1X16"])
def test_permute_quantized_tokens(mode):
  """An FP8 (or NVFP4) token tensor: its data rows and row scales move together, so the permuted tensor dequantizes
  to the permuted dequantized tokens, bit for bit; padding rows have zero data and scales 1."""
  mode = te_jax.ScalingMode[mode]
  x = jnp.asarray(np.random.default_rng(15).standard_normal((2, 5, 160)), jnp.bfloat16)
  experts = routed(16, (2, 5), 2, 4)[1]
  if mode is te_jax.ScalingMode.PER_TENSOR:
    q = jax.jit(lambda v: quantize(v, jnp.float32(16.0)).out)(x)
  else:
    q = jax.jit(quantize_block_ref, static_argnums=1)(x, mode)
  rq, group_sizes, plan = permute_j(q, experts, 4, capacity_factor=0.75, align=4)
  assert isinstance(rq, te_jax.QuantizedTensor) and rq.mode is mode and rq.data.dtype == q.data.dtype
  assignment = np.asarray(plan.assignment)
  pad = assignment == plan.config.num_assignments
  token = np.minimum(assignment // 2, 9)
  data = np.asarray(q.data.astype(jnp.float32)).reshape(10, 160)[token]
  np.testing.assert_array_equal(np.asarray(rq.data.astype(jnp.float32)), np.where(pad[:, None], 0, data))
  if mode.block is not None:
    scales = np.asarray(q.scale_inv.astype(jnp.float32)).reshape(10, -1)[token]
    np.testing.assert_array_equal(np.asarray(rq.scale_inv.astype(jnp.float32)), np.where(pad[:, None], 1, scales))
  rows = permute_j(q.dequantize(jnp.float32), experts, 4, capacity_factor=0.75, align=4)[0]
  np.testing.assert_array_equal(np.asarray(rq.dequantize(jnp.float32)), np.asarray(rows))
  assert group_sizes.tolist() == [expert_capacity(10, 2, 4, 0.75, align=4)] * 4 == [4] * 4


def test_permute_quantized_rejects_what_rows_cannot_carry():
  data = np.zeros((4, 128), ml_dtypes.float8_e4m3fn)
  experts = np.zeros((4, 1), np.int32)
  blocks = te_jax.QuantizedTensor(data, np.ones((1, 1), np.float32), mode=te_jax.ScalingMode.BLOCK_128X128)
  with pytest.raises(ValueError, match=r"BLOCK_128X128, whose blocks span rows"):
    permute(blocks, experts, 2)
  with_t = te_jax.QuantizedTensor(data, np.ones((4, 1), np.float32), data.T, np.ones((128, 1), np.float32),
                                  mode=te_jax.ScalingMode.BLOCK_1X128)
  with pytest.raises(ValueError, match=r"without its transposed copy"):
    permute(with_t, experts, 2)


# ---- bad arguments -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: route(np.zeros((2, 4)), 5), ValueError, r"k=5 must be an int between 1 and .*logits.shape\[-1\]=4"),
    (lambda: route(np.zeros((2, 4)), 0), ValueError, r"k=0"),
    (lambda: route(np.zeros((2, 4), np.int32), 1), TypeError, r"logits must be a floating-point array, got int32"),
    (lambda: route(np.zeros((2, 4)), 1, score="relu"), ValueError, r"score='relu' must be one of"),
    (lambda: route(np.zeros((2, 6)), 1, num_groups=4, topk_groups=1), ValueError, r"num_groups=4 must be a positive "
     r"int dividing the number of experts \(logits.shape\[-1\]=6\)"),
    (lambda: route(np.zeros((2, 6)), 1, num_groups=3), ValueError, r"num_groups=3 and topk_groups=None come together"),
    (lambda: route(np.zeros((2, 6)), 1, num_groups=3, topk_groups=4), ValueError, r"topk_groups=4 must be an int "
     r"between 1 and num_groups=3"),
    (lambda: route(np.zeros((2, 8)), 5, num_groups=4, topk_groups=2), ValueError, r"k=5 experts cannot be chosen "
     r"from topk_groups=2 groups of 2 experts; raise topk_groups to at least 3"),
    (lambda: route(np.zeros((2, 8)), 2, num_groups=4, topk_groups=2, group_topk=3), ValueError, r"group_topk=3"),
    (lambda: route(np.zeros((2, 8)), 2, group_topk=1), ValueError, r"group_topk=1 needs num_groups"),
    (lambda: route(np.zeros((2, 8)), 2, expert_bias=np.zeros(7)), ValueError, r"expert_bias must have shape \(8,\)"),
    (lambda: route(np.zeros((2, 8)), 2, expert_bias=np.zeros(8, np.int32)), TypeError, r"expert_bias must be a "
     r"floating-point"),
    (lambda: route(np.zeros((2, 8)), 2, normalize_topk=1), TypeError, r"normalize_topk must be a bool"),
    (lambda: route(np.zeros((2, 8)), 2, scaling_factor=jnp.float32(2)), TypeError, r"scaling_factor must be a "
     r"finite Python float"),
    (lambda: load_balancing_loss(np.zeros((4, 3)), np.zeros((4, 1))), TypeError, r"experts must be an integer"),
    (lambda: load_balancing_loss(np.zeros((4, 3)), np.zeros((5, 1), np.int32)), ValueError, r"must share their "
     r"leading \(token\) dims"),
    (lambda: z_loss(np.zeros((3, 2), np.int32)), TypeError, r"z_loss: logits must be a floating-point"),
    (lambda: update_expert_bias(np.zeros(3), np.zeros(4), 0.1), ValueError, r"both be \(E,\)"),
    (lambda: permute(np.zeros((3, 2), np.int32), np.zeros((3, 1), np.int32), 2), TypeError, r"x must be a floating"),
    (lambda: permute(np.zeros((3, 2)), np.zeros((3, 1)), 2), TypeError, r"experts must be an integer array"),
    (lambda: permute(np.zeros((3, 2)), np.zeros((4, 1), np.int32), 2), ValueError, r"x \(3, 2\) and experts \(4, 1\)"),
    (lambda: permute(np.zeros((3, 2)), np.zeros((3, 1), np.int32), 0), ValueError, r"num_experts must be a positive"),
    (lambda: permute(np.zeros((3, 2)), np.zeros((3, 1), np.int32), 2, align=0), ValueError, r"align must be a "
     r"positive int"),
    (lambda: permute(np.zeros((3, 2)), np.zeros((3, 1), np.int32), 2, capacity_factor=0.0), ValueError,
     r"capacity_factor must be a finite Python float > 0 \(or None: dropless\), got 0.0"),
    (lambda: unpermute(np.zeros((2, 2)), None, np.zeros((3, 1))), TypeError, r"plan must be the PermutePlan"),
])
def test_bad_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_bad_unpermute_shapes():
  rows, _, plan = permute_j(np.zeros((3, 2), np.float32), np.zeros((3, 2), np.int32), 2)
  assert isinstance(plan, PermutePlan)
  with pytest.raises(ValueError, match=r"y must be \(rows, N\) with the 6 rows permute returned, got \(5, 2\)"):
    unpermute(rows[:5], plan, np.ones((3, 2), np.float32))
  with pytest.raises(ValueError, match=r"weights must have shape \(3, 2\)"):
    unpermute(rows, plan, np.ones((3, 1), np.float32))
  with pytest.raises(TypeError, match=r"weights must be a floating-point array"):
    unpermute(rows, plan, np.ones((3, 2), np.int32))
