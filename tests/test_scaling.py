"""te_jax._core.scaling: the delayed-scaling math, against numpy float32 arithmetic written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_f32_equal
from te_jax._core import scaling
from te_jax.ops import scale_update

E4M3_MAX = np.float32(448.0)
E5M2_MAX = np.float32(57344.0)


@pytest.fixture(autouse=True)
def _on_cpu():
  """The expected values are numpy float32 arithmetic, which XLA:CPU reproduces bit for bit (IEEE division)."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def np_compute_scale(amax, scale, fp8_max, margin=0) -> np.float32:
  """The documented rule in numpy float32: fp8_max / amax * 2^-margin where that is a positive finite float32 (and
  amax is positive and finite), else the previous scale."""
  amax = np.float32(amax)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    new = np.float32(fp8_max) / amax * np.float32(2.0**-margin)
  return new if (amax > 0 and np.isfinite(amax) and np.isfinite(new) and new > 0) else np.float32(scale)


def test_fp8_max():
  assert scaling.fp8_max(jnp.float8_e4m3fn) == 448.0
  assert scaling.fp8_max(jnp.float8_e5m2) == 57344.0


@pytest.mark.parametrize("amax,margin,expected", [
    (2.0, 0, 224.0),
    (448.0, 0, 1.0),
    (3.0, 0, np.float32(448.0) / np.float32(3.0)),  # rounded once, in float32
    (2.0, 1, 112.0),
    (2.0, 3, 28.0),
    (1e-3, 0, np.float32(448.0) / np.float32(1e-3)),
    (1e30, 0, np.float32(448.0) / np.float32(1e30)),  # tiny but normal scale
])
def test_compute_scale(amax, margin, expected):
  got = scaling.compute_scale(jnp.float32(amax), jnp.float32(5.0), 448.0, margin)
  assert got.dtype == jnp.float32
  assert_f32_equal(got, np.float32(expected), what="scale")
  assert_f32_equal(got, np_compute_scale(amax, 5.0, E4M3_MAX, margin), what="scale vs numpy")


@pytest.mark.parametrize("amax", [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 2.0**-130],
                         ids=["zero", "-zero", "nan", "inf", "-inf", "tiny-1e-45", "tiny-2^-130"])
def test_compute_scale_keeps_previous(amax):
  """Zero, non-finite, and amax so small that fp8_max / amax overflows float32 (448 / 1e-45 = inf, and
  448 / 2^-130 > 3.4e38) keep the previous scale."""
  got = scaling.compute_scale(jnp.float32(amax), jnp.float32(0.375), 448.0)
  assert_f32_equal(got, np.float32(0.375), what="scale")


def test_compute_scale_margin_overflow_keeps_previous():
  """amax * 2^margin is finite but the scale is not: 448 / (2^-120 * 2^-8) = 448 * 2^128 overflows."""
  got = scaling.compute_scale(jnp.float32(2.0**-120), jnp.float32(2.0), 448.0, margin=-8)
  assert_f32_equal(got, np.float32(2.0), what="scale")


def test_compute_scale_huge_amax_with_margin():
  """amax * 2^margin would overflow to inf (and the scale to 0); fp8_max / amax / 2^margin does not."""
  got = scaling.compute_scale(jnp.float32(3.0e38), jnp.float32(2.0), 448.0, margin=2)
  assert_f32_equal(got, np.float32(448.0) / np.float32(3.0e38) / np.float32(4.0), what="scale")
  assert float(got) > 0


def test_compute_scale_elementwise_and_jit():
  amax = np.array([2.0, 0.0, np.nan, 448.0], np.float32)
  prev = np.array([1.0, 3.0, 4.0, 5.0], np.float32)
  got = jax.jit(scaling.compute_scale, static_argnums=(2, 3))(amax, prev, 448.0, 1)
  want = np.array([np_compute_scale(a, p, E4M3_MAX, 1) for a, p in zip(amax, prev)], np.float32)
  assert_f32_equal(got, want, what="scale")


def test_roll_amax_history():
  h = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  got = scaling.roll_amax_history(jnp.asarray(h), jnp.float32(9.0))
  assert got.dtype == jnp.float32
  assert_f32_equal(got, np.array([9.0, 1.0, 2.0, 3.0], np.float32), what="history")
  assert_f32_equal(scaling.roll_amax_history(jnp.zeros((1,)), jnp.float32(7.0)), np.array([7.0], np.float32))
  assert_f32_equal(scaling.roll_amax_history(jnp.asarray(h), jnp.array([5.0])), np.array([5, 1, 2, 3], np.float32))


@pytest.mark.parametrize("algo,expected", [("max", 7.0), ("most_recent", 2.0)])
def test_amax_from_history(algo, expected):
  h = jnp.array([2.0, 7.0, 0.0, 3.0], jnp.float32)
  assert_f32_equal(scaling.amax_from_history(h, algo), np.float32(expected))


def test_amax_from_history_nan():
  h = jnp.array([2.0, np.nan, 1.0], jnp.float32)
  assert np.isnan(scaling.amax_from_history(h, "max"))  # documented: NaN until it rolls out
  assert scaling.amax_from_history(h, "most_recent") == 2.0


def test_amax_from_history_bad_algo():
  with pytest.raises(ValueError, match="amax_compute_algo must be 'max' or 'most_recent', got 'mean'"):
    scaling.amax_from_history(jnp.zeros((3,)), "mean")


@pytest.mark.parametrize("history_len", [1, 4])
@pytest.mark.parametrize("margin", [0, 2, 0.5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fp8,fp8_max", [(jnp.float8_e4m3fn, E4M3_MAX), (jnp.float8_e5m2, E5M2_MAX)],
                         ids=["e4m3", "e5m2"])
def test_update_scale_state_replayed(history_len, margin, algo, fp8, fp8_max):
  """Several delayed-scaling steps, replayed by hand: a zero, a NaN and an inf amax among normal ones."""
  amaxes = np.array([3.0, 0.0, 10.0, np.nan, 0.5, 0.25, np.inf, 0.125, 2.0, 1.0, 1.0, 1.0], np.float32)
  step = jax.jit(scale_update.update_scale_state, static_argnames=("fp8_dtype", "margin", "algo"))
  state = scaling.ScaleState.create(history_len)
  history, scale = np.zeros(history_len, np.float32), np.float32(1.0)
  for amax in amaxes:
    state = step(state, jnp.float32(amax), fp8_dtype=fp8, margin=margin, algo=algo)
    history = np.concatenate([[amax], history[:-1]]).astype(np.float32)
    source = history.max() if algo == "max" else history[0]  # ndarray.max propagates NaN, as documented
    scale = np_compute_scale(source, scale, fp8_max, margin)
    assert_f32_equal(state.amax_history, history, what="history")
    assert_f32_equal(state.scale, scale, what="scale")
    assert_f32_equal(state.scale_inv, np.float32(1.0) / scale, what="scale_inv")
  assert state.scale.dtype == jnp.float32 and state.amax_history.dtype == jnp.float32


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_scale_states_batched_equals_one_by_one(algo):
  """Several tensors (E4M3 and E5M2, a NaN, a zero and an inf amax among them) updated in one batched computation
  and one at a time: both the numpy replay of the rule (_np_update), bit for bit. (update_scale_state is the batched
  op with one tensor, so comparing the two with each other alone would prove nothing.)"""
  rng = np.random.default_rng(0)
  dtypes = [jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e5m2, jnp.float8_e4m3fn]
  states = [scaling.ScaleState(jnp.asarray(rng.uniform(0, 4, 6), jnp.float32), jnp.float32(rng.uniform(1, 100)))
            for _ in dtypes]
  amaxes = [jnp.float32(v) for v in (3.0, 0.0, np.nan, np.inf, 0.5)]

  def both(states, amaxes):
    one_by_one = [scale_update.update_scale_state(s, a, d, margin=1, algo=algo)
                  for s, a, d in zip(states, amaxes, dtypes)]
    return scale_update.update_scale_states(states, amaxes, dtypes, margin=1, algo=algo), one_by_one

  batched, one_by_one = jax.jit(both)(states, amaxes)
  for state, amax, dtype, got, single in zip(states, amaxes, dtypes, batched, one_by_one, strict=True):
    want_h, want_s = _np_update(np.asarray(state.amax_history), np.float32(state.scale), np.float32(amax),
                                scaling.fp8_max(dtype), 1, algo)
    for what, new in (("batched", got), ("one by one", single)):
      assert_f32_equal(new.amax_history, want_h, what=f"history, {what}")
      assert_f32_equal(new.scale, want_s, what=f"scale, {what}")
      assert_f32_equal(new.scale_inv, np.float32(1.0) / want_s, what=f"scale_inv, {what}")
  with pytest.raises(ValueError, match="amax_compute_algo must be"):
    scale_update.update_scale_states(states, amaxes, dtypes, algo="mean")


def test_scale_state_create():
  s = scaling.ScaleState.create(3)
  assert_f32_equal(s.amax_history, np.zeros(3, np.float32), what="history")
  assert_f32_equal(s.scale, np.float32(1.0), what="scale")
  assert s.scale.shape == () and s.amax_history.dtype == jnp.float32
  assert_f32_equal(s.scale_inv, np.float32(1.0), what="scale_inv")


@pytest.mark.parametrize("history_len", [0, -1])
def test_scale_state_create_rejects(history_len):
  with pytest.raises(ValueError, match=f"history_len must be >= 1, got {history_len}"):
    scaling.ScaleState.create(history_len)


# ---- the batched update as one op (te_jax.ops.scale_update) ------------------------------------------------------

SPECIAL_AMAXES = (3.0, 0.0, np.nan, np.inf, 0.5, 1e-45, 3.0e38, 448.0)


def _np_update(history, scale, amax, fp8_max, margin, algo):
  history = np.concatenate([[np.float32(amax)], history[:-1]]).astype(np.float32)
  source = history.max() if algo == "max" else history[0]
  return history, np_compute_scale(source, scale, fp8_max, margin)


def _random_states(count, history_len, seed):
  """``count`` states with random histories (a NaN in one of them) and scales, their amaxes (the special ones first)
  and FP8 dtypes (alternating)."""
  rng = np.random.default_rng(seed)
  histories = [rng.uniform(0, 4, history_len).astype(np.float32) for _ in range(count)]
  if count > 2 and history_len > 2:
    histories[2][history_len // 2] = np.nan
  scales = [np.float32(rng.uniform(1, 100)) for _ in range(count)]
  amaxes = [np.float32(SPECIAL_AMAXES[i] if i < len(SPECIAL_AMAXES) else rng.uniform(0, 8)) for i in range(count)]
  dtypes = [(jnp.float8_e4m3fn, jnp.float8_e5m2)[i % 2] for i in range(count)]
  return histories, scales, amaxes, dtypes


def _update(histories, scales, amaxes, dtypes, margin, algo):
  states = [scaling.ScaleState(jnp.asarray(h), jnp.asarray(s)) for h, s in zip(histories, scales)]
  return scale_update.update_scale_states(states, [jnp.asarray(a) for a in amaxes], dtypes, margin=margin, algo=algo)


@pytest.mark.parametrize("count,history_len", [(1, 1), (5, 16), (17, 1000)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_scale_states_matches_numpy(count, history_len, algo):
  """More tensors than one CUDA launch takes (16), histories longer than a block's threads, the special amaxes."""
  histories, scales, amaxes, dtypes = _random_states(count, history_len, seed=count)
  got = jax.jit(lambda h, s, a: _update(h, s, a, dtypes, 3, algo))(histories, scales, amaxes)
  for h, s, a, d, new in zip(histories, scales, amaxes, dtypes, got):
    want_h, want_s = _np_update(h, s, a, scaling.fp8_max(d), 3, algo)
    assert_f32_equal(new.amax_history, want_h, what="history")
    assert_f32_equal(new.scale, want_s, what="scale")


def test_scale_update_rejects_bad_input():
  from te_jax.ops.scale_update import scale_update

  h, s = jnp.zeros(4), jnp.float32(1.0)
  with pytest.raises(ValueError, match="as many scales, amaxes and fp8_max as histories"):
    scale_update([h, h], [s], [s, s], [448.0, 448.0])
  with pytest.raises(ValueError, match="1-D and of one length"):
    scale_update([h, jnp.zeros(5)], [s, s], [s, s], [448.0, 448.0])
  with pytest.raises(ValueError, match="1-D and of one length"):
    scale_update([jnp.zeros(0)], [s], [s], [448.0])
  with pytest.raises(ValueError, match="amaxes must be scalars"):
    scale_update([h], [s], [jnp.zeros(2)], [448.0])


def test_scale_update_under_a_mesh_and_vmap():
  """Replicated state under jit on an 8-device mesh (with an amax from a sharded input), and vmapped."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]), ("d",))
  x = jax.device_put(jnp.arange(64, dtype=jnp.float32) - 40.0,
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  state = scaling.ScaleState.create(4)

  @jax.jit
  def step(state, x):
    return scale_update.update_scale_state(state, jnp.max(jnp.abs(x)), jnp.float8_e4m3fn)

  new = step(state, x)
  assert_f32_equal(new.amax_history, np.array([40.0, 0, 0, 0], np.float32), what="history")
  assert_f32_equal(new.scale, E4M3_MAX / np.float32(40.0), what="scale")
  batched = jax.vmap(lambda a: scale_update.update_scale_state(state, a, jnp.float8_e5m2))(jnp.float32([2.0, 0.0]))
  assert_f32_equal(batched.scale, np.array([E5M2_MAX / np.float32(2.0), 1.0], np.float32), what="scale")


@pytest.mark.gpu
@pytest.mark.parametrize("count,history_len", [(1, 1), (6, 16), (17, 1024), (3, 1000)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2, 0.3])
def test_gpu_scale_update_matches_reference_bitwise(count, history_len, algo, margin, gpu):
  """te_scale_update_cuda against the documented rule in IEEE float32 (numpy, and XLA:CPU's lowering of the
  reference) bit for bit, and against XLA:GPU's lowering of the reference: the same histories, scales within one ulp
  (XLA:GPU's float32 division is not correctly rounded)."""
  from te_jax._core import native
  from te_jax.ops.scale_update import ScaleUpdateConfig, scale_update_ref

  assert native.has_target("cuda", "te_scale_update_cuda"), native.load_errors
  histories, scales, amaxes, dtypes = _random_states(count, history_len, seed=10 + count)
  config = ScaleUpdateConfig(tuple(scaling.fp8_max(d) for d in dtypes), margin, algo == "most_recent")
  reference = jax.jit(lambda *args: scale_update_ref(*args, config=config))
  cpu_ref = reference(*histories, *scales, *amaxes)
  with jax.default_device(gpu):
    ours = jax.jit(lambda h, s, a: _update(h, s, a, dtypes, margin, algo))
    hlo = ours.lower(histories, scales, amaxes).compile().as_text()
    assert 'custom_call_target="te_scale_update_cuda"' in hlo
    got = ours(histories, scales, amaxes)
    gpu_ref = reference(*histories, *scales, *amaxes)
  for i, (h, s, a, d, new) in enumerate(zip(histories, scales, amaxes, dtypes, got)):
    want_h, want_s = _np_update(h, s, a, scaling.fp8_max(d), margin, algo)
    assert_f32_equal(new.amax_history, want_h, what="history vs numpy")
    assert_f32_equal(new.scale, want_s, what="scale vs numpy")
    assert_f32_equal(new.amax_history, cpu_ref[i], what="history vs the reference on the CPU")
    assert_f32_equal(new.scale, cpu_ref[count + i], what="scale vs the reference on the CPU")
    assert_f32_equal(new.amax_history, gpu_ref[i], what="history vs the reference on the GPU")
    ulps = abs(int(np.float32(new.scale).view(np.int32)) - int(np.float32(gpu_ref[count + i]).view(np.int32)))
    assert ulps <= 1, f"scale {float(new.scale)!r} vs the reference on the GPU {float(gpu_ref[count + i])!r}"


def test_scale_update_in_shard_map_keeps_varying_axes():
  """Inside shard_map the new state varies over the mesh axes its amax varies over: a per-shard amax gives a
  per-shard state (out_specs P("x")), a psum/pmax-reduced one a replicated state (out_specs P())."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  state = scaling.ScaleState.create(3)
  x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)

  def per_shard(x):
    new = scale_update.update_scale_state(state, jnp.max(jnp.abs(x)), jnp.float8_e4m3fn)
    return new.amax_history[None], new.scale[None]

  hist, scale = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))(x)
  np.testing.assert_array_equal(np.asarray(hist)[:, 0], [3.0, 7.0, 11.0, 15.0])
  assert_f32_equal(scale, E4M3_MAX / np.float32([3.0, 7.0, 11.0, 15.0]), what="scale")

  def reduced(x):
    new = scale_update.update_scale_state(state, jax.lax.pmax(jnp.max(jnp.abs(x)), "x"), jnp.float8_e4m3fn)
    return new.amax_history, new.scale

  hist, scale = jax.jit(jax.shard_map(reduced, mesh=mesh, in_specs=P("x"), out_specs=(P(), P())))(x)
  assert_f32_equal(hist, np.array([15.0, 0.0, 0.0], np.float32), what="history")
  assert_f32_equal(scale, E4M3_MAX / np.float32(15.0), what="scale")
