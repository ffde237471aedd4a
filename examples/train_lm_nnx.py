"""The byte-level language model of ``examples/train_lm.py`` in Flax NNX (te_jax.nnx.TransformerLayer), trained in
BF16 and in FP8 side by side on the same corpus and batches (``te_jax.compare.lm``'s data code). Reports the held-out
loss, tokens per second and memory of both.

The FP8 run differs from the BF16 run only in ``te_jax.autocast(enabled=True, recipe=DelayedScaling())`` around the
model's construction (which gives its layers their FP8 state) and the steps. Both differentiate with
``te_jax.nnx.value_and_grad``, which is ``nnx.value_and_grad`` that also writes the FP8 state's update into the model
(a no-op for the BF16 model, which has none); ``te_jax.nnx.calibrate`` before the first step gives the state its
first amaxes (again a no-op in BF16).

    python examples/train_lm_nnx.py                 # tiny on CPU, ~100M params on a GPU
    python examples/train_lm_nnx.py --size small --steps 30
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_jax
import te_jax.nnx as te_nnx
from te_jax import recipe
from te_jax.compare.lm import VOCAB, batches, load_corpus
from train_lm import SIZES


class LM(nnx.Module):
  """Byte embedding, pre-LN causal TransformerLayers with RoPE and GELU, a final LayerNorm, tied output head."""

  def __init__(self, hidden: int, layers: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Embed(VOCAB, hidden, embedding_init=init, rngs=rngs)
    self.layers = nnx.List([
        te_nnx.TransformerLayer(hidden, mlp, heads, layer_type="decoder", enable_rotary_pos_emb=True,
                                dtype=jnp.bfloat16, kernel_init=init, rngs=rngs) for _ in range(layers)])
    self.final_norm = te_nnx.LayerNorm(hidden, dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens).astype(jnp.bfloat16)
    for layer in self.layers:
      x = layer(x, deterministic=True)
    return self.embed.attend(self.final_norm(x).astype(jnp.float32))


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def run(rec, size, steps, lr, seed, train_data, eval_data):
  """``steps`` steps of the LM from seed ``seed``'s parameters (``rec``: the FP8 recipe, None for BF16)."""
  batch, seq, hidden, layers, heads, mlp = SIZES[size]
  fp8 = lambda: te_jax.autocast(enabled=rec is not None, recipe=rec)  # noqa: E731
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
  with fp8():
    model = LM(hidden, layers, heads, mlp, rngs=nnx.Rngs(seed))  # the same parameters in both runs
  optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, 0.01)),
                            wrt=nnx.Param)
  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = te_nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  data = batches(train_data, batch, seq, seed=1 + seed)
  times, losses = [], []
  with fp8():
    x, y = next(data)
    te_nnx.calibrate(loss_fn, model, x, y)  # FP8: the first step's scales; BF16: no state, a no-op
    for i in range(steps):
      if i:
        x, y = next(data)
      t0 = time.perf_counter()
      losses.append(float(step(model, optimizer, x, y)))  # synchronizes
      times.append(time.perf_counter() - t0)
    evaluate = nnx.jit(loss_fn)
    eval_batches = batches(eval_data, batch, seq, seed=2)
    eval_loss = float(np.mean([float(evaluate(model, *next(eval_batches))) for _ in range(8)]))
  step_s = float(np.median(times[1:] if steps > 1 else times))
  return {"train_loss": float(np.mean(losses[-max(1, steps // 10):])), "eval_loss": eval_loss,
          "tokens_per_s": batch * seq / step_s, "step_ms": 1e3 * step_s}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  size = args.size or ("large" if on_gpu else "small")
  steps = args.steps or (400 if on_gpu else 60)
  train_data, eval_data = load_corpus(32 << 20 if on_gpu else 4 << 20)
  batch, seq, hidden, layers, heads, mlp = SIZES[size]
  print(f"te_jax {te_jax.__version__} (NNX) on {jax.devices()[0].device_kind}: byte-level LM, {layers} layers x "
        f"{hidden} hidden, {heads} heads, mlp {mlp}; batch {batch} x {seq} tokens, {steps} steps, seed {args.seed}")
  results = {name: run(rec, size, steps, args.lr, args.seed, train_data, eval_data)
             for name, rec in {"BF16": None, "FP8": recipe.DelayedScaling(amax_history_len=16)}.items()}
  print("\n| run  | train loss | held-out loss | tokens/s | step (ms) |")
  print("|------|-----------:|--------------:|---------:|----------:|")
  for name, r in results.items():
    print(f"| {name:<4} | {r['train_loss']:10.4f} | {r['eval_loss']:13.4f} | {r['tokens_per_s']:8,.0f} | "
          f"{r['step_ms']:9.2f} |")
  bf16, fp8 = results["BF16"], results["FP8"]
  print(f"FP8 vs BF16: held-out loss {(fp8['eval_loss'] - bf16['eval_loss']) / bf16['eval_loss']:+.2%}, speed "
        f"{fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x"
        + ("" if on_gpu else "  (CPU: FP8 is emulated, so speed is not the point here)"))


if __name__ == "__main__":
  main()
