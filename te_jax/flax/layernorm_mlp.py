"""Flax linen ``LayerNormMLP``: norm -> fc1 -> activation -> fc2, every GEMM in FP8 with its cast fused into the
kernel before it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.params import resolve_deterministic
from te_jax.flax.scope import LinenScope, builds, options_of
from te_jax.flax.te_names import te_names
from te_jax.modules.axes import Initializer
from te_jax.modules.layernorm_mlp import LayerNormMLPOptions, layernorm_mlp_block
from te_jax.recipe import Recipe

__all__ = ["LayerNormMLP"]


@te_names
@builds(LayerNormMLPOptions)
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
      "linear")`` (GeGLU), ``("relu", "linear")`` (ReGLU), ``("clamped_silu", "clamped_linear")`` (GPT-OSS's
      clamped SwiGLU), ... (``te_jax.ops.activation.ACTIVATION_TYPES``).
    activation_params: Transformer Engine's option of that name: a dict of the clamped SwiGLU's ``limit``,
      ``alpha`` and ``glu_linear_offset`` (any of them; the rest its defaults 7.0, 1.702, 1.0), e.g. ``{"limit":
      10.0}``; None for the defaults, and for the other activations, which take no parameters (any raises).
    intermediate_dropout: dropout on the activation output (from the ``dropout_rng_name`` rng stream unless
      deterministic); when it is active the layer runs as its parts (norm, dense, activation, dropout, dense), each
      still FP8.
    intermediate_dropout_dims: the dims of the activation output (the input's rank, its last dim the intermediate
      one) along which ``intermediate_dropout``'s mask is shared (Flax's ``broadcast_dims``; Transformer Engine's
      ``intermediate_hidden_dropout_dims``), e.g. ``(-2,)`` for one mask across the sequence of a (B, S, H) input.
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
    quantization_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` of both GEMMs' FP8 tensors saved for
      the backward pass (None: ``te_jax.FP8_RESIDUAL``), as in DenseGeneral.
    ffn1_ckpt_name, ffn2_ckpt_name: the checkpoint names of fc1's output (the activation's input, saved for the
      backward pass) and of fc2's output, as Transformer Engine names them (None: unnamed):
      ``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names("ffn1"))`` keeps fc1's output and
      recomputes the rest.
  """

  intermediate_dim: int = 2048
  activation_type: Sequence[str] = ("gelu",)
  activation_params: Mapping[str, float] | None = None
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
  intermediate_dropout_dims: Sequence[int] = ()
  quantization_checkpoint_name: str | None = None
  ffn1_ckpt_name: str | None = "ffn1"
  ffn2_ckpt_name: str | None = "ffn2"

  @nn.compact
  def __call__(self, inputs: jax.Array, deterministic: bool | None = None, residual: jax.Array | None = None):
    """The MLP of ``inputs``, plus ``residual`` (``inputs``' shape) when given: added in fc2's epilogue. With
    ``return_layernorm_output``, the pair (that, the normalized input)."""
    options = options_of(self, LayerNormMLPOptions)
    deterministic = resolve_deterministic(self, deterministic, intermediate_dropout=self.intermediate_dropout)
    return layernorm_mlp_block(LinenScope(self), options, inputs, deterministic, residual)
