"""The KV cache of autoregressive decoding, framework-neutral: its shape, the append at the cache index, the queries'
positions, the mask (and ALiBi bias) of queries over the cached keys, and the NaN that marks steps past the cache's
end. ``te_jax.flax.MultiHeadAttention`` keeps the cache in the ``"cache"`` collection, ``te_jax.nnx``'s in
``nnx.Cache`` variables; both name them ``cached_key``, ``cached_value`` (``(batch, max_length, kv_heads,
head_dim)``) and ``cache_index`` (int32 scalar: the positions filled so far) and run these functions on them.

The index is a traced value, so appending past the cache's end cannot raise inside ``jit``: the write position of
``lax.dynamic_update_slice`` is then clamped, and ``mark_overflow`` turns those steps' outputs into NaN rather than
wrong values."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from te_jax.fused.attention_masks import alibi_bias_at
from te_jax.modules.axes import is_int

__all__ = ["KVCache", "append_to_cache", "check_fits_cache", "decode_mask_and_bias", "kv_cache_shape", "mark_overflow",
           "query_positions", "require_cache"]


class KVCache(abc.ABC):
  """The KV cache of one attention layer, as its framework keeps it (``te_jax.modules.attention`` reads and appends
  through it)."""

  @abc.abstractmethod
  def key_shape(self) -> tuple[int, ...] | None:
    """The cached keys' ``(batch, max_length, kv_heads, head_dim)``; None where the call creates the cache (linen's
    ``init``: it takes the input's shape). Raises where decoding needs a cache that was never made."""

  @abc.abstractmethod
  def index(self) -> jax.Array | None:
    """The positions filled so far (int32 scalar): the new tokens' first position; None as for ``key_shape``."""

  @abc.abstractmethod
  def append(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes ``key``, ``value`` (batch, steps, kv_heads, head_dim) at the index, moves it on, and returns the whole
    cached keys and values (where the call creates the cache: ``key`` and ``value`` themselves)."""


def kv_cache_shape(input_shape: Sequence[int], *, hidden: int, kv_heads: int, head_dim: int,
                   transpose_batch_sequence: bool = False) -> tuple[int, int, int, int]:
  """The ``(batch, max_length, kv_heads, head_dim)`` cache of a layer whose inputs are ``input_shape``: (batch,
  max_length, hidden), or (max_length, batch, hidden) with ``transpose_batch_sequence``; a ValueError naming
  ``input_shape`` otherwise."""
  shape = tuple(input_shape) if isinstance(input_shape, Sequence) else None
  layout = "(max_length, batch, hidden)" if transpose_batch_sequence else "(batch, max_length, hidden)"
  if shape is None or len(shape) != 3 or not all(is_int(n) and n > 0 for n in shape) or shape[-1] != hidden:
    raise ValueError(f"input_shape must be the inputs' shape {layout} with hidden={hidden}, got {input_shape!r}")
  batch, length = (shape[1], shape[0]) if transpose_batch_sequence else shape[:2]
  return int(batch), int(length), kv_heads, head_dim


def require_cache(present: bool) -> None:
  """The error of decoding before the cache exists."""
  if not present:
    raise ValueError("decode=True needs the KV cache, which is not initialized: call init_cache(input_shape) first "
                     "(input_shape: the inputs' shape at the full length the cache is to hold)")


def check_fits_cache(cache_shape: Sequence[int], key_shape: Sequence[int], argument: str = "inputs_q") -> None:
  """A ValueError naming the caller's ``argument`` unless keys of ``key_shape`` (batch, steps, kv_heads, head_dim)
  fit the cache: same batch and heads, at most as many steps as the cache has positions."""
  batch, max_len, heads, dim = cache_shape
  if key_shape[0] != batch or tuple(key_shape[2:]) != (heads, dim) or key_shape[1] > max_len:
    raise ValueError(f"decode: {argument} gives keys {tuple(key_shape)} that do not fit the KV cache "
                     f"{tuple(cache_shape)} (batch, max_length, kv_heads, head_dim): the batch must be the cache's "
                     f"and a call holds at most max_length={max_len} positions")


def append_to_cache(cached_key: jax.Array, cached_value: jax.Array, index: jax.Array, key: jax.Array,
                    value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The caches with ``key``, ``value`` (batch, steps, kv_heads, head_dim; cast to the caches' dtypes) written at
  ``index``, and the next index. (Check the shapes with ``check_fits_cache`` first.)"""
  cached_key = jax.lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), (0, index, 0, 0))
  cached_value = jax.lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), (0, index, 0, 0))
  return cached_key, cached_value, index + key.shape[1]


def query_positions(steps: int, index: jax.Array | None = None) -> jax.Array:
  """The positions of ``steps`` new tokens: ``index + arange(steps)`` (int32), from 0 without a cache index."""
  positions = jnp.arange(steps, dtype=jnp.int32)
  return positions if index is None else positions + index


def decode_mask_and_bias(index: jax.Array, steps: int, max_len: int, mask: jax.Array | None, bias, bias_type, *,
                         window_size: tuple[int, int] | None, num_heads: int):
  """The attention's mask and bias for ``steps`` queries at positions ``index + t`` over the ``max_len`` cached keys,
  with what the attention itself cannot know of the queries' positions: causal over the keys filled so far, the
  sliding window, ALiBi's distances. ``mask``: the caller's, bool, True = masked out (or None). Returns (mask: bool,
  True = masked out, bias, bias_type), for an "arbitrary" mask type and no window."""
  query_pos = index + jnp.arange(steps)[:, None]
  key_pos = jnp.arange(max_len)[None, :]
  masked = key_pos > query_pos  # query t sees the cached keys 0 .. index + t
  if window_size is not None and window_size[0] >= 0:
    masked = masked | (key_pos < query_pos - window_size[0])
  mask = masked[None, None] if mask is None else jnp.logical_or(mask, masked[None, None])
  if bias_type == "alibi":
    bias = alibi_bias_at(num_heads, query_pos[:, 0], key_pos[0])
    bias_type = "post_scale_bias"
  return mask, bias, bias_type


def mark_overflow(out: jax.Array, index: jax.Array, steps: int, max_len: int) -> jax.Array:
  """``out`` (batch first), NaN where the ``steps`` written at ``index`` ran past the cache's ``max_len``
  positions (their update was clamped): say so rather than return wrong values."""
  return jnp.where(index + steps <= max_len, out, jnp.asarray(jnp.nan, out.dtype))
