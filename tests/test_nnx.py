"""te_jax.nnx against te_jax.flax: each NNX module and its linen twin, loaded with the same parameters
(``te_jax.nnx.from_linen``), give bit-identical outputs, parameter gradients, parameters and FP8 state over five
train steps (adam, DelayedScaling, a batch of another range each step); and the NNX train step's FP8 state: kept
current by ``te_nnx.value_and_grad``, a params-only ``nnx.value_and_grad`` raises, shared modules combine their
updates, ``nnx.scan``, ``nnx.remat``, ``nnx.split``/``merge``, checkpoints and ``calibrate``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax.recipe import DelayedScaling, Float8CurrentScaling

FP8 = te_jax.FP8_COLLECTION
RECIPE = DelayedScaling(amax_history_len=4)
STEPS = 5


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def _batches(shape, n=STEPS, dtype=jnp.float32):
  return [(jax.random.normal(jax.random.key(10 + i), shape, jnp.float32) * (i + 1)).astype(dtype) for i in range(n)]


def _loss_of(y):
  y = y[0] if isinstance(y, tuple) else y
  return jnp.mean(y.astype(jnp.float32) ** 2)


def _linen_steps(module, variables, batches, kw):
  loss = lambda v, x: _loss_of(module.apply(v, x, **kw))  # noqa: E731
  state = train_state.TrainState.create(apply_fn=module.apply, params=variables, tx=optax.adam(1e-2))

  @jax.jit
  def step(state, x):
    value, grads = jax.value_and_grad(loss)(state.params, x)
    return state.apply_gradients(grads=grads), value, grads["params"]

  losses, grads = [], []
  for x in batches:
    state, value, g = step(state, x)
    losses.append(value)
    grads.append(g)
  return losses, grads, state.params


def _nnx_steps(model, batches, kw):
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    value, grads = te_nnx.value_and_grad(lambda m: _loss_of(m(x, **kw)))(model)
    optimizer.update(model, grads)
    return value, grads

  losses, grads = [], []
  for x in batches:
    value, g = step(model, optimizer, x)
    losses.append(value)
    grads.append(nnx.to_pure_dict(g))
  return losses, grads, te_nnx.to_linen(model)


def _parity(linen_module, make_nnx, x_shape, kw=None, dtype=jnp.float32, rename=None):
  kw = kw or {}
  batches = _batches(x_shape, dtype=dtype)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = linen_module.init(jax.random.key(0), batches[0], **kw)
    if rename:  # a submodule named otherwise in the two APIs
      variables = {c: {rename.get(k, k): v for k, v in tree.items()} for c, tree in variables.items()}
      linen_module = _Renamed(linen_module, {v: k for k, v in rename.items()})
    model = make_nnx(nnx.Rngs(1))
    te_nnx.from_linen(model, variables)
    _assert_trees_equal(te_nnx.to_linen(model), variables)
    want = _linen_steps(linen_module, variables, batches, kw)
    got = _nnx_steps(model, batches, kw)
  _assert_trees_equal(got[0], want[0])  # the losses: the outputs
  _assert_trees_equal(got[1], want[1])  # the parameter gradients of every step
  _assert_trees_equal(got[2], want[2])  # parameters and FP8 state after the steps
  if FP8 in variables:
    assert float(jnp.max(jax.tree.leaves(want[2][FP8])[0])) > 0  # the state moved


class _Renamed:
  """A linen module whose variables a test renamed: apply renames them back."""

  def __init__(self, module, back):
    self.module, self.back = module, back

  def apply(self, variables, *args, **kw):
    variables = {c: {self.back.get(k, k): v for k, v in tree.items()} for c, tree in variables.items()}
    return self.module.apply(variables, *args, **kw)


def test_dense_general_parity():
  _parity(te_flax.DenseGeneral(48), lambda r: te_nnx.DenseGeneral(32, 48, rngs=r), (2, 16, 32))


def test_dense_general_multi_axis_parity():
  _parity(te_flax.DenseGeneral((4, 16), axis=(-2, -1), dtype=jnp.bfloat16),
          lambda r: te_nnx.DenseGeneral((2, 16), (4, 16), axis=(-2, -1), dtype=jnp.bfloat16, rngs=r), (16, 2, 16))


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_parity(norm_type):
  _parity(te_flax.LayerNorm(norm_type=norm_type, zero_centered_gamma=True, dtype=jnp.bfloat16),
          lambda r: te_nnx.LayerNorm(32, norm_type=norm_type, zero_centered_gamma=True, dtype=jnp.bfloat16, rngs=r),
          (16, 32))


def test_dot_product_attention_parity():
  """No parameters: the outputs and the gradients of q, k and v."""
  kw = dict(num_gqa_groups=2, attn_mask_type="causal", backend="unfused")
  q, k, v = (_batches((2, 16, h, 16), 1)[0].astype(jnp.bfloat16) for h in (4, 2, 2))
  linen, model = te_flax.DotProductAttention(head_dim=16, num_attention_heads=4, **kw), te_nnx.DotProductAttention(
      16, 4, **kw)
  want = jax.value_and_grad(lambda q, k, v: _loss_of(linen.apply({}, q, k, v)), argnums=(0, 1, 2))(q, k, v)
  got = jax.value_and_grad(lambda q, k, v: _loss_of(model(q, k, v)), argnums=(0, 1, 2))(q, k, v)
  _assert_trees_equal(got, want)


def test_layernorm_dense_general_parity():
  _parity(te_flax.LayerNormDenseGeneral(48, norm_type="rmsnorm", dtype=jnp.bfloat16),
          lambda r: te_nnx.LayerNormDenseGeneral(32, 48, norm_type="rmsnorm", dtype=jnp.bfloat16, rngs=r), (16, 32))


@pytest.mark.parametrize("activation", [("gelu",), ("silu", "linear")])
def test_layernorm_mlp_parity(activation):
  _parity(te_flax.LayerNormMLP(intermediate_dim=64, activation_type=activation, dtype=jnp.bfloat16),
          lambda r: te_nnx.LayerNormMLP(32, 64, activation_type=activation, dtype=jnp.bfloat16, rngs=r), (2, 16, 32))


def test_fp8_dot_general_parity():
  _parity(nn.Dense(48, dot_general_cls=te_flax.Fp8DotGeneral),
          lambda r: nnx.Linear(32, 48, dot_general=te_nnx.Fp8DotGeneral(), rngs=r), (16, 32),
          rename={"Fp8DotGeneral_0": "dot_general"})


def test_multi_head_attention_parity():
  kw = dict(num_gqa_groups=2, enable_rotary_pos_emb=True, dtype=jnp.bfloat16, backend="unfused")
  _parity(te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=4, **kw),
          lambda r: te_nnx.MultiHeadAttention(64, 16, 4, rngs=r, **kw), (2, 16, 64), {"deterministic": True})


@pytest.mark.parametrize("variant", ["gpt", "post-ln"])
@pytest.mark.fast_cases(1)
def test_transformer_layer_parity(variant):
  kw = dict(hidden_size=64, intermediate_dim=128, num_attention_heads=4, dtype=jnp.bfloat16, backend="unfused")
  if variant == "gpt":
    kw.update(layer_type="decoder", activation_type=("silu", "linear"), num_gqa_groups=2, enable_rotary_pos_emb=True)
  else:
    kw.update(post_layernorm=True, use_bias=True)
  nnx_kw = dict(kw)
  args = [nnx_kw.pop(k) for k in ("hidden_size", "intermediate_dim", "num_attention_heads")]
  _parity(te_flax.TransformerLayer(**kw), lambda r: te_nnx.TransformerLayer(*args, rngs=r, **nnx_kw), (2, 16, 64),
          {"deterministic": True})


class _LinenTwice(nn.Module):
  """One DenseGeneral applied twice (shared weights)."""

  @nn.compact
  def __call__(self, x):
    d = te_flax.DenseGeneral(32, name="d")
    return d(jnp.tanh(d(x)) * 4.0)


class _NnxTwice(nnx.Module):
  def __init__(self, rngs):
    self.d = te_nnx.DenseGeneral(32, 32, rngs=rngs)

  def __call__(self, x):
    return self.d(jnp.tanh(self.d(x)) * 4.0)


def test_shared_module_combines_its_state_updates_as_linen():
  """Two applications of one layer: amax histories combine by max, scales by min, in both APIs alike."""
  _parity(_LinenTwice(), _NnxTwice, (16, 32))


class _LinenScan(nn.Module):
  @nn.compact
  def __call__(self, x):
    mlp = nn.scan(lambda m, c, _: (m(c), None), variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True},
                  length=3)
    return mlp(te_flax.LayerNormMLP(intermediate_dim=64, name="layers"), x, None)[0]


class _NnxScan(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
      return te_nnx.LayerNormMLP(32, 64, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, c):
      return layer(c)

    return body(self.layers, x)


def test_scan_over_stacked_layers_matches_linen_scan():
  """nnx.vmap-stacked layers under nnx.scan against nn.scan with the FP8 collection in variable_axes: a state per
  layer, updated as linen's."""
  _parity(_LinenScan(), _NnxScan, (16, 32))


def _trained_model(make=lambda r: te_nnx.LayerNormMLP(32, 64, rngs=r), steps=2):
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    model = make(nnx.Rngs(0))
    _nnx_steps(model, _batches((16, 32), steps), {})
  return model


def test_params_only_step_raises_with_the_fix():
  model = _trained_model()
  x = _batches((16, 32), 1)[0]
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="differentiate with te_jax.nnx.value_and_grad"):
      nnx.value_and_grad(lambda m: _loss_of(m(x)))(model)
    with pytest.raises(ValueError, match="differentiate with te_jax.nnx.value_and_grad"):
      nnx.jit(lambda m: nnx.grad(lambda m: _loss_of(m(x)))(m))(model)
    g = jax.grad(lambda x: _loss_of(model(x)))(x)  # input gradients only (saliency): no state needed
  assert float(jnp.max(jnp.abs(g))) > 0


@pytest.mark.parametrize("context", ["no autocast", "current scaling"])
def test_a_step_without_delayed_scaling_keeps_the_state(context):
  model = _trained_model()
  before = te_nnx.to_linen(model)
  recipe = Float8CurrentScaling() if context == "current scaling" else None
  with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
    _nnx_steps(model, _batches((16, 32), 1), {})
  after = te_nnx.to_linen(model)
  _assert_trees_equal(after[FP8], before[FP8])
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, after["params"], before["params"]))  # it trained


def test_missing_state_raises_naming_the_fix():
  model = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))  # outside autocast: no FP8 state
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="construct the model inside te_jax.autocast"):
      model(jnp.ones((16, 32)))
    with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
      assert model(jnp.ones((16, 32))).shape == (16, 16)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
    with pytest.raises(ValueError, match="amax_history_len is 8"):
      _trained_model()(jnp.ones((16, 32)))


def test_remat_gives_the_same_gradients_and_state():
  x = _batches((16, 32), 1)[0]
  results = []
  for remat in (False, True):
    model = _trained_model()
    call = nnx.remat(lambda m, x: m(x)) if remat else (lambda m, x: m(x))
    with te_jax.autocast(enabled=True, recipe=RECIPE):
      loss, grads = nnx.jit(lambda m: te_nnx.value_and_grad(lambda m: _loss_of(call(m, x)))(m))(model)
    results.append((loss, nnx.to_pure_dict(grads), te_nnx.to_linen(model)))
  _assert_trees_equal(results[1], results[0])


def test_split_merge_and_checkpoint_keep_params_and_state(tmp_path):
  model = _trained_model()
  x = _batches((16, 32), 1)[0]
  graphdef, state = nnx.split(model)
  merged = nnx.merge(graphdef, state)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    _assert_trees_equal(merged(x), model(x))
  import orbax.checkpoint as ocp
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", nnx.to_pure_dict(nnx.state(model)))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    fresh = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(5))
  abstract = nnx.to_pure_dict(nnx.state(fresh))
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  nnx.update(fresh, _replaced(fresh, restored))
  _assert_trees_equal(te_nnx.to_linen(fresh), te_nnx.to_linen(model))
  assert float(fresh.wi_grad_scale[...]) != 1.0  # a state that moved came back


def _replaced(model, pure):
  state = nnx.state(model)
  nnx.replace_by_pure_dict(state, pure)
  return state


def test_calibrate_matches_linen_and_raises_where_it_would_do_nothing():
  linen = te_flax.LayerNormMLP(intermediate_dim=64)
  x = _batches((16, 32), 1)[0] * 30
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = linen.init(jax.random.key(0), x)
    model = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
    te_nnx.from_linen(model, variables)
    want = te_flax.calibrate(lambda v, x: _loss_of(linen.apply(v, x)), variables, x)
    te_nnx.calibrate(lambda m, x: _loss_of(m(x)), model, x)
  _assert_trees_equal(te_nnx.to_linen(model), want)
  assert float(model.wi_x_scale[...]) != 1.0
  with pytest.raises(ValueError, match="calibrate: the pass ran no GEMM with delayed scaling"):
    te_nnx.calibrate(lambda m, x: _loss_of(m(x)), model, x)
  plain = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    with pytest.raises(ValueError, match="calibrate: the model has no te_jax.nnx.Fp8State"):
      te_nnx.calibrate(lambda m, x: _loss_of(m(x)), plain, x)


def test_sharding_metadata_reaches_the_params():
  """nnx.with_partitioning on the kernel initializer, and logical_axes=True, name the parameters' axes (the
  ``out_sharding`` metadata nnx.get_partition_spec reads); naming them both ways raises."""
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
  with nnx.use_eager_sharding(False):  # names only: no mesh here to place the parameters on
    layer = te_nnx.DenseGeneral(32, 64, kernel_init=init, rngs=nnx.Rngs(0))
    block = te_nnx.TransformerLayer(64, 128, 4, logical_axes=True, rngs=nnx.Rngs(0))
  assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
  specs = nnx.get_partition_spec(nnx.state(block, nnx.Param))
  assert tuple(specs["mlp"]["wi_kernel"].get_value()) == ("embed", "act", "mlp")
  assert tuple(specs["self_attention"]["qkv"]["kernel"].get_value()) == ("embed", "heads", "qkv", "kv")
  with pytest.raises(ValueError, match="names the parameter's axes already"):
    te_nnx.DenseGeneral(32, 64, kernel_init=init, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))


def test_dropout_needs_deterministic_and_draws_from_rngs():
  layer = te_nnx.TransformerLayer(64, 128, 4, hidden_dropout=0.5, backend="unfused", rngs=nnx.Rngs(0, dropout=1))
  x = _batches((2, 8, 64), 1)[0]
  with pytest.raises(ValueError, match="pass deterministic=True"):
    layer(x)
  a, b = layer(x, deterministic=False), layer(x, deterministic=False)
  assert not bool(jnp.array_equal(a, b))  # a new mask each call
  _assert_trees_equal(layer(x, deterministic=True), layer(x, deterministic=True))


@pytest.mark.slow  # ~10 s on 2 cores: the decoder's linen and NNX steps
def test_decoder_with_cross_attention_parity():
  kw = dict(layer_type="decoder", dtype=jnp.bfloat16, backend="unfused", use_bias=True)
  encoded = _batches((2, 8, 64), 1)[0].astype(jnp.bfloat16)
  _parity(te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4, **kw),
          lambda r: te_nnx.TransformerLayer(64, 128, 4, cross_attention=True, rngs=r, **kw), (2, 16, 64),
          {"encoded": encoded, "deterministic": True})


def test_layernorm_mlp_in_parts_parity():
  """return_layernorm_output: the MLP runs as its parts (layernorm_dense, activation, dense)."""
  _parity(te_flax.LayerNormMLP(intermediate_dim=64, return_layernorm_output=True),
          lambda r: te_nnx.LayerNormMLP(32, 64, return_layernorm_output=True, rngs=r), (16, 32))


def test_a_jitted_step_follows_autocast():
  """One nnx.jit step, called under DelayedScaling and then with FP8 off: retraced for each (autocast's state is part
  of the jit cache key), so the second call keeps the state instead of reusing the FP8 program."""
  model = _trained_model(steps=1)
  x = _batches((16, 32), 1)[0]

  @nnx.jit
  def step(model):
    return te_nnx.value_and_grad(lambda m: _loss_of(m(x)))(model)[0]

  with te_jax.autocast(enabled=True, recipe=RECIPE):
    step(model)
  moved = te_nnx.to_linen(model)[FP8]
  with te_jax.autocast(enabled=False):
    step(model)
  _assert_trees_equal(te_nnx.to_linen(model)[FP8], moved)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    step(model)
  assert not jax.tree.all(jax.tree.map(jnp.array_equal, te_nnx.to_linen(model)[FP8], moved))
