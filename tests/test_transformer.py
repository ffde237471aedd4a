"""MultiHeadAttention, RelativePositionBiases and TransformerLayer against plain jnp references with the same
parameters (float32: tight; FP8: within quantization), the KV cache against the full forward, training with FP8
state, argument errors, and on the GPU the fused path (cuDNN attention, FP8 GEMMs, fused norms) against the CPU."""

import doctest
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from te_jax.recipe import DelayedScaling, Float8CurrentScaling
from conftest import random_normal, rel_error


# ---- plain jnp reference layer --------------------------------------------------------------------------------------


def _ln(x, scale, bias, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _rope_ref(x, positions, base=10000.0):
  """Half-split RoPE as a complex rotation: the pair (x_i, x_{i + D/2}) times exp(1j * position * base^(-2i/D))."""
  d = x.shape[-1]
  inv = base ** (-np.arange(0, d, 2) / d)
  rot = jnp.asarray(np.exp(1j * np.asarray(positions, np.float64)[:, None] * inv[None, :]), jnp.complex64)
  z = jax.lax.complex(x[..., : d // 2], x[..., d // 2:]) * rot[None, :, None, :]
  return jnp.concatenate([jnp.real(z), jnp.imag(z)], -1)


def _attention_ref(q, k, v, causal: bool, mask=None, bias=None):
  """``mask``: the caller's, in Flax's convention (True = attend)."""
  h, hk = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  if bias is not None:
    logits = logits + bias
  t, s = logits.shape[-2:]
  masked = np.zeros((t, s), bool)
  if causal:
    masked = np.triu(np.ones((t, s), bool), 1)
  masked = jnp.asarray(masked)[None, None] if mask is None else jnp.logical_or(masked, jnp.logical_not(mask))
  logits = jnp.where(masked, -jnp.inf, logits)
  p = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _mha_ref(p, x, heads, kv_heads, *, causal=True, rope=False, ln=True, kv=None, mask=None, bias=None):
  """The module's parameter layout: one (hidden, H, 3, D) "qkv" kernel for self attention without GQA, else a
  "query" (hidden, H, D) and a "kv" (hidden, Hk, 2, D) kernel (the input norm's parameters sit with the first)."""
  first = p["qkv"] if "qkv" in p else p["query"]
  xn = _ln(x, first["ln_scale"], first["ln_bias"]) if ln else x
  if "qkv" in p:
    qkv = jnp.einsum("bsh,hncd->bsncd", xn, p["qkv"]["kernel"])
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  else:
    q = jnp.einsum("bsh,hnd->bsnd", xn, p["query"]["kernel"])
    kvp = jnp.einsum("bsh,hncd->bsncd", xn if kv is None else kv, p["kv"]["kernel"])
    k, v = kvp[..., 0, :], kvp[..., 1, :]
  if rope:
    pos = np.arange(x.shape[1])
    q, k = _rope_ref(q, pos), _rope_ref(k, pos)
  o = _attention_ref(q, k, v, causal, mask, bias)
  return jnp.einsum("bsnd,ndh->bsh", o, p["out"]["kernel"])


def _layer_ref(p, x, heads, kv_heads, *, rope=False):
  """Pre-LN GPT layer, gelu (tanh form) MLP, no biases."""
  x = x + _mha_ref(p["self_attention"], x, heads, kv_heads, rope=rope)
  m = p["mlp"]
  z = _ln(x, m["ln_scale"], m["ln_bias"])
  h = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", z, m["wi_kernel"][:, 0, :]), approximate=True)
  return x + h @ m["wo_kernel"]


def _x(shape, seed=0, dtype=jnp.float32):
  return random_normal(seed, shape, dtype)


def test_docstring_examples():
  import te_jax.flax.transformer as module  # noqa: PLC0415

  result = doctest.testmod(module)
  assert result.attempted > 0 and result.failed == 0, result


# ---- float32: tight agreement ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.fast_cases(2)
def test_layer_matches_reference_float32(kv_heads, rope):
  layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4,
                                   num_gqa_groups=kv_heads, layer_type="decoder", enable_rotary_pos_emb=rope,
                                   dtype=jnp.float32, backend="unfused")
  x = _x((2, 12, 64))
  v = layer.init(jax.random.key(1), x, deterministic=True)
  ours = layer.apply(v, x, deterministic=True)
  ref = _layer_ref(v["params"], x, 4, kv_heads, rope=rope)
  assert rel_error(ours, ref) < 1e-5
  g = jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) ** 2))(v)["params"]
  g_ref = jax.grad(lambda p: jnp.sum(_layer_ref(p, x, 4, kv_heads, rope=rope) ** 2))(v["params"])
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert rel_error(a, b) < 1e-4


def _norm_ref(x, prm, rms: bool, zero_centered: bool, eps=1e-6):
  scale = prm["ln_scale"] + 1.0 if zero_centered else prm["ln_scale"]
  if rms:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale
  return _ln(x, scale, prm["ln_bias"], eps)


def _options_layer_ref(p, x, *, post_residual, use_bias, gated, rms, zero_centered):
  """Pre-LN decoder layer (causal, 4 heads, fused QKV) with the options of test_layer_options_match_reference."""
  norm = functools.partial(_norm_ref, rms=rms, zero_centered=zero_centered)
  a, m = p["self_attention"], p["mlp"]
  z = norm(x, a["qkv"])
  qkv = jnp.einsum("bsh,hncd->bsncd", z, a["qkv"]["kernel"]) + (a["qkv"]["bias"] if use_bias else 0.0)
  o = _attention_ref(qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :], causal=True)
  y = jnp.einsum("bsnd,ndh->bsh", o, a["out"]["kernel"]) + (a["out"]["bias"] if use_bias else 0.0)
  x = y + (z if post_residual else x)
  z = norm(x, m)
  h = jnp.einsum("bsh,hnf->bsnf", z, m["wi_kernel"]) + (m["wi_bias"] if use_bias else 0.0)
  act = jax.nn.silu(h[..., 0, :]) * h[..., 1, :] if gated else jax.nn.gelu(h[..., 0, :], approximate=True)
  y = act @ m["wo_kernel"] + (m["wo_bias"] if use_bias else 0.0)
  return y + (z if post_residual else x)


@pytest.mark.parametrize("options", [
    dict(post_residual=True, use_bias=False, gated=False, rms=False, zero_centered=False),
    dict(post_residual=False, use_bias=True, gated=True, rms=False, zero_centered=False),
    dict(post_residual=False, use_bias=False, gated=False, rms=True, zero_centered=True),
    dict(post_residual=True, use_bias=True, gated=True, rms=True, zero_centered=True),
], ids=["post-residual", "bias-swiglu", "rmsnorm-zero-centered", "all"])
@pytest.mark.fast_cases(1)
def test_layer_options_match_reference(options):
  """Residuals after the norm (both blocks, as Megatron and Transformer Engine define it), biases, SwiGLU, RMSNorm
  and zero-centered gamma against the jnp reference, values and gradients."""
  layer = te_flax.TransformerLayer(
      hidden_size=32, intermediate_dim=64, num_attention_heads=4, layer_type="decoder",
      apply_residual_connection_post_layernorm=options["post_residual"], use_bias=options["use_bias"],
      activation_type=("silu", "linear") if options["gated"] else ("gelu",),
      norm_type="rmsnorm" if options["rms"] else "layernorm", zero_centered_gamma=options["zero_centered"],
      dtype=jnp.float32, backend="unfused")
  x = _x((2, 7, 32), 30)
  v = layer.init(jax.random.key(31), x, deterministic=True)
  # Random biases and norm parameters (their initializers give zeros and ones), so that each one counts.
  leaves, tree = jax.tree.flatten(v["params"])
  keys = jax.random.split(jax.random.key(32), len(leaves))
  v = {"params": jax.tree.unflatten(tree, [l + 0.1 * random_normal(k, l.shape) for l, k in zip(leaves, keys)])}
  ref = functools.partial(_options_layer_ref, **options)
  assert rel_error(layer.apply(v, x, deterministic=True), ref(v["params"], x)) < 1e-5
  g = jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) ** 2))(v)["params"]
  g_ref = jax.grad(lambda p: jnp.sum(ref(p, x) ** 2))(v["params"])
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert rel_error(a, b) < 1e-4


def test_post_norm_residuals_with_cross_attention_match_reference():
  """apply_residual_connection_post_layernorm in a decoder layer: self attention, cross attention and MLP each add
  their own normalized input."""
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4, layer_type="decoder",
                                   apply_residual_connection_post_layernorm=True, dtype=jnp.float32,
                                   backend="unfused")
  x, encoded = _x((2, 6, 32), 33), _x((2, 5, 32), 34)
  v = layer.init(jax.random.key(35), x, encoded, deterministic=True)

  def ref(p, x):
    sa, ca, m = p["self_attention"], p["encoder_decoder_attention"], p["mlp"]
    x = _mha_ref(sa, x, 4, 4) + _ln(x, sa["qkv"]["ln_scale"], sa["qkv"]["ln_bias"])
    x = _mha_ref(ca, x, 4, 4, causal=False, kv=encoded) + _ln(x, ca["query"]["ln_scale"], ca["query"]["ln_bias"])
    z = _ln(x, m["ln_scale"], m["ln_bias"])
    return jax.nn.gelu(z @ m["wi_kernel"][:, 0, :], approximate=True) @ m["wo_kernel"] + z

  assert rel_error(layer.apply(v, x, encoded, deterministic=True), ref(v["params"], x)) < 1e-5


def test_cross_attention_and_padding_mask_match_reference():
  mha = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="padding",
                                   dtype=jnp.float32, backend="unfused")
  x, enc = _x((2, 6, 32), 1), _x((2, 10, 32), 2)
  mask = jnp.ones((2, 1, 6, 10), bool).at[1, :, :, 7:].set(False)  # batch 1: keys 7.. are padding
  v = mha.init(jax.random.key(3), x, enc, mask, deterministic=True)
  assert sorted(v["params"]) == ["kv", "out", "query"]
  ours = mha.apply(v, x, enc, mask, deterministic=True)
  ref = _mha_ref(v["params"], x, 4, 2, causal=False, kv=enc, mask=mask)
  assert rel_error(ours, ref) < 1e-5


def test_post_ln_layer_matches_reference():
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2, post_layernorm=True,
                                   layer_type="encoder", dtype=jnp.float32, backend="unfused")
  x = _x((2, 5, 32), 4)
  v = layer.init(jax.random.key(5), x, deterministic=True)
  p = v["params"]
  assert sorted(p) == ["mlp_layernorm", "self_attention", "self_attention_layernorm", "wi", "wo"]
  h = _ln(x + _mha_ref(p["self_attention"], x, 2, 2, causal=False, ln=False),
          p["self_attention_layernorm"]["scale"], p["self_attention_layernorm"]["bias"])
  m = jax.nn.gelu(jnp.einsum("bsh,hf->bsf", h, p["wi"]["kernel"][:, 0, :]), approximate=True) @ p["wo"]["kernel"]
  ref = _ln(h + m, p["mlp_layernorm"]["scale"], p["mlp_layernorm"]["bias"])
  assert rel_error(layer.apply(v, x, deterministic=True), ref) < 1e-5


def test_transpose_batch_sequence_is_the_same_layer():
  kw = dict(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type="decoder", dtype=jnp.float32,
            backend="unfused", enable_rotary_pos_emb=True)
  x = _x((2, 7, 32), 6)
  v = te_flax.TransformerLayer(**kw).init(jax.random.key(7), x, deterministic=True)
  a = te_flax.TransformerLayer(**kw).apply(v, x, deterministic=True)
  b = te_flax.TransformerLayer(transpose_batch_sequence=True, **kw).apply(v, jnp.swapaxes(x, 0, 1),
                                                                         deterministic=True)
  np.testing.assert_allclose(a, jnp.swapaxes(b, 0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"enable_rotary_pos_emb": True}, {"enable_relative_embedding": True},
                                {"window_size": (2, 0)}, {"self_attn_bias_type": "alibi"}],
                         ids=["plain", "rope", "relative-bias", "window", "alibi"])
@pytest.mark.fast_cases(2)
def test_kv_cache_decoding_matches_the_full_forward(kw):
  """Each feature that depends on the queries' positions (RoPE, relative biases, the sliding window, ALiBi) sees
  them at the cache index when decoding."""
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4, num_gqa_groups=2,
                                   layer_type="decoder", dtype=jnp.float32, backend="unfused", **kw)
  x = _x((2, 9, 32), 8)
  v = layer.init(jax.random.key(9), x, deterministic=True)
  full = layer.apply(v, x, deterministic=True)
  cache = layer.init(jax.random.key(9), x, deterministic=True, decode=True)["cache"]
  outs = []
  for chunk in [x[:, :3]] + [x[:, i:i + 1] for i in range(3, 9)]:  # a prompt of 3 tokens, then one at a time
    y, mut = layer.apply({"params": v["params"], "cache": cache}, chunk, deterministic=True, decode=True,
                         mutable=["cache"])
    cache = mut["cache"]
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)
  assert int(cache["self_attention"]["cache_index"]) == 9
  # The cache is full: a further step cannot be stored, and says so.
  y, _ = layer.apply({"params": v["params"], "cache": cache}, x[:, :1], deterministic=True, decode=True,
                     mutable=["cache"])
  assert np.all(np.isnan(y))


def test_encoder_decoder_layer_decodes_like_the_full_forward():
  """A decoder layer with cross attention over an encoder output whose padding is a keys-only (B, 1, 1, S) mask."""
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4, layer_type="decoder",
                                   enable_relative_embedding=True, dtype=jnp.float32, backend="unfused")
  x, encoded = _x((2, 9, 32), 20), _x((2, 7, 32), 21)
  enc_mask = jnp.ones((2, 1, 1, 7), bool).at[1, :, :, 5:].set(False)  # example 1: 2 padded encoder positions
  v = layer.init(jax.random.key(22), x, encoded, None, enc_mask, deterministic=True)
  full = layer.apply(v, x, encoded, None, enc_mask, deterministic=True)
  cache = layer.init(jax.random.key(22), x, encoded, None, enc_mask, deterministic=True, decode=True)["cache"]
  outs, i = [], 0
  for steps in (3, 1, 2, 1, 1, 1):
    y, mut = layer.apply({**v, "cache": cache}, x[:, i:i + steps], encoded, None, enc_mask, deterministic=True,
                         decode=True, mutable=["cache"])
    cache, i = mut["cache"], i + steps
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)


def test_relative_position_biases_buckets():
  """T5's bucketing, checked against a direct per-pair evaluation of its definition."""
  rpb = te_flax.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=2)
  rel = np.arange(-300, 301)[None, :]
  got = rpb.bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)[0]
  for r, b in zip(rel[0], got):
    n = -r
    half = 16
    base = half if n < 0 else 0
    n = abs(n)
    exact = n if n < 8 else min(half - 1, 8 + int(np.log(n / 8) / np.log(128 / 8) * 8))
    assert b == base + exact, (r, b, base + exact)



@pytest.mark.parametrize("q, k, bidirectional", [(5, 7, True), (7, 5, False), (1, 9, True), (9, 1, True),
                                                 (1, 1, False), (40, 300, True)])
def test_relative_position_biases_values_and_gradient(q, k, bidirectional):
  """The bias is the table entry of each pair's bucket, exactly; the table's gradient sums each bucket's pairs."""
  rpb = te_flax.RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=3)
  bias, v = rpb.init_with_output(jax.random.key(0), q, k, bidirectional=bidirectional)
  table = np.asarray(v["params"]["rel_embedding"])
  ids = rpb.bucket(np.arange(k)[None] - np.arange(q)[:, None], bidirectional=bidirectional, num_buckets=32,
                   max_distance=128)
  assert bias.shape == (1, 3, q, k)
  np.testing.assert_array_equal(bias[0], table[:, ids])
  # Queries at an offset (decoding with a KV cache of k keys): the rows of the full (k, k) bias there.
  if q <= k:
    full = rpb.apply(v, k, k, bidirectional=bidirectional)
    for offset in {0, (k - q) // 2, k - q}:
      np.testing.assert_array_equal(
          jax.jit(lambda o: rpb.apply(v, q, k, bidirectional=bidirectional, q_offset=o))(offset),
          full[:, :, offset:offset + q])
  w = np.asarray(random_normal(1, (1, 3, q, k)), np.float64)
  grad = jax.grad(lambda v: jnp.sum(rpb.apply(v, q, k, bidirectional=bidirectional) * w))(v)
  want = np.einsum("hqk,qkb->hb", w[0], np.eye(32)[ids])
  np.testing.assert_allclose(grad["params"]["rel_embedding"], want, rtol=1e-5, atol=1e-5 * np.abs(w).sum() / 32)
  with pytest.raises(ValueError, match="positive ints"):
    rpb.apply(v, 0, k)


def test_relative_embedding_layer_runs_with_bias():
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2,
                                   enable_relative_embedding=True, dtype=jnp.float32, backend="unfused")
  x = _x((2, 6, 32), 10)
  v = layer.init(jax.random.key(11), x, deterministic=True)
  assert v["params"]["relpos_bias"]["rel_embedding"].shape == (2, 32)
  g = jax.grad(lambda v: jnp.sum(layer.apply(v, x, deterministic=True) ** 2))(v)
  assert float(jnp.abs(g["params"]["relpos_bias"]["rel_embedding"]).sum()) > 0


def test_dropout_needs_rng_and_is_deterministic_given_it():
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2, hidden_dropout=0.2,
                                   attention_dropout=0.1, dtype=jnp.float32, backend="unfused")
  x = _x((2, 6, 32), 12)
  v = layer.init(jax.random.key(13), x, deterministic=True)
  a = layer.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  b = layer.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  c = layer.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  np.testing.assert_allclose(layer.apply(v, x, deterministic=True), layer.apply(v, x, deterministic=True))
  # As in Flax: the module's attribute or the call's argument, not both; with dropout, one of them is needed.
  train = layer.clone(deterministic=False)
  np.testing.assert_array_equal(train.apply(v, x, rngs={"dropout": jax.random.key(1)}), a)
  with pytest.raises(ValueError, match="has dropout .*pass deterministic=True"):
    layer.apply(v, x, rngs={"dropout": jax.random.key(1)})
  with pytest.raises(ValueError, match="deterministic"):
    train.apply(v, x, deterministic=True)


def test_argument_errors():
  x = _x((2, 6, 32))
  with pytest.raises(ValueError, match="layer_type"):
    te_flax.TransformerLayer(hidden_size=32, num_attention_heads=2, layer_type="bogus").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="num_gqa_groups"):
    te_flax.TransformerLayer(hidden_size=32, num_attention_heads=4, num_gqa_groups=3).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="num_attention_heads"):
    te_flax.TransformerLayer(hidden_size=30, num_attention_heads=4).init(jax.random.key(0), _x((2, 6, 30)))
  with pytest.raises(ValueError, match="encoded"):
    te_flax.TransformerLayer(hidden_size=32, num_attention_heads=2).init(jax.random.key(0), x, x)
  mha = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=2)
  with pytest.raises(ValueError, match="decode"):
    mha.init(jax.random.key(0), x, _x((2, 3, 32)), decode=True)
  with pytest.raises(ValueError, match="rotary_percent"):
    te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=2, enable_rotary_pos_emb=True,
                               rotary_percent=0.0).init(jax.random.key(0), x)
  # hidden_size names the input's width: a different one is an error, not a silently different head_dim.
  with pytest.raises(ValueError, match="hidden_size=16"):
    te_flax.TransformerLayer(hidden_size=16, num_attention_heads=2).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="3-D"):
    te_flax.TransformerLayer(hidden_size=32, num_attention_heads=2).init(jax.random.key(0), x[0])
  with pytest.raises(ValueError, match="inputs_q must be 3-D"):
    mha.init(jax.random.key(0), x[0])
  with pytest.raises(ValueError, match="hidden_dropout"):
    te_flax.TransformerLayer(hidden_size=32, num_attention_heads=2, hidden_dropout=1.0).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="attention_dropout"):
    te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=2, attention_dropout=-0.1).init(
        jax.random.key(0), x, deterministic=True)


# ---- FP8 -------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # multi-step training
@pytest.mark.parametrize("rec", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_layer_trains_close_to_high_precision(rec):
  layer = te_flax.TransformerLayer(hidden_size=64, intermediate_dim=128, num_attention_heads=4, num_gqa_groups=2,
                                   layer_type="decoder", enable_rotary_pos_emb=True, dtype=jnp.bfloat16,
                                   backend="unfused")
  x = _x((4, 16, 64), 14, jnp.bfloat16)
  y = _x((4, 16, 64), 15)

  def run(recipe):
    with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
      v = layer.init(jax.random.key(16), x, deterministic=True)
      state = train_state.TrainState.create(apply_fn=layer.apply, params=v, tx=optax.adam(3e-3))

      @jax.jit
      def step(state):
        def loss_fn(v):
          return jnp.mean((state.apply_fn(v, x, deterministic=True).astype(jnp.float32) - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=g), loss

      losses = []
      for _ in range(30):
        state, loss = step(state)
        losses.append(float(loss))
    return state, losses

  _, ref = run(None)
  state, fp8 = run(rec)
  assert fp8[-1] < 0.5 * fp8[0]
  assert abs(fp8[-1] - ref[-1]) / ref[-1] < 0.1, (fp8[-1], ref[-1])  # a 64-wide toy fit: FP8 noise is visible
  if not isinstance(rec, DelayedScaling):  # current scaling keeps no state
    assert te_jax.FP8_COLLECTION not in state.params
    return
  meta = state.params[te_jax.FP8_COLLECTION]
  names = {"/".join(str(getattr(k, "key", k)) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(meta)}
  for module in ("self_attention/query", "self_attention/kv", "self_attention/out", "mlp"):
    assert any(n.startswith(module) for n in names), (module, sorted(names))


class _Stack(nn.Module):
  """Layers of a decoder stack, each wrapped in ``nn.remat`` (activation checkpointing) when ``policy`` is given."""

  policy: object = None
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    cls = te_flax.TransformerLayer if self.policy is None else nn.remat(te_flax.TransformerLayer, policy=self.policy)
    for i in range(self.layers):
      x = cls(hidden_size=64, intermediate_dim=256, num_attention_heads=4, layer_type="decoder",
              self_attn_mask_type="causal", dtype=jnp.float32, backend="unfused", hidden_dropout=0.0,
              attention_dropout=0.0, name=f"layer_{i}")(x)
    return x


@pytest.mark.slow  # three-layer stacks, nine compiles
@pytest.mark.parametrize("rec", [None, DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["fp32", "delayed", "current"])
def test_remat_layers_give_the_same_step_in_less_memory(rec):
  """nn.remat around each layer (recomputing its forward in the backward, everything or only the GEMM outputs
  saved): the same gradients and FP8 state updates bit for bit (the recomputed forward uses the same scales), and
  less compiled temp memory with nothing saved."""
  x = _x((8, 128, 64), 30)
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    v = _Stack().init(jax.random.key(31), x)
    results = {}
    for name, policy in (("plain", None), ("nothing saved", jax.checkpoint_policies.nothing_saveable),
                         ("dots saved", jax.checkpoint_policies.dots_saveable)):
      grad = jax.jit(jax.grad(lambda v, x, m=_Stack(policy=policy): jnp.sum(m.apply(v, x) ** 2)))
      compiled = grad.lower(v, x).compile()
      results[name] = (compiled(v, x), compiled.memory_analysis().temp_size_in_bytes)
  g_plain, temp_plain = results["plain"]
  for name in ("nothing saved", "dots saved"):
    g, _ = results[name]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_plain), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=f"{name}: {jax.tree_util.keystr(path)}")
  assert results["nothing saved"][1] < 0.7 * temp_plain, (results["nothing saved"][1], temp_plain)


# ---- GPU -------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_fp8_layer_runs_fused_kernels_and_matches_cpu(gpu):
  """The GPT layer under FP8 on the GPU: cuDNN attention, FP8 GEMMs and the fused norm/activation kernels in the
  compiled program; its loss and gradients against the CPU path (the same FP8 numerics, the reference GEMM and
  attention) within FP8 rounding flips."""
  cpu = jax.devices("cpu")[0]
  kw = dict(hidden_size=256, intermediate_dim=1024, num_attention_heads=4, layer_type="decoder", dtype=jnp.bfloat16)
  layer = te_flax.TransformerLayer(**kw)
  # "auto" picks the attention backend from jax's default backend (the GPU here): the CPU copy asks for unfused.
  cpu_layer = te_flax.TransformerLayer(backend="unfused", **kw)
  x = _x((2, 128, 256), 17, jnp.bfloat16)
  rec = Float8CurrentScaling()
  with te_jax.autocast(enabled=True, recipe=rec):
    v = layer.init(jax.random.key(18), x, deterministic=True)

    def loss(v, x, layer=layer):
      return jnp.mean(layer.apply(v, x, deterministic=True).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss))
    grad_cpu = jax.jit(jax.value_and_grad(lambda v, x: loss(v, x, cpu_layer)))
    on_gpu = jax.device_put((v, x), gpu)
    hlo = grad.lower(*on_gpu).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    for t in ("te_gemm_cuda", "te_norm_fwd_cuda", "te_norm_bwd_cuda", "te_act_fwd_cuda", "te_act_bwd_cuda"):
      assert t in targets, (t, sorted(targets))
    assert any(t.startswith("__cudnn$fmha") for t in targets), sorted(targets)
    l_gpu, g_gpu = grad(*on_gpu)
    l_cpu, g_cpu = grad_cpu(*jax.device_put((v, x), cpu))
  assert abs(float(l_gpu) - float(l_cpu)) / float(l_cpu) < 2e-2
  for a, b in zip(jax.tree.leaves(g_gpu["params"]), jax.tree.leaves(g_cpu["params"])):
    assert rel_error(a, b) < 0.15


@pytest.mark.gpu
def test_gpu_bf16_layer_matches_reference(gpu):
  layer = te_flax.TransformerLayer(hidden_size=256, intermediate_dim=512, num_attention_heads=2, num_gqa_groups=1,
                                   layer_type="decoder", enable_rotary_pos_emb=True, dtype=jnp.bfloat16)
  x = jax.device_put(_x((2, 128, 256), 19, jnp.bfloat16), gpu)
  v = layer.init(jax.random.key(20), x, deterministic=True)
  ours = jax.jit(lambda v, x: layer.apply(v, x, deterministic=True))(v, x)
  ref = _layer_ref(jax.device_get(v["params"]), np.asarray(x, np.float32), 2, 1, rope=True)
  assert rel_error(ours, ref) < 2e-2


# ---- FP8 attention through the recipe --------------------------------------------------------------------------------


def test_recipe_fp8_dpa_is_validated():
  with pytest.raises(ValueError, match="fp8_dpa"):
    DelayedScaling(fp8_dpa=1)
  with pytest.raises(ValueError, match="fp8_dpa"):
    Float8CurrentScaling(fp8_dpa="yes")


def test_recipe_fp8_dpa_routes_attention_where_supported(monkeypatch):
  """With ``fp8_dpa`` the attention modules take the FP8 path where ``dot_product_attention(fp8_dpa=True)`` accepts the
  configuration, and stay in high precision where it does not (here: no cuDNN FP8 on a CPU)."""
  import te_jax.fused.attention as attention_mod  # noqa: PLC0415

  mha = te_flax.MultiHeadAttention(head_dim=16, num_attention_heads=2, dtype=jnp.bfloat16)
  x = _x((2, 8, 32), 21, jnp.bfloat16)
  v = mha.init(jax.random.key(22), x, deterministic=True)

  def apply(rec):
    with te_jax.autocast(enabled=True, recipe=rec):
      return np.asarray(mha.apply(v, x, deterministic=True), np.float32)

  plain = apply(Float8CurrentScaling())
  np.testing.assert_array_equal(apply(Float8CurrentScaling(fp8_dpa=True)), plain)  # not available here
  calls = []

  def fake_fp8(q, k, v, cfg):
    calls.append(cfg.fp8_dpa)
    return jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)

  monkeypatch.setattr(attention_mod, "fp8_unsupported", lambda cfg: None)
  monkeypatch.setattr(attention_mod, "fp8_attention", fake_fp8)
  np.testing.assert_array_equal(apply(Float8CurrentScaling(fp8_dpa=True)), 0.0)  # the FP8 path ran
  assert calls == [True]
  assert np.abs(apply(Float8CurrentScaling())).max() > 0  # without fp8_dpa it does not
  dpa = te_flax.DotProductAttention(head_dim=16, num_attention_heads=2)
  q = _x((2, 8, 2, 16), 23, jnp.bfloat16)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(fp8_dpa=True)):
    assert dpa.backend_for(q, q, q).name == "fused" and "FP8" in dpa.backend_for(q, q, q).reason
    out = dpa.apply({}, q, q, q, deterministic=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


# ---- sharding --------------------------------------------------------------------------------------------------------


def _assert_same_step(y, grads, y_ref, grads_ref, fp8: bool):
  """Sharded against one device: float32 within summation-order rounding. Under FP8 the sharded sums (psum, reduce
  order) differ in the last float32 bits too, and an E5M2 gradient cast flips by a quarter of an element's value where
  such a difference crosses a rounding boundary: a few elements of a gradient move by ~1%, ~1e-5 in norm. A wrong
  scale or a per-shard amax moves whole tensors (>= 1e-2 in norm)."""
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    if fp8:
      assert rel_error(a, b) < 1e-3, rel_error(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 8-device parallel layer
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_data_parallel_layer_matches_one_device(fp8):
  """The layer's train-step gradients under jit with the batch sharded over 8 devices equal the unsharded ones, the
  output keeps the batch sharding, and no activation is all-gathered (only parameter gradients are reduced)."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type="decoder",
                                   enable_rotary_pos_emb=True, dtype=jnp.float32, backend="unfused")
  x = _x((8, 16, 32), 24)
  rec = Float8CurrentScaling() if fp8 else None
  with te_jax.autocast(enabled=fp8, recipe=rec):
    v = layer.init(jax.random.key(25), x, deterministic=True)

    @jax.jit
    def step(v, x):
      y, vjp = jax.vjp(lambda v, x: layer.apply(v, x, deterministic=True), v, x)
      return y, vjp(jnp.ones_like(y))[0]

    y1, g1 = step(v, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    vs = jax.device_put(v, NamedSharding(mesh, P()))
    hlo = step.lower(vs, xs).compile().as_text()
    y8, g8 = step(vs, xs)
  assert y8.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), y8.ndim)
  gathered = [l for l in hlo.splitlines() if "all-gather" in l and "f32[8,16" in l]
  assert not gathered, gathered[:2]
  _assert_same_step(y8, g8, y1, g1, fp8)


@pytest.mark.slow  # 8-device parallel layer
@pytest.mark.parametrize("fsdp", [False, True], ids=["tp", "tp+fsdp"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_tensor_parallel_layer_matches_one_device(fp8, fsdp):
  """Heads and the MLP's intermediate dim sharded over a "model" axis (logical axis rules), the batch over "data":
  the same output and gradients as one device, and no all-gather at all (every shard keeps whole heads of q, k and v,
  the output projections end in all-reduces). With FSDP the parameters' hidden axis is sharded over "data" too, and
  the weights are all-gathered where they are used."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "model"))
  rules = (("embed", "data" if fsdp else None), ("heads", "model"), ("kv", None), ("qkv", None), ("mlp", "model"),
           ("act", None))
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4, layer_type="decoder",
                                   enable_rotary_pos_emb=True, dtype=jnp.float32, backend="unfused",
                                   logical_axes=True)
  x = _x((4, 16, 32), 26)
  rec = Float8CurrentScaling() if fp8 else None
  with te_jax.autocast(enabled=fp8, recipe=rec):
    boxed = layer.init(jax.random.key(27), x, deterministic=True)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    v = nn.meta.unbox(boxed)
    embed = "data" if fsdp else None
    assert shardings["params"]["self_attention"]["qkv"]["kernel"].spec == P(embed, "model", None, None)
    assert shardings["params"]["mlp"]["wo_kernel"].spec == P("model", embed)

    @jax.jit
    def step(v, x):
      y, vjp = jax.vjp(lambda v, x: layer.apply(v, x, deterministic=True), v, x)
      return y, vjp(jnp.ones_like(y))[0]

    y1, g1 = step(v, x)
    vs, xs = jax.device_put(v, shardings), jax.device_put(x, NamedSharding(mesh, P("data")))
    hlo = step.lower(vs, xs).compile().as_text()
    y8, g8 = step(vs, xs)
  if not fsdp:  # (with FSDP the weights are all-gathered for use, by design)
    assert " all-gather(" not in hlo and " all-gather-start(" not in hlo
  assert " all-reduce(" in hlo or " all-reduce-start(" in hlo
  _assert_same_step(y8, g8, y1, g1, fp8)


@pytest.mark.slow  # 8-device parallel layer
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_sequence_parallel_layer_matches_one_device(fp8):
  """The residual stream's sequence axis mapped to the tensor-parallel mesh axis as well (sequence parallelism): the
  same output and gradients as one device, and the output stays (batch, sequence)-sharded."""
  from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "model"))
  rules = (("batch", "data"), ("seq", "model"), ("act_embed", None), ("embed", None), ("heads", "model"),
           ("kv", None), ("qkv", None), ("mlp", "model"), ("act", None))
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4, layer_type="decoder",
                                   enable_rotary_pos_emb=True, dtype=jnp.float32, backend="unfused",
                                   logical_axes=True)
  x = _x((4, 16, 32), 28)
  rec = Float8CurrentScaling() if fp8 else None

  def step(v, x):
    y, vjp = jax.vjp(lambda v, x: layer.apply(v, x, deterministic=True), v, x)
    return y, vjp(jnp.ones_like(y))[0]

  with te_jax.autocast(enabled=fp8, recipe=rec):
    boxed = layer.init(jax.random.key(29), x, deterministic=True)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    v = nn.meta.unbox(boxed)
    y1, g1 = jax.jit(step)(v, x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      y8, g8 = jax.jit(step)(jax.device_put(v, shardings), jax.device_put(x, NamedSharding(mesh, P("data", "model"))))
  assert y8.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), y8.ndim), y8.sharding
  _assert_same_step(y8, g8, y1, g1, fp8)


class _ScanBody(nn.Module):
  """One decoder layer as nn.scan's body: (carry, x) -> (carry, y), the layer's output the carry."""

  @nn.compact
  def __call__(self, x, _):
    layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type="decoder",
                                     enable_rotary_pos_emb=True, hidden_dropout=0.1, dtype=jnp.bfloat16,
                                     backend="unfused", name="layer")
    return layer(x, deterministic=False), None


class _ScannedStack(nn.Module):
  """Three layers through nn.scan, each with its own parameters, FP8 state and dropout key."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_ScanBody, variable_axes={"params": 0, te_jax.FP8_COLLECTION: 0},
                    split_rngs={"params": True, "dropout": True}, length=3)
    return stack(name="layers")(x, None)[0]


@pytest.mark.slow  # multi-step training
def test_scanned_layer_stack_trains_with_fp8_state_per_layer():
  """The usual way to stack layers, nn.scan over the layer: parameters and FP8 state stacked per layer, trained."""
  x = _x((4, 16, 32), 30, jnp.bfloat16)
  y = _x((4, 16, 32), 31)
  model = _ScannedStack()
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    v = model.init({"params": jax.random.key(32), "dropout": jax.random.key(33)}, x)
    leaves = jax.tree.leaves(v[te_jax.FP8_COLLECTION])
    assert leaves and all(leaf.shape[0] == 3 for leaf in leaves)  # one state per layer
    state = train_state.TrainState.create(apply_fn=model.apply, params=v, tx=optax.adam(3e-3))

    @jax.jit
    def step(state, key):
      def loss_fn(v):
        out = state.apply_fn(v, x, rngs={"dropout": key})
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)

      loss, g = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=g), loss

    losses = []
    for i in range(20):
      state, loss = step(state, jax.random.key(i))
      losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses
  fp8 = state.params[te_jax.FP8_COLLECTION]
  scales = [np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(fp8)
            if jax.tree_util.keystr(path).endswith("x_scale']")]
  assert scales and all(s.shape == (3,) and np.all(s != 1.0) for s in scales)  # every layer's scales moved


@pytest.mark.slow  # a scanned three-layer stack
def test_calibrate_fills_every_scanned_layers_state():
  """``te_flax.calibrate`` through nn.scan: each layer's every history gets one amax (element 0, the rest zero) and
  the scale fp8_max / amax, layer by layer, and the parameters come back as they were."""
  x = _x((4, 16, 32), 30, jnp.bfloat16)
  model = _ScannedStack()

  def loss_fn(v, x):
    return jnp.mean(model.apply(v, x, rngs={"dropout": jax.random.key(1)}).astype(jnp.float32) ** 2)

  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    v = model.init({"params": jax.random.key(32), "dropout": jax.random.key(33)}, x)
    calibrated = te_flax.calibrate(loss_fn, v, x)
  for a, b in zip(jax.tree.leaves(calibrated["params"]), jax.tree.leaves(v["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  state = {jax.tree_util.keystr(p): np.asarray(leaf, np.float32)
           for p, leaf in jax.tree_util.tree_leaves_with_path(calibrated[te_jax.FP8_COLLECTION])}
  histories = [k for k in state if k.endswith("_amax_history']")]
  assert len(histories) >= 12, sorted(state)  # q/k/v + out, fc1, fc2: x, kernel and grad of each
  for k in histories:
    h = state[k]
    assert h.shape == (3, 4) and np.all(h[:, 0] > 0) and not np.any(h[:, 1:]), (k, h)
    fmt = jnp.float8_e5m2 if k.endswith("grad_amax_history']") else jnp.float8_e4m3fn
    scale = state[k.replace("_amax_history']", "_scale']")]
    np.testing.assert_allclose(scale, float(jnp.finfo(fmt).max) / h[:, 0], rtol=1e-6, err_msg=k)
