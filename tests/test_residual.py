"""The residual connection folded into a layer's last GEMM (``residual=`` of dense, layernorm_mlp and their Flax
modules; TransformerLayer uses it when no hidden dropout sits before the add).

Folded, ``x @ W + b + r`` is rounded once instead of twice: outputs within one rounding of the output dtype of the
unfolded layer's, gradients bitwise equal (the residual's gradient is the output's, and nothing else changes) but
where the residual is the block's input under FP8: the norm's backward kernel adds the residual's gradient before
rounding dx, so that gradient is within one rounding too.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax

CPU = jax.devices("cpu")[0]
RECIPES = {"bf16": None, "fp8-current": te_jax.recipe.Float8CurrentScaling()}


def _rand(shape, seed, dtype=np.float32, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def _check_folded(folded, unfolded, args, residual, device, rounded_once=()):
  """Outputs apart by at most the unfolded layer's extra bf16 rounding (of ``y`` before the add, |y| <= |out| + |r|,
  and of the sum: 2^-8 relative each); gradients of every argument equal, but those of the arguments in
  ``rounded_once``: the unfolded norm gradient ``a`` is rounded before the output's gradient ``w`` is added, so the
  two differ by at most 2^-8 (|a| + 2 |a + w|) with |a| <= |a + w| + |w|."""
  args = [jax.device_put(a, device) for a in args]
  y_f = np.asarray(jax.jit(folded)(*args)).astype(np.float32)
  y_u = np.asarray(jax.jit(unfolded)(*args)).astype(np.float32)
  r = np.abs(np.asarray(residual).astype(np.float32))
  bound = 2.0**-8 * (2 * np.abs(y_u) + r)
  assert np.all(np.abs(y_f - y_u) <= bound), float(np.max(np.abs(y_f - y_u) - bound))
  weights = jnp.asarray(_rand(y_f.shape, seed=99))

  def loss(f):
    return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * weights)

  argnums = tuple(range(len(args)))
  g_f = jax.jit(jax.grad(loss(folded), argnums=argnums))(*args)
  g_u = jax.jit(jax.grad(loss(unfolded), argnums=argnums))(*args)
  for i, (a, b) in enumerate(zip(g_f, g_u)):
    if i in rounded_once:
      a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
      w = np.abs(np.asarray(weights.astype(jnp.bfloat16)).astype(np.float32))
      bound = 2.0**-8 * (3 * np.abs(b) + w)
      assert np.all(np.abs(a - b) <= bound), (i, float(np.max(np.abs(a - b) - bound)))
      assert not np.array_equal(a, b), "the folded add should change some roundings"
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"gradient of argument {i}")


DEVICES = pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["cpu", "gpu"])


@DEVICES
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("rows", [48, 40], ids=["rows48", "rows40-padded"])
def test_dense_residual(recipe, rows, on_gpu, request):
  device = request.getfixturevalue("gpu") if on_gpu else CPU
  rec = RECIPES[recipe]
  x = _rand((2, rows // 2, 64), 1, ml_dtypes.bfloat16)
  kernel, bias = _rand((64, 32), 2, scale=0.125), _rand((32,), 3)
  residual = _rand((2, rows // 2, 32), 4, ml_dtypes.bfloat16, scale=4.0)
  _check_folded(lambda x, k, b, r: te_jax.dense(x, k, b, residual=r, recipe=rec),
                lambda x, k, b, r: te_jax.dense(x, k, b, recipe=rec) + r, [x, kernel, bias, residual], residual,
                device)


@DEVICES
@pytest.mark.parametrize("recipe", RECIPES)
def test_layernorm_mlp_residual(recipe, on_gpu, request):
  device = request.getfixturevalue("gpu") if on_gpu else CPU
  rec = RECIPES[recipe]
  x = _rand((3, 16, 64), 5, ml_dtypes.bfloat16)
  gamma, beta = 1 + _rand((64,), 6, scale=0.1), _rand((64,), 7, scale=0.1)
  k1, k2 = _rand((64, 1, 128), 8, scale=0.125), _rand((128, 64), 9, scale=0.1)

  def mlp(x, gamma, beta, k1, k2, residual=None):
    return te_jax.layernorm_mlp(x, gamma, beta, k1, k2, residual=residual, recipe=rec)

  _check_folded(lambda x, g, b, k1, k2: mlp(x, g, b, k1, k2, residual=x),
                lambda x, g, b, k1, k2: mlp(x, g, b, k1, k2) + x, [x, gamma, beta, k1, k2], x, device,
                rounded_once=(0,) if rec is not None else ())


@DEVICES
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("norm_type,rows", [("layernorm", 48), ("rmsnorm", 40)], ids=["layernorm", "rmsnorm-padded"])
def test_layernorm_dense_passed_input(recipe, norm_type, rows, on_gpu, request):
  """``return_input``: x passed through the layer as a residual; its gradient joins dx in the norm's kernel (also
  with rows padded to a multiple of 16 inside)."""
  device = request.getfixturevalue("gpu") if on_gpu else CPU
  rec = RECIPES[recipe]
  x = _rand((rows // 8, 8, 64), 11, ml_dtypes.bfloat16)
  gamma, kernel = 1 + _rand((64,), 12, scale=0.1), _rand((64, 64), 14, scale=0.1)
  beta = _rand((64,), 13, scale=0.1) if norm_type == "layernorm" else None
  ln_dense = functools.partial(te_jax.layernorm_dense, norm_type=norm_type, recipe=rec)

  def passed(x, g, k):
    y, x_out = ln_dense(x, g, beta, k, return_input=True)
    return y + x_out

  _check_folded(passed, lambda x, g, k: ln_dense(x, g, beta, k) + x, [x, gamma, kernel], jnp.zeros(()), device,
                rounded_once=(0,) if rec is not None else ())


def test_residual_shape_is_checked():
  with pytest.raises(ValueError, match="residual must have the output's shape"):
    te_jax.dense(jnp.ones((4, 16)), jnp.ones((16, 32)), residual=jnp.ones((4, 16)),
                 recipe=te_jax.recipe.Float8CurrentScaling())
  with pytest.raises(ValueError, match="residual must have the output's shape"):
    te_jax.dense(jnp.ones((4, 16)), jnp.ones((16, 8)), residual=jnp.ones((4, 16)))
  with pytest.raises(ValueError, match="exclude each other"):
    te_jax.dense(jnp.ones((4, 16)), jnp.ones((16, 2, 8)), unstack_axis=-2, residual=jnp.ones((4, 2, 8)))


@pytest.mark.parametrize("hidden_dropout,deterministic,folded", [(0.0, False, True), (0.1, True, True),
                                                                 (0.1, False, False)])
def test_transformer_layer_folds_only_without_dropout(hidden_dropout, deterministic, folded):
  """The compiled step has the residual adds as separate XLA adds only when dropout sits before them."""
  layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4,
                                   hidden_dropout=hidden_dropout, attention_dropout=0.0, dtype=jnp.bfloat16,
                                   layer_type="encoder")
  x = jnp.asarray(_rand((2, 16, 64), 10, ml_dtypes.bfloat16))
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  with te_jax.autocast(enabled=True, recipe=te_jax.recipe.Float8CurrentScaling()):
    variables = layer.init(rngs, x, deterministic=True)
    step = lambda v, x: layer.apply(v, x, deterministic=deterministic, rngs={"dropout": jax.random.key(2)})
    jaxpr = jax.make_jaxpr(step)(variables, x)
  adds_of_stream = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "add" and e.outvars[0].aval.shape == x.shape]
  assert (len(adds_of_stream) == 0) == folded, adds_of_stream


@pytest.mark.parametrize("layer_type,gqa_groups", [("encoder", None), ("decoder", None), ("decoder", 2)],
                         ids=["encoder", "decoder", "decoder-gqa"])
def test_transformer_layer_backward_has_no_residual_adds(layer_type, gqa_groups):
  """Pre-LN without dropout, FP8: the gradients of both residual connections are added inside the norms' backward
  kernels (with GQA, through the query projection's norm), so the backward has no add of two residual-stream-shaped
  gradients."""
  layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, dtype=jnp.bfloat16, layer_type=layer_type,
                                   num_gqa_groups=gqa_groups)
  x = jnp.asarray(_rand((2, 16, 64), 15, ml_dtypes.bfloat16))
  with te_jax.autocast(enabled=True, recipe=te_jax.recipe.Float8CurrentScaling()):
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    grad = jax.grad(lambda x: jnp.sum(layer.apply(variables, x, deterministic=True).astype(jnp.float32)))
    jaxpr = jax.make_jaxpr(grad)(x)

  def eqns(jaxpr):
    for e in jaxpr.eqns:
      yield e
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from eqns(sub)

  adds = [e for e in eqns(jaxpr.jaxpr) if e.primitive.name in ("add", "add_any")
          and e.outvars[0].aval.shape == x.shape]
  assert not adds, adds
