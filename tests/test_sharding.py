"""quantize on 8 CPU devices (forced in conftest.py).

Under jax.jit with a sharded input the handler runs on local shards: the results must be bitwise those of the
unsharded call (dbias within the float32 summation bound), the outputs must keep the shardings the partition rule
gives (data like x, data_t with x's spec permuted, amax replicated), and the compiled program must hold no all-gather
and exactly the all-reduces the op needs: one max for amax when x is sharded, one sum for dbias when a dim other
than the last is sharded.
"""

import collections
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import assert_column_sums_close, assert_f32_equal, assert_fp8_equal
from te_jax.ops.quantize import quantize

DEVICES = jax.devices("cpu")
E4M3 = jax.numpy.float8_e4m3fn
SCALE = np.float32(0.75)

# (mesh shape, axis names, x shape, x spec); local shards have odd sizes.
CASES = [
    ((8,), ("x",), (8 * 3, 10), P("x", None)),  # rows
    ((8,), ("x",), (6, 8 * 5), P(None, "x")),  # cols
    ((8,), ("x",), (8, 6, 14), P("x", None, None)),  # leading batch dim
    ((4, 2), ("a", "b"), (4 * 5, 2 * 7), P("a", "b")),  # rows and cols
    ((4, 2), ("a", "b"), (8 * 3, 6), P(("a", "b"), None)),  # rows over both axes
    ((4, 2), ("a", "b"), (4 * 3, 10), P("a", None)),  # rows, replicated over b
    ((4, 2), ("a", "b"), (4, 2 * 3, 10), P("a", "b", None)),  # batch and rows
    ((4, 2), ("a", "b"), (2, 12, 4 * 3), P("b", None, "a")),  # batch and cols
    ((2, 2, 2), ("a", "b", "c"), (2 * 3, 2 * 5, 2 * 7), P("a", "b", "c")),  # every dim
    ((2, 2, 2), ("a", "b", "c"), (2, 3, 2 * 5, 2 * 4), P("a", None, "b", "c")),  # rank 4
    ((2, 2, 2), ("a", "b", "c"), (6, 10), P()),  # replicated: no collective at all
]
TRANSPOSES = {"no-t": {}, "t": {"transpose": True}, "t-batch0": {"transpose": True, "transpose_batch_dims": 0}}


def _params():
  for mesh_shape, names, shape, spec in CASES:
    modes = ["no-t", "t"] + (["t-batch0"] if len(shape) >= 3 else [])  # on rank 2, batch 0 is the default
    for mode in modes:
      for dbias in (False, True):
        yield pytest.param(mesh_shape, names, shape, spec, mode, dbias,
                           id=f"{'x'.join(map(str, mesh_shape))}-{shape}-{spec}-{mode}{'-dbias' if dbias else ''}")


# ---- helpers -------------------------------------------------------------------------------------------------------


def random_input(shape, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * np.exp2(rng.uniform(-10, 10, shape))).astype(ml_dtypes.bfloat16)


def full_spec(spec, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


def mesh_axes(entries) -> set:
  axes = set()
  for e in entries:
    axes.update(() if e is None else (e if isinstance(e, tuple) else (e,)))
  return axes


def t_axes(ndim: int, batch_dims: int) -> tuple:
  return tuple(range(batch_dims)) + (ndim - 1,) + tuple(range(batch_dims, ndim - 1))


_BAD_COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
_ALL_REDUCE = re.compile(r"\ball-reduce(?:-start)?\(.*?to_apply=%([\w.\-]+)")


def all_reduces(hlo: str) -> collections.Counter:
  """The all-reduces of a compiled HLO module, counted by the op of their reduction ("maximum", "add", ...)."""
  ops = collections.Counter()
  for name in _ALL_REDUCE.findall(hlo):
    body = re.search(rf"^%{re.escape(name)} \(.*?\n(.*?)^\}}", hlo, re.S | re.M)
    assert body, f"reduction computation {name} not found"
    root = re.search(r"ROOT \S+ = \S+ ([\w-]+)\(", body.group(1))
    ops[root.group(1)] += 1
  return ops


def assert_replicas_agree(arr, what: str):
  """Every copy of each block of a (partly) replicated array holds the same bits."""
  blocks = {}
  for shard in arr.addressable_shards:
    key = str(shard.index)
    bits = np.asarray(shard.data).view(np.uint8)
    if key in blocks:
      np.testing.assert_array_equal(bits, blocks[key], err_msg=f"{what}: replicas of block {key} differ")
    blocks[key] = bits


def assert_sharding(arr, mesh, spec, what: str):
  assert arr.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), arr.ndim), (what, arr.sharding, spec)


def test_eight_cpu_devices():
  assert len(DEVICES) == 8, "conftest.py sets --xla_force_host_platform_device_count=8 before jax is imported"


# ---- jit with NamedSharding ----------------------------------------------------------------------------------------


def check_sharded_quantize(mesh, shape, spec, kwargs, dbias, seed=0):
  x = random_input(shape, seed)
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  f = jax.jit(lambda x: quantize(x, SCALE, E4M3, dbias=dbias, **kwargs))
  compiled = f.lower(xs).compile()
  out = compiled(xs)
  ref = f(jax.device_put(x, DEVICES[0]))  # unsharded, one device

  # Values: bitwise, and every replica of every output the same.
  assert_fp8_equal(out.out.data, ref.out.data)
  assert_replicas_agree(out.out.data, "data")
  for shard in out.amax.addressable_shards:
    assert_f32_equal(shard.data, ref.amax)
  assert_f32_equal(out.amax, np.max(np.abs(x.astype(np.float32))), what="amax vs numpy")
  ndim, spec = len(shape), full_spec(spec, len(shape))
  if kwargs.get("transpose"):
    b = kwargs.get("transpose_batch_dims", ndim - 2)
    assert_fp8_equal(out.out.data_t, ref.out.data_t, what="data_t")
    assert_fp8_equal(out.out.data_t, np.transpose(np.asarray(ref.out.data), t_axes(ndim, b)), what="data_t vs numpy")
    assert_replicas_agree(out.out.data_t, "data_t")
    assert_sharding(out.out.data_t, mesh, [spec[i] for i in t_axes(ndim, b)], "data_t")
  if dbias:
    assert_column_sums_close(out.dbias, x)
    assert_replicas_agree(out.dbias, "dbias")
    assert_sharding(out.dbias, mesh, spec[-1:], "dbias")

  # Shardings.
  assert_sharding(out.out.data, mesh, spec, "data")
  assert_sharding(out.amax, mesh, (), "amax")

  # Collectives.
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_quantize_cpu"') == 1
  assert not _BAD_COLLECTIVES.search(hlo), _BAD_COLLECTIVES.search(hlo).group(0)
  expected = collections.Counter()
  if mesh_axes(spec):
    expected["maximum"] += 1
  if dbias and mesh_axes(spec[:-1]):
    expected["add"] += 1
  assert all_reduces(hlo) == expected


@pytest.mark.parametrize("mesh_shape,names,shape,spec,mode,dbias", list(_params()))
def test_sharded_equals_unsharded(mesh_shape, names, shape, spec, mode, dbias):
  mesh = Mesh(np.array(DEVICES).reshape(mesh_shape), names)
  check_sharded_quantize(mesh, shape, spec, TRANSPOSES[mode], dbias)


def test_explicit_axes_mesh():
  """jax.make_mesh gives Explicit axes; the partition callback sees them as Auto (jax #34811): same results."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2, devices=DEVICES)
  check_sharded_quantize(mesh, (4, 2 * 3, 10), P("a", "b", None), {"transpose": True, "transpose_batch_dims": 0},
                         dbias=True)


# ---- shard_map -----------------------------------------------------------------------------------------------------


def test_shard_map_on_local_shards():
  mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("a", "b"))
  x = random_input((4 * 5, 2 * 9), seed=1)

  def local(x):
    o = quantize(x, SCALE, E4M3, transpose=True, dbias=True)
    return (o.out.data, o.out.data_t, o.amax.reshape(1, 1), jax.lax.pmax(o.amax, ("a", "b")),
            jax.lax.psum(o.dbias, "a"))

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("a", "b"),
                            out_specs=(P("a", "b"), P("b", "a"), P("a", "b"), P(), P("b"))))
  xs = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  compiled = f.lower(xs).compile()
  data, data_t, local_amax, amax, dbias = compiled(xs)
  ref = quantize(jax.device_put(x, DEVICES[0]), SCALE, E4M3, transpose=True)

  assert_fp8_equal(data, ref.out.data)  # elementwise: local casts tile the global one
  assert_fp8_equal(data_t, ref.out.data_t, what="data_t")  # local transposes, placed at P("b", "a")
  blocks = x.astype(np.float32).reshape(4, 5, 2, 9)
  assert_f32_equal(local_amax, np.abs(blocks).max(axis=(1, 3)), what="per-shard amax")
  assert_f32_equal(amax, ref.amax)
  assert_column_sums_close(dbias, x)
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_quantize_cpu"') == 1
  assert not _BAD_COLLECTIVES.search(hlo)
  assert all_reduces(hlo) == collections.Counter({"maximum": 1, "add": 1})  # the pmax and psum written above


def test_shard_map_outputs_keep_varying_axes():
  """Were the vma dropped, shard_map would take out_specs=P() for a per-shard amax without complaint (and return
  device 0's local value), and a scan carry through quantize would fail to type-check."""
  mesh = Mesh(np.array(DEVICES), ("x",))

  def local(x):
    o = quantize(x, SCALE, E4M3, transpose=True, dbias=True)
    assert jax.typeof(x).manual_axis_type.varying == {"x"}
    for v in (o.out.data, o.out.data_t, o.amax, o.dbias):  # what the op writes (scale_inv is 1 / SCALE, replicated)
      assert jax.typeof(v).manual_axis_type.varying == {"x"}, jax.typeof(v)  # float8_e4m3fn[2,8]{V:x} etc.
    return o.out.data

  jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(random_input((16, 8), seed=2))


# ---- vmap over a sharded batch dim ---------------------------------------------------------------------------------


def _vmapped_on_sharded_batch():
  mesh = Mesh(np.array(DEVICES), ("x",))
  x = random_input((8, 6, 10), seed=3)
  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  f = jax.jit(jax.vmap(lambda x: quantize(x, SCALE, E4M3, transpose=True)))
  compiled = f.lower(xs).compile()
  return x, compiled(xs), compiled.as_text()


def test_vmap_over_sharded_batch_values():
  x, out, _ = _vmapped_on_sharded_batch()
  # Index on the host: slicing a sharded FP8 array on XLA:CPU may turn -0 into +0, which is no concern here.
  data, data_t, amax = (np.asarray(a) for a in (out.out.data, out.out.data_t, out.amax))
  for i in range(x.shape[0]):
    ref = quantize(jax.device_put(x[i], DEVICES[0]), SCALE, E4M3, transpose=True)
    assert_fp8_equal(data[i], ref.out.data)
    assert_fp8_equal(data_t[i], ref.out.data_t, what="data_t")
    assert_f32_equal(amax[i], ref.amax)


def test_vmap_over_sharded_batch_stays_sharded():
  _, out, hlo = _vmapped_on_sharded_batch()
  assert not _BAD_COLLECTIVES.search(hlo), _BAD_COLLECTIVES.search(hlo).group(0)
  assert out.out.data.sharding.spec[0] == "x", out.out.data.sharding
