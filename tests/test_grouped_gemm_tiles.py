"""grouped_gemm's tile promise (every group's size a multiple of ``tile``) and the CUDA handler it enables.

- Off the GPU (the reference): with a tile, both forms within the tolerance rule of the float64 group loop (FP8 rows
  grouped: the products scaled per row after the sum, as the handler's are), high precision bit for bit the
  untiled call; bad tiles and concrete sizes that break the promise raise.
- On the GPU: te_grouped_gemm_cuda in the compiled program; its values within the rule of the float64 loop (FP8
  with the noise term of Hopper's FP8 accumulator, tests/test_gemm.py's FP8_ACCUM_U); rows past the groups and
  empty groups' matrices zeros; traced sizes that are no grouping, or not multiples of the tile, all NaN;
  grouped_dense's train step (TE_JAX_GROUPED_GEMM=cuda) runs its three GEMMs on it, within the rule of the
  reference path's.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import F32_U
from te_jax import ScalingMode, recipe
import te_jax.fused.grouped_dense as gd
from te_jax.fused.grouped_dense import grouped_dense
from te_jax.ops import grouped_gemm as gg
from test_grouped_dense import G, M, _loop64, _normal, _operands, assert_rule

F32 = jnp.float32
TILE = 16
SIZES = {"balanced": [16, 16, 16], "empty": [32, 0, 16], "below": [16, 0, 16]}
KINDS = ["hp-f32", "hp-bf16", "fp8"]
FP8_ACCUM_U = 2.0**-14


def _run(kind, ragged, sizes, tile, jit=False):
  lhs, rhs, a64, b64 = _operands(kind, ragged)
  call = lambda s: gg.grouped_gemm(lhs, rhs, s, dtype=F32, ragged_contracting=ragged, tile=tile)  # noqa: E731
  s = jnp.asarray(sizes, jnp.int32)
  out = jax.jit(call)(s) if jit else call(s)
  return out, _loop64(kind, ragged, a64, b64, sizes), call


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ragged", [False, True], ids=["rows", "contracting"])
@pytest.mark.fast_cases(4)
def test_tiled_reference_is_the_float64_group_loop(ragged, kind, sizes):
  out, (exact, base, abs_prod), _ = _run(kind, ragged, SIZES[sizes], TILE)
  assert_rule(out, exact, base, abs_prod, M if ragged else 128, f"{kind} {sizes}")
  if kind.startswith("hp"):
    untiled, _, _ = _run(kind, ragged, SIZES[sizes], None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(untiled))


def test_bad_tiles_raise():
  x, w = _normal(0, (M, 128)), _normal(1, (G, 32, 128))
  sizes = jnp.asarray([16, 16, 16], jnp.int32)
  for tile in (8, 20, 32, True, 16.0):
    with pytest.raises(ValueError, match="tile must be a multiple of 16 dividing the 48 grouped rows"):
      gg.grouped_gemm(x, w, sizes, tile=tile)
  with pytest.raises(ValueError, match=r"tile=16: every group size must be a multiple of it, got \[20, 12, 16\]"):
    gg.grouped_gemm(x, w, jnp.asarray([20, 12, 16], jnp.int32), tile=16)


def test_native_tile_is_opt_in_and_none_off_the_gpu(monkeypatch):
  monkeypatch.delenv(gg.GROUPED_GEMM_ENV, raising=False)
  assert gg.native_tile() == 0  # the reference by default
  monkeypatch.setenv(gg.GROUPED_GEMM_ENV, "cuda")
  if jax.default_backend() != "gpu":
    assert gg.native_tile() == 0
  monkeypatch.setenv(gg.GROUPED_GEMM_ENV, "fast")
  with pytest.raises(ValueError, match="TE_JAX_GROUPED_GEMM='fast': set it to 'cuda'"):
    gg.native_tile()


# ---- the CUDA handler ----------------------------------------------------------------------------------------------


def _assert_gpu_rule(out, exact, base, abs_prod, k, fp8, what):
  """The tolerance rule, plus for FP8 the accumulator's noise ``sqrt(K) * FP8_ACCUM_U * max sum|a||b|``."""
  ours = np.asarray(jnp.asarray(out).astype(F32)).astype(np.float64)
  err = float(np.abs(ours - exact).max(initial=0.0))
  err_base = float(np.abs(np.asarray(base, np.float64) - exact).max(initial=0.0))
  u = FP8_ACCUM_U if fp8 else F32_U
  noise = math.sqrt(k) * u * float(np.max(abs_prod, initial=0.0))
  assert np.all(np.isfinite(ours)), f"{what}: non-finite output"
  assert err <= 2 * err_base + noise, f"{what}: err {err:.3g} > 2 * {err_base:.3g} + {noise:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ragged", [False, True], ids=["rows", "contracting"])
def test_gpu_handler_is_the_float64_group_loop(ragged, kind, sizes, gpu):
  out, (exact, base, abs_prod), call = _run(kind, ragged, SIZES[sizes], TILE, jit=True)
  hlo = jax.jit(call).lower(jnp.asarray(SIZES[sizes], jnp.int32)).compile().as_text()
  assert 'custom_call_target="te_grouped_gemm_cuda"' in hlo
  _assert_gpu_rule(out, exact, base, abs_prod, M if ragged else 128, kind == "fp8", f"{kind} {sizes}")
  out = np.asarray(out)
  if ragged:
    for g, n in enumerate(SIZES[sizes]):
      if n == 0:
        np.testing.assert_array_equal(out[g], 0.0)
  else:
    np.testing.assert_array_equal(out[sum(SIZES[sizes]):], 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("ragged", [False, True], ids=["rows", "contracting"])
def test_gpu_sizes_that_break_the_promise_give_nan(ragged, gpu):
  _, _, call = _run("fp8", ragged, SIZES["balanced"], TILE)
  for bad in ([-16, 16, 16], [32, 32, 16], [8, 24, 16]):  # negative, past M, not multiples of the tile
    out = jax.jit(call)(jnp.asarray(bad, jnp.int32))
    assert np.isnan(np.asarray(out)).all(), bad


@pytest.mark.gpu
def test_gpu_grouped_dense_step_runs_on_the_handler(gpu, monkeypatch):
  """A current-scaling train step of grouped_dense on the GPU: its forward, dgrad and wgrad GEMMs are
  te_grouped_gemm_cuda, and output and gradients are within the rule of the same step on the reference."""
  monkeypatch.setenv(gg.GROUPED_GEMM_ENV, "cuda")
  tile = gg.native_tile()
  assert tile, "no CUDA grouped GEMM on this GPU"
  rows, k, n, groups = 4 * tile, 256, 128, 4
  x, w = _normal(0, (rows, k)), _normal(1, (groups, k, n), scale=0.05)
  sizes = jnp.asarray([tile + 7, 0, 2 * tile - 30, 40], jnp.int32)
  r = recipe.Float8CurrentScaling()

  def loss(x, w):
    return jnp.sum(grouped_dense(x, w, sizes, recipe=r).astype(F32) ** 2)

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  hlo = step.lower(x, w).compile().as_text()
  assert hlo.count('custom_call_target="te_grouped_gemm_cuda"') == 3
  ours = step(x, w)
  monkeypatch.setattr(gd, "native_tile", lambda: 0)  # the reference path: no tile, FP8_ALIGN's padding
  want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


def test_the_handler_declines_what_it_does_not_run():
  """No tile, block-scaled operands, scaled FP8 rows-grouped products and a contracting form not in float32 lower
  to the reference (the native signature is None), on every platform."""
  lhs, rhs = jax.ShapeDtypeStruct((64, 32), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((2, 16, 32), jnp.float8_e4m3fn)
  out = jax.ShapeDtypeStruct((64, 16), F32)
  cfg = gg.GroupedGemmConfig
  per_tensor, block = ScalingMode.PER_TENSOR, ScalingMode.BLOCK_1X128
  for config in (cfg(F32, lhs_mode=per_tensor, rhs_mode=per_tensor, unscaled=True),  # no tile
                 cfg(F32, lhs_mode=per_tensor, rhs_mode=per_tensor, tile=16),  # scaled FP8, rows grouped
                 cfg(F32, lhs_mode=block, rhs_mode=block, tile=16),
                 cfg(jnp.bfloat16, ragged_contracting=True, tile=16),  # contracting in bfloat16
                 cfg(F32, lhs_mode=per_tensor, rhs_mode=per_tensor, tile=48, unscaled=True)):  # 64 rows % 48
    assert gg._native_signature("cuda", config, [lhs, rhs], [out]) is None, config
