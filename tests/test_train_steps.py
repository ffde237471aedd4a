"""The train-step shapes users write, against the FP8 state: each either keeps the delayed-scaling state current, keeps
it as it was, or raises with the fix; none leaves it frozen or zeroed in silence.

- the whole variables dict differentiated (TrainState(params=variables)): the reference;
- a custom optax loop through ``te_flax.split_fp8_state``: the same state and parameters, bit for bit;
- optax.MultiSteps: the state follows every micro-step, the parameters every k-th;
- only the parameters differentiated, or the collection passed as ``mutable=[...]`` (Flax's lm1b step): raises;
- gradients with respect to the input only (saliency): runs, no state needed;
- a step outside autocast or under another recipe: the state comes back unchanged, not zeroed;
- the state missing from the variables: raises, naming the collection;
- ``calibrate`` on params-only variables or outside autocast: raises;
- ``nn.scan`` with the collection in ``variable_axes``: each layer's own state; broadcast over a loop or a vmap:
  raises;
- ``jax.checkpoint`` saving only ``te_jax.FP8_RESIDUAL``: the FP8 operands saved, the same step.
"""

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

FP8 = te_jax.FP8_COLLECTION
RECIPE = DelayedScaling(amax_history_len=4)


class Block(nn.Module):
  """One of each FP8 module with state, so every fused op's rule is exercised."""

  @nn.compact
  def __call__(self, x):
    x = te_flax.LayerNormDenseGeneral(32, dtype=jnp.float32)(x)
    x = te_flax.LayerNormMLP(intermediate_dim=64, dtype=jnp.float32)(x)
    return te_flax.DenseGeneral(16, dtype=jnp.float32)(x)


MODEL = Block()
X = jax.random.normal(jax.random.key(1), (8, 16), jnp.float32)


def _loss(variables, x=X):
  return jnp.mean(MODEL.apply(variables, x) ** 2)


def _init():
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    return MODEL.init(jax.random.key(0), X)


def _assert_trees_equal(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def _train_state_steps(variables, tx, n, batches):
  state = train_state.TrainState.create(apply_fn=MODEL.apply, params=variables, tx=tx)
  step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(_loss)(s.params, x)))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    for i in range(n):
      state = step(state, batches[i])
  return state.params


BATCHES = [jax.random.normal(jax.random.key(10 + i), (8, 16), jnp.float32) * (i + 1) for i in range(4)]


def test_custom_optax_loop_with_split_fp8_state_matches_train_state():
  variables, tx = _init(), optax.adam(1e-2)
  want = _train_state_steps(variables, tx, 3, BATCHES)

  params, _ = te_flax.split_fp8_state(variables)
  opt_state = tx.init(params)

  @jax.jit
  def step(variables, opt_state, x):
    grads, new_state = te_flax.split_fp8_state(jax.grad(_loss)(variables, x))
    params, _ = te_flax.split_fp8_state(variables)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {**optax.apply_updates(params, updates), FP8: new_state}, opt_state

  with te_jax.autocast(enabled=True, recipe=RECIPE):
    for i in range(3):
      variables, opt_state = step(variables, opt_state, BATCHES[i])
  _assert_trees_equal(variables, want)
  assert float(jnp.max(want[FP8]["DenseGeneral_0"]["x_amax_history"])) > 0  # the state moved


def test_split_fp8_state_checks_its_argument():
  with pytest.raises(TypeError, match="split_fp8_state: expected the variables dict"):
    te_flax.split_fp8_state([1, 2])
  assert te_flax.split_fp8_state({"params": 1}) == ({"params": 1}, None)


def test_multisteps_updates_the_state_every_micro_step():
  """With optax.MultiSteps the parameters change every k-th call; the FP8 state, written by apply_gradients from the
  step's own gradient, after every call: the scales see every micro-batch."""
  variables = _init()
  tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  states = [_train_state_steps(variables, tx, n, BATCHES) for n in (1, 2)]
  plain = [_train_state_steps(variables, optax.sgd(0.0), n, BATCHES) for n in (1, 2)]  # state only, lr 0
  _assert_trees_equal(states[0][FP8], plain[0][FP8])
  _assert_trees_equal(states[0]["params"], variables["params"])  # the first micro-step only accumulates
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, states[1]["params"], variables["params"]))
  history = states[1][FP8]["DenseGeneral_0"]["x_amax_history"]
  assert float(history[0]) > 0 and float(history[1]) > 0  # two micro-steps rolled in


@pytest.mark.parametrize("mutable", [False, True], ids=["closed-over", "mutable"])
def test_differentiating_only_the_params_raises_with_the_fix(mutable):
  variables = _init()
  state = variables[FP8]

  def loss(params):
    out = MODEL.apply({"params": params, FP8: state}, X, mutable=[FP8] if mutable else False)
    return jnp.mean((out[0] if mutable else out) ** 2)

  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="differentiates an FP8 layer's kernel but not its delayed-scaling state"):
      jax.grad(loss)(variables["params"])


def test_input_gradients_need_no_state_update():
  variables = _init()
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    g = jax.jit(jax.grad(lambda x: _loss(variables, x)))(X)
  assert g.shape == X.shape and bool(jnp.all(jnp.isfinite(g))) and float(jnp.max(jnp.abs(g))) > 0


@pytest.mark.parametrize("context", ["no autocast", "autocast disabled", "current scaling"])
def test_a_step_without_delayed_scaling_keeps_the_state(context):
  variables = _train_state_steps(_init(), optax.sgd(0.1), 2, BATCHES)  # a state that has moved
  state = train_state.TrainState.create(apply_fn=MODEL.apply, params=variables, tx=optax.sgd(0.1))
  step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(_loss)(s.params)))
  if context == "no autocast":
    after = step(state)
  else:
    recipe = Float8CurrentScaling() if context == "current scaling" else RECIPE
    with te_jax.autocast(enabled=context == "current scaling", recipe=recipe):
      after = step(state)
  _assert_trees_equal(after.params[FP8], variables[FP8])
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, after.params["params"], variables["params"]))  # it trained


def test_missing_state_raises_naming_the_collection():
  variables = _init()
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="DelayedScaling needs this layer's FP8 state.*no '_overwrite_with_gradient'"):
      MODEL.apply({"params": variables["params"]}, X)
  bf16_init = MODEL.init(jax.random.key(0), X)  # init outside autocast: params only
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="Initialize the model inside te_jax.autocast"):
      MODEL.apply(bf16_init, X)
    with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):  # the documented way without a state
      assert MODEL.apply(bf16_init, X).shape == (8, 16)


def test_calibrate_raises_where_it_would_do_nothing():
  variables = _init()
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    calibrated = te_flax.calibrate(_loss, variables)
    with pytest.raises(ValueError, match="calibrate: variables has no '_overwrite_with_gradient' collection"):
      te_flax.calibrate(_loss, {"params": variables["params"]})
  assert float(calibrated[FP8]["DenseGeneral_0"]["x_scale"]) != 1.0
  with pytest.raises(ValueError, match="calibrate: the pass ran no GEMM with delayed scaling"):
    te_flax.calibrate(_loss, variables)
  assert te_flax.calibrate(_loss, {"params": variables["params"]}) == {"params": variables["params"]}  # BF16 code


def test_a_non_finite_step_leaves_the_state_as_it_was():
  """One NaN batch: optax.apply_if_finite skips the parameter update, and the FP8 state, whose amaxes are NaN in every
  layer's backward, stays as it was instead of holding a NaN in every history for amax_history_len steps; the next
  finite step updates both as usual."""
  variables = _train_state_steps(_init(), optax.sgd(0.1), 2, BATCHES)
  state = train_state.TrainState.create(apply_fn=MODEL.apply, params=variables,
                                        tx=optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5))
  step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(_loss)(s.params, x)))
  bad = BATCHES[2].at[3, 5].set(jnp.nan)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    skipped = step(state, bad)
    _assert_trees_equal(skipped.params, variables)
    after = step(skipped, BATCHES[2])
  history = after.params[FP8]["DenseGeneral_0"]["grad_amax_history"]
  assert bool(jnp.all(jnp.isfinite(history))) and float(history[0]) > 0
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, after.params["params"], variables["params"]))


def test_remat_policy_saves_exactly_the_named_fp8_residuals(capsys):
  """``save_only_these_names(te_jax.FP8_RESIDUAL)`` keeps each GEMM's FP8 input and kernel (four per GEMM pair of the
  MLP, two per dense) and recomputes everything else; the step is the plain one bit for bit."""
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = MODEL.init(jax.random.key(0), X)

    def loss(v, x):
      return jnp.mean(MODEL.apply(v, x) ** 2)

    policy = jax.checkpoint_policies.save_only_these_names(te_jax.FP8_RESIDUAL)
    remat = jax.checkpoint(loss, policy=policy)
    jax.ad_checkpoint.print_saved_residuals(remat, variables, X)
    saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    plain, kept = (jax.jit(jax.grad(f))(variables, X) for f in (loss, remat))
  assert len(saved) == 8 and all(line.startswith("f8_e4m3fn[") and te_jax.FP8_RESIDUAL in line for line in saved), saved
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(kept), jax.tree.leaves(plain), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


class _ScanBody(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return te_flax.DenseGeneral(16, dtype=jnp.float32)(x), None


def _scanned(fp8_axes: bool):
  kw = dict(variable_axes={"params": 0, FP8: 0}) if fp8_axes else dict(variable_axes={"params": 0},
                                                                      variable_broadcast=FP8)
  return nn.scan(_ScanBody, length=3, split_rngs={"params": True}, **kw)()


def test_scan_with_per_layer_state_updates_each_layer_on_its_own():
  model = _scanned(fp8_axes=True)
  x = jax.random.normal(jax.random.key(2), (8, 16), jnp.float32) * 3
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = model.init(jax.random.key(0), x, None)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x, None)[0] ** 2)))(variables)
  x_amax = grads[FP8]["DenseGeneral_0"]["x_amax_history"][:, 0]  # (layers,): each layer's own input amax
  assert x_amax[0] == jnp.max(jnp.abs(x)) and len(set(np.asarray(x_amax).tolist())) == 3, x_amax


@pytest.mark.parametrize("transform", ["scan broadcast", "vmap broadcast"])
def test_state_shared_by_loop_iterations_raises_with_the_fix(transform):
  """nn.scan broadcasting the FP8 collection (or nn.vmap with its axis None) would sum the iterations' state updates:
  raises, naming variable_axes; running it without differentiating the state is fine."""
  x = jnp.ones((8, 16), jnp.float32)
  if transform == "scan broadcast":
    model, args = _scanned(fp8_axes=False), (x, None)
    out = lambda v: model.apply(v, *args)[0]
  else:
    model = nn.vmap(te_flax.DenseGeneral, variable_axes={"params": None, FP8: None},
                    split_rngs={"params": False})(16, dtype=jnp.float32)
    args = (x,)
    out = lambda v: model.apply(v, *args)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = model.init(jax.random.key(0), *args)
    jax.jit(out)(variables)
    with pytest.raises(ValueError, match="variable_axes"):
      jax.grad(lambda v: jnp.sum(out(v)))(variables)
