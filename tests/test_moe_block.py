"""MoEBlock (te_jax/modules/moe.py, te_jax/flax/moe.py, te_jax/nnx/moe.py):

- without FP8, forward and gradients against a dense MoE written in jnp (every token through every expert, masked by
  the one-hot of its kept choices), in float32 and float64, by the tolerance rule; with capacity dropping, shared
  experts, a pre-norm, group-limited sigmoid routing and the expert bias;
- under DelayedScaling, Float8CurrentScaling and Float8BlockScaling, the forward against a per-expert loop of GEMMs
  of the reference-quantized operands (each expert's rows and kernels cast as the recipe casts them);
- linen and NNX bit for bit from the same variables (outputs, gradients, FP8 state, losses, expert bias);
- training steps with optax (the FP8 state and the expert bias moving, the loss falling), nn.scan and nnx.scan over
  two layers, nn.remat and nnx.remat, checkpoints, the auxiliary losses against moe_router's functions, the errors.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from conftest import F32_U, assert_within_rule, random_normal
from te_jax._core import scaling
from te_jax._core.quantized_tensor import ScalingMode
from te_jax.fused.moe_router import load_balancing_loss, route, tokens_per_expert, update_expert_bias, z_loss
from te_jax.ops.quantize import amax, quantize
from te_jax.ops.quantize_block import quantize_block_ref
from te_jax.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

FP8 = te_jax.FP8_COLLECTION
F32, BF16 = jnp.float32, jnp.bfloat16
H, E, F, FS = 32, 4, 32, 48
X_SHAPE = (2, 8, H)
RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling()}

# Option sets: Mixtral's (softmax over the chosen, RMSNorm), DeepSeek-V3's (sigmoid, groups, bias, scaling, shared
# experts; here with biases and a LayerNorm), and a capacity small enough to drop choices.
CONFIGS = {
    "capacity": dict(num_experts=E, k=2, intermediate_dim=F, capacity_factor=0.5, activation_type=("gelu",)),
    "mixtral": dict(num_experts=E, k=2, intermediate_dim=F, normalize_topk=True, norm_type="rmsnorm"),
    "deepseek": dict(num_experts=E, k=2, intermediate_dim=F, score="sigmoid", num_groups=2, topk_groups=1,
                     scaling_factor=2.5, use_expert_bias=True, shared_intermediate_dim=FS, norm_type="layernorm",
                     use_bias=True),
}


def randomized(tree, seed=1, scale=0.3):
  """``tree`` with every leaf moved by noise: no zero bias or unit scale a wrong mapping could keep right."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([leaf + scale * random_normal(seed + i, leaf.shape).astype(leaf.dtype)
                            for i, leaf in enumerate(leaves)])


def setup(config, seed=0, dtype=F32):
  """A linen block of ``config``, its variables (parameters randomized, an expert bias that changes the choice) and
  an input."""
  model = te_flax.MoEBlock(**CONFIGS[config], dtype=dtype)
  x = random_normal(seed, X_SHAPE).astype(dtype)
  variables = model.init(jax.random.key(seed), x)
  variables = {**variables, "params": randomized(variables["params"], seed + 1)}
  if "batch_stats" in variables:
    variables["batch_stats"] = {"expert_bias": jnp.asarray([0.3, -0.2, 0.1, 0.0], F32)}
  return model, variables, x


# ---- the dense reference -----------------------------------------------------------------------------------------


def _act(h, activation_type):
  act = {"silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=True)}[activation_type[0]]
  return act(h[..., 0, :]) * h[..., 1, :] if len(activation_type) == 2 else act(h[..., 0, :])


def dense_moe(params, bias, x, cfg):
  """The block written densely in jnp, in x's dtype: every token through every expert; the gate one-hot of each
  token's kept choices times their weights."""
  dt, hp = x.dtype, jax.lax.Precision.HIGHEST
  p = jax.tree.map(lambda v: v.astype(dt), params)
  e, k = cfg["num_experts"], cfg["k"]
  act_type = cfg.get("activation_type", ("silu", "linear"))
  t = x.reshape(-1, x.shape[-1])
  if cfg.get("norm_type"):
    mean = jnp.mean(t, -1, keepdims=True) if cfg["norm_type"] == "layernorm" else 0.0
    var = jnp.mean((t - mean) ** 2, -1, keepdims=True)
    t = (t - mean) * jax.lax.rsqrt(var + 1e-6) * p["ln_scale"] + p.get("ln_bias", 0.0)
  logits = jnp.dot(t, p["router_kernel"], precision=hp)
  scores = jax.nn.softmax(logits) if cfg.get("score", "softmax") == "softmax" else jax.nn.sigmoid(logits)
  sel = jax.lax.stop_gradient(scores + (0.0 if bias is None else bias.astype(dt)))
  if cfg.get("num_groups"):
    g, m = cfg["num_groups"], cfg["topk_groups"]
    grouped = sel.reshape(-1, g, e // g)
    group_score = jnp.sum(jax.lax.top_k(grouped, max(k // m, 1))[0], -1)
    keep_group = jnp.any(jax.lax.top_k(group_score, m)[1][..., None] == jnp.arange(g), -2)
    sel = jnp.where(keep_group[..., None], grouped, -jnp.inf).reshape(sel.shape)
  experts = jax.lax.top_k(sel, k)[1]
  w = jnp.take_along_axis(scores, experts, -1)
  if cfg.get("normalize_topk", cfg.get("score") == "sigmoid"):
    w = w / jnp.sum(w, -1, keepdims=True)
  w = w * cfg.get("scaling_factor", 1.0)
  onehot = jax.nn.one_hot(experts, e, dtype=dt)  # (T, k, E)
  if cfg.get("capacity_factor"):  # each expert keeps its first choices by token order
    cap = te_jax.expert_capacity(t.shape[0], k, e, cfg["capacity_factor"])
    rank = jnp.cumsum(onehot.reshape(-1, e), 0).reshape(onehot.shape) - 1
    onehot = onehot * (jnp.sum(rank * onehot, -1, keepdims=True) < cap)
  gate = jnp.einsum("tk,tke->te", w, onehot, precision=hp)
  n_act = len(act_type)
  wi = p["wi_kernel"]
  h = jnp.einsum("th,ehnf->tenf", t, wi, precision=hp) + p.get("wi_bias", jnp.zeros((e, n_act, wi.shape[-1]), dt))
  out = jnp.einsum("tef,efh->teh", _act(h, act_type), p["wo_kernel"], precision=hp) + p.get("wo_bias", 0.0)
  y = jnp.einsum("te,teh->th", gate, out, precision=hp)
  if cfg.get("shared_intermediate_dim"):
    hs = jnp.einsum("th,hnf->tnf", t, p["shared_wi_kernel"], precision=hp) + p.get("shared_wi_bias", 0.0)
    y = y + jnp.dot(_act(hs, act_type), p["shared_wo_kernel"], precision=hp) + p.get("shared_wo_bias", 0.0)
  return y.reshape(x.shape)


def _dense_grads(params, bias, x, c, cfg):
  return jax.grad(lambda p, x: jnp.sum(c * dense_moe(p, bias, x, cfg)), argnums=(0, 1))(params, x)


# The quick run keeps the capacity case; the slow step every case, the FP8 and linen/NNX grids, the transforms and
# the checkpoints (each compiles the block's forward and backward: 10-30 s on a 2-core CPU).
@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_the_dense_moe(config):
  model, variables, x = setup(config)
  cfg = CONFIGS[config]
  c = random_normal(7, X_SHAPE)
  bias = variables.get("batch_stats", {}).get("expert_bias")

  @jax.jit
  def ours(variables, x):
    y, vjp = jax.vjp(lambda p, x: model.apply({**variables, "params": p}, x, deterministic=True),
                     variables["params"], x)
    return y, vjp(c)

  y, (dp, dx) = ours(variables, x)
  y32 = jax.jit(dense_moe, static_argnums=3)(variables["params"], bias, x, _hashable(cfg))
  dp32, dx32 = jax.jit(_dense_grads, static_argnums=4)(variables["params"], bias, x, c, _hashable(cfg))
  with jax.enable_x64(True):
    f64 = lambda t: jax.tree.map(lambda v: jnp.asarray(np.asarray(v, np.float64)), t)  # noqa: E731
    b64 = None if bias is None else f64(bias)
    y64 = dense_moe(f64(variables["params"]), b64, f64(x), cfg)
    dp64, dx64 = _dense_grads(f64(variables["params"]), b64, f64(x), f64(c), cfg)
    y64, dp64, dx64 = jax.tree.map(np.asarray, (y64, dp64, dx64))
  assert float(np.max(np.abs(y64))) > 0.1
  assert_within_rule(y, y32, y64, "output")
  assert_within_rule(dx, dx32, dx64, "input gradient")
  for name in dp:
    assert_within_rule(dp[name], dp32[name], dp64[name], f"gradient of {name}")
  if config == "capacity":  # something was dropped: the capacity rows are fewer than the choices
    assert te_jax.expert_capacity(16, 2, E, 0.5) * E < 16 * 2


class _hashable(dict):
  def __hash__(self):
    return hash(tuple(sorted((k, str(v)) for k, v in self.items())))


# ---- FP8 ---------------------------------------------------------------------------------------------------------


def _routing(params, bias, x, cfg):
  t = x.reshape(-1, x.shape[-1])
  logits = jax.lax.dot_general(t, params["router_kernel"], (((1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)
  return route(logits, cfg["k"], normalize_topk=cfg.get("normalize_topk")), t


def _fake_quant(name, role, v, state_scale=None):
  """``v`` (rows, cols) as the recipe's quantizer casts a tensor of ``role`` of one expert, dequantized."""
  dtype = jnp.float8_e4m3fn
  if name in ("delayed", "current"):
    scale = state_scale if name == "delayed" else scaling.compute_scale(amax(v), jnp.float32(1.0),
                                                                        scaling.fp8_max(dtype))
    return quantize(v, scale, dtype).out.dequantize(F32)
  mode = ScalingMode.BLOCK_128X128 if role == "kernel" else ScalingMode.BLOCK_1X128
  return quantize_block_ref(v, mode, dtype, power_of_two_scales=True).dequantize(BF16).astype(F32)


def fp8_loop(name, params, x, cfg):
  """The routed experts as a loop over experts of float64 / float32 GEMMs of the quantized operands (the second
  GEMM's input quantized from the float32 first GEMM), the outputs combined with the weights."""
  r, t = _routing(params, None, x, cfg)
  experts, w = np.asarray(r.experts), np.asarray(r.weights, np.float64)
  out = {"64": np.zeros(t.shape), "32": np.zeros(t.shape, np.float32)}
  one = jnp.float32(1.0)  # a fresh delayed-scaling state's scales
  for e in range(cfg["num_experts"]):
    tok, j = np.nonzero(experts == e)
    if tok.size == 0:
      continue
    xq = _fake_quant(name, "x", t[tok], one)
    wi = _fake_quant(name, "kernel", params["wi_kernel"][e].reshape(H, -1), one)
    wo = _fake_quant(name, "kernel", params["wo_kernel"][e], one)
    h = jnp.dot(xq, wi, precision=jax.lax.Precision.HIGHEST)
    aq = _fake_quant(name, "x", _act(h.reshape(-1, 2, F), ("silu", "linear")), one)
    out["64"][tok] += w[tok, j, None] * (np.asarray(aq, np.float64) @ np.asarray(wo, np.float64))
    out["32"][tok] += (np.asarray(w[tok, j, None], np.float32) *
                       np.asarray(jnp.dot(aq, wo, precision=jax.lax.Precision.HIGHEST)))
  return out["32"], out["64"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_forward_is_the_expert_loop_of_quantized_operands(name):
  cfg = dict(num_experts=E, k=2, intermediate_dim=F, normalize_topk=True)
  model = te_flax.MoEBlock(**cfg, dtype=F32)
  x = random_normal(0, X_SHAPE)
  with te_jax.autocast(enabled=True, recipe=RECIPES[name]):
    variables = model.init(jax.random.key(0), x)
    variables = {**variables, "params": randomized(variables["params"])}
    y = jax.jit(model.apply)(variables, x)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
  y32, y64 = fp8_loop(name, variables["params"], x, cfg)
  assert_within_rule(np.asarray(y).reshape(y64.shape), y32, y64, f"{name} output")
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads["params"]))
  if name == "delayed":  # every expert that got tokens recorded its amaxes
    load = tokens_per_expert(_routing(variables["params"], None, x, cfg)[0].experts, E)
    newest = grads[FP8]["wi_x_amax_history"][:, 0]
    np.testing.assert_array_equal(np.asarray(newest > 0), np.asarray(load > 0))
  else:
    assert FP8 not in variables


# ---- linen and NNX -------------------------------------------------------------------------------------------------


def _nnx_twin(config, variables, recipe):
  with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
    model = te_nnx.MoEBlock(H, **CONFIGS[config], dtype=F32, rngs=nnx.Rngs(3))
  te_nnx.from_linen(model, variables)  # the parameters, the FP8 state and the expert bias (batch_stats)
  return model


def _bits(a, b, what):
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert np.asarray(u).tobytes() == np.asarray(v).tobytes(), (what, jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["off", "delayed", "current", "block"])
@pytest.mark.parametrize("config", ["deepseek", "mixtral"])
def test_linen_and_nnx_are_the_same(config, recipe_name):
  recipe = RECIPES.get(recipe_name)
  cfg = {**CONFIGS[config], "load_balancing_coef": 0.01, "z_loss_coef": 0.001}
  linen = te_flax.MoEBlock(**cfg, dtype=F32)
  x = random_normal(0, X_SHAPE)
  with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
    variables = linen.init(jax.random.key(0), x)
    variables = {**variables, "params": randomized(variables["params"])}
    model = te_nnx.MoEBlock(H, **cfg, dtype=F32, rngs=nnx.Rngs(3))
    te_nnx.from_linen(model, variables)
    trained = {k: v for k, v in variables.items() if k != "batch_stats"}

    def linen_loss(trained, stats):
      y, new = linen.apply({**trained, **stats}, x, deterministic=False, mutable=["aux_loss", "batch_stats"])
      aux = sum(jnp.sum(v) for v in jax.tree.leaves(new["aux_loss"]))
      return jnp.sum(y ** 2) + aux, (y, new)

    stats = {"batch_stats": variables["batch_stats"]} if "batch_stats" in variables else {}
    grads, (y_linen, new) = jax.jit(jax.grad(linen_loss, has_aux=True))(trained, stats)

    def nnx_loss(m):
      y = m(x, deterministic=False)
      return jnp.sum(y ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(m, te_nnx.AuxLoss))), y

    (_, y_nnx), grads_nnx = nnx.jit(lambda m: te_nnx.value_and_grad(nnx_loss, has_aux=True)(m))(model)
  _bits(y_linen, y_nnx, "output")
  _bits(grads["params"], nnx.to_pure_dict(grads_nnx), "parameter gradients")
  if FP8 in variables:
    _bits(grads[FP8], nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8State)), "FP8 state")
  losses = {name: v[0] for name, v in new["aux_loss"].items()}
  _bits(losses, nnx.to_pure_dict(nnx.state(model, te_nnx.AuxLoss)), "auxiliary losses")
  if "batch_stats" in variables:
    _bits(new["batch_stats"]["expert_bias"], model.expert_bias[...], "expert bias")


def _step(model, variables, x):
  """A jitted training call's output, its gradients (parameters and FP8 state), losses and new expert bias."""
  trained = {k: v for k, v in variables.items() if k != "batch_stats"}
  stats = {k: v for k, v in variables.items() if k == "batch_stats"}

  def loss(trained, stats):
    y, new = model.apply({**trained, **stats}, x, deterministic=False, mutable=["aux_loss", "batch_stats"])
    return jnp.sum(y.astype(F32) ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(new["aux_loss"])), (y, new)

  grads, (y, new) = jax.jit(jax.grad(loss, has_aux=True))(trained, stats)
  return y, grads, new


@pytest.mark.slow  # ~16 s a case; the quick run checks the layouts' bits at the op (test_grouped_dense's pre-aligned)
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block"])
@pytest.mark.parametrize("config", ["deepseek", "mixtral"])
def test_rows_laid_out_once_are_the_padded_layouts_bits(config, recipe_name, monkeypatch):
  """The block permutes into the grouped GEMMs' aligned layout once (permute's align, groups_aligned=True): the same
  output, gradients, FP8 state, losses and expert bias, bit for bit, as with the rows permuted unaligned and padded
  by each grouped GEMM (group_align made 1 for the block, the layout before)."""
  import te_jax.modules.moe as moe_body
  from te_jax.fused.grouped_dense import group_align

  model, variables, x = setup(config)
  model = model.clone(load_balancing_coef=0.01, z_loss_coef=0.001)
  assert group_align(RECIPES[recipe_name], (E, H, 2 * F)) > 1
  with te_jax.autocast(enabled=True, recipe=RECIPES[recipe_name]):
    variables = {**model.init(jax.random.key(0), x), **{k: v for k, v in variables.items() if k != FP8}}
    aligned = _step(model, variables, x)
    monkeypatch.setattr(moe_body, "group_align", lambda *args: 1)
    padded = _step(model, variables, x)
  _bits(aligned, padded, "step")
  assert float(jnp.abs(aligned[0]).max()) > 0


def test_the_rules_shard_the_experts_over_the_expert_axis():
  """logical_axis_rules(expert=...) maps the expert kernels' and biases' leading dim to that mesh axis and shards the
  batch over it too; the router and the shared experts stay as the other rules say."""
  rules = te_flax.logical_axis_rules(data="data", expert="expert")
  assert dict(rules)["expert"] == "expert" and dict(rules)["batch"] == ("data", "expert")
  assert "expert" in te_flax.LOGICAL_AXES
  model = te_flax.MoEBlock(**CONFIGS["deepseek"], logical_axes=True)
  boxed = model.init(jax.random.key(0), random_normal(0, X_SHAPE))
  specs = jax.tree.map(tuple, nn.get_partition_spec(boxed)["params"], is_leaf=lambda v: isinstance(v, P))
  mesh_specs = {name: tuple(nn.logical_to_mesh_axes(spec, rules)) for name, spec in specs.items()}
  assert mesh_specs["wi_kernel"] == ("expert", None, None, None)
  assert mesh_specs["wo_kernel"] == ("expert", None, None)
  assert mesh_specs["wi_bias"] == ("expert", None, None) and mesh_specs["wo_bias"] == ("expert", None)
  assert mesh_specs["router_kernel"] == (None, None) and mesh_specs["shared_wi_kernel"] == (None, None, None)
  with pytest.raises(ValueError, match=r"each mesh axis may serve one kind of parallelism.*expert='data'"):
    te_flax.logical_axis_rules(data="data", expert="data")


def test_from_linen_and_to_linen_carry_the_expert_bias():
  """batch_stats (the expert bias) goes from linen to NNX and back with the parameters and the FP8 state: the round
  trip gives the same bits, a trained NNX bias comes back, and a missing or misshapen one raises naming it."""
  model, variables, x = setup("deepseek")
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    variables = {**model.init(jax.random.key(0), x), **{k: v for k, v in variables.items() if k != FP8}}
    twin = te_nnx.MoEBlock(H, **CONFIGS["deepseek"], dtype=F32, rngs=nnx.Rngs(3))
    te_nnx.from_linen(twin, variables)
    _bits(te_nnx.to_linen(twin), variables, "round trip")
    assert float(jnp.abs(twin.expert_bias[...]).max()) > 0
    twin(x, deterministic=False)  # a training call moves the NNX bias
    back = te_nnx.to_linen(twin)
    assert not np.array_equal(back["batch_stats"]["expert_bias"], variables["batch_stats"]["expert_bias"])
    _bits(back["batch_stats"]["expert_bias"], twin.expert_bias[...], "the trained bias")
    _bits(model.apply(back, x, deterministic=True), twin(x, deterministic=True), "linen on the NNX variables")
  with pytest.raises(ValueError, match=r"'batch_stats' does not match the model: missing \[\('expert_bias',\)\]"):
    te_nnx.from_linen(twin, {k: v for k, v in variables.items() if k != "batch_stats"})
  with pytest.raises(ValueError, match=r"'batch_stats' has other shapes or dtypes than the model: \['expert_bias"):
    te_nnx.from_linen(twin, {**variables, "batch_stats": {"expert_bias": jnp.zeros((E + 1,), F32)}})
  with pytest.raises(ValueError, match=r"collections \['aux_loss'\] have no NNX twin here"):
    te_nnx.from_linen(twin, {**variables, "aux_loss": {}})


def test_module_sizes_follow_in_features():
  model = te_nnx.MoEBlock(H, num_experts=E, k=2, intermediate_dim=F, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features"):
    model(jnp.ones((4, 24)))


# ---- the auxiliary losses and the expert bias ---------------------------------------------------------------------


@pytest.mark.parametrize("per_sequence", [False, True])
def test_aux_losses_are_moe_routers_times_their_coefficients(per_sequence):
  model = te_flax.MoEBlock(num_experts=E, k=2, intermediate_dim=F, load_balancing_coef=0.01, z_loss_coef=0.001,
                           load_balancing_per_sequence=per_sequence)
  x = random_normal(0, X_SHAPE)
  variables = model.init(jax.random.key(0), x)
  assert set(variables) == {"params"}  # init sows nothing
  _, new = model.apply(variables, x, deterministic=False, mutable=["aux_loss"])
  logits = jax.lax.dot_general(x.reshape(-1, H), variables["params"]["router_kernel"], (((1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)
  r = route(logits, 2)
  lb = load_balancing_loss(r.scores.reshape(2, 8, E), r.experts.reshape(2, 8, 2), per_sequence=per_sequence)
  _bits(new["aux_loss"]["load_balancing_loss"][0], jnp.float32(0.01) * lb, "load balancing loss")
  _bits(new["aux_loss"]["z_loss"][0], jnp.float32(0.001) * z_loss(logits), "z-loss")
  # Evaluation without the collection: nothing to collect, no error.
  assert model.apply(variables, x, deterministic=True).shape == X_SHAPE


def test_expert_bias_moves_in_training_only():
  model, variables, x = setup("deepseek")
  bias = variables["batch_stats"]["expert_bias"]
  y_eval, new_eval = model.apply(variables, x, deterministic=True, mutable=["batch_stats"])
  _bits(new_eval["batch_stats"]["expert_bias"], bias, "bias after evaluation")
  y, new = model.apply(variables, x, deterministic=False, mutable=["batch_stats"])
  _bits(y, y_eval, "output")  # the step's routing uses the bias it started with
  p = variables["params"]
  t = te_jax.layernorm(x.reshape(-1, H), p["ln_scale"], p["ln_bias"], epsilon=1e-6, dtype=F32)
  logits = jax.lax.dot_general(t, p["router_kernel"], (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST)
  r = route(logits, 2, score="sigmoid", num_groups=2, topk_groups=1, expert_bias=bias, scaling_factor=2.5)
  want = update_expert_bias(bias, tokens_per_expert(r.experts, E), 1e-3)
  _bits(new["batch_stats"]["expert_bias"], want, "updated bias")
  assert not np.array_equal(np.asarray(want), np.asarray(bias))


def test_capacity_drops_whole_tokens_to_zeros():
  """k = 1 and a capacity of 2 rows per expert: a token past its expert's capacity comes out as zeros."""
  model = te_flax.MoEBlock(num_experts=E, k=1, intermediate_dim=F, capacity_factor=0.5)
  x = random_normal(0, X_SHAPE)
  variables = model.init(jax.random.key(0), x)
  y = np.asarray(model.apply(variables, x)).reshape(-1, H)
  logits = x.reshape(-1, H) @ variables["params"]["router_kernel"]
  experts = np.asarray(jnp.argmax(logits, -1))
  cap = te_jax.expert_capacity(16, 1, E, 0.5)
  rank = np.array([np.sum(experts[:i] == experts[i]) for i in range(16)])
  dropped = rank >= cap
  assert dropped.any() and (~dropped).any()
  np.testing.assert_array_equal(y[dropped], 0.0)
  assert np.all(np.abs(y[~dropped]).max(-1) > 0)


# ---- training ----------------------------------------------------------------------------------------------------


def _train(model, variables, batches, steps, tx=optax.adam(3e-3)):
  trained = {k: v for k, v in variables.items() if k != "batch_stats"}
  stats = {k: v for k, v in variables.items() if k == "batch_stats"}
  opt = tx.init(trained["params"])

  def loss_fn(trained, stats, x, target):
    y, new = model.apply({**trained, **stats}, x, deterministic=False, mutable=["aux_loss", "batch_stats"])
    aux = sum(jnp.sum(v) for v in jax.tree.leaves(new.get("aux_loss", {})))
    return jnp.mean((y - target) ** 2) + aux, {k: v for k, v in new.items() if k == "batch_stats"}

  @jax.jit
  def step(trained, stats, opt, x, target):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, stats, x, target)
    updates, opt = tx.update(grads["params"], opt, trained["params"])
    trained = {**trained, **grads, "params": optax.apply_updates(trained["params"], updates)}  # FP8: its new state
    return trained, stats, opt, loss

  losses = []
  for i in range(steps):
    trained, stats, opt, loss = step(trained, stats, opt, *batches[i % len(batches)])
    losses.append(float(loss))
  return {**trained, **stats}, losses


@pytest.mark.parametrize("recipe_name", ["delayed", pytest.param("block", marks=pytest.mark.slow)])
def test_training_steps_update_the_state_and_lower_the_loss(recipe_name):
  cfg = dict(num_experts=E, k=2, intermediate_dim=F, load_balancing_coef=0.01, use_expert_bias=True,
             expert_bias_update_rate=0.01)
  model = te_flax.MoEBlock(**cfg, dtype=F32)
  teacher = te_flax.MoEBlock(**{**cfg, "use_expert_bias": False, "load_balancing_coef": 0.0})
  xs = [random_normal(10 + i, X_SHAPE) for i in range(2)]
  teacher_vars = teacher.init(jax.random.key(5), xs[0])
  batches = [(x, teacher.apply(teacher_vars, x)) for x in xs]
  with te_jax.autocast(enabled=True, recipe=RECIPES[recipe_name]):
    variables = model.init(jax.random.key(0), xs[0])
    trained, losses = _train(model, variables, batches, 12)
  assert all(np.isfinite(losses)), losses
  assert losses[-1] < 0.7 * losses[0], losses
  assert not np.array_equal(trained["batch_stats"]["expert_bias"], variables["batch_stats"]["expert_bias"])
  if recipe_name == "delayed":
    for name in ("wi_x_amax_history", "wo_grad_amax_history", "wo_kernel_scale"):
      before, after = variables[FP8][name], trained[FP8][name]
      assert not np.array_equal(before, after), name
      assert np.all(np.isfinite(after)), name


def test_nnx_training_steps_with_the_optimizer():
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    model = te_nnx.MoEBlock(H, num_experts=E, k=2, intermediate_dim=F, z_loss_coef=1e-3, use_expert_bias=True,
                            expert_bias_update_rate=0.01, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    x = random_normal(1, X_SHAPE)
    target = jnp.tanh(x)
    before = te_nnx.to_linen(model)
    bias_before = model.expert_bias[...]

    @nnx.jit
    def step(model, optimizer):
      def loss_fn(m):
        y = m(x)
        return jnp.mean((y - target) ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(m, te_nnx.AuxLoss)))
      loss, grads = te_nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    model.train()  # deterministic=False
    losses = [float(step(model, optimizer)) for _ in range(8)]
  assert losses[-1] < losses[0] and all(np.isfinite(losses)), losses
  after = te_nnx.to_linen(model)
  assert not np.array_equal(after[FP8]["wi_x_amax_history"], before[FP8]["wi_x_amax_history"])
  assert not np.array_equal(model.expert_bias[...], bias_before)
  model.eval()
  bias = model.expert_bias[...]
  model(x)
  _bits(model.expert_bias[...], bias, "bias after an evaluation call")


# ---- transforms and checkpoints ----------------------------------------------------------------------------------

_LAYER = dict(num_experts=E, k=2, intermediate_dim=F, load_balancing_coef=0.01, use_expert_bias=True,
              deterministic=False)
_AXES = {"params": 0, FP8: 0, "batch_stats": 0, "aux_loss": 0}


class _LinenStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    body = nn.scan(lambda m, c, _: (c + m(c), None), variable_axes=_AXES, split_rngs={"params": True}, length=2)
    return body(te_flax.MoEBlock(**_LAYER, name="layers"), x, None)[0]


class _NnxStack(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
      return te_nnx.MoEBlock(H, **_LAYER, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, c):
      return c + layer(c)

    return body(self.layers, x)


@pytest.mark.slow
def test_scan_over_two_layers_in_linen_and_nnx():
  """nn.scan with the block's collections in variable_axes, and nnx.scan over nnx.vmap-stacked blocks: each layer
  its own FP8 state, expert bias and losses, the same in both."""
  x = random_normal(0, X_SHAPE)
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    linen = _LinenStack()
    variables = linen.init(jax.random.key(0), x)
    assert variables["batch_stats"]["layers"]["expert_bias"].shape == (2, E)
    assert variables[FP8]["layers"]["wi_x_amax_history"].shape == (2, E, 4)
    model = _NnxStack(nnx.Rngs(0))
    te_nnx.from_linen(model, variables)
    trained = {k: v for k, v in variables.items() if k != "batch_stats"}

    def linen_loss(trained):
      y, new = linen.apply({**trained, "batch_stats": variables["batch_stats"]}, x,
                           mutable=["aux_loss", "batch_stats"])
      return jnp.sum(y ** 2) + jnp.sum(new["aux_loss"]["layers"]["load_balancing_loss"][0]), (y, new)

    grads, (y, new) = jax.jit(jax.grad(linen_loss, has_aux=True))(trained)

    def nnx_loss(m):
      y = m(x)
      return jnp.sum(y ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(nnx.state(m, te_nnx.AuxLoss))), y

    (_, y_nnx), grads_nnx = nnx.jit(lambda m: te_nnx.value_and_grad(nnx_loss, has_aux=True)(m))(model)
  assert new["aux_loss"]["layers"]["load_balancing_loss"][0].shape == (2,)
  newest = grads[FP8]["layers"]["wi_x_amax_history"][..., 0]
  assert bool(jnp.any(newest[0] > 0)) and bool(jnp.any(newest[1] > 0))
  _bits(y, y_nnx, "output")
  _bits(grads["params"], nnx.to_pure_dict(grads_nnx), "parameter gradients")
  _bits(grads[FP8], nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8State)), "FP8 state")
  _bits(new["batch_stats"]["layers"]["expert_bias"], model.layers.expert_bias[...], "expert biases")


@pytest.mark.slow
def test_remat_gives_the_same_values():
  x = random_normal(0, X_SHAPE)
  cfg = dict(num_experts=E, k=2, intermediate_dim=F, shared_intermediate_dim=FS)
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    plain, remat = te_flax.MoEBlock(**cfg), nn.remat(te_flax.MoEBlock)(**cfg)
    variables = plain.init(jax.random.key(0), x)
    results = [jax.jit(jax.value_and_grad(lambda v, m=m: jnp.sum(m.apply(v, x) ** 2)))(variables)
               for m in (plain, remat)]
    model = te_nnx.MoEBlock(H, **cfg, rngs=nnx.Rngs(0))
    te_nnx.from_linen(model, variables)
    loss, grads = nnx.jit(lambda m: te_nnx.value_and_grad(
        lambda m: jnp.sum(nnx.remat(lambda m, x: m(x))(m, x) ** 2))(m))(model)
  _bits(results[1], results[0], "nn.remat")
  _bits(loss, results[0][0], "nnx.remat loss")
  _bits(nnx.to_pure_dict(grads), results[0][1]["params"], "nnx.remat gradients")


@pytest.mark.slow
def test_checkpoints_round_trip(tmp_path):
  model, variables, x = setup("deepseek")
  with te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    variables = {**model.init(jax.random.key(0), x), "params": variables["params"]}
    trained, _ = _train(model, variables, [(x, jnp.tanh(x))], 2)
    restored = serialization.from_bytes(jax.tree.map(jnp.zeros_like, trained), serialization.to_bytes(trained))
    _bits(restored, trained, "flax.serialization")
    _bits(model.apply(restored, x, deterministic=True), model.apply(trained, x, deterministic=True), "output")

    import orbax.checkpoint as ocp
    nnx_model = _nnx_twin("deepseek", trained, RECIPES["delayed"])
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", nnx.to_pure_dict(nnx.state(nnx_model)))
    fresh = te_nnx.MoEBlock(H, **CONFIGS["deepseek"], dtype=F32, rngs=nnx.Rngs(9))
    state = nnx.state(fresh)
    with ocp.StandardCheckpointer() as checkpointer:
      nnx.replace_by_pure_dict(state, checkpointer.restore(tmp_path / "ckpt", nnx.to_pure_dict(state)))
    nnx.update(fresh, state)
    _bits(nnx.to_pure_dict(nnx.state(fresh)), nnx.to_pure_dict(nnx.state(nnx_model)), "orbax")
    _bits(fresh(x, deterministic=True), model.apply(trained, x, deterministic=True), "restored NNX output")


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error, match", [
    (dict(k=5), ValueError, r"k=5 must be an int between 1 and num_experts=4"),
    (dict(num_experts=0), ValueError, "num_experts must be a positive int"),
    (dict(score="relu"), ValueError, "score='relu'"),
    (dict(num_groups=3, topk_groups=1), ValueError, r"num_groups=3 must be a positive int dividing the number of "
                                                    r"experts \(num_experts=4\)"),
    (dict(num_groups=2), ValueError, "num_groups=2 and topk_groups=None come together"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be a finite Python float > 0"),
    (dict(load_balancing_coef=-1.0), ValueError, "load_balancing_coef must be a finite float >= 0"),
    (dict(norm_type="batchnorm"), ValueError, "norm_type must be one of"),
    (dict(activation_type=("tanh",)), ValueError, "tanh"),
    (dict(shared_intermediate_dim=0), ValueError, "shared_intermediate_dim must be a positive int"),
])
def test_bad_options_name_the_argument(bad, error, match):
  kw = {**dict(num_experts=E, k=2, intermediate_dim=F), **bad}
  x = jnp.ones((4, H))
  with pytest.raises(error, match=match):
    te_flax.MoEBlock(**kw).init(jax.random.key(0), x)
  with pytest.raises(error, match=match):
    te_nnx.MoEBlock(H, **kw, rngs=nnx.Rngs(0))


def test_training_needs_its_collections_and_its_mode():
  x = random_normal(0, X_SHAPE)
  model = te_flax.MoEBlock(num_experts=E, k=2, intermediate_dim=F, load_balancing_coef=0.01, use_expert_bias=True)
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="pass deterministic=False"):
    model.apply(variables, x)
  with pytest.raises(ValueError, match=r"mutable=\['aux_loss'\]"):
    model.apply(variables, x, deterministic=False, mutable=["batch_stats"])
  with pytest.raises(ValueError, match=r"mutable=\['batch_stats'\]"):
    model.apply(variables, x, deterministic=False, mutable=["aux_loss"])
  nnx_model = te_nnx.MoEBlock(H, num_experts=E, k=2, intermediate_dim=F, z_loss_coef=0.01, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pass deterministic=False"):
    nnx_model(x)
  with pytest.raises(ValueError, match="inputs must be float tokens"):
    model.apply(variables, jnp.ones((H,)), deterministic=True)


# ---- sharded -----------------------------------------------------------------------------------------------------


def _sharded_step(mesh, rules, recipe, config="deepseek"):
  """A jitted training call of the block on ``mesh`` under ``rules`` (its variables laid out by the rules, the tokens
  over "batch"): (output, gradients, new variables), the compiled program's collectives."""
  from parallel_model import collectives

  cfg = {**CONFIGS[config], "load_balancing_coef": 0.01, "z_loss_coef": 0.001}
  model = te_flax.MoEBlock(**cfg, logical_axes=True)
  x = random_normal(0, (8, 8, H))
  with te_jax.autocast(enabled=True, recipe=recipe):
    boxed = model.init(jax.random.key(0), x)
    variables = nn.meta.unbox(boxed)
    variables = {**variables, "params": randomized(variables["params"])}
    if "batch_stats" in variables:
      variables["batch_stats"] = {"expert_bias": jnp.asarray([0.3, -0.2, 0.1, 0.0], F32)}
    trained = {k: v for k, v in variables.items() if k != "batch_stats"}
    stats = {k: v for k, v in variables.items() if k == "batch_stats"}

    def loss(trained, stats, x):
      y, new = model.apply({**trained, **stats}, x, deterministic=False, mutable=["aux_loss", "batch_stats"])
      aux = sum(jnp.sum(v) for v in jax.tree.leaves(new["aux_loss"]))
      return jnp.sum(y.astype(F32) ** 2) + aux, (y, new)

    step = jax.jit(jax.grad(loss, has_aux=True))
    if mesh is None:
      return step(trained, stats, x), None
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
      put = lambda tree, name: jax.device_put(tree, {k: v for k, v in shardings.items() if k in tree} or None)
      args = (put(trained, "trained"), put(stats, "stats"),
              jax.device_put(x, NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", None, None), rules))))
      compiled = step.lower(*args).compile()
      return compiled(*args), collectives(compiled.as_text())


@pytest.mark.parametrize("recipe_name", ["delayed"])
def test_explicit_mesh_gives_the_auto_meshs_values(recipe_name):
  """Data parallel over 8 devices: the block's training call on a mesh with Explicit axes (its custom_vjp cotangents
  typed as their primals, te_jax._core.explicit.typed_vjp) gives the Auto mesh's output, gradients, FP8 state,
  losses and expert bias, bit for bit."""
  rules = te_flax.logical_axis_rules(data="data")
  results = {}
  for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,), devices=jax.devices("cpu")[:8])
    results[kind] = _sharded_step(mesh, rules, RECIPES[recipe_name])[0]
  _bits(results[AxisType.Explicit], results[AxisType.Auto], "Explicit against Auto")


# The collectives of the sharded training call (kind, reduction, dtype): data parallel over "data" and the experts'
# kernels over "expert" by the rules, on a 2 x 4 mesh. XLA's partitioner places the permutation's gathers (all-to-alls
# of the rows) and gathers the sort's ids; current scaling's amaxes are max-reduced (as u32 bit patterns).
EXPERT_COLLECTIVES = {
    "delayed": {("all-gather", "", "f32"): 5, ("all-gather", "", "s32"): 1, ("all-reduce", "add", "f32"): 14,
                ("all-reduce", "add", "s32"): 3, ("all-reduce", "maximum", "f32"): 4, ("all-to-all", "", "f32"): 16},
    "current": {("all-gather", "", "f16"): 4, ("all-gather", "", "f32"): 17, ("all-gather", "", "s32"): 3,
                ("all-reduce", "add", "f32"): 19, ("all-reduce", "add", "s32"): 17,
                ("all-reduce", "maximum", "u32"): 4, ("all-to-all", "", "f32"): 16,
                ("collective-permute", "", "s32"): 4},
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_sharded_by_the_rules_is_one_device(recipe_name):
  """On 8 devices, the tokens over ("data", "expert") and the experts' kernels over "expert" (logical_axis_rules):
  the output and the expert bias bit for bit one device's; the gradients, FP8 state and losses (token sums split
  over the shards) within a float32 summation bound of 64 ulps of their largest element; the compiled collectives
  pinned."""
  rules = te_flax.logical_axis_rules(data="data", expert="expert")
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices("cpu")[:8])
  (sharded, found), (one, _) = (_sharded_step(m, rules, RECIPES[recipe_name]) for m in (mesh, None))
  (g_s, (y_s, new_s)), (g_1, (y_1, new_1)) = sharded, one
  _bits(y_s, y_1, "output")
  _bits(new_s["batch_stats"], new_1["batch_stats"], "expert bias")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((g_s, new_s["aux_loss"])),
                          jax.tree.leaves((g_1, new_1["aux_loss"]))):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=64 * F32_U * max(np.abs(b).max(), 1e-30),
                               err_msg=jax.tree_util.keystr(path))
  assert dict(found) == EXPERT_COLLECTIVES[recipe_name], sorted(found.items())
