"""Flax linen ``LayerNormMLP``: norm -> fc1 -> activation -> fc2, every GEMM in FP8 with its cast fused into the
kernel before it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax._core.autocast import resolve_recipe
from te_jax.flax.fp8_state import fp8_state
from te_jax.flax.params import (ACT, ACT_EMBED, BATCH, EMBED, MLP, SEQ, Initializer, flat_init, is_int, logical,
                                resolve_deterministic, rule_axes, rule_shards, sequence_kept, stream_input,
                                stream_sharding)
from te_jax.flax.scope import LinenScope
from te_jax.modules.layernorm_dense import norm_params
from te_jax.fused.dense import dense
from te_jax.fused.layernorm_dense import layernorm_dense
from te_jax.fused.layernorm_mlp import intermediate_split, layernorm_mlp, merge_parts, split_parts
from te_jax.ops.activation import activation, parse_activation_type
from te_jax.recipe import Recipe

__all__ = ["LayerNormMLP"]

_AXES_ATTRS = ("ln_scale_axes", "ln_bias_axes", "wi_kernel_axes", "wi_bias_axes", "wo_kernel_axes", "wo_bias_axes")


class LayerNormMLP(nn.Module):
  """LayerNorm/RMSNorm -> fc1 -> activation -> fc2 over the last dim; under FP8 every GEMM is FP8 and each cast is
  fused into the kernel before it.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
  >>> mlp = te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("silu", "linear"), dtype=jnp.bfloat16)
  >>> variables = mlp.init(jax.random.key(0), jnp.ones((4, 32), jnp.bfloat16))
  >>> jax.tree.map(jnp.shape, variables["params"])["wi_kernel"], mlp.apply(variables, jnp.ones((4, 32))).shape
  ((32, 2, 64), (4, 32))

  Attributes:
    intermediate_dim: fc1's width F.
    activation_type: ``("gelu",)``, ``("relu",)``, ... or a gated pair ``("silu", "linear")`` (SwiGLU), ``("gelu",
      "linear")`` (GeGLU), ``("relu", "linear")`` (ReGLU).
    intermediate_dropout: dropout on the activation output (from the ``dropout_rng_name`` rng stream unless
      deterministic); when it is active the layer runs as its parts (norm, dense, activation, dropout, dense), each
      still FP8.
    dropout_rng_name: the rng stream of the dropout mask.
    deterministic: no dropout; or give it to the call (one of the two, as in Flax; needed when there is dropout).
    return_layernorm_output: also return the normalized input (for a residual taken after the norm); the layer then
      runs as its parts too.
    use_bias: biases on fc1 and fc2.
    norm_type, epsilon, zero_centered_gamma: the norm's, as in LayerNorm.
    ln_scale_init, ln_scale_axes, ln_bias_init, ln_bias_axes: the norm's parameters, as ``LayerNorm``'s
      ``scale_init``, ...
    kernel_init, bias_init: the initializers of both GEMMs' parameters (``wi_kernel`` is (hidden, n_activations,
      intermediate), ``wo_kernel`` (intermediate, hidden)).
    wi_kernel_axes, wi_bias_axes, wo_kernel_axes, wo_bias_axes: their logical axis names.
    logical_axes: name every parameter's axes with te_jax's logical names instead (``te_jax.flax.LOGICAL_AXES``:
      ``wi_kernel`` (embed, act, mlp), ``wo_kernel`` (mlp, embed), the norm's (embed,)), for
      ``te_jax.flax.logical_axis_rules``; not together with the ``*_axes`` attributes. A 3-D input (batch, seq,
      hidden) is then read as a residual stream: its sequence gathered under sequence parallelism (kept sharded under
      context parallelism, every op on the sequence shards), the output constrained to the stream's (batch, seq,
      act_embed) sharding (fc2 reduce-scatters onto it) and the input's gradient too (fc1's dgrad reduce-scatters).
    transpose_batch_sequence: with ``logical_axes``, a 3-D input is (seq, batch, hidden).
    dtype, param_dtype, recipe: as in DenseGeneral.
  """

  intermediate_dim: int = 2048
  activation_type: Sequence[str] = ("gelu",)
  intermediate_dropout: float = 0.0
  dropout_rng_name: str = "dropout"
  deterministic: bool | None = None
  use_bias: bool = True
  return_layernorm_output: bool = False
  norm_type: str = "layernorm"
  epsilon: float = 1e-6
  zero_centered_gamma: bool = False
  ln_scale_init: Initializer | None = None
  ln_scale_axes: tuple[str | None, ...] = ()
  ln_bias_init: Initializer = nn.initializers.zeros_init()
  ln_bias_axes: tuple[str | None, ...] = ()
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  wi_kernel_axes: tuple[str | None, ...] = ()
  wi_bias_axes: tuple[str | None, ...] = ()
  wo_kernel_axes: tuple[str | None, ...] = ()
  wo_bias_axes: tuple[str | None, ...] = ()
  logical_axes: bool = False
  transpose_batch_sequence: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  recipe: Recipe | None = None

  def _axis_names(self) -> dict[str, tuple[str, ...]]:
    """With ``logical_axes``, the parameters' logical axis names by attribute; else {} (the attributes')."""
    if not self.logical_axes:
      return {}
    given = [a for a in _AXES_ATTRS if getattr(self, a)]
    if given:
      raise ValueError(f"LayerNormMLP: logical_axes=True names every parameter's axes; {', '.join(given)} too: "
                       "give one of the two")
    return {"ln_scale_axes": (EMBED,), "ln_bias_axes": (EMBED,), "wi_kernel_axes": (EMBED, ACT, MLP),
            "wi_bias_axes": (ACT, MLP), "wo_kernel_axes": (MLP, EMBED), "wo_bias_axes": (EMBED,)}

  def _activation_names(self, ndim: int) -> tuple[str, ...] | None:
    if not self.logical_axes or ndim != 3:
      return None
    return (SEQ, BATCH, ACT_EMBED) if self.transpose_batch_sequence else (BATCH, SEQ, ACT_EMBED)

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: bool | None = None, residual: jax.Array | None = None):
    """The MLP of ``inputs``, plus ``residual`` (``inputs``' shape) when given: added in fc2's epilogue. With
    ``return_layernorm_output``, the pair (that, the normalized input)."""
    name, gated = parse_activation_type(tuple(self.activation_type))
    if not (is_int(self.intermediate_dim) and self.intermediate_dim > 0):
      raise ValueError(f"intermediate_dim must be a positive int, got {self.intermediate_dim!r}")
    deterministic = resolve_deterministic(self, deterministic, intermediate_dropout=self.intermediate_dropout)
    act = (name, "linear") if gated else (name,)
    n_act = 2 if gated else 1
    hidden, f = inputs.shape[-1], self.intermediate_dim
    names = self._axis_names()
    gamma, beta = norm_params(LinenScope(self), hidden, norm_type=self.norm_type, epsilon=self.epsilon,
                              zero_centered_gamma=self.zero_centered_gamma, scale_init=self.ln_scale_init,
                              bias_init=self.ln_bias_init,
                              scale_axes=tuple(names.get("ln_scale_axes", self.ln_scale_axes)),
                              bias_axes=tuple(names.get("ln_bias_axes", self.ln_bias_axes)),
                              param_dtype=self.param_dtype, prefix="ln_")
    k1 = self.param("wi_kernel", logical(flat_init(self.kernel_init, 1, 1 if n_act > 1 else None),
                                          names.get("wi_kernel_axes", self.wi_kernel_axes)),
                    (hidden, n_act, f), self.param_dtype)
    k2 = self.param("wo_kernel", logical(flat_init(self.kernel_init, 1), names.get("wo_kernel_axes",
                                                                                    self.wo_kernel_axes)),
                    (f, hidden), self.param_dtype)
    b1 = b2 = None
    if self.use_bias:
      b1 = self.param("wi_bias", logical(self.bias_init, names.get("wi_bias_axes", self.wi_bias_axes)), (n_act, f),
                      self.param_dtype)
      b2 = self.param("wo_bias", logical(self.bias_init, names.get("wo_bias_axes", self.wo_bias_axes)), (hidden,),
                      self.param_dtype)
    # A gated kernel's (2, F) with F split over mesh axes (tensor parallelism) merges into fc1's N shard by shard.
    wi_axes = names.get("wi_kernel_axes", self.wi_kernel_axes)
    mesh = jax.sharding.get_abstract_mesh()
    split = intermediate_split(tuple(a for a in rule_axes(wi_axes[-1]) if a in mesh.axis_names) or None) if (
        gated and wi_axes) else ()
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    recipe = resolve_recipe(self.recipe)
    stream = self._activation_names(inputs.ndim)
    if stream:
      own_residual = residual is inputs
      inputs = stream_input(inputs, stream, stream.index(SEQ))
      residual = inputs if own_residual else residual

    def finish(out):
      if not stream:
        return out
      y = nn.with_logical_constraint(out[0] if self.return_layernorm_output else out, stream)
      return (y, out[1]) if self.return_layernorm_output else y

    # Batch first with the sequence sharded: fc2 takes its rows' sharding from finish's constraint and fc1's dgrad
    # writes the stream's (grad_sharding; stream_input hands it on as it is), so under sequence parallelism both
    # reduce-scatter onto the stream rather than all-reducing; a sequence sharded over another axis (context
    # parallelism) stays sharded through the layer (its rows kept).
    scatter = bool(stream) and not self.transpose_batch_sequence and rule_shards(SEQ)
    rows = dict(scatter_rows=scatter, keep_rows=scatter and sequence_kept(SEQ))
    grad_sharding = stream_sharding(stream) if scatter else None
    x, (meta_1, meta_2) = fp8_state(self, recipe, inputs.astype(dtype), ("wi_", "wo_"))
    if residual is inputs and x.dtype == inputs.dtype:
      residual = x  # the block's own input: layernorm_mlp folds its gradient into the norm's backward
    norm_args = dict(norm_type=self.norm_type, epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma)
    dropout = self.intermediate_dropout > 0.0 and not deterministic
    if not dropout and not self.return_layernorm_output:
      return finish(layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, activation_type=act, residual=residual,
                                  fp8_meta_1=meta_1, fp8_meta_2=meta_2, recipe=recipe, grad_sharding=grad_sharding,
                                  intermediate_axes=split, **rows, **norm_args))
    # Dropout between the activation and fc2, or the norm's output wanted: the parts, each dense still in FP8.
    h = layernorm_dense(x, gamma, beta, merge_parts(k1, 1, split), None if b1 is None else merge_parts(b1, 0, split),
                        return_layernorm_output=self.return_layernorm_output, fp8_meta=meta_1, recipe=recipe,
                        keep_rows=rows["keep_rows"], grad_sharding=grad_sharding, **norm_args)
    h, z = h if self.return_layernorm_output else (h, None)
    a = activation(split_parts(h, -1, 2, split) if gated else h, act)
    if dropout:
      a = nn.Dropout(self.intermediate_dropout, rng_collection=self.dropout_rng_name)(a, deterministic=False)
    y = dense(a, k2, b2, residual=residual, fp8_meta=meta_2, recipe=recipe, **rows)
    return finish((y, z) if self.return_layernorm_output else y)
