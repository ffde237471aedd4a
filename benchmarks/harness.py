"""Timing helpers shared by the benchmarks: synchronized timing, jitted loops for small ops, the copy ceiling.

Conventions:

- Every timed function is jitted and compiled before timing, then warmed up; a time is the median of ``runs``
  synchronized measurements (``jax.block_until_ready`` on the result).
- ``time_calls(batch=1)`` is one host-timed call per measurement, dispatch included: comparable with published
  baselines measured that way (a training loop that reads its loss every step). ``batch > 1`` dispatches that many
  calls back to back and waits for the last: the device never waits for the host, so the time is the op's own (use
  it for ops above ~50 us).
- ``time_loop`` runs the op ``inner`` times inside one jitted ``lax.fori_loop``, for ops too small for per-call
  timing. It times ``inner`` and ``2 * inner`` iterations and takes the difference, which cancels the loop's fixed
  costs (dispatch, carry initialisation, final sync). For a large op the loop is a second view of the per-call time,
  and ``loop_inner`` shortens it to what cancels those costs (see there).
- Work shared between the timings of one function is done once: the first call (compile) by the output check that
  precedes the timings, one warm-up per timing after that, one compile for the memory analysis and the handler list.
- Bandwidth counts bytes read + written once each (the minimum traffic of the op); ``copy_bandwidth`` measures the
  ceiling the same way, with a large device-to-device copy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import te_jax


@dataclasses.dataclass(frozen=True)
class Context:
  """What every benchmark's ``run(ctx)`` gets.

  Attributes:
    gpu: whether the default backend is a GPU.
    platform: the lowering platform of the default backend, "cuda" or "cpu" (FFI target names end with it).
    shrink: divide every benchmark dimension by this (1 on a GPU; larger for a quick smoke run on a CPU).
    copy_gbps: the measured device copy bandwidth (bytes read + written), the ceiling for memory-bound ops, with
      per-call timing.
    copy_loop_gbps: the same ceiling inside a jitted loop (the in-program view, without per-call overhead).
    runs: measurements per timing (the median is reported).
    batch: calls per measurement in ``time_calls`` for the main (device-bound) time.
    inner: iterations of the shorter loop in ``time_loop`` (the most; see ``loop_inner``).
    clocks: the GPU's clock and power sampler (``ClockSampler``), None where there is no ``nvidia-smi``.
  """

  gpu: bool
  platform: str
  shrink: int
  copy_gbps: float
  copy_loop_gbps: float
  runs: int = 20
  batch: int = 10
  inner: int = 100
  clocks: ClockSampler | None = None


@dataclasses.dataclass(frozen=True)
class Timing:
  """A median time per call, in milliseconds, with the spread of the measurements."""

  ms: float
  ms_min: float
  ms_max: float
  runs: int

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def _timing(samples: Sequence[float]) -> Timing:
  return Timing(statistics.median(samples) * 1e3, min(samples) * 1e3, max(samples) * 1e3, len(samples))


def time_calls(fn: Callable[..., Any], *args: Any, runs: int = 20, batch: int = 1, warmup: int = 3) -> Timing:
  """Median time of one call of the jitted ``fn(*args)``.

  Args:
    fn: a jitted function.
    *args: its arguments (device arrays).
    runs: number of measurements.
    batch: calls per measurement, dispatched back to back; the measurement is divided by it.
    warmup: calls before the first measurement (the first one compiles, if ``fn`` was not compiled yet).

  Returns:
    The median (and min, max) over ``runs`` measurements of the time per call.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(runs):
    start = time.perf_counter()
    for _ in range(batch):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / batch)
  return _timing(samples)


def time_loop(fn: Callable[..., Any], args: Sequence[Any], *, inner: int = 100, runs: int = 20,
              warmup: int = 2) -> Timing:
  """Time of one iteration of ``fn(*args)`` run ``inner`` times in a jitted ``lax.fori_loop``.

  Two things keep XLA from optimising the loop away: each iteration's outputs are carried to the end (nothing is
  dead code), and every float scalar argument gets ``zero * (first output element)`` added after each iteration, with
  ``zero`` a run-time argument, so that the call is not loop invariant. Arrays stay unchanged: a one-element update of
  a large input made XLA copy it each iteration before a custom call read it (measured on the H200: quantize's loop
  time doubled). So XLA may hoist out of the loop what depends on unchanged arrays only (an input's amax, its
  transpose): for the XLA-compiled jnp of such ops the loop time is a lower bound, and the per-call time the fair one.

  Args:
    fn: the (unjitted) function to time; returns a pytree of arrays.
    args: its arguments (arrays; the float scalars among them are perturbed).
    inner: iterations in the shorter loop (the longer one runs ``2 * inner``).
    runs: measurements of each loop.
    warmup: calls of each loop before measuring.

  Returns:
    The per-iteration time: the median over ``runs`` of (time of the 2*inner loop - time of the inner loop) / inner,
    the two loops timed back to back in each run so that both see the same machine load. Where noise (another process)
    makes that median non-positive: the 2*inner loop's median / (2*inner), an upper bound.
  """
  args = list(args)
  out_shapes = jax.eval_shape(fn, *args)

  def loop(n, zero, *args):
    def body(_, carry):
      args_, _ = carry
      outs = fn(*args_)
      first = jnp.ravel(jax.tree.leaves(outs)[0])[0].astype(jnp.float32)
      args_ = tuple(_nudge(a, zero * first) for a in args_)
      return args_, outs

    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
    return jax.lax.fori_loop(0, n, body, (tuple(args), init))[1]

  zero = jnp.float32(0.0)
  short = jax.jit(lambda *a: loop(inner, *a))
  long = jax.jit(lambda *a: loop(2 * inner, *a))
  # The two programs differ only in their trip count: traced here, compiled side by side (XLA's compile releases the
  # GIL); the calls below find them in jit's cache.
  lowered = [f.lower(zero, *args) for f in (short, long)]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    list(pool.map(lambda lo: lo.compile(), lowered))
  for _ in range(warmup):
    jax.block_until_ready((short(zero, *args), long(zero, *args)))
  diffs, longs = [], []
  for _ in range(runs):
    t_short = time_calls(short, zero, *args, runs=1, warmup=0).ms
    t_long = time_calls(long, zero, *args, runs=1, warmup=0).ms
    diffs.append((t_long - t_short) / inner)
    longs.append(t_long / (2 * inner))
  if statistics.median(diffs) <= 0:
    return Timing(statistics.median(longs), min(longs), max(longs), runs)
  return Timing(statistics.median(diffs), min(diffs), max(diffs), runs)


def _nudge(a: jax.Array, delta: jax.Array) -> jax.Array:
  """``a + delta`` for a float scalar ``a``; anything else (arrays, None) unchanged."""
  if a is None or a.ndim or not jnp.issubdtype(a.dtype, jnp.floating):
    return a
  return a + delta.astype(a.dtype)


def copy_bandwidth(nbytes: int, *, runs: int = 20, batch: int = 10) -> dict[str, float]:
  """The device copy ceiling: a jitted ``jnp.copy`` of ``nbytes`` (the input is not donated, so XLA must copy).

  Args:
    nbytes: size of the copied array; take it large (1 GiB on a GPU) so that launch costs vanish.
    runs: measurements.
    batch: copies per measurement.

  Returns:
    ``{"bytes": read + written, "ms": median per copy, "gbps": GB/s read + written, "hlo_copies": whether the
    compiled HLO holds a copy}``; if it does not, the number is no ceiling (the caller says so).
  """
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  copy = jax.jit(jnp.copy)
  copies = bool(re.search(r"\bcopy(-start)?\(", copy.lower(x).compile().as_text()))
  t = time_calls(copy, x, runs=runs, batch=batch)
  moved = 2 * x.nbytes
  return {"bytes": moved, "ms": t.ms, "gbps": gbps(moved, t.ms), "hlo_copies": copies}


def copy_bandwidth_loop(nbytes: int, *, inner: int = 50, runs: int = 20) -> dict[str, float]:
  """The copy ceiling measured like ``time_loop`` measures an op: ``x * s`` (``s`` = 1 at run time, so nothing
  folds away) reads and writes ``nbytes`` per iteration of a jitted loop.

  Returns:
    ``{"bytes": read + written, "ms": per iteration, "gbps": GB/s read + written}``.
  """
  x = jnp.ones((nbytes // 4,), jnp.float32)
  t = time_loop(lambda x, s: x * s, (x, jnp.float32(1.0)), inner=inner, runs=runs)
  moved = 2 * x.nbytes
  return {"bytes": moved, "ms": t.ms, "gbps": gbps(moved, t.ms)}


# ---- the GPU's clocks ---------------------------------------------------------------------------------------------


class ClockSampler:
  """``nvidia-smi`` samples (host time, SM MHz, W, clock-event reasons) every 50 ms in a background thread.

  A layer's rows carry the median SM clock and power while its calls ran back to back, and the share of samples at
  the power cap: on the H200 a layer step reaches the board's 700 W cap within ~100 ms of back-to-back calls
  (2026-12-02: SM clock 1,470-1,560 MHz instead of 1,980, "SW power cap" in 95-98% of the samples), so its time
  follows its energy per step more than its kernels' times in a short trace.
  """

  FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"
  POWER_CAP = 0x4  # nvidia-smi's "SW power cap" clock-event reason bit

  def __init__(self, period_ms: int = 50):
    self.samples: list[tuple[float, float, float, int]] = []
    self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                   f"-lms={period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    threading.Thread(target=self._read, daemon=True).start()

  @classmethod
  def start(cls) -> ClockSampler | None:
    """A running sampler, or None without ``nvidia-smi``."""
    return cls() if shutil.which("nvidia-smi") else None

  def _read(self) -> None:
    for line in self._proc.stdout:
      parts = [p.strip() for p in line.split(",")]
      try:
        self.samples.append((time.perf_counter(), float(parts[0]), float(parts[1]), int(parts[2], 16)))
      except (ValueError, IndexError):
        continue

  def summary(self, t0: float, t1: float) -> dict[str, float | None]:
    """Median SM MHz and W, and the share of samples at the power cap, between host times ``t0`` and ``t1``."""
    s = [x for x in self.samples if t0 <= x[0] <= t1]
    if not s:
      return dict(NO_CLOCKS)
    return {"sm_mhz": statistics.median(x[1] for x in s), "power_w": statistics.median(x[2] for x in s),
            "power_capped": sum(bool(x[3] & self.POWER_CAP) for x in s) / len(s)}

  def stop(self) -> None:
    self._proc.terminate()


NO_CLOCKS = {"sm_mhz": None, "power_w": None, "power_capped": None}


# ---- memory-bound ops against XLA's compilation of their jnp reference -------------------------------------------

# Below this many elements an op runs in tens of microseconds: time it in a jitted loop instead of per call.
LOOP_BELOW = 1 << 22
# A large op's shorter loop runs at least this long (and at least LOOP_MIN_INNER iterations): the loop's fixed costs
# (dispatch, final sync: tens of microseconds, with jitter of a few) cancel in the difference of the two loops, and
# 2 ms of iterations keep that jitter under ~1% of a sample. With ``ctx.inner`` (50) iterations for every op, the
# loops of the large ops took 3,300 calls each per row, most of the memory-bound benchmarks' time on the H200.
LOOP_MIN_MS = 2.0
LOOP_MIN_INNER = 8


def loop_inner(ctx: Context, n_elems: int, call_ms: float | None) -> int:
  """Iterations of the shorter loop: ``ctx.inner`` for small ops (whose reported time is the loop's); for large ops,
  enough iterations of their per-call time ``call_ms`` for ``LOOP_MIN_MS``, at most ``ctx.inner``."""
  if n_elems < LOOP_BELOW or not call_ms or not math.isfinite(call_ms):
    return ctx.inner
  return min(ctx.inner, max(LOOP_MIN_INNER, math.ceil(LOOP_MIN_MS / call_ms)))


def memory_bound_timing(ctx: Context, jitted: Callable[..., Any], plain: Callable[..., Any], args: Sequence[Any],
                        moved: int, n_elems: int) -> dict[str, Any]:
  """The timing fields of a memory-bound op's row (``report.MEMORY_BOUND_COLUMNS``).

  Three views of one time: back-to-back calls (the reported one for large inputs), a jitted loop (the reported one
  for small inputs; for large ones a check that dispatch is not what is measured), one synchronized call. ``jitted``
  has run once before (the output check), so each timing needs one warm-up only.

  Args:
    ctx: the benchmark context.
    jitted: the jitted op; plain: the same function unjitted (for ``time_loop``); args: its arguments, the last one a
      float scalar ``time_loop`` may perturb.
    moved: bytes read + written once each.
    n_elems: the size that picks loop timing (below ``LOOP_BELOW``) or per-call timing.
  """
  t_call = time_calls(jitted, *args, runs=ctx.runs, batch=ctx.batch, warmup=1) if n_elems >= LOOP_BELOW else None
  t_sync = time_calls(jitted, *args, runs=ctx.runs, warmup=1)
  inner = loop_inner(ctx, n_elems, t_call.ms if t_call else None)
  t_loop = time_loop(plain, args, inner=inner, runs=ctx.runs)
  t = t_call or t_loop
  rate = gbps(moved, t.ms)
  return {
      "bytes": moved,
      "ms": t.ms,
      "ms_loop": t_loop.ms,
      "ms_sync": t_sync.ms,
      "timing": t.as_dict(),
      "loop_inner": inner,
      "gbps": rate,
      "pct_copy": 100.0 * rate / ctx.copy_gbps,
      "pct_copy_loop": 100.0 * gbps(moved, t_loop.ms) / ctx.copy_loop_gbps,
  }


def judge_pair(te_row: dict, xla_row: dict, *, native: bool, expected: str, agree: bool) -> list[dict]:
  """Fills in speed-up, ok and note of a (te_jax, XLA) pair of rows: the te_jax row is ok when its native handler
  ran and its outputs agree with XLA's."""
  te_row["speedup_vs_xla"] = xla_row["ms"] / te_row["ms"]
  xla_row["speedup_vs_xla"] = 1.0
  problems = ([] if native else [f"NOT NATIVE (expected {expected})"]) + ([] if agree else ["MISMATCH vs XLA"])
  te_row["ok"] = not problems
  xla_row["ok"] = True
  te_row["note"] = "; ".join(filter(None, [te_row.get("note", ""), *problems]))
  return [te_row, xla_row]


def print_pair(bench: str, rows: Sequence[dict]) -> None:
  """One progress line (stderr) for a (te_jax, XLA) pair of rows."""
  te_row, xla_row = rows
  print(f"{bench} {te_row['case']}: te_jax {te_row['ms']:.4f} ms, xla {xla_row['ms']:.4f} ms, "
        f"{te_row['speedup_vs_xla']:.2f}x, {te_row['pct_copy']:.0f}% of copy BW ({te_row['pct_copy_loop']:.0f}% "
        f"in a loop), {te_row['handler']}" + (f" [{te_row['note']}]" if not te_row["ok"] else ""),
        file=sys.stderr, flush=True)


def run_pairs(ctx: Context, bench: str, cases: Sequence[Any], bench_case: Callable[..., list[dict]],
              seed: int = 0) -> list[dict]:
  """Runs ``bench_case(ctx, case, key)`` for every case (a (te_jax, XLA) pair of rows each, keys ``seed + i``),
  printing one progress line per pair; returns all rows in order."""
  rows = []
  for i, case in enumerate(cases):
    case_rows = bench_case(ctx, case, jax.random.key(seed + i))
    print_pair(bench, case_rows)
    rows += case_rows
  return rows


# ---- layers: fwd+bwd of Flax modules against Flax baselines ------------------------------------------------------


def layer_fwd_bwd(model: Any, rec: Any, **apply_kw: Any) -> Callable[..., Any]:
  """The jitted training computation of a layer: ``(variables, x, dy) -> (out, (d_variables, dx))``, the output and
  ``jax.vjp`` of ``model.apply`` w.r.t. the variables (parameters and FP8 state) and the input, under
  ``te_jax.autocast(recipe=rec)`` (FP8 off when ``rec`` is None)."""
  def f(variables, x, dy):
    with te_jax.autocast(enabled=rec is not None, recipe=rec):
      out, vjp = jax.vjp(lambda v, x: model.apply(v, x, **apply_kw), variables, x)
    return out, vjp(dy)

  return jax.jit(f)


def warm_layer(model: Any, rec: Any, fn: Callable[..., Any], key: jax.Array, x: jax.Array, dy: jax.Array,
               steps: int = 3, **init_kw: Any) -> tuple[Any, jax.Array]:
  """The layer's variables after ``steps`` calls of ``fn`` (so that delayed scaling's amax history holds real values;
  Flax's own FP8 ops keep their state in the same collection), and the last output.

  ``init`` runs jitted: one compile, where op-by-op initialisation compiled each initializer's ops on its own (~350
  compiles for the GPT layer's six implementations, a third of that benchmark's time in the CPU smoke run)."""
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    variables = jax.jit(functools.partial(model.init, **init_kw))(key, x)
  out = None
  for _ in range(steps):
    out, (grads, _) = fn(variables, x, dy)
    if te_jax.FP8_COLLECTION in grads:
      variables = {**variables, te_jax.FP8_COLLECTION: grads[te_jax.FP8_COLLECTION]}
  return variables, out


def layer_row(ctx: Context, fn: Callable[..., Any], args: Sequence[Any], *, flops: float, out: jax.Array,
              problems: list[str]) -> dict[str, Any]:
  """The timing, rate, temp memory, clock and handler fields of a layer's row; ``problems`` gets "non-finite output".

  Two times: ``ms``, calls dispatched back to back (the device never waits for the host: the step's own time, at the
  steady state a training loop without host syncs reaches, here the H200's power cap), and ``ms_sync``, one call
  waited on at a time (a loop that reads its loss every step; the host's dispatch counts, and the device idles
  between calls; the method of published baselines that time one step at a time). ``fn`` is warm (``warm_layer``):
  one warm-up call per timing."""
  t0 = time.perf_counter()
  t = time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch, warmup=1)
  clocks = ctx.clocks.summary(t0, time.perf_counter()) if ctx.clocks else dict(NO_CLOCKS)
  t_sync = time_calls(fn, *args, runs=ctx.runs, batch=1, warmup=1)
  compiled = fn.lower(*args).compile()
  targets = set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))
  if not bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))):
    problems.append("non-finite output")
  return {
      "ms": t.ms,
      "timing": t.as_dict(),
      "ms_sync": t_sync.ms,
      "tflops": flops / (t.ms * 1e-3) / 1e12,
      "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
      **clocks,
      "targets": sorted(targets),
      "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas", "__cudnn")))) or "xla",
  }


def print_layer_rows(bench: str, rows: Sequence[dict]) -> None:
  """One progress line (stderr) per timed layer row."""
  for r in rows:
    clocks = f", {r['sm_mhz']:.0f} MHz, {r['power_w']:.0f} W" if r.get("sm_mhz") else ""
    print(f"{bench} {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, "
          f"{r['speedup_vs_bf16']:.2f}x vs Flax bf16, {r['speedup_vs_flax_fp8']:.2f}x vs Flax fp8; "
          f"1 sync call {r['ms_sync']:.3f} ms, {r['speedup_vs_bf16_sync']:.2f}x / "
          f"{r['speedup_vs_flax_fp8_sync']:.2f}x, "
          f"temp {r['temp_mib']:.0f} MiB ({r['temp_vs_flax_fp8']:.2f}x){clocks}"
          + (f" [{r['note']}]" if not r["ok"] else ""), file=sys.stderr, flush=True)


def add_ratios(rows: list[dict], *, bf16: str, fp8: str) -> None:
  """Speed-ups against the ``bf16`` and ``fp8`` baseline impls, and temp memory against the ``fp8`` one."""
  by = {r["impl"]: r for r in rows}
  for r in rows:
    if r.get("ms") == r.get("ms"):  # not NaN: a timed row
      r["speedup_vs_bf16"] = by[bf16]["ms"] / r["ms"]
      r["speedup_vs_flax_fp8"] = by[fp8]["ms"] / r["ms"]
      r["speedup_vs_bf16_sync"] = by[bf16]["ms_sync"] / r["ms_sync"]
      r["speedup_vs_flax_fp8_sync"] = by[fp8]["ms_sync"] / r["ms_sync"]
    r["temp_vs_flax_fp8"] = r["temp_mib"] / by[fp8]["temp_mib"]


def gbps(nbytes: int, ms: float) -> float:
  """GB/s (10^9 bytes per second) for ``nbytes`` moved in ``ms`` milliseconds."""
  return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")


def custom_call_targets(jitted: Callable[..., Any], *args: Any) -> set[str]:
  """The custom-call targets in the optimised HLO of ``jitted(*args)``, e.g. ``{"te_quantize_cuda"}``."""
  return set(re.findall(r'custom_call_target="([^"]+)"', jitted.lower(*args).compile().as_text()))


def bits(x: jax.Array) -> jax.Array:
  """``x`` reinterpreted as unsigned integers of the same width, for bitwise comparisons on the device."""
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned)


def bitwise_equal(a: jax.Array, b: jax.Array) -> bool:
  """Same shape, dtype and bytes."""
  return a.shape == b.shape and a.dtype == b.dtype and bool(jnp.array_equal(bits(a), bits(b)))
