"""How much FP8 fast accumulation costs in accuracy, next to what FP8 quantization itself costs, on the GPU.

Hopper's FP8 tensor-core MMA keeps fewer accumulator bits than float32; cuBLASLt's default (full-precision)
accumulation promotes the partial sums to float32 as it goes, its FAST_ACCUM mode does not, so the error of fast
accumulation grows with K. This runs the FP8 GEMMs of a layer's backward pass (E5M2 gradient x E4M3 operand,
float32 output, per-tensor scaling) both ways through ``te_jax.gemm`` and compares them with the exact product of the
same FP8 values (a float32 GEMM at HIGHEST precision of the dequantized operands: each product is exact in float32,
so only float32 summation error remains); the quantization error is the FP8 GEMM's distance from the product of the
unquantized operands.

Errors are relative to the RMS of the exact output: ``rms`` of the error, ``max`` of |error|, and ``bias``, the mean
of error * sign(exact output), which is negative when the accumulation loses magnitude (truncation).

  python benchmarks/accumulation_error.py          # GPU only: on the pure-JAX path both modes are exact
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import te_jax

M, N = 4096, 4096
KS = (4096, 8192, 16384)
CASES = {
    # name: (the gradient's distribution, the other operand's): a dgrad sees a signed operand, a wgrad after GELU a
    # mostly positive one (its sums do not cancel, so they grow with K)
    "signed operand": (jax.random.normal, jax.random.normal),
    "GELU-activation operand": (jax.random.normal, lambda k, s: jax.nn.gelu(jax.random.normal(k, s))),
}


def _quantized(x, dtype):
  """``x`` scaled to ``dtype``'s full range by its amax, the FP8 array, and the scale's inverse."""
  scale = float(jnp.finfo(dtype).max) / jnp.max(jnp.abs(x.astype(jnp.float32)))
  q = te_jax.quantize(x, scale, dtype)
  return q.data, 1.0 / scale


def _errors(out, exact):
  rms = jnp.sqrt(jnp.mean(exact * exact))
  err = out - exact
  return (float(jnp.sqrt(jnp.mean(err * err)) / rms), float(jnp.max(jnp.abs(err)) / rms),
          float(jnp.mean(err * jnp.sign(exact)) / rms))


def measure(key, k: int, grad_dist, operand_dist) -> dict[str, tuple[float, float, float]]:
  kg, ko = jax.random.split(key)
  g = grad_dist(kg, (M, k)).astype(jnp.bfloat16)
  a = operand_dist(ko, (N, k)).astype(jnp.bfloat16)
  g8, g_inv = _quantized(g, jnp.float8_e5m2)
  a8, a_inv = _quantized(a, jnp.float8_e4m3fn)
  dot = jax.jit(lambda x, y: jnp.dot(x, y.T, precision=jax.lax.Precision.HIGHEST))
  exact = dot(g8.astype(jnp.float32) * g_inv, a8.astype(jnp.float32) * a_inv)
  unquantized = dot(g.astype(jnp.float32), a.astype(jnp.float32))
  run = jax.jit(lambda x, y, fast: te_jax.gemm(x, y, lhs_scale_inv=g_inv, rhs_scale_inv=a_inv, out_dtype=jnp.float32,
                                               fast_accum=fast), static_argnums=2)
  return {
      "full-precision accumulation": _errors(run(g8, a8, False), exact),
      "fast accumulation": _errors(run(g8, a8, True), exact),
      "FP8 quantization (vs unquantized operands)": _errors(exact, unquantized),
  }


def main() -> int:
  if jax.default_backend() != "gpu":
    print("accumulation_error: needs a GPU (the pure-JAX GEMM accumulates exactly in both modes)", file=sys.stderr)
    return 1
  print(f"FP8 GEMM errors, ({M}, K) E5M2 x ({N}, K) E4M3 -> float32, relative to the RMS of the exact output")
  print("\n| operands | K | error of | rms | max | bias |")
  print("|---|---|---|---|---|---|")
  key = jax.random.key(7)
  for name, (grad_dist, operand_dist) in CASES.items():
    for k in KS:
      key, sub = jax.random.split(key)
      for what, (rms, mx, bias) in measure(sub, k, grad_dist, operand_dist).items():
        print(f"| {name} | {k} | {what} | {rms:.2e} | {mx:.2e} | {bias:+.2e} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
