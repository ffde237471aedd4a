"""Transformer Engine's layer options under their TE meaning: ``TransformerLayer(output_layernorm=True)`` (one norm on
the layer's output in place of the self attention's input norm), te_jax's post-LN under its own name
(``post_layernorm``) and ``scale_attn_logits=False``; each against a numpy reference in float64
and float32 (CONTRIBUTING.md's tolerance rule), linen against NNX bit for bit, and the invalid combinations raising."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from conftest import assert_within_rule, random_normal

H, F, HEADS = 32, 64, 2


def _np(tree, dtype):
  return jax.tree.map(lambda a: np.asarray(a, dtype), tree)


def _ln(x, scale, bias, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + x.dtype.type(eps)) * scale + bias


def _gelu(x):
  c = x.dtype.type(np.sqrt(2.0 / np.pi))
  return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x ** 3)))


def _attention(p, x, scale: bool):
  """Self attention over the fused (hidden, H, 3, D) kernel, no mask, no norm (``p`` the ``self_attention``
  parameters)."""
  qkv = np.einsum("bsh,hncd->bsncd", x, p["qkv"]["kernel"])
  q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
  logits = np.einsum("btnd,bsnd->bnts", q, k)
  if scale:
    logits = logits / x.dtype.type(np.sqrt(q.shape[-1]))
  logits = logits - logits.max(-1, keepdims=True)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  return np.einsum("btnd,ndh->bth", np.einsum("bnts,bsnd->btnd", probs, v), p["out"]["kernel"])


def _output_layernorm_ref(p, x, scale: bool = True):
  """TE's output_layernorm: y = x + Attn(x); LN_out(y + MLP(LN(y)))."""
  y = x + _attention(p["self_attention"], x, scale)
  m = p["mlp"]
  h = _gelu(np.einsum("bsh,hf->bsf", _ln(y, m["ln_scale"], m["ln_bias"]), m["wi_kernel"][:, 0, :]))
  z = y + h @ m["wo_kernel"]
  return _ln(z, p["output_layernorm"]["scale"], p["output_layernorm"]["bias"])


def _pre_ln_ref(p, x, scale: bool):
  a = p["self_attention"]
  y = x + _attention(a, _ln(x, a["qkv"]["ln_scale"], a["qkv"]["ln_bias"]), scale)
  m = p["mlp"]
  h = _gelu(np.einsum("bsh,hf->bsf", _ln(y, m["ln_scale"], m["ln_bias"]), m["wi_kernel"][:, 0, :]))
  return y + h @ m["wo_kernel"]


def _layer(**kw):
  kw = {"layer_type": "encoder", **kw}
  return te_flax.TransformerLayer(hidden_size=H, intermediate_dim=F, num_attention_heads=HEADS, dtype=jnp.float32,
                                  backend="unfused", **kw)


def _check(ours, ref, params, x, what):
  assert_within_rule(ours, ref(_np(params, np.float32), np.asarray(x, np.float32)),
                     ref(_np(params, np.float64), np.asarray(x, np.float64)), what)


def test_output_layernorm_is_transformer_engines():
  layer = _layer(output_layernorm=True)
  x = random_normal(0, (2, 6, H))
  v = layer.init(jax.random.key(0), x, deterministic=True)
  p = v["params"]
  assert sorted(p) == ["mlp", "output_layernorm", "self_attention"]
  assert sorted(p["self_attention"]["qkv"]) == ["kernel"]  # no input norm before the self attention
  _check(layer.apply(v, x, deterministic=True), _output_layernorm_ref, p, x, "output_layernorm")


@pytest.mark.slow
def test_output_layernorm_decoder_keeps_the_cross_attention_norm():
  layer = _layer(output_layernorm=True, layer_type="decoder")
  x, enc = random_normal(1, (2, 6, H)), random_normal(2, (2, 5, H))
  p = layer.init(jax.random.key(1), x, enc, deterministic=True)["params"]
  assert sorted(p) == ["encoder_decoder_attention", "mlp", "output_layernorm", "self_attention"]
  assert "ln_scale" in p["encoder_decoder_attention"]["query"]
  assert "ln_scale" not in p["self_attention"]["qkv"]


def test_post_layernorm_is_te_jaxs_former_post_ln():
  p = _layer(post_layernorm=True).init(jax.random.key(2), random_normal(3, (2, 4, H)), deterministic=True)["params"]
  assert sorted(p) == ["mlp_layernorm", "self_attention", "self_attention_layernorm", "wi", "wo"]


@pytest.mark.slow
def test_scale_attn_logits_false_leaves_the_logits_unscaled():
  layer = _layer(scale_attn_logits=False)
  x = random_normal(4, (2, 6, H))
  v = layer.init(jax.random.key(3), x, deterministic=True)
  _check(layer.apply(v, x, deterministic=True), lambda p, x: _pre_ln_ref(p, x, False), v["params"], x,
         "scale_attn_logits=False")


@pytest.mark.slow
def test_output_layernorm_linen_and_nnx_agree_bit_for_bit():
  kw = dict(output_layernorm=True, scale_attn_logits=False, dtype=jnp.float32, backend="unfused")
  x = random_normal(5, (2, 6, H))
  model = te_nnx.TransformerLayer(H, F, HEADS, rngs=nnx.Rngs(0), **kw)
  linen = te_flax.TransformerLayer(hidden_size=H, intermediate_dim=F, num_attention_heads=HEADS, **kw)
  variables = te_nnx.to_linen(model)
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(linen.apply(variables, x, deterministic=True)))


@pytest.mark.parametrize("kw, words", [
    (dict(output_layernorm=True, post_layernorm=True), "two architectures"),
    (dict(output_layernorm=True, apply_residual_connection_post_layernorm=True), "output_layernorm=True"),
    (dict(post_layernorm=True, apply_residual_connection_post_layernorm=True), "post_layernorm=True"),
])
def test_layer_options_that_exclude_each_other_raise(kw, words):
  with pytest.raises(ValueError, match=words):
    _layer(**kw).init(jax.random.key(0), jnp.ones((1, 2, H)), deterministic=True)


def test_scale_attn_logits_false_with_a_scale_factor_raises():
  mha = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=2, scale_attn_logits=False, scale_factor=0.5)
  with pytest.raises(ValueError, match="scale_attn_logits=False"):
    mha.init(jax.random.key(0), jnp.ones((1, 2, 16)), deterministic=True)
