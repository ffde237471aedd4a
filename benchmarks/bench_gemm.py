"""GEMM: te_jax's cuBLASLt FP8 GEMM vs XLA's bf16 GEMM (and te_jax's own bf16 path), same shape, same process.

FP8 operands are quantized once, outside the timed function: this measures the GEMM alone. Rates count
2*M*N*K FLOPs. Where PyTorch with CUDA is importable beside JAX (as on the GPU machine), two more rows time
``torch._scaled_mm`` (cuBLASLt's FP8 GEMM as PyTorch calls it) on the same FP8 bytes, with and without fast
accumulation: the same ceiling reached by another caller, timed the same way (10 back-to-back calls, then a sync), in
one child process for all shapes.

The QKV case times the forward GEMM of a fused (H, 3, D) projection handed out as q, k and v: one GEMM of N = 3HD
whose output would still have to be split, three GEMMs of N = HD against each part's (pre-sliced) weight rows, and
``rhs_parts`` (one batched cuBLASLt launch writing the three arrays) on the weight's rows grouped by part, both
pre-grouped and grouped in the timed function (as the layer does, from the (H, 3, D)-ordered transposed FP8 kernel).

The accuracy rows (bench ``gemm_accuracy``) back the recipes' default of full-precision accumulation in dgrad and
wgrad: Hopper's FP8 tensor-core MMA keeps fewer accumulator bits than float32; cuBLASLt's default accumulation promotes
the partial sums to float32 as it goes, its FAST_ACCUM mode does not, so fast accumulation's error grows with K (the
token count, for wgrad). They run a backward GEMM's operands (E5M2 gradient x E4M3 operand, float32 out, per-tensor
scales) both ways through te_jax's GEMM and compare with the exact product of the same FP8 values (a float32 GEMM at
HIGHEST precision of the dequantized operands: each product is exact in float32, only float32 summation error
remains); the FP8 quantization's own error is that exact product's distance from the product of the unquantized
operands. Errors are relative to the RMS of the exact output: ``rel_rms``, ``rel_max`` and ``bias``, the mean of
error * sign(exact output), negative when the accumulation loses magnitude. On the CPU both accumulations are exact.

The block-scaled rows (bench ``gemm_block``) time DeepSeek-style block scaling (1 x 128 activations and gradients,
128 x 128 weights; cuBLASLt's VEC128 / BLK128x128 scale modes on Hopper) at 8192^3 and at the three GEMMs of a
4096-wide linear layer at 8192 tokens (forward x . kernel^T and dgrad g . kernel: 1 x 128 by 128 x 128; wgrad
x^T . g contracting the tokens: 1 x 128 by 1 x 128), beside XLA's bf16 GEMM and te_jax's per-tensor FP8 GEMM on the
same shape, with and without fast accumulation (cuBLASLt has no fast-accumulation block-scaled kernel, so the block
rows with ``fast_accum=True`` run the same kernel; they are compared with per-tensor FP8's fast rows); operands
quantized once, outside the timed function (the scales' conversion into cuBLASLt's layouts is inside it, and timed
alone in the ``scale layout`` row). Targets at 8192^3: >= 1.5x XLA bf16 and >= 85% of per-tensor FP8.

  python benchmarks/bench_gemm.py
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import harness
from te_jax import QuantizedTensor
from te_jax import ScalingMode
from te_jax.ops.gemm import gemm
from te_jax.ops.gemm_block import block_gemm_path, kernel_scales
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_block import quantize_block_ref

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
SHAPES = ((8192, 8192, 8192), (16384, 8192, 8192), (16384, 4096, 16384))  # (M, N, K)
QKV = (8192, 32, 128, 4096)  # tokens (batch 4 x sequence 2048), heads, head dim, hidden: the GPT layer's


def _operands(key, m, n, k):
  ka, kb = jax.random.split(key)
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (n, k), jnp.float32).astype(jnp.bfloat16)
  return a, b


# Run in a child process, so that PyTorch's CUDA state (and a crash of it) stays out of this one; one process for every
# shape (PyTorch's import and CUDA start-up once): loads each shape's FP8 operands, times torch._scaled_mm like
# harness.time_calls, prints {shape index: {"fast"|"full": {...}}} and saves the outputs.
_TORCH_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np, torch
d, shapes, runs, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
one = torch.ones((), dtype=torch.float32, device="cuda")
result = {}
for i in range(shapes):
  a = torch.from_numpy(np.load(f"{d}/a{i}.npy")).cuda().view(torch.float8_e4m3fn)
  b = torch.from_numpy(np.load(f"{d}/b{i}.npy")).cuda().view(torch.float8_e4m3fn)
  result[i] = {}
  for key, fast in (("fast", True), ("full", False)):
    call = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)
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
    np.save(f"{d}/out{i}_{key}.npy", out.float().cpu().numpy())
    result[i][key] = {"ms": statistics.median(samples) * 1e3, "ms_min": min(samples) * 1e3,
                      "ms_max": max(samples) * 1e3, "runs": len(samples), "torch": torch.__version__}
print(json.dumps(result))
"""


def _with_torch(ctx: harness.Context) -> bool:
  return ctx.gpu and importlib.util.find_spec("torch") is not None


def _run_torch(ctx: harness.Context, d: str, shapes: int) -> dict | str:
  """torch._scaled_mm on the operands saved in ``d`` (``a{i}.npy``, ``b{i}.npy``): its result, or why it failed."""
  proc = subprocess.run([sys.executable, "-c", _TORCH_SCRIPT, d, str(shapes), str(ctx.runs), str(ctx.batch)],
                        capture_output=True, text=True, timeout=300, check=False)
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (IndexError, ValueError):
    return "torch._scaled_mm failed: " + " ".join(proc.stderr.split())[-200:]


def _torch_rows(result: dict | str, i: int, d: str, ref, flops: float, case: str) -> list[dict]:
  """The two ``torch._scaled_mm`` rows of shape ``i`` (bf16 out, with and without fast accumulation)."""
  if isinstance(result, str):
    return [{"bench": "gemm", "case": case, "impl": "torch._scaled_mm fp8", "ms": float("nan"),
             "tflops": float("nan"), "handler": "torch (cuBLASLt)", "ok": False, "note": result}]
  rows = []
  for key, label in (("fast", " (fast acc)"), ("full", "")):
    t = result[str(i)][key]
    got = jnp.asarray(np.load(f"{d}/out{i}_{key}.npy"))
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    problems = [] if rel <= 0.1 else [f"rel err {rel:.3g} > 0.1"]
    rows.append({"bench": "gemm", "case": case, "impl": f"torch._scaled_mm fp8{label}", "ms": t["ms"],
                 "timing": {k: t[k] for k in ("ms", "ms_min", "ms_max", "runs")},
                 "tflops": flops / (t["ms"] * 1e-3) / 1e12, "rel_err_vs_bf16": rel,
                 "handler": f"torch {t['torch']} (cuBLASLt)", "ok": not problems, "note": "; ".join(problems)})
  return rows


def bench_shape(ctx: harness.Context, mnk, key, save: tuple[str, int] | None) -> tuple[list[dict], jax.Array, float]:
  """The te_jax and XLA rows of one shape, the bf16 reference output and the FLOPs; with ``save = (d, i)``, the FP8
  operands' bytes are saved as ``d/a{i}.npy`` and ``d/b{i}.npy`` for torch."""
  m, n, k = (d // ctx.shrink for d in mnk)
  a, b = _operands(key, m, n, k)
  one = jnp.float32(1.0)
  qa, qb = quantize(a, one).out, quantize(b, one).out
  inv = jnp.float32(1.0)
  fp8 = lambda x: QuantizedTensor(x, inv)  # noqa: E731 - the FP8 bytes timed as arguments, the scale a constant
  impls = {
      "te_jax fp8 (fast acc)": (jax.jit(lambda x, y: gemm(fp8(x), fp8(y), fast_accum=True)), (qa.data, qb.data)),
      "te_jax fp8": (jax.jit(lambda x, y: gemm(fp8(x), fp8(y))), (qa.data, qb.data)),
      "te_jax bf16": (jax.jit(lambda x, y: gemm(x, y)), (a, b)),
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
  if save:
    np.save(f"{save[0]}/a{save[1]}.npy", np.asarray(qa.data).view(np.uint8))
    np.save(f"{save[0]}/b{save[1]}.npy", np.asarray(qb.data).view(np.uint8))
  return rows, ref, flops


def bench_qkv(ctx: harness.Context, key) -> list[dict]:
  """The QKV projection's forward GEMM (FP8, fast accumulation, bf16 out) four ways; see the module docstring."""
  m, h, d, k = QKV[0] // ctx.shrink, QKV[1], QKV[2], QKV[3] // ctx.shrink
  x, w_t = _operands(key, m, 3 * h * d, k)  # w_t: (H * 3 * D, K), rows head-major as the (hidden, H, 3, D) kernel's
  one = jnp.float32(1.0)
  qx, qw = quantize(x, one).out.data, quantize(w_t, one).out.data
  group = lambda w: jnp.swapaxes(w.reshape(h, 3, d, k), 0, 1).reshape(3, h * d, k)
  grouped = group(qw)  # (3, H * D, K): each part's rows together
  per_part = tuple(grouped)

  def fp8_gemm(a, b, **kw):
    return gemm(QuantizedTensor(a, one), QuantizedTensor(b, one), fast_accum=True, **kw)

  impls = {
      "one GEMM, N = 3HD (output not split)": (jax.jit(lambda a, b: fp8_gemm(a, b)), (qx, qw)),
      "3 GEMMs, N = HD (weight rows pre-sliced)": (jax.jit(lambda a, ws: tuple(fp8_gemm(a, w) for w in ws)),
                                                   (qx, per_part)),
      "rhs_parts: one batched GEMM (weight pre-grouped)": (jax.jit(lambda a, b: fp8_gemm(a, b, rhs_parts=True)),
                                                           (qx, grouped)),
      "rhs_parts, grouping the weight's rows too": (jax.jit(lambda a, b: fp8_gemm(a, group(b), rhs_parts=True)),
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


ACCURACY_MN = 4096
ACCURACY_KS = (4096, 8192, 16384)
ACCURACY_OPERANDS = {
    # name: the other operand's distribution (the gradient is normal): a dgrad sees a signed operand, a wgrad after
    # GELU a mostly positive one (its sums do not cancel, so they grow with K)
    "signed operand": jax.random.normal,
    "GELU-activation operand": lambda k, s: jax.nn.gelu(jax.random.normal(k, s)),
}


def _scaled(x, dtype):
  """``x`` scaled to ``dtype``'s full range by its amax: the FP8 array and the scale's inverse."""
  scale = float(jnp.finfo(dtype).max) / jnp.max(jnp.abs(x.astype(jnp.float32)))
  return quantize(x, scale, dtype).out.data, 1.0 / scale


def _errors(out, exact):
  """(rms, max, bias) of ``out - exact`` relative to the RMS of ``exact``."""
  rms = jnp.sqrt(jnp.mean(exact * exact))
  err = out - exact
  return jnp.stack([jnp.sqrt(jnp.mean(err * err)) / rms, jnp.max(jnp.abs(err)) / rms,
                    jnp.mean(err * jnp.sign(exact)) / rms])


@jax.jit
def _accuracy(g, a):
  """Errors of the FP8 GEMM g (M, K) x a (N, K) -> float32 with full-precision and fast accumulation against the
  exact product of the same FP8 values, and of that product against the unquantized operands' (3 x (rms, max, bias))."""
  g8, g_inv = _scaled(g, jnp.float8_e5m2)
  a8, a_inv = _scaled(a, jnp.float8_e4m3fn)
  dot = lambda x, y: jnp.dot(x, y.T, precision=jax.lax.Precision.HIGHEST)
  exact = dot(g8.astype(jnp.float32) * g_inv, a8.astype(jnp.float32) * a_inv)
  fp8 = lambda fast: gemm(QuantizedTensor(g8, g_inv), QuantizedTensor(a8, a_inv), dtype=jnp.float32,  # noqa: E731
                          fast_accum=fast)
  return jnp.stack([_errors(fp8(False), exact), _errors(fp8(True), exact),
                    _errors(exact, dot(g.astype(jnp.float32), a.astype(jnp.float32)))])


def accuracy_rows(ctx: harness.Context, key) -> list[dict]:
  """The ``gemm_accuracy`` rows: for each operand distribution and K, the three errors (see the module docstring)."""
  mn = ACCURACY_MN // ctx.shrink
  rows = []
  for name, operand in ACCURACY_OPERANDS.items():
    for k in (kk // ctx.shrink for kk in ACCURACY_KS):
      key, kg, ka = jax.random.split(key, 3)
      g = jax.random.normal(kg, (mn, k)).astype(jnp.bfloat16)
      a = operand(ka, (mn, k)).astype(jnp.bfloat16)
      targets = harness.custom_call_targets(_accuracy, g, a)
      native = f"te_gemm_{ctx.platform}" in targets or not ctx.gpu
      errors = np.asarray(_accuracy(g, a))
      case = f"({mn}, {k}) E5M2 x ({mn}, {k}) E4M3 -> float32, {name}"
      for impl, (rms, mx, bias) in zip(("full-precision accumulation", "fast accumulation",
                                        "FP8 quantization (vs unquantized operands)"), errors.tolist()):
        problems = ([] if native else ["NOT NATIVE"]) + ([] if np.isfinite([rms, mx, bias]).all() else ["non-finite"])
        rows.append({"bench": "gemm_accuracy", "case": case, "impl": impl, "k": k, "rel_rms": rms, "rel_max": mx,
                     "bias": bias, "handler": ", ".join(sorted(t for t in targets if t.startswith("te_"))) or "xla",
                     "ok": not problems,
                     "note": "; ".join(problems) or ("" if ctx.gpu else "pure-JAX path: both accumulations exact")})
      print(f"gemm accuracy {case}: rel rms full {errors[0][0]:.2e}, fast {errors[1][0]:.2e}, quantization "
            f"{errors[2][0]:.2e}", file=sys.stderr, flush=True)
  return rows


# (case, M, N, K, lhs mode, rhs mode): lhs (M, K), rhs (N, K)
BLOCK_CASES = (
    ("8192^3 forward", 8192, 8192, 8192, ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128),
    ("layer 4096, 8192 tokens: forward", 8192, 4096, 4096, ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128),
    ("layer 4096, 8192 tokens: dgrad", 8192, 4096, 4096, ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_128X128),
    ("layer 4096, 8192 tokens: wgrad", 4096, 4096, 8192, ScalingMode.BLOCK_1X128, ScalingMode.BLOCK_1X128),
)


def bench_block(ctx: harness.Context) -> list[dict]:
  """The ``gemm_block`` rows (see the module docstring)."""
  rows = []
  quantize_jit = jax.jit(quantize_block_ref, static_argnums=1)
  for i, (case, m, n, k, lm, rm) in enumerate(BLOCK_CASES):
    m, n, k = m // ctx.shrink, n // ctx.shrink, k // ctx.shrink
    a, b = _operands(jax.random.key(300 + i), m, n, k)
    qa, qb = quantize_jit(a, lm), quantize_jit(b, rm)
    one = jnp.float32(1.0)
    pa, pb = quantize(a, one).out.data, quantize(b, one).out.data
    pt = lambda x: QuantizedTensor(x, one)  # noqa: E731
    layouts = jax.jit(lambda x, y: (kernel_scales(x.scale_inv, x.mode, x.shape, 1),
                                    kernel_scales(y.scale_inv, y.mode, y.shape, 1)))
    impls = {
        "xla bf16": (jax.jit(lambda x, y: jnp.dot(x, y.T)), (a, b)),
        "te_jax fp8 per-tensor": (jax.jit(lambda x, y: gemm(pt(x), pt(y))), (pa, pb)),
        "te_jax fp8 per-tensor (fast acc)": (jax.jit(lambda x, y: gemm(pt(x), pt(y), fast_accum=True)), (pa, pb)),
        "te_jax fp8 block": (jax.jit(lambda x, y: gemm(x, y)), (qa, qb)),
        "te_jax fp8 block (fast acc)": (jax.jit(lambda x, y: gemm(x, y, fast_accum=True)), (qa, qb)),
        "scale layout (both operands' scales into cuBLASLt's layouts)": (layouts, (qa, qb)),
    }
    flops = 2.0 * m * n * k
    ref = impls["xla bf16"][0](a, b).astype(jnp.float32)
    path = block_gemm_path(qa, qb)
    label = f"{case}: {m}x{n}x{k} {lm.name} x {rm.name} -> bf16"
    case_rows = []
    for name, (fn, args) in impls.items():
      t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
      targets = harness.custom_call_targets(fn, *args)
      problems = []
      if "block" in name and ctx.gpu and path != "native":
        problems.append(f"NOT NATIVE ({path})")
      if name != "xla bf16" and not name.startswith("scale") and ctx.gpu and f"te_gemm_{ctx.platform}" not in targets:
        problems.append("NOT NATIVE")
      row = {"bench": "gemm_block", "case": label, "impl": name, "ms": t.ms, "timing": t.as_dict(),
             "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla"}
      if not name.startswith("scale"):
        out = fn(*args).astype(jnp.float32)
        rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        problems += [] if rel <= 0.1 else [f"rel err {rel:.3g} > 0.1"]
        row.update(tflops=flops / (t.ms * 1e-3) / 1e12, rel_err_vs_bf16=rel)
      row.update(ok=not problems, note="; ".join(problems))
      case_rows.append(row)
    by = {r["impl"]: r for r in case_rows}
    for r in case_rows:
      r["speedup_vs_xla"] = by["xla bf16"]["ms"] / r["ms"] if "tflops" in r else float("nan")
      if "block" in r["impl"]:
        per_tensor = by["te_jax fp8 per-tensor" + (" (fast acc)" if "fast" in r["impl"] else "")]
        r["vs_per_tensor_fp8"] = per_tensor["ms"] / r["ms"]
      print(f"gemm_block {label} {r['impl']}: {r['ms']:.4f} ms"
            + (f", {r['tflops']:.0f} TFLOP/s, {r['speedup_vs_xla']:.2f}x XLA bf16" if "tflops" in r else "")
            + (f", {r['vs_per_tensor_fp8']:.1%} of per-tensor FP8" if "vs_per_tensor_fp8" in r else "")
            + (f" [{r['note']}]" if not r["ok"] else ""), file=sys.stderr, flush=True)
    rows += case_rows
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = bench_block(ctx)
  with tempfile.TemporaryDirectory() as d:
    shapes = [bench_shape(ctx, mnk, jax.random.key(100 + i), (d, i) if _with_torch(ctx) else None)
              for i, mnk in enumerate(SHAPES)]
    torch_result = _run_torch(ctx, d, len(SHAPES)) if _with_torch(ctx) else None
    for i, (shape_rows, ref, flops) in enumerate(shapes):
      if torch_result is not None:
        shape_rows += _torch_rows(torch_result, i, d, ref, flops, shape_rows[0]["case"])
      base = next(r for r in shape_rows if r["impl"] == "xla bf16")["ms"]
      for r in shape_rows:
        r["speedup_vs_xla"] = base / r["ms"]
        print(f"gemm {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, "
              f"{r['speedup_vs_xla']:.2f}x vs XLA bf16" + (f" [{r['note']}]" if not r["ok"] else ""),
              file=sys.stderr, flush=True)
      rows += shape_rows
  for r in bench_qkv(ctx, jax.random.key(200)):
    print(f"gemm {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s; {r['note']}", file=sys.stderr,
          flush=True)
    rows.append(r)
  return rows + accuracy_rows(ctx, jax.random.key(7))


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_gemm", "--no-write"]))
