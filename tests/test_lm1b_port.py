"""Flax's lm1b model (tests/models/lm1b, vendored unmodified) ported to te_jax three ways (tests/models/lm1b_ports.py:
``Fp8DotGeneral`` as its layers' ``dot_general_cls``, ``te_flax.DenseGeneral`` for ``nn.Dense``, its decoder block on
the fused modules), each trained 20 steps under each FP8 recipe beside the original in BF16: same initial parameters
(converted to the fused port's layout by ``te_flax.flax_block_to_te``), same byte-level batches; the final loss is
within 2% of BF16's, and under delayed scaling every GEMM's FP8 state moved.

The train step is lm1b's (``train.py``'s ``train_step``: a ``TrainState``, ``jax.value_and_grad`` of the weighted
cross entropy), adapted as the README's "Train steps" says: the state holds the whole variables dict and the loss
differentiates it (lm1b's ``{"params": params}`` would leave the FP8 state behind, which raises).

The CPU configuration is tiny (one layer, 64 wide); ``gpu`` runs lm1b-like sizes (6 layers, 512 wide) on a GPU.
"""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from models import lm1b_ports
from te_jax.recipe import DelayedScaling, Float8CurrentScaling

STEPS = 20
# The final loss of a port against BF16's: 2%. Measured on the CPU configuration: within 0.3% (FP8's error over
# 20 steps of a loss that falls from ~5.6 to ~2.9).
RTOL = 0.02
SIZES = {
    "cpu": dict(model=dict(emb_dim=64, num_heads=4, qkv_dim=64, mlp_dim=128, num_layers=1, max_len=32), batch=8,
                length=32, lr=3e-3),
    "gpu": dict(model=dict(emb_dim=512, num_heads=8, qkv_dim=512, mlp_dim=2048, num_layers=6, max_len=256), batch=32,
                length=256, lr=1e-3),
}
RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling()}
# The corpus: a fixed text, read as bytes (lm1b's padding token 0 never occurs in it).
TEXT = (pathlib.Path(lm1b_ports.__file__).parent / "lm1b" / "models.py").read_bytes()


def batches(size: str) -> list[jax.Array]:
  """``STEPS`` batches of ``(batch, length)`` byte windows of ``TEXT`` at fixed random offsets."""
  s = SIZES[size]
  data = np.frombuffer(TEXT, np.uint8).astype(np.int32)
  starts = np.random.default_rng(0).integers(0, len(data) - s["length"], (STEPS, s["batch"]))
  return [jnp.asarray(data[row[:, None] + np.arange(s["length"])]) for row in starts]


def loss_fn(model, variables, inputs):
  """lm1b's weighted cross entropy (no label smoothing): the inputs are the targets, the model shifts them."""
  logits = model.apply(variables, inputs)
  weights = jnp.where(inputs > 0, 1.0, 0.0)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), inputs)
  return jnp.sum(losses * weights) / jnp.sum(weights)


def train_step(state, inputs, model):
  """lm1b's ``train_step``, differentiating the whole variables dict (params and FP8 state)."""
  loss, grads = jax.value_and_grad(functools.partial(loss_fn, model))(state.params, inputs)
  return state.apply_gradients(grads=grads), loss


def train(state, model, data):
  step = jax.jit(functools.partial(train_step, model=model))
  losses = []
  for inputs in data:
    state, loss = step(state, inputs)
    losses.append(float(loss))
  return state, losses


def model_and_config(name: str, size: str):
  models = lm1b_ports.port(name)
  config = lm1b_ports.config(models, **SIZES[size]["model"])
  return models.TransformerLM(config), config


@functools.cache
def bf16_run(size: str):
  """The original model's initial parameters and its losses over the batches, in BF16."""
  model, _ = model_and_config("bf16", size)
  data = batches(size)
  params = nn.meta.unbox(model.init(jax.random.key(0), data[0])["params"])
  state = train_state.TrainState.create(apply_fn=model.apply, params={"params": params},
                                        tx=optax.adamw(SIZES[size]["lr"]))
  return params, train(state, model, data)[1]


def run_port(name: str, recipe, size: str):
  """The port trained from the original's initial parameters: (losses, FP8 state before, FP8 state after)."""
  params, _ = bf16_run(size)
  model, config = model_and_config(name, size)
  data = batches(size)
  if name == "fused":
    params = te_flax.convert_blocks(te_flax.flax_block_to_te, params, lm1b_ports.block_paths(config))
  tx = optax.adamw(SIZES[size]["lr"])
  with te_jax.autocast(enabled=True, recipe=recipe):
    variables = nn.meta.unbox(model.init(jax.random.key(1), data[0]))  # another key: the parameters are replaced
    if te_jax.FP8_COLLECTION in variables:  # delayed scaling: the original's parameters, a fresh FP8 state
      state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
      state = te_flax.restore_into_fp8(state, params)
      state = state.replace(params=te_flax.calibrate(functools.partial(loss_fn, model), state.params, data[0]))
    else:
      state = train_state.TrainState.create(apply_fn=model.apply, params={"params": params}, tx=tx)
    before = state.params.get(te_jax.FP8_COLLECTION)
    state, losses = train(state, model, data)
  return losses, before, state.params.get(te_jax.FP8_COLLECTION)


def _cases():
  for size in SIZES:
    for name in lm1b_ports.PORTS:
      for recipe in RECIPES:
        quick = (size, name, recipe) == ("cpu", "dense_general", "delayed")
        marks = [pytest.mark.gpu] if size == "gpu" else [] if quick else [pytest.mark.slow]
        yield pytest.param(size, name, recipe, marks=marks, id=f"{size}-{name}-{recipe}")


@pytest.mark.parametrize("size,name,recipe", list(_cases()))
def test_port_trains_to_the_bf16_loss(size, name, recipe):
  _, want = bf16_run(size)
  losses, before, after = run_port(name, RECIPES[recipe], size)
  assert all(np.isfinite(losses)), losses
  assert want[-1] < 0.8 * want[0], f"the BF16 model did not learn: {want}"  # a comparison worth making
  np.testing.assert_allclose(losses[-1], want[-1], rtol=RTOL, err_msg=f"{name} under {recipe}: {losses} vs {want}")
  if recipe == "delayed":
    histories = {jax.tree_util.keystr(path): (b, a) for (path, b), a in zip(
        jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after)) if "amax_history" in str(path[-1])}
    assert histories, "no FP8 state under delayed scaling"
    frozen = [path for path, (b, a) in histories.items() if np.array_equal(b, a)]
    assert not frozen, f"FP8 amax histories that did not change in {STEPS} steps: {frozen}"
  else:
    assert before is None and after is None  # current scaling keeps no state
