"""The keyword names of NVIDIA Transformer Engine's JAX modules (``transformer_engine.jax.flax``, from its source)
that te_jax's linen modules spell differently, each with te_jax's name: a port that passes one gets an error that
names te_jax's instead of Python's "unexpected keyword argument". docs/porting.md has every argument.

>>> import te_jax.flax as te_flax
>>> te_flax.LayerNorm(layernorm_type="rmsnorm")
Traceback (most recent call last):
...
TypeError: LayerNorm takes norm_type where Transformer Engine's takes layernorm_type: pass norm_type='rmsnorm' (docs/porting.md lists every argument)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

__all__ = ["TE_NAMES", "te_names"]

_NORM = {"layernorm_type": "norm_type"}
_LN_PARAMS = {"scale_init": "ln_scale_init", "scale_axes": "ln_scale_axes"}
_ROTARY = {"rotary_pos_emb_windows": "rotary_base", "rotary_pos_emb_group_method": "rotary_interleaved"}
_CONTEXT = {"context_parallel_axis": "context_parallel", "context_parallel_strategy": "cp_strategy",
            "context_parallel_causal_load_balanced": "cp_load_balanced"}

#: For each module, Transformer Engine's keyword names that te_jax spells differently: ``{TE name: te_jax name}``.
TE_NAMES: Mapping[str, Mapping[str, str]] = {
    "LayerNorm": _NORM,
    "LayerNormDenseGeneral": {**_NORM, **_LN_PARAMS, "layernorm_input_axes": "input_axes"},
    "LayerNormMLP": {**_NORM, **_LN_PARAMS, "kernel_axes_1": "wi_kernel_axes", "kernel_axes_2": "wo_kernel_axes",
                     "bias_axes_1": "wi_bias_axes", "bias_axes_2": "wo_bias_axes", "activations": "activation_type",
                     "intermediate_dropout_rng_name": "dropout_rng_name",
                     "intermediate_dropout_rate": "intermediate_dropout",
                     "intermediate_hidden_dropout_dims": "intermediate_dropout_dims"},
    "DotProductAttention": _CONTEXT,
    "MultiHeadAttention": {**_NORM, "layernorm_epsilon": "epsilon", **_ROTARY},
    "TransformerLayer": {**_NORM, "layernorm_epsilon": "epsilon", "mlp_hidden_size": "intermediate_dim",
                         "mha_kernel_init": "kernel_init", "mlp_kernel_init": "kernel_init",
                         "mlp_activations": "activation_type", "mlp_activation_params": "activation_params",
                         "relative_embedding": "relative_embedding_buckets and relative_embedding_max_distance",
                         **_ROTARY},
}

# Where the value does not carry over as it is, what it becomes.
_HOW = {
    "rotary_pos_emb_windows": "windows (1, b) are rotary_base=b",
    "rotary_pos_emb_group_method": "'consecutive' is rotary_interleaved=True, 'alternate' False",
    "relative_embedding": "give the bucket count and the maximum distance",
}


def te_names(cls):
  """Wraps a linen module's constructor (``cls.__name__`` a key of ``TE_NAMES``) so that a keyword of Transformer
  Engine's spelling raises a ``TypeError`` naming te_jax's."""
  names = TE_NAMES[cls.__name__]
  init = cls.__init__

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    for te_name in kwargs:
      if te_name in names:
        ours = names[te_name]
        how = _HOW.get(te_name, f"pass {ours}={kwargs[te_name]!r}")
        raise TypeError(f"{cls.__name__} takes {ours} where Transformer Engine's takes {te_name}: {how} "
                        "(docs/porting.md lists every argument)")
    init(self, *args, **kwargs)

  cls.__init__ = __init__
  return cls
