"""Trains the same MLP classifier in BF16 and in FP8 side by side, and reports loss, accuracy, speed and memory.

The task needs no download: labels come from a fixed random "teacher" network on Gaussian inputs, so the student
MLP has a real function to learn. Both runs start from the same parameters and see the same batches; the only
difference is ``te_jax.autocast(enabled=..., recipe=DelayedScaling())`` around the train step.

    python examples/train_mlp.py            # sizes picked for the machine: small on CPU, large on a GPU
    python examples/train_mlp.py --size small --steps 100
"""

from __future__ import annotations

import argparse
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
    # (batch, input features, hidden, layers, classes)
    "small": (512, 256, 512, 3, 16),
    "large": (16384, 4096, 8192, 3, 64),
}


class MLP(nn.Module):
  hidden: int
  layers: int
  classes: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.gelu(te_flax.DenseGeneral(self.hidden, dtype=jnp.bfloat16)(x))
    # The classifier head stays out of FP8 (16-64 classes is too narrow to gain, and logits want precision).
    return nn.Dense(self.classes, dtype=jnp.float32)(x.astype(jnp.float32))


def make_teacher(key, features, classes):
  """A fixed random two-layer tanh network whose argmax labels the inputs."""
  k1, k2 = jax.random.split(key)
  w1 = jax.random.normal(k1, (features, 256)) / np.sqrt(features)
  w2 = jax.random.normal(k2, (256, classes)) / np.sqrt(256)
  return w1, w2


def batch_of(teacher, key, batch, features):
  """A fresh batch every step (drawn on the device), so the loss measures learning, not memorising."""
  w1, w2 = teacher
  x = jax.random.normal(key, (batch, features), jnp.float32)
  y = jnp.argmax(jnp.tanh(x @ w1) @ w2, axis=-1)
  return x.astype(jnp.bfloat16), y


def train(fp8: bool, model, params, teacher, batch, features, steps, lr):
  rec = recipe.DelayedScaling(amax_history_len=16) if fp8 else None
  data_key = jax.random.key(1)
  with te_jax.autocast(enabled=fp8, recipe=rec):
    variables = model.init(jax.random.key(0), jnp.zeros((batch, features), jnp.bfloat16))
    variables = {**variables, "params": params}  # same starting point for both runs

    def loss_fn(v, x, y):
      logits = model.apply(v, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    # FP8: the first step's scales from a pass over its batch (a fresh state's scales are 1); BF16: a no-op
    variables = te_flax.calibrate(loss_fn, variables, *batch_of(teacher, jax.random.fold_in(data_key, 0), batch,
                                                                 features), has_aux=True)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adamw(lr))

    @jax.jit
    def step(state, i):
      x, y = batch_of(teacher, jax.random.fold_in(data_key, i), batch, features)
      (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
      acc = jnp.mean(jnp.argmax(logits, -1) == y)
      return state.apply_gradients(grads=grads), loss, acc

    compiled = step.lower(state, 0).compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    losses, accs, times = [], [], []
    for i in range(steps):
      t0 = time.perf_counter()
      state, loss, acc = step(state, i)
      loss = float(loss)  # synchronizes
      times.append(time.perf_counter() - t0)
      losses.append(loss)
      accs.append(float(acc))
  tail = max(1, steps // 10)
  return {
      "loss": float(np.mean(losses[-tail:])),
      "acc": float(np.mean(accs[-tail:])),
      "step_ms": 1e3 * float(np.median(times[1:] if steps > 1 else times)),  # the first call compiles
      "temp_mib": temp_bytes / 2**20,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default=None)
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--lr", type=float, default=1e-3)
  args = parser.parse_args()
  if args.steps is not None and args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")
  if not args.lr > 0:
    parser.error(f"--lr must be positive, got {args.lr}")
  on_gpu = jax.default_backend() == "gpu"
  size = args.size or ("large" if on_gpu else "small")
  steps = args.steps if args.steps is not None else (300 if on_gpu else 200)
  batch, features, hidden, layers, classes = SIZES[size]

  model = MLP(hidden, layers, classes)
  teacher = make_teacher(jax.random.key(2), features, classes)
  params = model.init(jax.random.key(0), jnp.zeros((batch, features), jnp.bfloat16))["params"]
  device = jax.devices()[0]
  print(f"te_jax {te_jax.__version__} on {device.device_kind} ({jax.default_backend()}): MLP {layers}x{hidden}, "
        f"batch {batch}, {features} features, {classes} classes, {steps} steps")
  results = {name: train(name == "FP8", model, params, teacher, batch, features, steps, args.lr)
             for name in ("BF16", "FP8")}

  print(f"\n| run  | final loss | accuracy | step (ms) | XLA temp memory (MiB) |")
  print(f"|------|-----------:|---------:|----------:|----------------------:|")
  for name, r in results.items():
    print(f"| {name:<4} | {r['loss']:10.4f} | {r['acc']:8.3f} | {r['step_ms']:9.2f} | {r['temp_mib']:21.1f} |")
  bf16, fp8 = results["BF16"], results["FP8"]
  gap = (fp8["loss"] - bf16["loss"]) / bf16["loss"]
  print(f"\nFP8 vs BF16: loss {gap:+.2%}, speed {bf16['step_ms'] / fp8['step_ms']:.2f}x, "
        f"temp memory {fp8['temp_mib'] / max(bf16['temp_mib'], 1e-9):.2f}x"
        + ("" if on_gpu else "  (CPU: FP8 is emulated, so speed is not the point here)"))


if __name__ == "__main__":
  main()
