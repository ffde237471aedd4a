"""``scale_update``: the delayed-scaling step of several tensors (amax histories rolled, next scales computed) as one
op.

``te_jax._core.scaling`` defines the math; this is its batched form as a primitive. The CUDA handler updates every
tensor in
one launch and writes each result into its own buffer; the reference (and the lowering wherever the handler is
missing) stacks the tensors, computes, and unstacks: on a GPU that is a concatenation, a reduction, a select and one
slice copy per history, each a kernel launch. The handler computes the documented rule in IEEE float32, as the
reference does on the CPU, bit for bit. XLA:GPU's own float32 division is not correctly rounded (some quotients
``448 / a`` differ from IEEE's by one ulp), so where the reference runs on a GPU its scales may be one ulp off the
handler's; the histories are the same bits.

The state is tiny and the same on every device: under a mesh, every operand and result is replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import scaling
from te_jax._core.primitive import define_op, output_aval

__all__ = ["ScaleUpdateConfig", "scale_update", "scale_update_ref", "update_scale_state", "update_scale_states"]


@dataclasses.dataclass(frozen=True)
class ScaleUpdateConfig:
  """Static parameters of one update.

  Attributes:
    fp8_max: the largest finite value of each tensor's FP8 dtype (one per tensor).
    margin: the scale is ``fp8_max / (amax * 2**margin)`` (any float >= 0), computed as ``fp8_max / amax *
      2**-margin`` with ``2**-margin`` rounded once to float32, by the handler as by the reference.
    most_recent: the scale comes from the newest amax instead of the history's max.
  """

  fp8_max: tuple[float, ...]
  margin: float = 0.0
  most_recent: bool = False

  @property
  def count(self) -> int:
    return len(self.fp8_max)


# ---- reference ---------------------------------------------------------------------------------------------------


def scale_update_ref(*args, config: ScaleUpdateConfig) -> list[jax.Array]:
  """``args``: the histories, then the scales, then the amaxes; returns the new histories, then the new scales."""
  n = config.count
  history = jnp.stack(args[:n])
  amax = jnp.stack([jnp.reshape(a, ()) for a in args[2 * n:]])
  history = jax.vmap(scaling.roll_amax_history)(history, amax)
  algo = "most_recent" if config.most_recent else "max"
  latest = jax.vmap(lambda h: scaling.amax_from_history(h, algo))(history)
  scales = scaling.compute_scale(latest, jnp.stack(args[n:2 * n]), jnp.asarray(config.fp8_max, jnp.float32),
                                 config.margin)
  return [history[i] for i in range(n)] + [scales[i] for i in range(n)]


# ---- primitive ---------------------------------------------------------------------------------------------------


def _abstract_eval(*avals, config: ScaleUpdateConfig):
  n = config.count
  like = avals[0]  # Op.bind has cast every operand to vary over the same manual axes
  return [output_aval(like, a.shape, jnp.float32) for a in avals[:n]] + [output_aval(like, (), jnp.float32)] * n


def _attributes(config: ScaleUpdateConfig) -> dict:
  return {"fp8_max": np.asarray(config.fp8_max, np.float32), "margin": np.float64(config.margin),
          "most_recent": np.bool_(config.most_recent)}


def _partition(config: ScaleUpdateConfig, mesh, arg_shapes, result_shape):
  del result_shape
  replicated = NamedSharding(mesh, P())

  def lower_fn(*args):
    return tuple(_SCALE_UPDATE.inner.bind(*args, config=config))

  return mesh, lower_fn, (replicated,) * (2 * config.count), (replicated,) * len(arg_shapes)


def _sharding_rule(config: ScaleUpdateConfig, mesh, value_types, result_types):
  del mesh, value_types, result_types
  n = config.count
  histories = [f"h{i}" for i in range(n)]
  rule = ", ".join(histories + [""] * (2 * n)) + " -> " + ", ".join(histories + [""] * n)
  return rule, dict(need_replication_factors=tuple(histories))


_SCALE_UPDATE = define_op(
    "scale_update",
    abstract_eval=_abstract_eval,
    reference=scale_update_ref,
    native_platforms=("cuda",),
    ffi_attributes=_attributes,
    partition=_partition,
    sharding_rule=_sharding_rule,
)


# ---- public API --------------------------------------------------------------------------------------------------


def scale_update(histories: Sequence[jax.Array], scales: Sequence[jax.Array], amaxes: Sequence[jax.Array],
                 fp8_max: Sequence[float], *, margin: float = 0.0,
                 most_recent: bool = False) -> tuple[list[jax.Array], list[jax.Array]]:
  """The next amax histories and scales of ``len(histories)`` tensors (see ``update_scale_states``).

  Args:
    histories: float32 ``(L,)`` amax histories, one length for all, element 0 the most recent.
    scales: float32 scalars, the scales used in the step just taken.
    amaxes: float32 scalars, that step's amaxes.
    fp8_max: each tensor's FP8 maximum.
    margin, most_recent: the recipe's margin and ``amax_compute_algo == "most_recent"``.

  Returns:
    ``(new_histories, new_scales)``.
  """
  n = len(histories)
  if not n or len(scales) != n or len(amaxes) != n or len(fp8_max) != n:
    raise ValueError(f"scale_update needs as many scales, amaxes and fp8_max as histories ({n}), got "
                     f"{len(scales)}, {len(amaxes)} and {len(fp8_max)}")
  shapes = {tuple(jnp.shape(h)) for h in histories}
  if len(shapes) != 1 or len(next(iter(shapes))) != 1 or next(iter(shapes))[0] < 1:
    raise ValueError(f"scale_update: the histories must be 1-D and of one length >= 1, got shapes {sorted(shapes)}")
  for what, values in (("scales", scales), ("amaxes", amaxes)):
    if any(jnp.size(v) != 1 for v in values):
      raise ValueError(f"scale_update: {what} must be scalars, got shapes {[jnp.shape(v) for v in values]}")
  args = ([jnp.asarray(h, jnp.float32) for h in histories] + [jnp.reshape(jnp.asarray(s, jnp.float32), ())
                                                             for s in scales]
          + [jnp.reshape(jnp.asarray(a, jnp.float32), ()) for a in amaxes])
  config = ScaleUpdateConfig(tuple(float(m) for m in fp8_max), float(margin), bool(most_recent))
  out = _SCALE_UPDATE.bind(*args, config=config)
  return list(out[:n]), list(out[n:])


def update_scale_state(
    state: scaling.ScaleState,
    amax: jax.Array,
    fp8_dtype,
    *,
    margin: float = 0.0,
    algo: scaling.AmaxComputeAlgo = "max",
) -> scaling.ScaleState:
  """One delayed-scaling step: roll ``amax`` into the history, then derive the next scale from it."""
  return update_scale_states([state], [amax], [fp8_dtype], margin=margin, algo=algo)[0]


def update_scale_states(
    states: Sequence[scaling.ScaleState],
    amaxes: Sequence[jax.Array],
    fp8_dtypes: Sequence,
    *,
    margin: float = 0.0,
    algo: scaling.AmaxComputeAlgo = "max",
) -> list[scaling.ScaleState]:
  """``update_scale_state`` of several tensors (histories of one length) as one op: the same values, from one
  kernel launch on a GPU with the CUDA module instead of a few launches per tensor."""
  if algo not in ("max", "most_recent"):
    raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")
  histories, scales = scale_update([s.amax_history for s in states], [s.scale for s in states], amaxes,
                                   [scaling.fp8_max(d) for d in fp8_dtypes], margin=margin,
                                   most_recent=algo == "most_recent")
  return [scaling.ScaleState(h, s) for h, s in zip(histories, scales)]
