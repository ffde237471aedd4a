"""te_flax's checkpoint converter (te_jax/flax/checkpoint.py) on a Flax decoder LM (tests/models/decoder_lm.py) and its
port on te_jax's fused modules (tests/models/decoder_lm_ports.py, ``fused``):

- Flax -> te_jax -> Flax is the identity, bit for bit, and the te_jax tree is the fused model's own layout;
- the converted fused model computes what the Flax model computes (FP8 off), and so does ``TransformerLayer`` from a
  Flax block with biases everywhere and its own submodule names (``FlaxLayout``);
- Adam's moments convert with the parameters: a step after the conversion is the conversion of a step;
- every mismatch raises naming the path;
- a BF16 ``TrainState`` saved and restored with ``flax.serialization`` (orbax is not a dependency of te_jax), converted
  and restored into an FP8 train state, trains, its FP8 state moving.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from models import decoder_lm_ports
from te_jax.recipe import DelayedScaling

FP8 = te_jax.FP8_COLLECTION
SIZES = dict(emb_dim=64, num_heads=4, qkv_dim=64, mlp_dim=128, num_layers=2, max_len=16)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 256, (4, 16)), jnp.int32)


def decoder_lm(name: str, dtype=jnp.float32):
  config = decoder_lm_ports.config(name, dtype=dtype, **SIZES)
  return decoder_lm_ports.model(name, dtype=dtype, **SIZES), config


def to_te(params, config):
  return te_flax.convert_blocks(te_flax.flax_block_to_te, params, decoder_lm_ports.block_paths(config))


def to_flax(params, config):
  return te_flax.convert_blocks(te_flax.te_block_to_flax, params, decoder_lm_ports.block_paths(config))


def randomized(params, seed=1):
  """``params`` with every leaf moved by noise: no zero bias or unit scale that a wrong mapping could keep right."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([p + 0.1 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)])


@functools.cache
def flax_params():
  model, _ = decoder_lm("bf16")
  return randomized(nn.meta.unbox(model.init(jax.random.key(0), TOKENS)["params"]))


def assert_bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype, path
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_flax_to_te_to_flax_is_the_identity():
  params = flax_params()
  fused, config = decoder_lm("fused")
  te_params = to_te(params, config)
  want = jax.eval_shape(lambda: nn.meta.unbox(fused.init(jax.random.key(0), TOKENS)["params"]))
  assert jax.tree.structure(te_params) == jax.tree.structure(want)
  assert jax.tree.map(jnp.shape, te_params) == jax.tree.map(lambda s: s.shape, want)
  assert_bitwise(to_flax(te_params, config), params)
  assert_bitwise(te_params["embed"], params["embed"])  # the rest passes through
  qkv = te_params["block_1"]["self_attention"]["qkv"]["kernel"]
  attention = params["block_1"]["MultiHeadDotProductAttention_0"]
  np.testing.assert_array_equal(qkv[:, :, 1, :], attention["key"]["kernel"])  # (hidden, heads, q/k/v, head_dim)


# Float32, FP8 off: the two models differ in the order of their float32 sums (the norms' statistics, attention's
# softmax, the fused QKV GEMM), a few float32 ulps of the logits.
TOL = dict(rtol=1e-4, atol=1e-4)


def test_converted_fused_model_computes_the_flax_model():
  params = flax_params()
  flax_model, config = decoder_lm("bf16")
  fused, _ = decoder_lm("fused")
  want = flax_model.apply({"params": params}, TOKENS)
  got = fused.apply({"params": to_te(params, config)}, TOKENS)
  assert float(jnp.max(jnp.abs(want))) > 1.0
  np.testing.assert_allclose(got, want, **TOL)


class FlaxBlock(nn.Module):
  """A pre-LN Flax block with biases on every projection and its own submodule names."""

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(x[..., 0])
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, use_bias=True, deterministic=True, name="attn")(
        nn.LayerNorm(name="ln_attn")(x), mask=mask)
    h = nn.relu(nn.Dense(128, name="fc1")(nn.LayerNorm(name="ln_mlp")(x)))
    return x + nn.Dense(64, name="fc2")(h)


def test_transformer_layer_takes_a_flax_block_with_biases():
  layout = te_flax.FlaxLayout(attention_norm="ln_attn", attention="attn", mlp_norm="ln_mlp", mlp_in="fc1",
                              mlp_out="fc2")
  x = jax.random.normal(jax.random.key(2), (2, 16, 64))
  params = randomized(FlaxBlock().init(jax.random.key(0), x)["params"])
  layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4, layer_type="decoder",
                                   activation_type=("relu",), use_bias=True)
  te_params = te_flax.flax_block_to_te(params, layout)
  want = jax.eval_shape(lambda: layer.init(jax.random.key(0), x)["params"])
  assert jax.tree.map(jnp.shape, te_params) == jax.tree.map(lambda s: s.shape, want)
  np.testing.assert_allclose(layer.apply({"params": te_params}, x), FlaxBlock().apply({"params": params}, x), **TOL)
  assert_bitwise(te_flax.te_block_to_flax(te_params, layout), params)


def _step(model):
  def loss(variables, x):
    logits = model.apply(variables, x).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, x))

  return jax.jit(lambda state, x: state.apply_gradients(grads=jax.grad(loss)(state.params, x)))


def test_optimizer_moments_convert_with_the_parameters():
  flax_model, config = decoder_lm("bf16")
  fused, _ = decoder_lm("fused")
  tx = optax.adam(1e-2)
  state = train_state.TrainState.create(apply_fn=flax_model.apply, params={"params": flax_params()}, tx=tx)
  state = _step(flax_model)(state, TOKENS)  # non-zero moments
  convert = lambda v: {"params": to_te(v["params"], config)}  # noqa: E731
  te_state = te_flax.convert_train_state(state, convert)
  adam = te_state.opt_state[0]
  assert int(adam.count) == 1
  assert_bitwise(adam.mu, convert(state.opt_state[0].mu))
  assert_bitwise(adam.nu, convert(state.opt_state[0].nu))
  back = te_flax.convert_train_state(te_state, lambda v: {"params": to_flax(v["params"], config)})
  assert_bitwise(back.params, state.params)
  assert_bitwise(back.opt_state, state.opt_state)
  # The next step from the converted state is the converted next step (wrong moments would move it elsewhere).
  want = convert(_step(flax_model)(state, TOKENS).params)
  got = _step(fused)(te_state, TOKENS).params
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got, want)
  with pytest.raises(ValueError, match="no subtree of the tree is structured like the parameters"):
    te_flax.convert_like(convert, state.opt_state, {"other": 1})


def _block():
  return jax.tree.map(lambda x: x, flax_params()["block_0"])


def test_a_block_that_does_not_match_raises_naming_the_path():
  block = _block()
  block["MultiHeadDotProductAttention_0"]["key"] = {}
  with pytest.raises(ValueError, match="has no 'MultiHeadDotProductAttention_0/key/kernel', which "
                                       "'self_attention/qkv/kernel' needs"):
    te_flax.flax_block_to_te(block)
  block = _block()
  block["MultiHeadDotProductAttention_0"]["query"]["bias"] = jnp.zeros((4, 16))  # q's bias without k's and v's
  with pytest.raises(ValueError, match="has no 'MultiHeadDotProductAttention_0/key/bias'"):
    te_flax.flax_block_to_te(block)
  block = _block()
  block["MlpBlock_0"]["Dense_2"] = {"kernel": jnp.zeros((64, 64))}
  with pytest.raises(ValueError, match="has 'MlpBlock_0/Dense_2/kernel', which has no place in the other layout"):
    te_flax.flax_block_to_te(block)
  te_block = te_flax.flax_block_to_te(_block())
  del te_block["mlp"]["wo_kernel"]
  with pytest.raises(ValueError, match="te_block_to_flax: the te_jax block has no 'mlp/wo_kernel', which "
                                       "'MlpBlock_0/Dense_1/kernel' needs"):
    te_flax.te_block_to_flax(te_block)
  with pytest.raises(ValueError, match="no block 'block_7'"):
    te_flax.convert_blocks(te_flax.flax_block_to_te, flax_params(), ["block_7"])
  with pytest.raises(TypeError, match="'LayerNorm_0/scale' is boxed"):
    te_flax.flax_block_to_te({**_block(), "LayerNorm_0": {"scale": nn.LogicallyPartitioned(jnp.ones(64), ("embed",)),
                                                          "bias": jnp.zeros(64)}})
  with pytest.raises(TypeError, match="layout must be a te_jax.flax.FlaxLayout"):
    te_flax.flax_block_to_te(_block(), {"attention": "attn"})


def _fp8_state(model, tx):
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
    variables = model.init(jax.random.key(3), TOKENS)
  return train_state.TrainState.create(apply_fn=model.apply, params=nn.meta.unbox(variables), tx=tx)


def test_restore_into_fp8_raises_naming_the_path():
  fused, config = decoder_lm("fused")
  state = _fp8_state(fused, optax.adam(1e-3))
  params = to_te(flax_params(), config)
  with pytest.raises(ValueError, match="the checkpoint has no parameter 'block_0/mlp/ln_bias'"):
    te_flax.restore_into_fp8(state, flax_params())  # a Flax-layout checkpoint, not converted
  with pytest.raises(ValueError, match="the checkpoint has the parameter 'extra/kernel', which the model does "
                                       "not have"):
    te_flax.restore_into_fp8(state, {**params, "extra": {"kernel": jnp.ones(2)}})
  small = {**params, "logits": {"kernel": jnp.ones((64, 128)), "bias": jnp.ones(128)}}
  with pytest.raises(ValueError, match=r"the parameter 'logits/bias' is \(128,\) in the checkpoint and "
                                       r"\(256,\) in the model"):
    te_flax.restore_into_fp8(state, small)
  with pytest.raises(ValueError, match="the whole variables dict with the FP8 state"):
    te_flax.restore_into_fp8(state.replace(params={"params": state.params["params"]}), params)
  with pytest.raises(ValueError, match="opt_state is not the state of the train state's optimizer"):
    te_flax.restore_into_fp8(state, params, optax.sgd(0.1, momentum=0.9).init(params))


@pytest.mark.slow  # ~16 s on 2 cores: a BF16 and an FP8 train state, saved, restored and stepped
def test_a_saved_bf16_train_state_restores_into_an_fp8_train_state_and_trains():
  flax_model, config = decoder_lm("bf16", jnp.bfloat16)
  fused, _ = decoder_lm("fused", jnp.bfloat16)
  tx = optax.adam(3e-3)
  bf16 = train_state.TrainState.create(apply_fn=flax_model.apply, params=flax_params(), tx=tx)
  loss = lambda model, variables, x: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
      model.apply(variables, x).astype(jnp.float32), x))
  bf16_step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(  # a Flax step: params only
      lambda p: loss(flax_model, {"params": p}, x))(s.params)))
  bf16 = bf16_step(bf16, TOKENS)

  saved = serialization.to_bytes(bf16)
  template = train_state.TrainState.create(apply_fn=flax_model.apply, params=jax.tree.map(jnp.zeros_like, bf16.params),
                                           tx=tx)
  restored = serialization.from_bytes(template, saved)
  assert_bitwise(restored.params, bf16.params)
  assert_bitwise(restored.opt_state, bf16.opt_state)

  converted = te_flax.convert_train_state(restored, lambda p: to_te(p, config))
  state = te_flax.restore_into_fp8(_fp8_state(fused, tx), converted.params, converted.opt_state)
  assert_bitwise(state.params["params"], converted.params)
  assert_bitwise(state.opt_state, converted.opt_state)  # the optimizer's state is over the params collection only
  assert int(state.opt_state[0].count) == 1

  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
    state = state.replace(params=te_flax.calibrate(functools.partial(loss, fused), state.params, TOKENS))
    before = state.params[FP8]
    step = jax.jit(lambda s, x: s.apply_gradients(grads=jax.grad(functools.partial(loss, fused))(s.params, x)))
    first = float(loss(fused, state.params, TOKENS))
    for _ in range(3):
      state = step(state, TOKENS)
    last = float(loss(fused, state.params, TOKENS))
  # The restored model starts where the BF16 one is (its loss, BF16 vs FP8 of the same weights) and goes on learning.
  np.testing.assert_allclose(first, float(loss(flax_model, {"params": bf16.params}, TOKENS)), rtol=0.02)
  assert last < first, (first, last)
  moved = [not np.array_equal(b, a) for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(state.params[FP8]))]
  assert any(moved) and len(moved) > 0
