"""Trains the byte-level decoder LM of examples/train_lm.py (te_jax.compare.lm) sharded over every device, with the
parallelism chosen by flags: data (--dp), fully sharded data (--fsdp), tensor (--tp), sequence parallelism (--sp,
over the tensor axis) and context parallelism (--cp: the sequence sharded through the attention too, which exchanges
keys and values between the shards, --cp-strategy all_gather, ring or all_to_all, load balanced in zig-zag order), in FP8 or BF16.
The mesh is (data, fsdp, context, tensor); te_flax.logical_axis_rules maps the model's logical axis names onto it, and
the parameters, the optimizer state and each batch are laid out with NamedSharding before the jitted step runs.

    python examples/sharded_lm.py --dp 8                              # 8 devices, data parallel
    python examples/sharded_lm.py --dp 2 --fsdp 2 --tp 2 --sp         # 8 devices, every kind at once, FP8
    python examples/sharded_lm.py --tp 4 --sp --bf16 --steps 200
    python examples/sharded_lm.py --dp 2 --cp 2 --tp 2 --cp-strategy ring
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python examples/sharded_lm.py --dp 2 --tp 4

--dp x --fsdp x --cp x --tp must equal the number of devices (jax.device_count()); without --dp, data parallelism
takes the devices the others leave, so `python examples/sharded_lm.py` runs on any number. Prints the loss and tokens/s
every --log-every steps, then the held-out loss.
"""

from __future__ import annotations

import argparse
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from te_jax.compare.lm import LM, batches, load_corpus
from train_lm import SIZES

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe

RECIPES = {"delayed": lambda: recipe.DelayedScaling(amax_history_len=16), "current": recipe.Float8CurrentScaling}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dp", type=int, default=None,
                      help="data-parallel size (default: the devices that --fsdp and --tp leave)")
  parser.add_argument("--fsdp", type=int, default=1, help="fully-sharded data-parallel size (parameters sharded)")
  parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads and MLP columns sharded)")
  parser.add_argument("--sp", action="store_true", help="sequence parallelism: the residual stream's sequence "
                      "sharded over the tensor-parallel axis")
  parser.add_argument("--cp", type=int, default=1, help="context-parallel size (the sequence sharded through the "
                      "attention; tokens in zig-zag order)")
  parser.add_argument("--cp-strategy", choices=("all_gather", "ring", "all_to_all"), default="all_gather",
                      help="how the attention exchanges keys and values between the --cp shards")
  precision = parser.add_mutually_exclusive_group()
  precision.add_argument("--fp8", dest="fp8", action="store_true", default=True, help="FP8 GEMMs (the default)")
  precision.add_argument("--bf16", dest="fp8", action="store_false", help="BF16 throughout")
  parser.add_argument("--recipe", choices=sorted(RECIPES), default="delayed", help="the FP8 scaling recipe")
  parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: small on CPU)")
  parser.add_argument("--batch", type=int, default=None, help="global batch (default: the size's)")
  parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the size's)")
  parser.add_argument("--steps", type=int, default=None, help="train steps (default: 400 on GPU, 40 on CPU)")
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--log-every", type=int, default=10, help="print the loss and tokens/s every N steps")
  args = parser.parse_args(argv)

  for flag in ("dp", "fsdp", "cp", "tp", "steps", "batch", "seq", "log_every"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
  if not args.lr > 0:
    parser.error(f"--lr must be positive, got {args.lr}")
  devices = jax.device_count()
  others = args.fsdp * args.cp * args.tp
  if args.dp is None:
    if devices % others:
      parser.error(f"--fsdp {args.fsdp} x --cp {args.cp} x --tp {args.tp} = {others} does not divide the {devices} "
                   "devices (jax.device_count()): choose --fsdp, --cp and --tp (and --dp) whose product is the device "
                   "count")
    args.dp = devices // others
  if args.dp * others != devices:
    parser.error(f"--dp {args.dp} x --fsdp {args.fsdp} x --cp {args.cp} x --tp {args.tp} = {args.dp * others} devices, "
                 f"but there are {devices} (jax.device_count()): choose --dp, --fsdp, --cp and --tp whose product is "
                 f"{devices}")
  if args.sp and args.tp == 1:
    parser.error("--sp shards the sequence over the tensor-parallel axis: it needs --tp of 2 or more")
  if args.sp and args.cp > 1:
    parser.error("--sp and --cp both shard the sequence (over the tensor axis, over the context axis): give one")

  on_gpu = jax.default_backend() == "gpu"
  args.size = args.size or ("large" if on_gpu else "small")
  size_batch, size_seq, hidden, _, heads, mlp = SIZES[args.size]
  args.batch, args.seq = args.batch or size_batch, args.seq or size_seq
  args.steps = args.steps or (400 if on_gpu else 40)
  for what, size, flags, n in (("--batch", args.batch, "--dp x --fsdp", args.dp * args.fsdp),
                               ("--seq", args.seq, "--tp (with --sp)", args.tp if args.sp else 1),
                               ("--seq", args.seq, "2 x --cp (zig-zag: two chunks a device)", 2 * args.cp),
                               (f"the heads of --size {args.size}", heads, "--tp", args.tp),
                               (f"the MLP width of --size {args.size}", mlp, "--tp", args.tp),
                               (f"the hidden size of --size {args.size}", hidden, "--fsdp", args.fsdp)):
    if size % n:
      parser.error(f"{what} ({size}) must be a multiple of {flags} ({n})")
  return args


def make_mesh(args) -> tuple[Mesh, list]:
  """The (data, fsdp, context, tensor) mesh over every device and te_jax's logical axis rules for it (plus the
  embedding's "vocab" rows, not sharded: 256 bytes)."""
  mesh = Mesh(np.array(jax.devices()).reshape(args.dp, args.fsdp, args.cp, args.tp),
              ("data", "fsdp", "context", "tensor"))
  rules = te_flax.logical_axis_rules(data="data", fsdp="fsdp", tensor="tensor", sequence_parallel=args.sp,
                                     context="context" if args.cp > 1 else None)
  return mesh, rules + [("vocab", None)]


def main(argv=None):
  args = parse_args(argv)
  mesh, rules = make_mesh(args)
  _, _, hidden, layers, heads, mlp = SIZES[args.size]
  model = LM(hidden, layers, heads, mlp, logical_axes=True, context_parallel="context" if args.cp > 1 else None,
             cp_strategy=args.cp_strategy)
  rec = RECIPES[args.recipe]() if args.fp8 else None
  train_data, eval_data = load_corpus(32 << 20 if jax.default_backend() == "gpu" else 4 << 20)

  warmup = min(max(1, args.steps // 10), args.steps - 1)  # a tenth of the steps (none in a 1-step run)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  tokens = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq"), rules))  # as the residual stream

  def put(batch):  # a (tokens, labels) batch on the mesh; under --cp in zig-zag order (the loss is a mean: any order)
    return tuple(jax.device_put(te_jax.to_zigzag(a, args.cp) if args.cp > 1 else a, tokens) for a in batch)
  zeros = jnp.zeros((args.batch, args.seq), jnp.int32)

  def loss_fn(variables, x, y):
    logits = model.apply(variables, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def create(x, y, boxed=False):
    variables = model.init(jax.random.key(0), x)
    variables = variables if boxed else nn.meta.unbox(variables)
    if not boxed:  # the first step's FP8 scales from one pass over its batch (BF16: variables as they are)
      variables = te_flax.calibrate(loss_fn, variables, x, y)
    return train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

  def step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  with te_jax.autocast(enabled=rec is not None, recipe=rec), jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    # The whole train state's shardings from the parameters' logical names (the optimizer's moments carry them too),
    # then the state created directly in them: no device ever holds the whole model.
    boxed = jax.eval_shape(lambda x, y: create(x, y, boxed=True), zeros, zeros)
    state_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    data = batches(train_data, args.batch, args.seq, seed=1)
    x, y = put(next(data))
    state = jax.jit(create, out_shardings=state_sharding)(x, y)
    train = jax.jit(step, in_shardings=(state_sharding, tokens, tokens), out_shardings=(state_sharding, None),
                    donate_argnums=0)
    evaluate = jax.jit(loss_fn, in_shardings=(state_sharding.params, tokens, tokens))

    n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(boxed.params["params"]))
    print(f"te_jax {te_jax.__version__} on {jax.device_count()} x {jax.devices()[0].device_kind}: byte-level LM, "
          f"{layers} layers x {hidden} hidden, {n_params / 1e6:.1f}M params; mesh dp {args.dp} x fsdp {args.fsdp} x "
          f"cp {args.cp}{' (' + args.cp_strategy + ')' if args.cp > 1 else ''} x tp {args.tp}{' + sp' if args.sp else ''}; {'FP8 ' + args.recipe if rec else 'BF16'}; batch "
          f"{args.batch} x {args.seq} tokens, {args.steps} steps", flush=True)
    t0, losses = time.perf_counter(), []
    for i in range(args.steps):
      if i:
        x, y = put(next(data))
      state, loss = train(state, x, y)
      losses.append(float(loss))  # synchronizes
      if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
        done = (i % args.log_every) + 1
        tokens_per_s = done * args.batch * args.seq / (time.perf_counter() - t0)
        print(f"step {i + 1:5d}  loss {np.mean(losses[-done:]):.4f}  {tokens_per_s:,.0f} tokens/s"
              + ("  (with the compile)" if i + 1 == done else ""), flush=True)
        t0 = time.perf_counter()
    held_out = batches(eval_data, args.batch, args.seq, seed=2)
    eval_loss = np.mean([float(evaluate(state.params, *put(next(held_out)))) for _ in range(4)])
  print(f"held-out loss {eval_loss:.4f}")
  return losses, float(eval_loss)


if __name__ == "__main__":
  main()
