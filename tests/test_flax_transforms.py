"""Every Flax module under Flax's and JAX's transforms (nn.remat, nn.scan over stacked layers, nn.vmap over an
ensemble, jax.checkpoint) with delayed scaling: the step compiles, and the FP8 state comes back updated (every amax
history's newest entry positive), each layer or ensemble member its own."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import te_jax
import te_jax.flax as te_flax

FP8 = te_jax.FP8_COLLECTION
RECIPE = te_jax.recipe.DelayedScaling(amax_history_len=4)
MODULES = {
    "DenseGeneral": (te_flax.DenseGeneral, dict(features=32)),
    "LayerNorm": (te_flax.LayerNorm, {}),
    "LayerNormDenseGeneral": (te_flax.LayerNormDenseGeneral, dict(features=32)),
    "LayerNormMLP": (te_flax.LayerNormMLP, dict(intermediate_dim=64)),
    "MultiHeadAttention": (te_flax.MultiHeadAttention, dict(head_dim=8, num_attention_heads=4, deterministic=True)),
    "TransformerLayer": (te_flax.TransformerLayer, dict(hidden_size=32, intermediate_dim=64, num_attention_heads=4,
                                                        deterministic=True)),
}
X = jax.random.normal(jax.random.key(0), (2, 8, 32))


def _model(name: str, transform: str):
  cls, kw = MODULES[name]
  kw = {**kw, "dtype": jnp.float32}
  if transform == "remat":
    return nn.remat(cls)(**kw), (X,)
  if transform == "vmap":
    return nn.vmap(cls, variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True})(**kw), (jnp.stack([X, -X]),)
  if transform == "scan":

    class Body(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return cls(**kw)(c), None

    return nn.scan(Body, length=2, variable_axes={"params": 0, FP8: 0}, split_rngs={"params": True})(), (X, None)
  return cls(**kw), (X,)


@pytest.mark.parametrize("transform", ["remat", "scan", "vmap", "checkpoint"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "DenseGeneral" else pytest.mark.slow)
                                  for n in MODULES])
@pytest.mark.fast_cases(2)
def test_module_under_transform_updates_its_state(name, transform):
  model, args = _model(name, transform)

  def loss(v):
    apply = lambda v: model.apply(v, *args)
    out = (jax.checkpoint(apply) if transform == "checkpoint" else apply)(v)
    return jnp.sum((out[0] if transform == "scan" else out).astype(jnp.float32) ** 2)

  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = model.init(jax.random.key(1), *args)
    grads = jax.jit(jax.grad(loss))(variables)
  if name == "LayerNorm":  # no GEMM, no state
    assert FP8 not in variables
    return
  histories = [h for path, h in jax.tree_util.tree_leaves_with_path(grads[FP8]) if "amax_history" in str(path[-1])]
  assert histories
  for h in histories:
    newest = h[..., 0]  # (layers or members,) under scan and vmap
    assert bool(jnp.all(newest > 0)), newest
