"""``dot_product_attention``: scaled dot-product attention with masks, bias, dropout, sliding windows and GQA.

The math, per batch ``b`` and query head ``h`` (key/value head ``h // (H // Hk)``, so GQA and MQA share K and V):

    logits[i, j] = scale * <q[i], k[j]> (+ bias[i, j])          scale defaults to 1 / sqrt(D)
    P[i, :]      = softmax(logits[i, :] over the j not masked)   a fully masked row gives P[i, :] = 0 (output 0)
                   (+ one sink logit in the denominator: ``softmax_type`` "off_by_one" 0, "learnable" a_h)
    P            = P * keep / (1 - rate)                         dropout, keep ~ Bernoulli(1 - rate)
    out[i]       = sum_j P[i, j] v[j]

**A mask is True (or nonzero) where attention is allowed**, as in Flax (``nn.make_attention_mask``,
``nn.make_causal_mask``, whose float32 0/1 masks go in as they are) and ``jax.nn.dot_product_attention``: the default
``mask_convention="flax"``. NVIDIA Transformer Engine's masks are the opposite, True where attention is masked out:
pass them with ``mask_convention="te"``. The convention is never guessed from the values. What is masked, for query
``i`` of ``T`` and key ``j`` of ``S``:

- ``"padding"`` (and the ``padding_*`` types): where the explicit ``mask`` does not attend, or, from ``segment_ids``,
  every pair in different segments or touching a token of segment 0 (padding); packed sequences attend within their
  segment only.
- ``"causal"``: ``j > i`` (top-left aligned); ``"causal_bottom_right"``: ``j > i + (S - T)`` (the last query sees
  every key, as in decoding with a KV cache); ``"padding_causal"``: both; ``"padding_causal_bottom_right"``: the
  padding and the bottom-right causal mask aligned per sequence at its actual lengths (``j > i + (s - t)``, ``t``
  and ``s`` the sequence's queries and keys that are not padding, positions within the sequence), as Transformer
  Engine and cuDNN align it.
- ``segment_pos`` (with ``segment_ids``): each token's position within its segment (packed sequences, Transformer
  Engine's ``segment_pos``); the causal mask and the window then compare positions, ``p_j > p_i`` in place of
  ``j > i`` (aligned per sequence, ``p_j - p_i > s - t``), so that the packed queries and keys of cross attention
  each start their sequence at 0. Without it, the positions are the indices ``i`` and ``j`` (one sequence per row,
  or packed self attention, where the two agree).
- ``"arbitrary"``: where the explicit ``mask`` does not attend (plus ``segment_ids`` when given).
- ``window_size=(left, right)``: keys outside ``i + a - left <= j <= i + a + right`` (``a = S - T`` for the bottom-right
  types, else 0; -1 leaves that side unbounded). With a causal type the causal mask bounds the right side, so any
  ``right`` is accepted (as Transformer Engine accepts it) and changes nothing.

Bias: ``"post_scale_bias"`` adds ``bias`` (broadcastable to ``(B, H, T, S)``) after the scaling, ``"pre_scale_bias"``
before it (``scale * (<q, k> + bias)``), and its gradient flows; ``"alibi"`` adds ``-slope_h * |j - i - a|`` with
the geometric slopes of Press et al. (ALiBi, 2022),
``slope_h = 2^(-8 (h + 1) / n)`` for ``n`` a power of two (see ``alibi_slopes``).

Two backends compute the same function:

- ``"unfused"``: plain jnp (two einsums and te_jax's fused softmax kernels, ``attention_unfused``). Runs everywhere; the
  reference for the tests.
- ``"fused"``: cuDNN flash attention through JAX's cuDNN custom call (``__cudnn$fmha*``): the causal mask and the
  causal sliding window natively (cuDNN skips the masked blocks), the other masks as an additive bias of large negative
  values, fully masked rows zeroed after the call. ``attention_backend`` says which backend a configuration gets and
  why; ``"auto"`` takes the fused one when it can.

FP8: ``fp8_dpa=True`` runs the forward pass in cuDNN's FP8 flash attention (E4M3, per-tensor current scaling) and the
backward pass in the input precision, where the configuration allows it (``attention_backend`` says; see
``te_jax.fused.attention_cudnn.fp8_attention_support``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax._core import native
from te_jax._core.autocast import resolve_recipe
from te_jax._core.manual_axes import to_common_varying
from te_jax.fused.attention_config import (ATTN_BIAS_TYPES, ATTN_MASK_TYPES, BACKENDS, MASK_CONVENTIONS, QKV_LAYOUTS,
                                           SOFTMAX_TYPES, AttentionConfig, configure, masked_out, unpack,
                                           unpack_shapes)
from te_jax.fused.attention_cudnn import (fp8_attention, fp8_attention_support, fp8_unsupported, fused, fused_reason,
                                          fused_unsupported, native_window)
from te_jax.fused.attention_masks import combine, layer_band, segment_mask
from te_jax.fused.attention_unfused import unfused
from te_jax.recipe import Recipe

__all__ = ["ATTN_BIAS_TYPES", "ATTN_MASK_TYPES", "AttentionBackend", "MASK_CONVENTIONS", "QKV_LAYOUTS", "SOFTMAX_TYPES",
           "attention_backend", "backend_report", "dot_product_attention", "fp8_dpa_enabled", "layout_for",
           "make_attention_mask"]


class AttentionBackend(NamedTuple):
  """Which backend a configuration runs on, and why."""

  name: str  # "fused" or "unfused"
  reason: str



def make_attention_mask(query, key, value=None, mask=None, *, segment_ids=None, attn_mask_type: str = "no_mask",
                        window_size=None, qkv_layout: str = "BSHD", mask_convention: str = "flax",
                        segment_pos=None) -> jax.Array | None:
  """The mask ``dot_product_attention`` applies, boolean, broadcastable to (B, H, T, S), in ``mask_convention``:
  True = attend for "flax" (the default), True = masked out for "te". Given back to ``dot_product_attention`` as an
  "arbitrary" mask with the same ``mask_convention``, it gives the same attention.

  Takes the same arguments as ``dot_product_attention`` (the arrays only for their shapes). None when nothing is
  masked.

  >>> import jax.numpy as jnp, te_jax
  >>> q = jnp.zeros((1, 3, 1, 8))
  >>> te_jax.make_attention_mask(q, q, q, attn_mask_type="causal")[0, 0].astype(int).tolist()
  [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
  """
  q, k, v = unpack(query, key, value, qkv_layout)
  cfg = configure(q, k, v, None, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=None,
                  scale_factor=None, dropout_rate=0.0, window_size=window_size,
                  tensor_format=QKV_LAYOUTS[qkv_layout][0], fp8_dpa=False, mask_convention=mask_convention,
                  segment_pos=segment_pos)
  seg = None if segment_ids is None else segment_mask(segment_ids, cfg)
  mask = masked_out(mask, mask_convention)
  out = combine(mask, seg, layer_band(cfg, mask, segment_ids, segment_pos))
  return out if out is None or mask_convention == "te" else jnp.logical_not(out)


def _choose(cfg: AttentionConfig, backend: str) -> AttentionBackend:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if cfg.fp8_dpa:
    why_not = fp8_unsupported(cfg)
    if why_not is not None:
      raise ValueError(f"fp8_dpa=True cannot run this configuration: {why_not}")
    if backend == "unfused":
      raise ValueError("fp8_dpa=True runs on cuDNN only: backend must be 'auto' or 'fused'")
    return AttentionBackend("fused", "cuDNN FP8 flash attention (E4M3 forward, current scaling); backward in "
                            f"{cfg.dtype}")
  if backend == "unfused":
    return AttentionBackend("unfused", "requested")
  if native.REFERENCE_FORCED:  # everywhere, an explicit "fused" included: the switch exists for A/B runs
    return AttentionBackend("unfused", "TE_JAX_REFERENCE=1 forces the pure-JAX path")
  why_not = fused_unsupported(cfg)
  if why_not is None:
    return AttentionBackend("fused", fused_reason(cfg))
  if backend == "fused":
    raise ValueError(f"backend='fused' cannot run this configuration: {why_not}")
  return AttentionBackend("unfused", why_not)


def _to_bshd(x, tensor_format: str):
  return jnp.swapaxes(x, 0, 1) if tensor_format == "SBHD" else x



def attention_backend(query, key=None, value=None, bias=None, mask=None, *, segment_ids=None,
                      attn_mask_type: str = "no_mask", attn_bias_type: str | None = None,
                      scale_factor: float | None = None, dropout_rate: float = 0.0, dropout_rng=None,
                      window_size: tuple[int, int] | None = None, qkv_layout: str = "BSHD", backend: str = "auto",
                      fp8_dpa: bool = False, mask_convention: str = "flax", softmax_type: str = "vanilla",
                      softmax_offset=None, segment_pos=None) -> AttentionBackend:
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
    q, k, v = unpack(query, key, value, qkv_layout)
  else:
    q, k, v = unpack_shapes(query, key, value, qkv_layout)
  cfg = configure(q, k, v, bias, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
                  scale_factor=scale_factor, dropout_rate=dropout_rate, window_size=window_size,
                  tensor_format=QKV_LAYOUTS[qkv_layout][0], fp8_dpa=fp8_dpa, mask_convention=mask_convention,
                  softmax_type=softmax_type, softmax_offset=softmax_offset, segment_pos=segment_pos)
  return _choose(cfg, backend)



def dot_product_attention(query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None,
                          bias: jax.Array | None = None, mask: jax.Array | None = None, *, segment_ids=None,
                          attn_mask_type: str = "no_mask", attn_bias_type: str | None = None,
                          scale_factor: float | None = None, dropout_rate: float = 0.0,
                          dropout_rng: jax.Array | None = None, window_size: tuple[int, int] | None = None,
                          qkv_layout: str = "BSHD", backend: str = "auto", fp8_dpa: bool = False,
                          mask_convention: str = "flax", softmax_type: str = "vanilla",
                          softmax_offset: jax.Array | None = None, segment_pos=None) -> jax.Array:
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
    bias: the "post_scale_bias" or "pre_scale_bias", broadcastable to (B, H, T, S) (each of B and H full or 1);
      float.
    mask: bool, int or float, **True (nonzero) = attend** (Flax's convention; see ``mask_convention``),
      broadcastable to (B, H, T, S) (each of B, H and T full or 1; (B, 1, 1, S) masks padded keys for every query):
      the padding of a padding mask type, or the mask of "arbitrary". ``nn.make_attention_mask(q_valid, kv_valid)``
      makes one.
    segment_ids: int, (B, S) for self-attention or a pair ``(q_ids (B, T), kv_ids (B, S))``: tokens attend only
      within their segment; id 0 is padding. An alternative to ``mask`` for the padding mask types (packed sequences),
      or combined with "arbitrary"'s mask.
    attn_mask_type: one of ``ATTN_MASK_TYPES``.
    attn_bias_type: None (from ``bias``: "post_scale_bias"), "no_bias", "pre_scale_bias" (added before the scale),
      "post_scale_bias" (after it) or "alibi".
    scale_factor: the logits' scale; None is 1 / sqrt(D).
    dropout_rate: dropout on the attention probabilities (inverted: kept ones scaled by 1 / (1 - rate)).
    dropout_rng: the PRNG key of the dropout mask (required when dropout_rate > 0); the same key gives the same mask.
    window_size: sliding window (left, right), -1 = unbounded on that side; None = no window.
    qkv_layout: one of ``QKV_LAYOUTS``.
    backend: "auto" (cuDNN when it supports the configuration on this machine, else unfused), "fused" (cuDNN or a
      ValueError saying why not) or "unfused". ``TE_JAX_REFERENCE=1`` makes every call unfused. The choice is made
      when the function is traced, from ``jax.default_backend()``: to run a computation on CPU devices of a GPU
      machine, ask for "unfused" (cuDNN's custom call has no CPU lowering).
    fp8_dpa: the forward pass in FP8 through cuDNN (see ``fp8_attention_support``); the backward in the input precision.
    mask_convention: what ``mask`` means: "flax" (default), True or nonzero = attend; "te" (NVIDIA Transformer
      Engine's), True or nonzero = masked out. One of ``MASK_CONVENTIONS``.
    softmax_type: one of ``SOFTMAX_TYPES``: "vanilla"; "off_by_one", a logit of 0 more in every row's denominator;
      "learnable", the logit ``softmax_offset[0, h, 0, 0]`` there (an attention sink per head). The sink is never
      masked; a row with every key masked still gives 0. cuDNN has no sink: these run unfused.
    softmax_offset: "learnable"'s sink logits, float32 (1, H, 1, 1), differentiable; None otherwise.
    segment_pos: int, with ``segment_ids``: each token's position within its segment, (B, S) for self-attention or
      a pair ``(q_pos (B, T), kv_pos (B, S))`` (Transformer Engine's ``segment_pos``); the causal mask and the window
      compare these positions (see the module docstring). None: the indices. Not with "alibi".

  Returns:
    The attention output in the query's layout ((B, T, H, Dv) or (T, B, H, Dv)) and dtype.
  """
  q, k, v = unpack(query, key, value, qkv_layout)
  tensor_format = QKV_LAYOUTS[qkv_layout][0]
  cfg = configure(q, k, v, bias, mask, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=attn_bias_type,
                  scale_factor=scale_factor, dropout_rate=dropout_rate, window_size=window_size,
                  tensor_format=tensor_format, fp8_dpa=fp8_dpa, mask_convention=mask_convention,
                  softmax_type=softmax_type, softmax_offset=softmax_offset, segment_pos=segment_pos)
  mask = masked_out(mask, mask_convention)  # from here on, one representation: True = masked out
  if cfg.dropout_rate > 0 and dropout_rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng (a jax PRNG key)")
  choice = _choose(cfg, backend)
  q, k, v = (_to_bshd(x, tensor_format) for x in (q, k, v))
  seg = None if segment_ids is None else segment_mask(segment_ids, cfg)
  if cfg.fp8_dpa:
    out = fp8_attention(*to_common_varying(q, k, v), cfg)
  elif choice.name == "fused":
    causal, window = native_window(cfg)
    band = None if (causal and (window is not None or cfg.lo == -math.inf)) else layer_band(cfg, mask, segment_ids,
                                                                                             segment_pos)
    out = fused(q, k, v, bias, combine(mask, seg, band), cfg)
  else:
    out = unfused(q, k, v, bias, combine(mask, seg, layer_band(cfg, mask, segment_ids, segment_pos)), dropout_rng,
                  cfg, softmax_offset)
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



def fp8_dpa_enabled(fp8_dpa: bool | None, *args, recipe: Recipe | None = None, **kwargs) -> bool:
  """A layer's FP8 attention or not: ``fp8_dpa`` when given; for None, what the layer's ``recipe`` (else autocast's)
  asks with its ``fp8_dpa``, where ``dot_product_attention(*args, fp8_dpa=True, **kwargs)`` accepts the
  configuration (shapes and dtypes are read)."""
  if fp8_dpa is not None:
    return fp8_dpa
  recipe = resolve_recipe(recipe)
  if recipe is None or not recipe.fp8_dpa:
    return False
  try:
    attention_backend(*args, fp8_dpa=True, **kwargs)
  except ValueError:  # not this configuration, or not on this machine: attention stays in the input precision
    return False
  return True


# BSHD-family layout -> the same packing in SBHD, for a layer's ``transpose_batch_sequence``.
_TO_SEQUENCE_FIRST = {"BSHD": "SBHD", "BS3HD": "SB3HD", "BSHD_BS2HD": "SBHD_SB2HD"}


def layout_for(qkv_layout: str, transpose_batch_sequence: bool) -> str:
  """A layer's ``qkv_layout``, made sequence-first (the "SB" form) by ``transpose_batch_sequence``."""
  if qkv_layout not in QKV_LAYOUTS:
    raise ValueError(f"qkv_layout must be one of {tuple(QKV_LAYOUTS)}, got {qkv_layout!r}")
  if not transpose_batch_sequence:
    return qkv_layout
  if qkv_layout not in _TO_SEQUENCE_FIRST:
    raise ValueError(f"transpose_batch_sequence=True takes a 'BS' layout ({tuple(_TO_SEQUENCE_FIRST)}) and makes "
                     f"it sequence-first; got qkv_layout={qkv_layout!r}")
  return _TO_SEQUENCE_FIRST[qkv_layout]
