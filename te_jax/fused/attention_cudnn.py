"""The cuDNN attention backend: flash attention through JAX's cuDNN custom call (``__cudnn$fmha*``), bf16/fp16 and
the FP8 forward, and what it supports on this machine."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from te_jax._core import native
from te_jax._core.dtypes import HALF_DTYPES as _FUSED_DTYPES
from te_jax._core.jax_compat import cudnn_attention
from te_jax._core.manual_axes import max_over_shards
from te_jax._core.scaling import compute_scale, fp8_max
from te_jax._core.explicit import typed_vjp
from te_jax.fused.attention_config import BOTTOM_RIGHT_TYPES, AttentionConfig
from te_jax.fused.attention_masks import alibi_bias, band_mask, combine
from te_jax.fused.attention_unfused import unfused
from te_jax.ops.quantize import amax, saturating_cast

__all__ = ["fp8_attention", "fp8_attention_support", "fp8_unsupported", "fused", "fused_reason", "fused_unsupported",
           "native_window"]



def _gpu_compute_capability() -> tuple[int, int] | None:
  try:
    if jax.default_backend() != "gpu":
      return None
    cc = jax.devices()[0].compute_capability
  except (RuntimeError, AttributeError):
    return None
  major, minor = cc.split(".")[:2]
  return int(major), int(minor)


def native_window(cfg: AttentionConfig) -> tuple[bool, int | None]:
  """(cuDNN's causal mask, cuDNN's sliding window length) for the band ``lo <= j - i <= hi``, where cuDNN can express
  it: cuDNN's causal mask is top-left (j <= i), its window ``(i - w, i]`` comes with the causal mask."""
  if cfg.per_sequence or cfg.has_segment_pos:  # at each sequence's lengths or positions: a dense mask of the data
    return False, None
  if cfg.hi == 0 and (cfg.align == 0 or cfg.mask_type not in BOTTOM_RIGHT_TYPES):
    if cfg.lo == -math.inf:
      return True, None
    if cfg.q_len == cfg.kv_len:
      return True, int(-cfg.lo) + 1
  return False, None


def _needs_dense_mask(cfg: AttentionConfig) -> bool:
  causal, window = native_window(cfg)
  band_left = (cfg.lo != -math.inf and window is None) or (cfg.hi != math.inf and not causal)
  return cfg.mask_shape is not None or cfg.has_segment_ids or band_left


def fused_unsupported(cfg: AttentionConfig) -> str | None:
  """Why cuDNN (through JAX 0.11.2) cannot run this configuration, or None when it can."""
  cc = _gpu_compute_capability()
  if cc is None:
    return "no GPU: cuDNN attention runs on NVIDIA GPUs only"
  fa, version = cudnn_attention()
  if fa is None:
    return version
  if cc < (8, 0):
    return f"compute capability {cc[0]}.{cc[1]} < 8.0: no cuDNN flash attention"
  if cfg.dtype not in _FUSED_DTYPES:
    return f"dtype {cfg.dtype}: cuDNN flash attention takes bfloat16 or float16"
  max_d = 256 if cc >= (9, 0) else 128
  if cfg.head_dim != cfg.v_head_dim:
    return f"query/key head dim {cfg.head_dim} != value head dim {cfg.v_head_dim}"
  if cfg.head_dim > max_d or cfg.head_dim % 8:
    return f"head dim {cfg.head_dim}: cuDNN needs a multiple of 8 up to {max_d} on compute capability {cc[0]}.{cc[1]}"
  if cfg.softmax_type != "vanilla":
    return f"softmax_type={cfg.softmax_type!r}: JAX's cuDNN call has no softmax sink"
  if cfg.dropout_rate > 0:
    return ("dropout: JAX's cuDNN call takes its dropout seed as a compile-time constant, so a traced PRNG key cannot "
            "drive it (every step would drop the same entries)")
  if cfg.bias_type != "no_bias" and (cfg.q_len % 2 or cfg.kv_len % 2):
    return f"a bias with an odd sequence length ({cfg.q_len}, {cfg.kv_len}): cuDNN's bias backward needs even ones"
  return None


def fused_reason(cfg: AttentionConfig) -> str:
  causal, window = native_window(cfg)
  parts = ["cuDNN flash attention"]
  if causal:
    parts.append("causal mask in cuDNN" + (f", sliding window {window}" if window else ""))
  if _needs_dense_mask(cfg):
    parts.append("mask as an additive bias (T*S memory per example)")
  if cfg.bias_type == "alibi":
    parts.append("ALiBi as an additive bias")
  if cfg.tensor_format == "SBHD":
    parts.append("SBHD transposed to BSHD around the call")
  return "; ".join(parts)


def fused(q, k, v, bias, dense_mask, cfg: AttentionConfig):
  """cuDNN flash attention: BSHD q, k, v (bf16/fp16) -> BSHD output."""
  fa, cudnn_version = cudnn_attention()
  causal, window = native_window(cfg)
  h, t, s = cfg.heads, cfg.q_len, cfg.kv_len
  total = None
  has_dbias = cfg.bias_type in ("pre_scale_bias", "post_scale_bias")
  if has_dbias:
    # cuDNN's dbias has the bias's shape with all H heads; autodiff sums it back over broadcast heads. JAX's own test
    # (fused_attention_stablehlo_test.py, test_sdpa_dbias) notes an all-zero dbias for batch > 1 with older cuDNN;
    # the GPU tests check dbias against the unfused gradient for bias batch 1 and 2 on every run.
    # cuDNN adds its bias after the scale: a pre-scale bias b, scale * (q.k + b), is the post-scale bias scale * b
    # (its gradient through the product).
    if cfg.bias_type == "pre_scale_bias":
      bias = bias.astype(jnp.float32) * jnp.float32(cfg.scale)
    total = jnp.broadcast_to(bias.astype(q.dtype), (bias.shape[0], h, t, s))
  elif cfg.bias_type == "alibi":
    total = alibi_bias(cfg).astype(q.dtype)
  if dense_mask is not None:
    negative = fa.get_large_negative_number(q.dtype)
    mask_bias = jnp.where(dense_mask, negative, jnp.zeros((), q.dtype))
    total = mask_bias if total is None else total + mask_bias
    total = jnp.broadcast_to(total, (*total.shape[:2], t, s))  # a key-padding mask (.., 1, S) covers every query
  unused = jnp.zeros(0, q.dtype)
  layout = fa.AttentionLayout.BTNH
  fa.check_layout(q, k, v, total, None, None, None, None, None, None, layout)
  mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
  out = fa._dot_product_attention(  # noqa: SLF001 - the one entry that lets us say whether dbias is needed
      q, k, v, unused if total is None else total, unused, unused, unused, unused, unused, unused,
      cfg.scale, 0, 0.0, (total is not None, has_dbias), mask_type, layout.value, window, cudnn_version, False)
  if dense_mask is not None:  # fully masked rows: cuDNN averages v (all logits equal), the definition says 0
    valid = ~jnp.all(combine(dense_mask, band_mask(cfg)), axis=-1)  # (B|1, H|1, T); the band: causal in cuDNN
    out = out * jnp.transpose(valid, (0, 2, 1))[..., None].astype(out.dtype)
  return out



def fp8_attention_support(head_dim: int = 128, q_len: int = 128, kv_len: int = 128, *, training: bool = True
                          ) -> tuple[bool, str]:
  """Whether JAX's cuDNN FP8 flash attention (``__cudnn$fmhaSoftmaxF8``) runs here for these sizes, and why (not).

  JAX 0.11.2's ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)`` takes E4M3/E5M2
  q, k, v with per-tensor descale/scale factors (q, k, v, S = softmax output, O, and dO, dP, dQ, dK, dV for the
  backward), returns an FP8 output and the amax of S and O; no bias, no mask other than causal, no padding, no dropout;
  training needs head dim 128 and sequence lengths that are multiples of 128, inference a head dim that is a multiple
  of 16 up to 256. cuDNN runs it on Hopper (compute capability 9.0) and later.

  ``fp8_dpa=True`` uses its forward (inference) call with per-tensor current scaling (see ``_fp8_forward``): E4M3's 3
  mantissa bits give errors of a few percent of max|out| against float32 attention. Its FP8 backward call is not used,
  so the backward pass runs in the input precision: it needs the scale factors of dQ, dK, dV and dP before it runs
  (a delayed-scaling state), and even with each from its tensor's exact amax it is slower than the bf16 call and far
  less accurate (the measurements are in the README's table of decisions).
  """
  if native.REFERENCE_FORCED:
    return False, "TE_JAX_REFERENCE=1 forces the pure-JAX path"
  cc = _gpu_compute_capability()
  if cc is None:
    return False, "no GPU"
  fa, version = cudnn_attention()
  if fa is None:
    return False, version
  if cc < (9, 0):
    return False, f"compute capability {cc[0]}.{cc[1]} < 9.0: cuDNN FP8 attention needs Hopper or later"
  if training and not (head_dim == 128 and q_len % 128 == 0 and kv_len % 128 == 0):
    return False, (f"training needs head dim 128 and sequence lengths multiple of 128, got D={head_dim}, "
                   f"T={q_len}, S={kv_len}")
  if not training and not (head_dim <= 256 and head_dim % 16 == 0):
    return False, f"inference needs a head dim that is a multiple of 16 up to 256, got {head_dim}"
  return True, f"cuDNN {version} FP8 flash attention on compute capability {cc[0]}.{cc[1]}"


def fp8_unsupported(cfg: AttentionConfig) -> str | None:
  causal, window = native_window(cfg)
  if cfg.bias_type != "no_bias" or cfg.mask_shape is not None or cfg.has_segment_ids or cfg.dropout_rate > 0:
    return "cuDNN FP8 attention takes no bias, mask, segment ids or dropout"
  if cfg.softmax_type != "vanilla":
    return f"softmax_type={cfg.softmax_type!r}: cuDNN FP8 attention has only the vanilla softmax"
  if window is not None or (_band_mask_needed(cfg) and not causal):
    return "cuDNN FP8 attention takes no sliding window and only the top-left causal mask"
  if cfg.head_dim != cfg.v_head_dim:
    return "query/key and value head dims differ"
  if cfg.dtype not in _FUSED_DTYPES:
    return f"dtype {cfg.dtype}: fp8_dpa=True takes bfloat16 or float16 inputs (quantized inside)"
  ok, reason = fp8_attention_support(cfg.head_dim, cfg.q_len, cfg.kv_len, training=False)
  return None if ok else reason


def _band_mask_needed(cfg: AttentionConfig) -> bool:
  return cfg.lo != -math.inf or cfg.hi != math.inf


_E4M3_MAX = fp8_max(jnp.float8_e4m3fn)


def _quantize_e4m3(x):
  """Per-tensor current scaling: (x * s) in E4M3 with s = 448 / amax(x), and 1 / s, as the (1, 1, 1, 1) float32
  factors cuDNN takes."""
  (x_amax,) = max_over_shards([amax(x)], [None])  # inside shard_map: the whole tensor's
  scale = compute_scale(x_amax, jnp.float32(1.0), _E4M3_MAX)
  x8 = saturating_cast(x.astype(jnp.float32), scale, jnp.float8_e4m3fn)
  return x8, (1.0 / scale).reshape(1, 1, 1, 1), x_amax


def _fp8_forward(q, k, v, cfg: AttentionConfig):
  """cuDNN FP8 flash attention forward (``__cudnn$fmhaSoftmaxF8``) on BSHD q, k, v; output in q's dtype.

  Scaling: q, k, v by their own amax (current scaling); the softmax output P in [0, 1] by 448 (P's full E4M3 range);
  the output O by 448 / (2 amax(v)): each output row is a convex combination of rows of v, so |O| <= amax(v), and the
  factor 2 leaves room for the rounding of P (its row sums are within a few ulps of 1).
  """
  fa, cudnn_version = cudnn_attention()
  causal, _ = native_window(cfg)
  q8, descale_q, _ = _quantize_e4m3(q)
  k8, descale_k, _ = _quantize_e4m3(k)
  v8, descale_v, amax_v = _quantize_e4m3(v)
  scale_s = jnp.full((1, 1, 1, 1), _E4M3_MAX, jnp.float32)
  scale_o = compute_scale(amax_v, jnp.float32(1.0), _E4M3_MAX, margin=1).reshape(1, 1, 1, 1)
  fa.check_layout(q8, k8, v8, None, None, None, None, None, None, None, fa.AttentionLayout.BTNH)
  out8, _, _ = fa._dot_product_attention_fp8_fwd(  # noqa: SLF001 - the inference entry (no residuals)
      q8, k8, v8, [descale_q, descale_k, descale_v, 1.0 / scale_s, scale_s, scale_o], cfg.scale, causal,
      fa.AttentionLayout.BTNH.value, cudnn_version)
  return (out8.astype(jnp.float32) / scale_o).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_attention(q, k, v, cfg: AttentionConfig):
  return _fp8_forward(q, k, v, cfg)


def _fp8_attention_fwd(q, k, v, cfg):
  return _fp8_forward(q, k, v, cfg), (q, k, v)


def _fp8_attention_bwd(cfg, res, g):
  """The gradient of attention in the input precision at the same q, k, v (cuDNN when it can, else unfused): JAX's
  FP8 backward needs the scales of dQ, dK, dV and dP before it runs, which current scaling cannot give."""
  q, k, v = res
  exact = dataclasses.replace(cfg, fp8_dpa=False)
  name = "fused" if fused_unsupported(exact) is None else "unfused"
  band = None if name == "fused" else band_mask(exact)

  def f(q, k, v):
    return fused(q, k, v, None, None, exact) if name == "fused" else unfused(q, k, v, None, band, None, exact)

  return jax.vjp(f, q, k, v)[1](g)


fp8_attention.defvjp(*typed_vjp(_fp8_attention_fwd, _fp8_attention_bwd, nondiff_argnums=(3,)))

