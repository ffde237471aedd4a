"""The attention modules' twins, beyond tests/test_nnx.py: a module's own FP8 ``recipe=`` (linen MultiHeadAttention and
TransformerLayer, as NNX's), T5's RelativePositionBiases in NNX (and linen's, bit for bit as it was before its math
moved to te_jax.modules.relative_position), and NNX's KV cache (``decode``, ``init_cache``) against linen's decoding
and the full causal forward."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
import te_jax.fused.attention as fused_attention
from te_jax.fused.attention import fp8_dpa_enabled
import te_jax.nnx as te_nnx
from te_jax.recipe import DelayedScaling, Float8CurrentScaling

FP8 = te_jax.FP8_COLLECTION
DELAYED = DelayedScaling(amax_history_len=4)


def _fast_only(values, fast, ids=None):
  """``values`` as pytest params, all but ``fast`` marked slow (the full set runs in CI's slow step; scripts/test.sh
  keeps one representative case of each test)."""
  return [pytest.param(v, id=None if ids is None else ids(v), marks=() if v in fast else pytest.mark.slow)
          for v in values]


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)), a, b)


def _x(shape, seed=0, dtype=jnp.float32):
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def _nnx_args(kw):
  """TransformerLayer's linen attributes as NNX's positional sizes and keywords."""
  kw = dict(kw)
  return [kw.pop(k) for k in ("hidden_size", "intermediate_dim", "num_attention_heads")], kw


def _loss(y):
  return jnp.mean(y.astype(jnp.float32) ** 2)


def _train_both(linen, variables, model, batches, kw):
  """Three adam steps of the linen module and of the NNX model loaded with the same variables: (losses, parameter
  gradients, final variables) of each."""
  state = train_state.TrainState.create(apply_fn=linen.apply, params=variables, tx=optax.adam(1e-2))

  @jax.jit
  def linen_step(state, x):
    value, grads = jax.value_and_grad(lambda v: _loss(linen.apply(v, x, **kw)))(state.params)
    return state.apply_gradients(grads=grads), value, grads["params"]

  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x):
    value, grads = te_nnx.value_and_grad(lambda m: _loss(m(x, **kw)))(model)
    optimizer.update(model, grads)
    return value, grads

  want, got = ([], []), ([], [])
  for x in batches:
    state, value, g = linen_step(state, x)
    want[0].append(value)
    want[1].append(g)
    value, g = nnx_step(model, optimizer, x)
    got[0].append(value)
    got[1].append(nnx.to_pure_dict(g))
  return (*want, state.params), (*got, te_nnx.to_linen(model))


# ---- recipe= on the linen attention modules ------------------------------------------------------------------------

LAYERS = {
    "gpt": dict(layer_type="decoder", num_gqa_groups=2, activation_type=("silu", "linear"), enable_rotary_pos_emb=True),
    "post-ln": dict(post_layernorm=True, use_bias=True),
    "relative": dict(layer_type="decoder", enable_relative_embedding=True),
}
# The GEMMs of each variant: every one keeps its FP8 state under a DelayedScaling recipe.
GEMMS = {
    "gpt": {("self_attention", "query"), ("self_attention", "kv"), ("self_attention", "out"), ("mlp",)},
    "post-ln": {("self_attention", "qkv"), ("self_attention", "out"), ("wi",), ("wo",)},
    "relative": {("self_attention", "qkv"), ("self_attention", "out"), ("mlp",)},
}


def _layer_kw(variant):
  return dict(hidden_size=64, intermediate_dim=128, num_attention_heads=4, dtype=jnp.bfloat16, backend="unfused",
              **LAYERS[variant])


def _state_owners(tree, path=()):
  """The module paths that hold FP8 state (the dicts with an ``x_amax_history``-like leaf)."""
  out = set()
  for k, v in tree.items():
    if isinstance(v, dict):
      out |= _state_owners(v, (*path, k))
    elif k.endswith("amax_history"):
      out.add(path)
  return out


@pytest.mark.slow  # ~8 s on 2 cores; a recipe= overriding autocast's is also test_recipe_autocast's
@pytest.mark.parametrize("variant", sorted(LAYERS))
def test_current_scaling_recipe_keeps_no_state_under_delayed_autocast(variant):
  """recipe=Float8CurrentScaling() under autocast(DelayedScaling): no FP8 state in either framework, every GEMM in
  current scaling (the outputs are those of the same layer under autocast(Float8CurrentScaling), not of high
  precision), and linen and NNX give the same outputs for the same parameters."""
  kw = _layer_kw(variant)
  x = _x((2, 16, 64), 1, jnp.bfloat16)
  current = Float8CurrentScaling()
  linen = te_flax.TransformerLayer(recipe=current, **kw)
  args, nnx_kw = _nnx_args(kw)
  with te_jax.autocast(enabled=True, recipe=DELAYED):
    variables = linen.init(jax.random.key(0), x, deterministic=True)
    assert FP8 not in variables
    y_linen = linen.apply(variables, x, deterministic=True)
    model = te_nnx.TransformerLayer(*args, recipe=current, rngs=nnx.Rngs(1), **nnx_kw)
    assert not jax.tree.leaves(nnx.state(model, te_nnx.Fp8State))
    te_nnx.from_linen(model, variables)
    y_nnx = model(x, deterministic=True)
  _assert_trees_equal(y_nnx, y_linen)
  with te_jax.autocast(enabled=True, recipe=current):
    _assert_trees_equal(te_flax.TransformerLayer(**kw).apply(variables, x, deterministic=True), y_linen)
  high = te_flax.TransformerLayer(**kw).apply(variables, x, deterministic=True)
  assert not np.array_equal(np.asarray(high), np.asarray(y_linen))  # FP8 ran


@pytest.mark.parametrize("variant", _fast_only(sorted(LAYERS), {"relative"}))
def test_delayed_recipe_keeps_state_without_autocast_and_trains_as_nnx(variant):
  """recipe=DelayedScaling() outside any autocast: every GEMM keeps its FP8 state, in linen and NNX alike, and three
  train steps give bit-identical losses, gradients, parameters and state."""
  kw = _layer_kw(variant)
  batches = [_x((2, 16, 64), 10 + i, jnp.bfloat16) * (i + 1) for i in range(3)]
  linen = te_flax.TransformerLayer(recipe=DELAYED, **kw)
  variables = linen.init(jax.random.key(0), batches[0], deterministic=True)
  assert _state_owners(variables[FP8]) == GEMMS[variant]
  args, nnx_kw = _nnx_args(kw)
  model = te_nnx.TransformerLayer(*args, recipe=DELAYED, rngs=nnx.Rngs(1), **nnx_kw)
  te_nnx.from_linen(model, variables)
  _assert_trees_equal(te_nnx.to_linen(model), variables)
  want, got = _train_both(linen, variables, model, batches, {"deterministic": True})
  for a, b in zip(got, want):
    _assert_trees_equal(a, b)
  assert float(jnp.max(jax.tree.leaves(want[2][FP8])[0])) > 0  # the state moved


def test_multi_head_attention_recipe_reaches_every_projection():
  """linen MultiHeadAttention(recipe=...) as NNX's: the state of each projection, none under current scaling."""
  kw = dict(num_gqa_groups=2, dtype=jnp.bfloat16, backend="unfused")
  x = _x((2, 16, 64), 3, jnp.bfloat16)
  linen = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=4, recipe=DELAYED, **kw)
  variables = linen.init(jax.random.key(0), x, deterministic=True)
  assert _state_owners(variables[FP8]) == {("query",), ("kv",), ("out",)}
  model = te_nnx.MultiHeadAttention(64, 16, 4, recipe=DELAYED, rngs=nnx.Rngs(0), **kw)
  te_nnx.from_linen(model, variables)
  y, _ = linen.apply(variables, x, deterministic=True, mutable=[FP8])
  _assert_trees_equal(model(x, deterministic=True), y)
  with te_jax.autocast(enabled=True, recipe=DELAYED):
    assert FP8 not in linen.clone(recipe=Float8CurrentScaling()).init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(ValueError, match="recipe must be"):
    linen.clone(recipe="delayed").init(jax.random.key(0), x, deterministic=True)


def test_the_modules_recipe_decides_fp8_attention(monkeypatch):
  """With fp8_dpa=None, the layer's recipe (not autocast's) says whether attention runs in FP8, where the
  configuration allows it (here: every configuration, the support check stubbed)."""
  monkeypatch.setattr(fused_attention, "attention_backend", lambda *a, **k: None)
  q = jax.ShapeDtypeStruct((1, 16, 2, 16), jnp.bfloat16)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
    assert fp8_dpa_enabled(None, q, q, q, recipe=None)
    assert not fp8_dpa_enabled(None, q, q, q, recipe=Float8CurrentScaling())
    assert not fp8_dpa_enabled(False, q, q, q, recipe=DelayedScaling(fp8_dpa=True))
  assert fp8_dpa_enabled(None, q, q, q, recipe=Float8CurrentScaling(fp8_dpa=True))
  assert not fp8_dpa_enabled(None, q, q, q, recipe=None)


# ---- RelativePositionBiases ----------------------------------------------------------------------------------------

# (num_buckets, max_distance, heads, q, k, bidirectional, q_offset, dtype) -> sha256 prefix of the table initialized
# from key 0, recorded with the implementation before its math moved to te_jax.modules.
RECORDED = {
    (32, 128, 3, 5, 7, True, None, "float32"): "09c3d8788aa3a27dbc6b384b",
    (32, 128, 3, 5, 7, True, None, "bfloat16"): "09c3d8788aa3a27dbc6b384b",
    (32, 128, 3, 7, 5, False, None, "float32"): "09c3d8788aa3a27dbc6b384b",
    (32, 128, 3, 7, 5, False, None, "bfloat16"): "09c3d8788aa3a27dbc6b384b",
    (16, 64, 2, 1, 9, True, None, "float32"): "ef5c5f3e90689c91cf758c12",
    (16, 64, 2, 1, 9, True, None, "bfloat16"): "ef5c5f3e90689c91cf758c12",
    (8, 20, 4, 9, 1, True, None, "float32"): "c840c4dfdb554efefa0fb6ec",
    (8, 20, 4, 9, 1, True, None, "bfloat16"): "c840c4dfdb554efefa0fb6ec",
    (32, 128, 2, 40, 300, True, None, "float32"): "13d52cdf51f38bd6e1d212fd",
    (32, 128, 2, 40, 300, True, None, "bfloat16"): "13d52cdf51f38bd6e1d212fd",
    (32, 128, 2, 3, 12, False, 4, "float32"): "13d52cdf51f38bd6e1d212fd",
    (32, 128, 2, 3, 12, False, 4, "bfloat16"): "13d52cdf51f38bd6e1d212fd",
    (32, 128, 2, 1, 12, True, 11, "float32"): "13d52cdf51f38bd6e1d212fd",
    (32, 128, 2, 1, 12, True, 11, "bfloat16"): "13d52cdf51f38bd6e1d212fd",
    (4, 5, 1, 6, 6, False, 0, "float32"): "47384b5135571979cfdf2160",
    (4, 5, 1, 6, 6, False, 0, "bfloat16"): "47384b5135571979cfdf2160",
}


def _sha(x) -> str:
  return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:24]


@pytest.mark.parametrize("case", _fast_only(sorted(RECORDED, key=str), {c for c in RECORDED if c[-1] == "float32"},
                                           ids=str))
@pytest.mark.fast_cases(2)
def test_relative_position_biases_are_bitwise_as_recorded_and_nnx_equals_linen(case):
  """linen's RelativePositionBiases: the same parameter (name, shape, dtype, initial values) as before, and the bias
  of a table gathered bit for bit; the NNX twin loaded with the linen table gives the same bias and table gradient,
  bit for bit."""
  nb, md, heads, q, k, bi, offset, dtype = case
  init_hash = RECORDED[case]
  linen = te_flax.RelativePositionBiases(nb, md, heads, dtype=jnp.dtype(dtype))
  variables = linen.init(jax.random.key(0), q, k, bidirectional=bi)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), variables) == {"params": {"rel_embedding": ((heads, nb),
                                                                                                jnp.float32)}}
  assert _sha(variables["params"]["rel_embedding"]) == init_hash
  # A table from numpy, so that its bits do not depend on XLA's flags; the bias gathers it, so it must come out as
  # table[h, bucket(k - q)] exactly (float32; bfloat16 is its rounding).
  table = jnp.asarray(np.random.default_rng(1).standard_normal((heads, nb)).astype(np.float32) * 3)
  checkpoint = {"params": {"rel_embedding": table}}

  def linen_bias(v):
    return linen.apply(v, q, k, bidirectional=bi, q_offset=offset)

  bias = (jax.jit(linen_bias) if offset is not None else linen_bias)(checkpoint)
  assert bias.shape == (1, heads, q, k) and bias.dtype == jnp.dtype(dtype)
  relative = np.arange(k)[None, :] - (np.arange(q)[:, None] + (offset or 0))
  buckets = linen.bucket(relative, bidirectional=bi, num_buckets=nb, max_distance=md)
  want_bias = np.asarray(table)[:, buckets][None].astype(jnp.dtype(dtype))
  np.testing.assert_array_equal(np.asarray(bias), want_bias)

  model = te_nnx.RelativePositionBiases(nb, md, heads, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(5))
  te_nnx.from_linen(model, checkpoint)
  _assert_trees_equal(te_nnx.to_linen(model), checkpoint)
  nnx_bias = nnx.jit(lambda m: m(q, k, bidirectional=bi, q_offset=offset))(model)
  _assert_trees_equal(nnx_bias, bias)
  w = _x(bias.shape, 2)
  want = jax.grad(lambda v: jnp.sum(linen_bias(v).astype(jnp.float32) * w))(checkpoint)["params"]
  got = nnx.grad(lambda m: jnp.sum(m(q, k, bidirectional=bi, q_offset=offset).astype(jnp.float32) * w))(model)
  _assert_trees_equal(nnx.to_pure_dict(got), want)
  np.testing.assert_array_equal(model.bucket(np.arange(-40, 41), bidirectional=bi, num_buckets=nb, max_distance=md),
                                linen.bucket(np.arange(-40, 41), bidirectional=bi, num_buckets=nb, max_distance=md))


def test_nnx_relative_position_biases_arguments():
  with nnx.use_eager_sharding(False):  # names only: no mesh here to place the parameters on
    rpb = te_nnx.RelativePositionBiases(32, 128, 2, embedding_axes=("heads", None), rngs=nnx.Rngs(0))
    layer = te_nnx.TransformerLayer(32, 64, 2, enable_relative_embedding=True, logical_axes=True, rngs=nnx.Rngs(0))
  assert rpb.rel_embedding.get_metadata()["out_sharding"] == ("heads", None)
  specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
  assert tuple(specs["relpos_bias"]["rel_embedding"].get_value()) == ("heads", None)
  with pytest.raises(ValueError, match="num_buckets must be >= 4"):
    te_nnx.RelativePositionBiases(2, 128, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_distance"):
    te_nnx.RelativePositionBiases(32, 8, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_attention_heads"):
    te_nnx.RelativePositionBiases(32, 128, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="positive ints"):
    rpb(0, 4)
  with pytest.raises(ValueError, match="q_seqlen=5 must be at most k_seqlen=4"):
    rpb(5, 4, q_offset=0)
  with pytest.raises(ValueError, match="self_attn_bias_type='alibi'"):
    te_nnx.TransformerLayer(32, 64, 2, enable_relative_embedding=True, self_attn_bias_type="alibi", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layer_type", _fast_only(["encoder", "decoder"], {"decoder"}))
def test_relative_embedding_layer_converts_and_trains_as_linen(layer_type):
  """NNX TransformerLayer(enable_relative_embedding=True): linen's parameter tree (``relpos_bias/rel_embedding``),
  carried by from_linen / to_linen, and three train steps bit for bit as linen's (bidirectional in an encoder)."""
  kw = dict(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type=layer_type,
            enable_relative_embedding=True, relative_embedding_buckets=16, relative_embedding_max_distance=20,
            dtype=jnp.float32, backend="unfused")
  batches = [_x((2, 6, 32), 20 + i) for i in range(3)]
  linen = te_flax.TransformerLayer(**kw)
  variables = linen.init(jax.random.key(0), batches[0], deterministic=True)
  args, nnx_kw = _nnx_args(kw)
  model = te_nnx.TransformerLayer(*args, rngs=nnx.Rngs(3), **nnx_kw)
  assert model.relpos_bias.rel_embedding.shape == (2, 16)
  assert jax.tree.map(jnp.shape, te_nnx.to_linen(model)) == jax.tree.map(jnp.shape, variables)
  te_nnx.from_linen(model, variables)
  _assert_trees_equal(te_nnx.to_linen(model), variables)
  _assert_trees_equal(model(batches[0], deterministic=True), linen.apply(variables, batches[0], deterministic=True))
  want, got = _train_both(linen, variables, model, batches, {"deterministic": True})
  for a, b in zip(got, want):
    _assert_trees_equal(a, b)
  assert float(jnp.abs(want[1][0]["relpos_bias"]["rel_embedding"]).sum()) > 0


# ---- the KV cache --------------------------------------------------------------------------------------------------

DECODE_VARIANTS = {"plain": {}, "rope": {"enable_rotary_pos_emb": True},
                   "relative": {"enable_relative_embedding": True}, "window": {"window_size": (2, 0)},
                   "alibi": {"self_attn_bias_type": "alibi"},
                   "sequence-first": {"transpose_batch_sequence": True, "enable_rotary_pos_emb": True}}
CHUNKS = (3, 1, 1, 2, 1, 1)  # a prompt of 3 tokens, then 1 or 2 at a time: 9 positions


def _chunks(x, seq_axis):
  out, i = [], 0
  for n in CHUNKS:
    out.append(jax.lax.slice_in_dim(x, i, i + n, axis=seq_axis))
    i += n
  return out


def _linen_decode(module, params, x, seq_axis, *args, **kw):
  cache = module.init(jax.random.key(0), x, *args, decode=True, **kw)["cache"]
  outs = []
  for chunk in _chunks(x, seq_axis) + [jax.lax.slice_in_dim(x, 0, 1, axis=seq_axis)]:  # the last past the end
    y, mut = module.apply({"params": params, "cache": cache}, chunk, *args, decode=True, mutable=["cache"], **kw)
    cache = mut["cache"]
    outs.append(y)
  return outs, cache


def _nnx_decode(model, x, seq_axis, *args, jit=False, **kw):
  model.init_cache(x.shape)
  call = nnx.jit(lambda m, c: m(c, *args, **kw)) if jit else (lambda m, c: m(c, *args, **kw))
  return [call(model, chunk) for chunk in _chunks(x, seq_axis) + [jax.lax.slice_in_dim(x, 0, 1, axis=seq_axis)]]


@pytest.mark.parametrize("variant", _fast_only(sorted(DECODE_VARIANTS), {"plain", "rope"}))
def test_nnx_decoding_equals_linen_and_the_full_forward(variant):
  """A decoder layer decoded step by step: NNX's outputs are linen's bit for bit, and the full causal forward's
  within the linen decode tests' tolerance; a step past the cache's end is NaN in both."""
  kw = dict(hidden_size=32, intermediate_dim=64, num_attention_heads=4, num_gqa_groups=2, layer_type="decoder",
            dtype=jnp.float32, backend="unfused", **DECODE_VARIANTS[variant])
  seq_axis = 0 if kw.get("transpose_batch_sequence") else 1
  x = _x((9, 2, 32) if seq_axis == 0 else (2, 9, 32), 8)
  linen = te_flax.TransformerLayer(**kw)
  variables = linen.init(jax.random.key(9), x, deterministic=True)
  full = linen.apply(variables, x, deterministic=True)
  want, cache = _linen_decode(linen, variables["params"], x, seq_axis, deterministic=True)
  args, nnx_kw = _nnx_args(kw)
  model = te_nnx.TransformerLayer(*args, decode=True, rngs=nnx.Rngs(0), **nnx_kw)
  te_nnx.from_linen(model, variables)
  got = _nnx_decode(model, x, seq_axis, deterministic=True, jit=variant == "rope")
  _assert_trees_equal(got, want)
  np.testing.assert_allclose(jnp.concatenate(got[:-1], seq_axis), full, rtol=2e-5, atol=2e-5)
  assert np.all(np.isnan(got[-1]))
  assert int(model.self_attention.cache_index[...]) == int(cache["self_attention"]["cache_index"]) == 10
  _assert_trees_equal({k: getattr(model.self_attention, k)[...] for k in ("cached_key", "cached_value")},
                      {k: cache["self_attention"][k] for k in ("cached_key", "cached_value")})
  # init_cache empties the cache: decoding again gives the same outputs; decode=False is the full forward.
  _assert_trees_equal(_nnx_decode(model, x, seq_axis, deterministic=True), want)
  _assert_trees_equal(model(x, deterministic=True, decode=False), full)


@pytest.mark.parametrize("convention", _fast_only(["flax", "te"], {"te"}))
def test_nnx_multi_head_attention_decodes_as_linen_with_a_key_padding_mask(convention):
  """MultiHeadAttention alone (GQA, RoPE, a keys-only padding mask in either convention); bfloat16 compute over a
  float32 cache (init_cache's dtype) reads back the same keys, so the outputs are still linen's bit for bit."""
  kw = dict(num_gqa_groups=2, enable_rotary_pos_emb=True, attn_mask_type="padding_causal", dtype=jnp.bfloat16,
            backend="unfused", mask_convention=convention)
  x = _x((2, 9, 64), 4, jnp.bfloat16)
  keys = jnp.ones((2, 1, 1, 9), bool).at[1, :, :, 6:].set(False)
  mask = keys if convention == "flax" else ~keys
  linen = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=4, **kw)
  variables = linen.init(jax.random.key(0), x, None, mask, deterministic=True)
  want, _ = _linen_decode(linen, variables["params"], x, 1, None, mask, deterministic=True)
  model = te_nnx.MultiHeadAttention(64, 16, 4, rngs=nnx.Rngs(0), **kw)
  te_nnx.from_linen(model, variables)
  model.init_cache(x.shape, dtype=jnp.float32)
  assert model.cached_key.shape == (2, 9, 2, 16) and model.cached_key.dtype == jnp.float32
  got = [model(chunk, None, mask, decode=True, deterministic=True) for chunk in _chunks(x, 1)]
  _assert_trees_equal(got, want[:-1])
  stored = model.cached_key[...]
  _assert_trees_equal(stored, stored.astype(jnp.bfloat16).astype(jnp.float32))  # the bfloat16 keys, exactly


def test_decode_misuse_raises_naming_the_argument():
  x = _x((2, 9, 32))
  mha = te_nnx.MultiHeadAttention(32, 8, 4, decode=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"decode=True needs the KV cache.*call init_cache\(input_shape\)"):
    mha(x)
  layer = te_nnx.TransformerLayer(32, 64, 4, layer_type="decoder", enable_relative_embedding=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"decode=True needs the KV cache.*init_cache"):
    layer(x, decode=True)
  mha.init_cache((2, 4, 32))
  with pytest.raises(ValueError, match=r"inputs_q gives keys \(2, 9, 4, 8\) that do not fit the KV cache "
                                       r"\(2, 4, 4, 8\).*max_length=4"):
    mha(x)
  with pytest.raises(ValueError, match="inputs_q .*the batch must be the cache's"):
    mha(x[:1, :2])
  layer.init_cache((2, 4, 32))
  with pytest.raises(ValueError, match="decode: inputs gives keys"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="input_shape must be"):
    mha.init_cache((2, 4, 16))
  with pytest.raises(ValueError, match="input_shape must be"):
    mha.init_cache((2, 32))
  with pytest.raises(ValueError, match="segment_ids"):
    mha(x[:, :2], segment_ids=jnp.ones((2, 2), jnp.int32))
  with pytest.raises(TypeError, match="decode must be a bool"):
    mha(x[:, :2], decode="yes")
  with pytest.raises(ValueError, match="decode=True .* is for self attention"):
    te_nnx.MultiHeadAttention(32, 8, 4, attention_type="cross", decode=True, rngs=nnx.Rngs(0))
  cross = te_nnx.MultiHeadAttention(32, 8, 4, attention_type="cross", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="attention_type='self'"):
    cross.init_cache((2, 4, 32))
  with pytest.raises(ValueError, match="decode: context_parallel attention does not support a KV cache"):
    te_nnx.MultiHeadAttention(32, 8, 4, context_parallel="data", decode=True, rngs=nnx.Rngs(0))
  # linen's check is the shared one: a call longer than its cache names the argument too.
  linen = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=4)
  cache = linen.init(jax.random.key(0), x[:, :4], decode=True, deterministic=True)
  with pytest.raises(ValueError, match="decode: inputs_q gives keys"):
    linen.apply(cache, x, decode=True, deterministic=True, mutable=["cache"])
