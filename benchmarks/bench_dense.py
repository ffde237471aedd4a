"""Dense layer fwd+bwd: te_jax.flax.DenseGeneral (FP8, DelayedScaling) vs Flax's nn.Dense in BF16 and in FP8
(``dot_general_cls=Fp8DirectDotGeneralOp``), same shapes, same process.

The timed function is the whole backward pass of the layer: ``jax.vjp`` of ``apply`` with respect to the variables
(parameters and FP8 state) and the input, applied to a random output gradient. Parameters are float32, inputs and
compute bfloat16. Rates count 6*M*K*N FLOPs (three GEMMs).

  python benchmarks/bench_dense.py
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

import harness
import te_jax
import te_jax.flax as te_flax
from te_jax import recipe

SHAPES = ((16384, 8192, 8192),)  # (tokens M, in K, out N)
COLUMNS = (
    ("case", "case"),
    ("impl", "impl"),
    ("ms", "ms"),
    ("TFLOP/s", "tflops"),
    ("vs Flax bf16", "speedup_vs_bf16"),
    ("vs Flax fp8", "speedup_vs_flax_fp8"),
    ("temp MiB", "temp_mib"),
    ("handler", "handler"),
    ("ok", "ok"),
    ("note", "note"),
)


def _fwd_bwd(model, rec):
  def f(variables, x, dy):
    with te_jax.autocast(enabled=rec is not None, recipe=rec):
      out, vjp = jax.vjp(model.apply, variables, x)
    return out, vjp(dy)

  return jax.jit(f)


def bench_shape(ctx: harness.Context, mkn, key) -> list[dict]:
  m, k, n = (d // ctx.shrink for d in mkn)
  kx, kd, ki = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
  delayed = recipe.DelayedScaling()  # amax history 1024, as Flax's op keeps
  impls = {
      "te_jax DenseGeneral fp8": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16), delayed),
      "flax Dense fp8": (nn.Dense(n, use_bias=False, dtype=jnp.bfloat16,
                                  dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp), None),
      "flax Dense bf16": (nn.Dense(n, use_bias=False, dtype=jnp.bfloat16), None),
      "te_jax DenseGeneral bf16": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16), None),
  }
  flops = 6.0 * m * k * n
  rows = []
  for name, (model, rec) in impls.items():
    with te_jax.autocast(enabled=rec is not None, recipe=rec):
      variables = model.init(ki, x)
    fn = _fwd_bwd(model, rec)
    # A few steps first so that delayed scaling's amax history holds real values.
    for _ in range(3):
      out, (grads, _) = fn(variables, x, dy)
      if te_jax.FP8_COLLECTION in grads:
        variables = {**variables, te_jax.FP8_COLLECTION: grads[te_jax.FP8_COLLECTION]}
    t = harness.time_calls(fn, variables, x, dy, runs=ctx.runs, batch=ctx.batch)
    compiled = fn.lower(variables, x, dy).compile()
    targets = harness.custom_call_targets(fn, variables, x, dy)
    hlo = compiled.as_text()
    fp8_gemm = ("te_gemm_cuda" in targets) if name.startswith("te_jax") else ("__cublas$lt$matmul$f8" in hlo)
    expect_fp8 = "fp8" in name
    problems = [] if (not ctx.gpu or fp8_gemm == expect_fp8) else [f"FP8 GEMM in HLO: {fp8_gemm}"]
    if not bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))):
      problems.append("non-finite output")
    rows.append({
        "bench": "dense",
        "case": f"x ({m}, {k}) @ W ({k}, {n}) fwd+bwd",
        "impl": name,
        "ms": t.ms,
        "timing": t.as_dict(),
        "tflops": flops / (t.ms * 1e-3) / 1e12,
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "handler": ", ".join(sorted(x for x in targets if x.startswith(("te_", "__cublas")))) or "xla",
        "ok": not problems,
        "note": "; ".join(problems),
    })
  by = {r["impl"]: r["ms"] for r in rows}
  for r in rows:
    r["speedup_vs_bf16"] = by["flax Dense bf16"] / r["ms"]
    r["speedup_vs_flax_fp8"] = by["flax Dense fp8"] / r["ms"]
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, mkn in enumerate(SHAPES):
    shape_rows = bench_shape(ctx, mkn, jax.random.key(200 + i))
    for r in shape_rows:
      print(f"dense {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, "
            f"{r['speedup_vs_bf16']:.2f}x vs Flax bf16, {r['speedup_vs_flax_fp8']:.2f}x vs Flax fp8"
            + (f" [{r['note']}]" if not r["ok"] else ""), file=sys.stderr, flush=True)
    rows += shape_rows
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_dense", "--no-write"]))
