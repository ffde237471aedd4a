"""A pre-LN decoder-only language model written with Flax's own layers, the kind of model a te_jax user starts from.

Tokens are embedded (``nn.Embed``), sinusoidal positions added (Vaswani et al. 2017, section 3.5: ``PE(p, 2i) =
sin(p / 10000^(2i/d))``, ``PE(p, 2i+1) = cos(...)``), then ``num_layers`` blocks of ``x + Attn(LN(x))`` and ``x +
MLP(LN(x))`` (``nn.MultiHeadDotProductAttention`` with a mask in Flax's convention, True = attend: causal and not
padding; an ``nn.Dense``-ReLU-``nn.Dense`` MLP), a final ``nn.LayerNorm`` and an ``nn.Dense`` onto the vocabulary.
Every parameter names its logical axes (``nn.with_logical_partitioning``), as a model written for sharding does.

Token 0 is padding: the model predicts token ``t`` from the tokens before it (its input is the tokens shifted right
by one, a 0 in front), and a position whose target is 0 attends nowhere and is left out of the loss.

The classes the model builds its projections, attention and blocks from are fields of its ``Config``: the ports
(``decoder_lm_ports.py``) swap them for te_jax's, as a user's edit of such a model would.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

_xavier = nn.initializers.xavier_uniform()
_zeros = nn.initializers.zeros_init()
_ones = nn.initializers.ones_init()


def logical(init, *axes):
  return nn.with_logical_partitioning(init, axes)


@dataclasses.dataclass(frozen=True)
class Config:
  """The model's sizes, dtype and layer classes.

  Attributes:
    dense: the class of every ``nn.Dense``-like projection (the MLP's two, the logits).
    attention: the class of the self-attention, called as ``nn.MultiHeadDotProductAttention`` is.
    block: the class of a decoder block, ``block(config=...)(x, mask)``; ``None`` is ``DecoderBlock``.
  """

  vocab_size: int = 256
  emb_dim: int = 64
  num_heads: int = 4
  qkv_dim: int = 64
  mlp_dim: int = 128
  num_layers: int = 1
  max_len: int = 32
  dtype: Any = jnp.bfloat16
  dropout_rate: float = 0.0
  deterministic: bool = True
  dense: Callable[..., nn.Module] = nn.Dense
  attention: Callable[..., nn.Module] = nn.MultiHeadDotProductAttention
  block: Callable[..., nn.Module] | None = None


def sinusoids(length: int, dim: int) -> np.ndarray:
  """(length, dim) float32 position encodings: sines at the even features, cosines at the odd ones."""
  position = np.arange(length, dtype=np.float64)[:, None]
  frequency = np.power(10000.0, -np.arange(0, dim, 2, dtype=np.float64) / dim)[None, :]
  table = np.zeros((length, dim))
  table[:, 0::2] = np.sin(position * frequency)
  table[:, 1::2] = np.cos(position * frequency[:, : dim // 2])
  return table.astype(np.float32)


class MlpBlock(nn.Module):
  """``Dense(mlp_dim)``, ReLU, dropout, ``Dense(emb_dim)``, with biases."""

  config: Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    h = c.dense(c.mlp_dim, dtype=c.dtype, kernel_init=logical(_xavier, "embed", "mlp"),
                bias_init=logical(_zeros, "mlp"))(x)
    h = nn.Dropout(rate=c.dropout_rate)(nn.relu(h), deterministic=c.deterministic)
    return c.dense(x.shape[-1], dtype=c.dtype, kernel_init=logical(_xavier, "mlp", "embed"),
                   bias_init=logical(_zeros, "embed"))(h)


def layer_norm(c: Config, name: str | None = None) -> nn.LayerNorm:
  return nn.LayerNorm(dtype=c.dtype, scale_init=logical(_ones, "embed"), bias_init=logical(_zeros, "embed"), name=name)


class DecoderBlock(nn.Module):
  """``x + Attn(LN(x))``, then ``x + MLP(LN(x))``; the attention without biases, the MLP with them. Its submodules
  keep Flax's automatic names (``LayerNorm_0``, ``MultiHeadDotProductAttention_0``, ``LayerNorm_1``, ``MlpBlock_0``),
  the layout ``te_jax.flax.FlaxLayout`` assumes by default."""

  config: Config

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    # nn.MultiHeadDotProductAttention calls its initializers on the flattened 2-D shapes, (embed, heads * kv) and
    # (heads * kv, embed), and reshapes the result: the names are the flat shape's. Heads being the major part of the
    # flat axis, the two names put on the 3-D kernels shard their heads axis.
    h = c.attention(num_heads=c.num_heads, qkv_features=c.qkv_dim, dtype=c.dtype, use_bias=False,
                    kernel_init=logical(_xavier, "embed", "heads"),
                    out_kernel_init=logical(_xavier, "heads", "embed"), dropout_rate=c.dropout_rate,
                    deterministic=c.deterministic)(layer_norm(c)(x), mask=mask)
    x = x + nn.Dropout(rate=c.dropout_rate)(h, deterministic=c.deterministic)
    h = MlpBlock(config=c)(layer_norm(c)(x))
    return x + nn.Dropout(rate=c.dropout_rate)(h, deterministic=c.deterministic)


class DecoderLM(nn.Module):
  """(batch, length) int tokens -> (batch, length, vocab_size) logits of each next token."""

  config: Config

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    if tokens.ndim != 2 or tokens.shape[1] > c.max_len:
      raise ValueError(f"tokens must be (batch, length <= {c.max_len}), got {tokens.shape}")
    inputs = jnp.pad(tokens, ((0, 0), (1, 0)))[:, :-1]
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens))
    x = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=logical(nn.initializers.normal(1.0), "vocab", "embed"),
                 name="embed")(inputs)
    x = x + sinusoids(c.max_len, c.emb_dim)[None, : tokens.shape[1]]
    x = nn.Dropout(rate=c.dropout_rate)(x, deterministic=c.deterministic).astype(c.dtype)
    block = c.block or DecoderBlock
    for i in range(c.num_layers):
      x = block(config=c, name=f"block_{i}")(x, mask)
    x = layer_norm(c, name="final_norm")(x)
    return c.dense(c.vocab_size, dtype=c.dtype, kernel_init=logical(_xavier, "embed", "vocab"),
                   bias_init=logical(_zeros, "vocab"), name="logits")(x)
