"""Where a layer's time goes: device time per kernel of one fwd+bwd step, from a ``jax.profiler`` trace.

Profiles the GPT layer of ``bench_transformer`` (or the block of ``bench_layernorm_mlp``) for each implementation,
sums the device time of every kernel over the traced steps, and prints per step: the total, a split by kind (GEMM,
attention, te_jax kernels, XLA fusions, copies/transposes), the slowest kernels with the HLO op that launched them,
and the device's idle time by the op that ended each gap (kernels that XLA ran inside a command buffer, a CUDA graph,
are listed under that command buffer's op; without command buffers each kernel names its HLO op and that op's shapes).
A layer step draws the H200 to its power cap within ~100 ms of back-to-back calls (the layer rows' SM clock and
power, ``harness.ClockSampler``), so the default 5 steps show kernels at higher clocks than the timed benchmark;
``--steps 100`` is mostly at the cap. It also times
the untraced program as the benchmarks do (calls dispatched back to back) and the host's time to dispatch one call: a
per-call time above the traced one means the device waited on something the trace does not show. ``--bench ops`` does
the same for single te_jax ops at their acceptance shapes (``acceptance_ops``), one call per step: what a
benchmark's per-call time holds besides the kernel. ``--bench ops --ncu`` only runs each op twice, untraced, for Nsight
Compute to read its kernels' counters (``bash scripts/gpu_check.sh ncu``). ``--bench lm`` profiles a whole train step
of ``te_jax.compare``'s LM (``--preset``), where the table per op family (every layer's kernels of one HLO op summed)
says where the step goes; its state is not donated (each call makes a fresh state), so its untraced per-call time is
not the compare's step time.

  python benchmarks/profile_layer.py                       # the GPT layer: te_jax FP8 and Flax FP8
  python benchmarks/profile_layer.py --bench layernorm_mlp --impl "te_jax LayerNormMLP fp8"
  python benchmarks/profile_layer.py --bench ops           # gelu fwd (with and without the transposed copy), ...
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/profile_layer.py --bench lm --steps 3
                                                            # te_jax.compare's gpt-small train step, BF16 and FP8
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/profile_layer.py --steps 60   # per-GEMM times
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:'ActivationKernel|NormFwdKernel' \
      --section SpeedOfLight python benchmarks/profile_layer.py --bench ops --ncu

Under ncu, without XLA_PYTHON_CLIENT_PREALLOCATE=false JAX reserves most of the GPU's memory and ncu saves and restores
all of it for each of a kernel's replay passes: minutes per kernel on the H200 (its 240 s step once ended with nothing).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

import bench_layernorm_mlp
import bench_transformer
import harness
import te_jax
from te_jax import ScalingMode
from te_jax import recipe as te_recipe
from te_jax.compare import lm, train
from te_jax.ops.activation import activation_bwd, activation_fwd
from te_jax.ops.norm import norm_bwd, norm_fwd
from te_jax.ops.quantize_block import quantize_block

# Kernel kinds, by kernel name (first match wins: cuDNN's attention kernels also name their architecture).
KINDS = (
    ("te_jax", re.compile(r"te_jax::")),
    ("attention", re.compile(r"fmha|flash|sdpa|cudnn|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|Kernel2", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|memcpy|memset", re.I)),
    ("xla fusion", re.compile(r"fusion|loop_|input_|reduce|convert|triton|wrapped|concatenate|slice", re.I)),
)


def _kind(name: str) -> str:
  return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def _stat(event, key: str) -> str:
  for k, v in event.stats:
    if k == key:
      return str(v)
  return ""


def kernel_times(fn, args, steps: int) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]], float]:
  """{(kernel name, hlo op): [total ns, launches]} over ``steps`` traced calls of ``fn``; the device's idle time
  before each kernel {hlo op of the kernel after the gap: [total ns, gaps]}; the traced span in ns (first kernel's
  start to last kernel's end)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        out = fn(*args)
      jax.block_until_ready(out)
    (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    profile = ProfileData.from_file(path)
  totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
  events = []  # (start, end, hlo op or kernel name)
  planes = [p for p in profile.planes if p.name.startswith("/device:GPU:0")]
  # Without a GPU: the host's XLA threads, and XLA's ops on the Python thread (where a small program runs).
  for plane in planes or [p for p in profile.planes if p.name == "/host:CPU"]:
    lines = ([line for line in plane.lines if line.name.startswith("Stream")] if planes else
             [line for line in plane.lines if line.name.startswith("tf_XLA") or line.name == "python"])
    for line in lines:
      for e in line.events:
        op = _stat(e, "hlo_op")
        if line.name == "python" and not op:
          continue
        t = totals[(e.name, op)]
        t[0] += e.duration_ns
        t[1] += 1
        events.append((e.start_ns, e.start_ns + e.duration_ns, op or e.name))
  gaps: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  events.sort()
  busy_until = events[0][1] if events else 0.0
  for start, end, op in events[1:]:
    if start > busy_until:  # the device idle (no kernel on any stream) until this one starts
      g = gaps[op]
      g[0] += start - busy_until
      g[1] += 1
    busy_until = max(busy_until, end)
  span = busy_until - events[0][0] if events else 0.0
  return totals, gaps, span


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _written(out) -> tuple:
  """What an FP8 op wrote (its output's data and transposed copy, then amax, dbias or the statistics), without the
  output's scale_inv (1 / its scale argument, one more XLA op), as the benchmarks time the op."""
  return (out.out.data, out.out.data_t, *out[1:])


def acceptance_ops(shrink: int = 1) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
  """{name: (jitted op, its arguments)} at the acceptance shapes, every dimension divided by ``shrink``: gelu
  (16384, 16384) bf16 -> E4M3 with and without the transposed copy and its backward to E5M2 with the transposed copy
  and dbias (bench_activation's), LayerNorm and RMSNorm (32768, 8192) bf16 -> E4M3 (bench_norm's), the LayerNorm
  backward with a residual gradient at the GPT layer's (8192, 4096), and the 1 GiB copy of the benchmarks' ceiling."""
  n = 16384 // shrink
  kx, kg = jax.random.split(jax.random.key(0))
  x = (3.0 * jax.random.normal(kx, (n, n), jnp.float32)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (n, n), jnp.float32).astype(jnp.bfloat16)
  scale = jnp.float32(16.0)

  def gelu_fwd(transpose):
    return jax.jit(lambda x, s: _written(activation_fwd(x, ("gelu",), dtype=E4M3, scale=s, transpose=transpose)))

  ops = {
      "gelu fwd +T": (gelu_fwd(True), (x, scale)),
      "gelu fwd": (gelu_fwd(False), (x, scale)),
      "gelu bwd": (jax.jit(lambda g, x, s: _written(activation_bwd(g, x, ("gelu",), dtype=E5M2, scale=s,
                                                                   transpose=True, dbias=True))), (g, x, scale)),
  }
  xn = x.reshape(2 * n, n // 2)
  gamma, beta = jnp.ones((n // 2,), jnp.float32), jnp.zeros((n // 2,), jnp.float32)
  ops["layernorm fwd"] = (jax.jit(lambda x, gm, b, s: _written(norm_fwd(x, gm, b, norm_type="layernorm", epsilon=1e-6,
                                                                        dtype=E4M3, scale=s))),
                          (xn, gamma, beta, scale))
  ops["rmsnorm fwd"] = (jax.jit(lambda x, gm, s: _written(norm_fwd(x, gm, norm_type="rmsnorm", epsilon=1e-6,
                                                                   dtype=E4M3, scale=s))), (xn, gamma, scale))
  # The LayerNorm backward at the GPT layer's shape (8192 tokens, hidden 4096), with the residual gradient added in.
  xl, gl = x[:n // 2, :n // 4], g[:n // 2, :n // 4]
  mean, rsigma = jnp.mean(xl.astype(jnp.float32), axis=-1), jnp.ones((n // 2,), jnp.float32)
  ops["layernorm bwd + dres (GPT layer)"] = (
      jax.jit(lambda dz, x, m, r, gm, dres: norm_bwd(dz, x, m, r, gm, dres=dres)),
      (gl, xl, mean, rsigma, jnp.ones((n // 4,), jnp.float32), gl))
  # The block-scaled casts at bench_quantize's shape (8192, 4096) bf16, with and without the transposed copy.
  xb = x[:n // 2, :n // 4]
  for label, mode, t in (("1x128", ScalingMode.BLOCK_1X128, False), ("1x128 +T", ScalingMode.BLOCK_1X128, True),
                         ("128x128 +T", ScalingMode.BLOCK_128X128, True), ("mxfp8 +T", ScalingMode.MXFP8_1X32, True),
                         ("nvfp4 +T", ScalingMode.NVFP4_1X16, True)):
    ops[f"quantize_block {label}"] = (
        jax.jit(lambda x, mode=mode, t=t: jax.tree.leaves(quantize_block(x, mode, with_transposed=t))), (xb,))
  # The copy ceiling as the benchmarks measure it (a 1 GiB jnp.copy), for kernel-time bandwidths against its own.
  ops["copy 1 GiB"] = (jax.jit(jnp.copy), (jnp.zeros(((1 << 28) // shrink**2,), jnp.float32),))
  return ops


# Calls dispatched back to back per untraced measurement: the benchmarks' own (harness.Context's default).
HOST_BATCH = harness.Context.batch


def host_times(fn, args, runs: int = 20, batch: int = HOST_BATCH) -> tuple[float, float]:
  """(ms per call of ``batch`` calls dispatched back to back, as the benchmarks time them; ms the host takes to
  dispatch one call, i.e. for ``fn(*args)`` to return without waiting for the device), medians over ``runs``. Where
  the first is above the traced device time per step, the device waited on the host or on something untraced."""
  per_call, dispatch = [], []
  jax.block_until_ready(fn(*args))
  for _ in range(runs):
    start = time.perf_counter()
    for i in range(batch):
      t = time.perf_counter()
      out = fn(*args)
      if i:  # the first call of a batch may wait for a free buffer of the previous batch
        dispatch.append(time.perf_counter() - t)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / batch)
  return statistics.median(per_call) * 1e3, statistics.median(dispatch) * 1e3


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (.*?) (custom-call|fusion|[a-z-]+)\((.*?)\)(?:,|$)")
_LAYOUT = re.compile(r"\{[^{}]*\}")


def op_shapes(fn, args) -> dict[str, str]:
  """{HLO op name: "result <- operands" types} of the compiled program, for the kernel table (kernels that XLA runs
  outside a command buffer name their op; run with XLA_FLAGS=--xla_gpu_enable_command_buffer= to see every op)."""
  lines = [m for m in map(_HLO_LINE.match, fn.lower(*args).compile().as_text().splitlines()) if m]
  types = {m.group(1): _LAYOUT.sub("", m.group(2)) for m in lines}
  return {m.group(1): types[m.group(1)] + " <- " + ", ".join(types.get(o, "?") for o in
                                                             re.findall(r"%([\w.-]+)", m.group(4)))
          for m in lines}


def report(name: str, profiled, steps: int, top: int, host: tuple[float, float],
           shapes: dict[str, str] | None = None) -> None:
  totals, gaps, span = profiled
  shapes = shapes or {}
  total = sum(t for t, _ in totals.values()) / steps / 1e6
  idle = sum(t for t, _ in gaps.values()) / steps / 1e6
  by_kind = collections.defaultdict(float)
  for (kernel, _), (t, _) in totals.items():
    by_kind[_kind(kernel)] += t / steps / 1e6
  print(f"\n## {name}: {total:.3f} ms of kernels per step; {span / steps / 1e6:.3f} ms traced per step, of which "
        f"{idle:.3f} ms the device was idle")
  print(f"untraced: {host[0]:.3f} ms per call of {HOST_BATCH} dispatched back to back; the host dispatches one call in "
        f"{host[1]:.3f} ms")
  print("| kind | ms | share |\n|---|---|---|")
  for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    print(f"| {kind} | {ms:.3f} | {ms / total:.1%} |")
  # Per op family (the HLO op's name without its number, e.g. every layer's te_act_bwd): where a model's step goes.
  families: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for (kernel, op), (t, n) in totals.items():
    f = families[(re.sub(r"\.\d+$", "", op) if op else kernel[:60], _kind(kernel))]
    f[0] += t
    f[1] += n
  print("\n| op family | kind | ms | share | launches |\n|---|---|---|---|---|")
  for (family, kind), (t, n) in sorted(families.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"| {family} | {kind} | {t / steps / 1e6:.3f} | {t / steps / 1e6 / total:.1%} | {n / steps:g} |")
  print("\n| kernel | hlo op | kind | ms | launches |\n|---|---|---|---|---|")
  for (kernel, op), (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
    short = kernel if len(kernel) <= 90 else kernel[:87] + "..."
    where = f"{op} ({shapes[op][:120]})" if op in shapes else op
    print(f"| `{short}` | {where} | {_kind(kernel)} | {t / steps / 1e6:.3f} | {n / steps:g} |")
  print("\n| idle before | ms | gaps |\n|---|---|---|")
  for op, (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top // 2]:
    print(f"| {op[:90]} | {t / steps / 1e6:.3f} | {n / steps:g} |")


def layer_steps(bench: str, names: list[str] | None = None, shrink: int = 1):
  """(name, jitted fwd+bwd step, its args) of each implementation ``names`` of the benchmark's layer (default: the
  FP8 ones without FP8 attention) at its acceptance shape, every dimension but the batch divided by ``shrink``;
  each step compiled and warmed up (``harness.warm_layer``) before it is yielded."""
  kx, kd = jax.random.split(jax.random.key(7))
  if bench == "transformer":
    c = {k: v if k == "batch" else max(1, v // shrink) for k, v in bench_transformer.LAYER.items()}
    impls = bench_transformer.impls(c)
    shape = (c["batch"], c["seq"], c["hidden"])
    te_kw = {"deterministic": True}
  else:
    tokens, hidden, intermediate = (d // shrink for d in bench_layernorm_mlp.SHAPES[0])
    impls = bench_layernorm_mlp.impls(hidden, intermediate)
    shape = (tokens, hidden)
    te_kw = {}
  x = jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, shape, jnp.float32).astype(jnp.bfloat16)
  for name in names or [n for n in impls if n.endswith("fp8") and "attention" not in n]:
    model, rec = impls[name]
    kw = te_kw if name.startswith("te_jax") else {}
    fn = harness.layer_fwd_bwd(model, rec, **kw)
    variables, _ = harness.warm_layer(model, rec, fn, jax.random.key(8), x, dy, **kw)
    yield name, fn, (variables, x, dy)


def lm_steps(preset: str, names: list[str] | None = None, shrink: int = 1):
  """(name, jitted train step, its args) of ``te_jax.compare``'s byte-level LM at ``preset`` (hidden, mlp and the
  sequence divided by ``shrink``): the BF16 run and the FP8 one (delayed scaling), each a whole train step (forward,
  backward, AdamW) exactly as ``python -m te_jax.compare`` times it. The state is not donated here, so that the
  same arguments serve every call."""
  p = lm.PRESETS[preset]
  fields = {k: v // shrink if k in ("hidden", "mlp") else v for k, v in p.model.items()}
  model = lm.LM(**fields)
  seq = max(8, p.seq // shrink)
  tokens = jax.random.randint(jax.random.key(0), (p.batch, seq + 1), 0, lm.VOCAB)
  batch = (tokens[:, :-1], tokens[:, 1:])
  params = model.init(jax.random.key(1), batch[0])["params"]
  runs = {"BF16": None, "FP8": te_recipe.DelayedScaling()}
  for name in names or runs:
    rec = runs[name]

    def precision(rec=rec):
      return te_jax.autocast(enabled=rec is not None, recipe=rec)

    with precision():
      state, step = train.train_state_and_step(train.Run(name, model, rec, p.steps), params, batch, lr=p.lr,
                                               donate=False)

    @jax.jit
    def fn(state, batch, step=step, precision=precision):
      with precision():
        return step(state, batch)

    jax.block_until_ready(fn(state, batch))
    yield f"LM {preset} {name}", fn, (state, batch)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bench", choices=("transformer", "layernorm_mlp", "ops", "lm"), default="transformer")
  parser.add_argument("--preset", choices=sorted(lm.PRESETS), default="gpt-small",
                      help="with --bench lm: te_jax.compare's preset")
  parser.add_argument("--impl", action="append",
                      help="implementation (or, with --bench ops, op) name; repeatable; default: the two FP8 ones "
                           "(every op)")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--shrink", type=int, default=1, help="divide the dimensions by this (a quick CPU run)")
  parser.add_argument("--untraced", action="store_true",
                      help="only the untraced times (per call, dispatch), e.g. to compare XLA_FLAGS settings")
  parser.add_argument("--ncu", action="store_true",
                      help="with --bench ops: run each op twice (the first call compiles; ncu's --launch-skip can "
                           "drop it), untraced, for Nsight Compute")
  a = parser.parse_args(argv)
  if a.bench == "ops":
    ops = acceptance_ops(a.shrink)
    unknown = [name for name in a.impl or [] if name not in ops]
    if unknown:
      parser.error(f"unknown op {unknown[0]!r}; the ops are {', '.join(map(repr, ops))}")
    for name in a.impl or ops:
      fn, args = ops[name]
      if a.ncu:
        for _ in range(2):
          jax.block_until_ready(fn(*args))
        print(f"ran {name}", flush=True)
        continue
      report(name, kernel_times(fn, args, a.steps), a.steps, a.top, host_times(fn, args))
    return 0
  steps = (lm_steps(a.preset, a.impl, a.shrink) if a.bench == "lm" else layer_steps(a.bench, a.impl, a.shrink))
  for name, fn, args in steps:
    if a.untraced:
      per_call, dispatch = host_times(fn, args)
      print(f"{name}: {per_call:.3f} ms per call of {HOST_BATCH} dispatched back to back, {dispatch:.3f} ms to "
            f"dispatch one (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})", flush=True)
      continue
    report(name, kernel_times(fn, args, a.steps), a.steps, a.top, host_times(fn, args), op_shapes(fn, args))
  return 0


if __name__ == "__main__":
  sys.exit(main())
