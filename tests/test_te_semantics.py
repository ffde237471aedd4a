"""Transformer Engine's layer options under their TE meaning: ``TransformerLayer(output_layernorm=True)`` (one norm on
the layer's output in place of the self attention's input norm), te_jax's post-LN under its own name
(``post_layernorm``) and ``scale_attn_logits=False``; attention's ``pre_scale_bias``, ``softmax_type`` ("off_by_one",
"learnable" with its ``softmax_offset`` parameter), RoPE and windows in cross attention, "padding_causal_bottom_right"
aligned per sequence and a right window with a causal mask; each against a numpy reference in float64 and float32
(CONTRIBUTING.md's tolerance rule; gradients against the same reference in jnp), linen against NNX bit for bit, and
the invalid combinations raising."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
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


# ---- attention: pre-scale bias, softmax types, cross-attention RoPE and windows, per-sequence bottom right --------


def _softmax_ref(xp, z, masked, sink):
  """The attention softmax over the last axis, keys where ``masked`` out; ``sink``: the extra logit of the
  "off_by_one" / "learnable" types in the denominator (None: vanilla); a row with every key masked gives 0."""
  z = xp.where(masked, -xp.inf, z)
  m = z.max(-1, keepdims=True)
  if sink is not None:
    m = xp.maximum(m, sink)
  m = xp.where(xp.isfinite(m), m, 0.0)
  e = xp.where(masked, 0.0, xp.exp(z - m))
  den = e.sum(-1, keepdims=True) + (0.0 if sink is None else xp.exp(sink - m))
  return e / xp.where(den > 0, den, 1.0)


def _attention_ref(xp, q, k, v, *, scale, bias=None, pre=False, masked=None, sink=None):
  """BSHD attention, as many key/value heads as query heads; ``bias`` added before the scale with ``pre``."""
  logits = xp.einsum("bthd,bshd->bhts", q, k)
  if bias is not None and pre:
    z = (logits + bias) * scale
  else:
    z = logits * scale + (0.0 if bias is None else bias)
  masked = xp.zeros(z.shape, bool) if masked is None else xp.broadcast_to(masked, z.shape)
  return xp.einsum("bhts,bshd->bthd", _softmax_ref(xp, z, masked, sink), v)


def _qkv(seed, t=5, s=7, heads=2, d=8):
  return random_normal(seed, (2, t, heads, d)), random_normal(seed + 1, (2, s, heads, d)), random_normal(
      seed + 2, (2, s, heads, d))


def _check_np(ours, ref, *args, what):
  assert_within_rule(ours, ref(*_np(args, np.float32)), ref(*_np(args, np.float64)), what)


def test_pre_scale_bias_is_added_before_the_scale():
  q, k, v = _qkv(10)
  bias = random_normal(13, (1, 2, 5, 7))
  ours = te_jax.dot_product_attention(q, k, v, bias, attn_bias_type="pre_scale_bias", scale_factor=0.3,
                                      backend="unfused")
  _check_np(ours, lambda q, k, v, b: _attention_ref(np, q, k, v, scale=q.dtype.type(0.3), bias=b, pre=True),
            q, k, v, bias, what="pre_scale_bias")
  cot = random_normal(14, ours.shape)
  grad = jax.grad(lambda b: jnp.sum(te_jax.dot_product_attention(
      q, k, v, b, attn_bias_type="pre_scale_bias", scale_factor=0.3, backend="unfused") * cot))(bias)
  want = jax.grad(lambda b: jnp.sum(_attention_ref(jnp, q, k, v, scale=0.3, bias=b, pre=True) * cot))(bias)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)


def _sink_mask():
  """(2, 1, 5, 7), True = masked out: padding, and every key of batch 0's query 4 (a fully masked row)."""
  m = np.zeros((2, 1, 5, 7), bool)
  m[0, :, :, 5:] = True
  m[0, :, 4, :] = True
  m[1, :, :, 6:] = True
  return m


@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
def test_softmax_types_add_a_sink_to_the_denominator(softmax_type):
  q, k, v = _qkv(20)
  masked = _sink_mask()
  offset = random_normal(23, (1, 2, 1, 1)) if softmax_type == "learnable" else None
  kw = dict(attn_mask_type="arbitrary", mask_convention="te", softmax_type=softmax_type, backend="unfused")

  def ours(q, k, v, offset):
    return te_jax.dot_product_attention(q, k, v, mask=jnp.asarray(masked), softmax_offset=offset, **kw)

  out = ours(q, k, v, offset)
  sink = np.zeros((1, 1, 1, 1)) if offset is None else offset
  _check_np(out, lambda q, k, v, a: _attention_ref(np, q, k, v, scale=q.dtype.type(1 / np.sqrt(8)), masked=masked,
                                                   sink=a), q, k, v, sink, what=softmax_type)
  np.testing.assert_array_equal(np.asarray(out)[0, 4], 0.0)  # a fully masked row: 0, the sink takes it all
  vanilla = te_jax.dot_product_attention(q, k, v, mask=jnp.asarray(masked), **{**kw, "softmax_type": "vanilla"})
  assert np.max(np.abs(np.asarray(out - vanilla))) > 1e-3  # the sink changes the result
  cot = random_normal(24, out.shape)
  argnums = (0, 1, 2, 3) if offset is not None else (0, 1, 2)
  got = jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=argnums)(q, k, v, offset)
  want = jax.grad(lambda q, k, v, a: jnp.sum(_attention_ref(jnp, q, k, v, scale=1 / np.sqrt(8), masked=masked,
                                                            sink=a if offset is not None else jnp.zeros(()))
                                             * cot), argnums=argnums)(q, k, v, offset)
  for name, a, b in zip(("dq", "dk", "dv", "dsoftmax_offset"), got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=name)


def test_learnable_softmax_offset_is_te_jaxs_parameter_linen_and_nnx():
  q, k, v = _qkv(30)
  attn = te_flax.DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type="no_mask",
                                     softmax_type="learnable", backend="unfused")
  variables = attn.init(jax.random.key(0), q, k, v, deterministic=True)
  offset = variables["params"]["softmax_offset"]
  assert offset.shape == (1, 2, 1, 1) and offset.dtype == jnp.float32 and not np.any(np.asarray(offset))
  model = te_nnx.DotProductAttention(8, 2, attn_mask_type="no_mask", softmax_type="learnable", backend="unfused",
                                     rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(model.softmax_offset[...], offset)
  trained = jnp.asarray([[[[0.5]], [[-1.0]]]], jnp.float32)
  model.softmax_offset[...] = trained
  linen = attn.apply({"params": {"softmax_offset": trained}}, q, k, v, deterministic=True)
  np.testing.assert_array_equal(np.asarray(model(q, k, v)), np.asarray(linen))
  with pytest.raises(ValueError, match="give rngs"):
    te_nnx.DotProductAttention(8, 2, softmax_type="learnable")
  mha = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=2, softmax_type="off_by_one")
  assert "attention" not in mha.init(jax.random.key(0), jnp.ones((1, 3, 16)), deterministic=True)["params"]
  with pytest.raises(ValueError, match="softmax_type must be one of"):
    te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=2, softmax_type="off-by-two").init(
        jax.random.key(0), jnp.ones((1, 3, 16)), deterministic=True)


def _rope_ref(xp, x, positions, base=10000.0):
  """Half-split RoPE of (B, S, H, D) at ``positions`` (S,)."""
  half = x.shape[-1] // 2
  inv = base ** (-np.arange(half) * 2.0 / x.shape[-1])
  angle = np.asarray(positions, np.float64)[:, None] * inv[None, :]
  c, s = (xp.asarray(f(angle), x.dtype)[None, :, None, :] for f in (np.cos, np.sin))
  x1, x2 = x[..., :half], x[..., half:]
  return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def test_cross_attention_rope_and_window():
  """Cross attention with q_len != kv_len: the queries rotate at arange(T), the keys at arange(S) of their own
  sequence (they once took the queries' positions), and a sliding window bounds the keys as in self attention."""
  x, enc = random_normal(40, (2, 5, 16)), random_normal(41, (2, 7, 16))
  kw = dict(head_dim=8, num_attention_heads=2, input_layernorm=False, attn_mask_type="no_mask",
            enable_rotary_pos_emb=True, window_size=(1, 2), dtype=jnp.float32, backend="unfused")
  mha = te_flax.MultiHeadAttention(**kw)
  variables = mha.init(jax.random.key(4), x, enc, deterministic=True)
  p = variables["params"]

  def ref(x, enc, wq, wkv, wo):
    f = x.dtype.type
    q = _rope_ref(np, np.einsum("bth,hnd->btnd", x, wq), np.arange(5))
    kv = np.einsum("bsh,hncd->bsncd", enc, wkv)
    k, v = _rope_ref(np, kv[..., 0, :], np.arange(7)), kv[..., 1, :]
    rel = np.arange(7)[None, :] - np.arange(5)[:, None]
    out = _attention_ref(np, q, k, v, scale=f(1 / np.sqrt(8)), masked=(rel < -1) | (rel > 2))
    return np.einsum("btnd,ndh->bth", out, wo)

  ours = mha.apply(variables, x, enc, deterministic=True)
  _check_np(ours, ref, x, enc, p["query"]["kernel"], p["kv"]["kernel"], p["out"]["kernel"], what="cross RoPE")
  model = te_nnx.MultiHeadAttention(16, attention_type="cross", rngs=nnx.Rngs(4), **kw)
  for name in ("query", "kv", "out"):
    getattr(model, name).kernel[...] = p[name]["kernel"]
  np.testing.assert_array_equal(np.asarray(model(x, enc)), np.asarray(ours))


def test_transformer_layer_cross_attention_takes_the_layers_rope_window_and_softmax():
  layer = _layer(layer_type="decoder", enable_rotary_pos_emb=True, window_size=(2, 0), softmax_type="learnable")
  x, enc = random_normal(50, (2, 4, H)), random_normal(51, (2, 6, H))
  p = layer.init(jax.random.key(5), x, enc, deterministic=True)["params"]
  for name in ("self_attention", "encoder_decoder_attention"):
    assert p[name]["attention"]["softmax_offset"].shape == (1, HEADS, 1, 1), name
  from te_jax.flax.scope import options_of  # noqa: PLC0415 - the layer's options, as its body reads them
  from te_jax.modules.transformer import TransformerLayerOptions  # noqa: PLC0415
  cross = options_of(layer, TransformerLayerOptions).attention(cross=True)
  assert cross.enable_rotary_pos_emb and cross.window_size == (2, 0) and cross.softmax_type == "learnable"


def _te_bottom_right_mask(q_ids, kv_ids, left=-1):
  """Transformer Engine's padding_causal_bottom_right, True = attend: within a segment of t queries and s keys,
  query p_q sees key p_kv when p_kv - p_q <= s - t (and >= s - t - left with a window), positions within it."""
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  out = np.zeros((b, t, s), bool)
  for n in range(b):
    for i in range(t):
      for j in range(s):
        seg = q_ids[n, i]
        if seg == 0 or kv_ids[n, j] != seg:
          continue
        p_q, p_kv = i - list(q_ids[n]).index(seg), j - list(kv_ids[n]).index(seg)
        shift = int(np.sum(kv_ids[n] == seg)) - int(np.sum(q_ids[n] == seg))
        out[n, i, j] = p_kv - p_q <= shift and (left < 0 or p_kv - p_q >= shift - left)
  return out


@pytest.mark.parametrize("window", [None, (1, 0)])
def test_padding_causal_bottom_right_is_aligned_per_sequence(window):
  q_ids = np.asarray([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]], np.int32)
  kv_ids = np.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
  q, k, v = _qkv(60, t=6, s=8)
  segs = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  mask = te_jax.make_attention_mask(q, k, v, segment_ids=segs, attn_mask_type="padding_causal_bottom_right",
                                    window_size=window)
  want = _te_bottom_right_mask(q_ids, kv_ids, -1 if window is None else window[0])
  np.testing.assert_array_equal(np.asarray(mask)[:, 0], want)
  # The same sequences as a padding mask (one per row, from position 0): their lengths read off the mask.
  pad = (q_ids[1] != 0)[:, None] & (kv_ids[1] != 0)[None, :]
  ours = te_jax.dot_product_attention(q[1:], k[1:], v[1:], mask=jnp.asarray(pad)[None, None],
                                      attn_mask_type="padding_causal_bottom_right", window_size=window,
                                      backend="unfused")
  _check_np(ours, lambda q, k, v: _attention_ref(np, q, k, v, scale=q.dtype.type(1 / np.sqrt(8)),
                                                 masked=~want[1:, None]), q[1:], k[1:], v[1:], what="per sequence")


def test_window_right_side_with_a_causal_mask_is_accepted():
  """Transformer Engine accepts any right window with a causal mask type: the causal mask bounds that side."""
  q, k, v = _qkv(70, t=6, s=6)
  run = lambda w: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=w, backend="unfused")
  np.testing.assert_array_equal(np.asarray(run((2, 3))), np.asarray(run((2, 0))))


# ---- layer options: drop_path, hidden_dropout_dims ----------------------------------------------------------------


def _pre_ln_branches_ref(p, x, m1, m2):
  """The pre-LN layer with its two residual branches multiplied by ``m1`` (attention) and ``m2`` (MLP)."""
  a = p["self_attention"]
  y = x + m1 * _attention(a, _ln(x, a["qkv"]["ln_scale"], a["qkv"]["ln_bias"]), True)
  m = p["mlp"]
  h = _gelu(np.einsum("bsh,hf->bsf", _ln(y, m["ln_scale"], m["ln_bias"]), m["wi_kernel"][:, 0, :]))
  return y + m2 * (h @ m["wo_kernel"])


def _branch_masks(ours, p, x, keep, shape):
  """For each element of ``shape`` (the examples, or one for the whole batch), which (m1, m2) of {0, keep}^2 the
  output is (checked against the reference within the tolerance rule); the pairs found."""
  found = []
  for idx in np.ndindex(*shape):
    sel = (slice(None),) if shape == () else idx
    errs = {}
    for m1 in (0.0, keep):
      for m2 in (0.0, keep):
        ref = _pre_ln_branches_ref(_np(p, np.float64), np.asarray(x, np.float64), m1, m2)
        errs[(m1, m2)] = np.max(np.abs(np.asarray(ours, np.float64)[sel] - ref[sel]))
    best = min(errs, key=errs.get)
    assert errs[best] < 1e-4 < min(e for k, e in errs.items() if k != best), (idx, errs)
    found.append(best)
  return found


def test_drop_path_drops_whole_branches_per_example():
  layer = _layer(drop_path=0.5)
  x = random_normal(80, (16, 3, H))
  v = layer.init(jax.random.key(8), x, deterministic=True)
  plain = _layer().apply(v, x, deterministic=True)
  np.testing.assert_array_equal(np.asarray(layer.apply(v, x, deterministic=True)), np.asarray(plain))
  ours = layer.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(9)})
  found = [pair for b in range(16) for pair in _branch_masks(ours[b:b + 1], v["params"], x[b:b + 1], 2.0, ())]
  assert {m1 for m1, _ in found} == {0.0, 2.0} and {m2 for _, m2 in found} == {0.0, 2.0}, found
  model = te_nnx.TransformerLayer(H, F, HEADS, drop_path=0.5, dtype=jnp.float32, backend="unfused",
                                  rngs=nnx.Rngs(0, dropout=1))
  out, params = model(x, deterministic=False), nnx.to_pure_dict(nnx.state(model, nnx.Param))
  found = [pair for b in range(16) for pair in _branch_masks(out[b:b + 1], params, x[b:b + 1], 2.0, ())]
  assert {m1 for m1, _ in found} == {0.0, 2.0} and {m2 for _, m2 in found} == {0.0, 2.0}, found


def test_hidden_dropout_dims_share_the_mask():
  """With every dim broadcast, each hidden dropout draws one value for the whole stream."""
  layer = _layer(hidden_dropout=0.5, hidden_dropout_dims=(0, 1, -1))
  x = random_normal(81, (2, 3, H))
  v = layer.init(jax.random.key(10), x, deterministic=True)
  for seed in range(3):
    ours = layer.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(seed)})
    _branch_masks(ours, v["params"], x, 2.0, ())
  with pytest.raises(ValueError, match="hidden_dropout_dims must be"):
    _layer(hidden_dropout_dims=(3,)).init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(ValueError, match="drop_path must be"):
    _layer(drop_path=1.0).init(jax.random.key(0), x, deterministic=True)
