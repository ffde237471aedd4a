"""te_jax.dot_product_attention and te_jax.flax.DotProductAttention.

- The unfused backend against an independent naive reference (one head at a time, the mask built by direct
  comparisons of positions, jax.nn.softmax), float32, for every mask type, bias type, GQA grouping, window, segment
  ids and layout: values and gradients with respect to q, k, v and the bias.
- Dropout: the same key gives the same output, another key another; the kept fraction matches the rate.
- Fully masked rows give zeros (values) and finite gradients; argument errors; jit and vmap; the module against the
  function.
- On a GPU (``@pytest.mark.gpu``): the fused (cuDNN) backend against the unfused one for every configuration cuDNN
  takes, in bfloat16: each is compared with the float32 reference, and the fused error must stay within twice the
  unfused bfloat16 error plus a small floor (the flash-attention tolerance rule); the HLO holds ``__cudnn$fmha``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax
from conftest import random_normal
from te_jax.fused import attention, attention_cudnn, attention_masks
from te_jax.fused.attention import AttentionBackend, fp8_attention_support

HIGHEST = jax.lax.Precision.HIGHEST
B, H, D = 2, 4, 8


# ---- the naive reference -------------------------------------------------------------------------------------------


def naive_mask(b, h, t, s, mask_type, mask=None, segment_ids=None, window=None):
  """True = masked out, (b, h, t, s), numpy, from the definitions (positions compared one condition at a time);
  ``mask`` is the caller's, in Flax's convention (True = attend)."""
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  diag = i + (s - t) if mask_type.endswith("bottom_right") else i  # the key position on each query's diagonal
  out = np.zeros((b, h, t, s), bool)
  if "causal" in mask_type:
    out |= (j > diag)[None, None]
  if window is not None:
    left, right = window
    if left >= 0:
      out |= (j < diag - left)[None, None]
    if right >= 0:
      out |= (j > diag + right)[None, None]
  if mask is not None:
    out |= np.broadcast_to(~np.asarray(mask, bool), out.shape)
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    seg = (q_ids[:, :, None] != kv_ids[:, None, :]) | (q_ids[:, :, None] == 0) | (kv_ids[:, None, :] == 0)
    out |= seg[:, None]
  return out


def naive_alibi(h, t, s, bottom_right):
  slopes = attention_masks.alibi_slopes(h)
  shift = s - t if bottom_right else 0
  dist = np.abs(np.arange(s)[None, :] - np.arange(t)[:, None] - shift)
  return (-slopes[:, None, None] * dist[None])[None].astype(np.float32)


def naive_attention(q, k, v, bias, masked, scale):
  """BSHD float32; one head at a time; key/value head h // (H / Hk)."""
  heads, kv_heads = q.shape[2], k.shape[2]
  masked = jnp.asarray(masked)
  outs = []
  for hh in range(heads):
    kv = hh // (heads // kv_heads)
    logits = jnp.einsum("btd,bsd->bts", q[:, :, hh], k[:, :, kv], precision=HIGHEST) * scale
    if bias is not None:
      logits = logits + jnp.broadcast_to(bias, (q.shape[0], heads) + bias.shape[2:])[:, hh]
    m = masked[:, hh]
    empty = jnp.all(m, axis=-1, keepdims=True)
    p = jax.nn.softmax(jnp.where(m, -jnp.inf, jnp.where(empty, 0.0, logits)), axis=-1)
    p = jnp.where(empty, 0.0, p)
    outs.append(jnp.einsum("bts,bsd->btd", p, v[:, :, kv], precision=HIGHEST))
  return jnp.stack(outs, axis=2)


def randn(key, shape, dtype=jnp.float32):
  return random_normal(key, shape, dtype)


def qkv(t, s, kv_heads=H, dtype=jnp.float32, d=D, seed=0, b=B, heads=H):
  return randn(seed, (b, t, heads, d), dtype), randn(seed + 1, (b, s, kv_heads, d), dtype), randn(
      seed + 2, (b, s, kv_heads, d), dtype)


def check_against_naive(q, k, v, bias=None, mask=None, *, segment_ids=None, mask_type="no_mask", bias_type=None,
                        window=None, scale=None, tol=3e-5):
  """Values and gradients (q, k, v, bias) of the unfused backend against the naive reference."""
  b, t, h, d = q.shape
  s = k.shape[1]
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  masked = naive_mask(b, h, t, s, mask_type, mask, segment_ids, window)
  ref_bias = bias
  if bias_type == "alibi":
    ref_bias = jnp.asarray(naive_alibi(h, t, s, mask_type.endswith("bottom_right")))
  cot = randn(99, (b, t, h, v.shape[-1]))

  def ours(q, k, v, bias):
    out = te_jax.dot_product_attention(q, k, v, bias if bias_type != "alibi" else None, mask,
                                       segment_ids=segment_ids, attn_mask_type=mask_type, attn_bias_type=bias_type,
                                       window_size=window, scale_factor=scale, backend="unfused")
    return jnp.sum(out * cot), out

  def ref(q, k, v, bias):
    out = naive_attention(q, k, v, bias, masked, scale)
    return jnp.sum(out * cot), out

  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  (_, got), g_got = jax.value_and_grad(ours, argnums=argnums, has_aux=True)(q, k, v, bias)
  (_, want), g_want = jax.value_and_grad(ref, argnums=argnums, has_aux=True)(q, k, v, ref_bias)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg="output")
  for name, a, e in zip(("dq", "dk", "dv", "dbias")[:len(g_got)], g_got, g_want, strict=True):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=name)
  return got


# ---- unfused vs the naive reference --------------------------------------------------------------------------------

SEQS = [(12, 12), (8, 12), (12, 8)]  # (T, S)


def padding_mask(t, s, q_lens=(9, 5), kv_lens=(7, 12)):
  """(B, 1, T, S), True = attend (Flax's convention): query row i or key j beyond each example's length is masked."""
  q_pad = np.arange(t)[None, :] >= np.minimum(np.asarray(q_lens), t)[:, None]
  kv_pad = np.arange(s)[None, :] >= np.minimum(np.asarray(kv_lens), s)[:, None]
  return jnp.asarray(~(q_pad[:, :, None] | kv_pad[:, None, :])[:, None])


@pytest.mark.parametrize("t,s", SEQS)
@pytest.mark.parametrize("mask_type", attention.ATTN_MASK_TYPES)
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
def test_gqa_mqa(kv_heads, mask_type):
  check_against_naive(*qkv(10, 10, kv_heads), mask_type=mask_type)


@pytest.mark.parametrize("bias_shape", [(1, H, 10, 12), (B, H, 10, 12), (B, 1, 10, 12), (1, 1, 10, 12)])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right", "padding"])
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


# A causal mask allows no right window (an error, tested below): those pairs are left out.
WINDOW_CASES = [(w, m) for w in WINDOWS for m in ("no_mask", "causal", "causal_bottom_right", "padding")
                if not ("causal" in m and w[1] > 0)]


@pytest.mark.parametrize("t,s", SEQS)
@pytest.mark.parametrize("window,mask_type", WINDOW_CASES)
def test_sliding_window(window, mask_type, t, s):
  mask = padding_mask(t, s) if mask_type == "padding" else None
  check_against_naive(*qkv(t, s), mask=mask, mask_type=mask_type, window=window)


def segments(lengths_per_example, n):
  """(B, n) ids: consecutive segments 1, 2, ... of the given lengths, then padding (0)."""
  ids = np.zeros((len(lengths_per_example), n), np.int32)
  for b, lengths in enumerate(lengths_per_example):
    pos = 0
    for seg, length in enumerate(lengths, start=1):
      ids[b, pos:pos + length] = seg
      pos += length
  return jnp.asarray(ids)


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
    (dict(window_size=(2, 1), attn_mask_type="causal"), ValueError, "window_size\\[1\\] must be 0 or -1"),
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
  _assert_auto_backend(te_jax.attention_backend(q, kv, qkv_layout="BSHD_BS2HD"))


def _assert_auto_backend(choice):
  """What "auto" must pick on this machine for a bfloat16 configuration cuDNN supports (every one passed here is
  one the GPU tests run fused): cuDNN on a GPU machine, else unfused, saying that there is no GPU."""
  if attention_cudnn._gpu_compute_capability() is not None:  # noqa: SLF001
    assert choice.name == "fused", choice
  else:
    assert choice == AttentionBackend("unfused", "no GPU: cuDNN attention runs on NVIDIA GPUs only"), choice


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


# ---- GPU: cuDNN against the unfused backend ------------------------------------------------------------------------

GPU_T, GPU_S, GPU_D = 256, 256, 64


def _gpu_case(mask_type, bias_type, window, kv_heads, t=GPU_T, s=GPU_S, layout="BSHD", segment=False):
  q, k, v = qkv(t, s, kv_heads=kv_heads, dtype=jnp.bfloat16, d=GPU_D)
  mask = segment_ids = bias = None
  if segment:
    segment_ids = segments([[t // 2, t // 4, t // 8], [t - 3]], t)
  elif mask_type.startswith("padding"):
    mask = padding_mask(t, s, q_lens=(t - 40, t), kv_lens=(s - 17, s - 1))
  elif mask_type == "arbitrary":
    mask = jnp.asarray(np.random.default_rng(3).random((1, 1, t, s)) < 0.5)
  if bias_type == "post_scale_bias":
    bias = randn(11, (1, H, t, s), jnp.bfloat16)
  elif bias_type == "per_example_bias":  # a (B, 1, T, S) bias: one per example, shared by the heads
    bias, bias_type = randn(12, (B, 1, t, s), jnp.bfloat16), "post_scale_bias"
  return dict(q=q, k=k, v=v, bias=bias, mask=mask, segment_ids=segment_ids, attn_mask_type=mask_type,
              attn_bias_type=bias_type, window_size=window, layout=layout)


def _run_backend(case, backend, dtype=None):
  def f(q, k, v, bias):
    cast = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.astype(dtype))
    return te_jax.dot_product_attention(cast(q), cast(k), cast(v), cast(bias), case["mask"],
                                        segment_ids=case["segment_ids"], attn_mask_type=case["attn_mask_type"],
                                        attn_bias_type=case["attn_bias_type"], window_size=case["window_size"],
                                        backend=backend).astype(jnp.float32)

  args = (case["q"], case["k"], case["v"], case["bias"])
  cot = randn(42, case["q"].shape[:3] + (case["v"].shape[-1],))
  argnums = (0, 1, 2, 3) if case["bias"] is not None else (0, 1, 2)

  def loss(*a):
    out = f(*a)
    return jnp.sum(out * cot), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  hlo = fn.lower(*args).compile().as_text()
  (_, out), grads = fn(*args)
  return out, [g.astype(jnp.float32) for g in grads], hlo


GPU_CASES = [
    ("no_mask", None, None, 4), ("causal", None, None, 4), ("causal", None, None, 2), ("causal", None, None, 1),
    ("padding", None, None, 4), ("padding_causal", None, None, 2), ("arbitrary", None, None, 4),
    ("causal", None, (32, 0), 4), ("no_mask", None, (16, 16), 4), ("causal_bottom_right", None, None, 4),
    ("no_mask", "post_scale_bias", None, 4), ("causal", "post_scale_bias", None, 2),
    ("padding", "post_scale_bias", None, 4), ("causal", "alibi", None, 4), ("no_mask", "alibi", None, 2),
    ("no_mask", "per_example_bias", None, 2), ("padding_causal", "per_example_bias", None, 4),
]


def _assert_close_to_reference(fused, unfused, ref, what):
  """err(fused) <= 2 err(unfused in bf16) + floor, both against the float32 unfused result."""
  scale = float(jnp.max(jnp.abs(ref))) or 1.0
  err_fused = float(jnp.max(jnp.abs(fused - ref)))
  err_unfused = float(jnp.max(jnp.abs(unfused - ref)))
  assert err_fused <= 2 * err_unfused + 2e-3 * scale, (what, err_fused, err_unfused, scale)


def _check_fused(case, emulated=False):
  assert te_jax.attention_backend(case["q"], case["k"], case["v"], case["bias"], case["mask"],
                                  segment_ids=case["segment_ids"], attn_mask_type=case["attn_mask_type"],
                                  attn_bias_type=case["attn_bias_type"],
                                  window_size=case["window_size"]).name == "fused"
  fused, g_fused, hlo = _run_backend(case, "fused")
  assert ("__cudnn$fmha" in hlo) != emulated
  unfused, g_unfused, hlo_unfused = _run_backend(case, "unfused")
  assert "__cudnn$fmha" not in hlo_unfused
  ref, g_ref, _ = _run_backend(case, "unfused", jnp.float32)
  assert np.all(np.isfinite(fused))
  _assert_close_to_reference(fused, unfused, ref, "output")
  for name, a, b, r in zip(("dq", "dk", "dv", "dbias"), g_fused, g_unfused, g_ref):
    assert np.all(np.isfinite(a)), name
    _assert_close_to_reference(a, b, r, name)


# ---- the fused backend's glue on any machine, with cuDNN's call emulated ---------------------------------------------


@pytest.fixture
def emulated_cudnn(monkeypatch):
  """Replaces JAX's cuDNN attention calls by XLA code with the semantics measured on an H200 (cuDNN 9.19): the causal
  mask is top-left (j <= i) for any T, S; a sliding window of length w keeps i - w < j <= i; the bias is added after
  the scaling, and its gradient flows only when has_dbias; FP8 takes the descale factors of q, k, v and writes
  O * scale_o in E4M3. Everything te_jax does around the call (bias and mask folding, zeroed rows, layouts, the FP8
  scaling) then runs on the CPU against the unfused backend."""
  from jax._src.cudnn import fused_attention_stablehlo as real  # noqa: PLC0415

  def attend(q, k, v, bias, scale, causal, window):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, bias=bias, scale=scale, is_causal=causal,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="xla")

  def dot_product_attention(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v, scale, seed,
                            dropout_rate, variadic_args, mask_type, layout, window, cudnn_version, return_residual):
    assert layout == real.AttentionLayout.BTNH.value and dropout_rate == 0.0 and not return_residual
    assert all(x.size == 0 for x in (q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v))
    has_bias, has_dbias = variadic_args
    assert q.dtype == k.dtype == v.dtype and (not has_bias or bias.dtype == q.dtype)
    b = (bias if has_dbias else jax.lax.stop_gradient(bias)).astype(jnp.float32) if has_bias else None
    return attend(q, k, v, b, scale, mask_type == real.MaskType.CAUSAL, window).astype(q.dtype)

  def fp8_fwd(q8, k8, v8, params, scale, causal, layout, cudnn_version):
    descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = params
    assert q8.dtype == k8.dtype == v8.dtype == jnp.float8_e4m3fn
    assert abs(float(scale_s.reshape(())) * float(descale_s.reshape(())) - 1.0) < 1e-6
    out = attend(q8.astype(jnp.float32) * descale_q, k8.astype(jnp.float32) * descale_k,
                 v8.astype(jnp.float32) * descale_v, None, scale, causal, None)
    return (out * scale_o).astype(jnp.float8_e4m3fn), jnp.zeros((1, 1, 1, 1)), jnp.zeros((1, 1, 1, 1))

  fake = type("EmulatedCudnn", (), dict(
      AttentionLayout=real.AttentionLayout, MaskType=real.MaskType, check_layout=staticmethod(real.check_layout),
      get_large_negative_number=staticmethod(real.get_large_negative_number),
      _dot_product_attention=staticmethod(dot_product_attention),
      _dot_product_attention_fp8_fwd=staticmethod(fp8_fwd)))
  monkeypatch.setattr(attention_cudnn, "cudnn_attention", lambda: (fake, 91900))
  monkeypatch.setattr(attention_cudnn, "_gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(attention.native, "REFERENCE_FORCED", False)  # noqa: SLF001


# The GPU cases' glue, three compiled value-and-gradient programs each (~3 s on a 2-core CPU), runs with the slow
# tests; the cases of the emulation alone, and one GPU case of each mask kind, in every run.
_EMULATED_FAST = {("causal", None, None, 2), ("padding_causal", None, None, 2), ("causal", None, (32, 0), 4),
                  ("padding", "post_scale_bias", None, 4)}
EMULATED_CASES = [c if c in _EMULATED_FAST else pytest.param(c, marks=pytest.mark.slow) for c in GPU_CASES] + [
    ("padding", None, None, 2, "segments"), ("padding_causal", None, None, 4, "segments"),
    ("causal", None, (7, 0), 4, "T<S"), ("causal_bottom_right", None, None, 4, "T<S"),
    ("causal", "alibi", None, 2, "T>S")]


@pytest.mark.parametrize("case", EMULATED_CASES,
                         ids=["-".join(map(str, getattr(c, "values", [c])[0])) for c in EMULATED_CASES])
def test_fused_glue_with_emulated_cudnn(emulated_cudnn, case):
  mask_type, bias_type, window, kv_heads, *extra = case
  t, s = {"T<S": (16, 32), "T>S": (32, 16)}.get(extra[0] if extra else None, (32, 32))
  _check_fused(_gpu_case(mask_type, bias_type, window, kv_heads, t=t, s=s, segment=extra == ["segments"]),
               emulated=True)


def test_fused_glue_sbhd_and_zero_rows_with_emulated_cudnn(emulated_cudnn):
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  got = te_jax.dot_product_attention(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), attn_mask_type="causal",
                                     qkv_layout="SBHD", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused")
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got, 0, 1), np.float32), np.asarray(want, np.float32))
  mask = np.ones((B, 1, 32, 32), bool)
  mask[0, 0, 5, :] = False  # query 5 of example 0 sees nothing
  out = te_jax.dot_product_attention(q, k, v, None, jnp.asarray(mask), attn_mask_type="arbitrary", backend="fused")
  assert np.all(np.asarray(out[0, 5], np.float32) == 0) and np.any(np.asarray(out[0, 4], np.float32) != 0)


def test_fused_glue_left_padding_with_emulated_cudnn(emulated_cudnn):
  """Left padding with a causal mask: the first rows see only padded keys under cuDNN's causal mask, although the
  padding mask alone leaves later keys open; they must still come out 0."""
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  pad = np.arange(32)[None, :] < np.asarray([6, 0])[:, None]  # example 0: the first 6 tokens are padding
  mask = jnp.asarray((~pad[:, None, :] & np.ones((B, 32, 1), bool))[:, None])  # keys only: queries stay unmasked
  out = te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type="padding_causal", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type="padding_causal", backend="unfused")
  assert np.all(np.asarray(out[0, :6], np.float32) == 0) and np.all(np.asarray(want[0, :6], np.float32) == 0)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def _check_key_padding_mask(backend, mask_type):
  """A (B, 1, 1, S) mask of padded keys is the (B, 1, T, S) mask with that row for every query: the same outputs and
  gradients."""
  q, k, v = qkv(16, 24, dtype=jnp.bfloat16, d=64)
  pad = np.arange(24)[None, :] >= np.asarray([20, 24])[:, None]  # example 0: its last 4 keys are padding
  keys_only = jnp.asarray(~pad[:, None, None, :])
  full = jnp.broadcast_to(keys_only, (B, 1, 16, 24))
  mask_type = mask_type + ("_bottom_right" if mask_type == "padding_causal" else "")

  def run(mask):
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type=mask_type,  # noqa: E731
                                                     backend=backend)
    out, vjp = jax.vjp(f, q, k, v)
    return [np.asarray(a, np.float32) for a in (out, *vjp(jnp.ones_like(out)))]

  for a, b in zip(run(keys_only), run(full)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["unfused", "fused"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_key_padding_mask_broadcasts_over_queries(emulated_cudnn, backend, mask_type):
  _check_key_padding_mask(backend, mask_type)  # the fused backend through the emulated cuDNN call


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_fused_key_padding_mask(mask_type):
  _check_key_padding_mask("fused", mask_type)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_fp8_glue_with_emulated_cudnn(emulated_cudnn, mask_type):
  """With the FP8 call emulated exactly (dequantized inputs, E4M3 output), the error is that of quantizing q, k, v
  and O to E4M3 with te_jax's scales: a few 2^-4 relative roundings; the gradient is the bf16 one."""
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  assert te_jax.attention_backend(q, k, v, attn_mask_type=mask_type, fp8_dpa=True).name == "fused"
  out = np.asarray(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True), np.float32)
  ref = np.asarray(te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                attn_mask_type=mask_type, backend="unfused"))
  scale = np.max(np.abs(ref))
  assert np.max(np.abs(out - ref)) <= 0.25 * scale and np.mean(np.abs(out - ref)) <= 0.02 * scale
  grad = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True)
                                    .astype(jnp.float32)))(q)
  want = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, backend="fused")
                                    .astype(jnp.float32)))(q)
  np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want, np.float32))
  with pytest.raises(ValueError, match="fp8_dpa=True cannot run"):
    te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=(4, 0), fp8_dpa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type,bias_type,window,kv_heads", GPU_CASES,
                         ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_fused_matches_unfused(mask_type, bias_type, window, kv_heads):
  _check_fused(_gpu_case(mask_type, bias_type, window, kv_heads))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_fused_segment_ids(mask_type):
  _check_fused(_gpu_case(mask_type, None, None, 2, segment=True))


@pytest.mark.gpu
@pytest.mark.parametrize("t,s,mask_type", [(128, 256, "causal"), (256, 128, "causal"), (128, 256,
                                                                                    "causal_bottom_right")])
def test_fused_cross_lengths(t, s, mask_type):
  _check_fused(_gpu_case(mask_type, None, None, 4, t=t, s=s))


@pytest.mark.gpu
def test_fused_fully_masked_rows_are_zero():
  q, k, v = qkv(64, 64, dtype=jnp.bfloat16, d=64)
  mask = np.ones((B, 1, 64, 64), bool)
  mask[0, 0, 5, :] = False  # query 5 of example 0 sees nothing
  out = te_jax.dot_product_attention(q, k, v, None, jnp.asarray(mask), attn_mask_type="arbitrary", backend="fused")
  assert np.all(np.asarray(out[0, 5], np.float32) == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.gpu
def test_fused_sbhd_layout():
  q, k, v = qkv(128, 128, dtype=jnp.bfloat16, d=64)
  got = te_jax.dot_product_attention(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), attn_mask_type="causal",
                                     qkv_layout="SBHD", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused")
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got, 0, 1), np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
def test_auto_picks_fused_and_unfused_with_reasons():
  q, k, v = qkv(128, 128, dtype=jnp.bfloat16, d=64)
  assert te_jax.attention_backend(q, k, v, attn_mask_type="causal").name == "fused"
  choice = te_jax.attention_backend(q, k, v, attn_mask_type="causal", dropout_rate=0.1)
  assert choice.name == "unfused" and "dropout" in choice.reason
  choice = te_jax.attention_backend(*qkv(16, 16), attn_mask_type="causal")
  assert choice.name == "unfused" and "float32" in choice.reason
  choice = te_jax.attention_backend(*qkv(128, 128, dtype=jnp.bfloat16, d=20))
  assert choice.name == "unfused" and "head dim 20" in choice.reason
  choice = te_jax.attention_backend(*qkv(127, 127, dtype=jnp.bfloat16, d=64), attn_bias_type="alibi")
  assert choice.name == "unfused" and "odd sequence length" in choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_fp8_forward(mask_type):
  """FP8 (E4M3) forward against the float32 result, and the backward against the bf16 one.

  E4M3 keeps 3 mantissa bits: each of q, k, v, P and O is rounded to within 2^-4 of itself. Measured on an H200
  (cuDNN 9.19, this shape): max error 12% (no mask) and 8% (causal) of max|out|, mean error 0.6%; the bounds below
  are 25% and 2%. A wrong scale or descale factor is off by a factor, far outside them."""
  ok, reason = fp8_attention_support(128, 256, 256, training=False)
  assert ok, reason
  q, k, v = qkv(256, 256, dtype=jnp.bfloat16, d=128)
  f8 = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True))
  hlo = f8.lower(q, k, v).compile().as_text()
  assert "__cudnn$fmhaSoftmaxF8" in hlo
  ref = te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), attn_mask_type=mask_type,
                                     backend="unfused")
  out = np.asarray(f8(q, k, v), np.float32)
  err = np.abs(out - np.asarray(ref))
  scale = float(jnp.max(jnp.abs(ref)))
  assert err.max() <= 0.25 * scale and err.mean() <= 0.02 * scale, (err.max(), err.mean(), scale)
  g = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True)
                                 .astype(jnp.float32)))(q)
  g_bf16 = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type)
                                      .astype(jnp.float32)))(q)
  g, g_bf16 = np.asarray(g, np.float32), np.asarray(g_bf16, np.float32)
  # The same cuDNN backward on the same inputs; its dQ accumulation order may vary between runs.
  assert np.max(np.abs(g - g_bf16)) <= 1e-2 * np.max(np.abs(g_bf16))


@pytest.mark.gpu
def test_fused_module_under_jit_and_vmap():
  q, k, v = qkv(128, 128, kv_heads=2, dtype=jnp.bfloat16, d=64)
  module = te_flax.DotProductAttention(head_dim=64, num_attention_heads=H, num_gqa_groups=2)
  assert module.backend_for(q, k, v).name == "fused"
  out = jax.jit(lambda q, k, v: module.apply({}, q, k, v, deterministic=True))(q, k, v)
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="unfused")
  _assert_close_to_reference(out.astype(jnp.float32), want.astype(jnp.float32),
                             te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                          attn_mask_type="causal"), "module")
  stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]
  got = jax.vmap(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused"))(
      *stacked)
  for n in range(2):
    one = te_jax.dot_product_attention(*(x[n] for x in stacked), attn_mask_type="causal", backend="fused")
    np.testing.assert_array_equal(np.asarray(got[n], np.float32), np.asarray(one, np.float32))


def test_every_gpu_case_is_a_valid_configuration():
  """The GPU cases are valid arguments (checked here on any machine, so that a GPU run fails only on numerics)."""
  for mask_type, bias_type, window, kv_heads in GPU_CASES:
    case = _gpu_case(mask_type, bias_type, window, kv_heads, t=16, s=16)
    choice = te_jax.attention_backend(case["q"], case["k"], case["v"], case["bias"], case["mask"],
                                      segment_ids=case["segment_ids"], attn_mask_type=mask_type,
                                      attn_bias_type=case["attn_bias_type"], window_size=window)
    _assert_auto_backend(choice)
