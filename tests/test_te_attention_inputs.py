"""Transformer Engine's attention inputs and its Softmax layer, against independent references.

- ``segment_pos``: the tokens' positions within packed segments. The reference mask is built here one query/key pair
  at a time from the definitions (same segment, not padding; causal ``p_j > p_i``; windows on ``p_j - p_i``; the
  per-sequence bottom-right band ``p_j - p_i - (s - t)``), and the attention is ``tests/attention_reference``'s naive
  one; a packed batch of cross attention with RoPE must also equal each sequence pair attended on its own.
- ``SequenceDescriptor``: every form gives the attention of the equivalent explicit mask or segment ids and
  positions (built here by hand from the lengths and offsets), in the linen and NNX modules, under jit.
- ``Softmax``: against a float64 numpy softmax with Transformer Engine's mask convention (1 = masked out), under the
  tolerance rule; gradients numerically; linen and NNX bit for bit; on the GPU, the CUDA handler in the HLO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import naive_attention, padding_mask, qkv, randn, segments
from conftest import assert_within_rule
from flax import nnx
from jax.test_util import check_grads

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx

H, D = 4, 8
TOL = 3e-5


# ---- references ----------------------------------------------------------------------------------------------------


def _np_positions(ids: np.ndarray) -> np.ndarray:
  """Position within the segment, one token at a time: its index less that of its id's first token in the row."""
  ids = np.asarray(ids)
  out = np.zeros(ids.shape, np.int32)
  for b in range(ids.shape[0]):
    row = list(ids[b])
    for i in range(len(row)):
      out[b, i] = i - row.index(row[i])
  return out


def _position_mask(mask_type, q_ids, kv_ids, q_pos, kv_pos, window=None, heads=H):
  """True = masked out (B, heads, T, S), from the definitions, pair by pair."""
  q_ids, kv_ids, q_pos, kv_pos = (np.asarray(a) for a in (q_ids, kv_ids, q_pos, kv_pos))
  b, t = q_ids.shape
  s = kv_ids.shape[1]
  out = np.zeros((b, heads, t, s), bool)
  for n in range(b):
    for i in range(t):
      for j in range(s):
        seg = q_ids[n, i]
        if seg == 0 or kv_ids[n, j] != seg:
          out[n, :, i, j] = True
          continue
        rel = int(kv_pos[n, j]) - int(q_pos[n, i])
        if mask_type == "padding_causal_bottom_right":
          rel -= int(np.sum(kv_ids[n] == seg)) - int(np.sum(q_ids[n] == seg))
        masked = "causal" in mask_type and rel > 0
        if window is not None:
          masked |= (window[0] >= 0 and rel < -window[0]) or (window[1] >= 0 and rel > window[1])
        out[n, :, i, j] = masked
  return out


def _attention_and_grads(f, q, k, v):
  cot = randn(99, q.shape[:3] + (v.shape[-1],))
  (_, out), grads = jax.value_and_grad(lambda *a: (jnp.sum(f(*a) * cot), f(*a)), argnums=(0, 1, 2),
                                       has_aux=True)(q, k, v)
  return out, grads


def _assert_close(got, want, tol=TOL):
  for name, a, e in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1]), strict=True):
    assert np.all(np.isfinite(a)), name
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=name)


# Packed cross attention: the queries' and keys' segments start at different offsets.
Q_IDS = segments([[3, 5], [6]], 8)
KV_IDS = segments([[4, 4, 2], [7, 3]], 10)


# ---- segment positions -------------------------------------------------------------------------------------------


def test_segment_positions_restart_at_each_segment():
  ids = np.asarray([[1, 1, 1, 2, 2, 0, 0], [3, 3, 1, 1, 1, 1, 2], [1, 2, 1, 2, 0, 1, 0]], np.int32)
  np.testing.assert_array_equal(te_jax.segment_positions(jnp.asarray(ids)), _np_positions(ids))
  many = np.random.default_rng(0).integers(0, 5, (2, 3, 40)).astype(np.int32)  # leading dims, ids in any order
  np.testing.assert_array_equal(te_jax.segment_positions(jnp.asarray(many)),
                                _np_positions(many.reshape(6, 40)).reshape(2, 3, 40))
  with pytest.raises(TypeError, match="segment_ids must be an integer array"):
    te_jax.segment_positions(jnp.zeros((2, 3)))


@pytest.mark.parametrize("mask_type,window", [("padding_causal", None), ("padding_causal_bottom_right", None),
                                              ("padding", (2, 1)), ("padding_causal", (1, 0))])
@pytest.mark.fast_cases(1)
def test_segment_pos_cross_attention(mask_type, window):
  """Packed cross attention at the tokens' positions: values and gradients against the naive attention of the mask
  built from the positions; the mask itself bit for bit (make_attention_mask)."""
  q, k, v = qkv(8, 10, kv_heads=2)
  pos = (jnp.asarray(_np_positions(Q_IDS)), jnp.asarray(_np_positions(KV_IDS)))
  masked = _position_mask(mask_type, Q_IDS, KV_IDS, *pos, window)
  assert not np.array_equal(masked, _position_mask(mask_type, Q_IDS, KV_IDS, *(np.broadcast_to(
      np.arange(n), (2, n)) for n in (8, 10)), window)), "the positions must change the mask for this test to mean it"
  got = _attention_and_grads(lambda q, k, v: te_jax.dot_product_attention(
      q, k, v, segment_ids=(Q_IDS, KV_IDS), segment_pos=pos, attn_mask_type=mask_type, window_size=window,
      backend="unfused"), q, k, v)
  want = _attention_and_grads(lambda q, k, v: naive_attention(q, k, v, None, masked, 1 / np.sqrt(D)), q, k, v)
  _assert_close(got, want)
  made = te_jax.make_attention_mask(q, k, v, segment_ids=(Q_IDS, KV_IDS), segment_pos=pos, attn_mask_type=mask_type,
                                    window_size=window, mask_convention="te")
  np.testing.assert_array_equal(np.broadcast_to(made, masked.shape), masked)


def test_segment_pos_of_packed_self_attention_is_the_indices_band():
  """Packed self attention: positions within the segments give the band of the indices (j - i within a segment)."""
  ids = segments([[5, 4, 2], [12]], 12)
  q, k, v = qkv(12, 12, kv_heads=2)
  for mask_type, window in (("padding_causal", (3, 0)), ("padding_causal_bottom_right", None)):
    kw = dict(segment_ids=ids, attn_mask_type=mask_type, window_size=window, backend="unfused")
    with_pos = te_jax.dot_product_attention(q, k, v, segment_pos=te_jax.segment_positions(ids), **kw)
    np.testing.assert_allclose(with_pos, te_jax.dot_product_attention(q, k, v, **kw), rtol=1e-6, atol=1e-6)


def _mha(attn_mask_type="padding_causal"):
  return te_flax.MultiHeadAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=2, input_layernorm=False,
                                    fuse_qkv_params=False, enable_rotary_pos_emb=True, attn_mask_type=attn_mask_type)


def test_packed_cross_attention_with_rope_is_each_sequence_alone():
  """A packed batch of cross attention (RoPE and the causal mask at the positions within the segments) gives, for
  each query segment, the attention of that sequence alone over its key sequence, both starting at 0."""
  hidden = 16
  xq, xkv = randn(1, (2, 8, hidden)), randn(2, (2, 10, hidden))
  q_ids, kv_ids = np.asarray(Q_IDS), np.asarray(KV_IDS)
  sd = te_jax.SequenceDescriptor.from_segment_ids_and_pos(
      (Q_IDS, KV_IDS), (jnp.asarray(_np_positions(q_ids)), jnp.asarray(_np_positions(kv_ids))))
  mha = _mha()
  variables = mha.init(jax.random.key(0), xq, xkv, sd, deterministic=True)
  packed = mha.apply(variables, xq, xkv, sd, deterministic=True)
  alone = _mha(attn_mask_type="causal")
  for b in range(2):
    for seg in set(q_ids[b]) - {0}:
      qi, ki = np.flatnonzero(q_ids[b] == seg), np.flatnonzero(kv_ids[b] == seg)
      want = alone.apply(variables, xq[b:b + 1, qi], xkv[b:b + 1, ki], deterministic=True)
      np.testing.assert_allclose(packed[b:b + 1, qi], want, rtol=2e-5, atol=2e-5, err_msg=f"example {b} seg {seg}")


def test_mha_descriptor_equals_explicit_ids_and_positions_linen_and_nnx():
  hidden = 16
  xq, xkv = randn(1, (2, 8, hidden)), randn(2, (2, 10, hidden))
  pos = (jnp.asarray(_np_positions(Q_IDS)), jnp.asarray(_np_positions(KV_IDS)))
  sd = te_jax.SequenceDescriptor.from_segment_ids_and_pos((Q_IDS, KV_IDS), pos)
  mha = _mha()
  variables = mha.init(jax.random.key(0), xq, xkv, sd, deterministic=True)
  got = jax.jit(lambda v, x, y, sd: mha.apply(v, x, y, sd, deterministic=True))(variables, xq, xkv, sd)
  want = jax.jit(lambda v, x, y, ids, pos: mha.apply(v, x, y, segment_ids=ids, segment_pos=pos, deterministic=True))(
      variables, xq, xkv, (Q_IDS, KV_IDS), pos)
  np.testing.assert_array_equal(got, want)
  ours = te_nnx.MultiHeadAttention(hidden, D, H, num_gqa_groups=2, input_layernorm=False, fuse_qkv_params=False,
                                   enable_rotary_pos_emb=True, attn_mask_type="padding_causal",
                                   attention_type="cross", rngs=nnx.Rngs(0))
  te_nnx.from_linen(ours, variables)
  np.testing.assert_array_equal(nnx.jit(lambda m, x, y, sd: m(x, y, segment_ids=sd))(ours, xq, xkv, sd), want)


# ---- SequenceDescriptor -------------------------------------------------------------------------------------------


def _dpa(mask_type, cls=te_flax.DotProductAttention, **kw):
  return cls(head_dim=D, num_attention_heads=H, num_gqa_groups=2, attn_mask_type=mask_type, backend="unfused", **kw)


def _linen_dpa(mask_type, q, k, v, *args, **kw):
  return _dpa(mask_type).apply({}, q, k, v, *args, deterministic=True, **kw)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.fast_cases(1)
def test_descriptor_from_seqlens_is_the_padding_mask(mask_type):
  """One sequence per row: the lengths give the attention of the padding mask of those lengths (Flax's convention,
  True = attend), and the naive attention of that mask; as the mask or as segment_ids, jitted."""
  q_lens, kv_lens = (9, 5), (7, 12)
  q, k, v = qkv(10, 12, kv_heads=2)
  sd = te_jax.SequenceDescriptor.from_seqlens((jnp.asarray(q_lens), jnp.asarray(kv_lens)))
  mask = padding_mask(10, 12, q_lens, kv_lens)
  want = _linen_dpa(mask_type, q, k, v, mask)
  np.testing.assert_array_equal(jax.jit(lambda sd: _linen_dpa(mask_type, q, k, v, sd))(sd),
                                jax.jit(lambda m: _linen_dpa(mask_type, q, k, v, m))(mask))
  np.testing.assert_allclose(_linen_dpa(mask_type, q, k, v, segment_ids=sd), want, rtol=1e-6, atol=1e-6)
  ids = [np.asarray(np.arange(n)[None, :] < np.asarray(lens)[:, None], np.int32) for lens, n in
         ((q_lens, 10), (kv_lens, 12))]
  masked = _position_mask(mask_type, *ids, *(np.broadcast_to(np.arange(n), (2, n)) for n in (10, 12)))
  np.testing.assert_allclose(want, naive_attention(q, k, v, None, masked, 1 / np.sqrt(D)), rtol=TOL, atol=TOL)


def _packed_by_hand(lens, offsets, n):
  """Segment ids and positions of packed sequences, token by token from the lengths and offsets."""
  ids, pos = np.zeros((len(lens), n), np.int32), np.zeros((len(lens), n), np.int32)
  for b, (row_lens, row_offsets) in enumerate(zip(lens, offsets, strict=True)):
    for k, (length, start) in enumerate(zip(row_lens, row_offsets, strict=False)):
      for t in range(max(start, 0), max(start, 0) + max(length, 0)):
        ids[b, t], pos[b, t] = k + 1, t - start
  return ids, pos


# Packed sequences with a gap (intra-row padding) and unused slots (-1), as Transformer Engine pads them.
Q_LENS, Q_OFFSETS = [[3, 4, -1], [2, 2, 3]], [[0, 4, 8, -1], [0, 2, 5, 8]]
KV_LENS, KV_OFFSETS = [[5, 2, -1], [3, 1, 4]], [[0, 5, 7, -1], [1, 4, 6, 10]]


@pytest.mark.parametrize("mask_type,window", [("padding_causal", None), ("padding_causal_bottom_right", None),
                                              ("padding", (1, 1))])
@pytest.mark.fast_cases(1)
def test_descriptor_from_seqlens_and_offsets(mask_type, window):
  """Packed sequences from lengths and offsets: the explicit segment ids and positions built by hand give the same
  attention, and it is the naive attention of the mask of those positions; linen and NNX bit for bit."""
  q, k, v = qkv(9, 10, kv_heads=2)
  (q_ids, q_pos), (kv_ids, kv_pos) = _packed_by_hand(Q_LENS, Q_OFFSETS, 9), _packed_by_hand(KV_LENS, KV_OFFSETS, 10)
  sd = te_jax.SequenceDescriptor.from_seqlens_and_offsets(
      (jnp.asarray(Q_LENS), jnp.asarray(KV_LENS)), (jnp.asarray(Q_OFFSETS), jnp.asarray(KV_OFFSETS)))
  got_ids, got_pos = sd.segments(batch=2, q_len=9, kv_len=10)
  for a, e in zip((*got_ids, *got_pos), (q_ids, kv_ids, q_pos, kv_pos), strict=True):
    np.testing.assert_array_equal(a, e)
  ids, pos = (jnp.asarray(q_ids), jnp.asarray(kv_ids)), (jnp.asarray(q_pos), jnp.asarray(kv_pos))
  run = jax.jit(lambda q, k, v, *a, **kw: _linen_dpa(mask_type, q, k, v, *a, window_size=window, **kw))
  got = run(q, k, v, sd)
  np.testing.assert_array_equal(got, run(q, k, v, segment_ids=ids, segment_pos=pos))
  masked = _position_mask(mask_type, q_ids, kv_ids, q_pos, kv_pos, window)
  np.testing.assert_allclose(got, naive_attention(q, k, v, None, masked, 1 / np.sqrt(D)), rtol=TOL, atol=TOL)
  nnx_dpa = _dpa(mask_type, cls=te_nnx.DotProductAttention)
  np.testing.assert_array_equal(
      nnx.jit(lambda m, q, k, v, sd: m(q, k, v, sd, window_size=window, deterministic=True))(nnx_dpa, q, k, v, sd), got)
  # from_segment_ids_and_pos of the same ids and positions: the same attention.
  np.testing.assert_array_equal(run(q, k, v, te_jax.SequenceDescriptor.from_segment_ids_and_pos(ids, pos)), got)


@pytest.mark.slow
def test_descriptor_gradients_flow_to_q_k_v():
  q, k, v = qkv(9, 10, kv_heads=2)
  sd = te_jax.SequenceDescriptor.from_seqlens_and_offsets(
      (jnp.asarray(Q_LENS), jnp.asarray(KV_LENS)), (jnp.asarray(Q_OFFSETS), jnp.asarray(KV_OFFSETS)))
  (q_ids, q_pos), (kv_ids, kv_pos) = _packed_by_hand(Q_LENS, Q_OFFSETS, 9), _packed_by_hand(KV_LENS, KV_OFFSETS, 10)
  masked = _position_mask("padding_causal", q_ids, kv_ids, q_pos, kv_pos)
  got = _attention_and_grads(lambda q, k, v: _linen_dpa("padding_causal", q, k, v, sd), q, k, v)
  want = _attention_and_grads(lambda q, k, v: naive_attention(q, k, v, None, masked, 1 / np.sqrt(D)), q, k, v)
  _assert_close(got, want)


# ---- bad inputs ----------------------------------------------------------------------------------------------------


def test_bad_sequence_inputs_raise_naming_the_argument():
  q, k, v = qkv(8, 10, kv_heads=2)
  sd = te_jax.SequenceDescriptor.from_seqlens(jnp.asarray([3, 4]))
  pos = (jnp.asarray(_np_positions(Q_IDS)), jnp.asarray(_np_positions(KV_IDS)))
  cases = [
      (lambda: _linen_dpa("causal", q, k, v, sd), ValueError, r"SequenceDescriptor gives the padding.*'causal'"),
      (lambda: _linen_dpa("padding", q, k, v, sd, segment_ids=Q_IDS), ValueError, "give no segment_ids"),
      (lambda: _linen_dpa("padding", q, k, v, segment_ids=sd, segment_pos=pos), ValueError, "give no segment_pos"),
      (lambda: _linen_dpa("padding", q, k, v, segment_pos=sd), TypeError, "segment_pos takes positions"),
      (lambda: _linen_dpa("padding", q, k, v, segment_pos=pos), ValueError, "needs the segment_ids too"),
      (lambda: _linen_dpa("padding", q, k, v, segment_ids=(Q_IDS, KV_IDS), segment_pos=pos[0]), ValueError,
       r"key/value segment_pos must have shape \(B, S\) = \(2, 10\)"),
      (lambda: _linen_dpa("padding", q, k, v, segment_ids=(Q_IDS, KV_IDS), segment_pos=(pos[0] * 1.0, pos[1])),
       TypeError, "query segment_pos must be an integer array"),
      (lambda: te_jax.dot_product_attention(q, k, v, segment_ids=(Q_IDS, KV_IDS), segment_pos=pos,
                                            attn_mask_type="padding", attn_bias_type="alibi"), ValueError,
       "attn_bias_type='alibi'.*segment_pos"),
      (lambda: _linen_dpa("padding", q, k, v, te_jax.SequenceDescriptor.from_seqlens(jnp.asarray([3, 4, 5]))),
       ValueError, "q_seqlens have batch 3; this attention's is 2"),
      (lambda: _dpa("padding_causal", context_parallel="cp").apply({}, q, k, v, segment_ids=(Q_IDS, KV_IDS),
                                                                   segment_pos=pos, deterministic=True),
       ValueError, "segment_pos: context_parallel attention takes the tokens at their indices"),
      (lambda: te_jax.SequenceDescriptor.from_segment_ids_and_pos(Q_IDS), ValueError, "segment_pos is required"),
      (lambda: te_jax.SequenceDescriptor.from_segment_ids_and_pos(Q_IDS, pos[1]), ValueError,
       r"q_segment_pos must have q_segment_ids' shape \(2, 8\)"),
      (lambda: te_jax.SequenceDescriptor.from_seqlens_and_offsets(jnp.asarray(Q_LENS), jnp.asarray(Q_LENS)),
       ValueError, r"q_seq_offsets must have shape \(B, M \+ 1\) = \(2, 4\)"),
      (lambda: te_jax.SequenceDescriptor.from_seqlens(jnp.ones((2, 3), jnp.int32)), ValueError,
       "q_seqlens must be 1-D"),
      (lambda: te_jax.SequenceDescriptor.from_seqlens(jnp.ones(2)), TypeError, "q_seqlens must be an integer"),
      (lambda: te_jax.SequenceDescriptor.from_seqlens((sd, sd, sd)), ValueError, "seqlens must be one array"),
  ]
  for f, error, message in cases:
    with pytest.raises(error, match=message):
      f()


def test_mha_sequence_inputs_raise():
  x = randn(1, (2, 8, 16))
  mha = _mha()
  pos = jnp.asarray(_np_positions(Q_IDS))
  variables = mha.init(jax.random.key(0), x, segment_ids=Q_IDS, deterministic=True)
  with pytest.raises(ValueError, match="give one of the two"):
    mha.apply(variables, x, segment_ids=Q_IDS, segment_pos=pos, positions=jnp.arange(8), deterministic=True)
  with pytest.raises(ValueError, match=r"SequenceDescriptor gives the padding.*'causal'"):
    mha.apply(variables, x, None, te_jax.SequenceDescriptor.from_seqlens(jnp.asarray([3, 8])),
              deterministic=True, attn_mask_type="causal")
  with pytest.raises(ValueError, match="decode=True does not take segment_ids, segment_pos or a SequenceDescriptor"):
    mha.init(jax.random.key(0), x, None, te_jax.SequenceDescriptor.from_seqlens(jnp.asarray([3, 8])), decode=True,
             deterministic=True)


# ---- Softmax -------------------------------------------------------------------------------------------------------


def _np_softmax(x, scale, masked=None, sink=None, dtype=np.float64):
  """Transformer Engine's Softmax in numpy: ``masked`` True where masked out (its mask == 1), ``sink`` one more logit
  in each denominator (unscaled); a row with every key masked gives zeros."""
  z = np.asarray(x, dtype) * dtype(scale)
  keep = np.ones(z.shape, bool) if masked is None else ~np.broadcast_to(np.asarray(masked, bool), z.shape)
  z = np.where(keep, z, -np.inf)
  m = np.max(z, axis=-1, keepdims=True)
  extra = None if sink is None else np.broadcast_to(np.asarray(sink, dtype), (*z.shape[:-1], 1))
  if extra is not None:
    m = np.maximum(m, extra)
  m = np.where(np.isfinite(m), m, 0)
  e = np.where(keep, np.exp(z - m), 0)
  total = np.sum(e, axis=-1, keepdims=True) + (0 if extra is None else np.exp(extra - m))
  return np.where(total > 0, e / np.where(total > 0, total, 1), 0)


SM_SHAPE = (2, 3, 5, 7)


def _logits(dtype=jnp.float32, seed=0, shape=SM_SHAPE):
  return randn(seed, shape, jnp.float32).astype(dtype) * 3


def _te_mask():
  """(B, 1, Sq, Sk) int, 1 = masked out; row 1 of example 0 fully masked."""
  mask = (np.random.default_rng(3).random((2, 1, 5, 7)) < 0.4).astype(np.int32)
  mask[0, 0, 1] = 1
  return mask


def _causal(shape=SM_SHAPE):
  return np.arange(shape[-1])[None, :] > np.arange(shape[-2])[:, None]


@pytest.mark.parametrize("fusion", ["scaled", "scaled_masked", "scaled_upper_triang_masked"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one", "learnable"])
@pytest.mark.fast_cases(3)
def test_softmax_against_numpy(fusion, softmax_type):
  x = _logits()
  bias = randn(5, (1, 3, 5, 7))
  mask = _te_mask() if fusion == "scaled_masked" else None
  masked = {"scaled": None, "scaled_masked": mask, "scaled_upper_triang_masked": _causal()}[fusion]
  offset = randn(6, (1, 3, 1, 1)) if softmax_type == "learnable" else None
  sink = {"vanilla": None, "off_by_one": 0.0, "learnable": offset}[softmax_type]
  sm = te_flax.Softmax(scale_factor=0.5, softmax_fusion_type=fusion, softmax_type=softmax_type)
  got = sm.apply({}, x, None if mask is None else jnp.asarray(mask), bias, offset)
  assert got.dtype == jnp.float32 and got.shape == SM_SHAPE
  biased = np.asarray(x) + np.asarray(bias)
  ref64 = _np_softmax(biased, 0.5, masked, None if sink is None else np.asarray(sink))
  ref32 = _np_softmax(biased, 0.5, masked, None if sink is None else np.asarray(sink), np.float32)
  assert_within_rule(got, ref32, ref64, f"{fusion} {softmax_type}")
  if masked is not None:
    assert np.all(np.asarray(got)[np.broadcast_to(np.asarray(masked, bool), SM_SHAPE)] == 0)
  # NNX: the same module, bit for bit.
  nnx_sm = te_nnx.Softmax(scale_factor=0.5, softmax_fusion_type=fusion, softmax_type=softmax_type)
  np.testing.assert_array_equal(nnx_sm(x, None if mask is None else jnp.asarray(mask), bias, offset), got)


def test_softmax_mask_conventions_and_dtypes():
  x = _logits()
  mask = _te_mask()
  te_mask = te_flax.Softmax(softmax_fusion_type="SCALED_MASKED")
  want = te_mask.apply({}, x, jnp.asarray(mask))
  for given in (jnp.asarray(mask, bool), jnp.asarray(mask, jnp.float32)):  # nonzero = masked out
    np.testing.assert_array_equal(te_mask.apply({}, x, given), want)
  flax_mask = te_flax.Softmax(softmax_fusion_type="scaled_masked", mask_convention="flax")
  np.testing.assert_array_equal(flax_mask.apply({}, x, jnp.asarray(mask == 0)), want)
  got = te_mask.apply({}, x.astype(jnp.bfloat16), jnp.asarray(mask))
  assert got.dtype == jnp.bfloat16
  # bfloat16 in and out: the float32 softmax of the bfloat16 logits, rounded once to bfloat16 (half an ulp, 2^-9).
  want = _np_softmax(np.asarray(x.astype(jnp.bfloat16), np.float64), 1.0, mask)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=2**-12)


def test_softmax_gradients():
  x = _logits(shape=(1, 2, 3, 4))
  mask = jnp.asarray(np.random.default_rng(1).random((1, 1, 3, 4)) < 0.3)
  offset = randn(7, (1, 2, 1, 1))
  for fusion, m in (("scaled", None), ("scaled_masked", mask), ("scaled_upper_triang_masked", None)):
    sm = te_flax.Softmax(scale_factor=0.7, softmax_fusion_type=fusion)
    check_grads(lambda x, sm=sm, m=m: sm.apply({}, x, m), (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
  sm = te_flax.Softmax(softmax_fusion_type="scaled_masked", softmax_type="learnable")
  check_grads(lambda x, o: sm.apply({}, x, mask, None, o), (x, offset), order=1, modes=["rev"], atol=1e-2,
              rtol=1e-2)


def test_softmax_bad_arguments_raise():
  x = _logits()
  cases = [
      (lambda: te_flax.Softmax(softmax_type="scaled_masked").apply({}, x), ValueError,
       "softmax_fusion_type='scaled_masked'"),
      (lambda: te_flax.Softmax(softmax_fusion_type="masked").apply({}, x), ValueError,
       "softmax_fusion_type must be one of"),
      (lambda: te_nnx.Softmax(softmax_type="sink"), ValueError, "softmax_type must be one of"),
      (lambda: te_nnx.Softmax(mask_convention="torch"), ValueError, "mask_convention must be one of"),
      (lambda: te_nnx.Softmax(scale_factor=float("nan")), ValueError, "scale_factor must be a finite"),
      (lambda: te_flax.Softmax().apply({}, x, jnp.asarray(_te_mask())), ValueError, "takes no mask"),
      (lambda: te_flax.Softmax(softmax_fusion_type="scaled_masked").apply({}, x), ValueError, "needs a mask"),
      (lambda: te_flax.Softmax(softmax_fusion_type="scaled_masked").apply({}, x, jnp.ones((2, 1, 5, 6))),
       ValueError, r"mask of shape \(2, 1, 5, 6\) must broadcast"),
      (lambda: te_flax.Softmax().apply({}, x, None, jnp.ones((3, 5, 6))), ValueError, "bias of shape"),
      (lambda: te_flax.Softmax().apply({}, x, None, None, jnp.zeros((1, 3, 1, 1))), ValueError,
       "softmax_offset is the learnable softmax's"),
      (lambda: te_flax.Softmax(softmax_type="learnable").apply({}, x), ValueError, "needs softmax_offset"),
      (lambda: te_flax.Softmax(softmax_type="learnable").apply({}, x, None, None, jnp.zeros((1, 3, 5, 7))),
       ValueError, r"softmax_offset of shape \(1, 3, 5, 7\) must broadcast to \(2, 3, 5, 1\)"),
      (lambda: te_flax.Softmax().apply({}, jnp.zeros((2, 3), jnp.int32)), TypeError, "inputs must be a float32"),
  ]
  for f, error, message in cases:
    with pytest.raises(error, match=message):
      f()


# ---- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fusion", ["scaled", "scaled_masked", "scaled_upper_triang_masked"])
def test_gpu_softmax_runs_the_cuda_kernel(fusion, gpu):
  x = jax.device_put(_logits(shape=(2, 4, 64, 300)), gpu)
  mask = np.random.default_rng(2).random((2, 1, 64, 300)) < 0.3 if fusion == "scaled_masked" else None
  sm = te_flax.Softmax(scale_factor=0.25, softmax_fusion_type=fusion)
  args = (x,) if mask is None else (x, jax.device_put(jnp.asarray(mask), gpu))
  fn = jax.jit(lambda *a: sm.apply({}, *a))
  assert "te_softmax_fwd_cuda" in fn.lower(*args).compile().as_text()
  masked = mask if fusion == "scaled_masked" else (_causal((64, 300)) if fusion != "scaled" else None)
  assert_within_rule(fn(*args), _np_softmax(x, 0.25, masked, dtype=np.float32), _np_softmax(x, 0.25, masked), fusion)


@pytest.mark.gpu
def test_gpu_fused_attention_at_segment_positions(gpu):
  """cuDNN (the positions' band as its additive mask) against the unfused backend and the naive attention."""
  q, k, v = (jax.device_put(a.astype(jnp.bfloat16), gpu) for a in qkv(8, 10, kv_heads=2, d=64))
  pos = (jnp.asarray(_np_positions(Q_IDS)), jnp.asarray(_np_positions(KV_IDS)))
  kw = dict(segment_ids=(Q_IDS, KV_IDS), segment_pos=pos, attn_mask_type="padding_causal")
  assert te_jax.attention_backend(q, k, v, **kw).name == "fused"
  fn = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend="fused", **kw))
  assert "__cudnn$fmha" in fn.lower(q, k, v).compile().as_text()
  masked = _position_mask("padding_causal", Q_IDS, KV_IDS, *pos)
  ref = naive_attention(*(a.astype(jnp.float32) for a in (q, k, v)), None, masked, 1 / 8)
  unfused = te_jax.dot_product_attention(q, k, v, backend="unfused", **kw).astype(jnp.float32)
  fused = fn(q, k, v).astype(jnp.float32)
  err, err_unfused = float(jnp.max(jnp.abs(fused - ref))), float(jnp.max(jnp.abs(unfused - ref)))
  assert err <= 2 * err_unfused + 2e-3 * float(jnp.max(jnp.abs(ref))), (err, err_unfused)
