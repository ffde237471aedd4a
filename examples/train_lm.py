"""Trains a small decoder-only language model built from te_jax.flax.TransformerLayer in BF16 and in FP8 side by
side, on a real text corpus that is on every machine: the Python standard library's own source files (bytes as
tokens). Reports the held-out loss, tokens per second and memory of both.

Both runs start from the same parameters and see the same batches; the only difference is
``te_jax.autocast(enabled=..., recipe=DelayedScaling())`` around the train step, and ``te_jax.flax.calibrate`` before
the first step (which gives the FP8 state its first amaxes; it returns BF16 variables as they are).

    python examples/train_lm.py                     # sizes picked for the machine: tiny on CPU, ~100M params on a GPU
    python examples/train_lm.py --size small --steps 50
    python examples/train_lm.py --seeds 3 --fast-accumulation   # mean of 3 seeds; one more FP8 run, fast accumulation
    python examples/train_lm.py --seeds 3 --first-seed 3          # the same with seeds 3, 4 and 5
    python examples/train_lm.py --fresh-state       # one more FP8 run, without te_flax.calibrate before the first step

A single short run's loss gap moves by a few percent with the seed (the loss still falls fast at a few hundred steps),
so compare means over seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
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
  """Byte embedding, pre-LN causal TransformerLayers with RoPE and GELU, a final LayerNorm, tied output head.

  With ``logical_axes`` every parameter and the residual stream carry logical axis names (te_jax's, and "vocab" for
  the embedding's rows), for ``te_flax.logical_axis_rules`` (examples/sharded_lm.py)."""

  hidden: int
  layers: int
  heads: int
  mlp: int
  logical_axes: bool = False

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    if self.logical_axes:
      init = nn.with_logical_partitioning(init, ("vocab", "embed"))
    embed = nn.Embed(VOCAB, self.hidden, embedding_init=init, name="embed")
    x = embed(tokens).astype(jnp.bfloat16)
    if self.logical_axes:
      x = nn.with_logical_constraint(x, ("batch", "seq", "act_embed"))
    for i in range(self.layers):
      x = te_flax.TransformerLayer(hidden_size=self.hidden, intermediate_dim=self.mlp, num_attention_heads=self.heads,
                                   layer_type="decoder", enable_rotary_pos_emb=True, dtype=jnp.bfloat16,
                                   kernel_init=nn.initializers.normal(0.02), logical_axes=self.logical_axes,
                                   name=f"layer_{i}")(x, deterministic=True)
    x = te_flax.LayerNorm(dtype=jnp.float32, name="final_norm")(x)
    return embed.attend(x.astype(jnp.float32))  # logits in float32: the head is narrow (256) and wants precision


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq - 1, batch)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def trainer(rec, model, batch, seq, steps, lr, calibrate=True):
  """The compiled train step of one run (``rec``: its FP8 recipe, None for BF16), a maker of its start state from
  parameters and the first batch (``calibrate``: through ``te_flax.calibrate``), its compiled loss, and the step's XLA
  temp memory. Compiled once, run for every seed."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  zeros = jnp.zeros((batch, seq), jnp.int32)

  def fp8():
    return te_jax.autocast(enabled=rec is not None, recipe=rec)

  with fp8():
    variables = model.init(jax.random.key(0), zeros)  # the FP8 state (if any) starts fresh in every run

  def loss_fn(v, x, y):
    logits = model.apply(v, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def new_state(params, x, y):
    with fp8():  # FP8: the first step's scales from a pass over its batch (a fresh state's are 1); BF16: a no-op
      v = {**variables, "params": params}
      v = te_flax.calibrate(loss_fn, v, x, y) if calibrate else v
    return train_state.TrainState.create(apply_fn=model.apply, params=v, tx=tx)

  def step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
  with fp8():
    step = jax.jit(step).lower(state, zeros, zeros).compile()
    evaluate = jax.jit(loss_fn).lower(state.params, zeros, zeros).compile()
  return new_state, step, evaluate, step.memory_analysis().temp_size_in_bytes


def train(run, params, train_data, eval_data, batch, seq, steps, seed):
  """``steps`` steps of ``run`` (a ``trainer``) from ``params`` on the batches of ``seed``."""
  new_state, step, evaluate, temp_bytes = run
  data = batches(train_data, batch, seq, seed=1 + seed)
  x, y = next(data)
  state = new_state(params, x, y)
  times, losses = [], []
  for i in range(steps):
    if i:
      x, y = next(data)
    t0 = time.perf_counter()
    state, loss = step(state, x, y)
    losses.append(float(loss))  # synchronizes
    times.append(time.perf_counter() - t0)
  eval_batches = batches(eval_data, batch, seq, seed=2)  # the same held-out batches for every run and seed
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
  parser.add_argument("--seeds", type=int, default=1,
                      help="repeat with this many seeds (parameter init and batch order); the table shows means")
  parser.add_argument("--first-seed", type=int, default=0,
                      help="the seeds are first-seed, first-seed + 1, ...: new seeds for a second sample")
  parser.add_argument("--fast-accumulation", action="store_true",
                      help="also train with FP8 fast accumulation in all three GEMMs of each layer")
  parser.add_argument("--fresh-state", action="store_true",
                      help="also train FP8 without te_flax.calibrate: the first step with a fresh state's scales of 1")
  args = parser.parse_args()
  if args.steps is not None and args.steps < 1:
    parser.error(f"--steps must be at least 1, got {args.steps}")
  if not args.lr > 0:
    parser.error(f"--lr must be positive, got {args.lr}")
  if args.seeds < 1:
    parser.error(f"--seeds must be at least 1, got {args.seeds}")
  if args.first_seed < 0:
    parser.error(f"--first-seed must be at least 0, got {args.first_seed}")
  seeds = range(args.first_seed, args.first_seed + args.seeds)
  on_gpu = jax.default_backend() == "gpu"
  size = args.size or ("large" if on_gpu else "small")
  steps = args.steps if args.steps is not None else (400 if on_gpu else 60)
  batch, seq, hidden, layers, heads, mlp = SIZES[size]
  train_data, eval_data = load_corpus(32 << 20 if on_gpu else 4 << 20)

  model = LM(hidden, layers, heads, mlp)
  init = {s: model.init(jax.random.key(s), jnp.zeros((batch, seq), jnp.int32))["params"] for s in seeds}
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(init[seeds[0]]))
  print(f"te_jax {te_jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}): byte-level LM, "
        f"{layers} layers x {hidden} hidden, {heads} heads, mlp {mlp}, {n_params / 1e6:.1f}M params; batch {batch} x "
        f"{seq} tokens, {steps} steps, seed(s) {seeds[0]}-{seeds[-1]}; corpus: {len(train_data) / 1e6:.1f} MB of "
        "Python standard library source")
  delayed = recipe.DelayedScaling(amax_history_len=16)
  recipes = {"BF16": None, "FP8": delayed}
  if args.fast_accumulation:
    fast = recipe.MMParams(use_split_accumulator=False)
    recipes["FP8 fast"] = dataclasses.replace(delayed, fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast)
  if args.fresh_state:
    recipes["FP8 fresh"] = delayed
  per_seed = {}
  for name, rec in recipes.items():
    run = trainer(rec, model, batch, seq, steps, args.lr, calibrate=name != "FP8 fresh")
    per_seed[name] = [train(run, init[s], train_data, eval_data, batch, seq, steps, s) for s in seeds]
  results = {name: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for name, rs in per_seed.items()}

  print("\n| run       | train loss | held-out loss | tokens/s | step (ms) | XLA temp memory (MiB) |")
  print("|-----------|-----------:|--------------:|---------:|----------:|----------------------:|")
  for name, r in results.items():
    print(f"| {name:<9} | {r['train_loss']:10.4f} | {r['eval_loss']:13.4f} | {r['tokens_per_s']:8,.0f} | "
          f"{r['step_ms']:9.2f} | {r['temp_mib']:21.1f} |")
  bf16 = results["BF16"]
  for name in recipes:
    if name == "BF16":
      continue
    r = results[name]
    gaps = [(f["eval_loss"] - b["eval_loss"]) / b["eval_loss"] for f, b in zip(per_seed[name], per_seed["BF16"])]
    spread = f" (per seed: {', '.join(f'{g:+.2%}' for g in gaps)})" if len(gaps) > 1 else ""
    memory = r["temp_mib"] / max(bf16["temp_mib"], 1e-9)
    print(f"{name} vs BF16: held-out loss {float(np.mean(gaps)):+.2%}{spread}, speed "
          f"{r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x, temp memory {memory:.2f}x"
          + ("" if on_gpu else "  (CPU: FP8 is emulated, so speed is not the point here)"))


if __name__ == "__main__":
  main()
