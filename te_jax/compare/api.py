"""``te_jax.compare.run``: BF16 against FP8, side by side, on any Flax model."""

from __future__ import annotations

import datetime
import importlib.metadata
import pathlib
import platform
import sys
from collections.abc import Callable, Iterable

import flax.linen as nn
import jax
import numpy as np

import te_jax
from te_jax import recipe as te_recipe
from te_jax._core import native
from te_jax.compare import report
from te_jax.compare.train import Run, check_batches, cross_entropy, tokens_in, train_run

__all__ = ["Interrupted", "RECIPES", "emulation_note", "run"]

#: ``--recipe`` names and the ``te_jax.recipe`` class each picks.
RECIPES = {"delayed": te_recipe.DelayedScaling, "current": te_recipe.Float8CurrentScaling,
           "block": te_recipe.Float8BlockScaling, "mxfp8": te_recipe.MXFP8BlockScaling,
           "nvfp4": te_recipe.NVFP4BlockScaling}


def emulation_note() -> str | None:
  """Why FP8 speed is not meaningful on this machine, or None where FP8 GEMMs run natively."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"FP8 is emulated on {device.platform.upper()} (no supported GPU): speed and memory are not meaningful here"
  cc = str(getattr(device, "compute_capability", "0.0"))
  if tuple(int(v) for v in cc.split(".")[:2]) < (8, 9):
    return f"FP8 is emulated on {device.device_kind} (compute capability {cc} < 8.9): speed is not meaningful here"
  if native.REFERENCE_FORCED or not native.registered.get("cuda"):
    return "FP8 runs on the pure-JAX reference path (the CUDA module did not load): speed is not meaningful here"
  return None


def _versions() -> dict:
  out = {"python": platform.python_version()}
  for name in ("te_jax", "jax", "jaxlib", "flax", "optax"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _recipe(recipe) -> te_recipe.Recipe:
  if isinstance(recipe, str):
    if recipe not in RECIPES:
      raise ValueError(f"run: recipe must be one of {sorted(RECIPES)} or a te_jax.recipe instance, got {recipe!r}")
    return RECIPES[recipe]()
  if not isinstance(recipe, tuple(RECIPES.values())):
    raise TypeError(f"run: recipe must be one of {sorted(RECIPES)} or a te_jax.recipe instance, got "
                    f"{type(recipe).__name__}")
  return recipe


def run(model_fn: Callable[[bool], nn.Module], batches: Iterable[tuple], *, steps: int,
        eval_batches: Iterable[tuple], recipe: str | te_recipe.Recipe = "delayed", loss: Callable = cross_entropy,
        lr: float = 1e-3, eval_every: int = 0, health_every: int = 0, out: str | pathlib.Path | None = None,
        seed: int = 0, description: str = "", quiet: bool = False) -> dict:
  """Trains ``model_fn(False)`` in BF16 and ``model_fn(True)`` in FP8 from the same initial parameters on the same
  batches; returns the report (also written to ``out``/report.json, with ``report.PLOTS`` beside it).

  Args:
    model_fn: ``model_fn(fp8)`` returns the Flax module of a run (the same parameters either way).
    batches: at least ``steps`` training batches: tuples with the model's input first (``loss`` sees the whole tuple).
    steps: train steps of each run.
    eval_batches: the held-out batches (a sequence, each evaluated every time).
    recipe: the FP8 run's recipe: a name in ``RECIPES`` or a ``te_jax.recipe`` instance.
    loss: ``loss(outputs, batch)``, a scalar; the default is cross-entropy against integer labels ``batch[1]``.
    lr: the peak learning rate of AdamW (warmup over a tenth of the steps, cosine decay to a tenth).
    eval_every: the held-out loss every that many steps as well as at the end (0: at the end only).
    health_every: FP8 health counters every that many steps (0: never; delayed scaling only).
    out: the folder of report.json and the plots; None writes nothing.
    seed: the parameters' initialization.
    description: a line about the model and data for the report.
    quiet: print nothing but the progress bars (the table is the report's "table" either way).
  """
  if not callable(model_fn):
    raise TypeError(f"run: model_fn must be a callable model_fn(fp8: bool) -> flax module, got "
                    f"{type(model_fn).__name__}")
  if not isinstance(steps, int) or steps < 1:
    raise ValueError(f"run: steps must be a positive int, got {steps!r}")
  for name, value in (("eval_every", eval_every), ("health_every", health_every), ("seed", seed)):
    if not isinstance(value, int) or value < 0:
      raise ValueError(f"run: {name} must be an int >= 0, got {value!r}")
  if not lr > 0:
    raise ValueError(f"run: lr must be positive, got {lr!r}")
  fp8_recipe = _recipe(recipe)
  batches = check_batches(batches, steps, "run: batches")
  eval_batches = list(eval_batches) if eval_batches is not None else []
  if not eval_batches:
    raise ValueError("run: eval_batches must hold at least one held-out batch")
  check_batches(eval_batches, len(eval_batches), "run: eval_batches")
  models = {"BF16": model_fn(False), "FP8": model_fn(True)}
  for name, model in models.items():
    if not isinstance(model, nn.Module):
      raise TypeError(f"run: model_fn({name == 'FP8'}) must return a flax.linen.Module, got {type(model).__name__}")
  params = jax.jit(models["BF16"].init)(jax.random.key(seed), batches[0][0])["params"]
  n_params = int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
  note = emulation_note()
  device = jax.devices()[0]
  if not quiet and note:
    print(f"NOTE: {note}.")
  results = {}
  header = {
      "description": description,
      "params": n_params,
      "recipe": repr(fp8_recipe),
      "note": note,
      "device": {"kind": device.device_kind, "platform": device.platform,
                 "compute_capability": getattr(device, "compute_capability", None), "count": jax.device_count()},
      "versions": _versions(),
      "command": " ".join(sys.argv),
  }
  order = (("FP8", fp8_recipe), ("BF16", None))
  # FP8 first: the device's peak memory only grows, so the run that needs less goes first (each run says whether it
  # raised the peak, that is whether its figure is its own). The report is written after each run, and on Ctrl-C
  # with the runs that finished, so that an interrupted comparison keeps what it measured.
  try:
    for position, (name, rec) in enumerate(order):
      results[name] = train_run(Run(name, models[name], rec, steps), params, batches, eval_batches, loss=loss, lr=lr,
                                eval_every=eval_every, health_every=health_every if rec is not None else 0,
                                tokens_per_batch=tokens_in(batches[0]), position=position)
      results[name].pop("final_variables")
      if len(results) < len(order):
        _write(header, results, [n for n, _ in order if n not in results], out)
  except KeyboardInterrupt:
    missing = [n for n, _ in order if n not in results]
    _write(header, results, missing, out)
    raise Interrupted(out, missing) from None
  result = _write(header, results, [], out)
  summary = result["table"]
  if not quiet:
    print("\n" + summary)
  return result


class Interrupted(KeyboardInterrupt):
  """Ctrl-C during ``run``: the report of the runs that finished was written to ``out`` (None: nowhere); ``missing``
  names the runs that did not."""

  def __init__(self, out, missing: list[str]):
    super().__init__(f"interrupted: {', '.join(missing)} did not finish")
    self.out, self.missing = out, missing


def _write(header: dict, results: dict, missing: list[str], out) -> dict:
  """The report of the finished runs (BF16 first), the FP8 run's ratios where both finished; written to ``out``
  (report.json and the plots) unless it is None. A partial report names the runs it lacks."""
  runs = [results[n] for n in ("BF16", "FP8") if n in results]
  if "BF16" in results and "FP8" in results:
    results["FP8"]["ratios"] = report.ratios(results["FP8"], results["BF16"])
  summary = report.table(runs, "BF16") if runs else "no run finished"
  if missing:
    summary += f"\npartial report: the {' and '.join(missing)} run{'s' if len(missing) > 1 else ''} did not finish"
  result = {**header, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "table": summary, "runs": runs, "missing": missing, "plots": dict(report.PLOTS),
            "health_operands": dict(report.HEALTH_OPERANDS)}
  if out is not None:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(result, out / "report.json")
    if runs:
      report.write_plots(runs, out)
  return result
