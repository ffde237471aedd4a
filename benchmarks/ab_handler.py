"""The GPT layer step with every te_jax handler against the same step with some handlers left out (their ops lowered
to the pure-JAX reference), timed in alternating rounds in one process: what one handler is worth in the layer.

  python benchmarks/ab_handler.py --without te_scale_update_cuda
  python benchmarks/ab_handler.py --without te_scale_update_cuda --impl "te_jax TransformerLayer fp8" --rounds 8

Each round times each variant over ``--runs`` x 10 calls (harness.time_calls); alternating rounds spread the GPU's
clock and power drift over both. Prints each variant's per-round medians and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

import bench_transformer
import harness
from te_jax import _native


def compiled_step(model, rec, without: tuple[str, ...], x, dy, key):
  """The layer's compiled fwd+bwd and its warmed-up variables, lowered with the ``without`` targets unregistered."""
  kw = {"deterministic": True}
  saved = list(_native.registered.get("cuda", []))
  _native.registered["cuda"] = [t for t in saved if t not in without]
  try:
    fn = harness.layer_fwd_bwd(model, rec, **kw)
    variables, _ = harness.warm_layer(model, rec, fn, key, x, dy, **kw)
    compiled = fn.lower(variables, x, dy).compile()
  finally:
    _native.registered["cuda"] = saved
  text = compiled.as_text()
  missing = [t for t in without if f'custom_call_target="{t}"' in text]
  if missing:
    raise SystemExit(f"ab_handler: {missing} still in the HLO of the variant without them")
  return compiled, variables


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--without", action="append", required=True, help="an FFI target to leave out, e.g. "
                      "te_scale_update_cuda (repeatable)")
  parser.add_argument("--impl", default="te_jax TransformerLayer fp8", help="a te_jax row of bench_transformer")
  parser.add_argument("--rounds", type=int, default=6)
  parser.add_argument("--runs", type=int, default=10)
  parser.add_argument("--shrink", type=int, default=1, help="divide the dimensions by this (a quick CPU run)")
  args = parser.parse_args()
  if jax.default_backend() != "gpu" and args.shrink == 1:
    raise SystemExit("ab_handler: no GPU; the CUDA handlers do not run here (--shrink 8 for a smoke run)")
  unknown = [t for t in args.without if not _native.has_target("cuda", t)]
  if unknown:
    raise SystemExit(f"ab_handler: {unknown} not registered for cuda (registered: {_native.registered.get('cuda')})")
  c = {k: v // args.shrink if k in ("seq", "hidden", "mlp", "heads") else v
       for k, v in bench_transformer.LAYER.items()}
  impls = bench_transformer.impls(c)
  if args.impl not in impls or not args.impl.startswith("te_jax"):
    raise SystemExit(f"ab_handler: --impl must be one of the te_jax rows: {[k for k in impls if 'te_jax' in k]}")
  model, rec = impls[args.impl]
  kx, kd, ki = jax.random.split(jax.random.PRNGKey(0), 3)
  shape = (c["batch"], c["seq"], c["hidden"])
  x = jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, shape, jnp.float32).astype(jnp.bfloat16)
  label = "without " + ", ".join(args.without)
  variants = {"all handlers": compiled_step(model, rec, (), x, dy, ki),
              label: compiled_step(model, rec, tuple(args.without), x, dy, ki)}
  times = {name: [] for name in variants}
  for _ in range(args.rounds):
    for name, (fn, variables) in variants.items():
      times[name].append(harness.time_calls(fn, variables, x, dy, runs=args.runs, batch=harness.Context.batch).ms)
  print(f"{args.impl}, {args.rounds} alternating rounds of {args.runs} x {harness.Context.batch} calls")
  for name, t in times.items():
    print(f"  {name}: median {statistics.median(t):.3f} ms; rounds {', '.join(f'{v:.3f}' for v in t)}")
  ratio = statistics.median(times[label]) / statistics.median(times["all handlers"])
  print(f"  {label} / all handlers: {ratio:.4f}")


if __name__ == "__main__":
  main()
