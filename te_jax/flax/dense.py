"""Flax linen dense layers whose GEMMs run in FP8 under ``te_jax.autocast``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from te_jax.flax.scope import LinenScope, builds, options_of
from te_jax.modules.axes import Initializer
from te_jax.modules.dense import DenseGeneralOptions, dense_general, fp8_dot_general, fp8_einsum
from te_jax.recipe import Recipe

__all__ = ["DenseGeneral", "Fp8DotGeneral", "Fp8Einsum"]


@builds(DenseGeneralOptions)
class DenseGeneral(nn.Module):
  """A dense layer over any input axes, with FP8 GEMMs under ``te_jax.autocast``.

  Flax's ``nn.DenseGeneral``, attribute for attribute (same parameter names, shapes and default initializers, so a
  checkpoint of one loads into the other; initializers that name their axes with ``nn.with_logical_partitioning``),
  plus logical axis names for sharding and the FP8 state collection.

  >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> layer = te_flax.DenseGeneral(features=32, dtype=jnp.bfloat16)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   variables = layer.init(jax.random.key(0), jnp.ones((8, 64)))
  >>> jax.tree.map(jnp.shape, variables["params"])
  {'bias': (32,), 'kernel': (64, 32)}
  >>> sorted(variables[te_jax.FP8_COLLECTION])[:2]
  ['grad_amax_history', 'grad_scale']

  Under FP8 the GEMM is te_jax's, unless it cannot be: with ``batch_dims`` or a ``dot_general`` of the caller's, or
  sizes that are not multiples of 16 (an FP8 GEMM's), the layer computes in high precision as Flax's does and hands
  its FP8 state back unchanged.

  Attributes:
    features: the output features (int or tuple).
    axis: the input axes to contract.
    batch_dims: leading input axes the kernel has too (one kernel per index), as in ``nn.DenseGeneral``.
    unstack_axis: return the output unstacked along this feature axis (``te_jax.dense``'s ``unstack_axis``); the
      kernel is then a stack of separate projections (a fused QKV kernel), and ``kernel_init`` initializes each part
      as a kernel of its own (its 2-D shape without the unstacked axis, its own key of ``jax.random.split``).
    use_bias: add a bias.
    kernel_init: initializer of the kernel, called on its 2-D (inputs, outputs) shape as Flax does (per part with
      ``unstack_axis``).
    bias_init: initializer of the bias.
    dtype: the compute dtype (None: the promotion of the input's and ``param_dtype``, as in Flax).
    param_dtype: the dtype of the parameters.
    precision: ``lax.dot_general``'s precision for the high-precision GEMM.
    dot_general, dot_general_cls: a GEMM of the caller's instead of te_jax's (as in Flax; it runs in high precision).
    kernel_axes: logical axis names of the kernel (``(*input axes, *feature axes)``).
    bias_axes: logical axis names of the bias.
    output_axes: logical axis names of the output (one per dim): the output is constrained to them
      (``nn.with_logical_constraint``). When the output has two non-feature dims (B, S) and the rules shard S (a
      sequence-parallel residual stream), the FP8 GEMM takes its rows' sharding from that constraint rather than from
      the input's, so a row-parallel layer (its contraction sharded over the tensor axis) ends in one reduce-scatter
      onto the stream instead of an all-reduce and a slice (``te_jax.dense``'s ``scatter_rows``). When S is sharded
      over a mesh axis tensor parallelism does not use (context parallelism), the layer keeps (B, S) as two dims
      throughout, sharded as they come (``te_jax.dense``'s ``keep_rows``): the merged (B * S) rows could not be
      sharded that way, and XLA would all-gather the sequence.
    recipe: an FP8 recipe for this layer, overriding autocast's.
    quantization_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` of the FP8 tensors this layer saves for
      the backward pass (its transposed FP8 input and its FP8 kernel), Transformer Engine's option of that name; None:
      ``te_jax.FP8_RESIDUAL``, the name every layer's share. A model that names its layers' apart picks which of them
      ``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names(...))`` keeps.
  """

  features: int | Sequence[int]
  axis: int | Sequence[int] = -1
  batch_dims: Sequence[int] = ()
  unstack_axis: int | None = None
  use_bias: bool = True
  kernel_init: Initializer = nn.initializers.lecun_normal()
  bias_init: Initializer = nn.initializers.zeros_init()
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  dot_general: Any = None
  dot_general_cls: Any = None
  kernel_axes: tuple[str | None, ...] = ()
  bias_axes: tuple[str | None, ...] = ()
  output_axes: tuple[str | None, ...] = ()
  recipe: Recipe | None = None
  quantization_checkpoint_name: str | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array, residual: jax.Array | None = None,
               out_sharding=None) -> jax.Array | tuple[jax.Array, ...]:
    """The layer's output, plus ``residual`` (the output's shape) when given: added in the GEMM's epilogue;
    ``out_sharding`` as ``te_jax.nnx.DenseGeneral``'s (``te_jax.dense``'s: the output's type on Explicit axes)."""
    return dense_general(LinenScope(self), options_of(self, DenseGeneralOptions), inputs, residual, out_sharding)


class Fp8DotGeneral(nn.Module):
  """te_jax's FP8 dense GEMM as a ``dot_general_cls`` for Flax's own layers.

  >>> import flax.linen as nn, jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax
  >>> layer = nn.Dense(16, dot_general_cls=te_flax.Fp8DotGeneral)
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((4, 32)))
  >>> y.shape
  (4, 16)

  Takes ``lax.dot_general``'s ``(lhs, rhs, dimension_numbers)`` with any dimension numbers (``nn.DenseGeneral``'s
  ``batch_dims`` too), lhs quantized as the GEMM's input and rhs as its kernel, through
  ``te_jax.fused.dot_general.dot_general``: with batch dims one batched product of the FP8 operands, under per-tensor
  recipes. An instance made in a compact method is also ``jnp.einsum``'s ``_dot_general`` (one GEMM's state per
  instance); ``Fp8Einsum`` keeps an einsum's operand roles fixed. Outside an enabled autocast it is a plain
  ``lax.dot_general``.

  Attributes:
    recipe: an FP8 recipe for this GEMM, overriding autocast's.
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return fp8_dot_general(LinenScope(self), self.recipe, lhs, rhs, dimension_numbers, precision,
                           preferred_element_type)


class Fp8Einsum(nn.Module):
  """A two-operand ``jnp.einsum`` as one FP8 GEMM (``Fp8DotGeneral``'s, with its state in this module's variables):
  the einsum of an input with a kernel (attention's ``'BTD,NDH->BTNH'``) or of two activations
  (``'BSNH,BTNH->BNTS'``, batched over B and N).

  >>> import jax, jax.numpy as jnp, te_jax
  >>> from te_jax.flax.dense import Fp8Einsum
  >>> q, k = jnp.ones((2, 32, 4, 16)), jnp.ones((2, 48, 4, 16))
  >>> with te_jax.autocast(enabled=True, recipe=te_jax.recipe.DelayedScaling(amax_history_len=16)):
  ...   s, variables = Fp8Einsum().init_with_output(jax.random.key(0), 'BSNH,BTNH->BNTS', q, k)
  >>> s.shape, variables[te_jax.FP8_COLLECTION]['x_amax_history'].shape
  ((2, 4, 48, 32), (16,))

  Takes ``(subscripts, lhs, rhs)``: ``'lhs,rhs->out'`` with an explicit output and one letter per dim; lhs is
  quantized as the GEMM's input, rhs as its kernel (the order given, whichever ``jnp.einsum`` would pick). With
  ``__call__``'s signature it is also the ``einsum_op`` of ``nnx.Einsum``-style code. Outside an enabled autocast it
  is ``jnp.einsum``'s result computed as one ``lax.dot_general``.

  Attributes:
    recipe: an FP8 recipe for this GEMM, overriding autocast's.
  """

  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None, out_sharding=None):
    return fp8_einsum(LinenScope(self), self.recipe, subscripts, lhs, rhs, precision, preferred_element_type,
                      out_sharding)
