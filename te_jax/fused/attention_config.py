"""The arguments of one attention call, checked (clear errors before XLA sees anything) and folded into a static,
hashable ``AttentionConfig``; the mask types, bias types and layouts ``dot_product_attention`` accepts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ATTN_BIAS_TYPES", "ATTN_MASK_TYPES", "AttentionConfig", "BACKENDS", "BOTTOM_RIGHT_TYPES", "CAUSAL_TYPES",
           "MASK_CONVENTIONS", "PADDING_TYPES", "QKV_LAYOUTS", "SOFTMAX_TYPES", "check_mask_convention",
           "check_softmax_type", "configure", "masked_out", "position_pair", "segment_pair", "unpack", "unpack_shapes"]

ATTN_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                   "padding_causal_bottom_right", "arbitrary")
ATTN_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
#: The attention softmax (Transformer Engine's ``softmax_type``): "vanilla" ``exp(z_j) / sum_k exp(z_k)``;
#: "off_by_one" one more logit of 0 in the denominator, ``exp(z_j) / (1 + sum_k exp(z_k))``; "learnable" a learned
#: logit per head ``a_h`` there, ``exp(z_j) / (exp(a_h) + sum_k exp(z_k))`` (an attention sink, as in recent open
#: models), from the ``softmax_offset`` array (1, H, 1, 1), float32.
SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")
#: layout -> (tensor format, packing): "qkv" packs (B, S, 3, H, D) in ``query``; "kv" packs (B, S, 2, H, D) in ``key``.
QKV_LAYOUTS = {
    "BSHD": ("BSHD", None), "SBHD": ("SBHD", None),
    "BS3HD": ("BSHD", "qkv"), "SB3HD": ("SBHD", "qkv"),
    "BSHD_BS2HD": ("BSHD", "kv"), "SBHD_SB2HD": ("SBHD", "kv"),
}
BACKENDS = ("auto", "fused", "unfused")
#: What a caller's ``mask`` means: "flax" (the default): True, or nonzero, = attend, as in ``flax.linen`` and
#: ``jax.nn.dot_product_attention``; "te": True, or nonzero, = masked out, as in NVIDIA Transformer Engine.
MASK_CONVENTIONS = ("flax", "te")
PADDING_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")
CAUSAL_TYPES = ("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right")
BOTTOM_RIGHT_TYPES = ("causal_bottom_right", "padding_causal_bottom_right")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
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
  fp8_dpa: bool
  softmax_type: str = "vanilla"
  has_segment_pos: bool = False  # the band compares the tokens' positions within their segments, not j - i

  @property
  def align(self) -> int:
    return self.kv_len - self.q_len if self.mask_type in BOTTOM_RIGHT_TYPES else 0

  @property
  def per_sequence(self) -> bool:
    """The band is aligned per sequence, at each one's actual kv length minus its q length (the padding's), not at
    the padded lengths: "padding_causal_bottom_right", as in Transformer Engine and cuDNN."""
    return self.mask_type == "padding_causal_bottom_right"



def unpack(query, key, value, qkv_layout: str):
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


def _check_window(window_size) -> tuple[int, int] | None:
  """``(left, right)``; with a causal mask type any ``right`` is accepted, as Transformer Engine accepts it: the causal
  mask bounds the right side (no key right of the diagonal), so ``right`` then changes nothing."""
  if window_size is None:
    return None
  if (not isinstance(window_size, Sequence) or len(window_size) != 2
      or not all(isinstance(w, (int, np.integer)) and w >= -1 for w in window_size)):
    raise ValueError(f"window_size must be None or (left, right) with ints >= -1 (-1: unbounded), got {window_size!r}")
  return int(window_size[0]), int(window_size[1])


def check_softmax_type(softmax_type: str) -> str:
  if not isinstance(softmax_type, str) or softmax_type not in SOFTMAX_TYPES:
    raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
  return softmax_type


def _check_softmax_offset(softmax_type: str, softmax_offset, heads: int) -> None:
  check_softmax_type(softmax_type)
  if softmax_type != "learnable":
    if softmax_offset is not None:
      raise ValueError(f"softmax_offset is the learnable softmax's; softmax_type={softmax_type!r} takes none (give "
                       "softmax_type='learnable')")
    return
  if softmax_offset is None:
    raise ValueError(f"softmax_type='learnable' needs softmax_offset, the per-head sink logits of shape "
                     f"(1, H, 1, 1) = (1, {heads}, 1, 1), float32")
  if tuple(softmax_offset.shape) != (1, heads, 1, 1) or jnp.dtype(softmax_offset.dtype) != jnp.float32:
    raise ValueError(f"softmax_offset must be float32 of shape (1, H, 1, 1) = (1, {heads}, 1, 1), got "
                     f"{jnp.dtype(softmax_offset.dtype).name} {tuple(softmax_offset.shape)}")


def _check_broadcastable(name: str, shape, full: tuple[int, int, int, int], query_broadcast: bool = False):
  """``shape`` must be 4-D with each of B and H either full or 1, S full, and T full (or 1 with
  ``query_broadcast``: a mask over the keys only, such as a padding mask (B, 1, 1, S))."""
  b, h, t, s = full
  queries = (t, 1) if query_broadcast else (t,)
  if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2] not in queries or shape[3] != s:
    t_name, t_value = ("T or 1", f"{t} or 1") if query_broadcast else ("T", f"{t}")
    raise ValueError(f"{name} must have shape (B or 1, H or 1, {t_name}, S) = ({b} or 1, {h} or 1, {t_value}, {s}), "
                     f"got {tuple(shape)}")


def segment_pair(segment_ids, batch: int, q_len: int, kv_len: int):
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


def position_pair(segment_pos, batch: int, q_len: int, kv_len: int):
  """``segment_pos`` as (q_pos (B, T), kv_pos (B, S)): one array (self attention) serves both."""
  if isinstance(segment_pos, (tuple, list)):
    if len(segment_pos) != 2:
      raise ValueError("segment_pos must be one (B, S) array (self-attention) or a pair (q_pos (B, T), kv_pos (B, S))")
    q_pos, kv_pos = segment_pos
  else:
    q_pos = kv_pos = segment_pos
  for name, pos, n in (("query segment_pos", q_pos, q_len), ("key/value segment_pos", kv_pos, kv_len)):
    if not hasattr(pos, "dtype") or not jnp.issubdtype(pos.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array (each token's position within its segment), got "
                      f"{getattr(pos, 'dtype', type(pos).__name__)}")
    if tuple(pos.shape) != (batch, n):
      raise ValueError(f"{name} must have shape (B, {'T' if name[0] == 'q' else 'S'}) = ({batch}, {n}), got "
                       f"{tuple(pos.shape)}")
  return q_pos, kv_pos


def check_mask_convention(mask_convention: str) -> str:
  if not isinstance(mask_convention, str) or mask_convention not in MASK_CONVENTIONS:
    raise ValueError(f"mask_convention must be one of {MASK_CONVENTIONS}, got {mask_convention!r} ('flax': True = "
                     "attend, as in Flax; 'te': True = masked out, as in Transformer Engine)")
  return mask_convention


def masked_out(mask, mask_convention: str):
  """A caller's ``mask`` (bool, int or float, in ``mask_convention``) as the one representation the attention
  computes with: bool, True where attention is masked out. None stays None."""
  check_mask_convention(mask_convention)
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  return jnp.logical_not(mask) if mask_convention == "flax" else mask.astype(jnp.bool_)


def configure(q, k, v, bias, mask, segment_ids, *, attn_mask_type, attn_bias_type, scale_factor, dropout_rate,
               window_size, tensor_format, fp8_dpa, mask_convention, softmax_type: str = "vanilla",
               softmax_offset=None, segment_pos=None) -> AttentionConfig:
  """Checks every argument (clear errors before XLA sees anything) and returns the static configuration."""
  check_mask_convention(mask_convention)
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
  if attn_bias_type in ("pre_scale_bias", "post_scale_bias"):
    if bias is None:
      raise ValueError(f"attn_bias_type={attn_bias_type!r} needs a bias")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be a floating-point array, got {bias.dtype}")
    _check_broadcastable("bias", bias.shape, (b, h, t, s))
  elif bias is not None:
    raise ValueError(f"attn_bias_type={attn_bias_type!r} takes no bias array (alibi computes its own)")
  if mask is not None:
    if attn_mask_type not in PADDING_TYPES + ("arbitrary",):
      raise ValueError(f"a mask was given with attn_mask_type={attn_mask_type!r}, which takes none: use 'arbitrary' "
                       "or a padding type")
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
            or jnp.issubdtype(mask.dtype, jnp.floating)):
      raise TypeError(f"mask must be a bool, integer or floating-point array (mask_convention={mask_convention!r}: "
                      f"nonzero = {'attend' if mask_convention == 'flax' else 'masked out'}), got {mask.dtype}")
    _check_broadcastable("mask", mask.shape, (b, h, t, s), query_broadcast=True)
  if segment_ids is not None:
    if attn_mask_type not in PADDING_TYPES + ("arbitrary",):
      raise ValueError(f"segment_ids were given with attn_mask_type={attn_mask_type!r}: use a padding type "
                       "('padding', 'padding_causal', 'padding_causal_bottom_right') or 'arbitrary'")
    if mask is not None and attn_mask_type != "arbitrary":
      raise ValueError("give the padding as `mask` or as `segment_ids`, not both")
    segment_pair(segment_ids, b, t, s)
  if segment_pos is not None:
    if segment_ids is None:
      raise ValueError("segment_pos gives the tokens' positions within their segments: it needs the segment_ids too")
    if attn_bias_type == "alibi":
      raise ValueError("attn_bias_type='alibi' computes its distances at the padded positions j - i, not at "
                       "segment_pos: give no segment_pos (or an explicit bias of the positions)")
    position_pair(segment_pos, b, t, s)
  if attn_mask_type in PADDING_TYPES and mask is None and segment_ids is None:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} needs the padding: a `mask` or `segment_ids`")
  if attn_mask_type == "arbitrary" and mask is None:
    raise ValueError("attn_mask_type='arbitrary' needs a `mask`")
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  window = _check_window(window_size)
  _check_softmax_offset(softmax_type, softmax_offset, h)
  align = s - t if attn_mask_type in BOTTOM_RIGHT_TYPES else 0
  lo, hi = -math.inf, math.inf
  if attn_mask_type in CAUSAL_TYPES:
    hi = align
  if window is not None:
    if window[0] >= 0:
      lo = align - window[0]
    if window[1] >= 0:
      hi = min(hi, align + window[1])
  scale = 1.0 / math.sqrt(d) if scale_factor is None else float(scale_factor)
  return AttentionConfig(batch=b, q_len=t, kv_len=s, heads=h, kv_heads=hk, head_dim=d, v_head_dim=dv,
                         dtype=jnp.dtype(q.dtype),
                 mask_type=attn_mask_type, bias_type=attn_bias_type,
                 bias_shape=None if bias is None else tuple(bias.shape),
                 mask_shape=None if mask is None else tuple(mask.shape), has_segment_ids=segment_ids is not None,
                 scale=scale, dropout_rate=float(dropout_rate), lo=lo, hi=hi, tensor_format=tensor_format,
                 fp8_dpa=bool(fp8_dpa), softmax_type=softmax_type, has_segment_pos=segment_pos is not None)



def unpack_shapes(query, key, value, qkv_layout):
  """``unpack`` for shape-only arguments (ShapeDtypeStruct cannot be indexed)."""
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
