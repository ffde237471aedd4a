"""Softmax: te_jax's fused softmax kernels (forward and backward; plain, masked, causal) vs the same math from XLA.

The baseline is ``te_jax.ops.softmax.softmax_fwd_ref`` / ``softmax_bwd_ref`` under ``jax.jit``: the same formulas,
float32 inside, bfloat16 in and out, which XLA fuses as well as it can. Both run in one process on the same inputs:
attention-shaped logits ``(B, H, Sq, Sk) = (4, 32, 2048, 2048)`` bf16, scale ``1 / sqrt(128)``, the masked case with a
``(B, 1, Sq, Sk)`` boolean mask (about a third masked out, broadcast over the heads). Each row checks that the te_jax
path ran its native handler (the target is in the compiled HLO) and that its outputs agree with XLA's (within two
bf16 ulps of the largest value: the two differ in the order of float32 sums and in exp, then round to bf16).

Bytes moved = the minimum traffic of the op: forward, the logits read and ``y`` written (+ the mask once); backward,
``dy`` and ``y`` read and ``dx`` written. The causal kernels read only the lower triangle (keys ``j <= i``), so the
causal cases count only those reads (and every write). GB/s over the measured copy bandwidth is the fraction of the
memory-bound ceiling reached.

  python benchmarks/bench_softmax.py     # this benchmark alone (run.py runs them all and writes the results)
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

import harness
from te_jax.ops.softmax import SoftmaxConfig, softmax_bwd, softmax_bwd_ref, softmax_fwd, softmax_fwd_ref

BF16 = jnp.dtype(jnp.bfloat16)
SCALE = 1.0 / math.sqrt(128.0)


@dataclasses.dataclass(frozen=True)
class Case:
  kind: str       # "plain", "masked" or "causal"
  backward: bool = False
  shape: tuple[int, int, int, int] = (4, 32, 2048, 2048)
  note: str = ""

  def name(self, shape: tuple[int, ...]) -> str:
    return f"{self.kind} {'bwd' if self.backward else 'fwd'} {'x'.join(map(str, shape))} bf16"


CASES = tuple(Case(kind, backward) for backward in (False, True) for kind in ("plain", "masked", "causal"))


def _lower_triangle(sq: int, sk: int) -> int:
  """Elements with key j <= query i in an (sq, sk) block."""
  return sum(min(i + 1, sk) for i in range(sq))


def _agree(got: jax.Array, want: jax.Array) -> bool:
  """max |got - want| <= two bf16 ulps of max |want| (2^-7 of its binade's power of two)."""
  diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  largest = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
  if not math.isfinite(diff):
    return False
  ulp = 2.0 ** (math.floor(math.log2(largest)) - 7) if largest > 0 else 0.0
  return diff <= 2 * ulp


def _barrier(x, s):
  """``x``, made to depend on the scalar ``s`` at no cost: harness.time_loop varies ``s`` between iterations, and
  the barrier keeps XLA from hoisting the (otherwise loop-invariant) op out of its loop."""
  return jax.lax.optimization_barrier((x, s))[0]


def bench_case(ctx: harness.Context, case: Case, key: jax.Array) -> list[dict]:
  """Times one case on both paths; returns the te_jax row and the XLA row."""
  shape = tuple(max(1, d // ctx.shrink) for d in case.shape)
  kx, km, kg = jax.random.split(key, 3)
  x = (4.0 * jax.random.normal(kx, shape, jnp.float32)).astype(BF16)
  mask = jax.random.bernoulli(km, 0.3, (shape[0], 1, *shape[2:])) if case.kind == "masked" else None
  masks = () if mask is None else (mask,)
  config = SoftmaxConfig(kind=case.kind, scale=SCALE)
  offset = jnp.int32(0)
  s = jnp.float32(1.0)
  rows_n, sq, sk = math.prod(shape[:-1]), shape[-2], shape[-1]
  n = math.prod(shape)
  read = math.prod(shape[:-2]) * _lower_triangle(sq, sk) if case.kind == "causal" else n

  if case.backward:
    y = softmax_fwd(x, mask, kind=case.kind, scale_factor=SCALE)
    dy = jax.random.normal(kg, shape, jnp.float32).astype(BF16)

    def ours(dy, y, s):
      return softmax_bwd(_barrier(dy, s), y, kind=case.kind, scale_factor=SCALE)

    def xla(dy, y, s):
      return softmax_bwd_ref(_barrier(dy, s), y, offset, config=config)[0]

    args = (dy, y, s)
    moved = 2 * (2 * read) + 2 * n
  else:
    def ours(x, *rest):
      return softmax_fwd(_barrier(x, rest[-1]), *rest[:-1], kind=case.kind, scale_factor=SCALE)

    def xla(x, *rest):
      return softmax_fwd_ref(_barrier(x, rest[-1]), offset, *rest[:-1], config=config)[0]

    args = (x, *masks, s)
    moved = 2 * read + 2 * n + (mask.size if mask is not None else 0)

  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, *args)
  expected = f"te_softmax_{'bwd' if case.backward else 'fwd'}_{ctx.platform}"
  native = expected in targets
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  agree = _agree(te_fn(*args), xla_fn(*args))

  rows = []
  for impl, fn, plain in (("te_jax", te_fn, ours), ("xla (jnp)", xla_fn, xla)):
    rows.append({
        "bench": "softmax",
        "case": case.name(shape),
        "impl": impl,
        "kind": case.kind,
        "backward": case.backward,
        "shape": list(shape),
        "rows": rows_n,
        "dtype": "bfloat16",
        "scale_factor": SCALE,
        **harness.memory_bound_timing(ctx, fn, plain, args, moved, n),
        "handler": te_handler if impl == "te_jax" else "xla fusion",
        "note": case.note,
    })
  return harness.judge_pair(*rows, native=native, expected=expected, agree=agree)


def run(ctx: harness.Context) -> list[dict]:
  """All cases, te_jax row then XLA row for each."""
  return harness.run_pairs(ctx, "softmax", CASES, bench_case, seed=300)


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_softmax", "--no-write"]))
