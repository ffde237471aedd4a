"""The embedded default of ``te_jax.compare``: a byte-level decoder-only language model built from
``te_jax.flax.TransformerLayer`` (or, with ``experts``, from a mixture-of-experts layer: the same attention, a
``te_jax.flax.MoEBlock`` for the FFN), trained on a corpus that is on every machine, the Python standard library's own
source files (bytes as tokens), so nothing needs a download.

>>> train, held_out = load_corpus(1 << 16)
>>> x, y = next(batches(train, batch=2, seq=16, seed=0))
>>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
((2, 16), True)
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax.flax as te_flax
from te_jax.flax.moe import AUX_LOSS_COLLECTION

__all__ = ["LM", "MoELayer", "PRESETS", "Preset", "VOCAB", "batches", "load_corpus"]

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Preset:
  """A model size (``LM``'s fields), its batch, default step count and corpus bytes."""

  model: dict
  batch: int
  seq: int
  steps: int
  corpus_bytes: int
  lr: float = 1e-3
  distill: dict | None = None  # the student's LM fields: a BF16 teacher of ``model`` is trained first


PRESETS = {
    # ~0.4M params: two runs of 60 steps, compiles included, in about a minute on a 2-core CPU.
    "tiny": Preset(dict(hidden=128, layers=2, heads=4, mlp=512), batch=8, seq=128, steps=60, corpus_bytes=4 << 20),
    # ~85M params (12 x 768, GPT-2 small's body; the byte vocabulary has no big embedding): 16 x 1024 tokens a step,
    # so that 500 steps (8.2M tokens) stay within one pass over the standard library's ~9 MB of training bytes: past
    # one epoch the held-out loss measures overfitting, which moves by a few percent from run to run.
    "gpt-small": Preset(dict(hidden=768, layers=12, heads=12, mlp=3072), batch=16, seq=1024, steps=500,
                        corpus_bytes=32 << 20, lr=6e-4),
    # ~1.2B params: 24 x 2048 (head dim 128), 8 x 2048 tokens a step (4.9M tokens in 300 steps).
    "gpt-1b": Preset(dict(hidden=2048, layers=24, heads=16, mlp=8192), batch=8, seq=2048, steps=300,
                     corpus_bytes=64 << 20, lr=3e-4),
    # Distillation (the classic mixed-precision tutorial): a BF16 teacher of the tiny size, then FP8 and BF16
    # students of half its width learn its output distribution.
    "distill-tiny": Preset(dict(hidden=128, layers=2, heads=4, mlp=512), batch=8, seq=128, steps=40,
                           corpus_bytes=4 << 20, distill=dict(hidden=64, layers=2, heads=4, mlp=256)),
    # Mixture of experts, Mixtral's FFN (8 SwiGLU experts, top 2, the chosen weights renormalized) in gpt-small's
    # body and batches. FLOPs per token match gpt-small's: a SwiGLU expert of width F costs 3 * 768 * F
    # multiply-adds a token and each token runs 2 of them, 6 * 768 * F, which equals the dense GELU MLP's
    # 2 * 768 * 3072 at F = 1024 (the router's 768 x 8 adds 0.1%). ~255M params, 19M of them per layer's experts.
    # TE_JAX_GROUPED_GEMM=cuda runs the FP8 expert GEMMs on te_jax's grouped GEMM kernel (default: per-expert GEMMs
    # through XLA).
    "moe": Preset(dict(hidden=768, layers=12, heads=12, mlp=1024, experts=8, top_k=2), batch=16, seq=1024,
                  steps=500, corpus_bytes=32 << 20, lr=6e-4),
    # The same on a CPU: tiny's attention, 4 experts of width 128 (top 2: 3/4 of tiny's MLP FLOPs), in about a
    # minute on 2 cores.
    "moe-tiny": Preset(dict(hidden=128, layers=2, heads=4, mlp=128, experts=4, top_k=2), batch=8, seq=128,
                       steps=60, corpus_bytes=4 << 20),
}


def load_corpus(limit_bytes: int) -> tuple[np.ndarray, np.ndarray]:
  """The standard library's .py files (tests and site-packages left out), concatenated in sorted order (the same
  bytes on every run) up to ``limit_bytes``: 95% to train on, the last 5% held out."""
  if limit_bytes < 1:
    raise ValueError(f"load_corpus: limit_bytes must be positive, got {limit_bytes}")
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if "test" in path.parts or "site-packages" in path.parts:
      continue
    try:
      data = path.read_bytes()
    except OSError:
      continue
    chunks.append(np.frombuffer(data, np.uint8))
    total += len(data)
    if total >= limit_bytes:
      break
  if not chunks:
    raise FileNotFoundError(f"load_corpus: no .py files under the standard library's folder {root}")
  corpus = np.concatenate(chunks)
  split = int(len(corpus) * 0.95)
  return corpus[:split], corpus[split:]


class MoELayer(nn.Module):
  """A pre-LN causal layer with a mixture-of-experts FFN: ``x + Attn(LN(x))`` as ``TransformerLayer`` computes it
  (its self attention, ``te_jax.flax.MultiHeadAttention`` with the input LayerNorm fused and the residual added in
  the output projection's epilogue, under the same name and options), then ``x + MoE(LN(x))``: a
  ``te_jax.flax.MoEBlock`` of ``experts`` SwiGLU experts of width ``mlp``, ``top_k`` of them per token with their
  weights renormalized (Mixtral's), the LayerNorm its pre-norm (the dense layer's norm type and epsilon).

  The block's auxiliary losses (the load-balancing loss and the router z-loss, each times its coefficient) are sown
  into the ``"aux_loss"`` collection. The layer trains (``deterministic=False``: the losses must be collected) when
  it is applied with that collection mutable, as ``te_jax.compare``'s train step applies it, and evaluates otherwise
  (the losses dropped, as the held-out loss is the cross-entropy alone).
  """

  hidden: int
  heads: int
  mlp: int
  experts: int
  top_k: int = 2
  load_balancing_coef: float = 1e-2
  z_loss_coef: float = 1e-3
  kernel_init: nn.initializers.Initializer = nn.initializers.normal(0.02)
  logical_axes: bool = False
  context_parallel: str | None = None
  cp_strategy: str = "all_gather"
  cp_load_balanced: bool = True

  @nn.compact
  def __call__(self, x, positions=None):
    def stream(x):
      return nn.with_logical_constraint(x, ("batch", "seq", "act_embed")) if self.logical_axes else x

    attention = te_flax.MultiHeadAttention(
        head_dim=self.hidden // self.heads, num_attention_heads=self.heads, input_layernorm=True,
        attn_mask_type="causal", enable_rotary_pos_emb=True, kernel_init=self.kernel_init,
        logical_axes=self.logical_axes, dtype=jnp.bfloat16, context_parallel=self.context_parallel,
        cp_strategy=self.cp_strategy, cp_load_balanced=self.cp_load_balanced, name="self_attention")
    x = stream(attention(x, positions=positions, deterministic=True, residual=x))
    moe = te_flax.MoEBlock(num_experts=self.experts, k=self.top_k, intermediate_dim=self.mlp,
                           activation_type=("silu", "linear"), normalize_topk=True, norm_type="layernorm",
                           load_balancing_coef=self.load_balancing_coef, z_loss_coef=self.z_loss_coef,
                           kernel_init=self.kernel_init, logical_axes=self.logical_axes, dtype=jnp.bfloat16,
                           name="moe")
    training = self.is_mutable_collection(AUX_LOSS_COLLECTION)
    return stream(x + moe(x, deterministic=not training))


class LM(nn.Module):
  """Byte embedding, pre-LN causal TransformerLayers with RoPE and GELU, a final LayerNorm, tied output head; with
  ``experts``, ``MoELayer``s instead (the same attention, a mixture of ``experts`` SwiGLU experts of width ``mlp``,
  ``top_k`` per token, for the FFN).

  >>> import jax, jax.numpy as jnp
  >>> model = LM(hidden=32, layers=1, heads=2, mlp=64)
  >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  >>> sorted(variables["params"])
  ['embed', 'final_norm', 'layer_0']

  With ``logical_axes`` every parameter and the residual stream carry logical axis names (te_jax's, and "vocab" for
  the embedding's rows), for ``te_jax.flax.logical_axis_rules`` (examples/sharded_lm.py).

  With ``context_parallel`` (a mesh axis of the mesh in context) the self attention runs context parallel
  (``te_jax.context_parallel_attention``, ``cp_strategy``), load balanced: the tokens must come in zig-zag order
  (``te_jax.to_zigzag(tokens, cp)``, the labels likewise), and RoPE takes their positions from
  ``te_jax.zigzag_order``. The logits come out in the same order.
  """

  hidden: int
  layers: int
  heads: int
  mlp: int
  experts: int = 0  # 0: the dense MLP
  top_k: int = 2
  logical_axes: bool = False
  context_parallel: str | None = None
  cp_strategy: str = "all_gather"

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    if self.logical_axes:
      init = nn.with_logical_partitioning(init, ("vocab", "embed"))
    embed = nn.Embed(VOCAB, self.hidden, embedding_init=init, name="embed")
    x = embed(tokens).astype(jnp.bfloat16)
    if self.logical_axes:
      x = nn.with_logical_constraint(x, ("batch", "seq", "act_embed"))
    positions, cp = None, {}
    if self.context_parallel is not None:
      mesh = jax.sharding.get_abstract_mesh()
      if self.context_parallel not in mesh.axis_names:
        raise ValueError(f"LM.context_parallel={self.context_parallel!r} is not an axis of the mesh in context (axes "
                         f"{mesh.axis_names}): call the model inside `with jax.set_mesh(mesh):`")
      devices = mesh.shape[self.context_parallel]
      positions = jnp.asarray(te_jax.zigzag_order(tokens.shape[1], devices))
      cp = dict(context_parallel=self.context_parallel, cp_strategy=self.cp_strategy, cp_load_balanced=True)
    if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
      raise ValueError(f"LM: experts must be 0 (dense) or a positive int with 1 <= top_k <= experts, got experts="
                       f"{self.experts!r}, top_k={self.top_k!r}")
    for i in range(self.layers):
      if self.experts:
        x = MoELayer(hidden=self.hidden, heads=self.heads, mlp=self.mlp, experts=self.experts, top_k=self.top_k,
                     logical_axes=self.logical_axes, name=f"layer_{i}", **cp)(x, positions=positions)
        continue
      x = te_flax.TransformerLayer(hidden_size=self.hidden, intermediate_dim=self.mlp, num_attention_heads=self.heads,
                                   layer_type="decoder", enable_rotary_pos_emb=True, dtype=jnp.bfloat16,
                                   kernel_init=nn.initializers.normal(0.02), logical_axes=self.logical_axes,
                                   name=f"layer_{i}", **cp)(x, positions=positions, deterministic=True)
    x = te_flax.LayerNorm(dtype=jnp.float32, name="final_norm")(x)
    return embed.attend(x.astype(jnp.float32))  # logits in float32: the head is narrow (256) and wants precision


def batches(data: np.ndarray, batch: int, seq: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless ``(tokens, next tokens)`` pairs of shape ``(batch, seq)``, from windows at random offsets of ``data``."""
  if len(data) <= seq + 1:
    raise ValueError(f"batches: data has {len(data)} tokens, fewer than seq + 2 = {seq + 2}")
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq - 1, batch)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]
