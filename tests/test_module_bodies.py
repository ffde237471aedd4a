"""The module bodies of ``te_jax.modules`` run the same in linen and NNX: a layer built in both frameworks with the
same options holds parameters and FP8 state of the same names, shapes and dtypes, and given the same values
(``te_nnx.from_linen``) computes bitwise the same outputs, gradients and FP8 state updates.

Cases cover what NNX gained from the shared body (DenseGeneral's ``batch_axis``, ``dot_general``, ``output_axes``)
and each recipe (none, delayed with its state, current)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = {"off": None, "delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}
# Every recipe in CI's slow step; scripts/test.sh runs delayed scaling, the one with state.
RECIPE_CASES = [pytest.param(r, marks=() if r == "delayed" else pytest.mark.slow) for r in sorted(RECIPES)]


def _bits(a, b, what):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), (what, jax.tree_util.keystr(path))
  assert jax.tree.structure(a) == jax.tree.structure(b), what


def _both(linen_layer, nnx_layer_fn, x, recipe_name):
  """Init linen and build NNX under the recipe, linen's variables loaded into NNX; the outputs, the gradients of
  the parameters and the FP8 state updates (delayed scaling) compared bit for bit."""
  recipe = RECIPES[recipe_name]
  with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
    variables = linen_layer.init(jax.random.key(0), x)
    model = nnx_layer_fn()
    te_nnx.from_linen(model, variables)  # same names, shapes and dtypes, or it raises
    y_linen, vjp = jax.vjp(lambda v, x: linen_layer.apply(v, x), variables, x)
    y_nnx = model(x)
    dy = jax.tree.map(jnp.ones_like, y_linen)
    grads_linen = vjp(dy)[0]
    _, grads_nnx = te_nnx.value_and_grad(
        lambda m: sum(jnp.vdot(a.astype(jnp.float32), b.astype(jnp.float32))
                      for a, b in zip(jax.tree.leaves(m(x)), jax.tree.leaves(dy))))(model)
  _bits(y_linen, y_nnx, "output")
  _bits(grads_linen["params"], nnx.to_pure_dict(grads_nnx), "parameter gradients")
  if te_jax.FP8_COLLECTION in variables:
    _bits(grads_linen[te_jax.FP8_COLLECTION], nnx.to_pure_dict(nnx.state(model, te_nnx.Fp8State)), "FP8 state")
  return variables, model, y_linen, vjp


@pytest.mark.parametrize("recipe_name", RECIPE_CASES)
def test_dense_general_same_in_both(recipe_name):
  x = jax.random.normal(jax.random.key(1), (4, 8, 32), jnp.bfloat16)
  _both(te_flax.DenseGeneral((2, 16), dtype=jnp.bfloat16),
        lambda: te_nnx.DenseGeneral(32, (2, 16), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x, recipe_name)


def test_dense_general_unstack_same_in_both():
  x = jax.random.normal(jax.random.key(1), (4, 32), jnp.bfloat16)
  _both(te_flax.DenseGeneral((3, 16), unstack_axis=-2, dtype=jnp.bfloat16),
        lambda: te_nnx.DenseGeneral(32, (3, 16), unstack_axis=-2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x,
        "delayed")


@pytest.mark.parametrize("recipe_name", ["off", "delayed"])
def test_dense_general_batch_axis(recipe_name):
  """NNX's ``batch_axis`` is linen's ``batch_dims``: one kernel per leading index, a high-precision GEMM (the FP8
  state, if any, handed back unchanged)."""
  x = jax.random.normal(jax.random.key(1), (3, 4, 32), jnp.float32)
  variables, model, y, _ = _both(
      te_flax.DenseGeneral(16, batch_dims=(0,)),
      lambda: te_nnx.DenseGeneral(32, 16, batch_axis={0: 3}, rngs=nnx.Rngs(0)), x, recipe_name)
  assert model.kernel.shape == (3, 32, 16) and y.shape == (3, 4, 16)
  want = jnp.einsum("bsi,bio->bso", x, variables["params"]["kernel"]) + variables["params"]["bias"][:, None]
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  assert not nnx.state(model, te_nnx.Fp8State)  # no te_jax GEMM: no state to keep


def test_dense_general_dot_general():
  calls = []

  def counting_dot(*args, **kwargs):
    calls.append(1)
    return jax.lax.dot_general(*args, **kwargs)

  x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)
  _both(te_flax.DenseGeneral(16, dot_general=counting_dot),
        lambda: te_nnx.DenseGeneral(32, 16, dot_general=counting_dot, rngs=nnx.Rngs(0)), x, "delayed")
  assert len(calls) >= 2  # linen's init and apply, and NNX's call, ran the caller's GEMM


def test_dense_general_output_axes_constrain():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (("batch", "data"), ("act_embed", "model"))
  x = jax.random.normal(jax.random.key(1), (8, 32), jnp.float32)
  model = te_nnx.DenseGeneral(32, 16, output_axes=("batch", "act_embed"), rngs=nnx.Rngs(0))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    y = jax.jit(lambda m, x: m(x))(model, x)
  assert y.sharding.spec == jax.sharding.PartitionSpec("data", "model")


@pytest.mark.parametrize("bad, match", [
    (dict(batch_axis={1: 3}), "batch_axis must map the leading input axes"),
    (dict(dot_general=jax.lax.dot_general, dot_general_cls=object), "dot_general or dot_general_cls"),
    (dict(unstack_axis=0), "unstack_axis must count from the output's end"),
])
def test_dense_general_bad_options(bad, match):
  with pytest.raises(ValueError, match=match):
    te_nnx.DenseGeneral(32, (2, 16), rngs=nnx.Rngs(0), **bad)


def test_nnx_input_of_other_size_names_in_features():
  model = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features"):
    model(jnp.ones((4, 24)))


@pytest.mark.parametrize("recipe_name", RECIPE_CASES)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_dense_general_same_in_both(recipe_name, norm_type):
  x = jax.random.normal(jax.random.key(1), (4, 8, 32), jnp.bfloat16)
  kw = dict(norm_type=norm_type, zero_centered_gamma=norm_type == "rmsnorm", dtype=jnp.bfloat16)
  _both(te_flax.LayerNormDenseGeneral(48, **kw),
        lambda: te_nnx.LayerNormDenseGeneral(32, 48, rngs=nnx.Rngs(0), **kw), x, recipe_name)


def test_layernorm_dense_general_return_layernorm_output_same_in_both():
  x = jax.random.normal(jax.random.key(1), (16, 32), jnp.bfloat16)
  _both(te_flax.LayerNormDenseGeneral((3, 16), unstack_axis=-2, return_layernorm_output=True, dtype=jnp.bfloat16),
        lambda: te_nnx.LayerNormDenseGeneral(32, (3, 16), unstack_axis=-2, return_layernorm_output=True,
                                             dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x, "delayed")


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layer_norm_same_in_both(norm_type):
  x = jax.random.normal(jax.random.key(1), (4, 32), jnp.float32)
  _both(te_flax.LayerNorm(norm_type=norm_type, dtype=jnp.bfloat16),
        lambda: te_nnx.LayerNorm(32, norm_type=norm_type, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x, "off")


def test_layernorm_dense_general_input_axes_in_both():
  """NNX's ``input_axes`` reads a sequence-parallel stream as linen's does: the same input gradient, back on the
  stream's shards."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = te_flax.logical_axis_rules(data="data", tensor="model", sequence_parallel=True)
  names = ("batch", "seq", "act_embed")
  x = jax.random.normal(jax.random.key(1), (4, 16, 32), jnp.bfloat16)
  linen_layer = te_flax.LayerNormDenseGeneral(64, kernel_axes=("embed", "mlp"), input_axes=names, dtype=jnp.bfloat16)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), te_jax.autocast(enabled=True, recipe=RECIPES["current"]):
    stream = nn.logical_to_mesh_axes(names)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, stream))
    variables = nn.unbox(jax.jit(linen_layer.init)(jax.random.key(0), x))
    model = te_nnx.LayerNormDenseGeneral(32, 64, kernel_axes=("embed", "mlp"), input_axes=names, dtype=jnp.bfloat16,
                                         rngs=nnx.Rngs(0))
    te_nnx.from_linen(model, variables)
    dx_linen = jax.jit(jax.grad(lambda x, v: linen_layer.apply(v, x).astype(jnp.float32).sum()))(x, variables)
    dx_nnx = jax.jit(jax.grad(lambda x, m: m(x).astype(jnp.float32).sum()))(x, model)
  _bits(dx_linen, dx_nnx, "input gradient")
  assert dx_linen.sharding.spec == dx_nnx.sharding.spec == stream == jax.sharding.PartitionSpec("data", "model", None)


@pytest.mark.parametrize("recipe_name", RECIPE_CASES)
@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear")])
def test_layernorm_mlp_same_in_both(recipe_name, act):
  x = jax.random.normal(jax.random.key(1), (4, 8, 32), jnp.bfloat16)
  kw = dict(activation_type=act, dtype=jnp.bfloat16)
  _both(te_flax.LayerNormMLP(intermediate_dim=64, **kw),
        lambda: te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0), **kw), x, recipe_name)


def test_layernorm_mlp_return_layernorm_output_same_in_both():
  x = jax.random.normal(jax.random.key(1), (16, 32), jnp.bfloat16)
  _both(te_flax.LayerNormMLP(intermediate_dim=64, return_layernorm_output=True, dtype=jnp.bfloat16),
        lambda: te_nnx.LayerNormMLP(32, 64, return_layernorm_output=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), x,
        "delayed")


@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear")])
def test_layernorm_mlp_logical_axes_in_both(act):
  """NNX's ``logical_axes`` names the parameters as linen's and reads a sequence-parallel stream as linen's does: the
  output and the input's gradient on the stream's shards, bitwise linen's, with the gated kernel tensor parallel."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = te_flax.logical_axis_rules(data="data", tensor="model", sequence_parallel=True)
  names = ("batch", "seq", "act_embed")
  x = jax.random.normal(jax.random.key(1), (4, 16, 32), jnp.bfloat16)
  kw = dict(activation_type=act, logical_axes=True, dtype=jnp.bfloat16)
  linen_layer = te_flax.LayerNormMLP(intermediate_dim=64, **kw)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), te_jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
    stream = nn.logical_to_mesh_axes(names)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, stream))
    boxed = jax.jit(linen_layer.init)(jax.random.key(0), x)
    variables = nn.unbox(boxed)
    model = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0), **kw)
    te_nnx.from_linen(model, variables)
    linen_names = {k: v.names for k, v in boxed["params"].items()}
    nnx_names = {k: v.get_metadata()["out_sharding"] for k, v in nnx.state(model, nnx.Param).items()}
    y_linen, dx_linen = jax.jit(jax.value_and_grad(
        lambda x, v: linen_layer.apply(v, x).astype(jnp.float32).sum()))(x, variables)
    y_nnx, dx_nnx = jax.jit(jax.value_and_grad(lambda x, m: m(x).astype(jnp.float32).sum()))(x, model)
  assert linen_names == nnx_names
  _bits((y_linen, dx_linen), (y_nnx, dx_nnx), "loss and input gradient")
  assert dx_nnx.sharding.spec == stream == jax.sharding.PartitionSpec("data", "model", None)


def test_layernorm_mlp_dropout_in_nnx():
  x = jax.random.normal(jax.random.key(1), (16, 32), jnp.bfloat16)
  model = te_nnx.LayerNormMLP(32, 64, intermediate_dropout=0.5, dtype=jnp.bfloat16, rngs=nnx.Rngs(0, dropout=1))
  train, evaluation = model(x, deterministic=False), model(x, deterministic=True)
  assert not np.array_equal(np.asarray(train, np.float32), np.asarray(evaluation, np.float32))
  with pytest.raises(ValueError, match="deterministic"):
    model(x)
