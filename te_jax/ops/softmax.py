"""Scaled softmax over the last axis, plain, with a boolean mask, or causal: forward and backward primitives.

Per row of ``logits`` (every dim but the last is a row dim; the last, ``Sk``, is the softmax axis), in float32
whatever the input dtype (float32, bfloat16 or float16; the outputs have the input's dtype)::

  z_j  = -inf                 where j is masked out
       = scale * x_j          elsewhere
  m    = max_j z_j            (NaN if any z_j is NaN)
  e_j  = exp(z_j - m')        m' = 0 if m = -inf (a fully masked row), else m
  y_j  = e_j * r              r = 0 if m = -inf, else 1 / sum_j e_j

  dx_j = (scale * y_j) * (dy_j - sum_k dy_k * y_k)

Masks: ``"plain"`` masks nothing; ``"masked"`` masks where the boolean ``mask`` is True (Transformer Engine's
convention, **True means masked out**, kept here as in the kernels it mirrors; the attention API takes Flax's masks,
True = attend, and converts them), ``mask`` having logits' rank and each leading dim either 1 (broadcast) or
logits' size, its last dim equal to ``Sk`` (the handlers broadcast by index math; nothing is materialized);
``"causal"`` masks key ``j > i`` for query ``i`` (top-left aligned: row ``i`` of the ``(..., Sq, Sk)`` logits sees
keys ``0..i``; ``i`` counts from the scalar operand ``q_offset``, which is 0 except in a shard of a sharded query
dim).

Sharding: rows (batch, heads, queries) may be sharded, and the ops run shard-local with no collectives; the key
axis must be whole on each device, so a sharded one is all-gathered by XLA before the op (the sharding rule asks for
it replicated).

Edge cases, by the formulas above: a fully masked row (every key masked, or every logit -inf) gives an all-zero
output, not NaN and not a uniform row, and then an all-zero gradient; a NaN logit in an unmasked position, a +inf
logit, or an overflow of ``scale * x`` to +inf makes its whole row NaN, masked positions included (``r`` is NaN; as
``jax.nn.softmax``); in a row without one, a masked position is 0 whatever its logit (NaN included). The causal
backward reads and writes only keys ``j <= i``: ``dx`` is exactly 0 above the diagonal, where the forward output is 0
too. The masked backward needs no mask: ``y`` is 0 there.

Numerics: the handlers compute these formulas in float32 but in their own order (max and sum reductions, ``exp``
implementations, ``1 / s`` then a product). Following the tolerance rule (CONTRIBUTING.md), their largest error
against a float64 evaluation of the same formulas is at most twice the largest error of this module's jnp reference
at the same precision (same input and output dtypes), plus 4 float32 roundings of the largest output (forward) or of
the largest ``|scale * y| * (|dy| + sum|dy * y|)`` (backward); tests/test_softmax.py checks exactly that, and that
masked positions are exactly 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.dtypes import HP_DTYPES
from te_jax._core.primitive import NativeSignature, define_op, full_spec, mesh_axes, output_aval, sequential_batcher
from te_jax._core.explicit import typed_vjp

__all__ = ["SOFTMAX_KINDS", "SoftmaxConfig", "softmax_bwd", "softmax_bwd_ref", "softmax_fwd", "softmax_fwd_ref",
           "scaled_masked_softmax", "scaled_softmax", "scaled_upper_triang_masked_softmax"]

#: The mask kinds, in the order of their integer codes in the FFI handlers.
SOFTMAX_KINDS = ("plain", "masked", "causal")
#: Leading (row) dims a masked softmax takes, checked on every platform; tests/test_geometry.py checks that the
#: handlers' mask index math covers them (softmax_max_mask_groups() of both native modules).
MAX_MASK_ROW_DIMS = 8


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig:
  """Static parameters of one softmax call (forward or backward).

  Attributes:
    kind: one of ``SOFTMAX_KINDS``. The backward uses it only for ``"causal"`` (which skips the upper triangle).
    scale: the float32 factor multiplying the logits (the ``scale_factor`` of the public functions).
  """

  kind: str
  scale: float


# ---- reference ---------------------------------------------------------------------------------------------------


def _causal_masked(shape, q_offset) -> jax.Array:
  """True above the diagonal of the last two dims: key ``j`` > query ``q_offset + i``."""
  i = jax.lax.broadcasted_iota(jnp.int32, shape[-2:], 0) + q_offset
  j = jax.lax.broadcasted_iota(jnp.int32, shape[-2:], 1)
  return j > i


def softmax_fwd_ref(logits: jax.Array, q_offset: jax.Array, *mask: jax.Array, config: SoftmaxConfig) -> list[jax.Array]:
  """The pure-jnp forward: the CPU fallback, the test oracle and the documentation of the kernels.

  Args:
    logits: ``(..., Sk)``, rank >= 2, float32/bfloat16/float16.
    q_offset: int32 scalar, the query index of the first row of the ``Sq`` dim (causal only; 0 unless sharded).
    *mask: for ``"masked"``, the boolean mask (logits' rank, leading dims 1 or logits', last dim ``Sk``).
    config: the kind and scale.

  Returns:
    ``[y]``, logits' shape and dtype.
  """
  z = logits.astype(jnp.float32) * np.float32(config.scale)
  if config.kind == "masked":
    z = jnp.where(mask[0], -jnp.inf, z)
  elif config.kind == "causal":
    z = jnp.where(_causal_masked(z.shape, q_offset), -jnp.inf, z)
  m = jnp.max(z, axis=-1, keepdims=True)
  e = jnp.exp(z - jnp.where(m == -jnp.inf, jnp.float32(0), m))
  s = jnp.sum(e, axis=-1, keepdims=True)
  # The formula's max is NaN when any z_j is, and then the whole row is NaN. XLA:CPU's max reduction does not always
  # propagate a NaN (inside some fusions it returns the other operand), and a row whose other keys are all masked
  # would then pass for a fully masked one (m = -inf, r = 0). A NaN z_j makes s NaN whatever m is, so a row is empty
  # only where s is not NaN: otherwise r is NaN, and so is every y_j, as with the kernels' NaN-propagating max.
  empty = (m == -jnp.inf) & ~jnp.isnan(s)
  r = jnp.where(empty, jnp.float32(0), 1.0 / s)
  return [(e * r).astype(logits.dtype)]


def softmax_bwd_ref(dy: jax.Array, y: jax.Array, q_offset: jax.Array, *, config: SoftmaxConfig) -> list[jax.Array]:
  """The pure-jnp backward: ``dx = (scale * y) * (dy - sum(dy * y))``, float32 inside, ``y``'s dtype out."""
  yf, gf = y.astype(jnp.float32), dy.astype(jnp.float32)
  prod = gf * yf
  if config.kind == "causal":
    above = _causal_masked(y.shape, q_offset)
    prod = jnp.where(above, jnp.float32(0), prod)
  s = jnp.sum(prod, axis=-1, keepdims=True)
  dx = (np.float32(config.scale) * yf) * (gf - s)
  if config.kind == "causal":
    dx = jnp.where(above, jnp.float32(0), dx)
  return [dx.astype(y.dtype)]


# ---- primitives --------------------------------------------------------------------------------------------------


def _fwd_abstract_eval(logits, q_offset, *mask, config: SoftmaxConfig):
  del q_offset, mask, config
  return [output_aval(logits, logits.shape, logits.dtype)]


def _bwd_abstract_eval(dy, y, q_offset, *, config: SoftmaxConfig):
  del dy, q_offset, config
  return [output_aval(y, y.shape, y.dtype)]


def _fwd_signature(platform, config: SoftmaxConfig, avals_in, avals_out):
  """The forward handler always takes (logits, q_offset, mask): an empty bool mask unless ``"masked"``."""
  del platform, avals_in
  extra = () if config.kind == "masked" else (np.zeros((0,), np.bool_),)
  return NativeSignature(extra_operands=extra, result_avals=list(avals_out), keep=[0])


def _fwd_attributes(config: SoftmaxConfig) -> dict:
  return {"kind": np.int64(SOFTMAX_KINDS.index(config.kind)), "scale": np.float32(config.scale)}


def _bwd_attributes(config: SoftmaxConfig) -> dict:
  return {"causal": np.bool_(config.kind == "causal"), "scale": np.float32(config.scale)}


# ---- vmap --------------------------------------------------------------------------------------------------------


def _batched_rows(args, dims, q_offset_index: int):
  """A batch dim is more rows: every array argument with it moved to the front (broadcast where it is missing; a
  mask gets a size-1 leading dim instead). None when q_offset is batched (the public API never does that)."""
  if dims[q_offset_index] is not None:
    return None
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = []
  for i, (a, d) in enumerate(zip(args, dims)):
    if i == q_offset_index:
      moved.append(a)
    elif d is not None:
      moved.append(jnp.moveaxis(a, d, 0))
    elif i > q_offset_index:  # the mask: broadcast along the new dim by its size-1 entry, by index math
      moved.append(a[None])
    else:
      moved.append(jnp.broadcast_to(a, (size, *a.shape)))
  return moved


def _fwd_batcher(args, dims, *, config: SoftmaxConfig):
  moved = _batched_rows(args, dims, q_offset_index=1)
  if moved is None:
    return sequential_batcher(_SOFTMAX_FWD)(args, dims, config=config)
  return list(_SOFTMAX_FWD.bind(*moved, config=config)), [0]


def _bwd_batcher(args, dims, *, config: SoftmaxConfig):
  moved = _batched_rows(args, dims, q_offset_index=2)
  if moved is None:
    return sequential_batcher(_SOFTMAX_BWD)(args, dims, config=config)
  return list(_SOFTMAX_BWD.bind(*moved, config=config)), [0]


# ---- sharding ----------------------------------------------------------------------------------------------------


def _row_spec(sharding, ndim: int) -> tuple:
  """The logits' PartitionSpec with the softmax axis (the last) replicated: every shard holds whole rows."""
  spec = full_spec(sharding, ndim)
  return spec[:-1] + (None,)


def _shifted_q_offset(q_offset, spec, local_sq: int, config: SoftmaxConfig):
  """In a shard of a sharded query dim, the causal query index starts at the shard's first global row."""
  axes = mesh_axes(spec[-2])
  if config.kind != "causal" or not axes:
    return q_offset
  return q_offset + jax.lax.axis_index(axes) * np.int32(local_sq)


def _fwd_partition(config: SoftmaxConfig, mesh, arg_shapes, result_shape):
  """Shard-local: rows (batch, heads, queries) stay sharded, the key axis is replicated; no collectives."""
  del result_shape
  logits = arg_shapes[0]
  ndim = len(logits.shape)
  spec = _row_spec(logits.sharding, ndim)
  arg_shardings = [NamedSharding(mesh, P(*spec)), NamedSharding(mesh, P())]
  if config.kind == "masked":
    mask_shape = arg_shapes[2].shape
    mask_spec = tuple(None if m != n else s for m, n, s in zip(mask_shape, logits.shape, spec))
    arg_shardings.append(NamedSharding(mesh, P(*mask_spec)))

  def lower_fn(logits, q_offset, *mask):
    q_offset = _shifted_q_offset(q_offset, spec, logits.shape[-2], config)
    return tuple(_SOFTMAX_FWD.inner.bind(logits, q_offset, *mask, config=config))

  return mesh, lower_fn, (NamedSharding(mesh, P(*spec)),), tuple(arg_shardings)


def _bwd_partition(config: SoftmaxConfig, mesh, arg_shapes, result_shape):
  """y's rows decide; dy follows; the key axis is replicated; no collectives."""
  del result_shape
  spec = _row_spec(arg_shapes[1].sharding, len(arg_shapes[1].shape))
  row = NamedSharding(mesh, P(*spec))

  def lower_fn(dy, y, q_offset):
    q_offset = _shifted_q_offset(q_offset, spec, y.shape[-2], config)
    return tuple(_SOFTMAX_BWD.inner.bind(dy, y, q_offset, config=config))

  return mesh, lower_fn, (row,), (row, row, NamedSharding(mesh, P()))


def _dims(ndim: int) -> list[str]:
  return [f"d{i}" for i in range(ndim - 1)] + ["k"]


def _fwd_sharding_rule(config: SoftmaxConfig, mesh, value_types, result_types):
  del mesh, result_types
  logits_shape = value_types[0].shape
  dims = _dims(len(logits_shape))
  operands = [" ".join(dims), ""]
  if config.kind == "masked":
    # A broadcast (size-1) mask dim is its own factor; the others are the logits' dims.
    mask_dims = [d if m == n else f"b{i}" for i, (d, m, n) in enumerate(zip(dims, value_types[2].shape, logits_shape))]
    operands.append(" ".join(mask_dims))
  rule = f"{', '.join(operands)} -> {' '.join(dims)}"
  return rule, dict(need_replication_factors=("k",))


def _bwd_sharding_rule(config: SoftmaxConfig, mesh, value_types, result_types):
  del config, mesh, result_types
  dims = " ".join(_dims(len(value_types[1].shape)))
  return f"{dims}, {dims}, -> {dims}", dict(need_replication_factors=("k",))


_SOFTMAX_FWD = define_op(
    "softmax_fwd",
    abstract_eval=_fwd_abstract_eval,
    reference=softmax_fwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_fwd_attributes,
    native_signature=_fwd_signature,
    partition=_fwd_partition,
    sharding_rule=_fwd_sharding_rule,
    batcher=_fwd_batcher,
)

_SOFTMAX_BWD = define_op(
    "softmax_bwd",
    abstract_eval=_bwd_abstract_eval,
    reference=softmax_bwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_bwd_attributes,
    partition=_bwd_partition,
    sharding_rule=_bwd_sharding_rule,
    batcher=_bwd_batcher,
)


# ---- argument checks and the op functions ------------------------------------------------------------------------


def check_scale_factor(scale_factor) -> float:
  """``scale_factor`` as a float: a static, finite Python number (int or float, not bool, not an array)."""
  if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float, np.floating, np.integer)):
    raise TypeError(f"scale_factor must be a static Python float, got {type(scale_factor).__name__}")
  value = float(scale_factor)
  if not math.isfinite(value):
    raise ValueError(f"scale_factor must be finite, got {value}")
  return value


def check_logits(logits, name: str = "logits") -> jax.Array:
  if not hasattr(logits, "dtype") or not hasattr(logits, "shape"):
    logits = jnp.asarray(logits)
  if jnp.dtype(logits.dtype) not in HP_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(logits.dtype).name}")
  if logits.ndim < 2:
    raise ValueError(f"{name} must have rank >= 2 (..., Sq, Sk), got shape {logits.shape}")
  return logits


def check_mask(mask, logits_shape: tuple[int, ...]) -> jax.Array:
  """``mask`` with leading size-1 dims added up to the logits' rank; raises unless it is a boolean array whose dims
  are each 1 or the logits' (right-aligned), its last one the logits' last one."""
  if not hasattr(mask, "dtype") or not hasattr(mask, "shape"):
    mask = jnp.asarray(mask)
  if jnp.dtype(mask.dtype) != jnp.dtype(jnp.bool_):
    raise TypeError(f"mask must be a bool array (True = masked out), got {jnp.dtype(mask.dtype).name}")
  ndim = len(logits_shape)
  ok = 1 <= mask.ndim <= ndim and mask.shape[-1] == logits_shape[-1] and all(
      m in (1, n) for m, n in zip(mask.shape[:-1][::-1], logits_shape[:-1][::-1]))
  if not ok:
    raise ValueError(f"mask of shape {mask.shape} is not broadcastable to logits of shape {tuple(logits_shape)} along "
                     f"the leading dims (each dim 1 or the logits', the last one equal)")
  if ndim - 1 > MAX_MASK_ROW_DIMS:
    raise ValueError(f"a masked softmax takes logits of rank <= {MAX_MASK_ROW_DIMS + 1}, got shape {logits_shape}")
  return mask.reshape((1,) * (ndim - mask.ndim) + mask.shape)


def softmax_fwd(logits: jax.Array, mask: jax.Array | None = None, *, kind: str, scale_factor: float = 1.0
                ) -> jax.Array:
  """The forward primitive: ``y = softmax(scale_factor * logits)`` over the last axis with ``kind``'s mask.

  Args:
    logits: ``(..., Sq, Sk)``, float32/bfloat16/float16.
    mask: for ``kind="masked"`` only: bool, True = masked out, broadcastable to ``logits`` along the leading dims.
    kind: one of ``SOFTMAX_KINDS``.
    scale_factor: static float.

  Returns:
    ``y``, logits' shape and dtype.
  """
  if kind not in SOFTMAX_KINDS:
    raise ValueError(f"kind must be one of {SOFTMAX_KINDS}, got {kind!r}")
  logits = check_logits(logits)
  config = SoftmaxConfig(kind=kind, scale=check_scale_factor(scale_factor))
  masks = ()
  if kind == "masked":
    if mask is None:
      raise ValueError("mask is required for kind='masked'")
    masks = (check_mask(mask, logits.shape),)
  elif mask is not None:
    raise ValueError(f"mask is only taken by kind='masked', got kind={kind!r}")
  return _SOFTMAX_FWD.bind(logits, jnp.int32(0), *masks, config=config)[0]


def softmax_bwd(dy: jax.Array, y: jax.Array, *, kind: str, scale_factor: float = 1.0) -> jax.Array:
  """The backward primitive: ``dx = (scale_factor * y) * (dy - sum(dy * y))`` per row, in ``y``'s dtype.

  Args:
    dy: the gradient of ``y``, ``y``'s shape and dtype.
    y: the forward output.
    kind: the forward's kind (``"causal"`` skips the upper triangle).
    scale_factor: the forward's static float.
  """
  if kind not in SOFTMAX_KINDS:
    raise ValueError(f"kind must be one of {SOFTMAX_KINDS}, got {kind!r}")
  y = check_logits(y, "y")
  dy = check_logits(dy, "dy")
  if dy.shape != y.shape or dy.dtype != y.dtype:
    raise ValueError(f"dy must have y's shape {y.shape} and dtype {jnp.dtype(y.dtype).name}, got {dy.shape} "
                     f"{jnp.dtype(dy.dtype).name}")
  config = SoftmaxConfig(kind=kind, scale=check_scale_factor(scale_factor))
  return _SOFTMAX_BWD.bind(dy, y, jnp.int32(0), config=config)[0]


# ---- differentiable softmax: softmax_fwd and softmax_bwd as custom_vjps ------------------------------------------


# ---- plain and causal: logits only -------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _softmax(logits, kind, scale_factor):
  return softmax_fwd(logits, kind=kind, scale_factor=scale_factor)


def _softmax_fwd(logits, kind, scale_factor):
  y = softmax_fwd(logits, kind=kind, scale_factor=scale_factor)
  return y, y


def _softmax_bwd(kind, scale_factor, y, dy):
  return (softmax_bwd(dy.astype(y.dtype), y, kind=kind, scale_factor=scale_factor),)


_softmax.defvjp(*typed_vjp(_softmax_fwd, _softmax_bwd, nondiff_argnums=(1, 2)))


# ---- masked: the mask is not differentiable ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _masked_softmax(logits, mask, scale_factor):
  return softmax_fwd(logits, mask, kind="masked", scale_factor=scale_factor)


def _masked_softmax_fwd(logits, mask, scale_factor):
  y = softmax_fwd(logits, mask, kind="masked", scale_factor=scale_factor)
  return y, y


def _masked_softmax_bwd(scale_factor, y, dy):
  # y is 0 wherever the mask is True, so the backward needs no mask; the bool mask gets no gradient (None).
  return softmax_bwd(dy.astype(y.dtype), y, kind="masked", scale_factor=scale_factor), None


_masked_softmax.defvjp(*typed_vjp(_masked_softmax_fwd, _masked_softmax_bwd, nondiff_argnums=(2,)))


# ---- public API --------------------------------------------------------------------------------------------------


def scaled_softmax(logits: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """``softmax(scale_factor * logits)`` over the last axis.

  >>> import jax.numpy as jnp, te_jax
  >>> y = te_jax.scaled_softmax(jnp.array([[0.0, 0.0], [1.0, -jnp.inf]]), scale_factor=2.0)
  >>> y.tolist()
  [[0.5, 0.5], [1.0, 0.0]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16.
    scale_factor: a static Python float multiplying the logits (float32 math).

  Returns:
    The softmax, logits' shape and dtype. A row of all -inf logits gives zeros.
  """
  logits = check_logits(logits)
  return _softmax(logits, "plain", check_scale_factor(scale_factor))


def scaled_masked_softmax(logits: jax.Array, mask: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """``softmax(scale_factor * logits)`` over the last axis, with the keys where ``mask`` is True masked out.

  >>> import jax.numpy as jnp, te_jax
  >>> logits = jnp.zeros((1, 1, 2, 3))
  >>> mask = jnp.array([[[[False, True, False], [True, True, True]]]])  # True = masked out
  >>> te_jax.scaled_masked_softmax(logits, mask).tolist()
  [[[[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16, e.g. ``(B, H, Sq, Sk)``.
    mask: bool, **True means masked out** (Transformer Engine's convention, as its softmax kernels; the opposite
      of Flax's and of ``te_jax.dot_product_attention``'s default, where True = attend); broadcastable to
      ``logits`` along the leading dims, e.g. ``(B, 1, Sq, Sk)``, ``(B, H, Sq, Sk)`` or ``(B, 1, 1, Sk)``: each dim
      1 or the logits', the last one equal to ``Sk``. The broadcast is not materialized. It gets no gradient.
    scale_factor: a static Python float multiplying the logits.

  Returns:
    The softmax, logits' shape and dtype: 0 at masked positions; a row with every key masked is all 0 (not NaN,
    not uniform), and so is its gradient.
  """
  logits = check_logits(logits)
  check_mask(mask, logits.shape)
  return _masked_softmax(logits, mask, check_scale_factor(scale_factor))


def scaled_upper_triang_masked_softmax(logits: jax.Array, scale_factor: float = 1.0) -> jax.Array:
  """Causal ``softmax(scale_factor * logits)`` over the last axis: key ``j > i`` is masked out for query ``i``.

  Top-left aligned: row ``i`` of the ``(..., Sq, Sk)`` logits sees keys ``0..i`` (every row sees key 0, so no row
  is fully masked).

  >>> import jax.numpy as jnp, te_jax
  >>> te_jax.scaled_upper_triang_masked_softmax(jnp.zeros((2, 2))).tolist()
  [[1.0, 0.0], [0.5, 0.5]]

  Args:
    logits: ``(..., Sq, Sk)``, rank >= 2, float32, bfloat16 or float16.
    scale_factor: a static Python float multiplying the logits.

  Returns:
    The softmax, logits' shape and dtype, 0 above the diagonal (and so is the gradient).
  """
  logits = check_logits(logits)
  return _softmax(logits, "causal", check_scale_factor(scale_factor))
