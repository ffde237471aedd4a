"""gemm of block-scaled operands (te_jax.ops.gemm_block): the emulated path, cuBLASLt's scale layouts, the dispatch,
sharding, and on a GPU the native cuBLASLt kernels.

- CPU: the emulated path against an independent numpy computation (the operands dequantized in float64 from their
  bytes and block scales, rounded to bfloat16, multiplied in float64) within the tolerance rule (CONTRIBUTING.md), for
  every mode pair, with bias, residual, rhs_parts, keep_rows / contract_dims and scatter_rows, under jit and vmap.
- The kernel-layout scales against cuBLASLt's documented index formulas, and the native path's program (the primitive
  with those scales, lowered to its reference on the CPU) equal to the emulated path bit for bit.
- The dispatch rule (which shapes and GPUs get the native path), argument errors, sharding on 8 CPU devices.
- GPU (``@pytest.mark.gpu``): the native kernel at the three GEMMs of a linear layer, 8192^3 and shapes that are not
  multiples of 128, against float64 of the dequantized operands, with the dispatch checked in the compiled HLO.
"""

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import F32_U
from te_jax import QuantizedTensor, ScalingMode
from te_jax.ops.gemm import _gemm_body, gemm
from te_jax.ops.gemm_block import (block_gemm_path, emulate, kernel_scales, logical_scales, native_block_reason)
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_block import quantize_block_ref, quantize_nvfp4_ref

S = ScalingMode
CPU = jax.devices("cpu")[0]
CPU_DEVICES = jax.devices("cpu")
FP8_ACCUM_U = 2.0**-14  # Hopper's FP8 MMA accumulator (tests/test_gemm.py)
PAIRS = {"1x128-1x128": (S.BLOCK_1X128, S.BLOCK_1X128), "1x128-128x128": (S.BLOCK_1X128, S.BLOCK_128X128),
         "128x128-1x128": (S.BLOCK_128X128, S.BLOCK_1X128), "128x128-128x128": (S.BLOCK_128X128, S.BLOCK_128X128),
         "mxfp8": (S.MXFP8_1X32, S.MXFP8_1X32), "nvfp4": (S.NVFP4_1X16, S.NVFP4_1X16)}
HOPPER_PAIRS = ("1x128-1x128", "1x128-128x128", "128x128-1x128")
_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def quantized(shape, mode, seed, device=CPU, dtype=jnp.float8_e4m3fn):
  """A block-scaled operand of normal values times a per-row spread (so the blocks' scales differ)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,)))
  x = jax.device_put(x.astype(np.float32), device)
  if mode is S.NVFP4_1X16:
    return quantize_nvfp4_ref(x)
  return quantize_block_ref(x, mode, dtype)


def dequantized64(q: QuantizedTensor) -> np.ndarray:
  """``q``'s value in float64 from its bytes and its logical scales, written here: each scale repeated over its
  block (rows 1: within a row)."""
  data = np.asarray(q.data.astype(jnp.float32)).astype(np.float64)
  s = np.asarray(q.scale_inv.astype(jnp.float32)).astype(np.float64)
  rows, cols = q.mode.block
  s = np.repeat(s, cols, axis=-1)[..., :data.shape[-1]]
  if rows > 1:
    s = np.repeat(s, rows, axis=-2)[..., :data.shape[-2], :]
  g = 1.0 if q.global_scale_inv is None else float(q.global_scale_inv)
  return data * (s * g)


def bf16_64(x64: np.ndarray) -> np.ndarray:
  """float64 values rounded as the emulation rounds them: to float32, then bfloat16."""
  return x64.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def check_close(ours, a64, b64, added64=None, accum_u=F32_U, k=None):
  """The tolerance rule against the float64 product of ``a64`` (M, K) and ``b64`` (N, K): the baseline is the same
  products accumulated in float32 (numpy), ``noise = sqrt(K) * accum_u * max sum|a||b|``."""
  exact = a64 @ b64.T + (0 if added64 is None else added64)
  base = (a64.astype(np.float32) @ b64.astype(np.float32).T).astype(np.float64) + (0 if added64 is None else added64)
  ours = np.asarray(ours).astype(np.float64).reshape(exact.shape)
  assert np.all(np.isfinite(ours))
  err, err_base = np.abs(ours - exact).max(), np.abs(base - exact).max()
  noise = math.sqrt(k or a64.shape[-1]) * accum_u * float((np.abs(a64) @ np.abs(b64).T).max())
  assert err <= 2 * err_base + noise, f"err {err:.3g} > 2 * {err_base:.3g} + {noise:.3g}"


# ---- CPU: the emulated path ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", PAIRS)
def test_emulated_values(pair):
  """Every mode pair, bias and residual, float32 out: the bfloat16-dequantized operands' product."""
  lm, rm = PAIRS[pair]
  m, n, k = 48, 160, 384
  lhs, rhs = quantized((m, k), lm, 1), quantized((n, k), rm, 2)
  bias = np.random.default_rng(3).standard_normal(n).astype(np.float32)
  residual = np.random.default_rng(4).standard_normal((m, n)).astype(np.float32)
  out = jax.jit(lambda a, b: gemm(a, b, bias=bias, residual=residual, dtype=jnp.float32))(lhs, rhs)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  check_close(out, bf16_64(dequantized64(lhs)), bf16_64(dequantized64(rhs)), bias + residual.astype(np.float64))


def test_emulated_options():
  """keep_rows, contract_dims=2 (a weight gradient of kept rows), scatter_rows, rhs_parts with biases, vmap: each
  equal to the same options on the bfloat16-dequantized operands, bit for bit."""
  x = quantized((2, 128, 256), S.BLOCK_1X128, 5)
  w = quantized((96, 256), S.BLOCK_128X128, 6)
  ex, ew = emulate(x), emulate(w)
  f = jax.jit(lambda a, b: gemm(a, b, keep_rows=True))
  np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(f(ex, ew)))
  f = jax.jit(lambda a, b: gemm(a, b, scatter_rows=True, dtype=jnp.float32))
  np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(f(ex, ew)))
  xt, gt = quantized((64, 2, 128), S.BLOCK_1X128, 7), quantized((32, 2, 128), S.BLOCK_1X128, 8)
  f = jax.jit(lambda a, b: gemm(a, b, contract_dims=2, dtype=jnp.float32))
  np.testing.assert_array_equal(np.asarray(f(xt, gt)), np.asarray(f(emulate(xt), emulate(gt))))
  parts = quantized((3, 32, 256), S.BLOCK_1X128, 9)
  bias = jnp.arange(96.0).reshape(3, 32)
  got = jax.jit(lambda a, b: gemm(a, b, rhs_parts=True, bias=bias))(x, parts)
  want = gemm(ex, emulate(parts), rhs_parts=True, bias=bias)
  assert len(got) == 3
  for g, w_ in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))
  two = jax.tree.map(lambda a: jnp.stack([a, a]), x)  # vmap over a stacked QuantizedTensor
  mapped = jax.vmap(lambda a: gemm(a, w, keep_rows=True))(two)
  np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(gemm(ex, ew, keep_rows=True)))


# ---- cuBLASLt's scale layouts and the native path's program ---------------------------------------------------------


@pytest.mark.parametrize("mode", [S.BLOCK_1X128, S.BLOCK_128X128, S.MXFP8_1X32], ids=lambda m: m.name)
def test_kernel_scales_follow_cublaslt_layout(mode):
  """Each scale lands at the offset cuBLAS's documentation gives for it, and ``logical_scales`` inverts it."""
  rows, k = 200, 1000  # neither a multiple of the tiles
  shape = mode.scale_shape((rows, k))
  logical = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) + 1
  kernel = np.asarray(kernel_scales(logical, mode, (rows, k), 1)).reshape(-1)
  lg = np.asarray(logical)
  r_idx, l_idx = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
  if mode is S.BLOCK_1X128:  # (L, R), R contiguous
    offset = l_idx * rows + r_idx
  elif mode is S.BLOCK_128X128:  # (ceil(R / 128), L4), K-major
    l4 = -(-shape[1] // 4) * 4
    offset = r_idx * l4 + l_idx
    assert kernel.size == shape[0] * l4
  else:  # 128 x 4 tiles in row-major order; within one, (outer % 32) * 16 + (outer / 32) * 4 + inner
    l4 = -(-shape[1] // 4) * 4
    tile = (r_idx // 128) * (l4 // 4) + l_idx // 4
    outer, inner = r_idx % 128, l_idx % 4
    offset = tile * 512 + (outer % 32) * 16 + (outer // 32) * 4 + inner
    assert kernel.size == -(-rows // 128) * 128 * l4
  np.testing.assert_array_equal(kernel[offset], lg)
  back = logical_scales(kernel_scales(logical, mode, (rows, k), 1), mode, (rows, k), 1)
  np.testing.assert_array_equal(np.asarray(back), lg)


NATIVE_OPTS = dict(bias=None, residual=None, dtype=jnp.float32, transpose_lhs=False, transpose_rhs=False,
                   fast_accum=False, rhs_parts=False, scatter_rows=False, keep_rows=False, contract_dims=1)


def native_program(lhs, rhs, **opts):
  """The native path's GEMM (the primitive with kernel-layout scales), whichever machine this is: on the CPU it lowers
  to the primitive's reference."""
  return _gemm_body(lhs.data, rhs.data, lhs.scale_inv, rhs.scale_inv, modes=(lhs.mode, rhs.mode),
                    **{**NATIVE_OPTS, **opts})


@pytest.mark.parametrize("pair", HOPPER_PAIRS)
def test_native_program_is_the_emulation(pair):
  """The scales in cuBLASLt's layout, through the primitive (and its reference), give the emulation's bits: plain,
  with the rows kept and with two contracted dims."""
  lm, rm = PAIRS[pair]
  lhs, rhs = quantized((64, 512), lm, 10), quantized((256, 512), rm, 11)
  bias = jnp.linspace(-1, 1, 256)
  got = jax.jit(lambda a, b: native_program(a, b, bias=bias, dtype=jnp.bfloat16))(lhs, rhs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(gemm(emulate(lhs), emulate(rhs), bias=bias)))
  if lm is S.BLOCK_1X128:
    x = quantized((2, 32, 512), lm, 12)
    got = jax.jit(lambda a, b: native_program(a, b, keep_rows=True))(x, rhs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gemm(emulate(x), emulate(rhs), keep_rows=True,
                                                                   dtype=jnp.float32)))
  if lm is rm is S.BLOCK_1X128:
    xt, gt = quantized((64, 2, 256), lm, 13), quantized((48, 2, 256), rm, 14)
    got = jax.jit(lambda a, b: native_program(a, b, contract_dims=2))(xt, gt)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gemm(emulate(xt), emulate(gt), contract_dims=2,
                                                                   dtype=jnp.float32)))


# ---- dispatch and errors -------------------------------------------------------------------------------------------

# (lhs mode, rhs mode, lhs shape, rhs shape, cc, options, native?)
DISPATCH = {
    "forward": (S.BLOCK_1X128, S.BLOCK_128X128, (4096, 1024), (1024, 1024), (9, 0), {}, True),
    "dgrad": (S.BLOCK_1X128, S.BLOCK_128X128, (4096, 1024), (1024, 1024), (9, 0), {}, True),
    "wgrad": (S.BLOCK_1X128, S.BLOCK_1X128, (1024, 4096), (1024, 4096), (9, 0), {}, True),
    "wgrad-kept-rows": (S.BLOCK_1X128, S.BLOCK_1X128, (1024, 2, 2048), (1024, 2, 2048), (9, 0),
                        {"contract_dims": 2}, True),
    "not-128-multiples": (S.BLOCK_1X128, S.BLOCK_128X128, (1000, 1040), (1040, 1040), (9, 0), {}, True),
    "m-not-8": (S.BLOCK_1X128, S.BLOCK_128X128, (1001, 1024), (1024, 1024), (9, 0), {}, False),
    "n-not-16": (S.BLOCK_1X128, S.BLOCK_1X128, (1024, 1024), (1000, 1024), (9, 0), {}, False),
    "2d-x-2d": (S.BLOCK_128X128, S.BLOCK_128X128, (1024, 1024), (1024, 1024), (9, 0), {}, False),
    "kept-rows-not-folding": (S.BLOCK_1X128, S.BLOCK_1X128, (512, 2, 100), (512, 2, 100), (9, 0),
                              {"contract_dims": 2}, False),
    "blackwell-block": (S.BLOCK_1X128, S.BLOCK_128X128, (1024, 1024), (1024, 1024), (10, 0), {}, False),
    "mxfp8-hopper": (S.MXFP8_1X32, S.MXFP8_1X32, (1024, 1024), (1024, 1024), (9, 0), {}, False),
    "mxfp8-blackwell": (S.MXFP8_1X32, S.MXFP8_1X32, (1024, 1024), (1024, 1024), (10, 0), {}, True),
    "nvfp4-blackwell": (S.NVFP4_1X16, S.NVFP4_1X16, (1024, 1024), (1024, 1024), (10, 0), {}, True),
    "no-gpu": (S.BLOCK_1X128, S.BLOCK_128X128, (4096, 1024), (1024, 1024), None, {}, False),
}


@pytest.mark.parametrize("case", DISPATCH)
def test_dispatch_rule(case):
  lm, rm, ls, rs, cc, opts, native = DISPATCH[case]
  why = native_block_reason(lm, rm, ls, rs, (jnp.float8_e4m3fn,) * 2, cc, **opts)
  assert (why is None) == native, why


def test_cpu_runs_the_emulation():
  """Lowered for the CPU, the block GEMM is the emulation, bit for bit."""
  lhs, rhs = quantized((16, 128), S.BLOCK_1X128, 15), quantized((16, 128), S.BLOCK_128X128, 16)
  if jax.default_backend() == "cpu":  # on a GPU machine the default device is the GPU
    assert block_gemm_path(lhs, rhs).startswith("emulated")
  got = jax.jit(gemm)(lhs, rhs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(gemm(emulate(lhs), emulate(rhs))))


def _q(shape, mode, dtype=jnp.float8_e4m3fn):
  return QuantizedTensor(jnp.zeros(shape, dtype), jnp.ones(mode.scale_shape(shape), mode.scale_dtype), mode=mode)


ERRORS = {
    "per-tensor-lhs": (lambda: gemm(QuantizedTensor(jnp.zeros((16, 128), jnp.float8_e4m3fn), jnp.float32(1)),
                                    _q((16, 128), S.BLOCK_1X128)),
                       ValueError, r"lhs is scaled PER_TENSOR but rhs is scaled BLOCK_1X128"),
    "bf16-rhs": (lambda: gemm(_q((16, 128), S.BLOCK_1X128), jnp.zeros((16, 128), jnp.bfloat16)),
                 ValueError, r"rhs is a bfloat16 array but lhs is scaled BLOCK_1X128"),
    "mxfp8-x-1x128": (lambda: gemm(_q((16, 128), S.MXFP8_1X32), _q((16, 128), S.BLOCK_1X128)),
                      ValueError, r"lhs is scaled MXFP8_1X32 and rhs BLOCK_1X128: these do not multiply"),
    "scale-shape": (lambda: gemm(QuantizedTensor(jnp.zeros((16, 128), jnp.float8_e4m3fn), jnp.ones((16, 2)),
                                                 mode=S.BLOCK_1X128), _q((16, 128), S.BLOCK_1X128)),
                    TypeError, r"lhs\.scale_inv must be float32\[16, 1\]"),
    "nvfp4-no-global": (lambda: gemm(_q((16, 128), S.NVFP4_1X16, jnp.float4_e2m1fn),
                                     _q((16, 128), S.NVFP4_1X16, jnp.float4_e2m1fn)),
                        TypeError, r"lhs is NVFP4 and needs a float32 scalar global_scale_inv"),
    "bf16-data": (lambda: gemm(_q((16, 128), S.BLOCK_1X128, jnp.bfloat16), _q((16, 128), S.BLOCK_1X128)),
                  TypeError, r"lhs is scaled BLOCK_1X128 and must hold float8_e4m3fn or float8_e5m2 data"),
    "transposed": (lambda: gemm(_q((128, 16), S.BLOCK_1X128), _q((16, 128), S.BLOCK_1X128), transpose_lhs=True),
                   ValueError, r"FP8 operands must be K-major"),
    "k-mismatch": (lambda: gemm(_q((16, 128), S.BLOCK_1X128), _q((16, 256), S.BLOCK_1X128)),
                   ValueError, r"contracting dims differ"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_argument_errors(case):
  call, exc, match = ERRORS[case]
  with pytest.raises(exc, match=match):
    call()
  with pytest.raises(exc, match=match):
    jax.jit(call).lower()


# ---- sharding on 8 CPU devices -------------------------------------------------------------------------------------

# (lhs data spec, rhs data spec, collectives expected): as the per-tensor GEMM's (tests/test_gemm.py)
SHARDING = {
    "column-parallel": (P(), P("x", None), {}),
    "row-parallel": (P(None, "x"), P(None, "x"), {"all-reduce": 1}),
    "data-parallel": (P("x", None), P(), {}),
}


def _placed(q: QuantizedTensor, mesh, spec) -> QuantizedTensor:
  """``q`` with its data placed as ``spec`` says and its logical scales alike (the same mesh axes on each dim)."""
  sharding = NamedSharding(mesh, spec)
  try:
    sharding.shard_shape(q.scale_inv.shape)
  except ValueError:  # scales too few to split (a shard cutting blocks): replicated, as the partitioner will ask
    sharding = NamedSharding(mesh, P())
  return QuantizedTensor(jax.device_put(q.data, NamedSharding(mesh, spec)), jax.device_put(q.scale_inv, sharding),
                         mode=q.mode)


@pytest.mark.parametrize("case", SHARDING)
@pytest.mark.parametrize("path", ["native-program", "emulated"])
def test_sharded(case, path):
  """Sharded == unsharded (K sharded: within the reordered float32 sum's bound), the collectives of the per-tensor
  GEMM (no all-gather of the activation), for the native path's program and the emulated path."""
  lhs_spec, rhs_spec, want = SHARDING[case]
  mesh = Mesh(np.array(CPU_DEVICES), ("x",))
  m, n, k = 128, 1024, 2048  # shards: 16 rows, 128 columns (one 128 x 128 block row), 256 of K (2 blocks)
  lhs, rhs = quantized((m, k), S.BLOCK_1X128, 17), quantized((n, k), S.BLOCK_128X128, 18)
  f = native_program if path == "native-program" else functools.partial(gemm, dtype=jnp.float32)
  if path == "native-program" and case == "row-parallel":  # 2 blocks of K per shard: no groups of 4 for 128 x 128
    rhs = quantized((n, k), S.BLOCK_1X128, 18)
  a, b = _placed(lhs, mesh, lhs_spec), _placed(rhs, mesh, rhs_spec)
  compiled = jax.jit(f).lower(a, b).compile()
  out = compiled(a, b)
  found = collections.Counter(_COLLECTIVE.findall(compiled.as_text()))
  assert found == collections.Counter(want), found
  ref = np.asarray(jax.jit(f)(lhs, rhs)).astype(np.float64)
  a64, b64 = bf16_64(dequantized64(lhs)), bf16_64(dequantized64(rhs))
  gamma = (k - 1) * F32_U / (1 - (k - 1) * F32_U)
  assert np.all(np.abs(np.asarray(out) - ref) <= 2 * gamma * (np.abs(a64) @ np.abs(b64).T))


def test_sharded_blocks_must_be_whole():
  """A shard cutting a 128 x 128 block of the weight's rows is an error naming the operand, the dim, the axis and
  the block (raised by the native path's partitioning)."""
  mesh = Mesh(np.array(CPU_DEVICES), ("x",))
  lhs, rhs = quantized((64, 1024), S.BLOCK_1X128, 19), quantized((256, 1024), S.BLOCK_128X128, 20)
  a, b = _placed(lhs, mesh, P()), _placed(rhs, mesh, P("x", None))  # 32 rows per shard
  with pytest.raises(Exception, match=r"rhs's dim 0 \(size 256\) is sharded over mesh axes \('x',\) into shards of "
                                      r"32: BLOCK_128X128 scaling needs whole 128 x 128 blocks"):
    jax.jit(native_program).lower(a, b).compile()


# ---- GPU: cuBLASLt's block-scaled kernels --------------------------------------------------------------------------


def _gpu_operands(shape, mode, seed, gpu):
  return jax.device_put(quantized(shape, mode, seed), gpu)


def _te_gemm_operand_types(hlo: str) -> list[str]:
  """The operand types of each te_gemm_cuda custom call in a compiled HLO."""
  calls = [line for line in hlo.splitlines() if 'custom_call_target="te_gemm_cuda"' in line]
  return [" ".join(re.findall(r"(f8e4m3fn|f8e5m2|bf16)\[", c.split("custom-call(")[-1])) for c in calls]


def run_native(lhs, rhs, gpu, **kw):
  """gemm on the GPU; asserts that the native block-scaled kernel ran (one te_gemm_cuda call on FP8 operands)."""
  assert block_gemm_path(lhs, rhs, keep_rows=kw.get("keep_rows", False),
                         contract_dims=kw.get("contract_dims", 1)) == "native"
  compiled = jax.jit(lambda a, b: gemm(a, b, **kw)).lower(lhs, rhs).compile()
  types = _te_gemm_operand_types(compiled.as_text())
  assert len(types) == 1 and "f8e" in types[0], types
  return compiled(lhs, rhs)


def check_gpu(lhs, rhs, out, rows=slice(None), added=None):
  """The tolerance rule against float64 of the dequantized operands (float32 dequantization: what the kernel
  multiplies), FP8 accumulator noise."""
  a64 = dequantized64(lhs).reshape(-1, math.prod(lhs.shape[-1:]))
  b64 = dequantized64(rhs).reshape(-1, a64.shape[-1])
  out = np.asarray(out).astype(np.float64).reshape(a64.shape[0], b64.shape[0])
  if added is not None and np.ndim(added) == 2:
    added = added[rows]
  check_close(out[rows], a64[rows], b64, added, accum_u=FP8_ACCUM_U)


# The three GEMMs of a linear layer of 1024 -> 1024 at 4096 tokens: (lhs shape, mode), (rhs shape, mode).
LAYER = {
    "forward": (((4096, 1024), S.BLOCK_1X128), ((1024, 1024), S.BLOCK_128X128)),  # x . kernel^T (N, K)
    "dgrad": (((4096, 1024), S.BLOCK_1X128), ((1024, 1024), S.BLOCK_128X128)),  # g . kernel (K, N)
    "wgrad": (((1024, 4096), S.BLOCK_1X128), ((1024, 4096), S.BLOCK_1X128)),  # x_t . g_t, contracting the tokens
    "odd": (((1000, 1040), S.BLOCK_1X128), ((1040, 1040), S.BLOCK_128X128)),  # not multiples of 128
    "odd-2d-lhs": (((1000, 1040), S.BLOCK_128X128), ((1040, 1040), S.BLOCK_1X128)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", LAYER)
@pytest.mark.parametrize("fast_accum", [False, True], ids=["", "fast"])
def test_gpu_layer_gemms(case, fast_accum, gpu):
  (ls, lm), (rs, rm) = LAYER[case]
  lhs, rhs = _gpu_operands(ls, lm, 30, gpu), _gpu_operands(rs, rm, 31, gpu)
  bias = jax.device_put(np.linspace(-2, 2, rs[0]).astype(np.float32), gpu) if case == "forward" else None
  out = run_native(lhs, rhs, gpu, bias=bias, dtype=jnp.float32 if bias is None else jnp.bfloat16,
                   fast_accum=fast_accum)
  added = None if bias is None else np.asarray(jnp.asarray(bias).astype(jnp.bfloat16)).astype(np.float64)
  check_gpu(lhs, rhs, out, rows=slice(None, None, 8), added=added)


@pytest.mark.gpu
def test_gpu_8192_cubed_and_accumulation(gpu):
  """8192^3 forward: within bounds, deterministic, and fast accumulation the same kernel (cuBLASLt has no
  fast-accumulation block-scaled kernel)."""
  lhs, rhs = _gpu_operands((8192, 8192), S.BLOCK_1X128, 32, gpu), _gpu_operands((8192, 8192), S.BLOCK_128X128, 33, gpu)
  full = np.asarray(run_native(lhs, rhs, gpu, dtype=jnp.float32))
  again = np.asarray(run_native(lhs, rhs, gpu, dtype=jnp.float32))
  fast = np.asarray(run_native(lhs, rhs, gpu, dtype=jnp.float32, fast_accum=True))
  np.testing.assert_array_equal(full.view(np.uint32), again.view(np.uint32))
  np.testing.assert_array_equal(full.view(np.uint32), fast.view(np.uint32))
  check_gpu(lhs, rhs, full, rows=slice(None, None, 256))


@pytest.mark.gpu
def test_gpu_epilogues_and_rows(gpu):
  """Bias and residual in the epilogue, kept rows, a weight gradient of kept rows (contract_dims=2), all native."""
  x = _gpu_operands((2, 512, 1024), S.BLOCK_1X128, 34, gpu)
  w = _gpu_operands((768, 1024), S.BLOCK_128X128, 35, gpu)
  bias = jax.device_put(np.linspace(-1, 1, 768).astype(np.float32), gpu)
  residual = jax.device_put(np.random.default_rng(36).standard_normal((2, 512, 768)).astype(np.float32), gpu)
  out = run_native(x, w, gpu, bias=bias, residual=residual, keep_rows=True, dtype=jnp.bfloat16)
  assert out.shape == (2, 512, 768)
  added = (np.asarray(jnp.asarray(bias).astype(jnp.bfloat16)).astype(np.float64)
           + np.asarray(jnp.asarray(residual).astype(jnp.bfloat16)).astype(np.float64).reshape(1024, 768))
  check_gpu(x, w, out, added=added)
  xt, gt = _gpu_operands((1024, 2, 512), S.BLOCK_1X128, 37, gpu), _gpu_operands((768, 2, 512), S.BLOCK_1X128, 38, gpu)
  dw = run_native(xt, gt, gpu, contract_dims=2, dtype=jnp.float32)
  check_gpu(QuantizedTensor(xt.data.reshape(1024, 1024), xt.scale_inv.reshape(1024, 8), mode=xt.mode),
            QuantizedTensor(gt.data.reshape(768, 1024), gt.scale_inv.reshape(768, 8), mode=gt.mode), dw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["m-not-8", "mxfp8", "2d-x-2d"])
def test_gpu_emulated_shapes(case, gpu):
  """What the kernels do not take runs emulated on the GPU (the te_gemm_cuda call on bfloat16 operands), values as
  the emulation's."""
  lm, rm, ls = {"m-not-8": (S.BLOCK_1X128, S.BLOCK_128X128, (1001, 1024)),
                "mxfp8": (S.MXFP8_1X32, S.MXFP8_1X32, (1024, 1024)),
                "2d-x-2d": (S.BLOCK_128X128, S.BLOCK_128X128, (1024, 1024))}[case]
  lhs, rhs = _gpu_operands(ls, lm, 39, gpu), _gpu_operands((1024, 1024), rm, 40, gpu)
  assert block_gemm_path(lhs, rhs).startswith("emulated")
  compiled = jax.jit(lambda a, b: gemm(a, b, dtype=jnp.float32)).lower(lhs, rhs).compile()
  types = _te_gemm_operand_types(compiled.as_text())
  assert types and all("f8e" not in t for t in types), types
  check_close(compiled(lhs, rhs), bf16_64(dequantized64(lhs)), bf16_64(dequantized64(rhs)))


@pytest.mark.gpu
def test_gpu_per_tensor_unchanged(gpu):
  """The per-tensor FP8 GEMM still runs natively beside the block-scaled one."""
  x = jax.device_put(np.random.default_rng(41).standard_normal((256, 512)).astype(np.float32), gpu)
  q = quantize(x, jnp.float32(8.0)).out
  hlo = jax.jit(lambda a: gemm(a, a)).lower(q).compile().as_text()
  assert any("f8e" in t for t in _te_gemm_operand_types(hlo))
