"""te_jax.nnx's modules sharded as their linen twins are: with ``logical_axes=True`` under
``te_jax.flax.logical_axis_rules`` (8 CPU devices: data 2 x tensor 4 with sequence parallelism, and FSDP 2 x tensor 2
x context 2), an NNX LayerNormMLP, MultiHeadAttention and TransformerLayer loaded with the linen module's variables
compile to the same collectives as the linen module (the residual stream's sequence gathered and reduce-scattered in
the same places, the kernels' gradients reduced alike) and give the same output, parameter gradients and FP8 state
update, under DelayedScaling."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from conftest import random_normal
from parallel_model import collectives
from te_jax.recipe import DelayedScaling

B, S, HIDDEN, HEADS, FFN = 4, 16, 64, 8, 128
RECIPE = DelayedScaling(amax_history_len=4)
MESHES = {"dp2xtp4-sp": ((2, 4), ("data", "tensor"), dict(data="data", tensor="tensor", sequence_parallel=True)),
          "fsdp2xtp2xcp2": ((2, 2, 2), ("fsdp", "tensor", "cp"), dict(fsdp="fsdp", tensor="tensor", context="cp"))}


def _modules(kind, cp=None):
  """(the linen module, a constructor of its NNX twin, the call's keywords); ``cp``: the attention's context
  parallelism over that mesh axis."""
  common = dict(dtype=jnp.float32, logical_axes=True)
  if kind == "mlp":
    return (te_flax.LayerNormMLP(intermediate_dim=FFN, activation_type=("silu", "linear"), **common),
            lambda rngs: te_nnx.LayerNormMLP(HIDDEN, FFN, activation_type=("silu", "linear"), rngs=rngs, **common),
            dict(deterministic=True))
  attn = dict(backend="unfused", context_parallel=cp, cp_load_balanced=False, **common)
  if kind == "mha":
    return (te_flax.MultiHeadAttention(head_dim=HIDDEN // HEADS, num_attention_heads=HEADS, num_gqa_groups=4, **attn),
            lambda rngs: te_nnx.MultiHeadAttention(HIDDEN, HIDDEN // HEADS, HEADS, num_gqa_groups=4, rngs=rngs,
                                                   **attn),
            dict(deterministic=True))
  assert kind == "layer", kind
  return (te_flax.TransformerLayer(hidden_size=HIDDEN, intermediate_dim=FFN, num_attention_heads=HEADS,
                                   layer_type="decoder", activation_type=("silu", "linear"), **attn),
          lambda rngs: te_nnx.TransformerLayer(HIDDEN, FFN, HEADS, layer_type="decoder",
                                               activation_type=("silu", "linear"), rngs=rngs, **attn),
          dict(deterministic=True))


# One case in scripts/test.sh (the layer under sequence parallelism); the rest in CI's slow step.
@pytest.mark.parametrize("kind,mesh_name", [
    pytest.param(kind, mesh_name, marks=() if (kind, mesh_name) == ("layer", "dp2xtp4-sp") else pytest.mark.slow)
    for kind in ("mlp", "mha", "layer") for mesh_name in MESHES])
def test_nnx_shards_as_linen(kind, mesh_name):
  shape, names, rule_args = MESHES[mesh_name]
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)
  rules = te_flax.logical_axis_rules(**rule_args)
  linen, make_nnx, call = _modules(kind, rule_args.get("context"))
  x, target = random_normal(1, (B, S, HIDDEN)), random_normal(2, (B, S, HIDDEN))
  act = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "act_embed"), rules))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    xs = jax.device_put(x, act)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):  # NNX shards each variable as it creates it
      boxed = linen.init(jax.random.key(0), xs, **call)
      model = make_nnx(nnx.Rngs(1))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    variables = jax.device_put(nn.meta.unbox(boxed), shardings)
    te_nnx.from_linen(model, variables)
    graphdef, state = nnx.split(model)

    def linen_loss(v, x):
      return jnp.mean(linen.apply(v, x, **call) * target)

    def nnx_loss(state, x):
      return jnp.mean(nnx.merge(graphdef, state)(x, **call) * target)

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      linen_step = jax.jit(jax.value_and_grad(linen_loss)).lower(variables, xs).compile()
      nnx_step = jax.jit(jax.value_and_grad(nnx_loss)).lower(state, xs).compile()
      want_loss, want = linen_step(variables, xs)
      got_loss, got_state = nnx_step(state, xs)
  got = te_nnx.to_linen(nnx.merge(graphdef, got_state))
  want_collectives = collectives(linen_step.as_text())
  assert want_collectives[("all-gather", "", "f32")] or want_collectives[("all-gather", "", "f8e4m3fn")], (
      want_collectives)
  assert collectives(nnx_step.as_text()) == want_collectives
  np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(want_loss))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, want)

