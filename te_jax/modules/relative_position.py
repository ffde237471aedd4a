"""T5's relative position biases, framework-neutral: the bucket of each key - query distance and the bias of every
(query, key) pair from the learned ``(heads, buckets)`` table. ``te_jax.flax.RelativePositionBiases`` and
``te_jax.nnx.RelativePositionBiases`` hold the table (the ``rel_embedding`` parameter) and call these."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.modules.axes import is_int

__all__ = ["check_relative_position_options", "relative_position_bias", "relative_position_bucket"]


def check_relative_position_options(num_buckets, max_distance, num_attention_heads=None) -> None:
  """A ValueError naming the argument when the bucketing (or the table's heads) cannot be built."""
  if not (is_int(num_buckets) and is_int(max_distance) and num_buckets >= 4 and max_distance > num_buckets // 4):
    raise ValueError(f"num_buckets must be >= 4 and max_distance > num_buckets / 4, got {num_buckets} and "
                     f"{max_distance}")
  if num_attention_heads is not None and not (is_int(num_attention_heads) and num_attention_heads > 0):
    raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")


def relative_position_bucket(relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> np.ndarray:
  """The bucket of each ``key_position - query_position`` (numpy; static shapes only).

  T5's scheme (Raffel et al. 2020, section 2.1): bidirectional, keys after the query take the upper half of the
  buckets; unidirectional, keys after the query share bucket 0. Within a half, the first quarter of the buckets
  hold one distance each, the rest cover the distances up to ``max_distance`` in logarithmically growing ranges,
  and farther distances fall into the last bucket."""
  rel = np.asarray(relative_position)
  half = num_buckets // 2 if bidirectional else num_buckets
  offset = np.where(rel > 0, half, 0).astype(rel.dtype) if bidirectional else 0
  distance = np.abs(rel) if bidirectional else np.maximum(-rel, 0)
  exact = half // 2
  log_ratio = np.log(np.maximum(distance, exact) / exact) / np.log(max_distance / exact)
  far = np.minimum(exact + (log_ratio * (half - exact)).astype(rel.dtype), half - 1)
  return offset + np.where(distance < exact, distance, far)


def _check_call(q_seqlen, k_seqlen, q_offset) -> None:
  """The call's lengths (static positive ints; with an offset, at most as many queries as keys)."""
  if not (is_int(q_seqlen) and is_int(k_seqlen) and q_seqlen > 0 and k_seqlen > 0):
    raise ValueError(f"q_seqlen and k_seqlen must be positive ints, got {q_seqlen!r} and {k_seqlen!r}")
  if q_offset is not None and q_seqlen > k_seqlen:
    raise ValueError(f"with q_offset, q_seqlen={q_seqlen} must be at most k_seqlen={k_seqlen}")


def relative_position_bias(table: jax.Array, q_seqlen: int, k_seqlen: int, *, bidirectional: bool = True,
                           max_distance: int, q_offset: jax.Array | int | None = None,
                           dtype: Any = jnp.float32) -> jax.Array:
  """The bias ``(1, heads, q_seqlen, k_seqlen)`` to add to the attention logits: ``table[h, bucket(k - q)]`` for the
  ``(heads, num_buckets)`` ``table``, in ``dtype``.

  ``q_offset`` (may be traced, in ``[0, k_seqlen - q_seqlen]``): the queries are at positions ``q_offset + t``, as
  when decoding with a KV cache of ``k_seqlen`` keys; default 0.
  """
  num_buckets = table.shape[-1]
  check_relative_position_options(num_buckets, max_distance)
  _check_call(q_seqlen, k_seqlen, q_offset)
  # The bias depends on key - query only: one value per head for each relative position (a one-hot matmul of that
  # size, exact), laid out as (q, k) by _diagonals. No (q, k, buckets) one-hot, and the table's gradient is a sum
  # over diagonals and buckets in a fixed order (no scatter). With an offset, every position a query can have
  # (-(k - 1) .. k - 1), then the q + k - 1 of this offset.
  lowest = 1 - (k_seqlen if q_offset is not None else q_seqlen)
  relative = np.arange(lowest, k_seqlen, dtype=np.int32)
  buckets = relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=num_buckets,
                                     max_distance=max_distance)
  one_hot = jnp.asarray(np.eye(num_buckets, dtype=np.float32)[buckets])  # (relative positions, buckets)
  per_relative = jnp.einsum("hb,rb->hr", table, one_hot)
  if q_offset is not None:  # relative position j - (q_offset + t) sits at index j - q_offset - t + k - 1
    start = k_seqlen - q_seqlen - jnp.asarray(q_offset, jnp.int32)
    per_relative = jax.lax.dynamic_slice_in_dim(per_relative, start, q_seqlen + k_seqlen - 1, axis=-1)
  return _diagonals(per_relative, q_seqlen, k_seqlen)[None].astype(dtype)


def _diagonals(per_relative: jax.Array, q: int, k: int) -> jax.Array:
  """``out[..., i, j] = per_relative[..., j - i + q - 1]`` for ``per_relative`` of length ``q + k - 1``: row i is the
  window starting at ``q - 1 - i``, cut from the rows repeated end to end (broadcast, reshape and slices, which XLA
  fuses into one pass over the output; their transposes are a pad and a sum)."""
  if q == 1:
    return per_relative[..., None, :k]
  lead, length = per_relative.shape[:-1], q + k - 1
  rows = jnp.broadcast_to(per_relative[..., None, :], (*lead, q, length)).reshape(*lead, q * length)
  # Flat index q - 1 + i (length - 1) + j is row i, column q - 1 - i + j: the window of row i, read at column j.
  windows = rows[..., q - 1:q - 1 + q * (length - 1)].reshape(*lead, q, length - 1)
  return windows[..., :k]
