"""te_jax.flax.LayerNorm against flax.linen.LayerNorm / RMSNorm with synced parameters.

- The same parameters from the same init key (names, shapes, dtypes, values); zero_centered_gamma stores scale - 1.
- Outputs and gradients against float64, under the tolerance rule (CONTRIBUTING.md) with Flax's own float32
  computation as the yardstick: err(ours, f64) <= 2 * err(flax, f64) + noise; the same output dtype as Flax for every
  dtype/param_dtype pair.
- Logical axis names, initializers, argument errors, a few optimizer steps alongside Flax, and the docstring examples
  of the normalization modules.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import te_jax.flax as te_flax
from conftest import F32_U

CPU = jax.devices("cpu")[0]
EPS = 1e-6


def _x(shape=(3, 5, 64), dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  rows = shape[:-1] + (1,)
  x = rng.uniform(-2, 2, rows) + np.exp2(rng.uniform(-2, 2, rows)) * rng.standard_normal(shape)
  return jax.device_put(jnp.asarray(x, dtype), CPU)


def flax_layer(norm_type: str, **kw):
  cls = nn.LayerNorm if norm_type == "layernorm" else nn.RMSNorm
  return cls(epsilon=EPS, **kw)


def truth(x, scale, bias, norm_type):
  """The layer in float64."""
  x = np.asarray(x).astype(np.float64)
  mean = 0.0 if norm_type == "rmsnorm" else x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  y = (x - mean) / np.sqrt(var + EPS) * np.asarray(scale, np.float64)
  return y if bias is None else y + np.asarray(bias, np.float64)


def assert_rule(ours, theirs, want, what, noise):
  want = np.asarray(want, np.float64)
  scale = np.max(np.abs(want)) + 1e-30
  e_ours = np.max(np.abs(np.asarray(ours).astype(np.float64) - want)) / scale
  e_theirs = np.max(np.abs(np.asarray(theirs).astype(np.float64) - want)) / scale
  assert e_ours <= 2 * e_theirs + noise, f"{what}: {e_ours:.3g} > 2 * {e_theirs:.3g} (Flax) + {noise:.3g}"


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    u, v = np.asarray(u), np.asarray(v)
    assert u.dtype == v.dtype and u.shape == v.shape, (jax.tree_util.keystr(path), u.dtype, v.dtype)
    np.testing.assert_array_equal(u.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8))


LAYERNORM_TYPES = ("layernorm", "rmsnorm")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("norm_type", LAYERNORM_TYPES)
def test_same_params_as_flax(norm_type, param_dtype):
  x = _x()
  kw = {"param_dtype": DTYPES[param_dtype]}
  ours = te_flax.LayerNorm(epsilon=EPS, norm_type=norm_type, **kw).init(jax.random.key(3), x)
  theirs = flax_layer(norm_type, **kw).init(jax.random.key(3), x)
  assert_trees_equal(ours, theirs)  # {'params': {'scale'[, 'bias']}}


@pytest.mark.parametrize("out_dtype", [None, jnp.bfloat16, jnp.float32], ids=["dtype-none", "bf16", "f32"])
@pytest.mark.parametrize("param_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("norm_type", LAYERNORM_TYPES)
@pytest.mark.fast_cases(6)
def test_outputs_and_gradients_against_flax(norm_type, x_dtype, param_dtype, out_dtype):
  """Synced (random) parameters; the output dtype is Flax's; values and gradients within the rule, with one rounding
  to the output (or gradient) dtype as noise, which both sides pay."""
  x = _x(dtype=DTYPES[x_dtype])
  kw = {"param_dtype": DTYPES[param_dtype], "dtype": out_dtype}
  ours = te_flax.LayerNorm(epsilon=EPS, norm_type=norm_type, **kw)
  theirs = flax_layer(norm_type, **kw)
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda p: jnp.asarray(rng.uniform(0.5, 1.5, p.shape), p.dtype),
                        theirs.init(jax.random.key(0), x))
  y_ours, y_theirs = ours.apply(params, x), theirs.apply(params, x)
  assert y_ours.dtype == y_theirs.dtype and y_ours.shape == y_theirs.shape
  p = params["params"]
  bias = p.get("bias")
  want = truth(x, p["scale"], bias, norm_type)
  assert_rule(y_ours, y_theirs, want, "output", noise=2 * F32_U + float(jnp.finfo(y_ours.dtype).eps))

  dz = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def grads(layer):
    return jax.grad(lambda v, x: jnp.sum(layer.apply(v, x).astype(jnp.float32) * dz), argnums=(0, 1))(params, x)

  g_ours, g_theirs = grads(ours), grads(theirs)
  assert jax.tree.structure(g_ours) == jax.tree.structure(g_theirs)
  # float64 gradients of the same loss, through jax's autodiff of the float64 formula (RMSNorm: a zero bias).
  with jax.enable_x64():
    def loss64(scale, b, x):
      mean = 0.0 if norm_type == "rmsnorm" else x.mean(-1, keepdims=True)
      y = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * scale
      return jnp.sum((y + b) * np.asarray(dz, np.float64))

    b64 = np.zeros(x.shape[-1]) if bias is None else np.asarray(bias).astype(np.float64)
    dscale, dbias, dx = (np.asarray(g) for g in jax.grad(loss64, argnums=(0, 1, 2))(
        np.asarray(p["scale"]).astype(np.float64), b64, np.asarray(x).astype(np.float64)))
  pairs = [("dx", g_ours[1], g_theirs[1], dx), ("dscale", g_ours[0]["params"]["scale"],
                                                g_theirs[0]["params"]["scale"], dscale)]
  if bias is not None:
    pairs.append(("dbias", g_ours[0]["params"]["bias"], g_theirs[0]["params"]["bias"], dbias))
  for name, a, b, w in pairs:
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    assert_rule(a, b, w, name, noise=2 * F32_U + float(jnp.finfo(a.dtype).eps))


@pytest.mark.parametrize("norm_type", LAYERNORM_TYPES)
def test_zero_centered_gamma(norm_type):
  """scale is stored as scale - 1 and initialized to zeros; with Flax's scale = ours + 1 the outputs agree."""
  x = _x()
  ours = te_flax.LayerNorm(epsilon=EPS, norm_type=norm_type, zero_centered_gamma=True)
  v = ours.init(jax.random.key(0), x)
  assert not np.any(np.asarray(v["params"]["scale"]))
  v = jax.tree.map(lambda p: p + 0.25, v)
  synced = {"params": {**v["params"], "scale": v["params"]["scale"] + 1}}
  y_ours, y_theirs = ours.apply(v, x), flax_layer(norm_type).apply(synced, x)
  want = truth(x, synced["params"]["scale"], synced["params"].get("bias"), norm_type)
  assert_rule(y_ours, y_theirs, want, "zero-centered output", noise=2 * F32_U)


def test_initializers_and_logical_axes():
  layer = te_flax.LayerNorm(scale_init=nn.initializers.constant(2.0), bias_init=nn.initializers.constant(0.5),
                            scale_axes=("embed",), bias_axes=("embed",))
  v = layer.init(jax.random.key(0), _x())
  assert nn.get_partition_spec(v)["params"] == {"scale": jax.sharding.PartitionSpec("embed"),
                                                "bias": jax.sharding.PartitionSpec("embed")}
  params = nn.unbox(v)["params"]
  np.testing.assert_array_equal(params["scale"], np.full(64, 2.0, np.float32))
  np.testing.assert_array_equal(params["bias"], np.full(64, 0.5, np.float32))
  rms = te_flax.LayerNorm(norm_type="rmsnorm", scale_axes=("embed",)).init(jax.random.key(0), _x())
  assert set(rms["params"]) == {"scale"}  # no bias for RMSNorm


def test_bad_layernorm_type():
  with pytest.raises(ValueError, match="^norm_type must be 'layernorm' or 'rmsnorm'"):
    te_flax.LayerNorm(norm_type="batchnorm").init(jax.random.key(0), _x())


@pytest.mark.slow  # multi-step training
@pytest.mark.parametrize("norm_type", LAYERNORM_TYPES)
def test_training_alongside_flax(norm_type):
  """A small regression model with the norm in the middle: 20 Adam steps from the same parameters reach the same
  loss as with Flax's norm (each step's float32 differences are rounding-level; the loss curves track)."""

  class Model(nn.Module):
    norm: type

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(32)(x)
      x = self.norm(name="norm")(x)
      return nn.Dense(1)(nn.gelu(x))

  ours = Model(lambda name: te_flax.LayerNorm(epsilon=EPS, norm_type=norm_type, name=name))
  theirs = Model(lambda name: flax_layer(norm_type, name=name))
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
  y = jnp.asarray(np.sin(np.asarray(x).sum(-1, keepdims=True)), jnp.float32)
  params = theirs.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)

  def train(model):
    @jax.jit
    def step(p, s):
      loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    p, s, losses = params, tx.init(params), []
    for _ in range(20):
      p, s, loss = step(p, s)
      losses.append(float(loss))
    return np.array(losses)

  l_ours, l_theirs = train(ours), train(theirs)
  assert l_ours[-1] < 0.5 * l_ours[0]  # it learns
  np.testing.assert_allclose(l_ours, l_theirs, rtol=1e-3)  # float32 rounding differences, amplified over 20 steps


def test_bf16_checkpoint_dtype_round_trip():
  """param_dtype bfloat16 parameters stay bfloat16 through a gradient step (the gradient has their dtype)."""
  x = _x(dtype=jnp.bfloat16)
  layer = te_flax.LayerNorm(param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
  v = layer.init(jax.random.key(0), x)
  g = jax.grad(lambda v: jnp.sum(layer.apply(v, x).astype(jnp.float32)))(v)
  assert {leaf.dtype for leaf in jax.tree.leaves(g)} == {jnp.dtype(ml_dtypes.bfloat16)}
