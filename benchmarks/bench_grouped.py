"""Grouped (MoE) GEMM: te_jax's CUDA grouped GEMM in FP8 against the BF16 baselines, same shape, same process.

A Mixtral-like expert GEMM: 16k tokens routed top-2 (M = 32768 rows sorted by expert), h = 4096, f = 14336, 8
experts, with balanced (4096 rows each) and skewed group sizes (multiples of the handler's tile). Rows:

- forward (rows grouped, x (M, h) . w[g] (f, h)^T): te_jax FP8 at the handler's tile and half of it (per-tensor E4M3
  operands with one scale per group, quantized outside the timed function; the per-row scaling and bf16 cast inside
  it), ``jax.lax.ragged_dot`` in
  bf16, a dense batched bf16 dot of the same FLOPs ((G, M/G, h) x (G, h, f)), and te_jax's dense FP8 GEMM of the same
  total FLOPs ((M, h) x (f, h)): the targets are >= 1.6x the best bf16 row and >= 85% of the dense FP8 rate.
- weight gradient (ragged contracting, x^T (h, M) . dy^T (f, M) per group -> (G, h, f) float32): te_jax FP8
  against te_jax's dense FP8 GEMM contracting all M rows (the same FLOPs) and the dense batched bf16 dot.

Rates count 2 * M * h * f FLOPs. Outputs are checked against the bf16 baseline of the same rows.

  python benchmarks/bench_grouped.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import harness
from te_jax import QuantizedTensor
from te_jax.ops import grouped_gemm as gg
from te_jax.ops.gemm import gemm
from te_jax.ops.quantize import quantize

TOKENS_X_TOPK, HIDDEN, FFN, EXPERTS = 32768, 4096, 14336, 8
SKEWED = (12288, 8192, 4096, 2048, 2048, 2048, 2048, 0)  # x 1/32768 of the rows


def _quantize_groups(x, sizes, dtype):
  """Per-group E4M3 of rows x (M, K) grouped by ``sizes``: one scale per group from its amax."""
  amax = gg.group_amax(x, sizes)
  fp8_max = float(jnp.finfo(dtype).max)
  scale = jnp.where(amax > 0, fp8_max / amax, 1.0).astype(jnp.float32)
  return gg.quantize_by_group(x, scale, sizes, dtype)


def _kernels(w, dtype):
  """Each expert's (N, K) matrix quantized on its own: (G, N, K) E4M3, scale_inv (G,)."""
  qs = [quantize(w[g], 448.0 / jnp.max(jnp.abs(w[g])).astype(jnp.float32), dtype).out for g in range(w.shape[0])]
  return QuantizedTensor(jnp.stack([q.data for q in qs]), jnp.stack([q.scale_inv for q in qs]))


def _rows(ctx, case, impls, flops, ref, tile):
  rows = []
  for name, (fn, args, native_target) in impls.items():
    t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
    targets = harness.custom_call_targets(fn, *args)
    out = fn(*args).astype(jnp.float32)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    bound = 0.1 if "fp8" in name else 1e-2
    native = native_target is None or native_target in targets or not ctx.gpu
    problems = ([] if native else ["NOT NATIVE"]) + ([] if rel <= bound else [f"rel err {rel:.3g} > {bound}"])
    rows.append({"bench": "grouped_gemm", "case": case, "impl": name, "ms": t.ms, "timing": t.as_dict(),
                 "tflops": flops / (t.ms * 1e-3) / 1e12, "rel_err_vs_bf16": rel, "tile": tile,
                 "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla",
                 "ok": not problems, "note": "; ".join(problems)})
  return rows


def run(ctx: harness.Context) -> list[dict]:
  s = ctx.shrink
  m, k, n, g = TOKENS_X_TOPK // s, HIDDEN // s, FFN // s, EXPERTS
  tile = gg.NATIVE_TILE if ctx.gpu else 16
  key = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key[0], (m, k), jnp.float32)
  w = jax.random.normal(key[1], (g, n, k), jnp.float32) * 0.02  # (G, N, K): each expert's (f, h) matrix
  dy = jax.random.normal(key[2], (m, n), jnp.float32) * 0.01
  xb, wb, dyb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
  flops = 2.0 * m * k * n
  rows = []
  target = f"te_grouped_gemm_{ctx.platform}"
  for case, sizes in (("balanced", (m // g,) * g), ("skewed", tuple(v * m // TOKENS_X_TOPK for v in SKEWED))):
    sz = jnp.asarray(sizes, jnp.int32)
    qx, qw = _quantize_groups(x, sz, jnp.float8_e4m3fn), _kernels(w, jnp.float8_e4m3fn)
    w_kn = jnp.swapaxes(wb, 1, 2)  # (G, K, N) for ragged_dot
    ref = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32))(xb, w_kn, sz)
    dense_q = quantize(x, jnp.float32(448.0 / 4.0), jnp.float8_e4m3fn).out
    dense_w = quantize(w[0], jnp.float32(448.0 / 0.1), jnp.float8_e4m3fn).out
    impls = {
        f"te_jax grouped fp8 (tile {t})": (
            jax.jit(lambda a, b, s, t=t: gg.grouped_gemm(a, b, s, dtype=jnp.bfloat16, tile=t)), (qx, qw, sz), target)
        for t in sorted({tile, max(16, tile // 2)}, reverse=True)}
    impls |= {
        "ragged_dot bf16": (jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s)), (xb, w_kn, sz), None),
    }
    rows += _rows(ctx, f"fwd {case} M{m} h{k} f{n} G{g}", impls, flops, ref, tile)
    if case == "balanced":  # same FLOPs, no grouping: the ceilings
      xg = xb.reshape(g, m // g, k)
      dense = {
          "dense batched bf16": (jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b).reshape(m, n)),
                                 (xg, w_kn), None),
          "te_jax dense fp8 (same FLOPs)": (jax.jit(lambda a, b: gemm(a, b, dtype=jnp.bfloat16)),
                                            (dense_q, dense_w), f"te_gemm_{ctx.platform}"),
      }
      for name, (fn, args, tgt) in dense.items():  # timed only: other products than the grouped rows
        t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
        targets = harness.custom_call_targets(fn, *args)
        ok = tgt is None or tgt in targets or not ctx.gpu
        rows.append({"bench": "grouped_gemm", "case": f"fwd {case} M{m} h{k} f{n} G{g}", "impl": name, "ms": t.ms,
                     "timing": t.as_dict(), "tflops": flops / (t.ms * 1e-3) / 1e12, "tile": tile,
                     "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla",
                     "ok": ok, "note": "" if ok else "NOT NATIVE"})
    # weight gradient: (K, M) x (N, M) contracted per group
    qxt = _quantize_groups(x, sz, jnp.float8_e4m3fn)
    qxt = QuantizedTensor(qxt.data.T, qxt.scale_inv)
    qdy = _quantize_groups(dy, sz, jnp.float8_e5m2)
    qdyt = QuantizedTensor(qdy.data.T, qdy.scale_inv)
    ref_w = jax.jit(lambda a, b, s: gg.grouped_gemm(a, b, s, dtype=jnp.float32, ragged_contracting=True))(
        xb.T, dyb.T, sz)
    impls = {"te_jax grouped fp8 wgrad": (jax.jit(lambda a, b, s: gg.grouped_gemm(
        a, b, s, dtype=jnp.float32, ragged_contracting=True, tile=tile)), (qxt, qdyt, sz), target)}
    if case == "balanced":
      impls["te_jax dense fp8 wgrad (same FLOPs)"] = (
          jax.jit(lambda a, b: gemm(a, b, dtype=jnp.float32)),
          (quantize(x.T, jnp.float32(100.0), jnp.float8_e4m3fn).out,
           quantize(dy.T, jnp.float32(1e4), jnp.float8_e5m2).out),
          f"te_gemm_{ctx.platform}")
    for name, (fn, args, tgt) in impls.items():
      t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch)
      targets = harness.custom_call_targets(fn, *args)
      ok = tgt is None or tgt in targets or not ctx.gpu
      note = "" if ok else "NOT NATIVE"
      if "grouped" in name:
        rel = float(jnp.linalg.norm(fn(*args) - ref_w) / jnp.linalg.norm(ref_w))
        if rel > 0.1:
          ok, note = False, f"rel err {rel:.3g} > 0.1"
      rows.append({"bench": "grouped_gemm", "case": f"wgrad {case} M{m} h{k} f{n} G{g}", "impl": name, "ms": t.ms,
                   "timing": t.as_dict(), "tflops": flops / (t.ms * 1e-3) / 1e12, "tile": tile,
                   "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla",
                   "ok": ok, "note": note})
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_grouped", "--no-write"]))
