"""LayerNormMLP fwd+bwd: te_jax.flax.LayerNormMLP (FP8, DelayedScaling) vs the same block built from Flax
(``nn.LayerNorm`` -> ``nn.Dense`` -> gelu -> ``nn.Dense``), in FP8 (``dot_general_cls=Fp8DirectDotGeneralOp``) and in
BF16, same shapes, same process.

The timed function is the layer's whole training computation: ``jax.vjp`` of ``apply`` with respect to the variables
(parameters and FP8 state) and the input, applied to a random output gradient, and the output itself. Parameters are
float32, inputs and compute bfloat16, biases on both GEMMs, gelu in its tanh form on both sides. Rates count the six
GEMMs, 6 * tokens * 2 * hidden * intermediate FLOPs. Temp is XLA's compiled scratch memory
(``memory_analysis().temp_size_in_bytes``): activations saved for the backward pass and the intermediates.

  python benchmarks/bench_layernorm_mlp.py
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

import harness
import te_jax.flax as te_flax
from te_jax import recipe

SHAPES = ((16384, 4096, 16384),)  # (tokens, hidden, intermediate)


class FlaxMLP(nn.Module):
  """The block as a Flax user writes it: LayerNorm, Dense, gelu, Dense."""

  hidden: int
  intermediate: int
  fp8: bool

  @nn.compact
  def __call__(self, x):
    kw = {"dtype": jnp.bfloat16}
    if self.fp8:
      kw["dot_general_cls"] = fp8_ops.Fp8DirectDotGeneralOp
    z = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16)(x)
    h = nn.gelu(nn.Dense(self.intermediate, **kw)(z), approximate=True)
    return nn.Dense(self.hidden, **kw)(h)


def impls(hidden: int, intermediate: int) -> dict:
  """{name: (model, recipe or None)}: te_jax's block and Flax's, in FP8 and BF16."""
  te_mlp = te_flax.LayerNormMLP(intermediate_dim=intermediate, activation_type=("gelu",), dtype=jnp.bfloat16)
  return {
      "te_jax LayerNormMLP fp8": (te_mlp, recipe.DelayedScaling()),
      "flax block fp8": (FlaxMLP(hidden, intermediate, fp8=True), None),
      "flax block bf16": (FlaxMLP(hidden, intermediate, fp8=False), None),
      "te_jax LayerNormMLP bf16": (te_mlp, None),
  }


def bench_shape(ctx: harness.Context, shape, key) -> list[dict]:
  m, h, f = (d // ctx.shrink for d in shape)
  kx, kd, ki = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, h), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (m, h), jnp.float32).astype(jnp.bfloat16)
  rows = []
  for name, (model, rec) in impls(h, f).items():
    fn = harness.layer_fwd_bwd(model, rec)
    variables, out = harness.warm_layer(model, rec, fn, ki, x, dy)
    problems = []
    row = harness.layer_row(ctx, fn, (variables, x, dy), flops=6.0 * m * 2 * h * f, out=out, problems=problems)
    targets = set(row.pop("targets"))
    if ctx.gpu and name.startswith("te_jax"):
      want = {"te_norm_fwd_cuda", "te_norm_bwd_cuda"}
      if "fp8" in name:
        want |= {"te_act_fwd_cuda", "te_act_bwd_cuda", "te_gemm_cuda"}
      if missing := want - targets:
        problems.append(f"missing handlers: {', '.join(sorted(missing))}")
    if ctx.gpu and name == "flax block fp8" and "__cublas$lt$matmul$f8" not in targets:
      problems.append("no FP8 GEMM in Flax's HLO")
    acceptance = "acceptance: >= 1.1x Flax fp8, temp <= 0.8x" if name == "te_jax LayerNormMLP fp8" else ""
    rows.append({"bench": "layernorm_mlp", "case": f"({m}, {h}) -> {f} -> {h} gelu fwd+bwd", "impl": name, **row,
                 "ok": not problems, "note": "; ".join(problems) or acceptance})
  harness.add_ratios(rows, bf16="flax block bf16", fp8="flax block fp8")
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, shape in enumerate(SHAPES):
    rows += bench_shape(ctx, shape, jax.random.key(300 + i))
  harness.print_layer_rows("layernorm_mlp", rows)
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_layernorm_mlp", "--no-write"]))
