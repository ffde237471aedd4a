"""activation_fwd / activation_bwd / activation.

- The CPU handler against the pure-jnp reference: bitwise (FP8 bytes, transposed copy, amax, high-precision values)
  for relu and squared_relu, plain and gated. The other activations use ``exp``, which XLA:CPU computes with its own
  approximation and with multiply-adds contracted into FMAs, while the handler uses the C library's expf and rounds
  every operation: there the handler's float32 values are checked against the reference within a bound of a few
  float32 roundings (2^-17 of the terms' magnitude; a wrong formula or constant is off by 1e-3 or more), and its FP8
  outputs bitwise against ``quantize`` of its own float32 values (the same cast, amax and transpose).
- The reference itself against jax.nn (gelu with approximate=True, silu, relu) and jax.grad, so that the oracle is
  anchored independently.
- jit, vmap, grad (check_grads), argument checks, and sharding on 8 CPU devices.
- On a GPU (``@pytest.mark.gpu``): the CUDA handlers against the reference run on the same GPU, bitwise for every
  activation: XLA's GPU code for the reference rounds every operation, uses libdevice's expf and rcp.approx.f32 for
  1 / d, exactly as the kernels do (see te_jax/ops/activation.py).
"""

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import assert_column_sums_close, assert_f32_equal, assert_fp8_equal, check_per_tensor
from test_sharding import all_reduces
from te_jax._core import native
from te_jax.ops.activation import ActivationConfig, activation_bwd_ref, activation_fwd_ref
from te_jax.ops.activation import activation_bwd, activation_fwd
from te_jax.ops.quantize import CastOutput, quantize

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
CPU = jax.devices("cpu")[0]
ACT_TYPES = [("gelu",), ("relu",), ("silu",), ("quick_gelu",), ("squared_relu",), ("silu", "linear"),
             ("gelu", "linear"), ("relu", "linear"), ("quick_gelu", "linear"), ("squared_relu", "linear")]
EXACT_ON_CPU = {"relu", "squared_relu"}  # no exp, no multiply-add: XLA:CPU computes what the handler does
IN_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
# Output features N (odd, multiples of 8 or not), leading dims of rank 1..3.
SHAPES = [(1, 1), (5, 7), (13, 31), (16, 16), (33, 130), (2, 3, 9), (3, 17, 40), (2, 1, 9, 24)]
ACTS = pytest.mark.parametrize("act", ACT_TYPES, ids=lambda a: "-".join(a))


# ---- helpers -------------------------------------------------------------------------------------------------------


class Flat(NamedTuple):
  """An op's results side by side, as the tests compare them; fields that do not apply are None."""

  data: jax.Array
  data_t: jax.Array | None
  amax: jax.Array | None
  dbias: jax.Array | None
  scale_inv: jax.Array | None = None


def flat(c: CastOutput) -> Flat:
  """A CastOutput as (data, data_t, amax, dbias, scale_inv): an FP8 ``out`` is a per-tensor QuantizedTensor (whose
  transposed copy, when there is one, has the same scale), a high-precision one the array itself."""
  if isinstance(c.out, te_jax.QuantizedTensor):
    q = c.out
    check_per_tensor(q)
    return Flat(q.data, q.data_t, c.amax, c.dbias, q.scale_inv)
  assert c.amax is None, "amax comes with FP8 outputs only"
  return Flat(c.out, None, c.amax, c.dbias)


def flatten(tree):
  """``flat`` of every CastOutput in ``tree`` (what a test function returns: a result, a tuple of them, a list)."""
  return jax.tree_util.tree_map(lambda v: flat(v) if isinstance(v, CastOutput) else v, tree,
                                is_leaf=lambda v: isinstance(v, CastOutput))


def input_shape(out_shape, act) -> tuple:
  return out_shape[:-1] + (2,) + out_shape[-1:] if len(act) == 2 else tuple(out_shape)


def random_input(shape, dtype, seed: int, spread: float = 4.0) -> np.ndarray:
  """Normal values scaled by 2^U(-spread, spread): the activations' curved region, their tails and tiny values."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * np.exp2(rng.uniform(-spread, spread, shape))).astype(dtype)


def fwd_kwargs(dtype, transpose=False):
  if jnp.dtype(dtype) in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
    return {"dtype": dtype, "scale": np.float32(0.75), "transpose": transpose}
  return {"dtype": dtype}


def run_many(fn, args_list, device, target=None, calls=1):
  """``fn(*args)`` for each of ``args_list`` in one jitted program on ``device``; asserts that the compiled program
  calls the native ``target`` ``calls`` times per element (``fn`` may return several ops' results)."""
  args_list = jax.device_put(args_list, device)
  compiled = jax.jit(lambda al: [fn(*a) for a in al]).lower(args_list).compile()
  if target is not None:
    assert compiled.as_text().count(f'custom_call_target="{target}"') == calls * len(args_list), target
  return flatten(compiled(args_list))


def reference_fwd(x, act, *, dtype, scale=None, transpose=False):
  config = ActivationConfig(activation=act[0], gated=len(act) == 2, out_dtype=jnp.dtype(dtype), transpose=transpose,
                            batch_ndim=x.ndim - (3 if len(act) == 2 else 2) if transpose else 0)
  outs = list(activation_fwd_ref(x, jnp.float32(1.0 if scale is None else scale), config=config))
  fp8 = config.fp8
  return Flat(outs[0], outs[1] if fp8 and transpose else None, outs[-1] if fp8 else None, None)


def reference_bwd(g, x, act, *, dtype, scale=None, transpose=False, dbias=False):
  gated = len(act) == 2
  config = ActivationConfig(activation=act[0], gated=gated, out_dtype=jnp.dtype(dtype), transpose=transpose,
                            batch_ndim=x.ndim - (3 if gated else 2) if transpose else 0, dbias=dbias)
  outs = list(activation_bwd_ref(g, x, jnp.float32(1.0 if scale is None else scale), config=config))
  data = outs.pop(0)
  data_t = outs.pop(0) if config.fp8 and transpose else None
  amax = outs.pop(0) if config.fp8 else None
  return Flat(data, data_t, amax, outs.pop(0) if dbias else None)


def t_axes(ndim: int, feature_ndim: int) -> tuple:
  """The default transposed copy: the feature dims before the last leading dim (written independently)."""
  lead = ndim - feature_ndim
  return tuple(range(lead - 1)) + tuple(range(lead, ndim)) + (lead - 1,)


def assert_hp_equal(actual, expected, what):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, actual.shape)
  assert_f32_equal(actual.astype(np.float32), expected.astype(np.float32), what=what)


def assert_close_to_reference(h, r, scale_terms, what):
  """|h - r| <= 2^-17 (|r| + scale_terms): a few float32 roundings of the terms the formula adds up."""
  h, r = np.asarray(h, np.float64), np.asarray(r, np.float64)
  nan = np.isnan(r)
  np.testing.assert_array_equal(np.isnan(h), nan, err_msg=f"{what}: NaN positions")
  inf = np.isinf(r)
  np.testing.assert_array_equal(h[inf], r[inf], err_msg=f"{what}: infinities")
  ok = ~nan & ~inf
  err = np.abs(h - r)[ok]
  bound = (2.0**-17 * (np.abs(r) + scale_terms))[ok]
  worst = np.argmax(err - bound) if err.size else 0
  assert np.all(err <= bound), f"{what}: error {err[worst]} over the bound {bound[worst]}"


def assert_fp8_consistent(outs, hps, scale):
  """Each of ``outs`` (FP8 outputs) is exactly quantize of the float32 values in ``hps`` the same handler computed
  (one compiled program quantizes them all)."""
  wants = run_many(lambda h: quantize(h, jnp.float32(scale), outs[0].data.dtype), [(h,) for h in hps], CPU,
                   "te_quantize_cpu")
  for out, want in zip(outs, wants, strict=True):
    assert_fp8_equal(out.data, want.data, what=f"data {out.data.shape}")
    assert_f32_equal(out.amax, want.amax, what=f"amax {out.data.shape}")


# ---- CPU handler vs reference --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _cpu_handlers_registered():
  """Every CPU test here means the native handlers: a silent fallback to the reference must fail, not pass."""
  assert native.has_target("cpu", "te_act_fwd_cpu") and native.has_target("cpu", "te_act_bwd_cpu"), \
      native.load_errors


def _cpu_case(act, dtype, seed):
  xs = [random_input(input_shape(s, act), dtype, seed=seed + i) for i, s in enumerate(SHAPES)]
  gs = [random_input(s, dtype, seed=seed + 100 + i, spread=2.0) for i, s in enumerate(SHAPES)]
  return xs, gs


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "bf16", "f16"])
@ACTS
@pytest.mark.fast_cases(6)
def test_cpu_forward(act, dtype):
  """One program runs the handler to E4M3 (with the transposed copy), float32 and the input dtype for every shape,
  one the reference; where the handler is not bitwise the reference (exp), only the reference's float32 values are
  compared (its FP8 outputs would not be), so only those are compiled."""
  xs, _ = _cpu_case(act, dtype, seed=1)
  feature_ndim = 1
  exact = act[0] in EXACT_ON_CPU
  args = [(x,) for x in xs]
  outs = run_many(lambda x: (activation_fwd(x, act, dtype=E4M3, scale=0.75, transpose=True),
                             activation_fwd(x, act, dtype=jnp.float32), activation_fwd(x, act)),
                  args, CPU, "te_act_fwd_cpu", calls=2 if dtype is np.float32 else 3)  # float32 twice: one call
  if exact:
    refs = run_many(lambda x: (reference_fwd(x, act, dtype=E4M3, scale=0.75, transpose=True),
                               reference_fwd(x, act, dtype=jnp.float32), reference_fwd(x, act, dtype=dtype)), args, CPU)
  else:
    refs = run_many(lambda x: (None, reference_fwd(x, act, dtype=jnp.float32), None), args, CPU)
  for x, (q, h, s), (rq, rh, rs) in zip(xs, outs, refs, strict=True):
    what = f"shape {x.shape}"
    assert_fp8_equal(q.data_t, np.transpose(np.asarray(q.data), t_axes(q.data.ndim, feature_ndim)), what="data_t")
    assert_f32_equal(q.scale_inv, np.float32(1) / np.float32(0.75), what="scale_inv")
    assert h.scale_inv is None and s.scale_inv is None  # high-precision outputs are plain arrays
    assert s.data.dtype == dtype
    if exact:
      assert_fp8_equal(q.data, rq.data, what=what)
      assert_fp8_equal(q.data_t, rq.data_t, what=f"data_t, {what}")
      assert_f32_equal(q.amax, rq.amax, what=f"amax, {what}")
      assert_hp_equal(h.data, rh.data, what=f"f32, {what}")
      assert_hp_equal(s.data, rs.data, what=f"{np.dtype(dtype).name}, {what}")
    else:
      xf = x.astype(np.float64)
      terms = np.abs(xf[..., 0, :] * xf[..., 1, :]) if len(act) == 2 else np.abs(xf)
      assert_close_to_reference(h.data, rh.data, terms, what=f"f32, {what}")
      assert_hp_equal(s.data, np.asarray(h.data).astype(dtype), what=f"{np.dtype(dtype).name} = f32 cast, {what}")
  if not exact:
    assert_fp8_consistent([q for q, _, _ in outs], [h.data for _, h, _ in outs], 0.75)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "bf16", "f16"])
@ACTS
@pytest.mark.fast_cases(6)
def test_cpu_backward(act, dtype):
  """As test_cpu_forward: one program for the handler's E5M2 (transposed copy, dbias) and float32 outputs, one for
  the reference's (its E5M2 outputs only where the handler is bitwise the reference)."""
  xs, gs = _cpu_case(act, dtype, seed=2)
  gated = len(act) == 2
  feature_ndim = 2 if gated else 1
  exact = act[0] in EXACT_ON_CPU
  args = [(g, x) for g, x in zip(gs, xs)]
  kw = {"dtype": E5M2, "scale": 2.0, "transpose": True, "dbias": True}
  outs = run_many(lambda g, x: (activation_bwd(g, x, act, **kw), activation_bwd(g, x, act, dtype=jnp.float32,
                                                                                dbias=True)),
                  args, CPU, "te_act_bwd_cpu", calls=2)
  refs = run_many(lambda g, x: (reference_bwd(g, x, act, **kw) if exact else None,
                                reference_bwd(g, x, act, dtype=jnp.float32)), args, CPU)
  for (g, x), (q, h), (rq, rh) in zip(args, outs, refs, strict=True):
    what = f"shape {x.shape}"
    assert q.data.shape == x.shape and q.dbias.shape == x.shape[-feature_ndim:]
    assert_f32_equal(q.scale_inv, np.float32(0.5), what="scale_inv")
    assert h.scale_inv is None
    assert_fp8_equal(q.data_t, np.transpose(np.asarray(q.data), t_axes(x.ndim, feature_ndim)), what="data_t")
    assert_column_sums_close(np.asarray(q.dbias).reshape(-1), np.asarray(h.data).reshape(-1, q.dbias.size))
    assert_f32_equal(q.dbias, h.dbias, what="dbias: the same sums in the FP8 and f32 runs")
    if exact:
      assert_fp8_equal(q.data, rq.data, what=what)
      assert_fp8_equal(q.data_t, rq.data_t, what=f"data_t, {what}")
      assert_f32_equal(q.amax, rq.amax, what=f"amax, {what}")
      assert_hp_equal(h.data, rh.data, what=f"f32, {what}")
    else:
      gf, xf = np.abs(g.astype(np.float64)), x.astype(np.float64)
      if gated:
        a, b = xf[..., 0, :], np.abs(xf[..., 1, :])
        terms = np.stack([gf * b * (1 + np.abs(a)) * (1 + a * a), gf * np.abs(a)], axis=-2)
      else:
        terms = gf * (1 + np.abs(xf)) * (1 + xf * xf)
      assert_close_to_reference(h.data, rh.data, terms, what=f"f32, {what}")
  if not exact:
    assert_fp8_consistent([q for q, _ in outs], [h.data for _, h in outs], 2.0)


def special_values() -> np.ndarray:
  v = np.array([0.0, -0.0, 1.0, -1.0, 1e-3, -1e-3, 5.0, -5.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 448.0, 1e4,
                -1e4, 3e38, -3e38, np.inf, -np.inf, np.nan, -np.nan, 1e-30, -1e-30], np.float32)
  return v


@ACTS
def test_cpu_special_values(act):
  v = special_values()
  n = len(v)
  x = np.stack([v, v[::-1]], axis=-2)[None] if len(act) == 2 else v[None]  # gated: every value meets every other
  g = np.resize(np.array([1.0, -2.0, 0.5, np.inf], np.float32), (1, n))
  out = run_many(lambda x: activation_fwd(x, act, dtype=jnp.float32), [(x,)], CPU, "te_act_fwd_cpu")[0]
  ref = run_many(lambda x: reference_fwd(x, act, dtype=jnp.float32), [(x,)], CPU)[0]
  dx = run_many(lambda g, x: activation_bwd(g, x, act, dtype=jnp.float32), [(g, x)], CPU, "te_act_bwd_cpu")[0]
  rdx = run_many(lambda g, x: reference_bwd(g, x, act, dtype=jnp.float32), [(g, x)], CPU)[0]
  with np.errstate(invalid="ignore", over="ignore"):
    if act[0] in EXACT_ON_CPU:
      assert_hp_equal(out.data, ref.data, what="forward")
      assert_hp_equal(dx.data, rdx.data, what="backward")
    else:
      assert_close_to_reference(out.data, ref.data, np.abs(np.prod(x.astype(np.float64), axis=-2)) if len(act) == 2
                                else np.abs(x.astype(np.float64)), what="forward")
  if act == ("relu",):  # NaN stays NaN; -0 becomes +0
    y = np.asarray(out.data)[0]
    assert np.isnan(y[np.isnan(v)]).all()
    assert np.signbit(y[v == 0]).sum() == 0


def test_cpu_fp8_amax_propagates_nan():
  x = np.ones((64, 64), np.float32)
  x[63, 63] = np.nan
  out = activation_fwd(jax.device_put(x, CPU), ("silu",), dtype=E4M3, scale=1.0)
  assert np.isnan(np.asarray(out.amax))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0)], ids=str)
def test_cpu_empty(shape):
  x = np.zeros(shape, np.float32)
  out = flat(activation_bwd(jnp.asarray(x), jnp.asarray(x), ("gelu",), dtype=E4M3, scale=1.0, transpose=True,
                                   dbias=True))
  assert out.data.shape == shape and float(out.amax) == 0.0
  np.testing.assert_array_equal(np.asarray(out.dbias), np.zeros(shape[-1:], np.float32))


# ---- the reference itself ------------------------------------------------------------------------------------------


def _jax_nn(act_name):
  return {"gelu": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu, "relu": jax.nn.relu,
          "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x), "squared_relu": lambda x: jax.nn.relu(x) ** 2}[act_name]


@ACTS
def test_reference_matches_jax_nn(act):
  """The reference forward and backward against jax.nn's definitions and jax.grad (float32, at 1e-5 relative)."""
  x = random_input(input_shape((64, 48), act), np.float32, seed=5, spread=3.0)
  g = random_input((64, 48), np.float32, seed=6, spread=1.0)
  f = _jax_nn(act[0])
  if len(act) == 2:
    def plain(x):
      return f(x[..., 0, :]) * x[..., 1, :]
  else:
    plain = f
  y_ref = reference_fwd(jnp.asarray(x), act, dtype=jnp.float32).data
  # atol: where 1 + tanh(z) rounds to 0, jax.nn.gelu gives 0 and the sigmoid form the (tiny) true value.
  np.testing.assert_allclose(np.asarray(y_ref), np.asarray(plain(jnp.asarray(x))), rtol=1e-5, atol=1e-5)
  _, vjp = jax.vjp(plain, jnp.asarray(x))
  dx_ref = reference_bwd(jnp.asarray(g), jnp.asarray(x), act, dtype=jnp.float32).data
  np.testing.assert_allclose(np.asarray(dx_ref), np.asarray(vjp(jnp.asarray(g))[0]), rtol=1e-5, atol=5e-5)


# ---- jit, vmap, grad -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear"), ("quick_gelu",), ("gelu", "linear")],
                         ids=lambda a: "-".join(a))
def test_check_grads(act):
  x = jax.device_put(random_input(input_shape((3, 8), act), np.float32, seed=3, spread=1.0), CPU)
  jax.test_util.check_grads(lambda x: te_jax.activation(x, act), (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_activation_grad_is_the_bwd_op():
  x = jax.device_put(random_input((2, 4, 2, 16), ml_dtypes.bfloat16, seed=4), CPU)
  g = jax.device_put(random_input((2, 4, 16), ml_dtypes.bfloat16, seed=5), CPU)
  act = ("silu", "linear")
  y, vjp = jax.vjp(lambda x: te_jax.activation(x, act), x)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 4, 16)
  assert_hp_equal(vjp(g)[0], activation_bwd(g, x, act).out, what="grad")
  assert_hp_equal(jax.jit(lambda x: te_jax.activation(x, act))(x), y, what="jit == eager")


def test_vmap_is_per_element():
  x = random_input((3, 5, 2, 24), np.float32, seed=7)
  f = jax.jit(jax.vmap(lambda x: activation_fwd(x, ("relu", "linear"), dtype=E4M3, scale=0.5,
                                                        transpose=True)))
  out = flat(f(jax.device_put(x, CPU)))
  for i in range(3):
    ref = reference_fwd(jnp.asarray(x[i]), ("relu", "linear"), dtype=E4M3, scale=0.5, transpose=True)
    assert_fp8_equal(out.data[i], ref.data)
    assert_fp8_equal(out.data_t[i], ref.data_t, what="data_t")
    assert_f32_equal(out.amax[i], ref.amax)


def test_transpose_batch_dims():
  x = random_input((2, 3, 5, 2, 8), np.float32, seed=8)
  g = random_input((2, 3, 5, 8), np.float32, seed=9)
  for b in (0, 1, 2):
    out = flat(activation_bwd(jnp.asarray(g), jnp.asarray(x), ("relu", "linear"), dtype=E4M3, scale=1.0,
                              transpose=True, transpose_batch_dims=b))
    axes = tuple(range(b)) + (3, 4) + tuple(range(b, 3))
    assert_fp8_equal(out.data_t, np.transpose(np.asarray(out.data), axes), what=f"batch dims {b}")


# ---- argument checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: activation_fwd(jnp.ones((2, 3)), ("tanh",)), ValueError, "^activation_type must be"),
    (lambda: activation_fwd(jnp.ones((2, 3)), ("gelu", "relu")), ValueError, "^activation_type must be"),
    (lambda: activation_fwd(jnp.ones((3, 4)), ("gelu", "linear")), ValueError, "^x of a gated activation"),
    (lambda: activation_fwd(jnp.ones((2, 3), jnp.int32)), TypeError, "^x must be float32"),
    (lambda: activation_fwd(jnp.ones((2, 3)), dtype=E4M3), ValueError, "^scale is required"),
    (lambda: activation_fwd(jnp.ones((2, 3)), scale=1.0), ValueError, "^scale and transpose need an FP8"),
    (lambda: activation_fwd(jnp.ones((2, 3)), dtype=jnp.int8), ValueError, "^dtype must be"),
    (lambda: activation_fwd(jnp.ones((2, 3)), dtype=E4M3, scale=np.array(1.0)), TypeError, "^scale must be"),
    (lambda: activation_fwd(jnp.ones((3,)), dtype=E4M3, scale=1.0, transpose=True), ValueError,
     "^transpose=True needs"),
    (lambda: activation_fwd(jnp.ones((2, 3, 4)), dtype=E4M3, scale=1.0, transpose=True,
                                   transpose_batch_dims=2), ValueError, r"^transpose_batch_dims must be in \[0, 1\]"),
    (lambda: activation_bwd(jnp.ones((2, 4)), jnp.ones((2, 3))), ValueError, "^g must have the activation"),
    (lambda: activation_bwd(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((2, 3))), TypeError, "^g must have x's"),
    (lambda: te_jax.activation(jnp.ones((2, 3)), "swiglu"), ValueError, "^activation_type must be"),
], ids=["unknown", "second-not-linear", "gated-shape", "int-x", "fp8-no-scale", "hp-scale", "int8-out", "f64-scale",
        "t-rank1", "batch-too-big", "g-shape", "g-dtype", "activation-name"])
def test_bad_arguments_raise_before_xla(call, error, match):
  with pytest.raises(error, match=match):
    call()
  with pytest.raises(error, match=match):  # under jit: at trace time, with the same message
    jax.jit(call)()


# ---- sharding on 8 CPU devices -------------------------------------------------------------------------------------

_BAD_COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


@pytest.mark.parametrize("x_shape,spec,act", [
    ((8 * 3, 16), P("x", None), ("gelu",)),
    ((4 * 3, 2, 2 * 8), P("a", None, "b"), ("silu", "linear")),  # rows and the hidden dim; the gate dim whole
    ((2, 4 * 3, 2, 8), P("b", "a", None, None), ("relu", "linear")),
    ((6, 8 * 2), P(None, "x"), ("squared_relu",)),
], ids=["rows", "rows+hidden-gated", "batch+rows-gated", "features"])
def test_sharded_equals_unsharded(x_shape, spec, act):
  names = ("x",) if "x" in str(spec) else ("a", "b")
  mesh = Mesh(np.array(jax.devices("cpu")).reshape((8,) if names == ("x",) else (4, 2)), names)
  gated = len(act) == 2
  x = random_input(x_shape, np.float32, seed=10)
  g_shape = x_shape[:-2] + x_shape[-1:] if gated else x_shape
  g = random_input(g_shape, np.float32, seed=11)
  g_spec = P(*(tuple(spec)[:-2] + tuple(spec)[-1:])) if gated else spec

  def f(g, x):
    y = activation_fwd(x, act, dtype=E4M3, scale=0.5, transpose=True)
    dx = activation_bwd(g, x, act, dtype=E5M2, scale=1.0, transpose=True, dbias=True)
    return y, dx

  args = (jax.device_put(g, NamedSharding(mesh, g_spec)), jax.device_put(x, NamedSharding(mesh, spec)))
  compiled = jax.jit(f).lower(*args).compile()
  y, dx = flatten(compiled(*args))
  ry, rdx = flatten(jax.jit(f)(jax.device_put(g, jax.devices("cpu")[0]), jax.device_put(x, jax.devices("cpu")[0])))
  for a, b, what in [(y.data, ry.data, "y"), (y.data_t, ry.data_t, "y_t"), (dx.data, rdx.data, "dx"),
                     (dx.data_t, rdx.data_t, "dx_t")]:
    assert_fp8_equal(a, b, what=what)
  assert_f32_equal(y.amax, ry.amax)
  assert_f32_equal(dx.amax, rdx.amax)
  dx32 = activation_bwd(jnp.asarray(g), jnp.asarray(x), act, dtype=jnp.float32).out
  feature_ndim = 2 if gated else 1
  assert_column_sums_close(dx.dbias.reshape(-1), np.asarray(dx32).reshape(-1, int(np.prod(x_shape[-feature_ndim:]))))
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_act_fwd_cpu"') == 1 and hlo.count('custom_call_target="te_act_bwd_cpu"') == 1
  assert not _BAD_COLLECTIVES.search(hlo), _BAD_COLLECTIVES.search(hlo).group(0)
  lead_sharded = any(e is not None for e in tuple(spec)[:len(x_shape) - feature_ndim])
  # The two amax maxima (XLA may combine them into one all-reduce) and, when a leading dim is sharded, the dbias sum.
  assert set(all_reduces(hlo)) == ({"maximum", "add"} if lead_sharded else {"maximum"}), all_reduces(hlo)


# ---- CUDA handlers vs reference on the GPU -------------------------------------------------------------------------

# Whole 128x128 tiles, ragged tiles, cols % 8 != 0 (scalar path), rows % 8 != 0 (byte stores of the transposed copy).
# One compiled program per activation and dtype covers all of them: GPU time goes to the kernels, not to compiles.
GPU_SHAPES = [(1, 1), (5, 7), (33, 130), (2, 3, 9), (200, 264), (1001, 1024), (4, 136, 128)]
GPU_LARGE = [(4096, 4096), (2, 2048, 3072)]


def _gpu_check(act, dtype, shapes, gpu, fwd_fp8=E4M3, bwd_fp8=E5M2):
  """Forward to fwd_fp8 and to dtype, backward to bwd_fp8 (with the transposed copy and dbias) and to float32, each
  against the reference on the GPU, bit for bit (dbias: within any summation order's bound)."""
  assert native.has_target("cuda", "te_act_fwd_cuda") and native.has_target("cuda", "te_act_bwd_cuda"), \
      native.load_errors
  gated = len(act) == 2
  feature_ndim = 2 if gated else 1
  xs = [random_input(input_shape(s, act), dtype, seed=sum(s)) for s in shapes]
  gs = [random_input(s, dtype, seed=sum(s) + 1, spread=2.0) for s in shapes]
  args = list(zip(gs, xs))

  def ours(g, x):
    return (activation_fwd(x, act, dtype=fwd_fp8, scale=0.75, transpose=True),
            activation_fwd(x, act, dtype=dtype),
            activation_bwd(g, x, act, dtype=bwd_fp8, scale=2.0, transpose=True, dbias=True),
            activation_bwd(g, x, act, dtype=jnp.float32))

  def ref(g, x):
    return (reference_fwd(x, act, dtype=fwd_fp8, scale=0.75, transpose=True), reference_fwd(x, act, dtype=dtype),
            reference_bwd(g, x, act, dtype=bwd_fp8, scale=2.0, transpose=True, dbias=True),
            reference_bwd(g, x, act, dtype=jnp.float32))

  assert_gpu_outputs_equal(act, dtype, feature_ndim, args, run_many(ours, args, gpu), run_many(ref, args, gpu))


def assert_gpu_outputs_equal(act, dtype, feature_ndim, args, outs, refs):
  """``_gpu_check``'s comparison: the FP8 forward (data, transposed copy, amax), the ``dtype`` forward, the FP8
  backward (its transposed copy's layout too) and the float32 backward bit for bit; dbias within any summation
  order's bound."""
  for (g, x), (yq, yh, dq, dh), (ryq, ryh, rdq, rdh) in zip(args, outs, refs, strict=True):
    what = f"{act} shape {x.shape}"
    assert_fp8_equal(yq.data, ryq.data, what=f"y, {what}")
    assert_fp8_equal(yq.data_t, ryq.data_t, what=f"y_t, {what}")
    assert_f32_equal(yq.amax, ryq.amax, what=f"y amax, {what}")
    assert_hp_equal(yh.data, ryh.data, what=f"y {np.dtype(dtype).name}, {what}")
    assert_fp8_equal(dq.data, rdq.data, what=f"dx, {what}")
    assert_fp8_equal(dq.data_t, rdq.data_t, what=f"dx_t, {what}")
    assert_fp8_equal(dq.data_t, np.transpose(np.asarray(dq.data), t_axes(x.ndim, feature_ndim)), what="dx_t layout")
    assert_f32_equal(dq.amax, rdq.amax, what=f"dx amax, {what}")
    assert_hp_equal(dh.data, rdh.data, what=f"dx f32, {what}")
    assert_column_sums_close(dq.dbias.reshape(-1), np.asarray(dh.data).reshape(-1, dq.dbias.size))


@pytest.mark.gpu
@ACTS
def test_gpu_matches_reference(act, gpu):
  _gpu_check(act, ml_dtypes.bfloat16, GPU_SHAPES, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear")], ids=lambda a: "-".join(a))
def test_gpu_other_dtypes_and_large(act, dtype, gpu):
  _gpu_check(act, dtype, GPU_SHAPES[:4] + GPU_LARGE, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("gelu",), ("silu", "linear")], ids=lambda a: "-".join(a))
def test_gpu_other_fp8_format(act, gpu):
  """The formats test_gpu_matches_reference leaves out, each its own copy of the whole-tile loop: the forward to E5M2
  and the backward to E4M3, on whole tiles, a ragged edge and a batch dim."""
  _gpu_check(act, ml_dtypes.bfloat16, [(256, 384), (200, 264), (3, 128, 256)], gpu, fwd_fp8=E5M2, bwd_fp8=E4M3)


@pytest.mark.gpu
def test_gpu_dbias_is_deterministic(gpu):
  x = jax.device_put(random_input((4096, 2, 1024), np.float32, seed=12), gpu)
  g = jax.device_put(random_input((4096, 1024), np.float32, seed=13), gpu)
  f = jax.jit(lambda g, x: activation_bwd(g, x, ("gelu", "linear"), dtype=E5M2, scale=1.0, dbias=True).dbias)
  first = np.asarray(f(g, x))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(f(g, x)).view(np.uint32), first.view(np.uint32))


@pytest.mark.gpu
def test_gpu_denormal_sigmoid(gpu):
  """Where the sigmoid's 1 / (1 + exp(-z)) is denormal (1 + exp(-z) > 2^126), the kernels' one-instruction reciprocal
  flushes it to zero; they compute those chunks again with the reference's reciprocal. Inputs around that edge, next
  to ordinary ones in the same 8-element chunks: forward and backward, float32 and FP8 with amax, bit for bit."""
  edges = {"gelu": (-12.5, -8.5), "silu": (-104.0, -86.0), "quick_gelu": (-62.0, -50.0)}
  for name, (lo, hi) in edges.items():
    tail = np.linspace(lo, hi, 64 * 96, dtype=np.float32).reshape(64, 96)
    x = np.concatenate([tail, random_input((64, 32), np.float32, seed=3, spread=1.0)], axis=1)  # (64, 128)
    g = random_input(x.shape, np.float32, seed=4, spread=1.0)
    for act in [(name,), (name, "linear")]:
      xa = np.stack([x, np.flip(x, axis=-1)], axis=-2) if len(act) == 2 else x

      def ours(g, x, act=act):
        return (activation_fwd(x, act, dtype=jnp.float32), activation_bwd(g, x, act, dtype=jnp.float32),
                activation_fwd(x, act, dtype=E4M3, scale=2.0**120),
                activation_bwd(g, x, act, dtype=E5M2, scale=2.0**120))

      def ref(g, x, act=act):
        return (reference_fwd(x, act, dtype=jnp.float32), reference_bwd(g, x, act, dtype=jnp.float32),
                reference_fwd(x, act, dtype=E4M3, scale=2.0**120), reference_bwd(g, x, act, dtype=E5M2, scale=2.0**120))

      (y, dx, yq, dq), = run_many(ours, [(g, xa)], gpu)
      (ry, rdx, ryq, rdq), = run_many(ref, [(g, xa)], gpu)
      what = "-".join(act)
      r = np.abs(np.asarray(ry.data))
      assert np.count_nonzero((r > 0) & (r < 1e-30)) > 0, what  # results that a flushed reciprocal would make zero
      assert_hp_equal(y.data, ry.data, what=f"forward, {what}")
      assert_hp_equal(dx.data, rdx.data, what=f"backward, {what}")
      assert_fp8_equal(yq.data, ryq.data, what=f"forward FP8, {what}")
      assert_fp8_equal(dq.data, rdq.data, what=f"backward FP8, {what}")
      assert_f32_equal(yq.amax, ryq.amax, what=f"forward amax, {what}")
      assert_f32_equal(dq.amax, rdq.amax, what=f"backward amax, {what}")


@pytest.mark.gpu
def test_gpu_special_values(gpu):
  v = special_values()
  for act in ACT_TYPES:
    x = np.stack([v, v[::-1]], axis=-2)[None] if len(act) == 2 else v[None]
    out = run_many(lambda x: activation_fwd(x, act, dtype=jnp.float32), [(x,)], gpu, "te_act_fwd_cuda")[0]
    ref = run_many(lambda x: reference_fwd(x, act, dtype=jnp.float32), [(x,)], gpu)[0]
    assert_hp_equal(out.data, ref.data, what=str(act))

