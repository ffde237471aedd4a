"""Quantize: quantize (one fused kernel) vs the same math compiled by XLA from jnp.

The baseline is ``te_jax.ops.quantize.quantize_ref`` under ``jax.jit``: the same outputs (FP8 data, transposed FP8
data, amax, dbias), which XLA fuses as well as it can. Both run in one process on the same input. Each row checks
that the te_jax path ran the native handler (its target is in the compiled HLO) and that its outputs equal XLA's
(bitwise for the FP8 data and amax; dbias within float32 summation-order error), and says so when not.

Bytes moved = input bytes + one FP8 byte per element for each FP8 output (+ the float32 dbias vector): the minimum
traffic of the op, so GB/s over the measured copy bandwidth is the fraction of the memory-bound ceiling reached.

The block-scaled rows (``BlockCase``: ``te_jax.ops.quantize_block.quantize_block`` against its reference under
``jax.jit``; outputs checked bit for bit against the reference run by XLA:CPU) count x's bytes, the data's (one byte an element, half a byte for E2M1) and the scales', for each copy.
NVFP4 rows take the global amax as given (as a training step that reduced it earlier does), except the one marked
"amax computed", whose time also holds the XLA reduction of max|x| that reads x once more before the cast (its bytes
still count x once: the row shows what the second pass costs).

  python benchmarks/bench_quantize.py     # this benchmark alone (run.py runs them all and writes the results)
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp

import harness
from te_jax.ops.quantize import QuantizeConfig, quantize_ref
from te_jax._core.scaling import compute_scale, fp8_max
from te_jax.ops.quantize import amax, quantize
from te_jax._core.quantized_tensor import ScalingMode
from te_jax.ops.quantize_block import quantize_block, quantize_block_ref, quantize_nvfp4_ref

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Case:
  shape: tuple[int, int]
  dtype: jnp.dtype
  transpose: bool = True
  dbias: bool = False
  note: str = ""

  def name(self, shape: tuple[int, ...]) -> str:
    extras = ["+T" if self.transpose else "", "+dbias" if self.dbias else ""]
    return f"{'x'.join(map(str, shape))} {jnp.dtype(self.dtype).name}->e4m3{''.join(extras)}"


CASES = (
    Case((16384, 8192), jnp.bfloat16, note="acceptance shape"),
    Case((8192, 8192), jnp.bfloat16),
    Case((16384, 8192), jnp.bfloat16, transpose=False),
    Case((16384, 8192), jnp.float32),
    Case((16384, 8192), jnp.bfloat16, dbias=True),
)


def _outputs_agree(x: jax.Array, got: tuple, want: tuple, case: Case) -> bool:
  """FP8 data, transposed data and amax bitwise; dbias to float32 summation-order error (1e-5 of sum |x|)."""
  n_exact = len(got) - (1 if case.dbias else 0)
  if not all(harness.bitwise_equal(a, b) for a, b in zip(got[:n_exact], want[:n_exact], strict=True)):
    return False
  if case.dbias:
    bound = 1e-5 * jnp.sum(jnp.abs(x.astype(jnp.float32)), axis=0)
    return bool(jnp.all(jnp.abs(got[-1] - want[-1]) <= bound))
  return True


def bench_case(ctx: harness.Context, case: Case, key: jax.Array) -> list[dict]:
  """Times one case on both paths; returns the te_jax row and the XLA row."""
  shape = tuple(d // ctx.shrink for d in case.shape)
  x = (3.0 * jax.random.normal(key, shape, jnp.float32)).astype(case.dtype)
  scale = compute_scale(amax(x), jnp.float32(1.0), fp8_max(E4M3))
  config = QuantizeConfig(out_dtype=E4M3, transpose=case.transpose, dbias=case.dbias)

  def ours(x, s):  # the reference's outputs, in its order: data, data_t, amax, dbias
    out = quantize(x, s, E4M3, transpose=case.transpose, dbias=case.dbias)
    return tuple(o for o in (out.out.data, out.out.data_t, out.amax, out.dbias) if o is not None)

  def xla(x, s):
    return tuple(quantize_ref(x, s, config=config))

  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, x, scale)
  expected = f"te_quantize_{ctx.platform}"
  native = expected in targets
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  agree = _outputs_agree(x, te_fn(x, scale), xla_fn(x, scale), case)

  fp8_copies = 2 if case.transpose else 1
  moved = x.nbytes + fp8_copies * x.size + (4 * shape[-1] if case.dbias else 0)
  rows = []
  for impl, fn, plain in (("te_jax", te_fn, ours), ("xla (jnp)", xla_fn, xla)):
    rows.append({
        "bench": "quantize",
        "case": case.name(shape),
        "impl": impl,
        "shape": list(shape),
        "dtype": jnp.dtype(case.dtype).name,
        "out_dtype": E4M3.name,
        "transpose": case.transpose,
        "dbias": case.dbias,
        **harness.memory_bound_timing(ctx, fn, plain, (x, scale), moved, x.size),
        "handler": te_handler if impl == "te_jax" else "xla fusion",
        "note": case.note,
    })
  return harness.judge_pair(*rows, native=native, expected=expected, agree=agree)


@dataclasses.dataclass(frozen=True)
class BlockCase:
  shape: tuple[int, int]
  mode: ScalingMode
  transpose: bool = True
  block_2d: bool = False
  amax_given: bool = True
  dtype: jnp.dtype = jnp.bfloat16
  note: str = ""

  def name(self, shape: tuple[int, ...]) -> str:
    out = "e2m1" if self.mode is ScalingMode.NVFP4_1X16 else "e4m3"
    extras = ("+T" if self.transpose else "") + (" 16x16" if self.block_2d else "")
    extras += "" if self.mode is not ScalingMode.NVFP4_1X16 else (" amax given" if self.amax_given else
                                                                   " amax computed")
    return f"{'x'.join(map(str, shape))} {jnp.dtype(self.dtype).name}->{out} {self.mode.name}{extras}"


BLOCK_CASES = (
    BlockCase((8192, 4096), ScalingMode.BLOCK_1X128, note="block scaling's activations (+T: the backward's copy)"),
    BlockCase((8192, 4096), ScalingMode.BLOCK_1X128, transpose=False),
    BlockCase((8192, 4096), ScalingMode.BLOCK_128X128),
    BlockCase((8192, 4096), ScalingMode.MXFP8_1X32),
    BlockCase((8192, 4096), ScalingMode.NVFP4_1X16),
    BlockCase((8192, 4096), ScalingMode.NVFP4_1X16, amax_given=False),
)


def _bitwise_equal(a: jax.Array, b: jax.Array) -> bool:
  """harness.bitwise_equal, and for E2M1 (4 bits an element, which no 8-bit integer bitcast takes) its 4-bit codes."""
  if a.dtype == jnp.float4_e2m1fn and a.shape == b.shape and b.dtype == a.dtype:
    codes = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint4).astype(jnp.uint8)  # noqa: E731
    return bool(jnp.array_equal(codes(a), codes(b)))
  return harness.bitwise_equal(a, b)


def bench_block_case(ctx: harness.Context, case: BlockCase, key: jax.Array) -> list[dict]:
  """Times one block-scaled case on both paths; returns the te_jax row and the XLA row."""
  shape = tuple(d // ctx.shrink for d in case.shape)
  x = (3.0 * jax.random.normal(key, shape, jnp.float32)).astype(case.dtype)
  nvfp4 = case.mode is ScalingMode.NVFP4_1X16
  kw = dict(with_transposed=case.transpose) | (dict(block_2d=case.block_2d) if nvfp4 else {})

  # s: NVFP4's global amax where given (the float scalar time_loop perturbs); unused by the other modes.
  def ours(x, s):
    extra = dict(global_amax=s) if nvfp4 and case.amax_given else {}
    return jax.tree.leaves(quantize_block(x, case.mode, **kw, **extra))

  def xla(x, s):
    if not nvfp4:
      return jax.tree.leaves(quantize_block_ref(x, case.mode, **kw))
    return jax.tree.leaves(quantize_nvfp4_ref(x, **kw, **(dict(global_amax=s) if case.amax_given else {})))

  s = amax(x)
  te_fn, xla_fn = jax.jit(ours), jax.jit(xla)
  targets = harness.custom_call_targets(te_fn, x, s)
  expected = "te_quantize_block_cuda"
  native = expected in targets or not ctx.gpu  # there is no CPU handler: on a CPU the reference is the path
  te_handler = ", ".join(sorted(name for name in targets if name.startswith("te_"))) or "reference"
  # Agreement with the reference as XLA:CPU computes it, the definition (XLA:GPU's compilation of the same jnp gives
  # other float32 scales on large inputs; tests/test_quantize_block.py says more).
  cpu = jax.devices("cpu")[0]
  want = jax.device_put(xla_fn(*jax.device_put((x, s), cpu)), jax.devices()[0])
  agree = all(_bitwise_equal(a, b) for a, b in zip(te_fn(x, s), want, strict=True))
  scales = case.mode.scale_shape(shape)
  scale_bytes = math.prod(scales) * case.mode.scale_dtype.itemsize
  data_bytes = x.size // 2 if nvfp4 else x.size
  moved = x.nbytes + (2 if case.transpose else 1) * (data_bytes + scale_bytes) + (4 if nvfp4 else 0)
  rows = []
  for impl, fn, plain in (("te_jax", te_fn, ours), ("xla (jnp)", xla_fn, xla)):
    rows.append({
        "bench": "quantize",
        "case": case.name(shape),
        "impl": impl,
        "shape": list(shape),
        "dtype": jnp.dtype(case.dtype).name,
        "mode": case.mode.name,
        "transpose": case.transpose,
        **harness.memory_bound_timing(ctx, fn, plain, (x, s), moved, x.size),
        "handler": te_handler if impl == "te_jax" else "xla fusion",
        "note": case.note,
    })
  return harness.judge_pair(*rows, native=native, expected=expected, agree=agree)


def run(ctx: harness.Context) -> list[dict]:
  """All cases, te_jax row then XLA row for each: the per-tensor cast, then the block-scaled ones."""
  return (harness.run_pairs(ctx, "quantize", CASES, bench_case, seed=0)
          + harness.run_pairs(ctx, "quantize", BLOCK_CASES, bench_block_case, seed=len(CASES)))


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_quantize", "--no-write"]))
