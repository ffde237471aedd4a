"""Attention masks mean what they mean in Flax (True, or nonzero, = attend) unless Transformer Engine's convention
(True = masked out) is asked for by name with ``mask_convention="te"``.

- ``te_jax.dot_product_attention`` with a float32 mask of ``nn.make_attention_mask`` and with the same mask as bool
  against ``jax.nn.dot_product_attention``; ``padding``, ``padding_causal`` and ``arbitrary``.
- ``te_flax.MultiHeadAttention`` (fused QKV, and the KV-cache decode path) against Flax's
  ``nn.MultiHeadDotProductAttention`` with the same weights.
- ``mask_convention="te"`` with the inverted mask gives identical results, in every entry point.
- ``make_attention_mask`` returns the convention it is asked for; a bad convention or mask dtype raises, naming it.

Flax gives a query row that sees no key the average of every value; te_jax gives it 0 (the module docstring of
``te_jax.fused.attention``): the rows of padded queries are compared with 0, the others with Flax.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax
from conftest import random_normal

B, T, H, D = 2, 8, 4, 16
HIDDEN = H * D
LENGTHS = (8, 5)  # example 1 ends in 3 padding tokens


def _valid() -> jax.Array:
  """(B, T) bool: the tokens that are not padding."""
  return jnp.arange(T)[None, :] < jnp.asarray(LENGTHS)[:, None]


def _flax_masks():
  """(padding, padding & causal) as Flax builds them: float32 (B, 1, T, T), 1 = attend."""
  valid = _valid()
  padding = nn.make_attention_mask(valid, valid)
  return padding, nn.combine_masks(padding, nn.make_causal_mask(valid))


def _rows_of_valid_queries(x):
  return np.concatenate([np.asarray(x)[b, :n] for b, n in enumerate(LENGTHS)])


def _rows_of_padded_queries(x):
  return np.concatenate([np.asarray(x)[b, n:] for b, n in enumerate(LENGTHS)])


def _check_against_flax(ours, theirs, tol=2e-5):
  assert _rows_of_valid_queries(ours).size and _rows_of_padded_queries(ours).size
  np.testing.assert_allclose(_rows_of_valid_queries(ours), _rows_of_valid_queries(theirs), rtol=tol, atol=tol)
  np.testing.assert_array_equal(_rows_of_padded_queries(ours), 0.0)


# ---- the function ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "arbitrary"])
def test_function_takes_flax_masks(mask_type):
  q, k, v = (random_normal(seed, (B, T, H, D)) for seed in (0, 1, 2))
  padding, padding_causal = _flax_masks()
  ours_mask = padding_causal if mask_type == "arbitrary" else padding  # "padding_causal" adds the causal part
  theirs_mask = padding if mask_type == "padding" else padding_causal
  theirs = jax.nn.dot_product_attention(q, k, v, mask=theirs_mask.astype(bool))

  def ours(mask, **kw):
    return te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type=mask_type, backend="unfused", **kw)

  from_float = ours(ours_mask)  # float32 0/1, as nn.make_attention_mask returns it
  assert ours_mask.dtype == jnp.float32
  _check_against_flax(from_float, theirs)
  np.testing.assert_array_equal(ours(ours_mask.astype(bool)), from_float)
  np.testing.assert_array_equal(ours(ours_mask.astype(jnp.int32)), from_float)
  np.testing.assert_array_equal(ours(ours_mask.astype(bool), mask_convention="flax"), from_float)
  np.testing.assert_array_equal(ours(~ours_mask.astype(bool), mask_convention="te"), from_float)
  np.testing.assert_array_equal(ours(1.0 - ours_mask, mask_convention="te"), from_float)


def test_nonzero_means_attend_as_in_flax():
  """Any nonzero value attends, as ``jnp.where(mask, ...)`` in Flax's attention reads it."""
  q, k, v = (random_normal(seed, (B, T, H, D)) for seed in (3, 4, 5))
  padding, _ = _flax_masks()
  run = lambda m: te_jax.dot_product_attention(q, k, v, None, m, attn_mask_type="padding",  # noqa: E731
                                               backend="unfused")
  np.testing.assert_array_equal(run(padding * 0.5), run(padding))
  np.testing.assert_array_equal(run(padding.astype(jnp.int8) * -3), run(padding))


def test_make_attention_mask_returns_the_convention_asked_for():
  q = jnp.zeros((B, T, H, D))
  padding, padding_causal = _flax_masks()
  got = te_jax.make_attention_mask(q, q, q, padding, attn_mask_type="padding_causal")
  assert got.dtype == jnp.bool_
  np.testing.assert_array_equal(np.broadcast_to(got, (B, 1, T, T)), padding_causal.astype(bool))
  te = te_jax.make_attention_mask(q, q, q, ~padding.astype(bool), attn_mask_type="padding_causal",
                                  mask_convention="te")
  np.testing.assert_array_equal(te, ~got)
  # Its output goes back in as an "arbitrary" mask of the same convention: the same attention.
  k = random_normal(6, (B, T, H, D))
  for mask, conv in ((got, "flax"), (te, "te")):
    np.testing.assert_array_equal(
        te_jax.dot_product_attention(k, k, k, None, mask, attn_mask_type="arbitrary", mask_convention=conv,
                                     backend="unfused"),
        te_jax.dot_product_attention(k, k, k, None, padding, attn_mask_type="padding_causal", backend="unfused"))


@pytest.mark.parametrize("entry", ["dot_product_attention", "attention_backend", "make_attention_mask"])
def test_bad_convention_raises(entry):
  q = jnp.zeros((B, T, H, D))
  padding, _ = _flax_masks()
  with pytest.raises(ValueError, match=r"mask_convention must be one of \('flax', 'te'\), got 'TE'"):
    getattr(te_jax, entry)(q, q, q, mask=padding, attn_mask_type="padding", mask_convention="TE")
  with pytest.raises(ValueError, match="mask_convention must be one of"):  # checked without a mask too
    getattr(te_jax, entry)(q, q, q, attn_mask_type="causal", mask_convention="inverted")



# ---- the Flax modules -----------------------------------------------------------------------------------------------


def _synced(mask_type, **kw):
  """Flax's MultiHeadDotProductAttention and te_flax's MultiHeadAttention (fused QKV kernel) with the same weights."""
  x = random_normal(7, (B, T, HIDDEN))
  theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=HIDDEN, use_bias=False, deterministic=True)
  fv = theirs.init(jax.random.key(8), x)["params"]
  ours = te_flax.MultiHeadAttention(head_dim=D, num_attention_heads=H, input_layernorm=False,
                                    attn_mask_type=mask_type, dtype=jnp.float32, backend="unfused", **kw)
  qkv = jnp.stack([fv[n]["kernel"] for n in ("query", "key", "value")], axis=2)  # (hidden, H, 3, D)
  params = {"qkv": {"kernel": qkv}, "out": {"kernel": fv["out"]["kernel"]}}
  return x, theirs, {"params": fv}, ours, params


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_multi_head_attention_matches_flax(mask_type):
  x, theirs, fv, ours, params = _synced(mask_type)
  padding, padding_causal = _flax_masks()
  want = theirs.apply(fv, x, mask=padding_causal if mask_type == "padding_causal" else padding)
  got = ours.apply({"params": params}, x, None, padding, deterministic=True)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x, None, padding, deterministic=True)["params"]) == \
      jax.tree.map(jnp.shape, params)
  _check_against_flax(got, want)
  np.testing.assert_array_equal(ours.apply({"params": params}, x, None, padding.astype(bool), deterministic=True), got)
  te = ours.clone(mask_convention="te")
  np.testing.assert_array_equal(te.apply({"params": params}, x, None, padding == 0, deterministic=True), got)


def test_kv_cache_decoding_with_a_flax_key_padding_mask_matches_flax():
  """The decode path adds its own causal mask to the caller's: Flax's key padding mask (B, 1, 1, S), float32."""
  x, theirs, fv, ours, params = _synced("padding_causal")
  keys = nn.make_attention_mask(jnp.ones((B, 1), bool), _valid())  # (B, 1, 1, T): padded keys only
  want = theirs.apply(fv, x, mask=nn.combine_masks(keys, nn.make_causal_mask(_valid())))
  for conv, mask in (("flax", keys), ("te", keys == 0)):
    module = ours.clone(mask_convention=conv)
    cache = module.init(jax.random.key(0), x, None, mask, decode=True, deterministic=True)["cache"]
    outs = []
    for i in range(T):
      y, mut = module.apply({"params": params, "cache": cache}, x[:, i:i + 1], None, mask, decode=True,
                            deterministic=True, mutable=["cache"])
      cache = mut["cache"]
      outs.append(y)
    got = jnp.concatenate(outs, 1)
    # Every query sees key 0 here (only keys are padded): every row is compared with Flax.
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=conv)


def test_dot_product_attention_module_and_transformer_layer_take_either_convention():
  q, k, v = (random_normal(seed, (B, T, H, D)) for seed in (9, 10, 11))
  padding, _ = _flax_masks()
  attn = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, attn_mask_type="padding_causal",
                                     backend="unfused")
  want = te_jax.dot_product_attention(q, k, v, None, padding, attn_mask_type="padding_causal", backend="unfused")
  np.testing.assert_array_equal(attn.apply({}, q, k, v, padding, deterministic=True), want)
  np.testing.assert_array_equal(attn.clone(mask_convention="te").apply({}, q, k, v, padding == 0, deterministic=True),
                                want)
  layer = te_flax.TransformerLayer(hidden_size=HIDDEN, intermediate_dim=64, num_attention_heads=H,
                                   layer_type="encoder", dtype=jnp.float32, backend="unfused")
  x = random_normal(12, (B, T, HIDDEN))
  variables = layer.init(jax.random.key(13), x, attention_mask=padding, deterministic=True)
  got = layer.apply(variables, x, attention_mask=padding, deterministic=True)
  np.testing.assert_array_equal(
      layer.clone(mask_convention="te").apply(variables, x, attention_mask=padding == 0, deterministic=True), got)
  unmasked = layer.apply(variables, x, deterministic=True)
  np.testing.assert_allclose(got[0], unmasked[0], rtol=1e-6, atol=1e-6)  # example 0 has no padding
  assert not np.allclose(got[1, :LENGTHS[1]], unmasked[1, :LENGTHS[1]])  # example 1's padded keys are left out


@pytest.mark.parametrize("module", ["DotProductAttention", "MultiHeadAttention", "TransformerLayer"])
def test_modules_check_the_convention(module):
  q = jnp.zeros((B, T, H, D))
  x = jnp.zeros((B, T, HIDDEN))
  make, args = {
      "DotProductAttention": (lambda **kw: te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, **kw),
                              (q, q, q)),
      "MultiHeadAttention": (lambda **kw: te_flax.MultiHeadAttention(head_dim=D, num_attention_heads=H, **kw), (x,)),
      "TransformerLayer": (lambda **kw: te_flax.TransformerLayer(hidden_size=HIDDEN, intermediate_dim=64,
                                                                 num_attention_heads=H, **kw), (x,)),
  }[module]
  with pytest.raises(ValueError, match=r"mask_convention must be one of \('flax', 'te'\), got 'True=masked'"):
    make(mask_convention="True=masked").init(jax.random.key(0), *args, deterministic=True)
