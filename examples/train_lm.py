"""Trains a small decoder-only language model built from te_jax.flax.TransformerLayer in BF16 and in FP8 side by
side, on a real text corpus that is on every machine: the Python standard library's own source files (bytes as
tokens). Reports the held-out loss, tokens per second and memory of both.

Both runs start from the same parameters and see the same batches; the only difference is
``te_jax.autocast(enabled=..., recipe=DelayedScaling())`` around the train step.

    python examples/train_lm.py                     # sizes picked for the machine: tiny on CPU, ~120M params on a GPU
    python examples/train_lm.py --size small --steps 50
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe

SIZES = {
    # (batch, sequence, hidden, layers, heads, mlp)
    "small": (8, 128, 128, 2, 4, 512),
    "large": (16, 1024, 1024, 8, 8, 4096),
}
VOCAB = 256  # bytes


def load_corpus(limit_bytes: int) -> tuple[np.ndarray, np.ndarray]:
  """The standard library's .py files, concatenated in sorted order (the same bytes on every run): 95% to train on,
  the last 5% held out."""
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
  corpus = np.concatenate(chunks)
  split = int(len(corpus) * 0.95)
  return corpus[:split], corpus[split:]


class LM(nn.Module):
  """Byte embedding, pre-LN causal TransformerLayers with RoPE and GELU, a final LayerNorm, tied output head."""

  hidden: int
  layers: int
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, self.hidden, embedding_init=nn.initializers.normal(0.02), name="embed")
    x = embed(tokens).astype(jnp.bfloat16)
    for i in range(self.layers):
      x = te_flax.TransformerLayer(hidden_size=self.hidden, mlp_hidden_size=self.mlp, num_attention_heads=self.heads,
                                   layer_type="decoder", enable_rotary_pos_emb=True, dtype=jnp.bfloat16,
                                   kernel_init=nn.initializers.normal(0.02), name=f"layer_{i}")(x, deterministic=True)
    x = te_flax.LayerNorm(dtype=jnp.float32, name="final_norm")(x)
    return embed.attend(x.astype(jnp.float32))  # logits in float32: the head is narrow (256) and wants precision


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq - 1, batch)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def train(fp8: bool, model, params, train_data, eval_data, batch, seq, steps, lr):
  rec = recipe.DelayedScaling(amax_history_len=16) if fp8 else None
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
  with te_jax.autocast(enabled=fp8, recipe=rec):
    variables = model.init(jax.random.key(0), jnp.zeros((batch, seq), jnp.int32))
    variables = {**variables, "params": params}
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.chain(optax.clip_by_global_norm(1.0),
                                                         optax.adamw(schedule, weight_decay=0.01)))

    def loss_fn(v, x, y):
      logits = model.apply(v, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
      return state.apply_gradients(grads=grads), loss

    evaluate = jax.jit(loss_fn)
    data = batches(train_data, batch, seq, seed=1)
    x0, y0 = next(data)
    compiled = step.lower(state, x0, y0).compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    times, losses = [], []
    for i in range(steps):
      x, y = (x0, y0) if i == 0 else next(data)
      t0 = time.perf_counter()
      state, loss = step(state, x, y)
      losses.append(float(loss))  # synchronizes
      times.append(time.perf_counter() - t0)
    eval_batches = batches(eval_data, batch, seq, seed=2)
    eval_loss = float(np.mean([float(evaluate(state.params, *next(eval_batches))) for _ in range(8)]))
  step_s = float(np.median(times[1:] if steps > 1 else times))
  return {
      "train_loss": float(np.mean(losses[-max(1, steps // 10):])),
      "eval_loss": eval_loss,
      "tokens_per_s": batch * seq / step_s,
      "step_ms": 1e3 * step_s,
      "temp_mib": temp_bytes / 2**20,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--lr", type=float, default=1e-3)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  size = args.size or ("large" if on_gpu else "small")
  steps = args.steps or (400 if on_gpu else 60)
  batch, seq, hidden, layers, heads, mlp = SIZES[size]
  train_data, eval_data = load_corpus(32 << 20 if on_gpu else 4 << 20)

  model = LM(hidden, layers, heads, mlp)
  params = model.init(jax.random.key(0), jnp.zeros((batch, seq), jnp.int32))["params"]
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  print(f"te_jax {te_jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}): byte-level LM, "
        f"{layers} layers x {hidden} hidden, {heads} heads, mlp {mlp}, {n_params / 1e6:.1f}M params; batch {batch} x "
        f"{seq} tokens, {steps} steps; corpus: {len(train_data) / 1e6:.1f} MB of Python standard library source")
  results = {name: train(name == "FP8", model, params, train_data, eval_data, batch, seq, steps, args.lr)
             for name in ("BF16", "FP8")}

  print("\n| run  | train loss | held-out loss | tokens/s | step (ms) | XLA temp memory (MiB) |")
  print("|------|-----------:|--------------:|---------:|----------:|----------------------:|")
  for name, r in results.items():
    print(f"| {name:<4} | {r['train_loss']:10.4f} | {r['eval_loss']:13.4f} | {r['tokens_per_s']:8,.0f} | "
          f"{r['step_ms']:9.2f} | {r['temp_mib']:21.1f} |")
  bf16, fp8 = results["BF16"], results["FP8"]
  gap = (fp8["eval_loss"] - bf16["eval_loss"]) / bf16["eval_loss"]
  print(f"\nFP8 vs BF16: held-out loss {gap:+.2%}, speed {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x, "
        f"temp memory {fp8['temp_mib'] / max(bf16['temp_mib'], 1e-9):.2f}x"
        + ("" if on_gpu else "  (CPU: FP8 is emulated, so speed is not the point here)"))


if __name__ == "__main__":
  main()
