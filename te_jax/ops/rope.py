"""Rotary position embedding (RoPE): the rotation of feature pairs by position-dependent angles, forward and backward.

``x`` is ``(B, S, H, D)`` ("BSHD") or ``(S, B, H, D)`` ("SBHD"), float32, bfloat16 or float16. The angles come in as
their float32 ``cos`` and ``sin`` tables, ``(S, R/2)``, or ``(B, S, R/2)`` when each sequence has its own positions
(packed sequences, KV-cache decoding). The first ``R <= D`` features of every head rotate, in ``R/2`` pairs; the
other ``D - R`` pass through unchanged (bit for bit). Pairs::

  rotate half (GPT-NeoX, Llama; interleaved=False):  (x1, x2) = (x[i], x[i + R/2]),  i < R/2
  interleaved (GPT-J; interleaved=True):             (x1, x2) = (x[2i], x[2i + 1]),  i < R/2

Math, in float32 whatever the input dtype, each operation rounded once in the order written, the result cast to
``x``'s dtype (``c = cos[.., s, i]``, ``s_ = sin[.., s, i]`` at the token's sequence position)::

  forward:   y1 = x1 * c - x2 * s_      y2 = x2 * c + x1 * s_
  backward:  dx1 = g1 * c + g2 * s_     dx2 = g2 * c - g1 * s_     (the transpose: the rotation by -angle)

The backward pass is the forward one with ``s_`` negated, exactly: ``a - b * (-s) == a + b * s`` bit for bit in IEEE
arithmetic (a subtraction is the addition of the negation, and ``b * (-s) == -(b * s)``), so the handlers run one
kernel for both, with a sign flip.

Bitwise agreement: the kernels only multiply and add; ``cos`` and ``sin`` are computed once by XLA (``jnp.cos``,
``jnp.sin``) from the angles and passed in as tables, so no transcendental function differs between the handlers
and the reference. The handlers are compiled without multiply-add contraction (``-fmad=false``, ``-ffp-contract=off``).
XLA's GPU backend does not contract either, so the reference compiled there is the same sequence of float32
operations. XLA's CPU backend does contract ``x1 * c - x2 * s_`` into a fused multiply-add (so a plain ``a * b - c * d``
there is not the once-rounded result), so on the CPU the reference
rounds its products through an ``optimization_barrier``: each product becomes a value of its own, which no
multiply-add can absorb. On both platforms the reference, the CPU handler and the CUDA handler then agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core.dtypes import HP_DTYPES
from te_jax._core.primitive import define_op, full_spec, output_aval
from te_jax._core.explicit import typed_vjp

__all__ = ["LAYOUTS", "RopeConfig", "check_rope_shapes", "rope_bwd", "rope_bwd_ref", "rope_fwd", "rope_fwd_ref",
           "apply_rope", "rope_frequencies"]

#: The layouts of ``x``: batch-major (B, S, H, D) and sequence-major (S, B, H, D).
LAYOUTS = ("BSHD", "SBHD")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Static parameters of one rotation (forward or backward).

  Attributes:
    layout: "BSHD" or "SBHD", the order of ``x``'s dims.
    interleaved: pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)`` (GPT-NeoX, Llama).
  """

  layout: str = "BSHD"
  interleaved: bool = False

  @property
  def seq_axis(self) -> int:
    return 1 if self.layout == "BSHD" else 0

  @property
  def batch_axis(self) -> int:
    return 0 if self.layout == "BSHD" else 1


# ---- reference ---------------------------------------------------------------------------------------------------


def _rounded_products(*products):
  """The products as values of their own on the CPU, where XLA would otherwise contract a product and the sum it
  feeds into a fused multiply-add (rounded once instead of twice); unchanged elsewhere (XLA:GPU does not contract)."""
  return jax.lax.platform_dependent(*products, cpu=lambda *p: jax.lax.optimization_barrier(p),
                                    default=lambda *p: p)


def _table(t: jax.Array, config: RopeConfig) -> jax.Array:
  """A ``(S, R/2)`` or ``(B, S, R/2)`` table broadcastable against the ``(.., .., H, R/2)`` halves of ``x``."""
  if t.ndim == 2:
    return t[:, None, None, :] if config.layout == "SBHD" else t[None, :, None, :]
  return jnp.swapaxes(t, 0, 1)[:, :, None, :] if config.layout == "SBHD" else t[:, :, None, :]


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, config: RopeConfig) -> jax.Array:
  """``y1 = x1 c - x2 s``, ``y2 = x2 c + x1 s`` on the first ``R = 2 cos.shape[-1]`` features; the rest as they are."""
  half = cos.shape[-1]
  rot = x[..., :2 * half].astype(jnp.float32)
  if config.interleaved:
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
  else:
    x1, x2 = rot[..., :half], rot[..., half:]
  c, s = _table(cos, config), _table(sin, config)
  x1c, x2s, x2c, x1s = _rounded_products(x1 * c, x2 * s, x2 * c, x1 * s)
  y1, y2 = x1c - x2s, x2c + x1s
  if config.interleaved:
    y = jnp.stack([y1, y2], axis=-1).reshape(rot.shape)
  else:
    y = jnp.concatenate([y1, y2], axis=-1)
  return jnp.concatenate([y.astype(x.dtype), x[..., 2 * half:]], axis=-1)


def rope_fwd_ref(x: jax.Array, cos: jax.Array, sin: jax.Array, *, config: RopeConfig) -> list[jax.Array]:
  """The pure-jnp forward rotation: the CPU fallback, the test oracle and the documentation of the kernels."""
  return [_rotate(x, cos, sin, config)]


def rope_bwd_ref(g: jax.Array, cos: jax.Array, sin: jax.Array, *, config: RopeConfig) -> list[jax.Array]:
  """The pure-jnp backward rotation (by the negated angle): ``dx1 = g1 c + g2 s``, ``dx2 = g2 c - g1 s``."""
  return [_rotate(g, cos, -sin, config)]


# ---- primitives --------------------------------------------------------------------------------------------------


def _abstract_eval(x, cos, sin, *, config: RopeConfig):
  del cos, sin, config
  return [output_aval(x, x.shape, x.dtype)]


def _attributes(config: RopeConfig) -> dict:
  return {"sbhd": np.bool_(config.layout == "SBHD"), "interleaved": np.bool_(config.interleaved)}


# ---- sharding ----------------------------------------------------------------------------------------------------


def _specs(config: RopeConfig, x_sharding, table_sharding, table_ndim: int) -> tuple[tuple, tuple]:
  """x keeps its batch, sequence and head sharding; D stays whole (it holds the pairs). The tables follow x.

  The sequence dim stays sharded when the tables are sharded the same way along it, or not at all (then each device
  slices its rows of the tiny tables locally, with no communication). Tables sharded along it in some other way
  make x whole along S (XLA gathers it): shard the tables like x, or leave them replicated, to avoid that.
  """
  x_spec = list(full_spec(x_sharding, 4))
  x_spec[3] = None
  table_seq = full_spec(table_sharding, table_ndim)[-2]
  seq = x_spec[config.seq_axis]
  if table_seq is not None and table_seq != seq:
    x_spec[config.seq_axis] = None
  table_spec = (x_spec[config.seq_axis], None)
  if table_ndim == 3:
    table_spec = (x_spec[config.batch_axis],) + table_spec
  return tuple(x_spec), table_spec


def _partition_for(op_getter):
  def partition(config: RopeConfig, mesh, arg_shapes, result_shape):
    del result_shape
    table_ndim = len(arg_shapes[1].shape)
    x_spec, table_spec = _specs(config, arg_shapes[0].sharding, arg_shapes[1].sharding, table_ndim)
    table = NamedSharding(mesh, P(*table_spec))

    def lower_fn(x, cos, sin):
      return tuple(op_getter().inner.bind(x, cos, sin, config=config))

    x_sharding = NamedSharding(mesh, P(*x_spec))
    return mesh, lower_fn, (x_sharding,), (x_sharding, table, table)

  return partition


def _sharding_rule(config: RopeConfig, mesh, value_types, result_types):
  del mesh, result_types
  x = "b s h d" if config.layout == "BSHD" else "s b h d"
  table = "b s r" if len(value_types[1].shape) == 3 else "s r"
  return f"{x}, {table}, {table} -> {x}", dict(need_replication_factors=("d", "r"))


# ---- vmap --------------------------------------------------------------------------------------------------------


def _batcher_for(op_getter):
  """Folds the vmapped dim into x's batch dim: one call over ``(V*B, ...)`` rows. Tables that are vmapped (per-example
  angles) or already batched become ``(V*B, S, R/2)``; broadcasting them costs little (per token, the two float32
  tables hold ``4 R`` bytes against x's ``2 H D`` in bfloat16)."""

  def rule(args, dims, *, config: RopeConfig):
    x, cos, sin = args
    x_dim, cos_dim, sin_dim = dims
    v = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    b_ax = config.batch_axis
    x = jnp.broadcast_to(x, (v, *x.shape)) if x_dim is None else jnp.moveaxis(x, x_dim, 0)
    x = jnp.moveaxis(x, 0, b_ax)  # (V, B, ...) or (S, V, B, ...)
    batch = x.shape[b_ax + 1]
    x = x.reshape(x.shape[:b_ax] + (v * batch,) + x.shape[b_ax + 2:])
    tables = []
    per_example = cos_dim is not None or sin_dim is not None or cos.ndim == 3
    for t, d in ((cos, cos_dim), (sin, sin_dim)):
      if not per_example:
        tables.append(t)
        continue
      t = jnp.broadcast_to(t, (v, *t.shape)) if d is None else jnp.moveaxis(t, d, 0)  # (V, [B,] S, R/2)
      if t.ndim == 3:
        t = t[:, None]
      t = jnp.broadcast_to(t, (v, batch, *t.shape[2:]))
      tables.append(t.reshape((v * batch, *t.shape[2:])))
    (y,) = op_getter().bind(x, *tables, config=config)
    y = y.reshape(y.shape[:b_ax] + (v, batch) + y.shape[b_ax + 1:])
    return [y], [b_ax]

  return rule


_ROPE_FWD = define_op(
    "rope_fwd",
    abstract_eval=_abstract_eval,
    reference=rope_fwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    partition=_partition_for(lambda: _ROPE_FWD),
    sharding_rule=_sharding_rule,
    batcher=_batcher_for(lambda: _ROPE_FWD),
)

_ROPE_BWD = define_op(
    "rope_bwd",
    abstract_eval=_abstract_eval,
    reference=rope_bwd_ref,
    native_platforms=("cpu", "cuda"),
    ffi_attributes=_attributes,
    partition=_partition_for(lambda: _ROPE_BWD),
    sharding_rule=_sharding_rule,
    batcher=_batcher_for(lambda: _ROPE_BWD),
)


# ---- public API --------------------------------------------------------------------------------------------------


def check_rope_shapes(x, table_shape: tuple[int, ...], layout: str, name: str = "x") -> None:
  """Checks ``x`` (dtype, rank) against ``layout``, and the angle table shape ``(S, R/2)`` or ``(B, S, R/2)``.

  Raises:
    TypeError: naming ``x`` when it is not float32, bfloat16 or float16.
    ValueError: naming ``layout``, ``x`` or ``freqs`` for a wrong layout string, rank or table shape.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be 'BSHD' or 'SBHD', got {layout!r}")
  dtype = getattr(x, "dtype", None)
  if dtype is None or jnp.dtype(dtype) not in HP_DTYPES:
    got = type(x).__name__ if dtype is None else jnp.dtype(dtype).name
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {got}")
  if len(x.shape) != 4:
    raise ValueError(f"{name} must be ({', '.join(layout)}) for layout {layout!r}, got shape {tuple(x.shape)}")
  config = RopeConfig(layout=layout)
  seq, batch, dim = x.shape[config.seq_axis], x.shape[config.batch_axis], x.shape[3]
  want = f"({seq}, R/2) or ({batch}, {seq}, R/2) with 2 <= R <= {dim}"
  ok = len(table_shape) in (2, 3) and table_shape[-2] == seq and 1 <= table_shape[-1] and 2 * table_shape[-1] <= dim
  if ok and len(table_shape) == 3:
    ok = table_shape[0] == batch
  if not ok:
    raise ValueError(f"freqs must be {want} for {name} of shape {tuple(x.shape)} in layout {layout!r}, "
                     f"got shape {tuple(table_shape)}")


def _check_tables(x, cos, sin, layout: str, name: str) -> None:
  for t, t_name in ((cos, "cos"), (sin, "sin")):
    if getattr(t, "dtype", None) is None or jnp.dtype(t.dtype) != jnp.float32:
      raise TypeError(f"{t_name} must be a float32 table, got {getattr(t, 'dtype', type(t).__name__)}")
  if cos.shape != sin.shape:
    raise ValueError(f"cos and sin must have the same shape, got {cos.shape} and {sin.shape}")
  check_rope_shapes(x, cos.shape, layout, name)


def rope_fwd(x: jax.Array, cos: jax.Array, sin: jax.Array, *, layout: str = "BSHD",
             interleaved: bool = False) -> jax.Array:
  """The forward rotation of ``x`` by the angles whose float32 ``cos`` and ``sin`` tables are given.

  Args:
    x: ``(B, S, H, D)`` ("BSHD") or ``(S, B, H, D)`` ("SBHD"); float32, bfloat16 or float16.
    cos, sin: float32 ``(S, R/2)`` or ``(B, S, R/2)``, ``R <= D``.
    layout: "BSHD" or "SBHD".
    interleaved: pairs ``(2i, 2i+1)`` instead of ``(i, i + R/2)``.

  Returns:
    ``x`` rotated, in ``x``'s dtype and shape.
  """
  _check_tables(x, cos, sin, layout, "x")
  config = RopeConfig(layout=layout, interleaved=bool(interleaved))
  return _ROPE_FWD.bind(x, cos, sin, config=config)[0]


def rope_bwd(g: jax.Array, cos: jax.Array, sin: jax.Array, *, layout: str = "BSHD",
             interleaved: bool = False) -> jax.Array:
  """The backward rotation (the transpose of ``rope_fwd``: the rotation by the negated angles) of ``g``.

  Args: as ``rope_fwd``, with ``g`` (the gradient of its output) in place of ``x``.

  Returns:
    ``dx`` in ``g``'s dtype and shape.
  """
  _check_tables(g, cos, sin, layout, "g")
  config = RopeConfig(layout=layout, interleaved=bool(interleaved))
  return _ROPE_BWD.bind(g, cos, sin, config=config)[0]


# ---- differentiable RoPE: rope_fwd and rope_bwd as one custom_vjp ------------------------------------------------


def rope_frequencies(positions_or_seq_len, rotary_dim: int, base: float = 10000.0) -> jax.Array:
  """The float32 rotation angles ``angle[.., p, i] = position[p] * base ** (-2 i / rotary_dim)``, ``i < rotary_dim/2``.

  >>> import te_jax
  >>> te_jax.rope_frequencies(3, 4, base=100.0).tolist()
  [[0.0, 0.0], [1.0, 0.10000000149011612], [2.0, 0.20000000298023224]]

  Args:
    positions_or_seq_len: an int ``S`` (positions 0..S-1), or an integer array of positions, ``(S,)`` or ``(B, S)``
      (packed sequences, or KV-cache decoding where positions do not start at 0).
    rotary_dim: ``R``, the number of features that rotate: even and positive.
    base: the wavelength base (10000 in RoFormer and Llama 2; Llama 3 uses 500000).

  Returns:
    float32 angles, ``(S, R/2)`` or ``(B, S, R/2)``: the ``freqs`` of ``apply_rope``. The inverse wavelengths
    ``base ** (-2 i / R)`` are computed in float64 on the host and rounded once to float32, so the angles are the
    same on every backend; each angle is one float32 product.

  Raises:
    ValueError: naming ``rotary_dim``, ``base`` or ``positions_or_seq_len`` for an odd or non-positive rotary dim,
      a non-positive base, a negative length or positions of rank other than 1 or 2.
    TypeError: naming ``positions_or_seq_len`` for positions that are not integers.
  """
  if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)) or rotary_dim <= 0 \
      or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
  if not isinstance(base, (int, float, np.floating, np.integer)) or not base > 0:
    raise ValueError(f"base must be a positive number, got {base!r}")
  inv_freq = (float(base) ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)).astype(np.float32)
  if isinstance(positions_or_seq_len, (int, np.integer)) and not isinstance(positions_or_seq_len, bool):
    seq_len = operator.index(positions_or_seq_len)
    if seq_len < 0:
      raise ValueError(f"positions_or_seq_len must be a non-negative length or positions, got {seq_len}")
    positions = jnp.arange(seq_len, dtype=jnp.float32)
  else:
    dtype = getattr(positions_or_seq_len, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"positions_or_seq_len must be an int or an integer array of positions, got "
                      f"{type(positions_or_seq_len).__name__ if dtype is None else jnp.dtype(dtype).name}")
    if jnp.ndim(positions_or_seq_len) not in (1, 2):
      raise ValueError(f"positions_or_seq_len must be (S,) or (B, S) positions, got shape "
                       f"{jnp.shape(positions_or_seq_len)}")
    positions = jnp.asarray(positions_or_seq_len).astype(jnp.float32)
  return positions[..., None] * jnp.asarray(inv_freq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _apply_rope(x, cos, sin, layout, interleaved):
  return rope_fwd(x, cos, sin, layout=layout, interleaved=interleaved)


def _apply_rope_fwd(x, cos, sin, layout, interleaved):
  return rope_fwd(x, cos, sin, layout=layout, interleaved=interleaved), (cos, sin)


def _apply_rope_bwd(layout, interleaved, residuals, g):
  cos, sin = residuals
  # No gradient for the tables (hence for freqs): the angles are a function of the positions, not trained.
  return rope_bwd(g, cos, sin, layout=layout, interleaved=interleaved), None, None


_apply_rope.defvjp(*typed_vjp(_apply_rope_fwd, _apply_rope_bwd, nondiff_argnums=(3, 4)))


def apply_rope(x: jax.Array, freqs: jax.Array, *, layout: str = "BSHD", interleaved: bool = False) -> jax.Array:
  """Rotates the first ``R = 2 * freqs.shape[-1]`` features of every head of ``x`` by the angles ``freqs``.

  >>> import jax.numpy as jnp, te_jax
  >>> x = jnp.array([1.0, 0.0, 0.0, 2.0, 5.0]).reshape(1, 1, 1, 5)   # (B, S, H, D), R = 4: feature 4 passes
  >>> freqs = jnp.full((1, 2), jnp.pi / 2)                           # angle pi/2 for both pairs
  >>> te_jax.apply_rope(x, freqs).round(6).tolist()                  # pairs (0, 2), (1, 3)
  [[[[-0.0, -2.0, 1.0, -0.0, 5.0]]]]
  >>> te_jax.apply_rope(x, freqs, interleaved=True).round(6).tolist()  # pairs (0, 1), (2, 3)
  [[[[-0.0, 1.0, -2.0, -0.0, 5.0]]]]

  Args:
    x: queries or keys, ``(B, S, H, D)`` ("BSHD") or ``(S, B, H, D)`` ("SBHD"); float32, bfloat16 or float16.
    freqs: float32 angles (``rope_frequencies``), ``(S, R/2)``, or ``(B, S, R/2)`` for per-sequence positions;
      ``R <= D``: the features after the first ``R`` pass through unchanged.
    layout: "BSHD" or "SBHD".
    interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + R/2)`` ("rotate half": GPT-NeoX, Llama).

  Returns:
    ``x`` rotated, same shape and dtype; the rotation is computed in float32. Differentiable in ``x``; ``freqs``
    gets no gradient (a zero cotangent): angles are functions of the positions, trained by no model we know of.

  Raises:
    TypeError: naming ``x`` or ``freqs`` for a dtype other than those above.
    ValueError: naming ``layout``, ``x`` or ``freqs`` for a wrong layout string, rank, or table shape (including
      ``R > D``).
  """
  check_rope_shapes(x, tuple(getattr(freqs, "shape", ())), layout)
  if getattr(freqs, "dtype", None) is None or jnp.dtype(freqs.dtype) != jnp.float32:
    raise TypeError(f"freqs must be float32 angles (see rope_frequencies), got "
                    f"{getattr(freqs, 'dtype', type(freqs).__name__)}")
  freqs = jax.lax.stop_gradient(freqs)
  return _apply_rope(x, jnp.cos(freqs), jnp.sin(freqs), layout, bool(interleaved))
