"""GEMM: te_jax's cuBLASLt FP8 GEMM vs XLA's bf16 GEMM (and te_jax's own bf16 path), same shape, same process.

FP8 operands are quantized once, outside the timed function: this measures the GEMM alone. Rates count
2*M*N*K FLOPs. Where PyTorch with CUDA is importable beside JAX (as on the GPU machine), two more rows time
``torch._scaled_mm`` (cuBLASLt's FP8 GEMM as PyTorch calls it) on the same FP8 bytes, with and without fast
accumulation: the same ceiling reached by another caller, timed the same way (10 back-to-back calls, then a sync), in
a child process.

The QKV case times the forward GEMM of a fused (H, 3, D) projection handed out as q, k and v: one GEMM of N = 3HD
whose output would still have to be split, three GEMMs of N = HD against each part's (pre-sliced) weight rows, and
``rhs_parts`` (one batched cuBLASLt launch writing the three arrays) on the weight's rows grouped by part, both
pre-grouped and grouped in the timed function (as the layer does, from the (H, 3, D)-ordered transposed FP8 kernel).

  python benchmarks/bench_gemm.py
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import harness
import te_jax

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
SHAPES = ((8192, 8192, 8192), (16384, 8192, 8192), (16384, 4096, 16384))  # (M, N, K)
QKV = (8192, 32, 128, 4096)  # tokens (batch 4 x sequence 2048), heads, head dim, hidden: the GPT layer's
COLUMNS = (
    ("case", "case"),
    ("impl", "impl"),
    ("ms", "ms"),
    ("TFLOP/s", "tflops"),
    ("vs XLA bf16", "speedup_vs_xla"),
    ("handler", "handler"),
    ("ok", "ok"),
    ("note", "note"),
)


def _operands(key, m, n, k):
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  return a, b


# Run in a child process, so that PyTorch's CUDA state (and a crash of it) stays out of this one: loads the FP8
# operands, times torch._scaled_mm like harness.time_calls, writes {"fast"|"full": {...}} and the outputs.
_TORCH_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, torch
d, runs, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a = torch.from_numpy(np.load(f"{d}/a.npy")).cuda().view(torch.float8_e4m3fn)
b = torch.from_numpy(np.load(f"{d}/b.npy")).cuda().view(torch.float8_e4m3fn)
one = torch.ones((), dtype=torch.float32, device="cuda")
result = {}
for key, fast in (("fast", True), ("full", False)):
  call = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)
  for _ in range(3):
    out = call()
  torch.cuda.synchronize()
  samples = []
  for _ in range(runs):
    start = time.perf_counter()
    for _ in range(batch):
      out = call()
    torch.cuda.synchronize()
    samples.append((time.perf_counter() - start) / batch)
  np.save(f"{d}/out_{key}.npy", out.float().cpu().numpy())
  result[key] = {"ms": statistics.median(samples) * 1e3, "ms_min": min(samples) * 1e3,
                 "ms_max": max(samples) * 1e3, "runs": len(samples), "torch": torch.__version__}
print(json.dumps(result))
"""


def _torch_rows(ctx: harness.Context, qa, qb, ref, flops: float, case: str) -> list[dict]:
  """``torch._scaled_mm`` (bf16 out, with and without fast accumulation) on the FP8 bytes of ``qa`` (M, K) and ``qb``
  (N, K), in a child process; no rows without a GPU or without PyTorch."""
  if not ctx.gpu or importlib.util.find_spec("torch") is None:
    return []
  with tempfile.TemporaryDirectory() as d:
    np.save(f"{d}/a.npy", np.asarray(qa).view(np.uint8))
    np.save(f"{d}/b.npy", np.asarray(qb).view(np.uint8))
    proc = subprocess.run([sys.executable, "-c", _TORCH_SCRIPT, d, str(ctx.runs), str(ctx.batch)],
                          capture_output=True, text=True, timeout=300, check=False)
    try:
      result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
      note = "torch._scaled_mm failed: " + " ".join(proc.stderr.split())[-200:]
      return [{"bench": "gemm", "case": case, "impl": "torch._scaled_mm fp8", "ms": float("nan"),
               "tflops": float("nan"), "handler": "torch (cuBLASLt)", "ok": False, "note": note}]
    rows = []
    for key, label in (("fast", " (fast acc)"), ("full", "")):
      t = result[key]
      got = jnp.asarray(np.load(f"{d}/out_{key}.npy"))
      rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
      problems = [] if rel <= 0.1 else [f"rel err {rel:.3g} > 0.1"]
      rows.append({"bench": "gemm", "case": case, "impl": f"torch._scaled_mm fp8{label}", "ms": t["ms"],
                   "timing": {k: t[k] for k in ("ms", "ms_min", "ms_max", "runs")},
                   "tflops": flops / (t["ms"] * 1e-3) / 1e12, "rel_err_vs_bf16": rel,
                   "handler": f"torch {t['torch']} (cuBLASLt)", "ok": not problems, "note": "; ".join(problems)})
  return rows


def bench_shape(ctx: harness.Context, mnk, key) -> list[dict]:
  m, n, k = (d // ctx.shrink for d in mnk)
  a, b = _operands(key, m, n, k)
  one = jnp.float32(1.0)
  qa, qb = te_jax.quantize(a, one), te_jax.quantize(b, one)
  inv = jnp.float32(1.0)
  impls = {
      "te_jax fp8 (fast acc)": (jax.jit(lambda x, y: te_jax.gemm(x, y, lhs_scale_inv=inv, rhs_scale_inv=inv,
                                                                fast_accum=True)), (qa.data, qb.data)),
      "te_jax fp8": (jax.jit(lambda x, y: te_jax.gemm(x, y, lhs_scale_inv=inv, rhs_scale_inv=inv)),
                     (qa.data, qb.data)),
      "te_jax bf16": (jax.jit(lambda x, y: te_jax.gemm(x, y)), (a, b)),
      "xla bf16": (jax.jit(lambda x, y: jnp.dot(x, y.T)), (a, b)),
  }
  flops = 2.0 * m * n * k
  ref = impls["xla bf16"][0](a, b).astype(jnp.float32)
  rows = []
  for name, (fn, args) in impls.items():
    t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
    targets = harness.custom_call_targets(fn, *args)
    native = name.startswith("xla") or f"te_gemm_{ctx.platform}" in targets or not ctx.gpu
    # Agreement: relative Frobenius error vs the bf16 GEMM; FP8 E4M3 rounding of both inputs bounds it near 2^-4.
    out = fn(*args).astype(jnp.float32)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    bound = 0.1 if "fp8" in name else 1e-2
    problems = ([] if native else ["NOT NATIVE"]) + ([] if rel <= bound else [f"rel err {rel:.3g} > {bound}"])
    rows.append({
        "bench": "gemm",
        "case": f"{m}x{n}x{k} -> bf16",
        "impl": name,
        "ms": t.ms,
        "timing": t.as_dict(),
        "tflops": flops / (t.ms * 1e-3) / 1e12,
        "rel_err_vs_bf16": rel,
        "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla",
        "ok": not problems,
        "note": "; ".join(problems),
    })
  rows += _torch_rows(ctx, qa.data, qb.data, ref, flops, f"{m}x{n}x{k} -> bf16")
  base = next(r for r in rows if r["impl"] == "xla bf16")["ms"]
  for r in rows:
    r["speedup_vs_xla"] = base / r["ms"]
  return rows


def bench_qkv(ctx: harness.Context, key) -> list[dict]:
  """The QKV projection's forward GEMM (FP8, fast accumulation, bf16 out) four ways; see the module docstring."""
  m, h, d, k = QKV[0] // ctx.shrink, QKV[1], QKV[2], QKV[3] // ctx.shrink
  x, w_t = _operands(key, m, 3 * h * d, k)  # w_t: (H * 3 * D, K), rows head-major as the (hidden, H, 3, D) kernel's
  one = jnp.float32(1.0)
  qx, qw = te_jax.quantize(x, one).data, te_jax.quantize(w_t, one).data
  group = lambda w: jnp.swapaxes(w.reshape(h, 3, d, k), 0, 1).reshape(3, h * d, k)
  grouped = group(qw)  # (3, H * D, K): each part's rows together
  per_part = tuple(grouped)
  gemm = functools.partial(te_jax.gemm, lhs_scale_inv=one, rhs_scale_inv=one, fast_accum=True)
  impls = {
      "one GEMM, N = 3HD (output not split)": (jax.jit(lambda a, b: gemm(a, b)), (qx, qw)),
      "3 GEMMs, N = HD (weight rows pre-sliced)": (jax.jit(lambda a, ws: tuple(gemm(a, w) for w in ws)),
                                                   (qx, per_part)),
      "rhs_parts: one batched GEMM (weight pre-grouped)": (jax.jit(lambda a, b: gemm(a, b, rhs_parts=True)),
                                                           (qx, grouped)),
      "rhs_parts, grouping the weight's rows too": (jax.jit(lambda a, b: gemm(a, group(b), rhs_parts=True)),
                                                    (qx, qw)),
  }
  want = impls["3 GEMMs, N = HD (weight rows pre-sliced)"][0](qx, per_part)
  flops = 2.0 * m * 3 * h * d * k
  case = f"QKV {m}x(3x{h}x{d})x{k} fp8 fast acc -> bf16"
  rows = []
  for name, (fn, args) in impls.items():
    t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
    targets = harness.custom_call_targets(fn, *args)
    out = fn(*args)
    problems = [] if f"te_gemm_{ctx.platform}" in targets or not ctx.gpu else ["NOT NATIVE"]
    if name.startswith("rhs_parts"):  # the same products as the per-part GEMMs, maybe summed in another order
      rel = max(float(jnp.linalg.norm((o - w).astype(jnp.float32)) / jnp.linalg.norm(w.astype(jnp.float32)))
                for o, w in zip(out, want))
      problems += [] if rel <= 1e-2 else [f"rel diff vs 3 GEMMs {rel:.3g} > 1e-2"]
    rows.append({"bench": "gemm", "case": case, "impl": name, "ms": t.ms, "timing": t.as_dict(),
                 "tflops": flops / (t.ms * 1e-3) / 1e12,
                 "handler": ", ".join(sorted(x for x in targets if x.startswith("te_"))) or "xla",
                 "ok": not problems, "note": "; ".join(problems)})
  base = next(r for r in rows if r["impl"].startswith("3 GEMMs"))["ms"]
  for r in rows:
    r["speedup_vs_xla"] = float("nan")
    r["note"] = "; ".join(filter(None, [f"{base / r['ms']:.3f}x the 3 GEMMs", r["note"]]))
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, mnk in enumerate(SHAPES):
    shape_rows = bench_shape(ctx, mnk, jax.random.key(100 + i))
    for r in shape_rows:
      print(f"gemm {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, "
            f"{r['speedup_vs_xla']:.2f}x vs XLA bf16" + (f" [{r['note']}]" if not r["ok"] else ""),
            file=sys.stderr, flush=True)
    rows += shape_rows
  for r in bench_qkv(ctx, jax.random.key(200)):
    print(f"gemm {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s; {r['note']}", file=sys.stderr,
          flush=True)
    rows.append(r)
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_gemm", "--no-write"]))
