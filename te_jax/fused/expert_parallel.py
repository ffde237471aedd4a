"""``expert_parallel_moe``: the experts of a mixture-of-experts layer sharded over a mesh axis (expert parallelism,
EP), the tokens sent to their experts' devices and back by all-to-alls, in FP8 on the way to the experts.

Called inside ``jax.shard_map`` over a mesh with the expert axis ``axis`` (P devices). Each device holds its own
tokens (T of them) with their routing (``te_jax.fused.moe_router.route``'s) and E / P of the E experts' kernels: the
experts ``p * E / P`` to ``(p + 1) * E / P - 1`` on device ``p``. One call, on every device:

1. **Permute** (``te_jax.fused.moe_permute.permute``): the device's token choices sorted by expert, each expert
   keeping at most ``C = expert_capacity(T, k, E, capacity_factor)`` of them, by token order; the rest are dropped
   (they add nothing to their token's output), exactly as ``permute`` drops them on this device's tokens alone. The
   (E * C, H) rows are then in the order of their experts' devices: the first E / P * C rows go to device 0, ...
2. **Dispatch**: under FP8 the rows are cast before they leave, as the expert GEMM casts its input (the recipe's
   ``"x"`` role, E4M3 under HYBRID): per-tensor recipes give each expert's rows that expert's scale (delayed
   scaling: the expert's state, its scale all-gathered from the device that holds it; current scaling: the scale of
   the expert's amax over every device's rows, one all-reduce of E floats), 1 x B recipes (``Float8BlockScaling``'s
   1 x 128, MXFP8's 1 x 32 with E8M0 scales) scale each row block, and those scale rows travel with the data, in
   their own all-to-all. NVFP4's tokens are not sent quantized (its global scale is the whole tensor's: it raises).
   One all-to-all over
   ``axis`` (``lax.all_to_all``) then hands each device the rows of its experts from every device: E / P groups of
   P * C rows (the C rows of device 0, then device 1's, ...). Without FP8 the rows travel in their dtype.
3. **The experts**: ``te_jax.fused.grouped_dense``'s forward GEMM on the received FP8 rows as they are (no second
   cast), the activation, and its second GEMM, with per-expert FP8 state as ``grouped_dense`` keeps it.
4. **Combine**: one all-to-all back, in the output's dtype, then ``unpermute`` with the combine weights.

The backward pass mirrors it (one ``custom_vjp``): the output gradient's rows go to the experts' devices in FP8 (the
recipe's ``"grad"`` role, E5M2 under HYBRID, scaled as in 2. with the second GEMM's gradient state), the two GEMMs'
backward passes run on them, and the input gradient comes back in its dtype. Which all-to-alls are FP8 is DeepSeek-V3's
choice (arXiv 2412.19437, section 3.3.2, "Low-Precision Communication"): the activations before the first expert GEMM
and the gradients before the second one's backward, the two that feed FP8 GEMMs; the combine and its backward stay in
high precision.

Why fixed capacities and ``lax.all_to_all``: every shape is static, and ``jax.lax.ragged_all_to_all`` (which would
send each device's actual counts) does not run on XLA:CPU (jax 0.11.2: "HLO opcode ragged-all-to-all is not
supported by XLA:CPU"). Each device sends E * C rows: ``capacity_factor`` times its k * T choices.

The result equals the single-device computation of the same layers, ``permute`` (with this capacity) of each
device's tokens on their own, ``grouped_dense`` of every expert over all of their rows, ``unpermute``: the same FP8
codes (each expert's scale is that of all its rows; delayed-scaling states update from the whole tensors' amaxes),
with two differences under 1 x B recipes: the weight gradients' token operands (the transposed copies of the received
tokens and output gradient) are cast along the tokens from the received FP8 rows' dequantized values (the
high-precision rows never reach the experts' device), and their blocks run along each device's rows of an expert
(``grouped_dense`` lays each device's groups out on whole blocks) rather than along all data shards' rows of it.

Other mesh axes: the tokens may be sharded over more axes (data parallelism: each expert's kernels replicated there,
their gradients summed over it); with ``tensor_axis`` each expert's hidden dim F is sharded over that axis (the first
kernel's columns, the second one's rows; the tokens replicated over it, the second GEMM's partial sums all-reduced
there before the combine). Current scaling's per-expert amaxes are reduced over every axis but ``axis``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax._core import scaling
from te_jax._core.manual_axes import max_over_shards, to_common_varying
from te_jax._core.quantized_tensor import QuantizedTensor, ScalingMode
from te_jax.fused.grouped_dense import (GroupedConfig, GroupedResiduals, QuantizedRows, check_grouped_meta,
                                        grouped_config, grouped_dense_bwd, grouped_dense_fwd)
from te_jax.fused.linear import as_arrays, fp8_recipe, instantiate, keeps_state, primal_values, state_as_float32
from te_jax.fused.moe_permute import permute, unpermute
from te_jax.fused.moe_router import Routing
from te_jax.fused.quantizer import DenseFp8Meta, quantizer_for
from te_jax.ops.activation import activation_bwd, activation_fwd, parse_activation_type
from te_jax.ops.gemm import FP8_ALIGN
from te_jax.ops.grouped_gemm import group_amax, quantize_by_group
from te_jax.recipe import Recipe

__all__ = ["ExpertParallelConfig", "expert_parallel_moe"]


@dataclasses.dataclass(frozen=True)
class ExpertParallelConfig:
  """The static parameters of one ``expert_parallel_moe`` call (it builds them from its arguments).

  Attributes:
    axis: the expert mesh axis.
    devices: P, its size.
    num_experts: E, over every device.
    capacity: C, the rows each device sends each expert.
    activation_type: ``(act,)`` or ``(act, "linear")``.
    tensor_axis: the mesh axis sharding each expert's hidden dim, or None.
    wi, wo: the two grouped GEMMs' configs (their FP8 configs None: high precision).
  """

  axis: str
  devices: int
  num_experts: int
  capacity: int
  activation_type: tuple[str, ...]
  tensor_axis: str | None
  wi: GroupedConfig
  wo: GroupedConfig

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.devices

  @property
  def gated(self) -> bool:
    return len(self.activation_type) == 2


# ---- the all-to-alls ---------------------------------------------------------------------------------------------


def _to_experts(cfg: ExpertParallelConfig, a: jax.Array) -> jax.Array:
  """Rows (E * C, ...) in the order of their experts, on each device, to their experts' devices: (E / P * P * C,
  ...), each local expert's rows from device 0, 1, ... in turn."""
  p, e, c = cfg.devices, cfg.local_experts, cfg.capacity
  blocks = a.reshape(p, e, c, *a.shape[1:])  # [destination device, its expert, row]
  got = jax.lax.all_to_all(blocks, cfg.axis, split_axis=0, concat_axis=1)  # [expert, source device, row]
  return got.reshape(e * p * c, *a.shape[1:])


def _from_experts(cfg: ExpertParallelConfig, a: jax.Array) -> jax.Array:
  """The inverse of ``_to_experts``: each expert's rows back to the devices they came from, in expert order."""
  p, e, c = cfg.devices, cfg.local_experts, cfg.capacity
  blocks = a.reshape(e, p, c, *a.shape[1:])
  back = jax.lax.all_to_all(blocks, cfg.axis, split_axis=1, concat_axis=0)  # [expert's device, expert, row]
  return back.reshape(p * e * c, *a.shape[1:])


def _local(cfg: ExpertParallelConfig, v: jax.Array) -> jax.Array:
  """This device's experts' entries of an (E, ...) array."""
  e = cfg.local_experts
  return jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index(cfg.axis) * e, e, axis=0)


def _send(cfg: ExpertParallelConfig, gemm: GroupedConfig, role: str, rows: jax.Array, state, dtype):
  """``rows`` (E * C, H) cast for the GEMM ``gemm`` (its ``role`` tensor, whose per-expert state on this device is
  ``state``), sent to the experts: the ``QuantizedRows`` that GEMM takes on the experts' device."""
  quantizer = gemm.fp8.quantizer
  if quantizer.mode_for(role) is ScalingMode.PER_TENSOR:
    sizes = jnp.full((cfg.num_experts,), cfg.capacity, jnp.int32)
    (amax,) = max_over_shards([group_amax(rows, sizes)], [None])  # each expert's, over every device's rows
    everyone = None
    if state is not None:  # the senders need every expert's scale: gathered, without the histories
      scale = jax.lax.all_gather(state.scale, cfg.axis, tiled=True)
      everyone = scaling.ScaleState(jnp.zeros((cfg.num_experts, 0), jnp.float32), scale)
    scale = jax.vmap(lambda s, a: quantizer.scale(s, a.reshape(1), dtype, frozenset()))(everyone, amax)
    q = quantize_by_group(rows, scale, sizes, dtype)
    got = dataclasses.replace(q, data=_to_experts(cfg, q.data), scale_inv=_local(cfg, q.scale_inv))
    return QuantizedRows(got, _local(cfg, amax))
  q = quantizer.quantize(role, None, rows, dtype).out
  return QuantizedRows(dataclasses.replace(q, data=_to_experts(cfg, q.data), scale_inv=_to_experts(cfg, q.scale_inv)),
                       None)


# ---- the layer ---------------------------------------------------------------------------------------------------


class _Residuals(NamedTuple):
  wi: GroupedResiduals
  wo: GroupedResiduals
  h: jax.Array  # the first GEMM's output: the activation's derivative needs it exactly


def _group_sizes(cfg: ExpertParallelConfig) -> jax.Array:
  return jnp.full((cfg.local_experts,), cfg.devices * cfg.capacity, jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe(cfg: ExpertParallelConfig, rows, wi, wo, wi_meta, wo_meta):
  return _forward(cfg, rows, wi, wo, wi_meta, wo_meta)[0]


def _moe_fwd(cfg: ExpertParallelConfig, *primals):
  return _forward(cfg, *primal_values(primals, trained=(1, 2), states=(3, 4)))


def _forward(cfg: ExpertParallelConfig, rows, wi, wo, wi_meta, wo_meta):
  sizes = _group_sizes(cfg)
  if cfg.wi.fp8 is None:
    x = _to_experts(cfg, rows)
  else:
    x = _send(cfg, cfg.wi, "x", rows, wi_meta and state_as_float32(wi_meta).x, cfg.wi.fp8.fwd_dtype)
  h, res_wi = grouped_dense_fwd(cfg.wi, x, wi, None, sizes, wi_meta)
  if cfg.gated:
    h = h.reshape(h.shape[0], 2, -1)
  a = activation_fwd(h, cfg.activation_type).out
  y, res_wo = grouped_dense_fwd(cfg.wo, a, wo, None, sizes, wo_meta)
  if cfg.tensor_axis is not None:  # the second GEMM's partial sums over the expert's hidden dim
    y = jax.lax.psum(y, cfg.tensor_axis)
  return _from_experts(cfg, y), _Residuals(res_wi, res_wo, h)


def _moe_bwd(cfg: ExpertParallelConfig, r: _Residuals, g):
  g = instantiate(g)
  if cfg.wo.fp8 is None:
    g = _to_experts(cfg, g)
  else:
    g = _send(cfg, cfg.wo, "grad", g, r.wo.meta and state_as_float32(r.wo.meta).grad, cfg.wo.fp8.bwd_dtype)
  da, dwo, _, wo_meta = grouped_dense_bwd(cfg.wo, r.wo, g)
  dh = activation_bwd(da.astype(r.h.dtype), r.h, cfg.activation_type).out
  dx, dwi, _, wi_meta = grouped_dense_bwd(cfg.wi, r.wi, dh.reshape(dh.shape[0], -1))
  return _from_experts(cfg, dx), dwi, dwo, wi_meta, wo_meta


_moe.defvjp(_moe_fwd, _moe_bwd, symbolic_zeros=True)


# ---- the API -----------------------------------------------------------------------------------------------------


def _axis_size(name: str, what: str, axis) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  if not isinstance(axis, str) or mesh.empty or axis not in mesh.manual_axes:
    manual = () if mesh.empty else tuple(mesh.manual_axes)
    raise ValueError(f"expert_parallel_moe: {name}={axis!r} must name {what}, a manual axis of the enclosing "
                     f"jax.shard_map (its manual axes here: {manual}); call it inside jax.shard_map over a mesh with "
                     "that axis")
  return int(mesh.shape[axis])


def _check_wire(recipe: Recipe) -> None:
  """Raises where the recipe's tokens cannot be sent quantized by rows."""
  quantizer = quantizer_for(recipe)
  for role in ("x", "grad"):
    mode = quantizer.mode_for(role)
    if mode is ScalingMode.NVFP4_1X16 or (mode.block is not None and mode.block[0] != 1):
      raise ValueError(f"expert_parallel_moe: {type(recipe).__name__} casts the tokens as {mode.name}, which "
                       "cannot be sent row by row (NVFP4's global scale is the whole tensor's); use DelayedScaling, "
                       "Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling")


def expert_parallel_moe(x: jax.Array, routing: Routing, wi: jax.Array, wo: jax.Array, *, axis: str,
                        capacity_factor: float, activation_type=("gelu",), tensor_axis: str | None = None,
                        wi_fp8_meta: DenseFp8Meta | None = None, wo_fp8_meta: DenseFp8Meta | None = None,
                        recipe: Recipe | None = None) -> jax.Array:
  """The routed experts' FFN, ``sum_j weights[t, j] * wo[e_j] . act(wi[e_j] . x[t])``, with the experts sharded over
  the mesh axis ``axis`` and the tokens sent to them and back by all-to-alls (see the module docstring). Call it
  inside ``jax.shard_map`` under ``jax.jit`` (jax 0.11.2 runs a ``custom_vjp`` with symbolic zeros, as this one and
  ``grouped_dense`` are, inside ``shard_map`` only when jitted): every argument is this device's.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> from te_jax.fused.moe_router import route
  >>> from te_jax.fused.expert_parallel import expert_parallel_moe
  >>> mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
  >>> def layer(x, logits, wi, wo):  # per device: 4 tokens, 2 of the 4 experts
  ...   return expert_parallel_moe(x, route(logits, 2), wi, wo, axis="expert", capacity_factor=2.0)
  >>> moe = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
  >>> x, logits = jnp.ones((8, 16)), jnp.zeros((8, 4))
  >>> moe(x, logits, jnp.ones((4, 16, 32)) / 16, jnp.ones((4, 32, 16)) / 32).shape
  (8, 16)

  Args:
    x: ``(..., H)``, this device's tokens in the compute dtype (the output has it too).
    routing: their ``route(...)``: ``experts`` ``(..., k)`` (ids in ``[0, E)``) and the combine ``weights``.
    wi: ``(E / P, H, F)`` (``(E / P, H, 2, F)`` for a gated activation, the activated half first): this device's
      experts' first kernels, experts ``p * E / P`` on; F is this device's shard of the hidden dim under
      ``tensor_axis``.
    wo: ``(E / P, F, H)``, their second kernels.
    axis: the expert mesh axis (P devices; E = P * wi.shape[0]).
    capacity_factor: each expert takes at most ``expert_capacity(T, k, E, capacity_factor)`` rows from each device
      (T the tokens here); the others are dropped. ``E / k`` keeps every choice of distinct experts (route's).
    activation_type: ``(act,)`` or ``(act, "linear")`` (``te_jax.ops.activation``'s).
    tensor_axis: a mesh axis sharding each expert's hidden dim F (the tokens replicated over it), or None.
    wi_fp8_meta, wo_fp8_meta: under ``DelayedScaling``, the local experts' states of the two GEMMs
      (``grouped_fp8_meta(E / P, L)`` each, sharded with the kernels); their gradients are their updates.
    recipe: overrides the autocast recipe.

  Returns:
    ``(..., H)`` in ``x``'s dtype.
  """
  x, wi, wo = as_arrays(x, wi, wo)
  if not isinstance(routing, Routing):
    raise TypeError(f"expert_parallel_moe: routing must be the Routing route returned, got {type(routing).__name__}")
  devices = _axis_size("axis", "the expert mesh axis", axis)
  if tensor_axis is not None:
    _axis_size("tensor_axis", "the mesh axis sharding the experts' hidden dim", tensor_axis)
    if tensor_axis == axis:
      raise ValueError(f"expert_parallel_moe: tensor_axis and axis must differ, got {axis!r} for both")
  act, gated = parse_activation_type(activation_type)
  activation_type = (act, "linear") if gated else (act,)
  if x.ndim < 2:
    raise ValueError(f"expert_parallel_moe: x must be (..., H) with at least one token dim, got shape {x.shape}")
  h = x.shape[-1]
  want_ndim = 4 if gated else 3
  if wi.ndim != want_ndim or wi.shape[1] != h or (gated and wi.shape[2] != 2):
    form = "(E / P, H, 2, F)" if gated else "(E / P, H, F)"
    raise ValueError(f"expert_parallel_moe: wi must be {form} with H = x's {h} for activation_type="
                     f"{activation_type}, got shape {wi.shape}")
  local, f = wi.shape[0], wi.shape[-1]
  if wo.shape != (local, f, h):
    raise ValueError(f"expert_parallel_moe: wo must be (E / P, F, H) = {(local, f, h)} to match wi {wi.shape} and x, "
                     f"got shape {wo.shape}")
  experts, weights = jnp.asarray(routing.experts), jnp.asarray(routing.weights)
  if experts.shape[:-1] != x.shape[:-1] or weights.shape != experts.shape:
    raise ValueError(f"expert_parallel_moe: routing.experts and routing.weights must be (..., k) over x's tokens "
                     f"{x.shape[:-1]}, got {experts.shape} and {weights.shape}")
  num_experts = local * devices
  recipe = fp8_recipe(recipe, wi_fp8_meta=wi_fp8_meta, wo_fp8_meta=wo_fp8_meta)
  if recipe is not None:
    if h % FP8_ALIGN or f % FP8_ALIGN:
      raise ValueError(f"expert_parallel_moe under FP8 needs H={h} and F={f} to be multiples of {FP8_ALIGN} (an FP8 "
                       "GEMM's dims); pad them or run without a recipe")
    _check_wire(recipe)
  if keeps_state(recipe):
    check_grouped_meta(wi_fp8_meta, local, "wi_fp8_meta")
    check_grouped_meta(wo_fp8_meta, local, "wo_fp8_meta")
  else:
    wi_fp8_meta = wo_fp8_meta = None
  if capacity_factor is None:
    raise ValueError("expert_parallel_moe: capacity_factor must be a float > 0 (the all-to-alls send a fixed number "
                     "of rows to each expert); E / k keeps every choice of k distinct experts")
  tokens = x.reshape(-1, h)
  rows, _, plan = permute(tokens, experts.reshape(tokens.shape[0], -1), num_experts, capacity_factor=capacity_factor)
  wi2 = wi.reshape(local, h, -1)
  group_axes = frozenset({axis})  # both GEMMs' inputs are in x's dtype
  cfg = ExpertParallelConfig(axis, devices, num_experts, plan.config.capacity, activation_type, tensor_axis,
                             grouped_config(rows, wi2, None, recipe, group_axes=group_axes),
                             grouped_config(rows, wo, None, recipe, group_axes=group_axes))
  rows, wi2, wo = to_common_varying(rows, wi2, wo)  # as jax's own ops would: each kernel's gradient summed where the
  # tokens are sharded and it is not (data parallelism), the tokens' over the tensor axis
  y = _moe(cfg, rows, wi2, wo, wi_fp8_meta, wo_fp8_meta)
  out = unpermute(y, plan, weights.reshape(tokens.shape[0], -1))
  return out.reshape(x.shape)
