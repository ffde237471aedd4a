"""Dense layer fwd+bwd: te_jax.flax.DenseGeneral (FP8, DelayedScaling) vs Flax's nn.Dense in BF16 and in FP8
(``dot_general_cls=Fp8DirectDotGeneralOp``), same shapes, same process.

The timed function is the whole backward pass of the layer: ``jax.vjp`` of ``apply`` with respect to the variables
(parameters and FP8 state) and the input, applied to a random output gradient. Parameters are float32, inputs and
compute bfloat16. Rates count 6*M*K*N FLOPs (three GEMMs). One more te_jax row runs all three GEMMs with FP8 fast
accumulation (the default recipe keeps dgrad and wgrad at full precision, as Transformer Engine does; Flax's op lets
XLA choose), one under ``Float8BlockScaling`` (1 x 128 / 128 x 128 block scales: cuBLASLt's block-scaled GEMMs on
Hopper).

  python benchmarks/bench_dense.py
"""

from __future__ import annotations

import dataclasses
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

import harness
import te_jax.flax as te_flax
from te_jax import recipe

SHAPES = ((16384, 8192, 8192),)  # (tokens M, in K, out N)


def recipe_with_fast_accumulation(r):
  """``r`` with FP8 fast accumulation in all three GEMMs (the default keeps dgrad and wgrad at full precision)."""
  fast = recipe.MMParams(use_split_accumulator=False)
  return dataclasses.replace(r, fp8_gemm_fprop=fast, fp8_gemm_dgrad=fast, fp8_gemm_wgrad=fast)


def bench_shape(ctx: harness.Context, mkn, key) -> list[dict]:
  m, k, n = (d // ctx.shrink for d in mkn)
  kx, kd, ki = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, n), jnp.float32).astype(jnp.bfloat16)
  delayed = recipe.DelayedScaling()  # amax history 1024, as Flax's op keeps
  impls = {
      "te_jax DenseGeneral fp8": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16), delayed),
      "te_jax DenseGeneral fp8 (fast accumulation)": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16),
                                                      recipe_with_fast_accumulation(delayed)),
      "te_jax DenseGeneral fp8 block scaling": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16),
                                                recipe.Float8BlockScaling()),
      "flax Dense fp8": (nn.Dense(n, use_bias=False, dtype=jnp.bfloat16,
                                  dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp), None),
      "flax Dense bf16": (nn.Dense(n, use_bias=False, dtype=jnp.bfloat16), None),
      "te_jax DenseGeneral bf16": (te_flax.DenseGeneral(n, use_bias=False, dtype=jnp.bfloat16), None),
  }
  rows = []
  for name, (model, rec) in impls.items():
    fn = harness.layer_fwd_bwd(model, rec)
    variables, out = harness.warm_layer(model, rec, fn, ki, x, dy)
    problems = []
    row = harness.layer_row(ctx, fn, (variables, x, dy), flops=6.0 * m * k * n, out=out, problems=problems)
    targets = set(row.pop("targets"))
    fp8_gemm = ("te_gemm_cuda" if name.startswith("te_jax") else "__cublas$lt$matmul$f8") in targets
    if ctx.gpu and fp8_gemm != ("fp8" in name):
      problems.append(f"FP8 GEMM in HLO: {fp8_gemm}")
    rows.append({"bench": "dense", "case": f"x ({m}, {k}) @ W ({k}, {n}) fwd+bwd", "impl": name, **row,
                 "ok": not problems, "note": "; ".join(problems)})
  harness.add_ratios(rows, bf16="flax Dense bf16", fp8="flax Dense fp8")
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, mkn in enumerate(SHAPES):
    rows += bench_shape(ctx, mkn, jax.random.key(200 + i))
  harness.print_layer_rows("dense", rows)
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_dense", "--no-write"]))
