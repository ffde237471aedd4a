"""How the sequences of a batch are laid out, as Transformer Engine's ``SequenceDescriptor`` says it: their lengths
(one sequence per row), their lengths and offsets (packed sequences), or segment ids and positions; and the one
conversion of each form into what te_jax's attention computes with, ``segment_ids`` and ``segment_pos`` pairs.

The forms, for queries (B, T) and keys (B, S), each given for both or as a pair ``(q, kv)``:

- ``SequenceDescriptor.from_seqlens(seqlens)``: ``seqlens`` (B,), row ``b`` holds one sequence at ``0 ..
  seqlens[b] - 1``, the rest is padding: segment id 1 there, 0 after; positions the indices.
- ``SequenceDescriptor.from_seqlens_and_offsets(seqlens, seq_offsets)``: ``seqlens`` (B, M), ``seq_offsets``
  (B, M + 1) (Transformer Engine's shapes; unused entries -1, or a length of 0): sequence ``k`` of row ``b`` holds
  tokens ``seq_offsets[b, k] .. seq_offsets[b, k] + seqlens[b, k] - 1``, segment id ``k + 1``, positions from 0 at
  its offset; tokens in no sequence are padding (id 0).
- ``SequenceDescriptor.from_segment_ids_and_pos(segment_ids, segment_pos)``: the ids (0 = padding) and each token's
  position within its segment, as they are (``segment_positions`` derives the positions of sequences in their
  natural order).

Positions matter to the causal mask, the window and RoPE (``te_jax.dot_product_attention``'s ``segment_pos``):
packed sequences restart at 0, so the queries and keys of packed cross attention line up at each sequence's start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax.fused.attention_config import PADDING_TYPES, QKV_LAYOUTS

__all__ = ["SequenceDescriptor", "resolve_sequences", "segment_positions", "sequence_shape"]


def _pair(name: str, value):
  """``value`` as a pair (q, kv): a tuple or list of two, or one array for both (Transformer Engine's rule)."""
  if isinstance(value, (tuple, list)):
    if len(value) != 2:
      raise ValueError(f"{name} must be one array (for queries and keys both) or a pair (q, kv), got {len(value)} "
                       "items")
    return tuple(value)
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(f"{name} must be an integer array or a pair of them (q, kv), got {type(value).__name__}")
  return value, value


def _check_ints(name: str, x, ndim: int) -> None:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x).__name__)}")
  if x.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's position within its segment, for sequences packed in their natural order: its index less the
  index of its segment id's first token in the row (0, 1, 2, ... from each segment's start), int32, the ids' shape
  (..., L). Padding (id 0) gets positions too, which no mask reads.

  >>> import jax.numpy as jnp, te_jax
  >>> te_jax.segment_positions(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
  [[0, 1, 2, 0, 1, 0]]
  """
  if not hasattr(segment_ids, "dtype") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be an integer array, got {getattr(segment_ids, 'dtype', type(segment_ids))}")
  if segment_ids.ndim < 1:
    raise ValueError(f"segment_ids must have a sequence dim (..., L), got shape {tuple(segment_ids.shape)}")
  n = segment_ids.shape[-1]
  ids = segment_ids.reshape(-1, n)
  index = jnp.arange(n, dtype=jnp.int32)

  def first_of_its_id(row):
    # O(L log L), not an (L, L) comparison: a stable sort puts each id's tokens together in their order, so the
    # first of each run of equal ids in the sorted row is the id's first token.
    order = jnp.argsort(row, stable=True).astype(jnp.int32)
    ordered = row[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
    run_start = jax.lax.cummax(jnp.where(starts, index, 0))
    return jnp.zeros((n,), jnp.int32).at[order].set(order[run_start])

  first = jax.vmap(first_of_its_id)(ids) if ids.shape[0] else jnp.zeros(ids.shape, jnp.int32)
  return (index - first).reshape(segment_ids.shape)


@jax.tree_util.register_pytree_node_class
class SequenceDescriptor:
  """The sequences of a batch, for the attention modules' ``mask`` (Transformer Engine's place of its
  ``sequence_descriptor``) or ``segment_ids`` argument, in place of a mask or segment ids; see the module docstring
  for the forms. A pytree (its arrays are the leaves), so it passes through ``jax.jit`` and ``jax.vmap``.

  >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> sd = te_jax.SequenceDescriptor.from_seqlens_and_offsets(jnp.array([[3, 2]]), jnp.array([[0, 3, 5]]))
  >>> ids, pos = sd.segments(batch=1, q_len=6, kv_len=6)
  >>> ids[0].tolist(), pos[0].tolist()
  ([[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]])
  >>> attn = te_flax.DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type="padding_causal")
  >>> q = jnp.ones((1, 6, 2, 8))
  >>> attn.apply({}, q, q, q, sd, deterministic=True).shape
  (1, 6, 2, 8)
  """

  def __init__(self, seqlens=None, seq_offsets=None, segment_ids=None, segment_pos=None):
    """Use the ``from_*`` constructors; this one takes the pairs as they are (for ``tree_unflatten``)."""
    self.seqlens = seqlens
    self.seq_offsets = seq_offsets
    self.segment_ids = segment_ids
    self.segment_pos = segment_pos

  def tree_flatten(self):
    return (self.seqlens, self.seq_offsets, self.segment_ids, self.segment_pos), None

  @classmethod
  def tree_unflatten(cls, aux_data, children):
    del aux_data
    return cls(*children)

  def __repr__(self) -> str:
    kind = ("segment ids and positions" if self.segment_ids is not None else
            "seqlens and offsets" if self.seq_offsets is not None else "seqlens")
    return f"SequenceDescriptor({kind})"

  @classmethod
  def from_seqlens(cls, seqlens) -> "SequenceDescriptor":
    """One sequence per row: ``seqlens`` (B,) integer, or a pair (q_seqlens, kv_seqlens)."""
    q, kv = _pair("seqlens", seqlens)
    for name, x in (("q_seqlens", q), ("kv_seqlens", kv)):
      _check_ints(name, x, 1)
    return cls(seqlens=(q, kv))

  @classmethod
  def from_seqlens_and_offsets(cls, seqlens, seq_offsets) -> "SequenceDescriptor":
    """Packed sequences: ``seqlens`` (B, M) and ``seq_offsets`` (B, M + 1), integer, each for both or a pair."""
    lens, offsets = _pair("seqlens", seqlens), _pair("seq_offsets", seq_offsets)
    for side, n, o in zip(("q", "kv"), lens, offsets, strict=True):
      _check_ints(f"{side}_seqlens", n, 2)
      _check_ints(f"{side}_seq_offsets", o, 2)
      if tuple(o.shape) != (n.shape[0], n.shape[1] + 1):
        raise ValueError(f"{side}_seq_offsets must have shape (B, M + 1) = ({n.shape[0]}, {n.shape[1] + 1}) for "
                         f"{side}_seqlens of shape {tuple(n.shape)}, got {tuple(o.shape)}")
    return cls(seqlens=lens, seq_offsets=offsets)

  @classmethod
  def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None) -> "SequenceDescriptor":
    """Segment ids (B, L), 0 = padding, and each token's position within its segment, each for both or a pair."""
    if segment_pos is None:
      raise ValueError("segment_pos is required (as in Transformer Engine): each token's position within its "
                       "segment; for sequences in their natural order pass segment_pos=te_jax.segment_positions(ids) "
                       "(for a pair of ids, a pair of positions)")
    ids, pos = _pair("segment_ids", segment_ids), _pair("segment_pos", segment_pos)
    for side, i, p in zip(("q", "kv"), ids, pos, strict=True):
      _check_ints(f"{side}_segment_ids", i, 2)
      _check_ints(f"{side}_segment_pos", p, 2)
      if i.shape != p.shape:
        raise ValueError(f"{side}_segment_pos must have {side}_segment_ids' shape {tuple(i.shape)}, got "
                         f"{tuple(p.shape)}")
    return cls(segment_ids=ids, segment_pos=pos)

  def segments(self, *, batch: int, q_len: int, kv_len: int):
    """The descriptor as te_jax's attention takes it: ``(segment_ids, segment_pos)``, pairs of (B, T) and (B, S)
    int32 arrays; ``segment_pos`` None for ``from_seqlens``, whose positions are the indices."""
    if self.segment_ids is not None:
      for side, ids, n in (("q", self.segment_ids[0], q_len), ("kv", self.segment_ids[1], kv_len)):
        if tuple(ids.shape) != (batch, n):
          raise ValueError(f"the SequenceDescriptor's {side}_segment_ids have shape {tuple(ids.shape)}; this "
                           f"attention's are (B, {'T' if side == 'q' else 'S'}) = ({batch}, {n})")
      return tuple(self.segment_ids), tuple(self.segment_pos)
    for side, lens in (("q", self.seqlens[0]), ("kv", self.seqlens[1])):
      if lens.shape[0] != batch:
        raise ValueError(f"the SequenceDescriptor's {side}_seqlens have batch {lens.shape[0]}; this attention's is "
                         f"{batch}")
    if self.seq_offsets is None:
      ids = tuple((jnp.arange(n)[None, :] < lens[:, None]).astype(jnp.int32)
                  for lens, n in zip(self.seqlens, (q_len, kv_len), strict=True))
      return ids, None
    ids, pos = zip(*(_from_offsets(lens, offsets, n)
                     for lens, offsets, n in zip(self.seqlens, self.seq_offsets, (q_len, kv_len), strict=True)))
    return tuple(ids), tuple(pos)


def _from_offsets(seqlens: jax.Array, offsets: jax.Array, n: int):
  """Segment ids and positions (B, n) int32 of packed sequences: token ``t`` is in sequence ``k`` where
  ``offsets[k] <= t < offsets[k] + seqlens[k]`` (id ``k + 1``, position ``t - offsets[k]``), else padding."""
  lens, starts = seqlens.astype(jnp.int32), offsets[:, :-1].astype(jnp.int32)
  t = jnp.arange(n, dtype=jnp.int32)[None, None, :]
  inside = (lens[:, :, None] > 0) & (starts[:, :, None] >= 0) & (t >= starts[:, :, None]) & (
      t < starts[:, :, None] + lens[:, :, None])  # (B, M, n)
  k = jnp.arange(1, lens.shape[1] + 1, dtype=jnp.int32)[None, :, None]
  ids = jnp.max(jnp.where(inside, k, 0), axis=1)
  pos = jnp.max(jnp.where(inside, t - starts[:, :, None], 0), axis=1)
  return ids, pos


def sequence_shape(query, key, qkv_layout: str) -> tuple[int, int, int]:
  """(B, T, S) of attention inputs in ``qkv_layout`` (packed or not, batch or sequence first)."""
  tensor_format, packing = QKV_LAYOUTS[qkv_layout]
  seq, batch = (0, 1) if tensor_format == "SBHD" else (1, 0)
  kv = query if packing == "qkv" or key is None else key
  return query.shape[batch], query.shape[seq], kv.shape[seq]


def resolve_sequences(mask, segment_ids, segment_pos, *, batch: int, q_len: int, kv_len: int,
                      attn_mask_type: str):
  """An attention call's ``mask``, ``segment_ids`` and ``segment_pos`` with a ``SequenceDescriptor`` (given as the
  mask or as the segment ids) turned into segment ids and positions: ``(mask, segment_ids, segment_pos)``."""
  if isinstance(segment_pos, SequenceDescriptor):
    raise TypeError("segment_pos takes positions; pass a SequenceDescriptor as the mask or as segment_ids")
  if isinstance(mask, SequenceDescriptor):
    if segment_ids is not None or segment_pos is not None:
      raise ValueError("a SequenceDescriptor was given as the mask: it describes the sequences, so give no "
                       "segment_ids or segment_pos beside it")
    descriptor, mask = mask, None
  elif isinstance(segment_ids, SequenceDescriptor):
    if segment_pos is not None:
      raise ValueError("segment_ids is a SequenceDescriptor, which holds the positions: give no segment_pos beside it")
    descriptor, segment_ids = segment_ids, None
  else:
    return mask, segment_ids, segment_pos
  if attn_mask_type not in PADDING_TYPES + ("arbitrary",):
    raise ValueError(f"a SequenceDescriptor gives the padding of attn_mask_type 'padding', 'padding_causal' or "
                     f"'padding_causal_bottom_right' (or 'arbitrary' with a mask); attn_mask_type={attn_mask_type!r} "
                     "takes none: give a padding type")
  segment_ids, segment_pos = descriptor.segments(batch=batch, q_len=q_len, kv_len=kv_len)
  return mask, segment_ids, segment_pos
