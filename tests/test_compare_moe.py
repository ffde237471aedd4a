"""te_jax.compare's mixture-of-experts LM (``--preset moe`` / ``moe-tiny``): its attention half is the dense layer's
(bit for bit with the FFN zeroed), the train step adds the MoE blocks' auxiliary losses to the loss and keeps the
blocks' non-trained state, and moe-tiny trains in BF16 and FP8 through ``te_jax.compare.run`` with the FP8 state
moving."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe
from te_jax.compare import lm, run
from te_jax.compare.train import Run, TrainState, split_variables, train_loss_of, train_state_and_step

_SMALL = dict(hidden=32, layers=1, heads=2, mlp=16, experts=4, top_k=2)


def _tokens(batch=2, seq=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, lm.VOCAB, (batch, seq + 1)).astype(np.int32)
  return jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])


def _zero_ffn(params, name, leaf):
  """``params`` with the output kernel of every layer's FFN (``name``'s ``leaf``) set to zeros."""
  out = jax.tree.map(lambda a: a, params)
  for layer in [k for k in out if k.startswith("layer_")]:
    out[layer][name][leaf] = jnp.zeros_like(out[layer][name][leaf])
  return out


@pytest.mark.parametrize("rec", [None, pytest.param(recipe.Float8CurrentScaling(), marks=pytest.mark.slow)],
                         ids=["bf16", "fp8-current"])  # FP8: ~11 s on 2 cores
def test_moe_layer_attention_is_the_dense_layers(rec):
  """With every FFN's output kernel zeroed, the MoE LM and the dense LM (TransformerLayer) of the same attention
  parameters give the same logits, bit for bit: the attention half of MoELayer is TransformerLayer's; and the FFNs
  do contribute once their kernels are not zero."""
  tokens, _ = _tokens()
  dense, moe = lm.LM(hidden=32, layers=2, heads=2, mlp=64), lm.LM(**{**_SMALL, "layers": 2})
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    p_moe = jax.jit(moe.init)(jax.random.key(0), tokens)["params"]
    p_dense = jax.jit(dense.init)(jax.random.key(1), tokens)["params"]
    for layer in ("layer_0", "layer_1"):  # the same attention (and embedding, final norm) in both
      p_dense[layer]["self_attention"] = p_moe[layer]["self_attention"]
    p_dense = {**p_dense, "embed": p_moe["embed"], "final_norm": p_moe["final_norm"]}
    want = jax.jit(dense.apply)({"params": _zero_ffn(p_dense, "mlp", "wo_kernel")}, tokens)
    got, full = (jax.jit(moe.apply)({"params": p}, tokens) for p in (_zero_ffn(p_moe, "moe", "wo_kernel"), p_moe))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.max(jnp.abs(full - got))) > 1e-3


def test_the_train_step_adds_the_aux_losses():
  """The train step's loss is the cross-entropy plus every auxiliary loss the MoE blocks sow (load balancing and
  z-loss per layer), computed here from a separate apply."""
  batch = _tokens()
  model = lm.LM(**_SMALL)
  run_ = Run("BF16", model, None, 4)
  params = jax.jit(model.init)(jax.random.key(0), batch[0])["params"]
  logits, sown = jax.jit(lambda v: model.apply(v, batch[0], mutable=["aux_loss"]))({"params": params})
  aux = sown["aux_loss"]
  assert sorted(aux["layer_0"]["moe"]) == ["load_balancing_loss", "z_loss"]
  aux_sum = float(sum(np.sum(np.asarray(v, np.float64)) for v in jax.tree.leaves(aux)))
  # The load-balancing loss is about its coefficient (1 when balanced, times 1e-2): well above the noise.
  assert aux_sum > 0.008
  ce = float(optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean())
  state, step = train_state_and_step(run_, params, batch, donate=False)
  _, value = step(state, batch)
  assert float(value) == pytest.approx(ce + aux_sum, rel=1e-6, abs=1e-6)
  assert abs(float(value) - ce) > 100 * 1e-6 * ce  # a step that dropped them would fail the line above

@pytest.mark.slow  # ~12 s on 2 cores: four gradient compiles
def test_the_train_loss_gradient_is_the_sums():
  """The train loss's gradient is the cross-entropy's plus the auxiliary losses' (the router kernel's, where the
  auxiliary losses weigh most)."""
  batch = _tokens()
  model = lm.LM(**_SMALL)
  run_ = Run("BF16", model, None, 4)
  params = jax.jit(model.init)(jax.random.key(0), batch[0])["params"]

  def ce_only(v):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, batch[0]), batch[1]).mean()

  def aux_only(v):
    _, s = model.apply(v, batch[0], mutable=["aux_loss"])
    return sum(jnp.sum(x) for x in jax.tree.leaves(s["aux_loss"]))

  # The gradient is the sum's, within the rounding of the BF16 backward (the losses' cotangents meet in BF16).
  router = lambda g: np.asarray(g["params"]["layer_0"]["moe"]["router_kernel"], np.float64)  # noqa: E731
  grads = router(jax.jit(jax.grad(lambda v: train_loss_of(run_)(v, {}, batch)[0]))({"params": params}))
  g_ce, g_aux = (router(jax.jit(jax.grad(f))({"params": params})) for f in (ce_only, aux_only))
  assert np.linalg.norm(grads - g_ce - g_aux) < 0.05 * np.linalg.norm(g_aux)
  assert np.linalg.norm(grads - g_ce) > 0.5 * np.linalg.norm(g_aux)


class _BiasedMoE(nn.Module):
  """A user model with DeepSeek-V3's expert bias (in "batch_stats"), training when "aux_loss" is mutable."""

  @nn.compact
  def __call__(self, x):
    moe = te_flax.MoEBlock(num_experts=4, k=2, intermediate_dim=16, use_expert_bias=True, expert_bias_update_rate=0.1,
                           load_balancing_coef=1e-2, dtype=jnp.bfloat16)
    y = moe(x, deterministic=not self.is_mutable_collection("aux_loss"))
    return te_flax.DenseGeneral(8, dtype=jnp.bfloat16, name="head")(x + y).astype(jnp.float32)


@pytest.mark.slow  # ~4 s on 2 cores: a train step's compile
def test_the_train_step_keeps_the_expert_bias():
  """The expert bias lives in the state's model_state, out of the optimizer's reach: each step replaces it by what
  the block's training call returned (moved by the step's load)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.bfloat16)
  batch = (x, jnp.asarray(rng.integers(0, 8, (4, 8)), jnp.int32))
  model = _BiasedMoE()
  trained, model_state = split_variables(jax.jit(model.init)(jax.random.key(0), x))
  assert sorted(trained) == ["params"] and sorted(model_state) == ["batch_stats"]
  bias0 = np.asarray(model_state["batch_stats"]["MoEBlock_0"]["expert_bias"])
  run_ = Run("BF16", model, None, 3)
  state, step = train_state_and_step(run_, trained["params"], batch, lr=1e-2, donate=False)
  assert isinstance(state, TrainState) and sorted(state.params) == ["params"]
  assert "batch_stats" not in state.params and not any(
      "expert_bias" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state))
  _, (expected, _) = jax.jit(train_loss_of(run_))(state.params, state.model_state, batch)
  state, value = step(state, batch)
  after_one = np.asarray(state.model_state["batch_stats"]["MoEBlock_0"]["expert_bias"])
  state, _ = step(state, batch)
  np.testing.assert_array_equal(after_one, np.asarray(expected["batch_stats"]["MoEBlock_0"]["expert_bias"]))
  assert np.isfinite(float(value)) and not np.array_equal(after_one, bias0)
  assert not np.array_equal(np.asarray(state.model_state["batch_stats"]["MoEBlock_0"]["expert_bias"]), after_one)


def test_presets_and_bad_sizes():
  """moe's experts cost gpt-small's MLP per token (top-2 SwiGLU: k * 3 * H * F multiply-adds against the GELU MLP's
  2 * H * mlp), with its body and batches; moe-tiny is two layers of 4 experts; bad expert counts raise."""
  moe, small = lm.PRESETS["moe"], lm.PRESETS["gpt-small"]
  m = moe.model
  assert (m["experts"], m["top_k"], m["layers"], m["hidden"]) == (8, 2, 12, 768)
  assert m["top_k"] * 3 * m["hidden"] * m["mlp"] == 2 * small.model["hidden"] * small.model["mlp"]
  assert (moe.batch, moe.seq) == (small.batch, small.seq)
  assert (lm.PRESETS["moe-tiny"].model["layers"], lm.PRESETS["moe-tiny"].model["experts"]) == (2, 4)
  tokens = jnp.zeros((1, 8), jnp.int32)
  for bad in (dict(experts=-1), dict(experts=2, top_k=3), dict(experts=2, top_k=0)):
    with pytest.raises(ValueError, match="LM: experts must be 0"):
      lm.LM(**{**_SMALL, **bad}).init(jax.random.key(0), tokens)


@pytest.mark.slow  # ~35-50 s on 2 cores: two runs of 6 steps with their compiles (step, health step, eval)
def test_moe_tiny_trains_in_bf16_and_fp8():
  """moe-tiny through te_jax.compare.run: both runs' losses finite and falling, close to each other; the FP8 run's
  state moves (every expert's amaxes change between the health steps) and its health covers the experts."""
  preset = lm.PRESETS["moe-tiny"]
  train, held_out = lm.load_corpus(1 << 20)
  batches = list(itertools.islice(lm.batches(train, preset.batch, preset.seq, seed=1), 6))
  evals = list(itertools.islice(lm.batches(held_out, preset.batch, preset.seq, seed=2), 1))
  result = run(lambda fp8: lm.LM(**preset.model), batches, steps=6, eval_batches=evals, lr=3e-3, health_every=3,
               quiet=True)
  bf16, fp8 = result["runs"]
  for r in (bf16, fp8):
    curve = r["train_curve"]
    assert len(curve) == 6 and np.all(np.isfinite(curve)) and np.isfinite(r["heldout_loss"])
    assert curve[-1] < curve[0] - 0.5, curve
  assert abs(fp8["heldout_loss"] - bf16["heldout_loss"]) < 0.02 * bf16["heldout_loss"]
  first, later = fp8["health"][0]["amax"], fp8["health"][1]["amax"]
  experts = [k for k in first if "/moe[" in k and k.endswith("wo_kernel")]
  assert len(experts) == 2 * 4, sorted(first)  # per layer, per expert
  assert all(first[k] != later[k] for k in experts)
  assert any("/moe[" in k for k in fp8["health"][0]["shares"])


@pytest.mark.gpu
def test_gpu_moe_preset_step_runs_on_the_grouped_gemm_handler(gpu, monkeypatch):
  """The moe preset's layer (two of them) on the GPU under delayed scaling, with te_jax's grouped GEMM chosen: each
  layer's six expert GEMMs (the two forward, their dgrads and wgrads) are te_grouped_gemm_cuda in the compiled step;
  three steps on one batch train (finite losses, the last below the first) and move the experts' FP8 state."""
  from te_jax.ops import grouped_gemm as gg

  monkeypatch.setenv(gg.GROUPED_GEMM_ENV, "cuda")
  assert gg.native_tile(), "no CUDA grouped GEMM on this GPU"
  preset = lm.PRESETS["moe"]
  model = lm.LM(**{**preset.model, "layers": 2})
  train, _ = lm.load_corpus(1 << 20)
  batches = list(itertools.islice(lm.batches(train, 2, preset.seq, seed=1), 1)) * 3  # step 0's rate is 0 (warmup)
  rec = recipe.DelayedScaling()
  with te_jax.autocast(enabled=True, recipe=rec):
    params = jax.jit(model.init)(jax.random.key(0), batches[0][0])["params"]
    state, step = train_state_and_step(Run("FP8", model, rec, 3), params, batches[0], lr=preset.lr, donate=False)
    hlo = step.lower(state, batches[0]).compile().as_text()
    assert hlo.count('custom_call_target="te_grouped_gemm_cuda"') == 6 * 2
    before = jax.tree.map(np.asarray, state.params[te_jax.FP8_COLLECTION]["layer_0"]["moe"])
    losses = []
    for b in batches:
      state, value = step(state, b)
      losses.append(float(value))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  after = state.params[te_jax.FP8_COLLECTION]["layer_0"]["moe"]
  assert any(not np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
