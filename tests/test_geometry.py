"""Kernel geometry is defined once, on the C++ side (ffi/include/te_jax/workspace.h and the kernels' capacities).

- The workspace results the ops give XLA are the sizes the CUDA module reports for the very operands and attributes of
  each custom call, computed by the functions its handlers check and carve their workspaces with. Lowering for CUDA
  needs no GPU, only the CUDA module; on a GPU the ops also run, and a handler handed a wrong size returns an error.
- The kernels' capacities cover the limits the API checks on every platform before any kernel runs.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax._core import native
from te_jax.ops import activation, gemm, norm, quantize, quantize_interleaved, softmax

# MLIR's names of the workspace dtypes the modules report.
_IR_DTYPES = {"float32": "f32", "uint8": "ui8"}


def _module(name: str):
  """An extension module; skips the test when it is not built here (or a shared library it needs is missing)."""
  try:
    return importlib.import_module(f"te_jax.{name}")
  except (ImportError, OSError) as e:
    pytest.skip(f"te_jax.{name} is not available: {e}")


# ---- capacities ----------------------------------------------------------------------------------------------------


def test_cpu_module_capacity_covers_the_api_limits():
  cpu = _module("_te_cpu")
  assert cpu.softmax_max_mask_groups() >= softmax.MAX_MASK_ROW_DIMS


def test_cuda_module_capacity_covers_the_api_limits():
  cuda = _module("_te_cuda")
  assert cuda.gemm_max_parts() >= gemm.MAX_PARTS
  # transpose_parts' copy feeds gemm(..., rhs_parts=True); the quantize kernel itself has no limit on it.
  assert cuda.gemm_max_parts() >= quantize.MAX_TRANSPOSE_PARTS
  assert cuda.quantize_interleaved_max_parts() >= quantize_interleaved.MAX_PARTS
  assert cuda.quantize_interleaved_max_cols() >= quantize_interleaved._MAX_COLS
  assert cuda.softmax_max_mask_groups() >= softmax.MAX_MASK_ROW_DIMS


def _scaling_modes(module) -> dict[str, tuple[int, int, int]]:
  """The module's scaling_modes() as {name: (number, block rows, block cols)}, each name once."""
  table = module.scaling_modes()
  modes = {name: (number, rows, cols) for name, number, rows, cols in table}
  assert len(modes) == len(table), f"a mode is named twice: {table}"
  return modes


# te_jax.ScalingMode as ffi/include/te_jax/scaling_mode.h must name it: the number, then the block (0, 0 per tensor).
_PYTHON_SCALING_MODES = {m.name: (m.value, *(m.block or (0, 0))) for m in te_jax.ScalingMode}


@pytest.mark.parametrize("name", ["_te_cpu", "_te_cuda"])
def test_kernel_scaling_modes_are_pythons(name):
  """The kernels' scaling modes (ffi/include/te_jax/scaling_mode.h) are te_jax.ScalingMode: the same names, numbers
  and blocks."""
  assert _scaling_modes(_module(name)) == _PYTHON_SCALING_MODES


def test_cuda_workspace_queries_reject_what_the_handlers_reject():
  cuda = _module("_te_cuda")
  with pytest.raises(ValueError, match="parts"):
    cuda.gemm_workspace(0)
  with pytest.raises(ValueError, match="parts"):
    cuda.gemm_workspace(cuda.gemm_max_parts() + 1)
  with pytest.raises(ValueError, match="batch_ndim"):
    cuda.quantize_workspace((4, 8), 2)
  with pytest.raises(ValueError, match="gated"):
    cuda.act_bwd_workspace((4, 8), True, 0)
  with pytest.raises(ValueError, match="last dim"):
    cuda.norm_bwd_workspace((4, 0), False)


# ---- workspaces: what the ops ask XLA for is what the module computes for the call -------------------------------

_BF16 = jnp.bfloat16
_F32 = jnp.float32


def _spec(shape, dtype=_BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


# Each case: (a function of arrays that runs one op, its argument specs). Odd shapes where a tile is partly filled.
_CASES = {
    "gemm": (lambda a, b: gemm.gemm(a, b), [_spec((64, 32)), _spec((48, 32))]),
    "gemm-2-parts": (lambda a, b: gemm.gemm(a, b, rhs_parts=True), [_spec((64, 32)), _spec((2, 48, 32))]),
    "gemm-3-parts": (lambda a, b: gemm.gemm(a, b, rhs_parts=True), [_spec((64, 32)), _spec((3, 48, 32))]),
    "gemm-4-parts": (lambda a, b: gemm.gemm(a, b, rhs_parts=True), [_spec((64, 32)), _spec((4, 16, 32))]),
    "quantize-dbias": (lambda x, s: quantize.quantize(x, s, dbias=True), [_spec((2, 33, 65)), _spec((), _F32)]),
    "quantize-dbias-1-row": (lambda x, s: quantize.quantize(x, s, dbias=True), [_spec((1, 16)), _spec((), _F32)]),
    "quantize-dbias-transpose-batch": (
        lambda x, s: quantize.quantize(x, s, transpose=True, transpose_batch_dims=1, dbias=True),
        [_spec((3, 40, 48)), _spec((), _F32)]),
    "quantize-interleaved-dbias": (
        lambda p0, p1, p2, s: quantize_interleaved.quantize_interleaved([p0, p1, p2], s, group=16, dbias=True),
        [_spec((70, 64))] * 3 + [_spec((), _F32)]),
    "act-bwd-dbias": (lambda g, x: activation.activation_bwd(g, x, ("gelu",), dbias=True),
                      [_spec((130, 257)), _spec((130, 257))]),
    "act-bwd-dbias-gated": (lambda g, x: activation.activation_bwd(g, x, ("silu", "linear"), dbias=True),
                            [_spec((3, 50, 96)), _spec((3, 50, 2, 96))]),
    "act-bwd-dbias-fp8-transpose-batch": (
        lambda g, x: activation.activation_bwd(g, x, ("gelu",), dtype=jnp.float8_e5m2, scale=1.0, transpose=True,
                                               transpose_batch_dims=1, dbias=True),
        [_spec((2, 200, 144)), _spec((2, 200, 144))]),
    "layernorm-bwd": (lambda dz, x, m, r, g: norm.norm_bwd(dz, x, m, r, g),
                      [_spec((1000, 1024)), _spec((1000, 1024)), _spec((1000,), _F32), _spec((1000,), _F32),
                       _spec((1024,), _F32)]),
    "layernorm-bwd-short-rows": (lambda dz, x, m, r, g: norm.norm_bwd(dz, x, m, r, g),
                                 [_spec((3, 7, 96)), _spec((3, 7, 96)), _spec((3, 7), _F32), _spec((3, 7), _F32),
                                  _spec((96,), _F32)]),
    "rmsnorm-bwd": (lambda dz, x, r, g: norm.norm_bwd(dz, x, None, r, g, norm_type="rmsnorm"),
                    [_spec((5000, 8192)), _spec((5000, 8192)), _spec((5000,), _F32), _spec((8192,), _F32)]),
}

# Per CUDA target with a workspace: the module's query, the workspace's index among the call's results, and the
# query's arguments from the call's operand shapes, result shapes and attributes (as the handler sees them; q has the
# shape of x, the interleaved parts side by side).
_WORKSPACES = {
    "te_gemm_cuda": ("gemm_workspace", 0, lambda operands, results, attrs: (len(results) - 1,)),
    "te_quantize_cuda": ("quantize_workspace", 4, lambda operands, results, attrs: (results[0], attrs["batch_ndim"])),
    "te_quantize_interleaved_cuda": ("quantize_workspace", 4,
                                     lambda operands, results, attrs: (results[0], attrs["batch_ndim"])),
    "te_act_bwd_cuda": ("act_bwd_workspace", 4,
                        lambda operands, results, attrs: (operands[1], attrs["gated"], attrs["batch_ndim"])),
    "te_norm_bwd_cuda": ("norm_bwd_workspace", 3, lambda operands, results, attrs: (operands[1], attrs["rmsnorm"])),
}


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.operation.name == "stablehlo.custom_call":
          yield inner.operation
        yield from _custom_calls(inner.operation)


def _cuda_calls(fn, specs) -> list[tuple[str, list, list, dict]]:
  """(target, operand types, result types, attributes) of each te_ custom call of ``fn`` lowered for CUDA."""
  lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
  calls = []
  for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
    target = op.attributes["call_target_name"].value
    if target.startswith("te_"):
      attrs = {a.name: a.attr.value for a in op.attributes["mhlo.backend_config"]}
      types = lambda values: [(tuple(v.type.shape), str(v.type.element_type)) for v in values]  # noqa: E731
      calls.append((target, types(op.operands), types(op.results), attrs))
  return calls


@pytest.mark.parametrize("case", _CASES)
def test_lowered_workspace_is_what_the_cuda_module_reports(case):
  cuda = _module("_te_cuda")
  if native.modules.get("cuda") is None:
    pytest.skip(f"the CUDA module is not loaded: {native.load_errors.get('cuda')}")
  fn, specs = _CASES[case]
  calls = [c for c in _cuda_calls(fn, specs) if c[0] in _WORKSPACES]
  assert len(calls) == 1, calls
  target, operands, results, attrs = calls[0]
  query, index, query_args = _WORKSPACES[target]
  count, dtype = getattr(cuda, query)(*query_args([s for s, _ in operands], [s for s, _ in results], attrs))
  assert count > 0
  assert results[index] == ((count,), _IR_DTYPES[dtype])


# ---- on the GPU: the handlers accept those workspaces, and reject a wrong one with an error ----------------------


def _arrays(specs):
  keys = jax.random.split(jax.random.key(0), len(specs))
  return [jax.random.uniform(k, s.shape, s.dtype, 0.5, 1.5) for k, s in zip(keys, specs)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _CASES)
def test_handlers_run_with_the_lowered_workspaces(case, gpu):
  fn, specs = _CASES[case]
  jitted = jax.jit(fn)
  assert any(c[0] in _WORKSPACES for c in _cuda_calls(fn, specs)), "the CUDA handler is not registered"
  out = jitted(*jax.device_put(_arrays(specs), gpu))
  for leaf in jax.tree.leaves(out):
    assert bool(jnp.all(jnp.isfinite(leaf.astype(_F32))))


def _short_quantize(x, scale):
  """te_quantize_cuda with dbias and a workspace one element short of what the module reports."""
  count, dtype = native.modules["cuda"].quantize_workspace(x.shape, 0)
  results = [jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((0,), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((), _F32), jax.ShapeDtypeStruct(x.shape[-1:], _F32),
             jax.ShapeDtypeStruct((count - 1,), dtype)]
  return jax.ffi.ffi_call("te_quantize_cuda", results)(x, scale, batch_ndim=np.int64(0), t_parts=np.int64(1),
                                                       t_group=np.int64(1))


def _short_norm_bwd(dz, x, mean, rsigma, gamma):
  """te_norm_bwd_cuda (LayerNorm) with a workspace one element short of what the module reports."""
  count, dtype = native.modules["cuda"].norm_bwd_workspace(x.shape, False)
  results = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(gamma.shape, _F32),
             jax.ShapeDtypeStruct(gamma.shape, _F32), jax.ShapeDtypeStruct((count - 1,), dtype)]
  return jax.ffi.ffi_call("te_norm_bwd_cuda", results)(dz, x, rsigma, gamma, mean, jnp.zeros((0,), x.dtype),
                                                       rmsnorm=np.bool_(False))


def _short_act_bwd(g, x):
  """te_act_bwd_cuda (gelu) with dbias and a workspace one element short of what the module reports."""
  count, dtype = native.modules["cuda"].act_bwd_workspace(x.shape, False, 0)
  results = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((0,), x.dtype),
             jax.ShapeDtypeStruct((), _F32), jax.ShapeDtypeStruct(x.shape[-1:], _F32),
             jax.ShapeDtypeStruct((count - 1,), dtype)]
  return jax.ffi.ffi_call("te_act_bwd_cuda", results)(g, x, jnp.float32(1.0), act=np.int64(0), gated=np.bool_(False),
                                                      batch_ndim=np.int64(0))


def _short_gemm(lhs, rhs):
  """te_gemm_cuda with a workspace one byte short of what the module reports."""
  count, dtype = native.modules["cuda"].gemm_workspace(1)
  results = [jax.ShapeDtypeStruct((count - 1,), dtype), jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[0]), _BF16)]
  one = jnp.float32(1.0)
  empty = jnp.zeros((0,), _BF16)
  return jax.ffi.ffi_call("te_gemm_cuda", results)(lhs, rhs, one, one, empty, empty, transpose_lhs=np.bool_(False),
                                                   transpose_rhs=np.bool_(False), fast_accum=np.bool_(False),
                                                   lhs_scaling_mode=np.int64(0), rhs_scaling_mode=np.int64(0),
                                                   deterministic=np.bool_(False))


_SHORT = {
    "quantize": (_short_quantize, [_spec((70, 48)), _spec((), _F32)]),
    "norm_bwd": (_short_norm_bwd, [_spec((70, 48)), _spec((70, 48)), _spec((70,), _F32), _spec((70,), _F32),
                                   _spec((48,), _F32)]),
    "act_bwd": (_short_act_bwd, [_spec((70, 48)), _spec((70, 48))]),
    "gemm": (_short_gemm, [_spec((64, 32)), _spec((48, 32))]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("target", _SHORT)
def test_handler_rejects_a_short_workspace(target, gpu):
  fn, specs = _SHORT[target]
  args = jax.device_put(_arrays(specs), gpu)
  with pytest.raises(Exception, match="workspace"):
    jax.block_until_ready(jax.jit(fn)(*args))
  # The process and the device are fine afterwards.
  assert float(jax.jit(lambda a: a.sum())(args[0].astype(_F32))) > 0
