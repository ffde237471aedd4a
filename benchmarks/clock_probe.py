"""SM clock, power and the GPU's clock-event reasons while a layer step runs back to back, per implementation.

A kernel in a short trace can run at a higher clock than the same kernel in a long timed loop, where the board
reaches its power limit. This samples ``nvidia-smi`` every 50 ms while each implementation of ``bench_transformer``'s
GPT layer runs ``--batches`` batches of 10 calls (after a pause, so that each starts from the same idle state), and
prints per implementation the ms per call of the first and the last batches, the median SM clock, power and the
clock-event reasons seen.

  python benchmarks/clock_probe.py --impl "te_jax TransformerLayer fp8" --impl "flax layer bf16"
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import subprocess
import sys
import threading
import time

import jax

import bench_transformer
import harness
import profile_layer

BATCH = harness.Context.batch  # calls dispatched back to back per measurement, as the benchmarks time them
FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# nvidia-smi's clock-event reason bits (nvidia-smi --help-query-gpu, "clocks_event_reasons").
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hw slowdown", 0x10: "sync boost",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


def reason_names(mask: int) -> str:
  return "+".join(name for bit, name in REASONS.items() if mask & bit) or "none"


class Sampler:
  """``nvidia-smi`` samples (host time, SM MHz, W, C, reasons bitmask) in a background thread."""

  def __init__(self, period_ms: int = 50):
    self.samples: list[tuple[float, float, float, float, int]] = []
    self._proc = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
        stdout=subprocess.PIPE, text=True)
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self._proc.stdout:
      parts = [p.strip() for p in line.split(",")]
      try:
        self.samples.append((time.perf_counter(), float(parts[0]), float(parts[1]), float(parts[2]),
                             int(parts[3], 16)))
      except (ValueError, IndexError):
        continue

  def between(self, t0: float, t1: float):
    return [s for s in self.samples if t0 <= s[0] <= t1]

  def stop(self):
    self._proc.terminate()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--impl", action="append", help="implementations of bench_transformer.impls (default: all)")
  p.add_argument("--batches", type=int, default=30)
  p.add_argument("--pause", type=float, default=5.0, help="idle seconds before each implementation")
  a = p.parse_args(argv)
  if shutil.which("nvidia-smi") is None:
    p.error("nvidia-smi is not on PATH: this probe is for a machine with an NVIDIA GPU")
  # Every step compiled and warmed up before the first is timed, so that compilation stays out of the samples.
  names = a.impl or list(bench_transformer.impls(bench_transformer.LAYER))
  prepared = list(profile_layer.layer_steps("transformer", names))
  sampler = Sampler()
  print("| impl | first batch ms | last 10 batches ms | median SM MHz | median W | max C | clock-event reasons "
        "(samples) |")
  print("|---|---|---|---|---|---|---|")
  for name, fn, args in prepared:
    time.sleep(a.pause)
    per_batch = []
    t_start = time.perf_counter()
    for _ in range(a.batches):
      t = time.perf_counter()
      for _ in range(BATCH):
        out = fn(*args)
      jax.block_until_ready(out)
      per_batch.append((time.perf_counter() - t) / BATCH * 1e3)
    t_end = time.perf_counter()
    s = sampler.between(t_start, t_end)
    reasons = collections.Counter(r for *_, r in s)
    print(f"| {name} | {per_batch[0]:.3f} | {statistics.median(per_batch[-10:]):.3f} | "
          f"{statistics.median(v[1] for v in s) if s else float('nan'):.0f} | "
          f"{statistics.median(v[2] for v in s) if s else float('nan'):.0f} | "
          f"{max((v[3] for v in s), default=float('nan')):.0f} | "
          f"{', '.join(f'{reason_names(r)}: {n}' for r, n in reasons.most_common())} |", flush=True)
  sampler.stop()
  return 0


if __name__ == "__main__":
  sys.exit(main())
