"""te_jax's three ports of Flax's lm1b model (``lm1b/models.py``, vendored unmodified), each the change a user would
make to that file, applied to a fresh copy of the module by replacing the names its code looks up when it runs:

- ``fp8_dot_general``: Flax's layers kept; ``dot_general_cls=te_flax.Fp8DotGeneral`` given to every ``nn.Dense``
  (the MLP's two, ``logitdense``) and ``qkv_dot_general_cls`` / ``out_dot_general_cls`` to the
  ``nn.MultiHeadDotProductAttention`` (the edit: those keyword arguments in four calls). The parameters are the
  original's; the FP8 state sits in an ``Fp8DotGeneral_0`` under each layer.
- ``dense_general``: ``te_flax.DenseGeneral`` in place of ``nn.Dense``, under the name ``Dense`` so that Flax's
  automatic names, and therefore the checkpoints, stay the original's (the edit: ``class Dense(te_flax.DenseGeneral):
  pass`` and ``nn.Dense`` -> ``Dense``). ``nn.MultiHeadDotProductAttention`` builds its ``nn.DenseGeneral``
  projections itself and takes no other layer class, so they get ``Fp8DotGeneral`` as in the first port.
- ``fused``: ``EncoderDecoder1DBlock`` rewritten on ``te_flax.MultiHeadAttention`` (the norm fused into the QKV
  projection) and ``te_flax.LayerNormMLP`` (norm, fc1, relu, fc2). Not ``te_flax.TransformerLayer``: its one
  ``use_bias`` covers attention and MLP, and lm1b's attention has no biases while its MLP has. The parameters are in
  te_jax's layout (``self_attention``, ``mlp``); ``te_flax.flax_block_to_te`` converts the original's.

Each port is a module object with the original's names (``TransformerConfig``, ``TransformerLM``, ...).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import types
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import te_jax.flax as te_flax

MODELS_PY = pathlib.Path(__file__).resolve().parent / "lm1b" / "models.py"
PORTS = ("fp8_dot_general", "dense_general", "fused")


def _fresh_models(name: str) -> types.ModuleType:
  """A new copy of the vendored models.py, as its own module object (the ports edit their copy, never the original)."""
  spec = importlib.util.spec_from_file_location(f"lm1b_models_{name}", MODELS_PY)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _linen(**replaced) -> types.SimpleNamespace:
  """``flax.linen`` with some names replaced: what ``nn.X`` means inside a port's copy of models.py."""
  return types.SimpleNamespace(**{**{k: getattr(nn, k) for k in dir(nn) if not k.startswith("__")}, **replaced})


_FP8_ATTENTION = functools.partial(nn.MultiHeadDotProductAttention, qkv_dot_general_cls=te_flax.Fp8DotGeneral,
                                   out_dot_general_cls=te_flax.Fp8DotGeneral)


class Dense(te_flax.DenseGeneral):
  """``te_flax.DenseGeneral`` under ``nn.Dense``'s name, so that its automatic names (``Dense_0``) are Flax's."""


class EncoderDecoder1DBlock(nn.Module):
  """lm1b's decoder block on te_jax's fused modules: ``x + Attn(LN(x))``, then ``x + MLP(LN(x))``, as the original."""

  config: Any

  @nn.compact
  def __call__(self, inputs, decoder_mask=None, encoder_decoder_mask=None):
    del encoder_decoder_mask  # a decoder-only LM, as in the original
    config = self.config
    assert inputs.ndim == 3
    mask = decoder_mask  # Flax's convention (1 = attend), te_jax's default too: passed as it is
    x = te_flax.MultiHeadAttention(
        head_dim=config.qkv_dim // config.num_heads, num_attention_heads=config.num_heads,
        attn_mask_type="causal" if mask is None else "arbitrary", attention_dropout=config.attention_dropout_rate,
        use_bias=False, kernel_init=config.kernel_init, dtype=config.dtype, deterministic=config.deterministic,
        name="self_attention")(inputs, mask=mask, decode=config.decode)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x + inputs
    z = te_flax.LayerNormMLP(
        intermediate_dim=config.mlp_dim, activation_type=("relu",), intermediate_dropout=config.dropout_rate,
        kernel_init=config.kernel_init, bias_init=config.bias_init, dtype=config.dtype,
        deterministic=config.deterministic, name="mlp")(x)
    z = nn.Dropout(rate=config.dropout_rate)(z, deterministic=config.deterministic)
    return x + z


def port(name: str) -> types.ModuleType:
  """The port ``name`` (one of ``PORTS``), or the original model for ``"bf16"``: a module like models.py."""
  models = _fresh_models(name)
  if name == "fp8_dot_general":
    models.nn = _linen(Dense=functools.partial(nn.Dense, dot_general_cls=te_flax.Fp8DotGeneral),
                       MultiHeadDotProductAttention=_FP8_ATTENTION)
  elif name == "dense_general":
    models.nn = _linen(Dense=Dense, MultiHeadDotProductAttention=_FP8_ATTENTION)
  elif name == "fused":
    models.EncoderDecoder1DBlock = EncoderDecoder1DBlock
  elif name != "bf16":
    raise ValueError(f"no port {name!r}: one of {PORTS} or 'bf16'")
  return models


def block_paths(config) -> list[str]:
  """Where the decoder blocks sit in the model's parameters (lm1b's names)."""
  return [f"decoder/encoderdecoderblock_{i}" for i in range(config.num_layers)]


def config(models: types.ModuleType, *, vocab_size: int = 256, dtype=jnp.bfloat16, **sizes):
  """A training configuration of ``models`` without dropout (the ports' runs draw no masks; the same batches give
  comparable losses)."""
  return models.TransformerConfig(vocab_size=vocab_size, output_vocab_size=vocab_size, dtype=dtype, dropout_rate=0.0,
                                  attention_dropout_rate=0.0, deterministic=True, **sizes)
