"""``context_parallel_attention``: attention over a sequence sharded across the devices of one mesh axis (context
parallelism, CP), and the zig-zag order that balances causal attention's work over them.

Under ``jax.jit``, query, key and value are global (B, S, H, D) arrays whose sequence axis is sharded over the mesh
axis ``axis`` (P devices, each holding S / P tokens); the batch may be sharded over other axes (``batch_axes``, by
default every other mesh axis) and the heads too (``head_axes``). The attention runs in a ``jax.shard_map`` with
those specs, collectives over ``axis`` only, each device computing the output of its own queries (all-to-all: of
its heads), in one of three strategies:

- ``"all_gather"``: every device gathers the whole K and V (and the key segment ids) over ``axis`` and attends its
  queries to them, the causal mask shifted to its queries' positions (``te_jax.dot_product_attention`` with the mask
  spelled out; the backward's dK, dV are reduce-scattered back). One collective, P times the K/V memory per device.
- ``"ring"``: P steps; at each, every device attends its queries to the K/V block it holds while passing that block
  to the next device (``jax.lax.ppermute``, independent of the step's compute, so XLA can overlap the two). The
  blocks' outputs are merged with their softmax log-sum-exp, online, in float32. The backward (a ``custom_vjp``) runs
  the ring again: each step recomputes its block (``jax.vjp`` of the unfused attention with its log-sum-exp, the
  same math as the forward, no flash-attention formulas of its own) and dK, dV travel with their K/V block, arriving
  home after P steps. Memory per device: two K/V blocks and one block's logits, never the whole K/V: for the
  gradient at T = 4096, P = 4, 4 heads of 64, float32, XLA:CPU plans 74 MiB of temporaries per device, against
  496 MiB for JAX's autodiff of the forward loop (it keeps every step's probabilities) and 262 MiB for
  "all_gather". Causal blocks that are fully masked are skipped (``lax.switch``), which is where load balancing
  pays.
- ``"all_to_all"`` (DeepSpeed-Ulysses, arXiv 2309.14509): one all-to-all per Q, K and V trades the sequence shard
  for a head shard, so each device holds the whole sequence for H / P of the heads and runs ordinary attention on
  it (any backend, cuDNN's causal mask included: no offsets, nothing spelled out densely); a last all-to-all trades
  the output back. The backward is the same collectives transposed. It needs the local query heads to be a
  multiple of P; K/V heads that are fewer than P (GQA, MQA) are repeated onto the devices of their query heads
  first (P a multiple of their count). Communication per device is about 4 / P of the activations, whatever P.

**Load balancing (zig-zag).** With a causal mask, device i of a contiguous split owns queries that see i + 1 of the
P key blocks: the last device does P times the first one's work. ``load_balanced=True`` takes the sequence in
zig-zag order instead: split into 2P chunks, device i holds chunks i and 2P - 1 - i, and in the ring every step
after the first computes exactly half a block on every device. **The inputs must then already be in that order**
(``to_zigzag`` on the token batch, labels, segment ids and any per-token input, ``from_zigzag`` on outputs), and so
must every position the model computes from: RoPE takes ``positions=zigzag_order(S, P)`` (``te_jax.flax``'s
attention raises when it would default to ``arange(S)``). Masks that do not depend on positions ("no_mask",
"padding") give the same result either way; their work is balanced already.

Masks: "no_mask", "causal", and the padding as ``segment_ids`` ("padding", "padding_causal"): packed sequences,
ids sharded with the sequence; the key ids travel with K/V. Dense masks, biases, windows and dropout are not
supported (a ValueError names the argument). Causal masks need self attention (T == S).

Backends: the ring's per-block attention is te_jax's unfused math (``attention_unfused.unfused_with_lse``, the
softmax kernels): JAX's cuDNN call returns no log-sum-exp to merge blocks with. ``"all_gather"`` takes ``backend``
through to ``te_jax.dot_product_attention``, so on a GPU it may run cuDNN; JAX's cuDNN call has no causal mask with
an offset, so there the shifted causal mask (and the segment ids) go in as a dense additive bias (T/P * S per
example) and cuDNN does not skip the masked half. ``"all_to_all"`` takes ``backend`` through too, with the plain causal mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from te_jax._core.manual_axes import to_common_varying
from te_jax.fused.attention import AttentionBackend, attention_backend, dot_product_attention
from te_jax.fused.attention_config import BACKENDS, QKV_LAYOUTS, configure, segment_pair, unpack, unpack_shapes
from te_jax.fused.attention_masks import combine, segment_mask
from te_jax.fused.attention_unfused import unfused_with_lse

__all__ = ["CP_MASK_TYPES", "CP_STRATEGIES", "check_layer_options", "context_parallel_attention",
           "context_parallel_backend", "from_zigzag", "resolve_cp_mesh", "to_zigzag", "zigzag_order"]

CP_STRATEGIES = ("all_gather", "ring", "all_to_all")
CP_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal")
_CP_LAYOUTS = tuple(name for name, (fmt, _) in QKV_LAYOUTS.items() if fmt == "BSHD")


# ---- the zig-zag order -----------------------------------------------------------------------------------------


def zigzag_order(seq_len: int, cp: int) -> np.ndarray:
  """The token positions of a sequence of ``seq_len`` in zig-zag order for ``cp`` devices: the sequence split into
  ``2 cp`` chunks, device i's contiguous shard holding chunks i and ``2 cp - 1 - i``. ``x[:, order]`` puts a batch in
  that order, and ``order`` itself is the permuted tokens' positions (RoPE's ``positions``).

  >>> import te_jax
  >>> te_jax.zigzag_order(8, 2).tolist()   # device 0: chunks 0 and 3; device 1: chunks 1 and 2
  [0, 1, 6, 7, 2, 3, 4, 5]
  """
  if not (isinstance(cp, (int, np.integer)) and cp >= 1):
    raise ValueError(f"cp must be a positive int (the context-parallel axis size), got {cp!r}")
  if seq_len % (2 * cp):
    raise ValueError(f"the zig-zag order splits the sequence into 2 * cp = {2 * cp} equal chunks: seq_len={seq_len} "
                     "is not a multiple")
  chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def _take(x, index: np.ndarray, axis: int):
  axis = axis % x.ndim
  return x[(slice(None),) * axis + (index,)]


def to_zigzag(x, cp: int, axis: int = 1):
  """``x`` (numpy or jax array) with its sequence axis ``axis`` put in ``zigzag_order`` for ``cp`` devices.

  >>> import numpy as np, te_jax
  >>> te_jax.to_zigzag(np.arange(8)[None], 2).tolist()
  [[0, 1, 6, 7, 2, 3, 4, 5]]
  """
  return _take(x, zigzag_order(x.shape[axis % x.ndim], cp), axis)


def from_zigzag(x, cp: int, axis: int = 1):
  """The inverse of ``to_zigzag``: the sequence axis back in its natural order.

  >>> import numpy as np, te_jax
  >>> te_jax.from_zigzag(te_jax.to_zigzag(np.arange(8)[None], 2), 2).tolist()
  [[0, 1, 2, 3, 4, 5, 6, 7]]
  """
  return _take(x, np.argsort(zigzag_order(x.shape[axis % x.ndim], cp)), axis)


# ---- arguments -------------------------------------------------------------------------------------------------


def resolve_cp_mesh(mesh, axis):
  """``mesh``, else the mesh set in context (``jax.set_mesh``), checked to have the axis ``axis``."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError(f"context parallelism over axis {axis!r} needs a mesh: pass mesh=..., or call inside "
                       "`with jax.set_mesh(mesh):`")
  if not isinstance(axis, str) or axis not in mesh.axis_names:
    raise ValueError(f"the context-parallel axis {axis!r} is not an axis of the mesh (axes {mesh.axis_names})")
  return mesh


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static description of one context-parallel call (lengths are per device)."""

  axis: str
  cp: int
  causal: bool
  load_balanced: bool
  q_local: int
  kv_local: int
  scale: float
  backend: str
  batch: tuple[str, ...]  # the mesh axes of the batch dim, and of the heads dim
  heads: tuple[str, ...]

  def spec(self, ndim: int) -> P:
    """The PartitionSpec of a (B, S, ...) operand: batch, sequence over ``axis``, heads (for ndim >= 3)."""
    entries = [self.batch or None, self.axis, self.heads or None][:min(ndim, 3)]
    return P(*entries)

  def positions(self, device, local: int) -> jax.Array:
    """The token positions held by ``device`` (may be traced): its shard of ``zigzag_order`` or of ``arange``."""
    total = local * self.cp
    order = zigzag_order(total, self.cp) if self.load_balanced and self.causal else np.arange(total)
    return jnp.asarray(order.reshape(self.cp, local).astype(np.int32))[device]


def check_layer_options(*, bias=None, attn_bias_type=None, window_size=None, fp8_dpa=None,
                        transpose_batch_sequence: bool = False, decode: bool = False) -> None:
  """An attention layer's options that ``context_parallel`` does not combine with: a ValueError naming the first one
  set. (``fp8_dpa=None`` is fine: the recipe's FP8 attention is then not used.)"""
  unsupported = [("bias", bias is not None or attn_bias_type not in (None, "no_bias"), "an attention bias (or ALiBi)"),
                 ("window_size", window_size is not None, "a sliding window"),
                 ("fp8_dpa", fp8_dpa is True, "FP8 attention"),
                 ("transpose_batch_sequence", transpose_batch_sequence, "sequence-first tensors"),
                 ("decode", decode, "a KV cache")]
  for name, given, what in unsupported:
    if given:
      raise ValueError(f"{name}: context_parallel attention does not support {what}")


def _as_axes(name: str, value) -> tuple[str, ...]:
  value = (value,) if isinstance(value, str) else value
  if not (isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value)):
    raise TypeError(f"{name} must be a mesh axis name or a tuple of them, got {value!r}")
  return tuple(value)


def _layout_axes(mesh, axis: str, batch_axes, head_axes, batch: int, heads: int, kv_heads: int):
  """The mesh axes of the batch and of the heads, checked against the mesh and the sizes."""
  heads_ = _as_axes("head_axes", head_axes)
  if batch_axes is None:
    batch_ = tuple(a for a in mesh.axis_names if a != axis and a not in heads_)
  else:
    batch_ = _as_axes("batch_axes", batch_axes)
  for name, group in (("batch_axes", batch_), ("head_axes", heads_)):
    unknown = [a for a in group if a not in mesh.axis_names]
    if unknown:
      raise ValueError(f"{name}={group!r}: {unknown} not in the mesh's axes {mesh.axis_names}")
    if axis in group:
      raise ValueError(f"{name}={group!r} includes the context-parallel axis {axis!r}")
  if set(batch_) & set(heads_) or len(set(batch_)) != len(batch_) or len(set(heads_)) != len(heads_):
    raise ValueError(f"batch_axes={batch_!r} and head_axes={heads_!r} must name each mesh axis at most once")
  def size(group):
    return int(np.prod([mesh.shape[a] for a in group]))

  if batch % size(batch_):
    raise ValueError(f"batch_axes={batch_!r} ({size(batch_)} shards) do not divide the batch {batch}: name the axes "
                     "the batch is sharded over (None: every mesh axis but the context-parallel and head axes)")
  if heads % size(heads_) or kv_heads % size(heads_):
    raise ValueError(f"head_axes={heads_!r} ({size(heads_)} shards) do not divide the heads ({heads} query, "
                     f"{kv_heads} key/value)")
  return batch_, heads_


def _check(q, k, strategy, load_balanced, attn_mask_type, segment_ids, mask, dropout_rate, backend, cp):
  if strategy not in CP_STRATEGIES:
    raise ValueError(f"strategy must be one of {CP_STRATEGIES}, got {strategy!r}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if not isinstance(load_balanced, bool):
    raise TypeError(f"load_balanced must be a bool, got {load_balanced!r}")
  if attn_mask_type not in CP_MASK_TYPES:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} is not supported with context parallelism: use one of "
                     f"{CP_MASK_TYPES}")
  if mask is not None:
    raise ValueError("mask: context parallel attention takes no dense mask; give the padding as segment_ids (B, S), "
                     "sharded with the sequence")
  if attn_mask_type.startswith("padding") and segment_ids is None:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} needs segment_ids (the padding, 0 = padding token)")
  if dropout_rate != 0:
    raise ValueError(f"dropout_rate={dropout_rate}: context parallel attention takes no attention dropout")
  if strategy == "ring" and backend == "fused":
    raise ValueError("backend='fused' with strategy='ring': the ring merges blocks by their log-sum-exp, which JAX's "
                     "cuDNN call does not return; use backend='auto' or 'unfused' (or strategy='all_gather')")
  t, s = q.shape[1], k.shape[1]
  if "causal" in attn_mask_type and t != s:
    raise ValueError(f"attn_mask_type={attn_mask_type!r} with context parallelism needs self attention (query and "
                     f"key lengths equal), got {t} and {s}")
  chunks = 2 * cp if (load_balanced and "causal" in attn_mask_type) else cp
  if t % chunks or s % chunks:
    what = f"2 * cp = {chunks} (load balancing)" if chunks != cp else f"the context-parallel axis size {cp}"
    raise ValueError(f"the sequence lengths ({t}, {s}) must be multiples of {what}")


def context_parallel_attention(query: jax.Array, key: jax.Array | None = None, value: jax.Array | None = None, *,
                               axis: str, mesh=None, strategy: str = "all_gather", load_balanced: bool = True,
                               attn_mask_type: str = "causal", segment_ids=None, mask=None,
                               scale_factor: float | None = None, dropout_rate: float = 0.0,
                               qkv_layout: str = "BSHD", backend: str = "auto", batch_axes=None,
                               head_axes=()) -> jax.Array:
  """Scaled dot-product attention with the sequence sharded over the mesh axis ``axis`` (see the module docstring):
  the same values and gradients as ``te_jax.dot_product_attention`` on the whole sequence.

  >>> import jax, numpy as np, te_jax
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> cp = len(jax.devices())
  >>> mesh = Mesh(np.array(jax.devices()), ("cp",))
  >>> x = jax.random.normal(jax.random.key(0), (1, 8 * cp, 2, 16))
  >>> zz = jax.device_put(te_jax.to_zigzag(x, cp), NamedSharding(mesh, P(None, "cp")))   # zig-zag, then sharded
  >>> attend = jax.jit(lambda x: te_jax.context_parallel_attention(x, x, x, axis="cp", mesh=mesh, strategy="ring"))
  >>> out = te_jax.from_zigzag(attend(zz), cp)
  >>> bool(np.allclose(out, te_jax.dot_product_attention(x, x, x, attn_mask_type="causal"), atol=1e-5))
  True

  Args:
    query: (B, T, H, D), sequence-sharded over ``axis``; (B, T, 3, H, D) packed for "BS3HD".
    key: (B, S, Hk, D) with Hk dividing H; (B, S, 2, Hk, D) packed for "BSHD_BS2HD"; None when packed in ``query``.
    value: (B, S, Hk, Dv); None when packed.
    axis: the mesh axis the sequence is sharded over.
    mesh: a ``jax.sharding.Mesh`` (or ``AbstractMesh``) with ``axis``; None: the mesh set by ``jax.set_mesh``.
    strategy: "all_gather", "ring" or "all_to_all" (``CP_STRATEGIES``).
    load_balanced: the sequence is in zig-zag order (``to_zigzag``); only causal masks depend on it.
    attn_mask_type: "no_mask", "padding", "causal" or "padding_causal" (``CP_MASK_TYPES``).
    segment_ids: int (B, S) or a pair (q_ids (B, T), kv_ids (B, S)), sharded (and ordered) as the sequence: tokens
      attend within their segment; 0 is padding. Required by the padding types.
    mask: must be None (dense masks are not supported; give segment ids).
    scale_factor: the logits' scale; None is 1 / sqrt(D).
    dropout_rate: must be 0.
    qkv_layout: "BSHD", "BS3HD" or "BSHD_BS2HD".
    backend: "auto", "fused" (all_gather only: cuDNN) or "unfused".
    batch_axes: the mesh axes the batch is sharded over (a name or a tuple); None: every mesh axis other than
      ``axis`` and ``head_axes`` (data parallelism over the rest of the mesh). Inputs sharded otherwise are
      resharded to this layout by XLA (correct, with collectives); () for a batch replicated over the other axes.
    head_axes: the mesh axes the heads are sharded over (tensor parallelism), () for none.

  Returns:
    (B, T, H, Dv) in the query's dtype, sharded as the query.
  """
  if qkv_layout not in _CP_LAYOUTS:
    raise ValueError(f"qkv_layout={qkv_layout!r}: context parallel attention takes a batch-first layout, one of "
                     f"{_CP_LAYOUTS}")
  q, k, v = unpack(query, key, value, qkv_layout)
  mesh = resolve_cp_mesh(mesh, axis)
  cp = int(mesh.shape[axis])
  _check(q, k, strategy, load_balanced, attn_mask_type, segment_ids, mask, dropout_rate, backend, cp)
  cfg = configure(q, k, v, None, None, segment_ids, attn_mask_type=attn_mask_type, attn_bias_type=None,
                  scale_factor=scale_factor, dropout_rate=0.0, window_size=None, tensor_format="BSHD",
                  fp8_dpa=False, mask_convention="flax")
  segs = () if segment_ids is None else tuple(segment_pair(segment_ids, cfg.batch, cfg.q_len, cfg.kv_len))
  batch, heads = _layout_axes(mesh, axis, batch_axes, head_axes, cfg.batch, cfg.heads, cfg.kv_heads)
  plan = _Plan(axis=axis, cp=cp, causal="causal" in attn_mask_type, load_balanced=load_balanced,
               q_local=cfg.q_len // cp, kv_local=cfg.kv_len // cp, scale=cfg.scale, backend=backend, batch=batch,
               heads=heads)
  if strategy == "all_to_all":
    _check_heads_split(cfg.heads, cfg.kv_heads, mesh, heads, cp)
  if strategy == "all_gather":
    return _all_gather(q, k, v, segs, plan, mesh)
  if strategy == "all_to_all":
    return _all_to_all(q, k, v, segs, plan, mesh)
  return _ring(q, k, v, segs, plan, mesh)


def context_parallel_backend(query, key=None, value=None, *, strategy: str = "all_gather",
                             attn_mask_type: str = "causal", segment_ids=None, qkv_layout: str = "BSHD",
                             backend: str = "auto", **unused) -> AttentionBackend:
  """The backend of each device's attention in ``context_parallel_attention`` with these arguments (arrays or
  ``jax.ShapeDtypeStruct``), and why. Other keywords of ``te_jax.attention_backend`` are accepted and ignored.

  >>> import jax, jax.numpy as jnp, te_jax
  >>> q = jax.ShapeDtypeStruct((2, 128, 8, 64), jnp.bfloat16)
  >>> te_jax.context_parallel_backend(q, q, q, strategy="ring").name
  'unfused'
  """
  del unused
  if strategy not in CP_STRATEGIES:
    raise ValueError(f"strategy must be one of {CP_STRATEGIES}, got {strategy!r}")
  if strategy == "ring":
    if backend == "fused":
      raise ValueError("backend='fused' with strategy='ring': the ring merges blocks by their log-sum-exp, which "
                       "JAX's cuDNN call does not return")
    return AttentionBackend("unfused", "context parallel ring: unfused attention per block (JAX's cuDNN call returns "
                            "no log-sum-exp to merge blocks with)")
  if qkv_layout not in _CP_LAYOUTS:
    raise ValueError(f"qkv_layout={qkv_layout!r}: context parallel attention takes a batch-first layout, one of "
                     f"{_CP_LAYOUTS}")
  q, k, v = (unpack_shapes if QKV_LAYOUTS[qkv_layout][1] else unpack)(query, key, value, qkv_layout)
  if strategy == "all_to_all":  # the whole sequence, a share of the heads: the mask as given
    choice = attention_backend(q, k, v, None, None, segment_ids=segment_ids, attn_mask_type=attn_mask_type,
                               backend=backend, mask_convention="te")
    return AttentionBackend(choice.name, f"context parallel all_to_all: {choice.reason}")
  causal = "causal" in attn_mask_type
  mask = jax.ShapeDtypeStruct((1, 1, q.shape[1], k.shape[1]), jnp.bool_) if causal else None
  mask_type = "arbitrary" if causal else attn_mask_type
  choice = attention_backend(q, k, v, None, mask, segment_ids=segment_ids, attn_mask_type=mask_type,
                             backend=backend, mask_convention="te")
  return AttentionBackend(choice.name, f"context parallel all_gather: {choice.reason}")


def _sharded(body, plan: _Plan, mesh, in_ndims, out_ndims):
  """``body`` in a shard_map over every mesh axis, operands and results of ``in_ndims`` / ``out_ndims`` dims sharded
  by ``plan.spec``. Manual over every axis, not over ``axis`` alone: in jax 0.11.2 a partially manual shard_map
  all-gathers the batch over the automatic axes before a ``lax.all_gather`` and around te_jax's custom-partitioned
  softmax, so the batch and heads axes are named (``batch_axes``, ``head_axes``)."""
  out_specs = tuple(plan.spec(n) for n in out_ndims)
  return jax.shard_map(functools.partial(body, plan=plan), mesh=mesh, in_specs=tuple(plan.spec(n) for n in in_ndims),
                       out_specs=out_specs if len(out_specs) > 1 else out_specs[0])


def _causal_mask(q_pos, k_pos):
  """True where key position > query position, (1, 1, T, S)."""
  return (k_pos[None, :] > q_pos[:, None])[None, None]


# ---- all-gather ------------------------------------------------------------------------------------------------


def _all_gather(q, k, v, segs, plan: _Plan, mesh):
  return _sharded(_all_gather_body, plan, mesh, (4, 4, 4) + (2,) * len(segs), (4,))(q, k, v, *segs)


def _all_gather_body(q, k, v, *segs, plan: _Plan):
  gather = functools.partial(jax.lax.all_gather, axis_name=plan.axis, axis=1, tiled=True)
  k, v = gather(k), gather(v)
  segment_ids = (segs[0], gather(segs[1])) if segs else None
  mask = None
  if plan.causal:
    q_pos = plan.positions(jax.lax.axis_index(plan.axis), plan.q_local)
    k_pos = plan.positions(slice(None), plan.kv_local).reshape(-1)  # every device's keys, in the gathered order
    mask = _causal_mask(q_pos, k_pos)
  mask_type = "arbitrary" if mask is not None else ("padding" if segs else "no_mask")
  return dot_product_attention(q, k, v, mask=mask, segment_ids=segment_ids, attn_mask_type=mask_type,
                               scale_factor=plan.scale, backend=plan.backend, mask_convention="te")


# ---- all-to-all (Ulysses) ------------------------------------------------------------------------------------


def _check_heads_split(heads: int, kv_heads: int, mesh, head_axes: tuple[str, ...], cp: int) -> None:
  shards = int(np.prod([mesh.shape[a] for a in head_axes]))
  local, kv_local = heads // shards, kv_heads // shards
  if local % cp:
    raise ValueError(f"strategy='all_to_all' splits the heads over the {cp} devices of the context-parallel axis: "
                     f"{local} query heads per device are not a multiple of {cp}; use strategy='ring' or "
                     "'all_gather'")
  if kv_local % cp and cp % kv_local:
    raise ValueError(f"strategy='all_to_all': {kv_local} key/value heads per device neither split over nor repeat "
                     f"onto the {cp} devices of the context-parallel axis; use strategy='ring' or 'all_gather'")


def _all_to_all(q, k, v, segs, plan: _Plan, mesh):
  return _sharded(_all_to_all_body, plan, mesh, (4, 4, 4) + (2,) * len(segs), (4,))(q, k, v, *segs)


def _all_to_all_body(q, k, v, *segs, plan: _Plan):
  if k.shape[2] % plan.cp:  # fewer K/V heads than devices: each onto the devices of its query heads
    k, v = (jnp.repeat(x, plan.cp // k.shape[2], axis=2) for x in (k, v))
  to_heads = functools.partial(jax.lax.all_to_all, axis_name=plan.axis, split_axis=2, concat_axis=1, tiled=True)
  q, k, v = to_heads(q), to_heads(k), to_heads(v)  # (B, S, H / P, D): the sequence in the devices' order
  ids = tuple(jax.lax.all_gather(x, plan.axis, axis=1, tiled=True) for x in segs)
  zigzag = plan.causal and plan.load_balanced
  if zigzag:  # attend in the natural order, where the causal mask is the plain one
    order = zigzag_order(q.shape[1], plan.cp)
    natural = np.argsort(order)
    q, k, v = (x[:, natural] for x in (q, k, v))
    ids = tuple(x[:, natural] for x in ids)
  mask_type = ("padding_causal" if ids else "causal") if plan.causal else ("padding" if ids else "no_mask")
  out = dot_product_attention(q, k, v, segment_ids=ids or None, attn_mask_type=mask_type, scale_factor=plan.scale,
                              backend=plan.backend, mask_convention="te")
  if zigzag:
    out = out[:, order]
  return jax.lax.all_to_all(out, plan.axis, split_axis=1, concat_axis=2, tiled=True)


# ---- ring: blocks --------------------------------------------------------------------------------------------------


def _attend_block(q, k, v, q_pos, k_pos, q_ids, kv_ids, plan: _Plan):
  """One block: (out float32 (B, t, H, Dv), lse float32 (B, t, H)) of queries ``q`` over keys ``k``."""
  segs = None if q_ids is None else (q_ids, kv_ids)
  cfg = configure(q, k, v, None, None, segs, attn_mask_type="padding" if segs else "no_mask", attn_bias_type=None,
                  scale_factor=plan.scale, dropout_rate=0.0, window_size=None, tensor_format="BSHD", fp8_dpa=False,
                  mask_convention="te")
  mask = combine(None if segs is None else segment_mask(segs, cfg),
                 _causal_mask(q_pos, k_pos) if plan.causal else None)
  return unfused_with_lse(q, k, v, None, mask, cfg)


class _Held(NamedTuple):
  """What a device holds at a ring step: the K/V block (and its segment ids) that travels."""

  k: jax.Array
  v: jax.Array
  kv_ids: jax.Array | None


def _parts(plan: _Plan):
  """The parts of a block a ring step may compute, as (query slice, key slice), None for nothing: causal blocks are
  fully masked in known parts, which are skipped.

  Zig-zag (``load_balanced``): the whole block on the diagonal (step 0, masked by positions); after it, from an
  earlier device every query sees the first key chunk and none of the second (the keys' first half), from a later
  one the first query chunk sees nothing and the second sees every key (the queries' second half): half a block on
  every device at every step. Contiguous: the whole block, or nothing for a block from a later device.
  """
  every = slice(None)
  if not plan.causal:
    return [(every, every)]
  if plan.load_balanced:
    return [(every, every), (every, slice(0, plan.kv_local // 2)), (slice(plan.q_local // 2, None), every)]
  return [(every, every), None]


def _block_kind(plan: _Plan, step, device, source):
  """The index in ``_parts(plan)`` of the part computed at ``step`` for the block of ``source`` (traced)."""
  if not plan.causal:
    return 0
  if plan.load_balanced:
    return jnp.where(step == 0, 0, jnp.where(source < device, 1, 2))
  return jnp.where(source <= device, 0, 1)


def _pad_to(x, part: slice, length: int, fill, axis: int = 1):
  """``x``, computed for ``part`` of ``length`` entries along ``axis``, padded with ``fill`` to all of them."""
  start = part.start or 0
  stop = length if part.stop is None else part.stop
  widths = [(0, 0)] * x.ndim
  widths[axis] = (start, length - stop)
  return jnp.pad(x, widths, constant_values=fill) if start or stop != length else x


def _switch(plan: _Plan, kind, branch, *operands):
  """``branch(part)(*operands)`` for the part ``kind`` of ``_parts(plan)`` (a ``lax.switch`` when there are several)."""
  parts = _parts(plan)
  if len(parts) == 1:
    return branch(parts[0])(*operands)
  return jax.lax.switch(kind, [branch(p) for p in parts], *operands)


def _block_forward(plan: _Plan, kind, q, held: _Held, q_pos, k_pos, q_ids):
  b, t, h = q.shape[:3]

  def branch(part):
    def run(q, held, q_pos, k_pos, q_ids):
      if part is None:
        out = jnp.zeros((b, t, h, held.v.shape[-1]), jnp.float32)
        return to_common_varying(out, jnp.full((b, t, h), -jnp.inf, jnp.float32), q, held.v)[:2]
      qs, ks = part
      kv_ids = None if held.kv_ids is None else held.kv_ids[:, ks]
      out, lse = _attend_block(q[:, qs], held.k[:, ks], held.v[:, ks], q_pos[qs], k_pos[ks],
                               None if q_ids is None else q_ids[:, qs], kv_ids, plan)
      return _pad_to(out, qs, t, 0.0), _pad_to(lse, qs, t, -jnp.inf)
    return run

  return _switch(plan, kind, branch, q, held, q_pos, k_pos, q_ids)


def _merge(out, lse, block_out, block_lse):
  """The online-softmax merge of a block's (output, log-sum-exp) into the running ones, float32."""
  new = jnp.logaddexp(lse, block_lse)
  def weight(x):
    return jnp.where(new == -jnp.inf, 0.0, jnp.exp(x - new))[..., None]
  return out * weight(lse) + block_out * weight(block_lse), new


def _block_backward(plan: _Plan, kind, q, held: _Held, q_pos, k_pos, q_ids, lse, dout, delta):
  """(dq, dk, dv) in float32 of one block, from the merged output's cotangent: the block's output entered the merged
  one with weight ``w = exp(lse_block - lse)``, so its cotangents are ``w dout`` for its output and
  ``w (<dout, out_block> - <dout, out>)`` for its log-sum-exp; ``jax.vjp`` of the block's forward does the rest."""
  t, s = q.shape[1], held.k.shape[1]

  def branch(part):
    def run(q, held, q_pos, k_pos, q_ids, lse, dout, delta):
      zeros = [jnp.zeros(x.shape, jnp.float32) for x in (q, held.k, held.v)]
      if part is None:
        return tuple(to_common_varying(*zeros, q, held.k)[:3])
      qs, ks = part
      kv_ids = None if held.kv_ids is None else held.kv_ids[:, ks]
      q_ids_part = None if q_ids is None else q_ids[:, qs]
      attend = functools.partial(_attend_block, q_pos=q_pos[qs], k_pos=k_pos[ks], q_ids=q_ids_part, kv_ids=kv_ids,
                                 plan=plan)
      (out_b, lse_b), pull = jax.vjp(attend, q[:, qs], held.k[:, ks], held.v[:, ks])
      w = jnp.where(lse_b == -jnp.inf, 0.0, jnp.exp(lse_b - lse[:, qs]))
      do = dout[:, qs]
      dq, dk, dv = pull((do * w[..., None], w * (jnp.sum(do * out_b, axis=-1) - delta[:, qs])))
      return (_pad_to(dq.astype(jnp.float32), qs, t, 0.0), _pad_to(dk.astype(jnp.float32), ks, s, 0.0),
              _pad_to(dv.astype(jnp.float32), ks, s, 0.0))
    return run

  return _switch(plan, kind, branch, q, held, q_pos, k_pos, q_ids, lse, dout, delta)


# ---- ring: the loops -----------------------------------------------------------------------------------------------


def _rotate(x, plan: _Plan):
  """Every device's ``x`` (a pytree) to the next device on the ring."""
  perm = [(i, (i + 1) % plan.cp) for i in range(plan.cp)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, plan.axis, perm), x)


def _ring_forward_body(q, k, v, *segs, plan: _Plan):
  device = jax.lax.axis_index(plan.axis)
  q_ids = segs[0] if segs else None
  q_pos = plan.positions(device, plan.q_local)
  b, t, h = q.shape[:3]
  out, lse = to_common_varying(jnp.zeros((b, t, h, v.shape[-1]), jnp.float32),
                               jnp.full((b, t, h), -jnp.inf, jnp.float32), q)[:2]

  def attend(step, held, out, lse):
    source = (device - step) % plan.cp
    block = _block_forward(plan, _block_kind(plan, step, device, source), q, held,
                           q_pos, plan.positions(source, plan.kv_local), q_ids)
    return _merge(out, lse, *block)

  def step(i, carry):
    held, out, lse = carry
    arriving = _rotate(held, plan)  # sent while this block is computed
    return (arriving, *attend(i, held, out, lse))

  held = _Held(k, v, segs[1] if segs else None)
  held, out, lse = jax.lax.fori_loop(0, plan.cp - 1, step, (held, out, lse))
  out, lse = attend(plan.cp - 1, held, out, lse)
  return out.astype(q.dtype), lse


def _ring_backward_body(q, k, v, out, lse, dout, *segs, plan: _Plan):
  device = jax.lax.axis_index(plan.axis)
  q_ids = segs[0] if segs else None
  q_pos = plan.positions(device, plan.q_local)
  dout = dout.astype(jnp.float32)
  delta = jnp.sum(dout * out.astype(jnp.float32), axis=-1)  # <dout, out> per query and head

  def grads(step, held, dq, dkv):
    source = (device - step) % plan.cp
    dq_b, dk_b, dv_b = _block_backward(plan, _block_kind(plan, step, device, source), q, held, q_pos,
                                       plan.positions(source, plan.kv_local), q_ids, lse, dout, delta)
    return dq + dq_b, (dkv[0] + dk_b, dkv[1] + dv_b)

  def step(i, carry):
    held, dq, dkv = carry
    arriving = _rotate(held, plan)
    dq, dkv = grads(i, held, dq, dkv)
    return arriving, dq, _rotate(dkv, plan)  # dK, dV travel with their block

  zeros = to_common_varying(*(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)), q)[:3]
  held = _Held(k, v, segs[1] if segs else None)
  held, dq, dkv = jax.lax.fori_loop(0, plan.cp - 1, step, (held, zeros[0], zeros[1:]))
  dq, dkv = grads(plan.cp - 1, held, dq, dkv)
  dk, dv = _rotate(dkv, plan)  # the last hop home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class _RingResiduals(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  segs: tuple
  out: jax.Array
  lse: jax.Array  # float32 (B, T, H), sequence-sharded as the output


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, segs, plan: _Plan, mesh):
  return _ring_fwd(q, k, v, segs, plan, mesh)[0]


def _ring_fwd(q, k, v, segs, plan: _Plan, mesh):
  out, lse = _sharded(_ring_forward_body, plan, mesh, (4, 4, 4) + (2,) * len(segs), (4, 3))(q, k, v, *segs)
  return out, _RingResiduals(q, k, v, segs, out, lse)


def _ring_bwd(plan: _Plan, mesh, res: _RingResiduals, dout):
  dq, dk, dv = _sharded(_ring_backward_body, plan, mesh, (4, 4, 4, 4, 3, 4) + (2,) * len(res.segs), (4, 4, 4))(
      res.q, res.k, res.v, res.out, res.lse, dout, *res.segs)
  return dq, dk, dv, tuple(None for _ in res.segs)


_ring.defvjp(_ring_fwd, _ring_bwd)
