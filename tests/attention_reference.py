"""The attention tests' independent reference: naive attention one head at a time, its mask built by direct
comparisons of positions, ``jax.nn.softmax`` in float32; and their random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import random_normal

import te_jax
from te_jax.fused import attention_cudnn, attention_masks
from te_jax.fused.attention import AttentionBackend

HIGHEST = jax.lax.Precision.HIGHEST
B, H, D = 2, 4, 8


# ---- the naive reference -------------------------------------------------------------------------------------------


def _sequence_diagonals(b, t, s, mask, segment_ids):
  """(b, t, s) key position minus its query's diagonal under "padding_causal_bottom_right": each sequence aligned at
  its own lengths, ``(j - start_kv) - (i - start_q) - (s_seq - t_seq)``, from the segments' starts and lengths found
  one token at a time (the sequences of a padding mask: its attended rows and columns, from position 0)."""
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
  else:
    attend = np.broadcast_to(np.asarray(mask, bool), (b, 1, t, s))[:, 0]
    q_ids, kv_ids = attend.any(axis=2).astype(int), attend.any(axis=1).astype(int)
  out = np.zeros((b, t, s), np.int64)
  for n in range(b):
    for i in range(t):
      for j in range(s):
        seg = q_ids[n, i]
        q_start, kv_start = list(q_ids[n]).index(seg), (list(kv_ids[n]).index(seg) if seg in kv_ids[n] else 0)
        t_seq, s_seq = int(np.sum(q_ids[n] == seg)), int(np.sum(kv_ids[n] == seg))
        out[n, i, j] = (j - kv_start) - (i - q_start) - (s_seq - t_seq)
  return out


def naive_mask(b, h, t, s, mask_type, mask=None, segment_ids=None, window=None):
  """True = masked out, (b, h, t, s), numpy, from the definitions (positions compared one condition at a time);
  ``mask`` is the caller's, in Flax's convention (True = attend)."""
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  diag = i + (s - t) if mask_type.endswith("bottom_right") else i  # the key position on each query's diagonal
  rel = (j - diag)[None, None]  # key position minus the diagonal's
  if mask_type == "padding_causal_bottom_right":  # the diagonal of each sequence at its own lengths
    rel = _sequence_diagonals(b, t, s, mask, segment_ids)[:, None]
  out = np.zeros((b, h, t, s), bool)
  if "causal" in mask_type:
    out |= rel > 0
  if window is not None:
    left, right = window
    if left >= 0:
      out |= rel < -left
    if right >= 0:
      out |= rel > right
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

def padding_mask(t, s, q_lens=(9, 5), kv_lens=(7, 12)):
  """(B, 1, T, S), True = attend (Flax's convention): query row i or key j beyond each example's length is masked."""
  q_pad = np.arange(t)[None, :] >= np.minimum(np.asarray(q_lens), t)[:, None]
  kv_pad = np.arange(s)[None, :] >= np.minimum(np.asarray(kv_lens), s)[:, None]
  return jnp.asarray(~(q_pad[:, :, None] | kv_pad[:, None, :])[:, None])


def segments(lengths_per_example, n):
  """(B, n) ids: consecutive segments 1, 2, ... of the given lengths, then padding (0)."""
  ids = np.zeros((len(lengths_per_example), n), np.int32)
  for b, lengths in enumerate(lengths_per_example):
    pos = 0
    for seg, length in enumerate(lengths, start=1):
      ids[b, pos:pos + length] = seg
      pos += length
  return jnp.asarray(ids)


def assert_auto_backend(choice):
  """What "auto" must pick on this machine for a bfloat16 configuration cuDNN supports (every one passed here is
  one the GPU tests run fused): cuDNN on a GPU machine, else unfused, saying that there is no GPU."""
  if attention_cudnn._gpu_compute_capability() is not None:  # noqa: SLF001
    assert choice.name == "fused", choice
  else:
    assert choice == AttentionBackend("unfused", "no GPU: cuDNN attention runs on NVIDIA GPUs only"), choice
