"""quantize_interleaved, and the layers' ``unstack_axis`` that uses it.

- ``interleave`` against an explicit numpy construction, so the definition is anchored independently.
- ``quantize_interleaved`` against ``quantize`` of the interleaved array: bitwise for the FP8 bytes, the transposed
  copy and amax, dbias within the bound of float32 summation; on CPU (reference lowering) and on a GPU (the CUDA
  handler, fast and generic kernels) - there the compiled program must call the interleaved handler itself.
- jit with sharded parts (whole groups per shard, and groups split across shards), vmap, argument checks.
- ``dense`` / ``layernorm_dense`` with ``unstack_axis``: outputs and gradients equal to unstacking the stacked output.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import assert_column_sums_close, assert_f32_equal, assert_fp8_equal
from te_jax._core import native
from te_jax.ops.quantize_interleaved import interleave
from te_jax.ops.quantize import CastOutput, quantize
from te_jax.ops.quantize_interleaved import quantize_interleaved

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
CPU = jax.devices("cpu")[0]


class Flat(NamedTuple):
  """A quantize's results side by side, as the tests compare them."""

  data: jax.Array
  data_t: jax.Array | None
  scale_inv: jax.Array
  amax: jax.Array
  dbias: jax.Array | None


def flat(c: CastOutput) -> Flat:
  """A CastOutput (its ``out`` a per-tensor QuantizedTensor) as (data, data_t, scale_inv, amax, dbias)."""
  assert c.out.mode is te_jax.ScalingMode.PER_TENSOR, c.out.mode
  return Flat(c.out.data, c.out.data_t, c.out.scale_inv, c.amax, c.dbias)


def random_parts(n: int, shape, dtype, seed: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [(rng.standard_normal(shape) * 4).astype(dtype) for _ in range(n)]


def numpy_interleave(parts, group: int) -> np.ndarray:
  lead, c = parts[0].shape[:-1], parts[0].shape[-1]
  out = np.empty((*lead, len(parts) * c), parts[0].dtype)
  for chunk in range(c // group):
    for i, p in enumerate(parts):
      start = (chunk * len(parts) + i) * group
      out[..., start:start + group] = p[..., chunk * group:(chunk + 1) * group]
  return out


@pytest.mark.parametrize("n,shape,group", [(2, (3, 8), 4), (3, (2, 5, 12), 3), (4, (6,), 6), (3, (4, 4), 1)], ids=str)
def test_interleave_matches_numpy(n, shape, group):
  parts = random_parts(n, shape, np.float32, seed=n)
  np.testing.assert_array_equal(np.asarray(interleave([jnp.asarray(p) for p in parts], group)),
                                numpy_interleave(parts, group))


def check_against_quantize(parts, group, fp8, device, **kwargs):
  """quantize_interleaved vs quantize(numpy interleave), both jitted on ``device``; returns the compiled HLO."""
  dev_parts = [jax.device_put(p, device) for p in parts]
  x = jax.device_put(numpy_interleave(parts, group), device)
  f = jax.jit(lambda ps, s: quantize_interleaved(ps, s, fp8, group=group, **kwargs))
  compiled = f.lower(dev_parts, jnp.float32(1.5)).compile()
  out = flat(compiled(dev_parts, jnp.float32(1.5)))
  ref = flat(jax.jit(lambda x, s: quantize(x, s, fp8, **kwargs))(x, jnp.float32(1.5)))
  what = f"{len(parts)} x {parts[0].shape}, group {group}"
  assert_fp8_equal(out.data, ref.data, what=f"data, {what}")
  assert_f32_equal(out.scale_inv, ref.scale_inv, what=f"scale_inv, {what}")
  assert_f32_equal(out.amax, ref.amax, what=f"amax, {what}")
  if kwargs.get("transpose"):
    assert_fp8_equal(out.data_t, ref.data_t, what=f"data_t, {what}")
  else:
    assert out.data_t is None
  if kwargs.get("dbias"):
    assert_column_sums_close(out.dbias, np.asarray(x))
  else:
    assert out.dbias is None
  return compiled.as_text()


EXTRAS = {"plain": {}, "t": {"transpose": True}, "t0+dbias": {"transpose": True, "transpose_batch_dims": 0,
                                                               "dbias": True}}


@pytest.mark.parametrize("extras", list(EXTRAS.values()), ids=list(EXTRAS))
@pytest.mark.parametrize("n,shape,group", [(3, (16, 4, 8), 8), (2, (5, 21), 7), (4, (2, 8, 32), 16)], ids=str)
def test_cpu_matches_quantize(n, shape, group, extras):
  parts = random_parts(n, shape[:-2] + (shape[-2] * shape[-1],) if len(shape) > 2 else shape, ml_dtypes.bfloat16, 1)
  check_against_quantize(parts, group, E4M3, CPU, **extras)


def test_one_part_is_quantize():
  x = random_parts(1, (16, 32), np.float32, seed=3)
  check_against_quantize(x, 32, E5M2, CPU, transpose=True, dbias=True)


def test_vmap_is_per_element():
  parts = [jnp.asarray(p) for p in random_parts(3, (4, 16, 32), np.float32, seed=4)]
  f = jax.vmap(lambda a, b, c: quantize_interleaved([a, b, c], 2.0, group=8, transpose=True))
  out = flat(f(*parts))
  for i in range(4):
    ref = flat(quantize(interleave([p[i] for p in parts], 8), 2.0, transpose=True))
    assert_fp8_equal(out.data[i], ref.data)
    assert_fp8_equal(out.data_t[i], ref.data_t)
    assert_f32_equal(out.amax[i], ref.amax)


# 96 columns on 4 shards: 24 each, 3 groups of 8 (split groups of 32). 48 columns in groups of 8 are 6 groups, which
# the mesh axis of 4 does not divide: the sharding rule must not let the propagation shard the group count over part
# of that axis (it used to fail inside the partitioner).
@pytest.mark.parametrize("spec,group,cols", [(P("a", None), 8, 96), (P(None, "a"), 8, 96), (P("a", "b"), 8, 96),
                                             (P(None, "a"), 32, 96), (P(None, "a"), 8, 48), (P(None, ("a", "b")), 8, 48)],
                         ids=["rows", "cols", "both", "split-groups", "indivisible-groups", "indivisible-two-axes"])
def test_sharded_equals_unsharded(spec, group, cols):
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("a", "b"))
  parts = random_parts(3, (64, cols), np.float32, seed=5)
  f = jax.jit(lambda ps: quantize_interleaved(ps, 1.0, E4M3, group=group, transpose=True, dbias=True))
  out = flat(f([jax.device_put(p, NamedSharding(mesh, spec)) for p in parts]))
  ref = flat(quantize(numpy_interleave(parts, group), 1.0, E4M3, transpose=True, dbias=True))
  assert_fp8_equal(out.data, ref.data)
  assert_fp8_equal(out.data_t, ref.data_t, what="data_t")
  assert_f32_equal(out.amax, ref.amax)
  assert_column_sums_close(out.dbias, numpy_interleave(parts, group))


Z = np.zeros((4, 8), np.float32)


@pytest.mark.parametrize("parts,kwargs,error,match", [
    ([], {"group": 1}, ValueError, "1 to 4 arrays"),
    (np.zeros((5, 4, 8), np.float32), {"group": 1}, ValueError, "1 to 4 arrays"),
    ([Z] * 5, {"group": 1}, ValueError, "1 to 4 arrays"),
    ([np.zeros((4, 8), np.float32), np.zeros((4, 16), np.float32)], {"group": 8}, ValueError, "one shape and dtype"),
    ([np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float16)], {"group": 8}, ValueError, "one shape and dtype"),
    ([Z] * 2, {"group": 3}, ValueError, "positive divisor"),
    ([Z] * 2, {"group": 0}, ValueError, "positive divisor"),
    ([Z] * 2, {"group": 8.0}, ValueError, "positive divisor"),
    ([np.zeros((4, 8), np.int32)] * 2, {"group": 8}, TypeError, "float32, bfloat16 or float16"),
    ([np.zeros((8,), np.float32)] * 2, {"group": 8, "transpose": True}, ValueError, "rank >= 2"),
    ([Z] * 2, {"group": 8, "transpose_batch_dims": 0}, ValueError, "needs transpose=True"),
    ([Z] * 2, {"group": 8, "transpose": True, "transpose_batch_dims": 1}, ValueError, "transpose_batch_dims must be"),
])
def test_bad_arguments_raise_before_xla(parts, kwargs, error, match):
  with pytest.raises(error, match=match):
    quantize_interleaved(parts, 1.0, **kwargs)


# ---- CUDA handler --------------------------------------------------------------------------------------------------

# (parts, part shape, group): fast kernel (group % 8 == 0, rows % 8 == 0) with partial tiles and a batch; generic
# kernel (group % 8 != 0, or odd rows with the transposed copy); the GPT layer's q/k/v gradient (32 heads of 128).
GPU_CASES = [(3, (256, 384), 128), (2, (200, 264), 8), (4, (2, 72, 40), 8), (3, (33, 96), 32), (2, (40, 42), 7),
             (3, (1000, 12), 4), (3, (2048, 4096), 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("extras", list(EXTRAS.values()), ids=list(EXTRAS))
@pytest.mark.parametrize("dtype,fp8", [(ml_dtypes.bfloat16, E5M2), (np.float32, E4M3), (np.float16, E4M3)],
                         ids=["bf16-e5m2", "f32-e4m3", "f16-e4m3"])
@pytest.mark.parametrize("n,shape,group", GPU_CASES, ids=str)
def test_gpu_matches_quantize(n, shape, group, dtype, fp8, extras, gpu):
  assert native.has_target("cuda", "te_quantize_interleaved_cuda"), native.load_errors
  hlo = check_against_quantize(random_parts(n, shape, dtype, seed=sum(shape)), group, fp8, gpu, **extras)
  assert hlo.count('custom_call_target="te_quantize_interleaved_cuda"') == 1


# ---- layers --------------------------------------------------------------------------------------------------------


def _fp8_recipe():
  return te_jax.recipe.Float8CurrentScaling()


def _check_unstacked_layer(f, args, n_parts, device):
  """f(*args, unstack_axis) vs unstacking f(*args, None): outputs bitwise; gradients of every argument bitwise."""
  args = [jax.device_put(a, device) for a in args]
  cot = random_parts(n_parts, (), np.float32, seed=0)  # one scalar weight per part: distinct gradients per part

  def loss(unstack, *a):
    y = f(*a, unstack)
    parts = y if unstack is not None else jnp.unstack(y, axis=-2)
    return sum(jnp.sum(p.astype(jnp.float32) * jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape) * c / p.size)
               for p, c in zip(parts, cot))

  y_split = jax.jit(lambda *a: f(*a, -2))(*args)
  y_full = jax.jit(lambda *a: f(*a, None))(*args)
  assert isinstance(y_split, tuple) and len(y_split) == n_parts
  for i, p in enumerate(y_split):
    np.testing.assert_array_equal(np.asarray(p), np.asarray(y_full[..., i, :]))
  argnums = tuple(range(1, len(args) + 1))
  g_split = jax.jit(jax.grad(loss, argnums=argnums), static_argnums=0)(-2, *args)
  g_full = jax.jit(jax.grad(loss, argnums=argnums), static_argnums=0)(None, *args)
  for a, b in zip(g_split, g_full):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["cpu", "gpu"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["dense", "layernorm_dense"])
def test_layer_unstack_axis(with_norm, fp8, on_gpu, request):
  device = request.getfixturevalue("gpu") if on_gpu else CPU
  h, heads, d = 64, 4, 16
  x, gamma, beta, bias = random_parts(4, (h,), np.float32, seed=7)
  x = (np.random.default_rng(8).standard_normal((3, 16, h))).astype(ml_dtypes.bfloat16)
  kernel = (np.random.default_rng(9).standard_normal((h, heads, 3, d)) / 8).astype(np.float32)
  bias = (np.random.default_rng(10).standard_normal((heads, 3, d))).astype(np.float32)
  recipe = _fp8_recipe() if fp8 else None

  if with_norm:
    def f(x, gamma, beta, kernel, bias, unstack_axis):
      return te_jax.layernorm_dense(x, gamma, beta, kernel, bias, unstack_axis=unstack_axis, recipe=recipe)
    args = [x, gamma, beta, kernel, bias]
  else:
    def f(x, kernel, bias, unstack_axis):
      return te_jax.dense(x, kernel, bias, unstack_axis=unstack_axis, recipe=recipe)
    args = [x, kernel, bias]
  _check_unstacked_layer(f, args, 3, device)


@pytest.mark.parametrize("axis,match", [(0, "feature axes"), (1, "feature axes"), (4, "feature axes"),
                                        (-3, "feature axes"), (-1, "at most 4 parts"), (1.0, "feature axes")], ids=str)
def test_unstack_axis_must_be_a_small_feature_axis(axis, match):
  with pytest.raises(ValueError, match=match):
    te_jax.dense(jnp.ones((2, 3, 8)), jnp.ones((8, 2, 16)), unstack_axis=axis)
  with pytest.raises(ValueError, match=match):
    te_jax.layernorm_dense(jnp.ones((2, 3, 8)), jnp.ones(8), jnp.zeros(8), jnp.ones((8, 2, 16)), unstack_axis=axis)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_layernorm_dense_unstack_with_layernorm_output(fp8):
  """``return_layernorm_output`` still returns the normalized input beside the unstacked parts."""
  x = jnp.asarray(np.random.default_rng(11).standard_normal((2, 16, 32)), jnp.bfloat16)
  gamma, beta = jnp.ones(32), jnp.zeros(32)
  kernel = jnp.asarray(np.random.default_rng(12).standard_normal((32, 2, 2, 16)) / 6, jnp.float32)
  recipe = _fp8_recipe() if fp8 else None
  (parts, z) = te_jax.layernorm_dense(x, gamma, beta, kernel, unstack_axis=-2, return_layernorm_output=True,
                                      recipe=recipe)
  y, z_ref = te_jax.layernorm_dense(x, gamma, beta, kernel, return_layernorm_output=True, recipe=recipe)
  assert len(parts) == 2 and parts[0].shape == (2, 16, 2, 16)
  for i, p in enumerate(parts):
    np.testing.assert_array_equal(np.asarray(p), np.asarray(y[..., i, :]))
  np.testing.assert_array_equal(np.asarray(z), np.asarray(z_ref))
