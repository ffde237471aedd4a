"""te_jax.flax.DenseGeneral and Fp8DotGeneral.

- Against flax.linen.DenseGeneral from the same init key: the same parameters (names, shapes, values); the same
  outputs without autocast; under FP8, outputs within the FP8 quantization bound and the FP8 state collection.
- Fp8DotGeneral as ``dot_general_cls`` of Flax's own layers.
- Training: an MLP classifier in FP8 reaches the BF16 loss; a BF16 checkpoint (params only) loads into an FP8 model;
  the full variables round-trip through orbax; nn.scan over layers keeps one FP8 state per layer.
- FP8 state updates of a module applied twice, and of micro-batches combined with accumulate_gradients: the larger
  amax and its scale; a module left unused in a step starts over from a fresh state.
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
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Format
from conftest import rel_error
from te_jax._core.scaling import ScaleState
from test_dense import current_scale, dense_reference, fp8_max, quantization_bounds

FP8 = te_jax.FP8_COLLECTION
CPU = jax.devices("cpu")[0]
HISTORY = 8
ROLES = ("x", "kernel", "grad")

# (features, axis) on x of shape (3, 4, 32): int and tuple features, int and tuple axes.
CONFIGS = {
    "int-int": (16, -1),
    "tuple-int": ((2, 8), -1),
    "int-tuple": (16, (1, 2)),
    "tuple-tuple": ((4, 4), (-2, -1)),
    "int-tuple-one": (32, (2,)),
}


def _x(dtype=jnp.float32, shape=(3, 4, 32), seed=0):
  return jax.device_put(jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype), CPU)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), x.dtype, y.dtype, x.shape, y.shape)
    np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8),
                                  err_msg=jax.tree_util.keystr(path))


# ---- against flax.linen.DenseGeneral -------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["dtype-none", "bf16"])
@pytest.mark.fast_cases(5)
def test_same_params_and_outputs_as_flax(config, use_bias, dtype):
  features, axis = CONFIGS[config]
  x = _x()
  ours = te_flax.DenseGeneral(features, axis=axis, use_bias=use_bias, dtype=dtype)
  theirs = nn.DenseGeneral(features, axis=axis, use_bias=use_bias, dtype=dtype)
  v_ours = ours.init(jax.random.key(42), x)
  v_theirs = theirs.init(jax.random.key(42), x)
  assert_trees_equal(v_ours, v_theirs)  # {'params': {'kernel', 'bias'}}: names, shapes, dtypes, bits
  y_ours, y_theirs = ours.apply(v_ours, x), theirs.apply(v_theirs, x)
  assert y_ours.dtype == y_theirs.dtype
  np.testing.assert_array_equal(np.asarray(y_ours).view(np.uint8), np.asarray(y_theirs).view(np.uint8))
  # Gradients too.
  g_ours = jax.grad(lambda v: jnp.sum(ours.apply(v, x).astype(jnp.float32) ** 2))(v_ours)
  g_theirs = jax.grad(lambda v: jnp.sum(theirs.apply(v, x).astype(jnp.float32) ** 2))(v_theirs)
  assert_trees_equal(g_ours, g_theirs)


@pytest.mark.parametrize("axis", [(-1, -2), (2, 1)], ids=str)
def test_unsorted_axes_give_flax_param_shapes(axis):
  x = _x()
  v_ours = te_flax.DenseGeneral(16, axis=axis).init(jax.random.key(0), x)
  v_theirs = nn.DenseGeneral(16, axis=axis).init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, v_ours) == jax.tree.map(jnp.shape, v_theirs)


FP8_RECIPES = {
    "delayed-hybrid": DelayedScaling(amax_history_len=HISTORY),
    "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=HISTORY),
    "current-hybrid": Float8CurrentScaling(),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rec", FP8_RECIPES)
@pytest.mark.fast_cases(4)
def test_fp8_outputs_close_to_flax_and_fp8_state(config, rec):
  """Under autocast: the same params, the output within the FP8 quantization bound of Flax's (at init the delayed
  scales are 1), and under DelayedScaling the FP8 collection with three amax histories of the recipe's length and
  three scales; Float8CurrentScaling keeps no state."""
  features, axis = CONFIGS[config]
  x = _x()
  r = FP8_RECIPES[rec]
  ours = te_flax.DenseGeneral(features, axis=axis)
  theirs = nn.DenseGeneral(features, axis=axis)
  with te_jax.autocast(enabled=True, recipe=r):
    variables = ours.init(jax.random.key(1), x)
    y = ours.apply(variables, x)
  v_theirs = theirs.init(jax.random.key(1), x)
  assert_trees_equal(variables["params"], v_theirs["params"])
  y_theirs = np.asarray(theirs.apply(v_theirs, x))

  if isinstance(r, DelayedScaling):
    assert set(variables) == {"params", FP8} and FP8 == "_overwrite_with_gradient" == te_jax.FP8_COLLECTION
    state = variables[FP8]
    assert set(state) == {f"{role}_{kind}" for role in ROLES for kind in ("amax_history", "scale")}
    for role in ROLES:
      h, s = state[f"{role}_amax_history"], state[f"{role}_scale"]
      assert h.shape == (HISTORY,) and h.dtype == jnp.float32 and not np.any(np.asarray(h))
      assert s.shape == () and s.dtype == jnp.float32 and float(s) == 1.0
    scales = (1.0, 1.0, 1.0)
  else:
    assert set(variables) == {"params"}
    kernel = np.asarray(variables["params"]["kernel"])
    scales = (current_scale(np.asarray(x), r.fp8_format.fwd_dtype), current_scale(kernel, r.fp8_format.fwd_dtype),
              1.0)
  kernel, bias = np.asarray(variables["params"]["kernel"]), np.asarray(variables["params"]["bias"])
  g = np.zeros(y.shape, np.float32)
  qbound = quantization_bounds(np.asarray(x), kernel, g, axis, scales, r.fp8_format)["out"]
  _, accum = dense_reference(np.asarray(x), kernel, bias, g, axis)
  # The quantization bound, plus the float32 accumulation error of each of the two results.
  assert np.all(np.abs(np.asarray(y, np.float64) - y_theirs) <= qbound + 2 * accum["out"])
  assert not np.array_equal(np.asarray(y), y_theirs)  # FP8 did happen


def test_module_recipe_overrides_autocast():
  x = _x()
  layer = te_flax.DenseGeneral(16, recipe=Float8CurrentScaling())
  variables = layer.init(jax.random.key(0), x)  # FP8 even outside autocast
  plain = nn.DenseGeneral(16).apply(variables, x)
  assert not np.array_equal(np.asarray(layer.apply(variables, x)), np.asarray(plain))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    assert set(layer.init(jax.random.key(0), x)) == {"params"}  # the module's current scaling wins: no state


def test_history_length_mismatch_is_an_error():
  x = _x()
  layer = te_flax.DenseGeneral(16)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    variables = layer.init(jax.random.key(0), x)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
    with pytest.raises(ValueError, match=r"x_amax_history has shape \(4,\), but the recipe's amax_history_len is 8"):
      layer.apply(variables, x)


# ---- Fp8DotGeneral -------------------------------------------------------------------------------------------------


def test_fp8_dot_general_in_flax_dense():
  x = _x(shape=(8, 32))
  ours = nn.Dense(16, dot_general_cls=te_flax.Fp8DotGeneral)
  theirs = nn.Dense(16)
  r = DelayedScaling(amax_history_len=HISTORY)

  # Outside autocast: plain dot_general, no FP8 state, bitwise Flax's.
  v_plain = ours.init(jax.random.key(0), x)
  assert set(v_plain) == {"params"}
  v_theirs = theirs.init(jax.random.key(0), x)
  assert_trees_equal(v_plain, v_theirs)
  np.testing.assert_array_equal(np.asarray(ours.apply(v_plain, x)), np.asarray(theirs.apply(v_theirs, x)))

  with te_jax.autocast(enabled=True, recipe=r):
    variables = ours.init(jax.random.key(0), x)
    assert_trees_equal(variables["params"], v_theirs["params"])
    state = variables[FP8]["Fp8DotGeneral_0"]
    assert {k: v.shape for k, v in state.items()} == {
        **{f"{role}_amax_history": (HISTORY,) for role in ROLES}, **{f"{role}_scale": () for role in ROLES}}
    y = ours.apply(variables, x)
    # A train step: the FP8 state becomes the amaxes of this step.
    c = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)
    grads = jax.grad(lambda v: jnp.sum(ours.apply(v, x) * c))(variables)
  kernel, bias = (np.asarray(variables["params"][n]) for n in ("kernel", "bias"))
  qbound = quantization_bounds(np.asarray(x), kernel, np.zeros((8, 16)), -1, (1.0, 1.0, 1.0), r.fp8_format)["out"]
  _, accum = dense_reference(np.asarray(x), kernel, bias, np.zeros((8, 16)), -1)
  y_theirs = np.asarray(theirs.apply(v_theirs, x), np.float64)
  # The quantization bound, plus the float32 accumulation error of each of the two results.
  assert np.all(np.abs(np.asarray(y, np.float64) - y_theirs) <= qbound + 2 * accum["out"])
  new = grads[FP8]["Fp8DotGeneral_0"]
  for role, v, dtype in (("x", x, r.fp8_format.fwd_dtype), ("kernel", kernel, r.fp8_format.fwd_dtype),
                         ("grad", c, r.fp8_format.bwd_dtype)):
    amax = np.float32(np.abs(np.asarray(v)).max())
    np.testing.assert_array_equal(np.asarray(new[f"{role}_amax_history"]), [amax] + [0] * (HISTORY - 1))
    np.testing.assert_array_equal(np.asarray(new[f"{role}_scale"]), np.float32(fp8_max(dtype)) / amax)


def test_output_axes():
  """output_axes constrains the output (a no-op without logical axis rules: the same values) and must name each of
  its dims; the row-parallel reduce-scatter it enables is checked in test_gemm and test_parallel_layers."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 4, 16)), jnp.float32)
  plain = te_flax.DenseGeneral(32, axis=(-2, -1))
  named = te_flax.DenseGeneral(32, axis=(-2, -1), output_axes=("batch", "seq", "act_embed"))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    variables = plain.init(jax.random.key(0), x)
    np.testing.assert_array_equal(named.apply(variables, x), plain.apply(variables, x))
    with pytest.raises(ValueError, match=r"output_axes \('batch', 'act_embed'\) must name each of the output's 3"):
      te_flax.DenseGeneral(32, axis=(-2, -1), output_axes=("batch", "act_embed")).init(jax.random.key(0), x)


# ---- training ------------------------------------------------------------------------------------------------------

# (batch, input features, hidden, hidden layers, classes): small enough for ~3 s per run on 2 CPU cores.
BATCH, FEATURES, HIDDEN, LAYERS, CLASSES = 256, 64, 128, 2, 16


class MLP(nn.Module):
  """A classifier: te_flax.DenseGeneral hidden layers in bf16, a float32 Flax head."""

  @nn.compact
  def __call__(self, x):
    for _ in range(LAYERS):
      x = nn.gelu(te_flax.DenseGeneral(HIDDEN, dtype=jnp.bfloat16)(x))
    return nn.Dense(CLASSES, dtype=jnp.float32)(x.astype(jnp.float32))


def _teacher():
  k1, k2 = jax.random.split(jax.random.key(2))
  return jax.random.normal(k1, (FEATURES, 64)) / np.sqrt(FEATURES), jax.random.normal(k2, (64, CLASSES)) / 8


def _batch(teacher, i):
  """A fresh batch per step, labelled by a fixed random tanh network: a function to learn, not data to memorise."""
  w1, w2 = teacher
  x = jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (BATCH, FEATURES))
  return x.astype(jnp.bfloat16), jnp.argmax(jnp.tanh(x @ w1) @ w2, axis=-1)


def _make_step(model, teacher):
  def loss_fn(v, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

  @jax.jit
  def step(state, i):
    x, y = _batch(teacher, i)
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  return step


def _train(fp8: bool, params, steps: int):
  model, teacher = MLP(), _teacher()
  rec = DelayedScaling(amax_history_len=16)
  with te_jax.autocast(enabled=fp8, recipe=rec):
    variables = model.init(jax.random.key(0), jnp.zeros((BATCH, FEATURES), jnp.bfloat16))
    variables = {**variables, "params": params}  # the same starting point for both runs
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(3e-3))
    step = _make_step(model, teacher)
    losses = []
    for i in range(steps):
      state, loss = step(state, i)
      losses.append(loss)
  return state, np.asarray(losses)


@pytest.mark.slow  # multi-step training
def test_fp8_training_reaches_bf16_loss():
  params = MLP().init(jax.random.key(0), jnp.zeros((BATCH, FEATURES), jnp.bfloat16))["params"]
  bf16_state, bf16 = _train(False, params, 150)
  fp8_state, fp8 = _train(True, params, 150)
  assert set(bf16_state.params) == {"params"} and set(fp8_state.params) == {"params", FP8}
  final_bf16, final_fp8 = bf16[-10:].mean(), fp8[-10:].mean()
  assert final_bf16 < 0.5 * bf16[0], f"BF16 did not learn: {bf16[0]:.3f} -> {final_bf16:.3f}"
  gap = (final_fp8 - final_bf16) / final_bf16
  assert abs(gap) <= 0.02, f"FP8 final loss {final_fp8:.4f} vs BF16 {final_bf16:.4f}: {gap:+.2%}"
  assert not np.array_equal(bf16, fp8)  # the FP8 run did run in FP8
  for layer in ("DenseGeneral_0", "DenseGeneral_1"):  # the state followed training: histories full, scales set
    state = fp8_state.params[FP8][layer]
    for role in ROLES:
      assert np.all(np.asarray(state[f"{role}_amax_history"]) > 0), (layer, role)
      assert float(state[f"{role}_scale"]) > 1.0, (layer, role)


@pytest.mark.slow  # multi-step training
def test_bf16_checkpoint_loads_into_fp8_model():
  """A checkpoint made without FP8 holds only ``params``: init the FP8 model (which creates the FP8 collection),
  put the loaded params in, train. The step uses the loaded params (the kernel amaxes are theirs)."""
  model, teacher = MLP(), _teacher()
  x0 = jnp.zeros((BATCH, FEATURES), jnp.bfloat16)
  bf16_state, _ = _train(False, MLP().init(jax.random.key(0), x0)["params"], 3)
  checkpoint = jax.tree.map(np.asarray, bf16_state.params)  # what a BF16 run saved
  assert set(checkpoint) == {"params"}
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
    variables = model.init(jax.random.key(7), x0)
    assert set(variables) == {"params", FP8}
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(checkpoint["params"])
    variables = {**variables, "params": checkpoint["params"]}
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))
    state, loss = _make_step(model, teacher)(state, 0)
  assert np.isfinite(float(loss))
  for layer in ("DenseGeneral_0", "DenseGeneral_1"):
    kernel_amax = np.float32(np.abs(checkpoint["params"][layer]["kernel"]).max())
    assert float(state.params[FP8][layer]["kernel_amax_history"][0]) == kernel_amax
    assert not np.array_equal(np.asarray(state.params["params"][layer]["kernel"]),
                              checkpoint["params"][layer]["kernel"])


@pytest.mark.slow  # multi-step training
def test_orbax_round_trip(tmp_path):
  """The full variables (params and FP8 state, after a few steps) saved with orbax and restored: bitwise the same,
  and the restored model computes bitwise the same output."""
  import orbax.checkpoint as ocp

  params = MLP().init(jax.random.key(0), jnp.zeros((BATCH, FEATURES), jnp.bfloat16))["params"]
  state, _ = _train(True, params, 3)
  variables = state.params
  assert np.all(np.asarray(variables[FP8]["DenseGeneral_0"]["x_amax_history"][:3]) > 0)

  path = tmp_path / "ckpt"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, variables)
  checkpointer.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, variables)
  restored = checkpointer.restore(path, abstract)
  checkpointer.close()
  assert_trees_equal(restored, variables)

  x, _ = _batch(_teacher(), 99)
  model = MLP()
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
    np.testing.assert_array_equal(np.asarray(model.apply(restored, x)), np.asarray(model.apply(variables, x)))


# ---- nn.scan over layers -------------------------------------------------------------------------------------------


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return nn.relu(te_flax.DenseGeneral(32, dtype=jnp.float32)(h)), None


@pytest.mark.slow  # multi-step training
def test_scan_keeps_one_fp8_state_per_layer():
  """nn.scan with variable_axes={'params': 0, FP8: 0}: the FP8 state is stacked per layer, a train step updates every
  layer's own slice (its kernel's amax, its input's amax), and training goes on."""
  layers, name = 3, "DenseGeneral_0"
  stack = nn.scan(_Block, variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True}, length=layers)()
  model_apply = lambda v, x: stack.apply(v, x, None)[0]
  rng = np.random.default_rng(3)
  x = jax.device_put(jnp.asarray(rng.standard_normal((8, 32)) * 4, jnp.float32), CPU)
  c = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    variables = stack.init(jax.random.key(0), x, None)
    assert variables["params"][name]["kernel"].shape == (layers, 32, 32)
    assert {k: v.shape for k, v in variables[FP8][name].items()} == {
        **{f"{role}_amax_history": (layers, 4) for role in ROLES}, **{f"{role}_scale": (layers,) for role in ROLES}}
    kernels = np.asarray(variables["params"][name]["kernel"])
    assert len({float(np.abs(k).max()) for k in kernels}) == layers  # split_rngs: a different kernel per layer
    state = train_state.TrainState.create(apply_fn=model_apply, params=variables, tx=optax.sgd(0.1))

    @jax.jit
    def step(state):
      grads = jax.grad(lambda v: jnp.sum(model_apply(v, x) * c))(state.params)
      return state.apply_gradients(grads=grads)

    # Each layer's input, computed layer by layer with the same (pre-step) per-layer parameters and state.
    inputs, h = [], x
    for layer in range(layers):
      inputs.append(np.asarray(h))
      p = jax.tree.map(lambda a: a[layer], {"params": variables["params"][name], FP8: variables[FP8][name]})
      meta = te_jax.DenseFp8Meta(*(ScaleState(p[FP8][f"{role}_amax_history"], p[FP8][f"{role}_scale"])
                                   for role in ROLES))
      h = jax.nn.relu(te_jax.dense(h, p["params"]["kernel"], p["params"]["bias"], fp8_meta=meta))
    state = step(state)
    new = state.params[FP8][name]
    for layer in range(layers):
      kernel_amax = np.float32(np.abs(kernels[layer]).max())
      np.testing.assert_array_equal(np.asarray(new["kernel_amax_history"][layer]), [kernel_amax, 0, 0, 0])
      np.testing.assert_array_equal(np.asarray(new["kernel_scale"][layer]), np.float32(448.0) / kernel_amax)
      x_amax = np.float32(np.abs(inputs[layer]).max())
      np.testing.assert_allclose(float(new["x_amax_history"][layer][0]), x_amax, rtol=1e-6)
      np.testing.assert_allclose(float(new["x_scale"][layer]), np.float32(448.0) / x_amax, rtol=1e-6)
      assert float(new["grad_amax_history"][layer][0]) > 0
    assert len({float(a) for a in np.asarray(new["x_amax_history"])[:, 0]}) == layers  # per layer, not shared
    for _ in range(2):
      state = step(state)
    assert np.all(np.asarray(state.params[FP8][name]["x_amax_history"])[:, :3] > 0)  # three steps in each history
    assert np.all(np.asarray(state.params[FP8][name]["grad_amax_history"])[:, :3] > 0)


def test_accumulated_micro_batches_give_the_full_batchs_state():
  """Gradients of four micro-batches (of different magnitudes) combined with accumulate_gradients: the FP8 state is
  the full batch's, bit for bit, and the parameter gradients its within float32 summation order. A plain sum adds
  the scales, a scale under which the largest micro-batch's input would saturate."""
  model = te_flax.DenseGeneral(32, dtype=jnp.float32)
  x = _x(shape=(4, 16, 32)) * jnp.exp2(jnp.arange(4.0))[:, None, None]
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=3)):
    variables = model.init(jax.random.key(0), x[0])
    grad = jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))
    full = grad(variables, x.reshape(64, 32))
    total = summed = None
    for mb in x:
      g = grad(variables, mb)
      total = te_flax.accumulate_gradients(total, g)
      summed = g if summed is None else jax.tree.map(jnp.add, summed, g)
  for name, want in full[FP8].items():
    np.testing.assert_array_equal(np.asarray(total[FP8][name]), np.asarray(want), err_msg=name)
  for a, b in zip(jax.tree.leaves(total["params"]), jax.tree.leaves(full["params"]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(b)).max()))
  assert float(summed[FP8]["x_scale"]) * float(jnp.abs(x).max()) > 448.0  # what the plain sum would do
  with pytest.raises(ValueError, match="not an FP8 amax history or scale"):
    te_flax.accumulate_gradients({FP8: {"other": jnp.ones(2)}}, {FP8: {"other": jnp.ones(2)}})


def test_micro_batches_in_a_scan_give_the_full_batchs_state():
  """Gradient accumulation as a jitted step writes it: a jax.lax.scan over the micro-batches, the sum started from
  zeros. The FP8 state equals the full batch's bit for bit, as with the Python loop above; the parameters' within
  float32 summation order."""
  model = te_flax.DenseGeneral(32, dtype=jnp.float32)
  x = _x(shape=(4, 16, 32)) * jnp.exp2(jnp.arange(4.0))[::-1, None, None]
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=3)):
    variables = model.init(jax.random.key(0), x[0])
    grad = jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2))
    full = jax.jit(grad)(variables, x.reshape(64, 32))

    @jax.jit
    def accumulated(variables, x):
      def body(total, mb):
        return te_flax.accumulate_gradients(total, grad(variables, mb)), None
      return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, variables), x)[0]

    total = accumulated(variables, x)
  for name, want in full[FP8].items():
    np.testing.assert_array_equal(np.asarray(total[FP8][name]), np.asarray(want), err_msg=name)
  for a, b in zip(jax.tree.leaves(total["params"]), jax.tree.leaves(full["params"]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(b)).max()))


def test_module_left_unused_in_a_step_starts_over():
  """A module a train step does not apply gets a zero gradient for its FP8 state, which apply_gradients writes over
  it (scale 0). Its next application acts as with a fresh state (history 0, scale 1), bit for bit, not with NaNs."""

  class Optional(nn.Module):
    @nn.compact
    def __call__(self, x, use_b: bool):
      y = te_flax.DenseGeneral(16, dtype=jnp.float32, name="a")(x)
      return te_flax.DenseGeneral(16, dtype=jnp.float32, name="b")(y) if use_b else y

  model, x = Optional(), _x(shape=(8, 32))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    v = model.init(jax.random.key(1), x, True)
    state = train_state.TrainState.create(apply_fn=model.apply, params=v, tx=optax.sgd(1e-3))
    for use_b in (True, False):
      state = state.apply_gradients(grads=jax.grad(lambda p, u=use_b: jnp.sum(model.apply(p, x, u)))(state.params))
    wiped = state.params[FP8]["b"]
    assert float(wiped["x_scale"]) == 0.0 and not np.any(np.asarray(wiped["x_amax_history"]))
    fresh = {**state.params, FP8: {**state.params[FP8], "b": v[FP8]["b"]}}
    y, g = jax.value_and_grad(lambda p: jnp.sum(model.apply(p, x, True)))(state.params)
    y_fresh, g_fresh = jax.value_and_grad(lambda p: jnp.sum(model.apply(p, x, True)))(fresh)
  assert np.isfinite(float(y))
  assert float(y) == float(y_fresh)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_fresh), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Stack(nn.Module):
  """A LayerNormDenseGeneral, a LayerNormMLP and a DenseGeneral: the fused paths and the plain one."""

  @nn.compact
  def __call__(self, x):
    x = te_flax.LayerNormDenseGeneral(64, dtype=jnp.float32, name="ln_dense")(x)
    x = x + te_flax.LayerNormMLP(intermediate_dim=128, dtype=jnp.float32, name="mlp")(x)
    return te_flax.DenseGeneral(32, dtype=jnp.float32, name="out")(x)


def _mean_loss(v, x, model=_Stack()):
  return jnp.mean(model.apply(v, x) ** 2)


def _calibrated_first_step(device):
  """Gradients of the first step on one batch: under Float8CurrentScaling, and under DelayedScaling after
  ``calibrate`` on that batch and without it; the parameters ``calibrate`` returned."""
  x = jax.device_put(_x(shape=(512, 32)), device)
  model, grad = _Stack(), jax.jit(jax.grad(_mean_loss))
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
    params = model.init(jax.random.key(0), x)["params"]
    current = grad({"params": params}, x)["params"]
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    fresh = {**model.init(jax.random.key(1), x), "params": params}
    calibrated = te_flax.calibrate(_mean_loss, fresh, x)
    assert_trees_equal(calibrated["params"], params)
    return current, grad(calibrated, x)["params"], grad(fresh, x)["params"]


def _leaf_errors(a, b):
  return [rel_error(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]


@pytest.mark.slow  # three gradient programs of a norm-MLP stack and a calibration pass: 15 s on 2 cores
def test_calibrated_first_step_is_the_current_scaling_step():
  """After ``calibrate`` on a batch, a delayed-scaling step on that batch casts every tensor by its own amax: its
  gradients are those of Float8CurrentScaling, bit for bit, in the norm-fused, MLP and plain GEMMs. A fresh state's
  are 2-8% off (its scales of 1 let the gradients of a mean loss underflow E5M2)."""
  current, calibrated, fresh = _calibrated_first_step(CPU)
  assert_trees_equal(calibrated, current)
  assert max(_leaf_errors(fresh, current)) > 0.05


@pytest.mark.gpu
def test_calibrated_first_step_is_the_current_scaling_step_on_gpu(gpu):
  """The same with the CUDA kernels, where the step after the calibration pass casts inside the norm and activation
  kernels (the pass itself writes their outputs, then quantizes): float32 rounding differs between the two, so the
  gradients agree to within 1%, not bit for bit, against 2-8% for a fresh state."""
  current, calibrated, fresh = _calibrated_first_step(gpu)
  assert max(_leaf_errors(calibrated, current)) < 0.01
  assert max(_leaf_errors(fresh, current)) > 0.05


def test_calibrate_records_each_tensors_amax():
  """One DenseGeneral, loss ``sum(y * c)``: the calibrated histories hold max|x|, max|kernel| and max|c| (the output
  gradient) in element 0 and zeros behind it, and each scale is fp8_max / amax."""
  model = te_flax.DenseGeneral(16, dtype=jnp.float32, use_bias=False)
  x, c = _x(shape=(32, 32)), _x(shape=(32, 16), seed=1) * 1e-4

  def loss(v, x, c):
    return jnp.sum(model.apply(v, x) * c), "aux"

  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=HISTORY)):
    v = model.init(jax.random.key(0), x)
    state = te_flax.calibrate(loss, v, x, c, has_aux=True)[FP8]
  for role, tensor, fmt in (("x", x, jnp.float8_e4m3fn), ("kernel", v["params"]["kernel"], jnp.float8_e4m3fn),
                            ("grad", c, jnp.float8_e5m2)):
    amax = np.float32(np.abs(np.asarray(tensor)).max())
    history = np.asarray(state[f"{role}_amax_history"], np.float32)
    np.testing.assert_array_equal(history, np.r_[amax, np.zeros(HISTORY - 1, np.float32)], err_msg=role)
    np.testing.assert_allclose(float(state[f"{role}_scale"]), fp8_max(fmt) / amax, rtol=1e-6, err_msg=role)


class _Optional(nn.Module):
  """Two DenseGenerals; ``use_b`` False skips the second."""

  recipe_b: object = None

  @nn.compact
  def __call__(self, x, use_b: bool = True):
    y = te_flax.DenseGeneral(16, dtype=jnp.float32, name="a")(x)
    return te_flax.DenseGeneral(16, dtype=jnp.float32, recipe=self.recipe_b, name="b")(y) if use_b else y


def test_calibrate_keeps_the_state_of_gemms_the_pass_does_not_reach():
  """A module ``fn`` does not apply keeps its state bit for bit (not the pass's zero cotangent); the others are
  calibrated."""
  model, x = _Optional(), _x(shape=(8, 32))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    v = model.init(jax.random.key(1), x)
    v = {**v, FP8: {**v[FP8], "b": jax.tree.map(lambda a: a + 3.0, v[FP8]["b"])}}  # a state that is not fresh
    out = te_flax.calibrate(lambda v, x: jnp.sum(model.apply(v, x, False)), v, x)[FP8]
  assert_trees_equal(out["b"], v[FP8]["b"])
  assert float(out["a"]["x_amax_history"][0]) == float(jnp.abs(x).max())


def test_calibrate_reaches_a_modules_own_recipe():
  """A module whose own ``recipe=DelayedScaling`` runs FP8 under a disabled autocast is calibrated; the module
  beside it runs without FP8 and has no state."""
  model, x = _Optional(recipe_b=DelayedScaling(amax_history_len=4)), _x(shape=(8, 32))
  v = model.init(jax.random.key(1), x)
  assert set(v[FP8]) == {"b"}
  out = te_flax.calibrate(lambda v, x: jnp.sum(model.apply(v, x)), v, x)
  y = model.apply(v, x, False)
  assert float(out[FP8]["b"]["x_amax_history"][0]) == float(jnp.abs(y).max())
  assert float(out[FP8]["b"]["x_scale"]) == pytest.approx(448.0 / float(jnp.abs(y).max()), rel=1e-6)
  assert_trees_equal(out["params"], v["params"])
  with pytest.raises(ValueError, match=r"\['other'\] is not an FP8 amax history or scale"):
    te_flax.calibrate(lambda v, x: jnp.sum(model.apply(v, x)), {**v, FP8: {**v[FP8], "other": jnp.ones(2)}}, x)


def test_calibrate_leaves_variables_alone_without_delayed_scaling():
  x, model = _x(shape=(16, 32)), _Stack()
  variables = model.init(jax.random.key(0), x)
  assert te_flax.calibrate(_mean_loss, variables, x) is variables  # no autocast: BF16, nothing to calibrate
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
    assert te_flax.calibrate(_mean_loss, variables, x) is variables
  with pytest.raises(TypeError, match="fn must be a callable"):
    te_flax.calibrate(None, variables, x)
  with pytest.raises(TypeError, match="variables must be the variables dict"):
    te_flax.calibrate(_mean_loss, [variables], x)



@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_module_applied_twice_combines_fp8_state_updates(jit):
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = te_flax.DenseGeneral(32, dtype=jnp.float32)
      return dense(nn.relu(dense(x)))

  model = Twice()
  x = _x(shape=(8, 32))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=3)):
    variables = model.init(jax.random.key(0), x)
    grad = jax.grad(lambda v: jnp.sum(model.apply(v, x)))
    grads = (jax.jit(grad) if jit else grad)(variables)
  new = grads[FP8]["DenseGeneral_0"]
  assert all(v.dtype == jnp.float32 for v in new.values())  # the max-combining dtype stays inside
  kernel_amax = np.float32(np.abs(np.asarray(variables["params"]["DenseGeneral_0"]["kernel"])).max())
  # Both applications see the same kernel, so any max-combination gives exactly the one-application state.
  np.testing.assert_array_equal(np.asarray(new["kernel_amax_history"]), [kernel_amax, 0, 0])
  np.testing.assert_array_equal(np.asarray(new["kernel_scale"]), np.float32(448.0) / kernel_amax)
  # Their inputs (x, then relu of the first output) and output gradients differ: the history holds the larger amax,
  # and the scale is that amax's, the smaller of the two applications' scales (the other input would saturate).
  dense = te_flax.DenseGeneral(32, dtype=jnp.float32)
  first = dense.apply({"params": variables["params"]["DenseGeneral_0"]}, x)
  x_amax = max(np.abs(np.asarray(x)).max(), np.abs(np.asarray(jax.nn.relu(first))).max())
  np.testing.assert_array_equal(np.asarray(new["x_amax_history"]), [x_amax, 0, 0])
  np.testing.assert_array_equal(np.asarray(new["x_scale"]), np.float32(448.0) / np.float32(x_amax))
  grad_amax = np.asarray(new["grad_amax_history"])[0]
  assert grad_amax > 0 and np.asarray(new["grad_amax_history"])[1] == 0
  np.testing.assert_array_equal(np.asarray(new["grad_scale"]), np.float32(57344.0) / grad_amax)
