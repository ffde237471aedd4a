"""Rotary position embedding: te_jax's rope_fwd / rope_bwd (one fused kernel each) vs the same math compiled by XLA.

The baseline is ``te_jax.ops.rope.rope_fwd_ref`` / ``rope_bwd_ref`` under ``jax.jit``: the same rotation of the same
bfloat16 ``x`` (or gradient ``g``) by the same float32 cos/sin tables, which XLA fuses into one loop. Both run in one
process on the same inputs, a Llama-sized attention input: B=4, S=2048, H=32 heads of D=128, all 128 features
rotating, in both layouts, forward and backward (the backward rotation is the forward one by the negated angle, so
its cost is the forward's). Each row checks that the te_jax path ran its native handler (the target is in the
compiled HLO) and that its output equals XLA's bit for bit.

Both functions take ``(x, cos, sin, shift)`` and rotate by the tables ``(cos + shift, sin)``: ``shift`` (0 at run
time; the harness's loop timing perturbs it so that no iteration can be hoisted) costs one pass over the 0.5 MiB cos
table, which XLA fuses into its loop and te_jax runs as a separate small kernel.

Bytes moved = x read + y written + the two tables read once (the minimum traffic of the op), so GB/s over the
measured copy bandwidth is the fraction of the memory-bound ceiling reached.

  python benchmarks/bench_rope.py     # this benchmark alone (run.py runs them all and writes the results)
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

import harness
import te_jax
from te_jax.ops.rope import RopeConfig, rope_bwd, rope_bwd_ref, rope_fwd, rope_fwd_ref


@dataclasses.dataclass(frozen=True)
class Case:
  shape: tuple[int, int, int, int]  # (B, S, H, D), whatever the layout
  layout: str = "BSHD"
  backward: bool = False
  interleaved: bool = False
  note: str = ""

  def x_shape(self, shape) -> tuple[int, ...]:
    b, s, h, d = shape
    return (b, s, h, d) if self.layout == "BSHD" else (s, b, h, d)

  def name(self, shape) -> str:
    pairs = "interleaved" if self.interleaved else "rotate-half"
    return (f"rope {'bwd' if self.backward else 'fwd'} {self.layout} {'x'.join(map(str, self.x_shape(shape)))} "
            f"bf16 {pairs}")


LLAMA = (4, 2048, 32, 128)
CASES = (
    Case(LLAMA, "BSHD", note="acceptance shape"),
    Case(LLAMA, "SBHD", note="acceptance shape"),
    Case(LLAMA, "BSHD", backward=True, note="acceptance shape"),
    Case(LLAMA, "SBHD", backward=True, note="acceptance shape"),
    Case(LLAMA, "BSHD", interleaved=True),
)


def bench_case(ctx: harness.Context, case: Case, key: jax.Array) -> list[dict]:
  """Times one case on both paths; returns the te_jax row and the XLA row."""
  b, s, h, d = case.shape
  shape = (b, max(1, s // ctx.shrink), max(1, h // ctx.shrink), d)  # a CPU smoke run keeps D (the pairs)
  x = jax.random.normal(key, case.x_shape(shape), jnp.float32).astype(jnp.bfloat16)
  freqs = te_jax.rope_frequencies(shape[1], d)
  cos, sin = jnp.cos(freqs), jnp.sin(freqs)
  config = RopeConfig(layout=case.layout, interleaved=case.interleaved)
  op, ref = (rope_bwd, rope_bwd_ref) if case.backward else (rope_fwd, rope_fwd_ref)

  def ours(x, cos, sin, shift):
    return op(x, cos + shift, sin, layout=case.layout, interleaved=case.interleaved)

  def xla(x, cos, sin, shift):
    return ref(x, cos + shift, sin, config=config)[0]

  args = (x, cos, sin, jnp.float32(0.0))
  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, *args)
  expected = f"te_rope_{'bwd' if case.backward else 'fwd'}_{ctx.platform}"
  native = expected in targets
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  agree = harness.bitwise_equal(te_fn(*args), xla_fn(*args))

  moved = 2 * x.nbytes + cos.nbytes + sin.nbytes
  rows = []
  for impl, fn, plain in (("te_jax", te_fn, ours), ("xla (jnp)", xla_fn, xla)):
    rows.append({
        "bench": "rope",
        "case": case.name(shape),
        "impl": impl,
        "backward": case.backward,
        "layout": case.layout,
        "interleaved": case.interleaved,
        "shape": list(x.shape),
        "rotary_dim": d,
        "dtype": "bfloat16",
        **harness.memory_bound_timing(ctx, fn, plain, args, moved, math.prod(x.shape)),
        "handler": te_handler if impl == "te_jax" else "xla fusion",
        "note": case.note,
    })
  return harness.judge_pair(*rows, native=native, expected=expected, agree=agree)


def run(ctx: harness.Context) -> list[dict]:
  """All cases, te_jax row then XLA row for each."""
  return harness.run_pairs(ctx, "rope", CASES, bench_case, seed=0)


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_rope", "--no-write"]))
