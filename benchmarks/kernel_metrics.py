"""Runs a few te_jax kernels once each at their benchmark shapes, for Nsight Compute to read their counters.

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:'ActivationKernel|NormFwdKernel' \
      --section SpeedOfLight --section WarpStateStats python benchmarks/kernel_metrics.py   # gpu_check.sh step "ncu"

Without XLA_PYTHON_CLIENT_PREALLOCATE=false, JAX reserves most of the GPU's memory, and ncu saves and restores all of
it for each of a kernel's replay passes: minutes per kernel on the H200.

Each op is compiled and run twice (the first call compiles; ncu's --launch-skip can drop it); the shapes are the
acceptance shapes of bench_activation (gelu (16384, 16384), bf16 -> E4M3 with and without the transposed copy; its
backward to E5M2 with the transposed copy and dbias) and bench_norm (LayerNorm (32768, 8192), bf16 -> E4M3), and the
LayerNorm backward (with a residual gradient) at the GPT layer's (8192, 4096).
``acceptance_ops`` also serves ``profile_layer.py --bench ops``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import te_jax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def acceptance_ops(shrink: int = 1) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
  """{name: (jitted op, its arguments)} at the acceptance shapes, every dimension divided by ``shrink``."""
  n = 16384 // shrink
  kx, kg = jax.random.split(jax.random.key(0))
  x = (3.0 * jax.random.normal(kx, (n, n), jnp.float32)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (n, n), jnp.float32).astype(jnp.bfloat16)
  scale = jnp.float32(16.0)

  def gelu_fwd(transpose):
    return jax.jit(lambda x, s: te_jax.activation_fwd(x, ("gelu",), dtype=E4M3, scale=s, transpose=transpose))

  ops = {
      "gelu fwd +T": (gelu_fwd(True), (x, scale)),
      "gelu fwd": (gelu_fwd(False), (x, scale)),
      "gelu bwd": (jax.jit(lambda g, x, s: te_jax.activation_bwd(g, x, ("gelu",), dtype=E5M2, scale=s,
                                                                 transpose=True, dbias=True)), (g, x, scale)),
  }
  xn = x.reshape(2 * n, n // 2)
  gamma, beta = jnp.ones((n // 2,), jnp.float32), jnp.zeros((n // 2,), jnp.float32)
  ops["layernorm fwd"] = (jax.jit(lambda x, gm, b, s: te_jax.norm_fwd(x, gm, b, norm_type="layernorm", epsilon=1e-6,
                                                                      out_dtype=E4M3, scale=s)),
                          (xn, gamma, beta, scale))
  ops["rmsnorm fwd"] = (jax.jit(lambda x, gm, s: te_jax.norm_fwd(x, gm, norm_type="rmsnorm", epsilon=1e-6,
                                                                 out_dtype=E4M3, scale=s)), (xn, gamma, scale))
  # The LayerNorm backward at the GPT layer's shape (8192 tokens, hidden 4096), with the residual gradient added in.
  xl, gl = x[:n // 2, :n // 4], g[:n // 2, :n // 4]
  mean, rsigma = jnp.mean(xl.astype(jnp.float32), axis=-1), jnp.ones((n // 2,), jnp.float32)
  ops["layernorm bwd + dres (GPT layer)"] = (
      jax.jit(lambda dz, x, m, r, gm, dres: te_jax.norm_bwd(dz, x, m, r, gm, dres=dres)),
      (gl, xl, mean, rsigma, jnp.ones((n // 4,), jnp.float32), gl))
  # The copy ceiling as the benchmarks measure it (a 1 GiB jnp.copy), for kernel-time bandwidths against its own.
  ops["copy 1 GiB"] = (jax.jit(jnp.copy), (jnp.zeros(((1 << 28) // shrink**2,), jnp.float32),))
  return ops


def main() -> None:
  for name, (fn, args) in acceptance_ops().items():
    for _ in range(2):
      jax.block_until_ready(fn(*args))
    print(f"ran {name}")


if __name__ == "__main__":
  main()
