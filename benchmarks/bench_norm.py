"""LayerNorm/RMSNorm: norm_fwd / norm_bwd (one fused kernel each way) vs the same math compiled by XLA from jnp.

The baseline is ``te_jax.ops.norm.norm_fwd_ref`` / ``norm_bwd_ref`` under ``jax.jit``: the same outputs (the
normalized tensor, FP8 with amax and optionally its transposed copy, mean and rsigma; backward dx, dgamma and dbeta),
which XLA fuses as well as it can. Both run in one process on the same input. Each row checks that the te_jax path
ran its native handler and that its outputs agree with XLA's (the two differ only in the order of float32 sums: the
statistics and dgamma/dbeta within the a-priori bound of that, FP8 codes at most one step apart, dx within two bf16
ulps of the largest value), and says so when not.

Bytes moved = every input read once and every output written once: x (and dz), the output(s), the float32 statistics
and parameters. GB/s over the measured copy bandwidth is the fraction of the memory-bound ceiling reached.

  python benchmarks/bench_norm.py     # this benchmark alone (run.py runs them all and writes the results)
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

import harness
from te_jax.ops.norm import NormConfig, norm_bwd_ref, norm_fwd_ref
from te_jax.ops.norm import norm_bwd, norm_fwd

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
F32_U = 2.0**-24


@dataclasses.dataclass(frozen=True)
class Case:
  direction: str  # "fwd" or "bwd"
  norm_type: str = "layernorm"
  out_dtype: jnp.dtype = E4M3  # forward output
  transpose: bool = False
  shape: tuple[int, int] = (32768, 8192)
  note: str = ""

  def name(self, shape: tuple[int, ...]) -> str:
    dims = "x".join(map(str, shape))
    if self.direction == "bwd":
      return f"{self.norm_type} bwd {dims} bf16"
    return f"{self.norm_type} fwd {dims} bf16->{jnp.dtype(self.out_dtype).name}{'+T' if self.transpose else ''}"


CASES = (
    Case("fwd", note="acceptance shape: fwd >= 80% of copy BW and >= 1.5x XLA"),
    Case("fwd", "rmsnorm"),
    Case("fwd", transpose=True),
    Case("fwd", out_dtype=BF16),
    Case("bwd", note="acceptance shape: bwd >= 70% of copy BW"),
    Case("bwd", "rmsnorm"),
)


def _gamma(n: int) -> float:
  """Higham's gamma_n: the bound of n float32 roundings in a row, any summation order."""
  return n * F32_U / (1 - n * F32_U)


def _fp8_adjacent(a: jax.Array, b: jax.Array) -> bool:
  """FP8 codes equal or one step apart (same sign, magnitudes differing by one code, or both zero)."""
  ua, ub = harness.bits(a).astype(jnp.int32), harness.bits(b).astype(jnp.int32)
  ma, mb = ua & 0x7F, ub & 0x7F
  same_sign = (ua >> 7) == (ub >> 7)
  return bool(jnp.all((jnp.abs(ma - mb) <= 1) & (same_sign | ((ma <= 1) & (mb <= 1)))))


def _fwd_agree(x, beta, got, want, case: Case) -> bool:
  """The statistics within twice the any-order bound of a float32 row sum; the output one FP8 step (or one rounding
  of the output dtype) apart, from statistics that differ that little; amax likewise. A high-precision output also
  gets the absolute error those statistics carry into ``t * g`` (``t * g + beta`` may cancel to near zero)."""
  n = x.shape[-1]
  xf = x.astype(jnp.float32)
  *_, rsigma_g = got
  *_, rsigma_w = want
  ok = bool(jnp.all(jnp.abs(rsigma_g / rsigma_w - 1) <= 2 * _gamma(n + 4)))
  if case.norm_type == "layernorm":
    spread = jnp.mean(jnp.abs(xf), axis=-1)
    ok &= bool(jnp.all(jnp.abs(got[-2] - want[-2]) <= 2 * _gamma(n + 1) * spread))
  out_g, out_w = got[0], want[0]
  if jnp.dtype(out_g.dtype) == E4M3:
    ok &= _fp8_adjacent(out_g, out_w)
    if case.transpose:
      ok &= _fp8_adjacent(got[1], want[1])
    i_amax = 2 if case.transpose else 1
    ok &= bool(jnp.abs(got[i_amax] / want[i_amax] - 1) <= 8 * _gamma(n + 4))  # through mean and rsigma
  else:
    ulp = float(jnp.finfo(out_w.dtype).eps)
    out_wf = out_w.astype(jnp.float32)
    diff = jnp.abs(out_g.astype(jnp.float32) - out_wf)
    tg = jnp.abs(out_wf) + (0.0 if beta is None else jnp.abs(beta))  # bounds |t * g| (up to one rounding)
    ok &= bool(jnp.all(diff <= ulp * jnp.abs(out_wf) + 4 * _gamma(n + 4) * tg + 1e-30))
  return ok


def _bwd_agree(dz, x, got, want, xhat_mag, case: Case) -> bool:
  """dx within two bf16 ulps of the largest value (each rounds once to bf16 from float32 values that differ by
  summation order); dgamma/dbeta within twice the any-order bound of a float32 column sum of their terms."""
  rows = x.shape[0]
  dx_g, dx_w = got[0].astype(jnp.float32), want[0].astype(jnp.float32)
  ok = bool(jnp.max(jnp.abs(dx_g - dx_w)) <= 2.0**-7 * jnp.max(jnp.abs(dx_w)))
  dzf = jnp.abs(dz.astype(jnp.float32))
  ok &= bool(jnp.all(jnp.abs(got[1] - want[1]) <= 2 * _gamma(rows + 3) * xhat_mag))
  if case.norm_type == "layernorm":
    ok &= bool(jnp.all(jnp.abs(got[2] - want[2]) <= 2 * _gamma(rows) * jnp.sum(dzf, axis=0)))
  return ok


def _row(ctx, case, shape, impl, fn, plain, args, moved, handler):
  return {
      "bench": "norm",
      "case": case.name(shape),
      "impl": impl,
      "direction": case.direction,
      "norm_type": case.norm_type,
      "shape": list(shape),
      "dtype": BF16.name,
      "out_dtype": jnp.dtype(case.out_dtype).name if case.direction == "fwd" else BF16.name,
      "transpose": case.transpose,
      **harness.memory_bound_timing(ctx, fn, plain, args, moved, shape[0] * shape[1]),
      "handler": handler,
      "note": case.note,
  }


def bench_case(ctx: harness.Context, case: Case, key: jax.Array) -> list[dict]:
  """Times one case on both paths; returns the te_jax row and the XLA row."""
  shape = tuple(d // ctx.shrink for d in case.shape)
  rows_n, hidden = shape
  kx, kg, kb, kd = jax.random.split(key, 4)
  x = (3.0 * jax.random.normal(kx, shape, jnp.float32)).astype(BF16)
  gamma = 1.0 + 0.1 * jax.random.normal(kg, (hidden,), jnp.float32)
  beta = 0.1 * jax.random.normal(kb, (hidden,), jnp.float32)
  rms = case.norm_type == "rmsnorm"
  betas = () if rms else (beta,)
  # The timed functions multiply gamma by this last argument, which harness.time_loop perturbs (by zero) each
  # iteration so that no call is loop invariant.
  one = jnp.float32(1.0)
  stats_bytes = 4 * rows_n * (1 if rms else 2)
  param_bytes = 4 * hidden * (1 if rms else 2)
  fp8 = jnp.dtype(case.out_dtype) == E4M3
  scale = jnp.float32(448.0 / 16.0)  # |y| beyond 16 saturates: as a delayed scale would after a few steps
  config = NormConfig(case.norm_type, 1e-6, out_dtype=jnp.dtype(case.out_dtype), transpose=case.transpose)

  if case.direction == "fwd":
    def ours(x, gamma, s):
      out = norm_fwd(x, gamma * s, *(None,) if rms else betas, norm_type=case.norm_type, epsilon=1e-6,
                            dtype=case.out_dtype, scale=scale if fp8 else None, transpose=case.transpose)
      y = (out.out.data, out.out.data_t) if fp8 else (out.out,)  # the reference's order: out, out_t, amax, ...
      return tuple(o for o in (*y, out.amax, out.mean, out.rsigma) if o is not None)

    def xla(x, gamma, s):
      return tuple(norm_fwd_ref(x, gamma * s, scale, *betas, config=config))

    args = (x, gamma, one)
    out_bytes = x.size * jnp.dtype(case.out_dtype).itemsize * (2 if case.transpose else 1)
    moved = x.nbytes + out_bytes + stats_bytes + param_bytes + (4 if fp8 else 0)
    target = f"te_norm_fwd_{ctx.platform}"
  else:
    dz = jax.random.normal(kd, shape, jnp.float32).astype(BF16)
    fwd = norm_fwd(x, gamma, *(None,) if rms else betas, norm_type=case.norm_type, epsilon=1e-6)

    def ours(dz, x, gamma, rsigma, mean, s):
      return tuple(o for o in norm_bwd(dz, x, mean, rsigma, gamma * s, norm_type=case.norm_type)
                   if o is not None)

    def xla(dz, x, gamma, rsigma, mean, s):
      return tuple(norm_bwd_ref(dz, x, rsigma, gamma * s, *(() if rms else (mean,)), config=config))

    args = (dz, x, gamma, fwd.rsigma, fwd.mean, one)
    moved = dz.nbytes + 2 * x.nbytes + stats_bytes + 2 * param_bytes
    target = f"te_norm_bwd_{ctx.platform}"

  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, *args)
  native = target in targets
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  got, want = te_fn(*args), xla_fn(*args)
  if case.direction == "fwd":
    agree = _fwd_agree(x, None if rms else beta, got, want, case)
  else:
    xf = x.astype(jnp.float32)
    xhat = xf * fwd.rsigma[:, None] if rms else (xf - fwd.mean[:, None]) * fwd.rsigma[:, None]
    agree = _bwd_agree(dz, x, got, want, jnp.sum(jnp.abs(dz.astype(jnp.float32) * xhat), axis=0), case)

  impls = (("te_jax", te_fn, ours, te_handler), ("xla (jnp)", xla_fn, xla, "xla fusion"))
  rows = [_row(ctx, case, shape, impl, fn, plain, args, moved, handler) for impl, fn, plain, handler in impls]
  return harness.judge_pair(*rows, native=native, expected=target, agree=agree)


def run(ctx: harness.Context) -> list[dict]:
  """All cases, te_jax row then XLA row for each."""
  return harness.run_pairs(ctx, "norm", CASES, bench_case, seed=200)


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_norm", "--no-write"]))
