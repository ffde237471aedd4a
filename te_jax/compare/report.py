"""The outputs of ``te_jax.compare``: the table printed at the end, the JSON report and the PNG plots."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["HEALTH_OPERANDS", "PLOTS", "health_summary", "operand_kind", "ratios", "seeds_summary", "seeds_table",
           "table", "write_json", "write_plots"]

#: The PNG files ``write_plots`` writes, and what each shows.
PLOTS = {
    "loss.png": "train loss per step (thin) and held-out loss (markers) of every run, on one axis",
    "step_time.png": "step time per step of every run (ms)",
    "memory.png": "peak memory of every run (MiB): the device's measure where it has one, else XLA's estimate",
    "fp8_health.png": "the most recent amax over the measured steps of the worst FP8 operands (by saturated + flushed "
                      "share), and the saturated and flushed shares of the worst forward operands (E4M3) and of the "
                      "worst output gradients (E5M2 under HYBRID), each at its worst measured step",
}

#: What the names in a health row's "shares" (and "amax") are: the module's path, then the operand.
HEALTH_OPERANDS = {
    "{path}/{prefix}kernel": "a GEMM's kernel, cast to E4M3 with the state's {prefix}kernel_scale",
    "{path}/x": "a DenseGeneral's input, cast to E4M3 with the state's x_scale",
    "{path}/{prefix}grad": "a GEMM's output gradient, cast (E5M2 under the HYBRID format) with the state's "
                           "{prefix}grad_scale for the dgrad and wgrad GEMMs; LayerNormMLP's fc1 gradient (wi_grad) "
                           "is cast inside the fused op and has an amax only",
    "{path}[i]/...": "layer i of a stack under nn.scan",
}


def operand_kind(name: str) -> str:
  """"grad" (an output gradient), "kernel" or "x" (an input), from a health row's operand name."""
  operand = name.rpartition("/")[2]
  return "grad" if operand.endswith("grad") else "kernel" if operand.endswith("kernel") else "x"


def _mib(n):
  return "-" if n is None else f"{n / 2**20:,.0f}"


def _memory_bytes(r):
  m = r["memory"]
  return m["device_peak_bytes"] if m["device_peak_bytes"] is not None else m["xla_estimate_bytes"]


def table(runs: list[dict], baseline: str) -> str:
  """The Markdown table of the runs, then each run's ratios to ``baseline``."""
  lines = ["| run | train loss | held-out loss | tokens/s | step ms (median) | step ms (p90) | compile s | peak MiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in runs:
    lines.append(f"| {r['name']} | {r['train_loss']:.4f} | {r['heldout_loss']:.4f} | {_num(r['tokens_per_s'], ',.0f')} | "
                 f"{_num(r['step_s_median'], '.2f', 1e3)} | {_num(r['step_s_p90'], '.2f', 1e3)} | "
                 f"{r['compile_s']:.1f} | {_mib(_memory_bytes(r))} |")
  base = next((r for r in runs if r["name"] == baseline), runs[0])
  for r in runs:
    if r is base or "ratios" not in r:
      continue
    q = r["ratios"]
    speed = _ratio(q["tokens_per_s"], "not measured")
    memory = "" if q["memory"] is None else f", peak memory {q['memory']:.2f}x"
    lines.append(f"{r['name']} vs {baseline}: held-out loss {q['heldout_loss'] - 1:+.2%}, tokens/s {speed}{memory}")
  lines += [r["timing_note"] for r in runs if r.get("timing_note")]
  lines.append(f"memory: {base['memory']['source']}")
  lines += [line for r in runs if (line := health_summary(r))]
  return "\n".join(lines)


def _num(value, spec: str, factor: float = 1.0) -> str:
  """``value * factor`` formatted with ``spec``, or "-" for a figure that was not measured (None)."""
  return "-" if value is None else format(factor * value, spec)


def _ratio(value, missing: str = "-") -> str:
  """A ratio as ``1.23x``, or ``missing`` for one that was not measured (None)."""
  return missing if value is None else f"{value:.2f}x"


def health_summary(run: dict) -> str | None:
  """One line on ``run``'s measured FP8 health: the largest saturated and flushed shares of its output gradients
  and of its forward operands over the measured steps, with where they were; None when nothing was measured."""
  worst = {}  # (kind, 0 saturated | 1 flushed) -> (share, operand, step)
  for row in run["health"]:
    for name, shares in row["shares"].items():
      for i, share in enumerate(shares):
        key = (operand_kind(name) == "grad", i)
        if key not in worst or share > worst[key][0]:
          worst[key] = (share, name, row["step"])
  if not worst:
    return None
  parts = []
  for grad, what in ((True, "output gradients"), (False, "forward operands")):
    found = [(label, worst[(grad, i)]) for i, label in enumerate(("saturated", "flushed")) if (grad, i) in worst]
    if found:
      parts.append(f"{what} " + ", ".join(f"{label} up to {100 * share:.2g}% ({name}, step {step})"
                                          for label, (share, name, step) in found))
  return f"FP8 health of the {run['name']} run over {len(run['health'])} measured steps: " + "; ".join(parts)


def ratios(run: dict, base: dict) -> dict:
  """``run``'s held-out loss, tokens/s and peak memory over ``base``'s."""
  a, b = _memory_bytes(run), _memory_bytes(base)
  return {"heldout_loss": run["heldout_loss"] / base["heldout_loss"],
          "tokens_per_s": (None if run["tokens_per_s"] is None or base["tokens_per_s"] is None
                           else run["tokens_per_s"] / base["tokens_per_s"]),
          "memory": None if a is None or not b else a / b}


def seeds_summary(reports: list[dict], seeds: list[int]) -> dict:
  """FP8 against BF16 over several seeds (one ``run`` report each): each seed's held-out losses and ratios, the mean of
  the per-seed ratios with its standard error, and how much BF16 alone moves from seed to seed.

  >>> r = lambda bf16, fp8: {"runs": [{"name": "BF16", "heldout_loss": bf16}, {"name": "FP8", "heldout_loss": fp8,
  ...     "ratios": {"heldout_loss": fp8 / bf16, "tokens_per_s": 1.2, "memory": 0.9}}]}
  >>> s = seeds_summary([r(1.0, 1.01), r(1.1, 1.1), r(1.2, 1.19)], [0, 1, 2])
  >>> round(s["heldout_ratio_mean"], 4), round(s["bf16_heldout_spread"], 4)
  (1.0006, 0.0909)
  """
  if len(reports) != len(seeds) or len(reports) < 2:
    raise ValueError(f"seeds_summary: one report per seed and at least two, got {len(reports)} for seeds {seeds}")
  rows = []
  for seed, rep in zip(seeds, reports):
    runs = {r["name"]: r for r in rep["runs"]}
    q = runs["FP8"]["ratios"]
    rows.append({"seed": seed, "bf16_heldout": runs["BF16"]["heldout_loss"], "fp8_heldout": runs["FP8"]["heldout_loss"],
                 "heldout_ratio": q["heldout_loss"], "tokens_per_s_ratio": q["tokens_per_s"], "memory_ratio": q["memory"]})
  ratio = np.array([r["heldout_ratio"] for r in rows])
  bf16 = np.array([r["bf16_heldout"] for r in rows])
  memory = [r["memory_ratio"] for r in rows if r["memory_ratio"] is not None]
  return {
      "seeds": rows,
      "heldout_ratio_mean": float(ratio.mean()),
      "heldout_ratio_standard_error": float(ratio.std(ddof=1) / np.sqrt(len(ratio))),
      "bf16_heldout_spread": float(bf16.std(ddof=1) / bf16.mean()),  # BF16's own seed-to-seed standard deviation
      "tokens_per_s_ratio_mean": float(np.mean(speed)) if (speed := [r["tokens_per_s_ratio"] for r in rows
                                                                      if r["tokens_per_s_ratio"] is not None]) else None,
      "memory_ratio_mean": float(np.mean(memory)) if memory else None,
  }


def seeds_table(summary: dict) -> str:
  """The Markdown table of ``seeds_summary``: a row per seed, then the means."""
  lines = ["| seed | BF16 held-out | FP8 held-out | FP8 vs BF16 | tokens/s | peak memory |", "|---:|---:|---:|---:|---:|---:|"]
  for r in summary["seeds"]:
    memory = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x"
    lines.append(f"| {r['seed']} | {r['bf16_heldout']:.4f} | {r['fp8_heldout']:.4f} | {r['heldout_ratio'] - 1:+.2%} | "
                 f"{_ratio(r['tokens_per_s_ratio'])} | {memory} |")
  memory = "" if summary["memory_ratio_mean"] is None else f", peak memory {summary['memory_ratio_mean']:.2f}x"
  lines.append(f"FP8 vs BF16 over {len(summary['seeds'])} seeds: held-out loss "
               f"{summary['heldout_ratio_mean'] - 1:+.2%} ± {summary['heldout_ratio_standard_error']:.2%} (mean of the "
               f"seeds' ratios ± its standard error; BF16 alone moves {summary['bf16_heldout_spread']:.2%} from seed "
               f"to seed), tokens/s {_ratio(summary['tokens_per_s_ratio_mean'], 'not measured')}{memory}")
  return "\n".join(lines)


def write_json(report: dict, path: pathlib.Path) -> None:
  path.write_text(json.dumps(report, indent=1, default=float) + "\n")


def _worst(runs: list[dict], count: int, grad: bool):
  """The ``count`` operands of a kind (output gradients, or forward operands) with the largest saturated + flushed
  share at any measured step, over all runs, and the (saturated, flushed) shares of that step."""
  worst = {}
  for r in runs:
    for row in r["health"]:
      for name, (sat, flush) in row["shares"].items():
        key = (r["name"], name)
        if (operand_kind(name) == "grad") == grad and (key not in worst or sat + flush > sum(worst[key])):
          worst[key] = (sat, flush)
  return sorted(worst, key=lambda k: -sum(worst[k]))[:count], worst


def _health_bars(ax, worst, shares, title: str) -> None:
  labels = [f"{a} {b}" for a, b in worst][::-1]
  sat = np.asarray([100 * shares[k][0] for k in worst][::-1])
  flush = np.asarray([100 * shares[k][1] for k in worst][::-1])
  if worst:
    ax.barh(labels, sat, color="C3", label="saturated")
    ax.barh(labels, flush, left=sat, color="C0", label="flushed")
    ax.legend(fontsize=7)
  else:
    ax.text(0.5, 0.5, "none measured", ha="center", transform=ax.transAxes)
  ax.set(xlabel="% of the operand's values (worst measured step)", title=title)
  ax.tick_params(axis="y", labelsize=7)


def write_plots(runs: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
  """Writes ``PLOTS`` into ``out``; returns their paths."""
  paths = []

  fig, ax = plt.subplots(figsize=(8, 5))
  for i, r in enumerate(runs):
    color = f"C{i}"
    ax.plot(np.arange(1, len(r["train_curve"]) + 1), r["train_curve"], color=color, lw=0.8, alpha=0.6,
            label=f"{r['name']} train")
    steps, values = zip(*r["heldout_curve"])
    ax.plot(steps, values, "o-", color=color, lw=2, label=f"{r['name']} held-out")
  ax.set(xlabel="step", ylabel="loss", title="loss")
  ax.legend()
  paths.append(_save(fig, out / "loss.png"))

  fig, ax = plt.subplots(figsize=(8, 4))
  for i, r in enumerate(runs):
    if r["step_s_median"] is None:
      ax.plot([], [], color=f"C{i}", label=f"{r['name']}: no step timed")
      continue
    ax.plot(1e3 * np.asarray(r["step_times_s"]), color=f"C{i}", lw=0.8,
            label=f"{r['name']} (median {1e3 * r['step_s_median']:.1f} ms)")
  ax.set(xlabel="timed step", ylabel="ms", title="step time")
  ax.legend()
  paths.append(_save(fig, out / "step_time.png"))

  fig, ax = plt.subplots(figsize=(6, 4))
  names = [r["name"] for r in runs]
  device = [r["memory"]["device_peak_bytes"] for r in runs]
  xla = [r["memory"]["xla_estimate_bytes"] or 0 for r in runs]
  pos = np.arange(len(runs))
  if all(d is not None for d in device):
    ax.bar(pos - 0.2, np.asarray(device) / 2**20, 0.4, label="device peak_bytes_in_use")
  ax.bar(pos + 0.2, np.asarray(xla) / 2**20, 0.4, label="XLA estimate of the step")
  ax.set_xticks(pos, names)
  ax.set(ylabel="MiB", title="peak memory")
  ax.legend()
  paths.append(_save(fig, out / "memory.png"))

  fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.5))
  forward, forward_shares = _worst(runs, 6, grad=False)
  grads, grad_shares = _worst(runs, 6, grad=True)
  for k, (run_name, name) in enumerate(forward[:3] + grads[:3]):
    r = next(r for r in runs if r["name"] == run_name)
    steps = [row["step"] for row in r["health"]]
    amax = [row["amax"].get(name, np.nan) for row in r["health"]]
    ax1.plot(steps, amax, "o-", color=f"C{k}", label=f"{run_name} {name}")
  ax1.set(xlabel="step", ylabel="amax (most recent)", title="amax of the worst operands", yscale="log")
  if forward or grads:
    ax1.legend(fontsize=7)
  else:
    ax1.text(0.5, 0.5, "no delayed-scaling run measured", ha="center", transform=ax1.transAxes)
  _health_bars(ax2, forward, forward_shares, "FP8 health: kernels and inputs (E4M3)")
  _health_bars(ax3, grads, grad_shares, "FP8 health: output gradients (E5M2 under HYBRID)")
  paths.append(_save(fig, out / "fp8_health.png"))
  return paths


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
