"""The Flax decoder LM of ``decoder_lm.py`` ported onto te_jax three ways, each the edit a user would make:

- ``fp8_dot_general``: Flax's layers kept; ``dot_general_cls=te_flax.Fp8DotGeneral`` given to every ``nn.Dense`` (the
  MLP's two, ``logits``) and ``qkv_dot_general_cls`` / ``out_dot_general_cls`` to the
  ``nn.MultiHeadDotProductAttention``. The parameters are the original's; the FP8 state sits in an
  ``Fp8DotGeneral_0`` under each layer.
- ``dense_general``: ``te_flax.DenseGeneral`` in place of ``nn.Dense``, under the name ``Dense`` so that Flax's
  automatic names, and therefore the checkpoints, stay the original's (``class Dense(te_flax.DenseGeneral): pass``).
  ``nn.MultiHeadDotProductAttention`` builds its ``nn.DenseGeneral`` projections itself and takes no other layer
  class, so they get ``Fp8DotGeneral`` as in the first port.
- ``fused``: the decoder block rewritten on ``te_flax.MultiHeadAttention`` (the norm fused into the QKV projection)
  and ``te_flax.LayerNormMLP`` (norm, fc1, ReLU, fc2). Not ``te_flax.TransformerLayer``: its one ``use_bias`` covers
  attention and MLP, and this model's attention has no biases while its MLP has. The parameters are in te_jax's
  layout (``self_attention``, ``mlp``); ``te_flax.flax_block_to_te`` converts the original's. Its modules name their
  axes with te_jax's logical names (``logical_axes=True``), which ``te_flax.logical_axis_rules`` maps.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp

import te_jax.flax as te_flax
from models import decoder_lm

PORTS = ("fp8_dot_general", "dense_general", "fused")

_FP8_ATTENTION = functools.partial(nn.MultiHeadDotProductAttention, qkv_dot_general_cls=te_flax.Fp8DotGeneral,
                                   out_dot_general_cls=te_flax.Fp8DotGeneral)


class Dense(te_flax.DenseGeneral):
  """``te_flax.DenseGeneral`` under ``nn.Dense``'s name, so that its automatic names (``Dense_0``) are Flax's."""


class FusedBlock(nn.Module):
  """The decoder block on te_jax's fused modules: ``x + Attn(LN(x))``, then ``x + MLP(LN(x))``, as the original."""

  config: decoder_lm.Config

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    h = te_flax.MultiHeadAttention(
        head_dim=c.qkv_dim // c.num_heads, num_attention_heads=c.num_heads, attn_mask_type="arbitrary",
        attention_dropout=c.dropout_rate, use_bias=False, dtype=c.dtype, deterministic=c.deterministic,
        logical_axes=True, name="self_attention")(x, mask=mask)  # Flax's mask convention (True = attend), te_jax's too
    x = x + nn.Dropout(rate=c.dropout_rate)(h, deterministic=c.deterministic)
    h = te_flax.LayerNormMLP(intermediate_dim=c.mlp_dim, activation_type=("relu",), intermediate_dropout=c.dropout_rate,
                             dtype=c.dtype, deterministic=c.deterministic, logical_axes=True, name="mlp")(x)
    return x + nn.Dropout(rate=c.dropout_rate)(h, deterministic=c.deterministic)


_LAYERS = {
    "bf16": {},
    "fp8_dot_general": dict(dense=functools.partial(nn.Dense, dot_general_cls=te_flax.Fp8DotGeneral),
                            attention=_FP8_ATTENTION),
    "dense_general": dict(dense=Dense, attention=_FP8_ATTENTION),
    "fused": dict(block=FusedBlock),
}


def config(name: str, *, dtype=jnp.bfloat16, **sizes) -> decoder_lm.Config:
  """The configuration of the port ``name`` (one of ``PORTS``), or of the original model for ``"bf16"``, without
  dropout (the ports' runs draw no masks; the same batches give comparable losses)."""
  if name not in _LAYERS:
    raise ValueError(f"no port {name!r}: one of {PORTS} or 'bf16'")
  return dataclasses.replace(decoder_lm.Config(dtype=dtype, **sizes), **_LAYERS[name])


def model(name: str, **kwargs) -> decoder_lm.DecoderLM:
  return decoder_lm.DecoderLM(config(name, **kwargs))


def block_paths(config: decoder_lm.Config) -> list[str]:
  """Where the decoder blocks sit in the model's parameters."""
  return [f"block_{i}" for i in range(config.num_layers)]
