"""``dot_product_attention``: scaled dot-product attention with masks, bias, dropout, sliding windows and GQA.

The math, per batch ``b`` and query head ``h`` (key/value head ``h // (H // Hk)``, so GQA and MQA share K and V):

    logits[i, j] = scale * <q[i], k[j]> (+ bias[i, j])          scale defaults to 1 / sqrt(D)
    P[i, :]      = softmax(logits[i, :] over the j not masked)   a fully masked row gives P[i, :] = 0 (output 0)
    P            = P * keep / (1 - rate)                         dropout, keep ~ Bernoulli(1 - rate)
    out[i]       = sum_j P[i, j] v[j]

**A mask is True where attention is masked out** (NVIDIA Transformer Engine's convention since 1.7; the opposite of
``jax.nn.dot_product_attention``'s). What is masked, for query ``i`` of ``T`` and key ``j`` of ``S``:

- ``"padding"`` (and the ``padding_*`` types): the explicit ``mask``, or, from ``segment_ids``, every pair in
  different segments or touching a token of segment 0 (padding); packed sequences attend within their segment only.
- ``"causal"``: ``j > i`` (top-left aligned); ``"causal_bottom_right"``: ``j > i + (S - T)`` (the last query sees
  every key, as in decoding with a KV cache); ``"padding_causal"``, ``"padding_causal_bottom_right"``: both.
- ``"arbitrary"``: the explicit ``mask`` only (plus ``segment_ids`` when given).
- ``window_size=(left, right)``: keys outside ``i + a - left <= j <= i + a + right`` (``a = S - T`` for the bottom-right
  types, else 0; -1 leaves that side unbounded). With a causal type ``right`` must be 0 or -1.

Bias: ``"post_scale_bias"`` adds ``bias`` (broadcastable to ``(B, H, T, S)``) after the scaling, and its gradient
flows; ``"alibi"`` adds ``-slope_h * |j - i - a|`` with the geometric slopes of Press et al. (ALiBi, 2022),
``slope_h = 2^(-8 (h + 1) / n)`` for ``n`` a power of two (see ``alibi_slopes``).

Two backends compute the same function:

- ``"unfused"``: plain jnp (two einsums, a float32 softmax written through one function, ``_softmax``, the seam for
  te_jax's fused softmax kernels). Runs everywhere; the reference for the tests.
- ``"fused"``: cuDNN flash attention through JAX's cuDNN custom call (``__cudnn$fmha*``): the causal mask and the
  causal sliding window natively (cuDNN skips the masked blocks), the other masks as an additive bias of large negative
  values, fully masked rows zeroed after the call. ``attention_backend`` says which backend a configuration gets and
  why; ``"auto"`` takes the fused one when it can.

FP8: ``fp8_attention_support`` reports what JAX's cuDNN FP8 flash attention offers here; ``fp8=True`` runs the forward
pass in FP8 (E4M3, per-tensor current scaling) and the backward pass in the input precision (see
``fp8_attention_support`` and ``_fp8_forward``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import _native
from te_jax._manual_axes import max_over_shards, to_common_varying
from te_jax.softmax import scaled_masked_softmax, scaled_softmax

__all__ = [
    "ATTN_BIAS_TYPES",
    "ATTN_MASK_TYPES",
    "AttentionBackend",
    "QKV_LAYOUTS",
    "alibi_bias_at",
    "alibi_slopes",
    "attention_backend",
    "backend_report",
    "dot_product_attention",
    "fp8_attention_support",
    "make_attention_mask",
]

ATTN_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                   "padding_causal_bottom_right", "arbitrary")
ATTN_BIAS_TYPES = ("no_bias", "post_scale_bias", "alibi")
#: layout -> (tensor format, packing): "qkv" packs (B, S, 3, H, D) in ``query``; "kv" packs (B, S, 2, H, D) in ``key``.
QKV_LAYOUTS = {
    "BSHD": ("BSHD", None), "SBHD": ("SBHD", None),
    "BS3HD": ("BSHD", "qkv"), "SB3HD": ("SBHD", "qkv"),
    "BSHD_BS2HD": ("BSHD", "kv"), "SBHD_SB2HD": ("SBHD", "kv"),
}
BACKENDS = ("auto", "fused", "unfused")
_PADDING_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")
_CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
_BOTTOM_RIGHT_TYPES = ("causal_bottom_right", "padding_causal_bottom_right")
_FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class AttentionBackend(NamedTuple):
  """Which backend a configuration runs on, and why."""

  name: str  # "fused" or "unfused"
  reason: str


@dataclasses.dataclass(frozen=True)
class _Config:
  """The static, validated description of one attention call (shapes in BSHD terms)."""

  batch: int
  q_len: int  # T
  kv_len: int  # S
  heads: int  # H
  kv_heads: int  # Hk
  head_dim: int  # D of q and k
  v_head_dim: int
  dtype: Any
  mask_type: str
  bias_type: str
  bias_shape: tuple[int, ...] | None
  mask_shape: tuple[int, ...] | None
  has_segment_ids: bool
  scale: float
  dropout_rate: float
  lo: float  # masked unless lo <= j - i <= hi (the causal mask and the window), -inf / inf when unbounded
  hi: float
  tensor_format: str
  fp8: bool

  @property
  def align(self) -> int:
    return self.kv_len - self.q_len if self.mask_type in _BOTTOM_RIGHT_TYPES else 0


# ---- argument checks -----------------------------------------------------------------------------------------------


def _unpack(query, key, value, qkv_layout: str):
  """Splits packed layouts into (q, k, v), each in its tensor format."""
  if qkv_layout not in QKV_LAYOUTS:
    raise ValueError(f"qkv_layout must be one of {tuple(QKV_LAYOUTS)}, got {qkv_layout!r}")
  _, packing = QKV_LAYOUTS[qkv_layout]
  if packing == "qkv":
    if key is not None or value is not None:
      raise ValueError(f"qkv_layout={qkv_layout!r} packs q, k and v in `query`: key and value must be None")
    if query.ndim != 5 or query.shape[2] != 3:
      raise ValueError(f"qkv_layout={qkv_layout!r}: query must be (B, S, 3, H, D) or (S, B, 3, H, D), got "
                       f"{query.shape}")
    return query[:, :, 0], query[:, :, 1], query[:, :, 2]
  if packing == "kv":
    if key is None or value is not None:
      raise ValueError(f"qkv_layout={qkv_layout!r} packs k and v in `key`: key is required and value must be None")
    if key.ndim != 5 or key.shape[2] != 2:
      raise ValueError(f"qkv_layout={qkv_layout!r}: key must be (B, S, 2, H, D) or (S, B, 2, H, D), got {key.shape}")
    return query, key[:, :, 0], key[:, :, 1]
  if key is None or value is None:
    raise ValueError(f"qkv_layout={qkv_layout!r} takes separate query, key and value")
  return query, key, value


def _check_window(window_size, mask_type: str) -> tuple[int, int] | None:
  if window_size is None:
    return None
  if (not isinstance(window_size, Sequence) or len(window_size) != 2
      or not all(isinstance(w, (int, np.integer)) and w >= -1 for w in window_size)):
    raise ValueError(f"window_size must be None or (left, right) with ints >= -1 (-1: unbounded), got {window_size!r}")
  left, right = int(window_size[0]), int(window_size[1])
  if mask_type in _CAUSAL_TYPES and right not in (0, -1):
    raise ValueError(f"window_size={window_size!r} with attn_mask_type={mask_type!r}: a causal mask allows no key "
                     "right of the diagonal, so window_size[1] must be 0 or -1")
  return left, right


def _check_broadcastable(name: str, shape, full: tuple[int, int, int, int], query_broadcast: bool = False):
  """``shape`` must be 4-D with each of B and H either full or 1, S full, and T full (or 1 with
  ``query_broadcast``: a mask over the keys only, such as a padding mask (B, 1, 1, S))."""
  b, h, t, s = full
  queries = (t, 1) if query_broadcast else (t,)
  if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2] not in queries or shape[3] != s:
    t_name, t_value = ("T or 1", f"{t} or 1") if query_broadcast else ("T", f"{t}")
    raise ValueError(f"{name} must have shape (B or 1, H or 1, {t_name}, S) = ({b} or 1, {h} or 1, {t_value}, {s}), "
                     f"got {tuple(shape)}")


def _segment_pair(segment_ids, batch: int, q_len: int, kv_len: int):
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be one (B, S) array (self-attention) or a pair (q_ids (B, T), kv_ids (B, S))")
    q_ids, kv_ids = segment_ids
  else:
    q_ids = kv_ids = segment_ids
  for name, ids, n in (("query segment_ids", q_ids, q_len), ("key/value segment_ids", kv_ids, kv_len)):
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array (0 = padding), got {ids.dtype}")
    if tuple(ids.shape) != (batch, n):
      raise ValueError(f"{name} must have shape (B, {'T' if name[0] == 'q' else 'S'}) = ({batch}, {n}), got "
                       f"{tuple(ids.shape)}")
  return q_ids, kv_ids


def _configure(q, k, v, bias, mask, segment_ids, *, attn_mask_type, attn_bias_type, scale_factor, dropout_rate,
               window_size, tensor_format, fp8) -> _Config:
  """Checks every argument (clear errors before XLA sees anything) and returns the static configuration."""
  for name, x in (("query", q), ("key", k), ("value", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be 4-D ({tensor_format}) after unpacking, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"query, key and value must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if tensor_format == "SBHD":
    (t, b, h, d), (s, bk, hk, dk), (sv, bv, hv, dv) = q.shape, k.shape, v.shape
  else:
    (b, t, h, d), (bk, s, hk, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
  if not b == bk == bv:
    raise ValueError(f"query, key and value must have one batch size, got {b}, {bk}, {bv}")
  if s != sv or hk != hv:
    raise ValueError(f"key and value must have the same sequence length and heads, got key {tuple(k.shape)} and "
                     f"value {tuple(v.shape)}")
  if d != dk:
    raise ValueError(f"query and key head dims must match, got {d} and {dk}")
  if hk == 0 or h % hk:
    raise ValueError(f"the key/value heads ({hk}) must divide the query heads ({h}) (GQA/MQA)")
  if attn_mask_type not in ATTN_MASK_TYPES:
    raise ValueError(f"attn_mask_type must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
  if attn_bias_type is None:
    attn_bias_type = "post_scale_bias" if bias is not None else "no_bias"
  if attn_bias_type not in ATTN_BIAS_TYPES:
    raise ValueError(f"attn_bias_type must be None or one of {ATTN_BIAS_TYPES}, got {attn_bias_type!r}")
  if attn_bias_type == "post_scale_bias":
    if bias is None:
      raise ValueError("attn_bias_type='post_scale_bias' needs a bias")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be a floating-point array, got {bias.dtype}")
    _check_broadcastable("bias", bias.shape, (b, h, t, s))
  elif bias is not None:
    raise ValueError(f"attn_bias_type={attn_bias_type!r} takes no bias array (alibi computes its own)")
  if mask is not None:
    if attn_mask_type not in _PADDING_TYPES + ("arbitrary",):
      raise ValueError(f"a mask was given with attn_mask_type={attn_mask_type!r}, which takes none: use 'arbitrary' "
                       "or a padding type")
    if mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be boolean (True = masked out), got {mask.dtype}")
    _check_broadcastable("mask", mask.shape, (b, h, t, s), query_broadcast=True)
  if segment_ids is not None:
    if attn_mask_type not in _PADDING_TYPES + ("arbitrary",):
      raise ValueError(f"segment_ids were given with attn_mask_type={attn_mask_type!r}: use a padding type "
                       "('padding', 'padding_causal', 'padding_causal_bottom_right') or 'arbitrary'")
    if mask is not None and attn_mask_type != "arbitrary":
      raise ValueError("give the padding as `mask` or as `segment_ids`, not both")
    _segment_pair(segment_ids, b, t, s)
  if attn_mask_type in _PADDING_TYPES and mask is None and segment_ids is None:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} needs the padding: a `mask` or `segment_ids`")
  if attn_mask_type == "arbitrary" and mask is None:
    raise ValueError("attn_mask_type='arbitrary' needs a boolean `mask` (True = masked out)")
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  window = _check_window(window_size, attn_mask_type)
  align = s - t if attn_mask_type in _BOTTOM_RIGHT_TYPES else 0
  lo, hi = -math.inf, math.inf
  if attn_mask_type in _CAUSAL_TYPES:
    hi = align
  if window is not None:
    if window[0] >= 0:
      lo = align - window[0]
    if window[1] >= 0:
      hi = min(hi, align + window[1])
  scale = 1.0 / math.sqrt(d) if scale_factor is None else float(scale_factor)
  return _Config(batch=b, q_len=t, kv_len=s, heads=h, kv_heads=hk, head_dim=d, v_head_dim=dv, dtype=jnp.dtype(q.dtype),
                 mask_type=attn_mask_type, bias_type=attn_bias_type,
                 bias_shape=None if bias is None else tuple(bias.shape),
                 mask_shape=None if mask is None else tuple(mask.shape), has_segment_ids=segment_ids is not None,
                 scale=scale, dropout_rate=float(dropout_rate), lo=lo, hi=hi, tensor_format=tensor_format,
                 fp8=bool(fp8))


# ---- masks and bias ------------------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> np.ndarray:
  """The ALiBi head slopes of Press et al. (2022): ``2^(-8 (h + 1) / n)`` for ``n`` a power of two; otherwise the
  slopes of the power of two ``m`` below ``n``, then every other slope of ``2m`` (float32, shape ``(num_heads,)``)."""

  def power_of_2(n):
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  m = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = power_of_2(m) + power_of_2(2 * m)[0::2][: num_heads - m]
  return np.asarray(slopes, np.float32)


def alibi_bias_at(num_heads: int, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
  """``-slope_h * |key_position - query_position|``, float32, shape (1, H, T, S), for the queries' and keys' positions
  (1-D, integer; the queries' may be traced, as when decoding from a KV cache)."""
  dist = jnp.abs(key_positions[None, :] - query_positions[:, None]).astype(jnp.float32)
  return -jnp.asarray(alibi_slopes(num_heads))[None, :, None, None] * dist[None, None]


def _alibi_bias(cfg: _Config) -> jax.Array:
  """``-slope_h * |j - i - a|``, float32, shape (1, H, T, S)."""
  return alibi_bias_at(cfg.heads, jnp.arange(cfg.q_len) + cfg.align, jnp.arange(cfg.kv_len))


def _band_mask(cfg: _Config) -> jax.Array | None:
  """True where ``j - i`` is outside ``[lo, hi]`` (causal mask and window), shape (1, 1, T, S); None if unbounded."""
  if cfg.lo == -math.inf and cfg.hi == math.inf:
    return None
  rel = jnp.arange(cfg.kv_len)[None, :] - jnp.arange(cfg.q_len)[:, None]
  out = jnp.zeros(rel.shape, bool)
  if cfg.lo != -math.inf:
    out = out | (rel < cfg.lo)
  if cfg.hi != math.inf:
    out = out | (rel > cfg.hi)
  return out[None, None]


def _segment_mask(segment_ids, cfg: _Config) -> jax.Array:
  """True between different segments and at padding (id 0), shape (B, 1, T, S)."""
  q_ids, kv_ids = _segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len)
  q, kv = q_ids[:, :, None], kv_ids[:, None, :]
  return ((q != kv) | (q == 0) | (kv == 0))[:, None]


def _combine(*masks):
  masks = [m for m in masks if m is not None]
  return functools.reduce(jnp.logical_or, masks) if masks else None


def make_attention_mask(query, key, value=None, mask=None, *, segment_ids=None, attn_mask_type: str = "no_mask",
                        window_size=None, qkv_layout: str = "BSHD") -> jax.Array | None:
  """The boolean mask (True = masked out) that ``dot_product_attention`` applies, broadcastable to (B, H, T, S).

  Takes the same arguments as ``dot_product_attention`` (the arrays only for their shapes). None when nothing is
  masked.
  """
  q, k, v = _unpack(query, key, value, qkv_layout)
  cfg = _configure(q, k, v, None, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=None,
                   scale_factor=None, dropout_rate=0.0, window_size=window_size,
                   tensor_format=QKV_LAYOUTS[qkv_layout][0], fp8=False)
  seg = None if segment_ids is None else _segment_mask(segment_ids, cfg)
  return _combine(mask, seg, _band_mask(cfg))


# ---- unfused backend -----------------------------------------------------------------------------------------------


def _softmax(logits: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
  """``softmax(scale * logits)`` over the last axis, masked (True = masked out), in float32; 0 on fully masked rows.

  The one place the unfused path computes its softmax: te_jax's fused softmax kernels (``te_jax.softmax``: one pass
  forward, one backward, only the probabilities saved), which share this mask convention and the zero rows.
  """
  logits = logits.astype(jnp.float32)
  if mask is None:
    return scaled_softmax(logits, scale_factor=float(scale))
  return scaled_masked_softmax(logits, mask, scale_factor=float(scale))


def _unfused(q, k, v, bias, mask, dropout_rng, cfg: _Config):
  """BSHD q (B, T, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> (B, T, H, Dv)."""
  b, t, h, d = q.shape
  s, dv = k.shape[1], v.shape[-1]  # explicit sizes, not -1: a reshape cannot infer a dim of an empty array
  hk, g = cfg.kv_heads, cfg.heads // cfg.kv_heads
  qg = q.reshape(b, t, hk, g, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32).reshape(b, h, t, s)
  scale = cfg.scale
  if cfg.bias_type != "no_bias":
    extra = _alibi_bias(cfg) if cfg.bias_type == "alibi" else bias.astype(jnp.float32)
    logits, scale = logits * jnp.float32(cfg.scale) + extra, 1.0
  probs = _softmax(logits, mask, scale)
  if cfg.dropout_rate > 0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - cfg.dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / jnp.float32(1.0 - cfg.dropout_rate), 0.0)
  probs = probs.astype(v.dtype).reshape(b, hk, g, t, s)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, dv).astype(q.dtype)


# ---- fused (cuDNN) backend -----------------------------------------------------------------------------------------


def _cudnn():
  """JAX's cuDNN attention module and the cuDNN version, or (None, reason)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415 - private, GPU builds only
    from jax._src.lib import cuda_versions  # noqa: PLC0415
  except ImportError as e:
    return None, f"jax has no cuDNN attention module ({e})"
  if cuda_versions is None:
    return None, "jaxlib has no CUDA support (no cuDNN)"
  return fa, cuda_versions.cudnn_get_version()


def _gpu_compute_capability() -> tuple[int, int] | None:
  try:
    if jax.default_backend() != "gpu":
      return None
    cc = jax.devices()[0].compute_capability
  except (RuntimeError, AttributeError):
    return None
  major, minor = cc.split(".")[:2]
  return int(major), int(minor)


def _native_window(cfg: _Config) -> tuple[bool, int | None]:
  """(cuDNN's causal mask, cuDNN's sliding window length) for the band ``lo <= j - i <= hi``, where cuDNN can express
  it: cuDNN's causal mask is top-left (j <= i), its window ``(i - w, i]`` comes with the causal mask."""
  if cfg.hi == 0 and (cfg.align == 0 or cfg.mask_type not in _BOTTOM_RIGHT_TYPES):
    if cfg.lo == -math.inf:
      return True, None
    if cfg.q_len == cfg.kv_len:
      return True, int(-cfg.lo) + 1
  return False, None


def _needs_dense_mask(cfg: _Config) -> bool:
  causal, window = _native_window(cfg)
  band_left = (cfg.lo != -math.inf and window is None) or (cfg.hi != math.inf and not causal)
  return cfg.mask_shape is not None or cfg.has_segment_ids or band_left


def _fused_unsupported(cfg: _Config) -> str | None:
  """Why cuDNN (through JAX 0.11.2) cannot run this configuration, or None when it can."""
  cc = _gpu_compute_capability()
  if cc is None:
    return "no GPU: cuDNN attention runs on NVIDIA GPUs only"
  fa, version = _cudnn()
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
  if cfg.dropout_rate > 0:
    return ("dropout: JAX's cuDNN call takes its dropout seed as a compile-time constant, so a traced PRNG key cannot "
            "drive it (every step would drop the same entries)")
  if cfg.bias_type != "no_bias" and (cfg.q_len % 2 or cfg.kv_len % 2):
    return f"a bias with an odd sequence length ({cfg.q_len}, {cfg.kv_len}): cuDNN's bias backward needs even ones"
  return None


def _fused_reason(cfg: _Config) -> str:
  causal, window = _native_window(cfg)
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


def _fused(q, k, v, bias, dense_mask, cfg: _Config):
  """cuDNN flash attention: BSHD q, k, v (bf16/fp16) -> BSHD output."""
  fa, cudnn_version = _cudnn()
  causal, window = _native_window(cfg)
  h, t, s = cfg.heads, cfg.q_len, cfg.kv_len
  total = None
  has_dbias = cfg.bias_type == "post_scale_bias"
  if has_dbias:
    # cuDNN's dbias has the bias's shape with all H heads; autodiff sums it back over broadcast heads. JAX's own test
    # (fused_attention_stablehlo_test.py, test_sdpa_dbias) notes an all-zero dbias for batch > 1 with older cuDNN;
    # on an H200 with cuDNN 9.19 dbias matched the XLA gradient for bias batch 1 and 2 at batch 2 (the GPU tests
    # below check it on every run).
    total = jnp.broadcast_to(bias.astype(q.dtype), (bias.shape[0], h, t, s))
  elif cfg.bias_type == "alibi":
    total = _alibi_bias(cfg).astype(q.dtype)
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
    valid = ~jnp.all(_combine(dense_mask, _band_mask(cfg)), axis=-1)  # (B|1, H|1, T); the band: causal in cuDNN
    out = out * jnp.transpose(valid, (0, 2, 1))[..., None].astype(out.dtype)
  return out


# ---- FP8 ------------------------------------------------------------------------------------------------------------


def fp8_attention_support(head_dim: int = 128, q_len: int = 128, kv_len: int = 128, *, training: bool = True
                          ) -> tuple[bool, str]:
  """Whether JAX's cuDNN FP8 flash attention (``__cudnn$fmhaSoftmaxF8``) runs here for these sizes, and why (not).

  JAX 0.11.2's ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True)`` takes E4M3/E5M2
  q, k, v with per-tensor descale/scale factors (q, k, v, S = softmax output, O, and dO, dP, dQ, dK, dV for the
  backward), returns an FP8 output and the amax of S and O; no bias, no mask other than causal, no padding, no dropout;
  training needs head dim 128 and sequence lengths that are multiples of 128, inference a head dim that is a multiple
  of 16 up to 256. cuDNN runs it on Hopper (compute capability 9.0) and later.

  ``fp8=True`` uses its forward (inference) call with per-tensor current scaling (see ``_fp8_forward``); measured on
  an H200 with cuDNN 9.19 (B=2, T=S=256, H=4, D=128, GQA included): max error 8-12% and mean error 0.6% of max|out|
  against float32 attention, what E4M3's 3 mantissa bits give. Its FP8 backward call is not used, so the backward
  pass runs in the input precision: it needs the scale factors of dQ, dK, dV and dP before it runs (a delayed-scaling
  state), and with each one from its tensor's exact amax it measured slower than the bf16 call, with 53-71% RMS
  error in dQ, dK and dV, on the H200 at (4, 2048, 32, 128) causal: forward and backward kernels 1.40 ms against
  1.27-1.29 ms in bf16 (``benchmarks/fp8_attention_probe.py``).
  """
  if _native.REFERENCE_FORCED:
    return False, "TE_JAX_REFERENCE=1 forces the pure-JAX path"
  cc = _gpu_compute_capability()
  if cc is None:
    return False, "no GPU"
  fa, version = _cudnn()
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


def _fp8_unsupported(cfg: _Config) -> str | None:
  causal, window = _native_window(cfg)
  if cfg.bias_type != "no_bias" or cfg.mask_shape is not None or cfg.has_segment_ids or cfg.dropout_rate > 0:
    return "cuDNN FP8 attention takes no bias, mask, segment ids or dropout"
  if window is not None or (_band_mask_needed(cfg) and not causal):
    return "cuDNN FP8 attention takes no sliding window and only the top-left causal mask"
  if cfg.head_dim != cfg.v_head_dim:
    return "query/key and value head dims differ"
  if cfg.dtype not in _FUSED_DTYPES:
    return f"dtype {cfg.dtype}: fp8=True takes bfloat16 or float16 inputs (quantized inside)"
  ok, reason = fp8_attention_support(cfg.head_dim, cfg.q_len, cfg.kv_len, training=False)
  return None if ok else reason


def _band_mask_needed(cfg: _Config) -> bool:
  return cfg.lo != -math.inf or cfg.hi != math.inf


_E4M3_MAX = 448.0


def _quantize_e4m3(x):
  """Per-tensor current scaling: (x * s) in E4M3 with s = 448 / amax(x), and 1 / s, as the (1, 1, 1, 1) float32
  factors cuDNN takes."""
  x32 = x.astype(jnp.float32)
  (amax,) = max_over_shards([jnp.max(jnp.abs(x32))], [None])  # inside shard_map: the whole tensor's
  scale = jnp.where(amax > 0, _E4M3_MAX / amax, 1.0)
  x8 = jnp.clip(x32 * scale, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)
  return x8, (1.0 / scale).reshape(1, 1, 1, 1), amax


def _fp8_forward(q, k, v, cfg: _Config):
  """cuDNN FP8 flash attention forward (``__cudnn$fmhaSoftmaxF8``) on BSHD q, k, v; output in q's dtype.

  Scaling: q, k, v by their own amax (current scaling); the softmax output P in [0, 1] by 448 (P's full E4M3 range);
  the output O by 448 / (2 amax(v)): each output row is a convex combination of rows of v, so |O| <= amax(v), and the
  factor 2 leaves room for the rounding of P (its row sums are within a few ulps of 1).
  """
  fa, cudnn_version = _cudnn()
  causal, _ = _native_window(cfg)
  q8, descale_q, _ = _quantize_e4m3(q)
  k8, descale_k, _ = _quantize_e4m3(k)
  v8, descale_v, amax_v = _quantize_e4m3(v)
  scale_s = jnp.full((1, 1, 1, 1), _E4M3_MAX, jnp.float32)
  scale_o = jnp.where(amax_v > 0, _E4M3_MAX / (2.0 * amax_v), 1.0).reshape(1, 1, 1, 1)
  fa.check_layout(q8, k8, v8, None, None, None, None, None, None, None, fa.AttentionLayout.BTNH)
  out8, _, _ = fa._dot_product_attention_fp8_fwd(  # noqa: SLF001 - the inference entry (no residuals)
      q8, k8, v8, [descale_q, descale_k, descale_v, 1.0 / scale_s, scale_s, scale_o], cfg.scale, causal,
      fa.AttentionLayout.BTNH.value, cudnn_version)
  return (out8.astype(jnp.float32) / scale_o).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_attention(q, k, v, cfg: _Config):
  return _fp8_forward(q, k, v, cfg)


def _fp8_attention_fwd(q, k, v, cfg):
  return _fp8_forward(q, k, v, cfg), (q, k, v)


def _fp8_attention_bwd(cfg, res, g):
  """The gradient of attention in the input precision at the same q, k, v (cuDNN when it can, else unfused): JAX's
  FP8 backward needs the scales of dQ, dK, dV and dP before it runs, which current scaling cannot give."""
  q, k, v = res
  exact = dataclasses.replace(cfg, fp8=False)
  name = "fused" if _fused_unsupported(exact) is None else "unfused"
  band = None if name == "fused" else _band_mask(exact)

  def f(q, k, v):
    return _fused(q, k, v, None, None, exact) if name == "fused" else _unfused(q, k, v, None, band, None, exact)

  return jax.vjp(f, q, k, v)[1](g)


_fp8_attention.defvjp(_fp8_attention_fwd, _fp8_attention_bwd)


# ---- backend choice and the public function ------------------------------------------------------------------------


def _choose(cfg: _Config, backend: str) -> AttentionBackend:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if cfg.fp8:
    why_not = _fp8_unsupported(cfg)
    if why_not is not None:
      raise ValueError(f"fp8=True cannot run this configuration: {why_not}")
    if backend == "unfused":
      raise ValueError("fp8=True runs on cuDNN only: backend must be 'auto' or 'fused'")
    return AttentionBackend("fused", "cuDNN FP8 flash attention (E4M3 forward, current scaling); backward in "
                            f"{cfg.dtype}")
  if backend == "unfused":
    return AttentionBackend("unfused", "requested")
  if _native.REFERENCE_FORCED:  # everywhere, an explicit "fused" included: the switch exists for A/B runs
    return AttentionBackend("unfused", "TE_JAX_REFERENCE=1 forces the pure-JAX path")
  why_not = _fused_unsupported(cfg)
  if why_not is None:
    return AttentionBackend("fused", _fused_reason(cfg))
  if backend == "fused":
    raise ValueError(f"backend='fused' cannot run this configuration: {why_not}")
  return AttentionBackend("unfused", why_not)


def _to_bshd(x, tensor_format: str):
  return jnp.swapaxes(x, 0, 1) if tensor_format == "SBHD" else x


def attention_backend(query, key=None, value=None, bias=None, mask=None, *, segment_ids=None,
                      attn_mask_type: str = "no_mask", attn_bias_type: str | None = None,
                      scale_factor: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
                      window_size: tuple[int, int] | None = None, qkv_layout: str = "BSHD", backend: str = "auto",
                      fp8: bool = False) -> AttentionBackend:
  """The backend ``dot_product_attention`` runs with these arguments, and why.

  Takes the same arguments (arrays or ``jax.ShapeDtypeStruct``: only shapes and dtypes are read).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> q = jax.ShapeDtypeStruct((2, 128, 8, 64), jnp.bfloat16)
  >>> te_jax.attention_backend(q, q, q, attn_mask_type="causal", backend="unfused")
  AttentionBackend(name='unfused', reason='requested')
  """
  del dropout_rng  # accepted for the same signature; it does not change the choice
  if qkv_layout not in QKV_LAYOUTS:
    raise ValueError(f"qkv_layout must be one of {tuple(QKV_LAYOUTS)}, got {qkv_layout!r}")
  if QKV_LAYOUTS[qkv_layout][1] is None:
    q, k, v = _unpack(query, key, value, qkv_layout)
  else:
    q, k, v = _unpack_shapes(query, key, value, qkv_layout)
  cfg = _configure(q, k, v, bias, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
                   scale_factor=scale_factor, dropout_rate=dropout_rate, window_size=window_size,
                   tensor_format=QKV_LAYOUTS[qkv_layout][0], fp8=fp8)
  return _choose(cfg, backend)


def _unpack_shapes(query, key, value, qkv_layout):
  """``_unpack`` for shape-only arguments (ShapeDtypeStruct cannot be indexed)."""
  _, packing = QKV_LAYOUTS[qkv_layout]
  if value is not None or (packing == "qkv" and key is not None):
    where = "q, k and v in `query`" if packing == "qkv" else "k and v in `key`"
    raise ValueError(f"qkv_layout={qkv_layout!r} packs {where}: pass None for the packed-away arrays")
  packed = query if packing == "qkv" else key
  if packed is None or len(packed.shape) != 5 or packed.shape[2] != (3 if packing == "qkv" else 2):
    raise ValueError(f"qkv_layout={qkv_layout!r}: the packed tensor must be 5-D with {3 if packing == 'qkv' else 2} "
                     f"in dim 2, got {None if packed is None else tuple(packed.shape)}")
  part = jax.ShapeDtypeStruct(packed.shape[:2] + packed.shape[3:], packed.dtype)
  return (part if packing == "qkv" else query), part, part


def dot_product_attention(query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *, segment_ids=None,
                          attn_mask_type: str = "no_mask", attn_bias_type: str | None = None,
                          scale_factor: float | None = None, dropout_rate: float = 0.0,
                          dropout_rng: jax.Array | None = None, window_size: tuple[int, int] | None = None,
                          qkv_layout: str = "BSHD", backend: str = "auto", fp8: bool = False) -> jax.Array:
  """Scaled dot-product attention (see the module docstring for the math and the mask conventions).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
  >>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 32))   # GQA: 2 key/value heads for 4 query heads
  >>> te_jax.dot_product_attention(q, k, v, attn_mask_type="causal").shape
  (2, 16, 4, 32)

  Args:
    query: (B, T, H, D) for "BSHD" layouts, (T, B, H, D) for "SBHD" ones; (B, S, 3, H, D) / (S, B, 3, H, D) packed
      q, k, v for "BS3HD" / "SB3HD" (then key and value are None).
    key: (B, S, Hk, D) with Hk dividing H (GQA; Hk = 1 is MQA); (B, S, 2, Hk, D) packed k, v for "BSHD_BS2HD" /
      "SBHD_SB2HD" (then value is None).
    value: (B, S, Hk, Dv).
    bias: the "post_scale_bias", broadcastable to (B, H, T, S) (each of B and H full or 1); float.
    mask: boolean, **True = masked out**, broadcastable to (B, H, T, S) (each of B, H and T full or 1; (B, 1, 1, S)
      masks padded keys for every query): the padding of a padding mask type, or the mask of "arbitrary".
    segment_ids: int, (B, S) for self-attention or a pair ``(q_ids (B, T), kv_ids (B, S))``: tokens attend only
      within their segment; id 0 is padding. An alternative to ``mask`` for the padding mask types (packed sequences),
      or combined with "arbitrary"'s mask.
    attn_mask_type: one of ``ATTN_MASK_TYPES``.
    attn_bias_type: None (from ``bias``), "no_bias", "post_scale_bias" or "alibi".
    scale_factor: the logits' scale; None is 1 / sqrt(D).
    dropout_rate: dropout on the attention probabilities (inverted: kept ones scaled by 1 / (1 - rate)).
    dropout_rng: the PRNG key of the dropout mask (required when dropout_rate > 0); the same key gives the same mask.
    window_size: sliding window (left, right), -1 = unbounded on that side; None = no window.
    qkv_layout: one of ``QKV_LAYOUTS``.
    backend: "auto" (cuDNN when it supports the configuration on this machine, else unfused), "fused" (cuDNN or a
      ValueError saying why not) or "unfused". ``TE_JAX_REFERENCE=1`` makes every call unfused. The choice is made
      when the function is traced, from ``jax.default_backend()``: to run a computation on CPU devices of a GPU
      machine, ask for "unfused" (cuDNN's custom call has no CPU lowering).
    fp8: the forward pass in FP8 through cuDNN (see ``fp8_attention_support``); the backward in the input precision.

  Returns:
    The attention output in the query's layout ((B, T, H, Dv) or (T, B, H, Dv)) and dtype.
  """
  q, k, v = _unpack(query, key, value, qkv_layout)
  tensor_format = QKV_LAYOUTS[qkv_layout][0]
  cfg = _configure(q, k, v, bias, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
                   scale_factor=scale_factor, dropout_rate=dropout_rate, window_size=window_size,
                   tensor_format=tensor_format, fp8=fp8)
  if cfg.dropout_rate > 0 and dropout_rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng (a jax PRNG key)")
  choice = _choose(cfg, backend)
  q, k, v = (_to_bshd(x, tensor_format) for x in (q, k, v))
  seg = None if segment_ids is None else _segment_mask(segment_ids, cfg)
  if cfg.fp8:
    out = _fp8_attention(*to_common_varying(q, k, v), cfg)
  elif choice.name == "fused":
    causal, window = _native_window(cfg)
    band = None if (causal and (window is not None or cfg.lo == -math.inf)) else _band_mask(cfg)
    out = _fused(q, k, v, bias, _combine(mask, seg, band), cfg)
  else:
    out = _unfused(q, k, v, bias, _combine(mask, seg, _band_mask(cfg)), dropout_rng, cfg)
  return _to_bshd(out, tensor_format)


def backend_report() -> dict[str, dict[str, str]]:
  """What ``python -m te_jax.doctor`` shows: the backend of a few typical configurations here, and FP8 attention."""
  q = jax.ShapeDtypeStruct((1, 2048, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16)
  cases = {
      "bf16 causal GQA, D=128": dict(query=q, key=kv, value=kv, attn_mask_type="causal"),
      "bf16 padding_causal + segment ids": dict(query=q, key=kv, value=kv, attn_mask_type="padding_causal",
                                                segment_ids=jax.ShapeDtypeStruct((1, 2048), jnp.int32)),
      "bf16 causal + dropout": dict(query=q, key=kv, value=kv, attn_mask_type="causal", dropout_rate=0.1),
      "float32 causal": dict(query=jax.ShapeDtypeStruct(q.shape, jnp.float32),
                             key=jax.ShapeDtypeStruct(kv.shape, jnp.float32),
                             value=jax.ShapeDtypeStruct(kv.shape, jnp.float32), attn_mask_type="causal"),
  }
  report = {name: attention_backend(**args)._asdict() for name, args in cases.items()}
  ok, reason = fp8_attention_support(128, 2048, 2048, training=False)
  report["fp8 forward, D=128"] = {"name": "fused" if ok else "unavailable", "reason": reason}
  return report
