"""One run of ``te_jax.compare``: a model trained for a number of steps under one precision, from given parameters
on given batches, with its step times, losses, compile time, memory and (under delayed scaling) FP8 health.

What flows where: the optimizer trains ``"params"``; the FP8 state (``te_jax.FP8_COLLECTION``) rides in the same
dict and is overwritten by its gradient (Flax's ``TrainState``); every other collection that ``init`` returns (an
MoE block's expert bias in ``"batch_stats"``) is the model's state, kept beside them (``TrainState.model_state``),
mutable in the train step and replaced by what it returns. The train step also makes ``"aux_loss"`` mutable and adds
the sum of what the model sows there (an MoE block's auxiliary losses, each already times its coefficient) to the
loss; evaluation applies the model with nothing mutable, its loss the plain one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state
from tqdm.auto import tqdm

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe as te_recipe
from te_jax.compare import health
from te_jax.flax.moe import AUX_LOSS_COLLECTION

__all__ = ["Run", "TrainState", "aux_loss_sum", "check_batches", "cross_entropy", "health_step", "loss_of",
           "optimizer", "split_variables", "tokens_in", "train_loss_of", "train_run", "train_state_and_step"]

# Collections that are not the model's state: the trained ones, and those a call sows afresh.
_NOT_STATE = ("params", te_jax.FP8_COLLECTION, AUX_LOSS_COLLECTION, health.HEALTH_COLLECTION)


def cross_entropy(outputs: jax.Array, batch: tuple) -> jax.Array:
  """The default loss: softmax cross-entropy of ``outputs`` (logits) against the integer labels ``batch[1]``."""
  return optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), batch[1]).mean()


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run trains: its name, model, FP8 recipe (None: BF16) and step count."""

  name: str
  model: nn.Module
  recipe: te_recipe.Recipe | None
  steps: int


class TrainState(train_state.TrainState):
  """Flax's ``TrainState`` (``params``: the trained parameters with the FP8 state) and ``model_state``: the
  collections the model updates as it trains that the optimizer must not touch (``split_variables``)."""

  model_state: Any = struct.field(default_factory=dict)


def _model_state(state) -> dict:
  return dict(getattr(state, "model_state", None) or {})


def split_variables(variables: Mapping) -> tuple[dict, dict]:
  """``(trained, model_state)``: ``"params"`` and the FP8 state, which the train state's ``params`` holds, and every
  other collection but those sown afresh by each call (``"aux_loss"``, the health counters).

  >>> split_variables({"params": 1, "batch_stats": 2, "aux_loss": 3})
  ({'params': 1}, {'batch_stats': 2})
  """
  trained = {k: v for k, v in variables.items() if k in ("params", te_jax.FP8_COLLECTION)}
  return trained, {k: v for k, v in variables.items() if k not in _NOT_STATE}


def aux_loss_sum(sown: Mapping | None) -> jax.Array:
  """The float32 sum of every leaf of an ``"aux_loss"`` collection (0 when it holds none)."""
  leaves = jax.tree.leaves(sown or {})
  return sum((jnp.sum(v.astype(jnp.float32)) for v in leaves), jnp.float32(0.0))


def _memory_peak(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  """AdamW (weight decay 0.01) after clipping the global gradient norm to 1, warmup over a tenth of ``steps`` to
  ``lr``, then cosine decay to a tenth of it."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), max(steps, 2), lr / 10)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def loss_of(run: Run, loss: Callable = cross_entropy) -> Callable:
  """``loss_fn(variables, batch)``: ``loss`` of ``run.model``'s outputs on ``batch[0]`` against ``batch``, nothing
  mutable (evaluation: no auxiliary loss)."""
  return lambda v, batch: loss(run.model.apply(v, batch[0]), batch)


def train_loss_of(run: Run, loss: Callable = cross_entropy) -> Callable:
  """``fn(variables, model_state, batch) -> (total, (model_state, aux))``: the train step's loss, ``loss`` of
  ``run.model``'s outputs applied with ``"aux_loss"`` and ``model_state``'s collections mutable, plus ``aux``, the
  sum of the auxiliary losses sown (``aux_loss_sum``); ``model_state`` as the call left it."""

  def fn(v, model_state, batch):
    outputs, new = run.model.apply({**v, **model_state}, batch[0], mutable=[AUX_LOSS_COLLECTION, *model_state])
    aux = aux_loss_sum(new.get(AUX_LOSS_COLLECTION))
    return loss(outputs, batch) + aux, ({k: new[k] for k in model_state}, aux)

  return fn


def train_state_and_step(run: Run, params, batch: tuple, *, loss: Callable = cross_entropy,
                         lr: float = 1e-3, donate: bool = True) -> tuple[train_state.TrainState, Callable]:
  """The train state of ``run`` from ``params`` (a copy; FP8 scales calibrated on ``batch``) and its train step
  ``step(state, batch) -> (state, loss)``, jitted (with the state donated, by default); call both inside ``run``'s
  precision (``te_jax.autocast(enabled=run.recipe is not None, recipe=run.recipe)``). The step's loss is
  ``train_loss_of``'s total, the auxiliary losses included; the state's ``model_state`` is what the step's call
  left."""
  loss_fn = train_loss_of(run, loss)

  def step(state, batch):
    (value, (model_state, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.model_state,
                                                                                  batch)
    return state.apply_gradients(grads=grads, model_state=model_state), value

  params = jax.tree.map(jnp.copy, params)  # the step donates its state; the caller's parameters start other runs
  # init jitted: op by op it takes longer than the step's compile on a CPU (the FP8 state's shapes are all it gives)
  init = jax.jit(run.model.init)(jax.random.key(0), batch[0])
  variables, model_state = split_variables({**init, "params": params})
  # FP8: the first step's scales; BF16: as it is
  variables = te_flax.calibrate(lambda v, b: loss_fn(v, model_state, b)[0], variables, batch)
  state = TrainState.create(apply_fn=run.model.apply, params=variables, tx=optimizer(lr, run.steps),
                            model_state=model_state)
  return state, jax.jit(step, donate_argnums=0 if donate else ())


def health_step(run: Run, loss: Callable = cross_entropy) -> Callable:
  """``step(state, probes, batch) -> (state, loss, shares)``: the train step that also takes the FP8 health counters
  (``te_jax.compare.health``) of the values it casts, kernels, inputs and output gradients, with ``probes``
  (``health.grad_probes(state.params)``) receiving the output gradients' counts; ``shares`` maps each operand to its
  (saturated, flushed) shares (``health.rows`` turns them into per-layer floats). Its loss and model state are the
  plain step's (``train_loss_of``); ``state`` may be Flax's own ``TrainState`` (no model state). Not jitted."""

  def loss_with_health(v, probes, model_state, batch):
    with health.input_health(), health.grad_health():
      outputs, sown = run.model.apply({**health.with_grad_probes(v, probes), **model_state}, batch[0],
                                      mutable=[health.HEALTH_COLLECTION, AUX_LOSS_COLLECTION, *model_state])
    value = loss(outputs, batch) + aux_loss_sum(sown.get(AUX_LOSS_COLLECTION))
    return value, (health.flatten_sown(sown.get(health.HEALTH_COLLECTION, {})), {k: sown[k] for k in model_state})

  def step(state, probes, batch):
    # The gradient w.r.t. the probes is the output gradients' counts; the variables' own gradient is the plain step's.
    (value, (inputs, model_state)), (grads, counts) = jax.value_and_grad(loss_with_health, argnums=(0, 1),
                                                                         has_aux=True)(
        state.params, probes, _model_state(state), batch)
    shares = {**health.kernel_health(state.params), **inputs, **health.grad_shares(counts)}
    kept = {"model_state": model_state} if hasattr(state, "model_state") else {}
    return state.apply_gradients(grads=grads, **kept), value, shares

  return step


def train_run(run: Run, params, batches: Sequence[tuple], eval_batches: Sequence[tuple], *,
              loss: Callable = cross_entropy, lr: float = 1e-3, eval_every: int = 0, health_every: int = 0,
              tokens_per_batch: int, position: int = 0) -> dict:
  """Trains ``run.model`` from ``params`` on ``batches[:run.steps]``; returns the run's numbers (JSON-ready).

  ``eval_every``: the held-out loss (mean over ``eval_batches``) every that many steps and after the last (0: after
  the last only). ``health_every``: the FP8 health counters from the step itself every that many steps (0: never;
  only under DelayedScaling, the one recipe whose scale exists before the step).
  """
  steps = run.steps
  device = jax.devices()[0]
  fp8 = run.recipe is not None
  delayed = isinstance(run.recipe, te_recipe.DelayedScaling)
  x0 = batches[0]

  def precision():
    return te_jax.autocast(enabled=fp8, recipe=run.recipe)

  peak_before = _memory_peak(device)
  with precision():
    state, step = train_state_and_step(run, params, x0, loss=loss, lr=lr)
    t0 = time.perf_counter()
    compiled = step.lower(state, x0).compile()
    compile_s = time.perf_counter() - t0
    evaluate = jax.jit(loss_of(run, loss))
    measure = jax.jit(health_step(run, loss), donate_argnums=0) if delayed and health_every else None
    probes = health.grad_probes(state.params) if measure is not None else None
  analysis = compiled.memory_analysis()
  xla_bytes = None if analysis is None else int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                                                + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)

  def eval_loss(state):
    with precision():
      return float(np.mean([float(evaluate({**state.params, **state.model_state}, b)) for b in eval_batches]))

  # One step in flight, as a training loop runs: step i+1 is dispatched before step i's loss is read, so the device
  # never waits for the host between steps. A step's time runs from the previous step's end (or from its own dispatch,
  # when the device was idle before it) to its own end; steps that measure FP8 health take no time sample.
  times, losses, evals, health_rows = [], [], [], []
  pending = None  # (step, loss as a device array, dispatch time) of the step in flight
  last_end = None  # when the step before the one in flight ended, if the device went on with no pause

  def record(i, value) -> float:
    value = float(value)  # waits for the step
    if not np.isfinite(value):
      raise FloatingPointError(f"{run.name}: the train loss is {value} at step {i}")
    losses.append(value)
    return value

  def finish():
    nonlocal pending, last_end
    i, value, dispatched = pending
    value = record(i, value)
    end = time.perf_counter()
    times.append(end - (dispatched if last_end is None else max(dispatched, last_end)))
    pending, last_end = None, end
    bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tokens_per_batch / float(np.median(times)):,.0f}")

  def pause():  # the device's queue drained: the next step's time starts at its dispatch
    nonlocal last_end
    if pending is not None:
      finish()
    last_end = None

  bar = tqdm(range(steps), desc=f"{run.name:<5}", position=position, leave=True, dynamic_ncols=True)
  for i in bar:
    batch = batches[i]
    if measure is not None and i % health_every == 0:
      pause()
      with precision():
        state, value, shares = measure(state, probes, batch)
      health_rows.append({"step": i, "shares": health.rows(shares)})
      record(i, value)
      health_rows[-1]["amax"] = health.latest_amaxes(state.params)
    else:
      dispatched = time.perf_counter()
      state, value = compiled(state, batch)
      if pending is not None:
        finish()
      pending = (i, value, dispatched)
    if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
      pause()
      evals.append([i + 1, eval_loss(state)])
  pause()
  bar.close()
  evals.append([steps, eval_loss(state)])
  peak_after = _memory_peak(device)
  timed = bool(times)
  median = float(np.median(times)) if timed else None
  return {
      "name": run.name,
      "recipe": None if run.recipe is None else type(run.recipe).__name__,
      "steps": steps,
      "train_loss": float(np.mean(losses[-max(1, steps // 10):])),
      "heldout_loss": evals[-1][1],
      "train_curve": losses,
      "heldout_curve": evals,
      "step_times_s": [float(t) for t in times],
      "step_s_median": median,
      "step_s_p90": float(np.percentile(times, 90)) if timed else None,
      "tokens_per_s": tokens_per_batch / median if timed else None,
      # Why a figure is missing (None): no step was timed, as every one took the FP8 health counters.
      "timing_note": None if timed else (f"no step of the {run.name} run was timed: each of its {steps} steps took "
                                         "the FP8 health counters (fewer health steps, or more steps, leave some "
                                         "to time)"),
      "compile_s": compile_s,
      "memory": {
          # The allocator's peak over the process: exact for this run only when this run raised it.
          "device_peak_bytes": peak_after,
          "device_peak_raised_by_this_run": None if peak_after is None else peak_after > (peak_before or 0),
          "xla_estimate_bytes": xla_bytes,
          "source": "device (jax.Device.memory_stats peak_bytes_in_use)" if peak_after is not None else
                    "XLA's compiled memory_analysis (arguments + outputs + temp - aliased): the device reports none",
      },
      "health": health_rows,
      "final_variables": {**state.params, **state.model_state},
  }


def tokens_in(batch: tuple) -> int:
  """The tokens of a batch: every element of an integer input (token ids), the leading axes of a float input (the
  last axis is features)."""
  x = np.asarray(batch[0]) if not isinstance(batch[0], jax.Array) else batch[0]
  return int(x.size if jnp.issubdtype(x.dtype, jnp.integer) else int(np.prod(x.shape[:-1])))


def check_batches(batches, steps: int, what: str) -> list[tuple]:
  """``batches`` as a list of at least ``steps`` tuples (a sequence is kept, an iterable is read ``steps`` times)."""
  if isinstance(batches, Mapping) or not hasattr(batches, "__iter__"):
    raise TypeError(f"{what} must be a sequence or an iterable of batches (tuples, inputs first), "
                    f"got {type(batches).__name__}")
  out = []
  for b in batches:
    if len(out) == steps:
      break
    if not isinstance(b, tuple) or not b:
      raise TypeError(f"{what}: each batch must be a non-empty tuple (inputs, targets, ...), got {type(b).__name__}")
    out.append(b)
  if len(out) < steps:
    raise ValueError(f"{what}: {steps} batches needed, got {len(out)}")
  return out
