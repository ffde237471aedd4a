"""Activations: activation_fwd / activation_bwd (one fused kernel each) vs the same math compiled by XLA.

The baseline is ``te_jax.ops.activation.activation_fwd_ref`` / ``activation_bwd_ref`` under ``jax.jit``: the same
outputs (FP8 data, transposed FP8 data, amax, dbias), which XLA fuses as well as it can. Both run in one process on
the same inputs. Each row checks that the te_jax path ran its native handler (the target is in the compiled HLO) and
that its outputs equal XLA's (bitwise for the FP8 data and amax; dbias within float32 summation-order error).

Bytes moved = the inputs (x, and g backward) + one FP8 byte per output element for each FP8 output (+ the float32
dbias vector): the minimum traffic of the op, so GB/s over the measured copy bandwidth is the fraction of the
memory-bound ceiling reached. The acceptance bar is 80% of copy bandwidth for the gelu and SwiGLU forward passes with
FP8 output and for the fused backward.

  python benchmarks/bench_activation.py     # this benchmark alone (run.py runs them all and writes the results)
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

import harness
from te_jax.ops.activation import ActivationConfig, activation_bwd_ref, activation_fwd_ref
from te_jax.ops.activation import activation_bwd, activation_fwd

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Case:
  act: tuple[str, ...]
  out_shape: tuple[int, int]  # (tokens, N): the forward output; gated inputs are (tokens, 2, N)
  backward: bool = False
  transpose: bool = True
  note: str = ""

  @property
  def gated(self) -> bool:
    return len(self.act) == 2

  def name(self, shape: tuple[int, int]) -> str:
    label = {("silu", "linear"): "swiglu", ("gelu", "linear"): "geglu"}.get(self.act, self.act[0])
    x_shape = (shape[0], 2, shape[1]) if self.gated else shape
    out = "e5m2+T+dbias" if self.backward else "e4m3" + ("+T" if self.transpose else "")
    return f"{label} {'bwd' if self.backward else 'fwd'} {'x'.join(map(str, x_shape))} bf16->{out}"


CASES = (
    Case(("gelu",), (16384, 16384), note="acceptance shape"),
    Case(("gelu",), (16384, 16384), transpose=False, note="acceptance shape"),
    Case(("silu", "linear"), (16384, 8192), note="acceptance shape"),
    Case(("silu", "linear"), (16384, 8192), transpose=False, note="acceptance shape"),
    Case(("gelu",), (16384, 16384), backward=True, note="acceptance shape"),
    Case(("silu", "linear"), (16384, 8192), backward=True, note="acceptance shape"),
)


def _outputs_agree(got: tuple, want: tuple, dx_f32: jax.Array | None, bitwise: bool) -> bool:
  """FP8 data, transposed data and amax bitwise (``bitwise``), else at most 0.1% of the FP8 bytes one code off and
  amax within 1e-5; dbias to float32 summation-order error (1e-5 of sum |dx|)."""
  n_exact = len(got) - (1 if dx_f32 is not None else 0)
  for a, b in zip(got[:n_exact], want[:n_exact], strict=True):
    if bitwise:
      if not harness.bitwise_equal(a, b):
        return False
    elif a.ndim == 0:
      if not bool(jnp.abs(a - b) <= 1e-5 * jnp.abs(b)):
        return False
    else:
      steps = jnp.abs(harness.bits(a).astype(jnp.int32) - harness.bits(b).astype(jnp.int32))
      if not bool((jnp.max(steps) <= 1) & (jnp.mean((steps > 0).astype(jnp.float32)) <= 1e-3)):
        return False
  if dx_f32 is not None:
    flat = dx_f32.reshape(-1, got[-1].size)
    bound = 1e-5 * jnp.sum(jnp.abs(flat), axis=0).reshape(got[-1].shape)
    return bool(jnp.all(jnp.abs(got[-1] - want[-1]) <= bound))
  return True


def bench_case(ctx: harness.Context, case: Case, key: jax.Array) -> list[dict]:
  """Times one case on both paths; returns the te_jax row and the XLA row."""
  shape = tuple(d // ctx.shrink for d in case.out_shape)
  x_shape = (shape[0], 2, shape[1]) if case.gated else shape
  kx, kg = jax.random.split(key)
  x = (2.0 * jax.random.normal(kx, x_shape, jnp.float32)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, shape, jnp.float32).astype(jnp.bfloat16)
  out_dtype = E5M2 if case.backward else E4M3
  scale = jnp.float32(4.0)
  config = ActivationConfig(activation=case.act[0], gated=case.gated, out_dtype=out_dtype, transpose=case.transpose,
                            batch_ndim=0, dbias=case.backward)

  if case.backward:
    def ours(g, x, s):
      out = activation_bwd(g, x, case.act, dtype=out_dtype, scale=s, transpose=case.transpose, dbias=True)
      return tuple(o for o in (out.out.data, out.out.data_t, out.amax, out.dbias) if o is not None)

    def xla(g, x, s):
      return tuple(activation_bwd_ref(g, x, s, config=config))

    args = (g, x, scale)
  else:
    def ours(x, s):
      out = activation_fwd(x, case.act, dtype=out_dtype, scale=s, transpose=case.transpose)
      return tuple(o for o in (out.out.data, out.out.data_t, out.amax) if o is not None)

    def xla(x, s):
      return tuple(activation_fwd_ref(x, s, config=config))

    args = (x, scale)

  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, *args)
  expected = f"te_act_{'bwd' if case.backward else 'fwd'}_{ctx.platform}"
  native = expected in targets
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  dx_f32 = activation_bwd(g, x, case.act, dtype=jnp.float32).out if case.backward else None
  # On a GPU XLA computes the reference's float32 operations exactly as the kernels do; on a CPU its exp differs from
  # the handler's by an ulp here and there (see te_jax/ops/activation.py), which moves an FP8 rounding now and then.
  bitwise = ctx.gpu or case.act[0] in ("relu", "squared_relu")
  agree = _outputs_agree(te_fn(*args), xla_fn(*args), dx_f32, bitwise)

  n_out = math.prod(x_shape) if case.backward else math.prod(shape)
  moved = sum(a.nbytes for a in args[:-1]) + (2 if case.transpose else 1) * n_out
  if case.backward:
    moved += 4 * math.prod(x_shape[1:])
  rows = []
  for impl, fn, plain in (("te_jax", te_fn, ours), ("xla (jnp)", xla_fn, xla)):
    rows.append({
        "bench": "activation",
        "case": case.name(shape),
        "impl": impl,
        "activation": list(case.act),
        "backward": case.backward,
        "shape": list(x_shape),
        "dtype": "bfloat16",
        "out_dtype": out_dtype.name,
        "transpose": case.transpose,
        "dbias": case.backward,
        **harness.memory_bound_timing(ctx, fn, plain, args, moved, math.prod(x_shape)),
        "handler": te_handler if impl == "te_jax" else "xla fusion",
        "note": case.note,
    })
  return harness.judge_pair(*rows, native=native, expected=expected, agree=agree)


def run(ctx: harness.Context) -> list[dict]:
  """All cases, te_jax row then XLA row for each."""
  return harness.run_pairs(ctx, "activation", CASES, bench_case, seed=0)


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_activation", "--no-write"]))
