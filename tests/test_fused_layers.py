"""layernorm_dense, layernorm_mlp and their Flax modules: values and gradients against the unfused composition,
the FP8 state updates, the kernels in the compiled program, and argument errors."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from te_jax.recipe import DelayedScaling, Float8CurrentScaling
from conftest import rel_error
from te_jax.ops.norm import norm_fwd

RECIPES = {"delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}
ACTS = {"gelu": ("gelu",), "swiglu": ("silu", "linear")}


def _inputs(gated: bool, seed: int = 0, rows=(3, 7), hidden=64, inter=128):
  k = jax.random.split(jax.random.key(seed), 7)
  n = 2 if gated else 1
  x = jax.random.normal(k[0], (*rows, hidden), jnp.float32).astype(jnp.bfloat16)
  gamma = 1 + 0.1 * jax.random.normal(k[1], (hidden,))
  beta = 0.1 * jax.random.normal(k[2], (hidden,))
  k1 = jax.random.normal(k[3], (hidden, n, inter)) / np.sqrt(hidden)
  k2 = jax.random.normal(k[4], (inter, hidden)) / np.sqrt(inter)
  b1 = 0.1 * jax.random.normal(k[5], (n, inter))
  b2 = 0.1 * jax.random.normal(k[6], (hidden,))
  return x, gamma, beta, k1, k2, b1, b2


def _mlp_ref(x, gamma, beta, k1, k2, b1, b2, act):
  """The same block in float32 jnp (flax.linen.LayerNorm's math, epsilon 1e-6)."""
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  z = (xf - mean) * jax.lax.rsqrt(((xf - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * gamma + beta
  h = jnp.einsum("...h,hnf->...nf", z, k1) + b1
  a = jax.nn.gelu(h[..., 0, :]) if act == ("gelu",) else jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
  return a @ k2 + b2


def _loss(fn):
  return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("act", list(ACTS.values()), ids=list(ACTS))
def test_mlp_high_precision_matches_reference(act):
  args = _inputs(len(act) == 2)
  x = args[0].astype(jnp.float32)
  ours = te_jax.layernorm_mlp(x, *args[1:], activation_type=act)
  ref = _mlp_ref(x, *args[1:], act)
  assert rel_error(ours, ref) < 1e-5  # float32 throughout; only summation order differs
  g_ours = jax.grad(_loss(lambda *a: te_jax.layernorm_mlp(*a, activation_type=act)), argnums=tuple(range(7)))(x,
                                                                                                           *args[1:])
  g_ref = jax.grad(_loss(lambda *a: _mlp_ref(*a, act)), argnums=tuple(range(7)))(x, *args[1:])
  for a, b in zip(g_ours, g_ref):
    assert rel_error(a, b) < 1e-4


@pytest.mark.parametrize("rec", list(RECIPES), ids=list(RECIPES))
@pytest.mark.parametrize("act", list(ACTS.values()), ids=list(ACTS))
def test_mlp_fp8_close_to_high_precision_and_updates_state(act, rec):
  args = _inputs(len(act) == 2, seed=1)
  r = RECIPES[rec]
  metas = (te_jax.DenseFp8Meta.create(4), te_jax.DenseFp8Meta.create(4))

  def f(x, g, b, k1, k2, b1, b2, m1, m2, recipe):
    return _loss(lambda *a: te_jax.layernorm_mlp(*a, activation_type=act, fp8_meta_1=m1, fp8_meta_2=m2,
                                                 recipe=recipe))(x, g, b, k1, k2, b1, b2)

  grad = jax.jit(jax.value_and_grad(f, argnums=tuple(range(9))), static_argnums=9)
  ref_loss, ref_grads = grad(*args, *metas, None)
  loss, grads = grad(*args, *metas, r)
  if isinstance(r, DelayedScaling):  # the first step ran at scale 1; the second uses the updated state
    new_metas = grads[7:9]
    amaxes = [float(s.amax_history[0]) for m in new_metas for s in m]
    assert all(a > 0 for a in amaxes), amaxes
    x_amax = float(new_metas[0].x.amax_history[0])
    ln = norm_fwd(args[0], args[1], args[2], dtype=jnp.float32)
    np.testing.assert_allclose(x_amax, float(jnp.max(jnp.abs(ln.out))), rtol=1e-6)  # fc1's input: the norm output
    loss, grads = grad(*args, *new_metas, r)
  # FP8 E4M3 forward / E5M2 backward over a 64/128-wide block: a few percent (a wrong scale or layout is >> 10%).
  assert abs(float(loss) - float(ref_loss)) / float(ref_loss) < 0.03
  for a, b in zip(grads[:7], ref_grads[:7]):
    assert rel_error(a, b) < 0.15


def test_mlp_fp8_program_runs_the_fused_kernels_and_saves_fp8():
  args = _inputs(True, seed=2)
  metas = (te_jax.DenseFp8Meta.create(4), te_jax.DenseFp8Meta.create(4))
  # The states are differentiated with the kernels (their updates leave the backward pass as their gradients).
  f = lambda *a: te_jax.layernorm_mlp(*a[:-2], activation_type=("silu", "linear"), recipe=DelayedScaling(  # noqa: E731
      amax_history_len=4), fp8_meta_1=a[-2], fp8_meta_2=a[-1])
  args = (*args, *metas)
  n = len(args)
  hlo = jax.jit(jax.grad(_loss(f), argnums=(0, 3, 4, n - 2, n - 1))).lower(*args).compile().as_text()
  targets = re.findall(r'custom_call_target="(te_\w+)"', hlo)
  for t in ("te_norm_fwd_cpu", "te_act_fwd_cpu", "te_act_bwd_cpu", "te_norm_bwd_cpu", "te_quantize_cpu"):
    assert t in targets, (t, sorted(set(targets)))
  _, vjp = jax.vjp(f, *args)
  kept = {(jnp.dtype(r.dtype).name, r.shape) for r in jax.tree.leaves(vjp) if r.size >= 32 * 64}
  # The FP8 GEMM inputs (transposed, for the weight gradients) and FP8 kernels; in high precision only x (the norm's
  # backward reads it) and fc1's output (the activation's derivative needs it exactly). Rows are padded 21 -> 32.
  assert kept == {("float8_e4m3fn", (64, 32)), ("float8_e4m3fn", (64, 256)), ("float8_e4m3fn", (128, 32)),
                  ("float8_e4m3fn", (128, 64)), ("bfloat16", (32, 64)), ("bfloat16", (32, 2, 128))}, kept


@pytest.mark.parametrize("rec", list(RECIPES), ids=list(RECIPES))
def test_layernorm_dense_fp8_with_layernorm_output(rec):
  x, gamma, beta, k1, *_ = _inputs(False, seed=3)
  kernel = k1[:, 0, :]
  meta = te_jax.DenseFp8Meta.create(4)

  def f(x, g, b, k, meta, recipe):
    y, z = te_jax.layernorm_dense(x, g, b, k, return_layernorm_output=True, fp8_meta=meta, recipe=recipe)
    return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(z.astype(jnp.float32) * 3.0)

  grad = jax.grad(f, argnums=(0, 1, 2, 3, 4))
  ref = grad(x, gamma, beta, kernel, meta, None)[:4]
  ours = grad(x, gamma, beta, kernel, meta, RECIPES[rec])
  if rec == "delayed":  # the first step ran at scale 1; the second uses the state it left
    ours = grad(x, gamma, beta, kernel, ours[4], RECIPES[rec])
  for a, b in zip(ours[:4], ref):
    assert rel_error(a, b) < 0.15


def test_argument_errors():
  x, gamma, beta, k1, k2, b1, b2 = _inputs(False)
  with pytest.raises(ValueError, match="kernel_1 must be"):
    te_jax.layernorm_mlp(x, gamma, beta, k1[:, :, :64].reshape(64, 64), k2)
  with pytest.raises(ValueError, match="kernel_2 must be"):
    te_jax.layernorm_mlp(x, gamma, beta, k1, k2.T)
  with pytest.raises(ValueError, match="fp8_meta_2"):
    te_jax.layernorm_mlp(x, gamma, beta, k1, k2, recipe=DelayedScaling(), fp8_meta_1=te_jax.DenseFp8Meta.create(4))
  # Sizes an FP8 GEMM cannot take run in high precision: the plain composition's result.
  fp8 = te_jax.layernorm_dense(x[..., :40], gamma[:40], beta[:40], k1[:40, 0, :], recipe=Float8CurrentScaling())
  np.testing.assert_array_equal(np.asarray(fp8), np.asarray(te_jax.layernorm_dense(x[..., :40], gamma[:40], beta[:40],
                                                                                   k1[:40, 0, :])))


@pytest.mark.parametrize("make, match", [
    (lambda: te_flax.LayerNormMLP(intermediate_dim=0), "intermediate_dim"),
    (lambda: te_flax.LayerNormMLP(intermediate_dim=64.0), "intermediate_dim"),
    (lambda: te_flax.LayerNormMLP(intermediate_dim=64, intermediate_dropout=1.5), "intermediate_dropout"),
    (lambda: te_flax.LayerNormDenseGeneral(features="64"), "features"),
    (lambda: te_flax.LayerNormDenseGeneral(features=(4, 0)), "features"),
    (lambda: te_flax.DenseGeneral(features=()), "features"),
    (lambda: te_flax.DenseGeneral(features=8, axis=2), "axis 2 is out of range"),
    (lambda: te_flax.DenseGeneral(features=8, axis=(-1, 1)), "axes repeat"),
], ids=["mlp-dim-0", "mlp-dim-float", "mlp-dropout", "features-str", "features-0", "features-empty", "axis-range",
        "axis-twice"])
def test_module_argument_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make().init(jax.random.key(0), jnp.ones((4, 64), jnp.float32))


@pytest.mark.parametrize("rec", [None, "current"], ids=["hp", "fp8-current"])
def test_layernorm_mlp_returns_the_norm_output(rec):
  """return_layernorm_output: the same MLP output, and the normalized input with its gradient path."""
  model = te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("silu", "linear"), dtype=jnp.bfloat16)
  both = model.clone(return_layernorm_output=True)
  x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float32).astype(jnp.bfloat16)
  with te_jax.autocast(enabled=rec is not None, recipe=RECIPES.get(rec)):
    v = model.init(jax.random.key(1), x)
    y = model.apply(v, x)
    y2, z = both.apply(v, x)
    p = v["params"]
    np.testing.assert_allclose(np.asarray(y2, np.float32), np.asarray(y, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(z, np.float32), np.asarray(
        te_jax.layernorm(x, p["ln_scale"], p["ln_bias"]), np.float32))
    g = jax.grad(lambda x: jnp.sum(both.apply(v, x)[1].astype(jnp.float32) ** 2))(x)
    g_ref = jax.grad(lambda x: jnp.sum(te_jax.layernorm(x, p["ln_scale"], p["ln_bias"]).astype(jnp.float32) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), rtol=2e-2, atol=2e-2)


def test_layernorm_mlp_intermediate_dropout():
  """With intermediate dropout the module runs as its parts: the dropout sees act(fc1(norm(x))) and keeps each value
  (scaled by 1 / (1 - rate)) or zeroes it, fc2 sees exactly the dropout's output; deterministic=True drops nothing."""
  rate = 0.5
  model = te_flax.LayerNormMLP(intermediate_dim=64, intermediate_dropout=rate, dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(0), (8, 32))
  v = model.init(jax.random.key(1), x, deterministic=True)
  y, state = model.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(2)}, capture_intermediates=True)
  p = v["params"]
  a = jax.nn.gelu(te_jax.layernorm(x, p["ln_scale"], p["ln_bias"]) @ p["wi_kernel"][:, 0] + p["wi_bias"][0],
                  approximate=True)
  dropped = state["intermediates"]["Dropout_0"]["__call__"][0]
  kept = np.asarray(dropped != 0)
  assert 0.3 < kept.mean() < 0.7
  np.testing.assert_allclose(np.where(kept, dropped, 0), np.where(kept, a / (1 - rate), 0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y, dropped @ p["wo_kernel"] + p["wo_bias"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(model.apply(v, x, deterministic=True),
                                model.clone(intermediate_dropout=0.0).apply(v, x))


@pytest.mark.slow  # multi-step training
@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
def test_layernorm_mlp_module_trains_and_keeps_fp8_state(act):
  model = te_flax.LayerNormMLP(intermediate_dim=128, activation_type=act, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32).astype(jnp.bfloat16)
  y = jax.random.normal(jax.random.key(1), (64, 64), jnp.float32)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    variables = model.init(jax.random.key(2), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2))

    @jax.jit
    def step(state):
      loss_fn = lambda v: jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2)  # noqa: E731
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(20):
      state, loss = step(state)
      losses.append(float(loss))
  fp8 = state.params[te_jax.FP8_COLLECTION]
  assert sorted(fp8) == sorted(f"{p}{r}_{k}" for p in ("wi_", "wo_") for r in ("x", "kernel", "grad")
                               for k in ("amax_history", "scale"))
  assert all(float(v) != 1.0 for k, v in fp8.items() if k.endswith("_scale"))  # every scale moved off its init
  assert losses[-1] < 0.7 * losses[0], losses


def test_layernorm_dense_general_module_matches_parts():
  x = jax.random.normal(jax.random.key(0), (8, 32), jnp.float32)
  layer = te_flax.LayerNormDenseGeneral(features=48, dtype=jnp.float32)
  v = layer.init(jax.random.key(1), x)
  p = v["params"]
  z = nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": p["ln_scale"], "bias": p["ln_bias"]}}, x)
  np.testing.assert_allclose(layer.apply(v, x), z @ p["kernel"] + p["bias"], rtol=1e-5, atol=1e-5)


# ---- on the GPU: the CUDA path against the CPU path, and the module against plain Flax ---------------------------


def _cuda_targets(jitted, *args) -> set[str]:
  return set(re.findall(r'custom_call_target="(te_\w+)"', jitted.lower(*args).compile().as_text()))


@pytest.mark.gpu
@pytest.mark.parametrize("rec", list(RECIPES), ids=list(RECIPES))
@pytest.mark.parametrize("act", list(ACTS.values()), ids=list(ACTS))
def test_gpu_mlp_matches_cpu_path(act, rec, gpu):
  """layernorm_mlp on the GPU (CUDA norm, activation, quantize and cuBLASLt GEMM handlers) against the CPU path (CPU
  handlers and the reference GEMM) with the same FP8 state: the same loss, and gradients up to FP8 rounding flips. The
  two differ in the last bits of float32 sums (norm statistics, GEMM accumulation), and the output gradient is cast
  to E5M2 (2 mantissa bits): the ~2^-8 / 2^-2 of its elements that sit at a rounding boundary flip by a quarter of
  their value, which gives ~3-5% relative differences in dx (measured on the H200); a wrong layout or scale gives
  O(1)."""
  cpu = jax.devices("cpu")[0]
  args = _inputs(len(act) == 2, seed=4, rows=(4, 40), hidden=256, inter=512)
  r = RECIPES[rec]
  metas = (te_jax.DenseFp8Meta.create(4), te_jax.DenseFp8Meta.create(4))

  def f(x, g, b, k1, k2, b1, b2, m1, m2):
    return _loss(lambda *a: te_jax.layernorm_mlp(*a, activation_type=act, fp8_meta_1=m1, fp8_meta_2=m2,
                                                 recipe=r))(x, g, b, k1, k2, b1, b2)

  grad = jax.jit(jax.value_and_grad(f, argnums=tuple(range(9))))
  if isinstance(r, DelayedScaling):  # real scales for the compared step: one step on the CPU first
    _, g0 = grad(*jax.device_put((*args, *metas), cpu))
    metas = tuple(g0[7:9])
  on_gpu = jax.device_put((*args, *metas), gpu)
  targets = _cuda_targets(grad, *on_gpu)
  for t in ("te_norm_fwd_cuda", "te_norm_bwd_cuda", "te_act_fwd_cuda", "te_act_bwd_cuda", "te_gemm_cuda"):
    assert t in targets, (t, sorted(targets))
  loss_gpu, grads_gpu = grad(*on_gpu)
  loss_cpu, grads_cpu = grad(*jax.device_put((*args, *metas), cpu))
  assert abs(float(loss_gpu) - float(loss_cpu)) / float(loss_cpu) < 5e-3
  for i, (a, b) in enumerate(zip(grads_gpu[:7], grads_cpu[:7])):
    assert rel_error(a, b) < 0.1, (i, rel_error(a, b))
  for a, b in zip(jax.tree.leaves(grads_gpu[7:9]), jax.tree.leaves(grads_cpu[7:9])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0.1)


class _FlaxMLP(nn.Module):
  """The block written with plain Flax: LayerNorm, Dense, gelu (tanh form), Dense."""

  intermediate: int

  @nn.compact
  def __call__(self, x):
    z = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16, name="ln")(x)
    h = nn.gelu(nn.Dense(self.intermediate, dtype=jnp.bfloat16, name="fc1")(z), approximate=True)
    return nn.Dense(x.shape[-1], dtype=jnp.bfloat16, name="fc2")(h)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_layernorm_mlp_module_matches_plain_flax(fp8, gpu):
  """te_flax.LayerNormMLP with its parameters copied into the plain Flax block: the same output and parameter
  gradients on the GPU, within bf16 rounding (BF16) or FP8 quantization (FP8, current scaling)."""
  hidden, inter = 256, 1024
  x = jax.device_put(jax.random.normal(jax.random.key(5), (2, 96, hidden), jnp.float32).astype(jnp.bfloat16), gpu)
  ours = te_flax.LayerNormMLP(intermediate_dim=inter, activation_type=("gelu",), dtype=jnp.bfloat16,
                              bias_init=nn.initializers.normal(0.1))
  rec = Float8CurrentScaling() if fp8 else None
  with te_jax.autocast(enabled=fp8, recipe=rec):
    v = ours.init(jax.random.key(6), x)
  p = v["params"]
  flax_params = {"ln": {"scale": p["ln_scale"], "bias": p["ln_bias"]},
                 "fc1": {"kernel": p["wi_kernel"][:, 0, :], "bias": p["wi_bias"][0]},
                 "fc2": {"kernel": p["wo_kernel"], "bias": p["wo_bias"]}}
  with te_jax.autocast(enabled=fp8, recipe=rec):
    y, g = jax.jit(jax.value_and_grad(lambda v: _loss(lambda x: ours.apply(v, x))(x) / x.size))(v)
  y_ref, g_ref = jax.jit(jax.value_and_grad(lambda p: _loss(lambda x: _FlaxMLP(inter).apply({"params": p}, x))(x)
                                            / x.size))(flax_params)
  # bf16 rounds at different points in the two (fused vs per-op); FP8 gradients are E5M2 (2 mantissa bits).
  assert abs(float(y) - float(y_ref)) / float(y_ref) < (1e-2 if fp8 else 2e-3)
  tol = 0.15 if fp8 else 2e-2
  gp = g["params"]
  pairs = ((gp["wi_kernel"][:, 0, :], g_ref["fc1"]["kernel"]), (gp["wo_kernel"], g_ref["fc2"]["kernel"]),
           (gp["ln_scale"], g_ref["ln"]["scale"]), (gp["wo_bias"], g_ref["fc2"]["bias"]))
  for a, b in pairs:
    assert rel_error(a, b) < tol, [rel_error(a, b) for a, b in pairs]
