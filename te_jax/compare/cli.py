"""``python -m te_jax.compare`` (``te-jax-compare``): BF16 against FP8 side by side on the embedded byte-level LM
(``--preset``) or on the user's own Flax model (``--module path:attr``), with a table, plots and a JSON report."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from te_jax import recipe as te_recipe
from te_jax._core import determinism
from te_jax._core.autocast import autocast
from te_jax.compare import lm, report
from te_jax.compare.api import RECIPES, Interrupted, emulation_note, run
from te_jax.compare.train import Run, train_run

__all__ = ["console_main", "load_model_fn", "main"]


def load_model_fn(spec: str):
  """``path/to/file.py:attr`` or ``package.module:attr`` -> the object ``attr`` names there (a ``model_fn``)."""
  path, sep, attr = spec.rpartition(":")
  if not sep or not path or not attr:
    raise ValueError(f"--module must be path:attr (a file or module, then the model_fn's name), got {spec!r}")
  if path.endswith(".py"):
    file = pathlib.Path(path)
    if not file.is_file():
      raise FileNotFoundError(f"--module: no file {path}")
    loaded = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(loaded)
    sys.modules[file.stem] = module
    loaded.loader.exec_module(module)
  else:
    module = importlib.import_module(path)
  if not hasattr(module, attr):
    raise AttributeError(f"--module: {path} has no attribute {attr!r}")
  return getattr(module, attr)


def _distill_loss(outputs, batch):
  """Cross-entropy against the teacher's distribution ``batch[2]`` (its logits)."""
  targets = jax.nn.softmax(batch[2].astype(jnp.float32), axis=-1)
  return optax.softmax_cross_entropy(outputs.astype(jnp.float32), targets).mean()


def _parser():
  parser = argparse.ArgumentParser(prog="python -m te_jax.compare", description=__doc__.splitlines()[0])
  parser.add_argument("--preset", choices=sorted(lm.PRESETS), default=None,
                      help="the embedded LM's size: tiny (CPU, about a minute), gpt-small and gpt-1b (GPU), "
                           "distill-tiny (a BF16 teacher, then FP8 and BF16 students), moe (GPU) and moe-tiny (CPU): "
                           "mixture-of-experts FFNs (Mixtral's: SwiGLU experts, top 2); default: tiny on CPU, "
                           "gpt-small on a GPU")
  parser.add_argument("--module", default=None, metavar="PATH:ATTR",
                      help="your own model instead: a model_fn(fp8: bool) returning a Flax module that takes the "
                           "LM's (batch, seq) int32 byte tokens and returns (batch, seq, 256) logits")
  parser.add_argument("--recipe", choices=sorted(RECIPES), default="delayed", help="the FP8 run's recipe")
  parser.add_argument("--fast-accumulation", action="store_true",
                      help="the FP8 run's dgrad and wgrad GEMMs with Hopper's fast FP8 accumulation (the recipe's "
                           "fp8_gemm_dgrad and fp8_gemm_wgrad with use_split_accumulator=False); default: full "
                           "float32 accumulation there")
  parser.add_argument("--amax-history-len", type=int, default=None, metavar="N",
                      help="delayed scaling's amax history length (default: the recipe's, 1024): how many steps a "
                           "tensor's scale remembers its largest value")
  parser.add_argument("--steps", type=int, default=None, help="train steps of each run (default: the preset's)")
  parser.add_argument("--batch", type=int, default=None, help="sequences per batch (default: the preset's)")
  parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the preset's)")
  parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
  parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
  parser.add_argument("--evals", type=int, default=10, help="held-out evaluations along each run")
  parser.add_argument("--health", type=int, default=5, help="how many steps take the FP8 health counters, spread over the run (at most every other step, "
                      "so that the others are timed; 0: none)")
  parser.add_argument("--seed", type=int, default=0, help="the initial parameters' and the batches' seed")
  parser.add_argument("--seeds", type=int, default=1, metavar="N",
                      help="compare N times, with seeds --seed to --seed + N - 1 (each report in seed-<n>/ under "
                           "--out, then seeds.json and a table of the means): a held-out difference of a percent needs "
                           "it, as runs of one seed vary by a few percent on a GPU")
  parser.add_argument("--out", default=None, help="the report's folder (default: a fresh compare-<date> folder)")
  parser.add_argument("--deterministic", action="store_true",
                      help="repeatable runs: the same seed gives the same bits on the same machine (te_jax's GEMMs "
                           "untimed, XLA's deterministic ops; slower)")
  return parser


def fp8_recipe(name: str, fast_accumulation: bool = False, amax_history_len: int | None = None) -> te_recipe.Recipe:
  """The FP8 run's recipe: ``RECIPES[name]`` with its defaults, or with fast accumulation in all three GEMMs, or (delayed
  scaling) another amax history length.

  >>> fp8_recipe("delayed", fast_accumulation=True).fp8_gemm_wgrad.use_split_accumulator
  False
  >>> fp8_recipe("delayed", amax_history_len=16).amax_history_len
  16
  """
  recipe = RECIPES[name]() if amax_history_len is None else RECIPES[name](amax_history_len=amax_history_len)
  if fast_accumulation:
    fast = te_recipe.MMParams(use_split_accumulator=False)
    recipe = dataclasses.replace(recipe, fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast)
  return recipe


def health_every(steps: int, count: int) -> int:
  """The period of ``--health count`` health steps over ``steps``: at least 2, so that the steps between them are
  timed (0: none)."""
  return max(2, steps // count) if count else 0


def main(argv: list[str] | None = None) -> dict:
  """The command line: ``argv`` (default ``sys.argv[1:]``) parsed as ``python -m te_jax.compare --help`` shows; runs
  the comparison, prints its table and the report's folder last, and returns the report (``run``'s), or with
  ``--seeds`` N > 1 the summary over the seeds (``report.seeds_summary``, with each seed's report under "reports")."""
  parser = _parser()
  args = parser.parse_args(argv)
  for name in ("steps", "batch", "seq", "seeds"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
  for name in ("eval_batches", "evals"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
  if args.health < 0 or args.seed < 0:
    parser.error(f"--health and --seed must be at least 0, got {args.health} and {args.seed}")
  if args.amax_history_len is not None and args.recipe != "delayed":
    parser.error(f"--amax-history-len is delayed scaling's; --recipe {args.recipe} keeps no history")
  if args.amax_history_len is not None and args.amax_history_len < 1:
    parser.error(f"--amax-history-len must be at least 1, got {args.amax_history_len}")
  if args.lr is not None and not args.lr > 0:
    parser.error(f"--lr must be positive, got {args.lr}")
  if args.deterministic and not determinism.request_xla_deterministic():
    parser.error(f"--deterministic: JAX started before XLA could be told; run with XLA_FLAGS='{determinism.XLA_FLAG}'")
  with autocast(deterministic=True if args.deterministic else None):
    return _main(args, parser)


def _main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
  on_gpu = jax.default_backend() == "gpu"
  preset_name = args.preset or ("gpt-small" if on_gpu else "tiny")
  preset = lm.PRESETS[preset_name]
  if args.module and preset.distill:
    parser.error(f"--module and --preset {preset_name} (a distillation preset) exclude each other")
  out = pathlib.Path(args.out or f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}")
  note = emulation_note()
  print(f"NOTE: {note}; the run still completes." if note else
        f"FP8 runs natively on {jax.devices()[0].device_kind}.")
  seeds = list(range(args.seed, args.seed + args.seeds))
  corpus = lm.load_corpus(preset.corpus_bytes)  # (train, held out): the same bytes for every seed
  if len(seeds) == 1:
    try:
      result = _compare(args, preset_name, corpus, seeds[0], out)
    except Interrupted as e:
      kept = "report.json (no run finished)" if len(e.missing) == 2 else "the partial report and plots"
      print(f"\ninterrupted: the {' and '.join(e.missing)} run{'s' if len(e.missing) > 1 else ''} did not finish; "
            f"{kept} in {out.resolve()}")
      raise SystemExit(130) from None
    if not args.deterministic:
      print("One seed: on a GPU the held-out loss of one seed moves by up to a few percent from run to run "
            "(--deterministic makes it repeatable); --seeds N gives the mean over N seeds with its standard error.")
    print(f"report and plots: {out.resolve()}")
    return result
  reports = []
  for seed in seeds:
    print(f"\n== seed {seed} ({len(reports) + 1} of {len(seeds)})")
    try:
      reports.append(_compare(args, preset_name, corpus, seed, out / f"seed-{seed}"))
    except Interrupted:
      done = ", ".join(f"seed-{s}" for s in seeds[:len(reports)]) or "none"
      print(f"\ninterrupted in seed {seed}: its partial report is in {(out / f'seed-{seed}').resolve()}; finished "
            f"seeds: {done} (no seeds.json: the summary needs every seed)")
      raise SystemExit(130) from None
  summary = report.seeds_summary(reports, seeds)
  summary["table"] = report.seeds_table(summary)
  report.write_json({"description": reports[0]["description"], "recipe": reports[0]["recipe"],
                     "device": reports[0]["device"], "versions": reports[0]["versions"],
                     "command": reports[0]["command"], **summary}, out / "seeds.json")
  print("\n" + summary["table"])
  print(f"reports and plots: {out.resolve()} (seeds.json, seed-<n>/)")
  return {**summary, "reports": reports}


def _compare(args: argparse.Namespace, preset_name: str, corpus: tuple[np.ndarray, np.ndarray], seed: int,
             out: pathlib.Path) -> dict:
  """One BF16-against-FP8 comparison of seed ``seed`` (its parameters and the order of its batches) on ``corpus``
  (``lm.load_corpus``'s train and held-out bytes), written to ``out``; prints its description and table."""
  preset = lm.PRESETS[preset_name]
  steps, batch, seq = args.steps or preset.steps, args.batch or preset.batch, args.seq or preset.seq
  lr = args.lr or preset.lr
  train_data, eval_data = corpus
  train = list(itertools.islice(lm.batches(train_data, batch, seq, seed=1 + seed), steps))
  held_out = list(itertools.islice(lm.batches(eval_data, batch, seq, seed=10_000), args.eval_batches))
  student = preset.distill or preset.model
  if args.module:
    model_fn, what = load_model_fn(args.module), f"model {args.module}"
  else:
    ffn = (f"{student['experts']} experts of mlp {student['mlp']}, top {student.get('top_k', 2)}"
           if student.get("experts") else f"mlp {student['mlp']}")
    model_fn, what = (lambda fp8: lm.LM(**student)), (
        f"byte-level LM {student['layers']} x {student['hidden']} (heads {student['heads']}, {ffn})")
  loss = None
  if preset.distill:  # a BF16 teacher first; the students learn its distribution
    teacher = lm.LM(**preset.model)
    params = teacher.init(jax.random.key(seed + 1), train[0][0])["params"]
    result = train_run(Run("teacher", teacher, None, steps), params, train, held_out, lr=lr,
                       tokens_per_batch=batch * seq)
    logits = jax.jit(lambda v, x: teacher.apply(v, x).astype(jnp.bfloat16))
    variables = result["final_variables"]
    train = [(x, y, logits(variables, x)) for x, y in train]
    held_out = [(x, y, logits(variables, x)) for x, y in held_out]
    loss = _distill_loss
    what += f", distilled from a BF16 teacher {preset.model['layers']} x {preset.model['hidden']} " \
            f"(held-out loss {result['heldout_loss']:.4f})"
  description = (f"{what}; {batch} x {seq} tokens a step, {steps} steps; corpus {len(train_data) / 1e6:.1f} MB of "
                 f"Python standard library source; preset {preset_name}"
                 + ("; FP8 GEMMs with fast accumulation" if args.fast_accumulation else "")
                 + (f"; amax history {args.amax_history_len} steps" if args.amax_history_len else "")
                 + ("; deterministic" if args.deterministic else ""))
  print(description)
  result = run(model_fn, train, steps=steps, eval_batches=held_out,
               recipe=fp8_recipe(args.recipe, args.fast_accumulation, args.amax_history_len), lr=lr,
               eval_every=max(1, steps // args.evals), health_every=health_every(steps, args.health),
               out=out, seed=seed, description=description, quiet=True,
               **({"loss": loss} if loss else {}))
  print("\n" + result["table"])
  return result


def console_main() -> None:
  """The ``te-jax-compare`` console script (and ``python -m te_jax.compare``): Ctrl-C before any run finished is one
  line, not a traceback."""
  try:
    main()
  except KeyboardInterrupt:
    print("\ninterrupted before any run finished: nothing was written")
    raise SystemExit(130) from None
