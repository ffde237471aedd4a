"""The FP8 GEMM pieces every fused layer shares: the recipe and its state, scales, the norm that writes a GEMM's
FP8 input, the forward GEMM with its residuals, and the dgrad/wgrad GEMMs of the backward pass.

A layer's forward produces its FP8 input (and the transposed copy the weight gradient needs) in whatever kernel
comes before the GEMM (a quantize, a norm, an activation), then calls ``linear_fwd``; its backward produces the FP8
output gradient (and its transposed copy) the same way, then calls ``linear_bwd``. Only FP8 tensors are kept for the
backward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from te_jax._core import scaling
from te_jax._core.autocast import get_autocast_state, resolve_recipe
from te_jax._core.explicit import explicit_mesh, explicit_sharding, reshape, retype, typed_vjp
from te_jax._core.manual_axes import varying_axes
from te_jax._core.primitive import full_spec, mesh_axes
from te_jax._core.quantized_tensor import QuantizedTensor
from te_jax.fused.quantizer import Quantizer, quantizer_for
from te_jax.ops.gemm import FP8_ALIGN, gemm
from te_jax.ops.norm import check_norm_args, layernorm, norm_bwd, norm_fwd
from te_jax.ops.quantize import CastOutput, group_parts
from te_jax.ops.quantize_interleaved import MAX_PARTS as _MAX_PARTS
from te_jax.recipe import Recipe

__all__ = [
    "Fp8Config", "LinearResiduals", "NormFp8", "NormSpec", "Unstack", "as_arrays", "check_checkpoint_name",
    "check_residual",
    "fp8_dims_aligned", "fp8_recipe", "input_for", "instantiate", "keep_state", "keeps_state", "layer_output",
    "linear_bwd", "linear_fwd", "norm_to_fp8", "out_spec_of", "pad_rows", "primal_values", "quantize_grad",
    "residual_rows", "state_as_float32", "state_like",
]


def out_spec_of(out_sharding, ndim: int) -> P | None:
  """A layer's ``out_sharding`` argument (None, a ``PartitionSpec`` or a ``NamedSharding``) as the PartitionSpec of
  its ``ndim``-dim output, checked."""
  if out_sharding is None:
    return None
  if not isinstance(out_sharding, (P, NamedSharding)):
    raise TypeError(f"out_sharding must be a jax.sharding.PartitionSpec or NamedSharding, got "
                    f"{type(out_sharding).__name__}")
  spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
  if len(spec) > ndim:
    raise ValueError(f"out_sharding {spec} has more entries than the output has dims ({ndim})")
  return P(*spec, *(None,) * (ndim - len(spec)))


def input_for(x: jax.Array, axes: tuple[int, ...], spec: P | None) -> jax.Array:
  """``x`` as a layer whose output is wanted sharded ``spec`` (its rows, then its features) reads it, on a mesh with
  Explicit axes: x's non-contracted dims resharded to the output's row entries less the mesh axes x's contracted dims
  use, its contracted dims as they are. That is the partitioner's choice on an Auto mesh (under sequence parallelism
  the sequence gathered before a column-parallel GEMM, in x's dtype); elsewhere ``x`` itself."""
  if spec is None or explicit_mesh(x) is None:
    return x
  xs = full_spec(jax.typeof(x).sharding, x.ndim)
  k_axes = mesh_axes(*(xs[a] for a in axes))
  rows = [d for d in range(x.ndim) if d not in axes]
  new = list(xs)
  for entry, d in zip(spec, rows):
    kept = tuple(a for a in mesh_axes(entry) if a not in k_axes)
    new[d] = None if not kept else (kept[0] if len(kept) == 1 else kept)
  return retype(x, P(*new))


def check_checkpoint_name(name, arg: str) -> str | None:
  """``name``, a ``jax.ad_checkpoint.checkpoint_name`` the caller's argument ``arg`` gives (None: the op's default),
  checked to be a non-empty str."""
  if name is not None and not (isinstance(name, str) and name):
    raise TypeError(f"{arg} must be a non-empty str (a jax.ad_checkpoint.checkpoint_name, for "
                    f"jax.checkpoint_policies.save_only_these_names) or None, got {name!r}")
  return name


def fp8_recipe(recipe: Recipe | None, **states) -> Recipe | None:
  """The recipe an FP8 op runs with (its own ``recipe``, else autocast's; None: high precision), checked to come with
  the state its quantizer keeps: ``states`` are the op's state arguments by name (``fp8_meta=...``)."""
  recipe = resolve_recipe(recipe)
  if recipe is not None:
    quantizer_for(recipe).check_state(states)
  return recipe


def keeps_state(recipe: Recipe | None) -> bool:
  """Whether an op under ``recipe`` (None: high precision) takes and updates a per-GEMM state."""
  return recipe is not None and quantizer_for(recipe).stateful


def as_arrays(x, *params):
  """A fused op's input ``x`` and parameters as jax arrays, ``x`` in the compute dtype jnp would use: NumPy arrays and
  Python scalars become jax arrays (float64 becomes float32 unless x64 is on), and a non-float ``x`` (integer
  tokens, booleans) is promoted with the parameters, as ``jnp.dot`` would, instead of the parameters being cast
  to its dtype."""
  x = jnp.asarray(x)
  params = [None if p is None else jnp.asarray(p) for p in params]
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    x = x.astype(jnp.result_type(x, *(p for p in params if p is not None)))
  return (x, *params)


@jax.custom_vjp
def keep_state(x, state):
  """``x``; the gradient of ``state`` (an FP8 state, or any pytree) is ``state`` itself: an update that keeps it.

  For a layer that holds a delayed-scaling state but runs a step without it (FP8 off, another recipe, a GEMM te_jax
  runs in high precision): tied to the layer's input, the state comes back as its own gradient, so that
  ``TrainState.apply_gradients`` writes it back unchanged instead of the zero gradient of an unused input."""
  return x


def _keep_state_fwd(x, state):
  return x, state


def _keep_state_bwd(state, g):
  return g, state


keep_state.defvjp(*typed_vjp(_keep_state_fwd, _keep_state_bwd))


def fp8_dims_aligned(k: int, n: int, unstack: "Unstack | None" = None) -> bool:
  """Whether the FP8 GEMMs of a (K, N) layer can take its dims (multiples of ``FP8_ALIGN``): K and N, and with
  ``unstack`` each part's width too, since the forward GEMM writes the parts as a batch of (M, N / parts) outputs."""
  dims = (k, n) if unstack is None or unstack.parts == 1 else (k, n, n // unstack.parts)
  return all(d % FP8_ALIGN == 0 for d in dims)


def pad_rows(x2d: jax.Array) -> tuple[jax.Array, int]:
  """Zero rows up to a multiple of ``FP8_ALIGN`` (the weight-gradient GEMM contracts over rows); zero rows change no
  amax, bias gradient or weight gradient. Returns the padded array and the number of rows added."""
  pad = -x2d.shape[0] % FP8_ALIGN
  return (jnp.pad(x2d, ((0, pad), (0, 0))) if pad else x2d), pad


def primal_values(primals, *, trained: tuple[int, ...], states: tuple[int, ...]) -> list:
  """The values of a fused op's differentiable arguments, as its forward rule receives them (``symbolic_zeros=True``
  wraps each leaf with whether it is differentiated), after checking that the step will keep the delayed-scaling state
  current: when a kernel (``primals[i]`` for ``i`` in ``trained``) is differentiated, its state (``states``) must be
  too, since the updated state leaves the backward pass as the state's gradient. A step that differentiates only the
  parameters would run with the scales of its first step forever, so it raises with the fix."""
  is_primal = lambda v: isinstance(v, CustomVJPPrimal)  # noqa: E731
  differentiated = lambda i: any(v.perturbed for v in jax.tree.leaves(primals[i], is_leaf=is_primal))  # noqa: E731
  has_state = any(jax.tree.leaves(primals[i], is_leaf=is_primal) for i in states)
  if has_state and any(differentiated(i) for i in trained) and not any(differentiated(i) for i in states):
    raise ValueError(
        "te_jax: this step differentiates an FP8 layer's kernel but not its delayed-scaling state (the "
        f"{scaling.FP8_COLLECTION!r} collection, te_jax.FP8_COLLECTION), so the state would never update: the new "
        "state leaves the backward pass as that collection's gradient. Differentiate the whole variables dict "
        "(jax.grad(loss)(variables), with TrainState(params=variables) whose apply_gradients writes the state), or "
        "for a custom optax loop split the gradients with te_jax.flax.split_fp8_state. The collection is not "
        "updated through mutable=[...]. With te_jax.nnx: differentiate with te_jax.nnx.value_and_grad (or "
        "te_jax.nnx.grad) instead of nnx.value_and_grad, which also differentiates the te_jax.nnx.Fp8State "
        "variables and writes their update into the model.")
  return [jax.tree.map(lambda v: v.value, p, is_leaf=is_primal) for p in primals]


def instantiate(cotangent):
  """A cotangent as an array: zeros where autodiff passed a symbolic zero (an output nothing used)."""
  if isinstance(cotangent, SymbolicZero):
    return jnp.zeros(cotangent.shape, cotangent.dtype)
  return cotangent


def state_as_float32(tree):
  """The FP8 state with float32 leaves. Modules hand it over in Flax's max-combining ``fp32_max_grad`` dtype (so
  that several applications of one module combine their updates by max); the math runs in float32.

  A scale that is not positive reads as 1.0, a fresh state's. Updates never make one, but a module that a train step
  left unused gets a zero gradient for its state, which ``TrainState.apply_gradients`` writes over it: with a scale
  of 0 the next step would quantize everything to 0 and dequantize with inf (NaN outputs). The zeroed history is
  a fresh state's too, so such a module starts over."""

  def f32(v):
    return v if v.dtype == jnp.float32 else jax.lax.convert_element_type(v, jnp.float32)

  def read(node):
    if not isinstance(node, scaling.ScaleState):
      return f32(node)
    scale = f32(node.scale)
    return scaling.ScaleState(f32(node.amax_history), jnp.where(scale > 0, scale, jnp.float32(1.0)))

  return jax.tree.map(read, tree, is_leaf=lambda n: isinstance(n, scaling.ScaleState))


def state_like(tree, ref):
  """``tree`` (float32 state) in the leaf dtypes of ``ref``: the updated state goes back as the input's gradient."""
  return jax.tree.map(lambda v, r: v if r.dtype == v.dtype else jax.lax.convert_element_type(v, r.dtype), tree, ref)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """Static facts of one FP8 GEMM: the recipe, its quantizer and the dtypes around it."""

  recipe: Recipe
  quantizer: Quantizer
  out_dtype: jnp.dtype  # the compute dtype: the layer input's dtype
  kernel_dtype: jnp.dtype  # the weight gradient's dtype
  bias_dtype: jnp.dtype | None  # None: no bias
  # Inside shard_map: the manual axes the kernel varies over as the caller passed it, before the layer cast it to
  # vary like its input (a replicated weight's current-scaling amax needs no reduction over the batch shards).
  kernel_axes: frozenset[str] | None = None
  # The jax.ad_checkpoint.checkpoint_name of the FP8 tensors saved for the backward pass.
  checkpoint_name: str = scaling.FP8_RESIDUAL

  @classmethod
  def of(cls, recipe: Recipe, x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
         checkpoint_name: str | None = None) -> "Fp8Config":
    """The config of the GEMM of layer input ``x`` with ``kernel`` (and ``bias``), as the layer's caller passed them;
    in a calibration pass (``te_jax.autocast.calibration_pass``) with the recipe's calibrating quantizer. Its saved
    FP8 tensors are named ``checkpoint_name`` (``check_checkpoint_name``'s; None: ``te_jax.FP8_RESIDUAL``)."""
    bias_dtype = None if bias is None else jnp.dtype(bias.dtype)
    quantizer = quantizer_for(recipe, get_autocast_state().calibrating)
    return cls(recipe, quantizer, jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), bias_dtype, varying_axes(kernel),
               checkpoint_name or scaling.FP8_RESIDUAL)

  @property
  def has_bias(self) -> bool:
    return self.bias_dtype is not None

  @property
  def fwd_dtype(self):
    return self.quantizer.fwd_dtype

  @property
  def bwd_dtype(self):
    return self.quantizer.bwd_dtype


@dataclasses.dataclass(frozen=True)
class Unstack:
  """A layer output handed out unstacked along one feature axis (``jnp.unstack(y, axis)``): of the GEMM's (M, N)
  output, ``parts`` arrays (M, N // parts), each taking every ``parts``-th chunk of ``group`` columns (``group`` is
  the size of the features after the axis). The backward quantizes their gradients straight into the GEMM's
  layout (``quantize_interleaved``) instead of stacking them first."""

  parts: int
  group: int
  feature_axis: int  # the unstacked axis among the features

  @classmethod
  def of(cls, axis: int | None, out_ndim: int, features: tuple[int, ...]) -> "Unstack | None":
    """For ``unstack_axis=axis`` of an output of rank ``out_ndim`` ending in ``features`` (None: no unstacking)."""
    if axis is None:
      return None
    first = out_ndim - len(features)
    if not isinstance(axis, int) or not -out_ndim <= axis < out_ndim or axis % out_ndim < first:
      raise ValueError(f"unstack_axis must be one of the output's feature axes {tuple(range(first, out_ndim))} "
                       f"(or {tuple(range(-len(features), 0))}), got {axis!r}")
    i = axis % out_ndim - first
    if not 1 <= features[i] <= _MAX_PARTS:
      raise ValueError(f"unstack_axis={axis} has size {features[i]}; at most {_MAX_PARTS} parts are supported")
    return cls(features[i], math.prod(features[i + 1:]), i)


def layer_output(y: jax.Array | tuple[jax.Array, ...], m: int, lead_shape: tuple[int, ...], features: tuple[int, ...],
                 unstack: Unstack | None):
  """The GEMM's (M + padding, N) output (or its (B, S, N) with the rows kept), or its parts, as the layer returns it:
  the first ``m`` rows, shaped ``(*lead_shape, *features)``, the unstacked axis left out of each part."""
  def rows(p):
    return p[:m] if p.ndim == 2 else p

  if unstack is None:
    return reshape(rows(y), (*lead_shape, *features))
  part_features = features[:unstack.feature_axis] + features[unstack.feature_axis + 1:]
  return tuple(reshape(rows(p), (*lead_shape, *part_features)) for p in y)


def check_residual(residual: jax.Array | None, out_shape: tuple[int, ...]) -> None:
  """A layer's ``residual`` argument must be None or have the layer output's shape."""
  if residual is not None and tuple(residual.shape) != tuple(out_shape):
    raise ValueError(f"residual must have the output's shape {tuple(out_shape)}, got {tuple(residual.shape)}")


def residual_rows(residual: jax.Array | None, m: int, n: int, pad: int, dtype,
                  out_rows: tuple[int, int] | None = None):
  """A layer's (checked) ``residual`` argument as its GEMM's (M + pad, N) C input in the output dtype (None stays
  None); with ``out_rows`` (B, S) (no padding then), as (B, S, N)."""
  if residual is None:
    return None
  if out_rows is not None:
    return reshape(residual.astype(dtype), (*out_rows, n))
  r = reshape(residual.astype(dtype), (m, n))
  return jnp.pad(r, ((0, pad), (0, 0))) if pad else r


def quantize_grad(cfg: Fp8Config, g: jax.Array | tuple[jax.Array, ...], state, unstack: Unstack | None) -> CastOutput:
  """The output gradient as the backward GEMMs need it: FP8 (M, N) with its transposed copy (N, M), its amax, and the
  bias gradient when there is a bias. ``g`` is the (M, N) gradient, or with ``unstack`` the parts' gradients; with the
  rows kept, (B, S, N) and (N, B, S). ``state``: the gradient's scaling state (None where the quantizer keeps none)."""
  kw = dict(transpose=True, transpose_batch_dims=0, dbias=cfg.has_bias)
  if unstack is None:
    return cfg.quantizer.quantize("grad", state, g, cfg.bwd_dtype, **kw)
  return cfg.quantizer.quantize_parts("grad", state, g, cfg.bwd_dtype, group=unstack.group, **kw)


class LinearResiduals(NamedTuple):
  """What the backward GEMMs need from the forward: quantized tensors and scalars only."""

  x_t: QuantizedTensor  # the FP8 input's transposed copy: (K, M), or (K, B, S) with the rows kept
  w: QuantizedTensor  # the FP8 kernel: (K, N)
  amax_w: jax.Array


def _reshaped(t: QuantizedTensor, *shape: int) -> QuantizedTensor:
  """``t`` as a GEMM's lhs (without its transposed copy) with its rows reshaped, its last dim kept."""
  return t.without_transposed().with_rows(*shape[:-1])


def _saved(t: QuantizedTensor, name: str) -> QuantizedTensor:
  """``t`` as a residual of the backward pass: without a transposed copy, its data named ``name`` (the config's
  ``checkpoint_name``) for ``jax.checkpoint`` policies."""
  return dataclasses.replace(t.without_transposed(), data=checkpoint_name(t.data, name))


def linear_fwd(cfg: Fp8Config, x: QuantizedTensor, kernel, kernel_state, bias, residual=None,
               unstack: Unstack | None = None, out_rows: tuple[int, int] | None = None,
               out_sharding=None) -> tuple[jax.Array | tuple[jax.Array, ...], LinearResiduals]:
  """``x @ kernel + bias (+ residual)`` from the FP8 input ``x`` (M, K) with its transposed copy: quantizes the (K, N)
  kernel (with its transposed copy, the K-major operand of this GEMM) and runs the forward GEMM (accumulating as the
  recipe's ``fp8_gemm_fprop`` says) with the bias and residual epilogues. With ``unstack``, returns the parts, each
  written by the GEMM where it is wanted: one batched GEMM against the transposed kernel's rows grouped by part. With
  ``out_rows`` (B, S), M = B * S, the output is (B, S, N), its rows sharded as its consumer asks (``gemm``'s
  ``scatter_rows``: a sequence-parallel row-parallel GEMM's reduce-scatter); a residual is then (B, S, N) too.

  With the rows kept (``x`` (B, S, K), its copy (K, B, S): a layer's ``keep_rows``), every GEMM keeps (B, S) as two
  dims sharded as they come (``gemm``'s ``keep_rows`` and ``contract_dims``), the output (B, S, N).

  ``out_sharding``: the (M, N) output's sharding (``gemm``'s), without ``unstack``."""
  quantize_kernel = functools.partial(cfg.quantizer.quantize, "kernel", kernel_state, kernel, cfg.fwd_dtype,
                                      shard_axes=cfg.kernel_axes, transpose=True)
  fwd_gemm = functools.partial(gemm, dtype=cfg.out_dtype, fast_accum=not cfg.recipe.fp8_gemm_fprop.use_split_accumulator)
  keep_rows = x.data.ndim > 2
  if unstack is None or unstack.parts == 1:
    qw = quantize_kernel()  # (K, N) and (N, K)
    lhs = x if out_rows is None else _reshaped(x, *out_rows, x.shape[-1])
    out = fwd_gemm(lhs, qw.out.transposed(), bias=bias, residual=residual, scatter_rows=out_rows is not None,
                   keep_rows=keep_rows, out_sharding=out_sharding)
    out = out if unstack is None else (out,)
  else:  # the transposed copy's rows grouped by part: (parts, N / parts, K)
    qw = quantize_kernel(transpose_parts=(unstack.parts, unstack.group))
    biases = None if bias is None else group_parts(bias, unstack.parts, unstack.group)
    out = fwd_gemm(x, qw.out.transposed(), bias=biases, rhs_parts=True, keep_rows=keep_rows)
  name = cfg.checkpoint_name
  return out, LinearResiduals(_saved(x.transposed(), name), _saved(qw.out, name), qw.amax)


def linear_bwd(cfg: Fp8Config, res: LinearResiduals, g: QuantizedTensor, dgrad_rows: tuple[int, int] | None = None,
               dgrad_sharding=None) -> tuple[jax.Array, jax.Array]:
  """dgrad and wgrad from the FP8 output gradient ``g`` (M, N) with its transposed copy (N, M) (with the rows kept,
  (B, S, N) and (N, B, S)), accumulating as the recipe's ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad`` say (full precision
  by default). Returns ``(dx (M, K) in the compute dtype, dkernel (K, N) in the kernel's dtype)``, dx (B, S, K) with
  the rows kept.

  With ``dgrad_rows`` (B, S), dx is (B, S, K) with its rows sharded as its consumer asks (``gemm``'s
  ``scatter_rows``): a column-parallel layer that constrains its input's gradient to a sequence-parallel residual
  stream (its ``grad_sharding``, here ``dgrad_sharding``: the GEMM's ``out_sharding``) reduce-scatters dx onto it."""
  recipe = cfg.recipe
  keep_rows = g.data.ndim > 2
  lhs = g if dgrad_rows is None else _reshaped(g, *dgrad_rows, g.shape[-1])
  dx = gemm(lhs, res.w, dtype=cfg.out_dtype, fast_accum=not recipe.fp8_gemm_dgrad.use_split_accumulator,
            scatter_rows=dgrad_rows is not None, keep_rows=keep_rows,
            out_sharding=dgrad_sharding if dgrad_rows is not None else None)
  # On Explicit mesh axes the weight gradient is wanted laid out as the kernel is (FSDP: reduce-scattered onto its
  # shards, as the partitioner does on an Auto mesh), rather than all-reduced and then sliced to the kernel's type.
  w_sharding = explicit_sharding(res.w.data)
  dw = gemm(res.x_t, g.transposed(), dtype=cfg.kernel_dtype,
            fast_accum=not recipe.fp8_gemm_wgrad.use_split_accumulator, contract_dims=res.x_t.data.ndim - 1,
            out_sharding=None if w_sharding is None else w_sharding.spec)
  return dx, dw


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """The static parameters of the norm in front of a GEMM."""

  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False

  def __post_init__(self):
    check_norm_args(self.norm_type, self.epsilon)

  def fwd(self, x, gamma, beta, **kwargs):
    return norm_fwd(x, gamma, beta, norm_type=self.norm_type, epsilon=self.epsilon,
                    zero_centered_gamma=self.zero_centered_gamma, **kwargs)

  def bwd(self, dz, x, mean, rsigma, gamma, dres=None):
    """The norm's backward on ``x``'s rows (and ``dz``'s, of ``x``'s shape), whichever rows the forward ran on: the
    statistics are reshaped to them (a forward on (B * S, H) rows, a backward on (B, S, H): sequence shards)."""
    rows = x.shape[:-1]
    mean = None if mean is None else mean.reshape(rows)
    return norm_bwd(dz, x, mean, rsigma.reshape(rows), gamma, norm_type=self.norm_type,
                    zero_centered_gamma=self.zero_centered_gamma, dres=dres)

  def plain(self, x, gamma, beta):
    """The differentiable high-precision norm (no FP8), in ``x``'s dtype."""
    return layernorm(x, gamma, beta, norm_type=self.norm_type, epsilon=self.epsilon,
                     zero_centered_gamma=self.zero_centered_gamma, dtype=x.dtype)


class NormFp8(NamedTuple):
  """The FP8 input of the GEMM after a norm, and what the norm's backward needs."""

  x: QuantizedTensor  # (M, H) FP8 with its (H, M) transposed copy
  amax: jax.Array
  mean: jax.Array | None
  rsigma: jax.Array
  hp: jax.Array | None  # the high-precision normalized tensor, when it was computed


def norm_to_fp8(cfg: Fp8Config, norm: NormSpec, state, x2d, gamma, beta, *, keep_hp: bool) -> NormFp8:
  """Normalizes ``x2d`` (M, H) into the FP8 GEMM input ((B, S, H) with the rows kept: the transposed copy is then
  (H, B, S)).

  Where the quantizer knows the scale up front (delayed scaling), the norm kernel casts directly. Otherwise (current
  scaling needs the amax of the normalized tensor first, block scaling each block's), and where ``keep_hp`` asks for
  the normalized tensor itself, the norm writes it in the compute dtype and the quantizer's pass follows.
  """
  if cfg.quantizer.fused_cast and not keep_hp:
    scale = cfg.quantizer.scale(state, None, cfg.fwd_dtype)
    out = norm.fwd(x2d, gamma, beta, dtype=cfg.fwd_dtype, scale=scale, transpose=True)
    return NormFp8(out.out, out.amax, out.mean, out.rsigma, None)
  out = norm.fwd(x2d, gamma, beta, dtype=x2d.dtype)
  q = cfg.quantizer.quantize("x", state, out.out, cfg.fwd_dtype, transpose=True, transpose_batch_dims=0)
  return NormFp8(q.out, q.amax, out.mean, out.rsigma, out.out if keep_hp else None)
