"""The body of ``LayerNormMLP``: norm -> fc1 -> activation -> fc2 over the last dim, every GEMM in FP8 with its cast
fused into the kernel before it (``te_jax.flax`` and ``te_jax.nnx``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from te_jax._core.autocast import resolve_recipe
from te_jax.fused.dense import dense
from te_jax.fused.layernorm_dense import layernorm_dense
from te_jax.fused.layernorm_mlp import (activation_params_items, intermediate_split, layernorm_mlp, merge_parts,
                                        split_parts)
from te_jax.fused.linear import check_checkpoint_name
from te_jax.modules.axes import (ACT, ACT_EMBED, BATCH, EMBED, MLP, SEQ, Initializer, explicit_out, is_int,
                                 logical_constraint, rule_axes, rule_shards, sequence_kept, stream_input,
                                 stream_sharding)
from te_jax.modules.layernorm_dense import norm_params
from te_jax.modules.scope import Scope
from te_jax.ops.activation import activation, normalize_activation_type
from te_jax.recipe import Recipe

__all__ = ["LayerNormMLPOptions", "check_dropout_dims", "layernorm_mlp_params", "layernorm_mlp_block"]

_AXES_ATTRS = ("ln_scale_axes", "ln_bias_axes", "wi_kernel_axes", "wi_bias_axes", "wo_kernel_axes", "wo_bias_axes")


def check_dropout_dims(dims, arg: str, ndim: int | None = None) -> tuple[int, ...]:
  """``dims``, the caller's argument ``arg``: a dropout's broadcast dims (Flax's ``broadcast_dims``, along which one
  mask value is shared), as a tuple of ints, each a dim of an ``ndim``-D tensor where ``ndim`` is given."""
  where = f" of the {ndim}-D tensor, each in [{-ndim}, {ndim})" if ndim is not None else ""
  if not (isinstance(dims, Sequence) and not isinstance(dims, str) and all(
      isinstance(d, int) and not isinstance(d, bool) and (ndim is None or -ndim <= d < ndim) for d in dims)):
    raise ValueError(f"{arg} must be a sequence of dims{where} (the dropout mask is shared along them), got {dims!r}")
  return tuple(dims)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerNormMLPOptions:
  """The options of ``LayerNormMLP``: the linen module's attributes (documented there, with their defaults) but
  ``deterministic``, which each framework resolves its own way; the NNX module maps its constructor's arguments onto
  them."""

  intermediate_dim: int
  activation_type: Sequence[str]
  # The user's dict (or None), stored as te_jax.fused.layernorm_mlp.activation_params_items' sorted (name, value)
  # tuple: the options are a static, hashable config.
  activation_params: Any
  intermediate_dropout: float
  intermediate_dropout_dims: Sequence[int]
  dropout_rng_name: str
  use_bias: bool
  return_layernorm_output: bool
  norm_type: str
  epsilon: float
  zero_centered_gamma: bool
  ln_scale_init: Initializer | None
  ln_scale_axes: tuple[str | None, ...]
  ln_bias_init: Initializer
  ln_bias_axes: tuple[str | None, ...]
  kernel_init: Initializer
  bias_init: Initializer
  wi_kernel_axes: tuple[str | None, ...]
  wi_bias_axes: tuple[str | None, ...]
  wo_kernel_axes: tuple[str | None, ...]
  wo_bias_axes: tuple[str | None, ...]
  logical_axes: bool
  transpose_batch_sequence: bool
  dtype: Any
  param_dtype: Any
  recipe: Recipe | None
  quantization_checkpoint_name: str | None
  ffn1_ckpt_name: str | None
  ffn2_ckpt_name: str | None

  def __post_init__(self):
    object.__setattr__(self, "activation_type", tuple(self.activation_type))
    object.__setattr__(self, "intermediate_dropout_dims",
                       check_dropout_dims(self.intermediate_dropout_dims, "intermediate_dropout_dims"))
    for arg in ("quantization_checkpoint_name", "ffn1_ckpt_name", "ffn2_ckpt_name"):
      check_checkpoint_name(getattr(self, arg), arg)
    if not (is_int(self.intermediate_dim) and self.intermediate_dim > 0):
      raise ValueError(f"intermediate_dim must be a positive int, got {self.intermediate_dim!r}")
    object.__setattr__(self, "activation_params", activation_params_items(
        self.activation_params, normalize_activation_type(self.activation_type)))
    if self.logical_axes:
      given = [a for a in _AXES_ATTRS if getattr(self, a)]
      if given:
        raise ValueError(f"LayerNormMLP: logical_axes=True names every parameter's axes; {', '.join(given)} too: "
                         "give one of the two")

  @property
  def act(self) -> tuple[str, ...]:
    return normalize_activation_type(self.activation_type)

  def axis_names(self, attr: str) -> tuple[str | None, ...]:
    """The logical axis names of a parameter (by its ``*_axes`` attribute): te_jax's under ``logical_axes``."""
    if not self.logical_axes:
      return tuple(getattr(self, attr))
    return {"ln_scale_axes": (EMBED,), "ln_bias_axes": (EMBED,), "wi_kernel_axes": (EMBED, ACT, MLP),
            "wi_bias_axes": (ACT, MLP), "wo_kernel_axes": (MLP, EMBED), "wo_bias_axes": (EMBED,)}[attr]


def layernorm_mlp_params(scope: Scope, o: LayerNormMLPOptions, hidden: int):
  """``(gamma, beta, wi_kernel, wo_kernel, wi_bias, wo_bias)`` of an MLP over inputs of last dim ``hidden``, its
  dropout and the FP8 state of both GEMMs."""
  n_act, f = len(o.act), o.intermediate_dim
  gamma, beta = norm_params(scope, hidden, norm_type=o.norm_type, epsilon=o.epsilon,
                            zero_centered_gamma=o.zero_centered_gamma, scale_init=o.ln_scale_init,
                            bias_init=o.ln_bias_init, scale_axes=o.axis_names("ln_scale_axes"),
                            bias_axes=o.axis_names("ln_bias_axes"), param_dtype=o.param_dtype, prefix="ln_")
  k1 = scope.param("wi_kernel", o.kernel_init, (hidden, n_act, f), o.param_dtype, n_in=1,
                   part_axis=1 if n_act > 1 else None, axes=o.axis_names("wi_kernel_axes"))
  k2 = scope.param("wo_kernel", o.kernel_init, (f, hidden), o.param_dtype, n_in=1,
                   axes=o.axis_names("wo_kernel_axes"))
  b1 = b2 = None
  if o.use_bias:
    b1 = scope.param("wi_bias", o.bias_init, (n_act, f), o.param_dtype, axes=o.axis_names("wi_bias_axes"))
    b2 = scope.param("wo_bias", o.bias_init, (hidden,), o.param_dtype, axes=o.axis_names("wo_bias_axes"))
  scope.declare_dropout("dropout", o.intermediate_dropout, o.dropout_rng_name, o.intermediate_dropout_dims)
  scope.declare_fp8_state(o.recipe, ("wi_", "wo_"))
  return gamma, beta, k1, k2, b1, b2


def layernorm_mlp_block(scope: Scope, o: LayerNormMLPOptions, inputs: jax.Array, deterministic: bool,
                        residual: jax.Array | None = None):
  """``LayerNormMLP``'s call (documented on the linen module), ``deterministic`` resolved by the framework."""
  act = o.act
  gated = len(act) == 2
  f = o.intermediate_dim
  gamma, beta, k1, k2, b1, b2 = layernorm_mlp_params(scope, o, inputs.shape[-1])
  check_dropout_dims(o.intermediate_dropout_dims, "intermediate_dropout_dims", inputs.ndim)
  # A gated kernel's (2, F) with F split over mesh axes (tensor parallelism) merges into fc1's N shard by shard.
  wi_axes = o.axis_names("wi_kernel_axes")
  mesh = jax.sharding.get_abstract_mesh()
  split = intermediate_split(tuple(a for a in rule_axes(wi_axes[-1]) if a in mesh.axis_names) or None) if (
      gated and wi_axes) else ()
  dtype = o.dtype or jnp.result_type(inputs.dtype, o.param_dtype)
  recipe = resolve_recipe(o.recipe)
  stream = None
  if o.logical_axes and inputs.ndim == 3:
    stream = (SEQ, BATCH, ACT_EMBED) if o.transpose_batch_sequence else (BATCH, SEQ, ACT_EMBED)
  if stream:
    own_residual = residual is inputs
    inputs = stream_input(inputs, stream, stream.index(SEQ))
    residual = inputs if own_residual else residual

  def finish(out):
    if not stream:
      return out
    y = logical_constraint(out[0] if o.return_layernorm_output else out, stream)
    return (y, out[1]) if o.return_layernorm_output else y

  # Batch first with the sequence sharded: fc2 takes its rows' sharding from finish's constraint and fc1's dgrad
  # writes the stream's (grad_sharding; stream_input hands it on as it is), so under sequence parallelism both
  # reduce-scatter onto the stream rather than all-reducing; a sequence sharded over another axis (context
  # parallelism) stays sharded through the layer (its rows kept).
  scatter = bool(stream) and not o.transpose_batch_sequence and rule_shards(SEQ)
  rows = dict(scatter_rows=scatter, keep_rows=scatter and sequence_kept(SEQ))
  grad_sharding = stream_sharding(stream) if scatter else None
  out_sharding = explicit_out(stream)
  x, (meta_1, meta_2) = scope.fp8_state(recipe, inputs.astype(dtype), ("wi_", "wo_"))
  if residual is inputs and x.dtype == inputs.dtype:
    residual = x  # the block's own input: layernorm_mlp folds its gradient into the norm's backward
  norm_args = dict(norm_type=o.norm_type, epsilon=o.epsilon, zero_centered_gamma=o.zero_centered_gamma)
  qname = dict(quantization_checkpoint_name=o.quantization_checkpoint_name)
  dropout = o.intermediate_dropout > 0.0 and not deterministic
  if not dropout and not o.return_layernorm_output:
    return finish(layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, activation_type=act,
                                activation_params=dict(o.activation_params), residual=residual,
                                fp8_meta_1=meta_1, fp8_meta_2=meta_2, recipe=recipe, grad_sharding=grad_sharding,
                                intermediate_axes=split, out_sharding=out_sharding, ffn1_ckpt_name=o.ffn1_ckpt_name,
                                ffn2_ckpt_name=o.ffn2_ckpt_name, **qname, **rows, **norm_args))
  # Dropout between the activation and fc2, or the norm's output wanted: the parts, each dense still in FP8, fc1's
  # and fc2's outputs named as layernorm_mlp names them.
  h = layernorm_dense(x, gamma, beta, merge_parts(k1, 1, split), None if b1 is None else merge_parts(b1, 0, split),
                      return_layernorm_output=o.return_layernorm_output, fp8_meta=meta_1, recipe=recipe,
                      keep_rows=rows["keep_rows"], grad_sharding=grad_sharding, **qname, **norm_args)
  h, z = h if o.return_layernorm_output else (h, None)
  a = activation(_named(split_parts(h, -1, 2, split) if gated else h, o.ffn1_ckpt_name), act,
                 dict(o.activation_params))
  if dropout:
    a = scope.dropout("dropout", o.intermediate_dropout, o.dropout_rng_name, a,
                      broadcast_dims=o.intermediate_dropout_dims)
  y = _named(dense(a, k2, b2, residual=residual, fp8_meta=meta_2, recipe=recipe, out_sharding=out_sharding, **qname,
                   **rows), o.ffn2_ckpt_name)
  return finish((y, z) if o.return_layernorm_output else y)


def _named(x: jax.Array, name: str | None) -> jax.Array:
  return x if name is None else checkpoint_name(x, name)
