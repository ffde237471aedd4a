"""te_jax.dot_product_attention and te_jax.flax.DotProductAttention.

- The unfused backend against an independent naive reference (one head at a time, the mask built by direct
  comparisons of positions, jax.nn.softmax), float32, for every mask type, bias type, GQA grouping, window, segment
  ids and layout: values and gradients with respect to q, k, v and the bias.
- Dropout: the same key gives the same output, another key another; the kept fraction matches the rate.
- Fully masked rows give zeros (values) and finite gradients; argument errors; jit and vmap; the module against the
  function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import (
  B,
  D,
  H,
  assert_auto_backend,
  check_against_naive,
  naive_mask,
  padding_mask,
  qkv,
  randn,
  segments,
)

import te_jax
import te_jax.flax as te_flax
from te_jax.fused import attention, attention_cudnn, attention_masks
from te_jax.fused.attention import AttentionBackend

# ---- unfused vs the naive reference --------------------------------------------------------------------------------

SEQS = [(12, 12), (8, 12), (12, 8)]  # (T, S)


@pytest.mark.parametrize("t,s", SEQS)
@pytest.mark.parametrize("mask_type", attention.ATTN_MASK_TYPES)
@pytest.mark.fast_cases(5)
def test_mask_types(mask_type, t, s):
  q, k, v = qkv(t, s)
  mask = None
  if mask_type in ("padding", "padding_causal", "padding_causal_bottom_right"):
    mask = padding_mask(t, s)
  elif mask_type == "arbitrary":
    mask = jnp.asarray(np.random.default_rng(0).random((B, 1, t, s)) >= 0.3)  # about 30% masked out
  check_against_naive(q, k, v, mask=mask, mask_type=mask_type)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
@pytest.mark.fast_cases(2)
def test_gqa_mqa(kv_heads, mask_type):
  check_against_naive(*qkv(10, 10, kv_heads), mask_type=mask_type)


@pytest.mark.parametrize("bias_shape", [(1, H, 10, 12), (B, H, 10, 12), (B, 1, 10, 12), (1, 1, 10, 12)])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right", "padding"])
@pytest.mark.fast_cases(3)
def test_post_scale_bias(bias_shape, mask_type):
  q, k, v = qkv(10, 12, kv_heads=2)
  mask = padding_mask(10, 12) if mask_type == "padding" else None
  check_against_naive(q, k, v, randn(7, bias_shape), mask, mask_type=mask_type, bias_type="post_scale_bias",
                      scale=0.3)


@pytest.mark.parametrize("t,s", SEQS)
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_alibi(mask_type, t, s):
  check_against_naive(*qkv(t, s), mask_type=mask_type, bias_type="alibi")


def test_alibi_slopes_follow_the_paper():
  np.testing.assert_array_equal(attention_masks.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
  # 6 heads: the 4 slopes of n = 4, then every other slope of n = 8 (Press et al., reference code).
  np.testing.assert_array_equal(attention_masks.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


WINDOWS = [(3, 0), (0, 0), (2, 2), (-1, 1), (4, -1)]


# With a causal mask a right window is accepted (as Transformer Engine accepts it) and bounded by the causal mask.
WINDOW_CASES = [(w, m) for w in WINDOWS for m in ("no_mask", "causal", "causal_bottom_right", "padding")]


@pytest.mark.parametrize("t,s", SEQS)
@pytest.mark.parametrize("window,mask_type", WINDOW_CASES)
@pytest.mark.fast_cases(8)
def test_sliding_window(window, mask_type, t, s):
  mask = padding_mask(t, s) if mask_type == "padding" else None
  check_against_naive(*qkv(t, s), mask=mask, mask_type=mask_type, window=window)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right", "arbitrary"])
def test_segment_ids(mask_type):
  ids = segments([[5, 4, 2], [12]], 12)
  q, k, v = qkv(12, 12, kv_heads=2)
  mask = jnp.asarray(np.random.default_rng(1).random((B, 1, 12, 12)) >= 0.2) if mask_type == "arbitrary" else None
  check_against_naive(q, k, v, mask=mask, segment_ids=ids, mask_type=mask_type)


def test_segment_ids_cross_attention_and_windows():
  q_ids, kv_ids = segments([[3, 5], [6]], 8), segments([[4, 4, 2], [7, 3]], 10)
  check_against_naive(*qkv(8, 10), segment_ids=(q_ids, kv_ids), mask_type="padding", window=(2, 1))


def test_non_contiguous_segments():
  ids = jnp.asarray([[1, 2, 1, 2, 0, 3, 3, 1], [2, 2, 2, 1, 1, 1, 0, 0]], jnp.int32)
  check_against_naive(*qkv(8, 8), segment_ids=ids, mask_type="padding_causal")


@pytest.mark.parametrize("layout", list(attention.QKV_LAYOUTS))
def test_layouts(layout):
  """Every layout gives the BSHD result, transposed or unpacked, values and gradients."""
  q, k, v = qkv(12, 12, kv_heads=H)
  fmt, packing = attention.QKV_LAYOUTS[layout]
  seq_first = fmt == "SBHD"

  def to_layout(q, k, v):
    if seq_first:
      q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))
    if packing == "qkv":
      return jnp.stack([q, k, v], axis=2), None, None
    if packing == "kv":
      return q, jnp.stack([k, v], axis=2), None
    return q, k, v

  def ours(q, k, v):
    out = te_jax.dot_product_attention(*to_layout(q, k, v), attn_mask_type="causal", qkv_layout=layout,
                                       backend="unfused")
    return jnp.swapaxes(out, 0, 1) if seq_first else out

  def ref(q, k, v):
    return te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="unfused")

  np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-6, atol=1e-6)
  cot = randn(5, q.shape)
  g_ours = jax.vjp(ours, q, k, v)[1](cot)
  g_ref = jax.vjp(ref, q, k, v)[1](cot)
  for a, e in zip(g_ours, g_ref, strict=True):
    np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)


def test_value_head_dim_may_differ():
  q, k, _ = qkv(6, 7)
  v = randn(3, (B, 7, H, 5))
  check_against_naive(q, k, v, mask_type="causal")


def test_make_attention_mask_matches_definition():
  ids = segments([[3, 5], [8]], 8)
  got = te_jax.make_attention_mask(*qkv(8, 8), segment_ids=ids, attn_mask_type="padding_causal", window_size=(2, 0))
  want = ~naive_mask(B, 1, 8, 8, "padding_causal", None, ids, (2, 0))  # True = attend, as the mask goes in
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
  assert te_jax.make_attention_mask(*qkv(8, 8)) is None


# ---- fully masked rows, dropout --------------------------------------------------------------------------------------


def test_fully_masked_rows_give_zero_and_finite_grads():
  q, k, v = qkv(6, 6)
  mask = np.ones((B, 1, 6, 6), bool)
  mask[0, 0, 2, :] = False  # query row 2 of example 0 sees nothing
  mask[1, 0, :, :] = False  # example 1 sees nothing at all
  out = check_against_naive(q, k, v, mask=jnp.asarray(mask), mask_type="arbitrary")
  assert np.all(out[0, 2] == 0) and np.all(out[1] == 0)
  assert np.any(out[0, 1] != 0)


@pytest.mark.parametrize("b, t, s", [(0, 6, 6), (2, 0, 6), (2, 6, 0)], ids=["no-batch", "no-queries", "no-keys"])
def test_empty_inputs(b, t, s):
  """Empty batch, queries or keys: outputs of the right (empty or zero) shape and gradients, not a reshape error."""
  q, k, v = jnp.ones((b, t, 4, 8)), jnp.ones((b, s, 2, 8)), jnp.ones((b, s, 2, 8))
  mask_type = "causal_bottom_right" if s >= t else "no_mask"
  out = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type))(q, k, v)
  assert out.shape == (b, t, 4, 8) and not np.any(np.asarray(out))  # no keys: every row is fully masked, so 0
  grads = jax.grad(lambda q, k, v: te_jax.dot_product_attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
  for name, g in zip(("dq", "dk", "dv"), grads):  # the output is empty or all zeros whatever q, k, v are
    np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=name)


def dropout_out(rng, rate, q=None, s=256):
  q = jnp.zeros((1, 64, 2, 8)) if q is None else q
  v = jnp.ones((1, s, 2, 8))
  return te_jax.dot_product_attention(q, v, v, dropout_rate=rate, dropout_rng=rng, backend="unfused")


def test_dropout_is_deterministic_given_the_key():
  q = randn(0, (1, 64, 2, 8))
  a = dropout_out(jax.random.key(1), 0.3, q)
  np.testing.assert_array_equal(a, dropout_out(jax.random.key(1), 0.3, q))
  assert not np.array_equal(a, dropout_out(jax.random.key(2), 0.3, q))
  np.testing.assert_array_equal(jax.jit(dropout_out, static_argnums=1)(jax.random.key(1), 0.3, q), a)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_rate(rate):
  """q = 0 gives P = 1/S everywhere; v = 1 makes each output the kept count / (S (1 - rate)): an integer count per
  row, and over 64 * 2 rows of 256 keys the kept fraction is within 5 standard deviations of 1 - rate."""
  s = 256
  out = np.asarray(dropout_out(jax.random.key(7), rate, s=s))[..., 0]
  kept = out * s * (1 - rate)
  np.testing.assert_allclose(kept, np.round(kept), atol=1e-3)
  n = kept.size * s
  sigma = np.sqrt(rate * (1 - rate) / n)
  assert abs(kept.sum() / n - (1 - rate)) < 5 * sigma


def test_dropout_gradients_use_the_same_mask():
  """The gradient of the dropped-out attention is the gradient of a fixed linear map in v: d/dv of sum(out * c)
  does not depend on v, and out is linear in v (same key)."""
  q, k, v = qkv(8, 8)
  key = jax.random.key(3)

  def f(v):
    return te_jax.dot_product_attention(q, k, v, dropout_rate=0.4, dropout_rng=key, backend="unfused")

  out, vjp = jax.vjp(f, v)
  np.testing.assert_allclose(f(2 * v), 2 * out, rtol=1e-6, atol=1e-6)
  (dv,) = vjp(out)
  np.testing.assert_allclose(jnp.sum(dv * v), jnp.sum(out * out), rtol=1e-5)


# ---- argument errors -------------------------------------------------------------------------------------------------


def _call(**overrides):
  q, k, v = qkv(8, 8)
  args = dict(query=q, key=k, value=v)
  args.update(overrides)
  return te_jax.dot_product_attention(**args)


BAD = [
    (dict(key=randn(1, (B, 8, H, D + 1)), value=randn(1, (B, 8, H, D + 1))), ValueError, "head dims"),
    (dict(key=randn(1, (B, 8, 3, D)), value=randn(1, (B, 8, 3, D))), ValueError, "divide the query heads"),
    (dict(value=randn(1, (B, 9, H, D))), ValueError, "same sequence length"),
    (dict(key=randn(1, (B + 1, 8, H, D)), value=randn(1, (B + 1, 8, H, D))), ValueError, "batch size"),
    (dict(value=randn(1, (B, 8, H, D), jnp.bfloat16)), TypeError, "one dtype"),
    (dict(query=jnp.ones((B, 8, H, D), jnp.int32)), TypeError, "floating-point"),
    (dict(query=randn(0, (8, H, D))), ValueError, "4-D"),
    (dict(attn_mask_type="causual"), ValueError, "attn_mask_type must be one of"),
    (dict(attn_mask_type="causal", mask=jnp.zeros((B, 1, 8, 8), bool)), ValueError, "takes none"),
    (dict(attn_mask_type="padding"), ValueError, "needs the padding"),
    (dict(attn_mask_type="arbitrary"), ValueError, "needs a `mask`"),
    (dict(attn_mask_type="arbitrary", mask=jnp.zeros((B, 1, 8, 8), jnp.complex64)), TypeError,
     "mask must be a bool, integer or floating-point array"),
    (dict(attn_mask_type="arbitrary", mask=jnp.zeros((B, 1, 8, 7), bool)), ValueError, "mask must have shape"),
    (dict(attn_mask_type="arbitrary", mask=jnp.zeros((3, 1, 8, 8), bool)), ValueError, "mask must have shape"),
    (dict(attn_mask_type="causal", segment_ids=jnp.ones((B, 8), jnp.int32)), ValueError, "segment_ids were given"),
    (dict(attn_mask_type="padding", segment_ids=jnp.ones((B, 7), jnp.int32)), ValueError, "segment_ids must have"),
    (dict(attn_mask_type="padding", segment_ids=jnp.ones((B, 8))), TypeError, "integer array"),
    (dict(attn_mask_type="padding", mask=jnp.zeros((B, 1, 8, 8), bool), segment_ids=jnp.ones((B, 8), jnp.int32)),
     ValueError, "not both"),
    (dict(attn_bias_type="post_scale_bias"), ValueError, "needs a bias"),
    (dict(bias=randn(2, (1, H, 8, 9))), ValueError, "bias must have shape"),
    (dict(bias=randn(2, (1, H, 8, 8)), attn_bias_type="alibi"), ValueError, "takes no bias"),
    (dict(attn_bias_type="relative"), ValueError, "attn_bias_type must be"),
    (dict(window_size=(2,)), ValueError, "window_size must be"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be"),
    (dict(softmax_type="sink"), ValueError, "softmax_type must be one of"),
    (dict(softmax_type="learnable"), ValueError, "needs softmax_offset"),
    (dict(softmax_offset=jnp.zeros((1, H, 1, 1))), ValueError, "takes none"),
    (dict(softmax_type="learnable", softmax_offset=jnp.zeros((1, H, 1, 2))), ValueError, "softmax_offset must be"),
    (dict(attn_bias_type="pre_scale_bias"), ValueError, "needs a bias"),
    (dict(dropout_rate=0.1), ValueError, "needs a dropout_rng"),
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, "dropout_rate must be in"),
    (dict(qkv_layout="BHSD"), ValueError, "qkv_layout must be one of"),
    (dict(qkv_layout="BS3HD"), ValueError, "packs q, k and v"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("overrides,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments(overrides, error, match):
  with pytest.raises(error, match=match):
    _call(**overrides)


def test_fused_without_gpu_says_why():
  if attention_cudnn._gpu_compute_capability() is not None:  # noqa: SLF001
    pytest.skip("a GPU is present")
  with pytest.raises(ValueError, match="backend='fused' cannot run this configuration: no GPU"):
    _call(backend="fused")
  assert te_jax.attention_backend(*qkv(8, 8)).name == "unfused"
  with pytest.raises(ValueError, match="fp8_dpa=True cannot run"):
    _call(fp8_dpa=True)


def test_attention_backend_takes_shapes_and_packed_layouts():
  packed = jax.ShapeDtypeStruct((B, 16, 3, H, D), jnp.bfloat16)
  choice = te_jax.attention_backend(packed, qkv_layout="BS3HD", attn_mask_type="causal", backend="unfused")
  assert choice == AttentionBackend("unfused", "requested")
  with pytest.raises(ValueError, match="packs q, k and v"):
    te_jax.attention_backend(packed, packed, qkv_layout="BS3HD")
  kv = jax.ShapeDtypeStruct((B, 16, 2, H, D), jnp.bfloat16)
  q = jax.ShapeDtypeStruct((B, 16, H, D), jnp.bfloat16)
  assert_auto_backend(te_jax.attention_backend(q, kv, qkv_layout="BSHD_BS2HD"))


def test_reference_forced_means_unfused(monkeypatch):
  monkeypatch.setattr(attention.native, "REFERENCE_FORCED", True)  # noqa: SLF001
  choice = te_jax.attention_backend(*qkv(8, 8, dtype=jnp.bfloat16), backend="fused")
  assert choice.name == "unfused" and "TE_JAX_REFERENCE" in choice.reason


# ---- jit, vmap, the module -----------------------------------------------------------------------------------------


def test_jit_and_vmap():
  q, k, v = qkv(8, 8, kv_heads=2)
  mask = padding_mask(8, 8)

  def f(q, k, v, mask):
    return te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type="padding_causal", backend="unfused")

  eager = f(q, k, v, mask)
  np.testing.assert_allclose(jax.jit(f)(q, k, v, mask), eager, rtol=1e-6, atol=1e-6)
  # vmap over an extra leading axis: each slice is one whole call.
  stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
  masks = jnp.stack([mask, ~mask])
  got = jax.vmap(f)(*stacked, masks)
  for n, scale in enumerate((1, 2)):
    np.testing.assert_allclose(got[n], f(scale * q, scale * k, scale * v, masks[n]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,transpose", [("BSHD", False), ("BSHD", True), ("BS3HD", False),
                                              ("BSHD_BS2HD", True)])
def test_module_matches_function(layout, transpose):
  q, k, v = qkv(8, 8)
  ids = segments([[5, 3], [8]], 8)
  module = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, attn_mask_type="padding_causal",
                                       attention_dropout=0.2, qkv_layout=layout, transpose_batch_sequence=transpose,
                                       dtype=jnp.float32, backend="unfused", window_size=(4, 0))
  fmt = {"BSHD": "SBHD", "BS3HD": "SB3HD", "BSHD_BS2HD": "SBHD_SB2HD"}[layout] if transpose else layout
  args = (q, k, v)
  if transpose:
    args = tuple(jnp.swapaxes(x, 0, 1) for x in args)
  if layout == "BS3HD":
    args = (jnp.stack(args, 2), None, None)
  elif layout == "BSHD_BS2HD":
    args = (args[0], jnp.stack(args[1:], 2), None)
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  variables = module.init(rngs, *args, segment_ids=ids, deterministic=True)
  assert variables == {}
  for deterministic in (True, False):
    got = module.apply({}, *args, segment_ids=ids, deterministic=deterministic, rngs={"dropout": jax.random.key(5)})
    # Flax derives the module's dropout key from the stream; recompute it the same way.
    rng = None if deterministic else _module_rng(module, args, ids)
    want = te_jax.dot_product_attention(*args, segment_ids=ids, attn_mask_type="padding_causal", window_size=(4, 0),
                                        qkv_layout=fmt, dropout_rate=0.0 if deterministic else 0.2, dropout_rng=rng,
                                        backend="unfused")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert module.backend_for(*args, segment_ids=ids, deterministic=True).name == "unfused"


def _module_rng(module, args, ids):
  """The key ``make_rng("dropout")`` returns inside ``module.apply`` with dropout stream key(5)."""
  class Probe(type(module)):
    def __call__(self, *a, **kw):
      return self.make_rng(self.dropout_rng_name)

  probe = Probe(**{f: getattr(module, f) for f in module.__dataclass_fields__ if f not in ("parent", "name")})
  return probe.apply({}, *args, segment_ids=ids, rngs={"dropout": jax.random.key(5)})


def test_module_checks_heads():
  q, k, v = qkv(8, 8, kv_heads=2)
  with pytest.raises(ValueError, match="num_gqa_groups"):
    te_flax.DotProductAttention(head_dim=D, num_attention_heads=H).apply({}, q, k, v, deterministic=True)
  with pytest.raises(ValueError, match="head_dim"):
    te_flax.DotProductAttention(head_dim=D * 2, num_attention_heads=H, num_gqa_groups=2).apply(
        {}, q, k, v, deterministic=True)
  with pytest.raises(ValueError, match="transpose_batch_sequence"):
    te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=2, qkv_layout="SBHD",
                                transpose_batch_sequence=True).apply({}, q, k, v, deterministic=True)
