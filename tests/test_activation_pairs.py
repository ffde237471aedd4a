"""The activation forms beyond ``(act,)`` and ``(act, "linear")``: ``sigmoid`` (alone and as GLU), the bilinear pair,
the pairs with both halves activated (``(act, act)``) and the clamped SwiGLU ``("clamped_silu", "clamped_linear")``
with its ``activation_params``, as Transformer Engine's LayerNormMLP takes them.

- The reference (float32 jnp) against an independent float64 numpy formula of each half and its derivative (written
  from Transformer Engine's definitions: flax's tanh gelu, x * sigmoid(1.702 x), GPT-OSS's clamps), within a few
  float32 roundings of the terms; its gradient against ``jax.vjp`` of the same formula in jnp (jax.nn functions).
- The clamps: the gradient is zero outside the range and passes at its ends (Transformer Engine's kernels).
- The CPU handler against the reference: bitwise where the form has no ``exp`` (relu * relu, squared_relu *
  squared_relu, linear * linear), else within the bound of tests/test_activation.py, with the FP8 outputs bitwise
  ``quantize`` of its own float32 values.
- ``te_jax.activation``'s gradient; argument checks; the reversed spelling ``("linear", act)``.
- LayerNormMLP with each new pair under FP8 against the plain jnp block; TransformerLayer takes them.
- On a GPU: the CUDA handlers bitwise the reference on the same GPU, their names in the compiled HLO.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax
from conftest import assert_column_sums_close, assert_f32_equal, assert_fp8_equal, rel_error
from test_activation import (Flat, assert_close_to_reference, assert_fp8_consistent, assert_gpu_outputs_equal,
                             assert_hp_equal, input_shape, random_input, run_many, t_axes)
from te_jax._core import native
from te_jax.ops.activation import (ACTIVATION_TYPES, ActivationConfig, activation_bwd, activation_bwd_ref,
                                   activation_fwd, activation_fwd_ref, normalize_activation_type,
                                   parse_activation_type)
from te_jax.recipe import Float8CurrentScaling

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
CPU = jax.devices("cpu")[0]
CLAMPED = ("clamped_silu", "clamped_linear")
NEW_TYPES = [("sigmoid",), ("sigmoid", "linear"), ("linear", "linear"), ("gelu", "gelu"), ("relu", "relu"),
             ("silu", "silu"), ("quick_gelu", "quick_gelu"), ("squared_relu", "squared_relu"),
             ("sigmoid", "sigmoid"), CLAMPED]
# Clamped SwiGLU with Transformer Engine's defaults, and with parameters that clamp the inputs here often.
CASES = [(a, None) for a in NEW_TYPES] + [(CLAMPED, {"limit": 1.5, "alpha": 1.2, "glu_linear_offset": 0.5})]
CASE_IDS = ["-".join(a) + ("-params" if p else "") for a, p in CASES]
EXACT_ON_CPU = {("relu", "relu"), ("squared_relu", "squared_relu"), ("linear", "linear")}  # no exp
IN_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
SHAPES = [(1, 1), (5, 7), (13, 31), (16, 16), (33, 130), (2, 3, 9), (2, 1, 9, 24)]
DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}

cases = pytest.mark.parametrize("act,params", CASES, ids=CASE_IDS)


def _p(params) -> dict:
  """The parameters the op uses: the given ones over Transformer Engine's defaults, rounded to float32."""
  return {k: float(np.float32(v)) for k, v in {**DEFAULTS, **(params or {})}.items()}


def config(act, params=None, *, dtype, transpose=False, x_ndim=2, dbias=False) -> ActivationConfig:
  gated = len(act) == 2
  p = _p(params)
  return ActivationConfig(activation=act[0], gated=gated, out_dtype=jnp.dtype(dtype), transpose=transpose,
                          batch_ndim=x_ndim - (3 if gated else 2) if transpose else 0, dbias=dbias,
                          gate=act[1] if gated else "linear", limit=p["limit"], alpha=p["alpha"],
                          glu_linear_offset=p["glu_linear_offset"])


def reference_fwd(x, act, params=None, *, dtype, scale=None, transpose=False) -> Flat:
  c = config(act, params, dtype=dtype, transpose=transpose, x_ndim=x.ndim)
  outs = list(activation_fwd_ref(x, jnp.float32(1.0 if scale is None else scale), config=c))
  return Flat(outs[0], outs[1] if c.fp8 and transpose else None, outs[-1] if c.fp8 else None, None)


def reference_bwd(g, x, act, params=None, *, dtype, scale=None, transpose=False, dbias=False) -> Flat:
  c = config(act, params, dtype=dtype, transpose=transpose, x_ndim=x.ndim, dbias=dbias)
  outs = list(activation_bwd_ref(g, x, jnp.float32(1.0 if scale is None else scale), config=c))
  data = outs.pop(0)
  data_t = outs.pop(0) if c.fp8 and transpose else None
  amax = outs.pop(0) if c.fp8 else None
  return Flat(data, data_t, amax, outs.pop(0) if dbias else None)


# ---- the independent formulas --------------------------------------------------------------------------------------


def np_half(name: str, x: np.ndarray, params=None) -> tuple[np.ndarray, np.ndarray]:
  """A half's function and its derivative in float64, from their definitions (tanh gelu, as flax's)."""
  p = _p(params)
  lim, alpha, off = p["limit"], p["alpha"], p["glu_linear_offset"]
  x = x.astype(np.float64)

  def sig(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # = 1 / (1 + exp(-z)), without overflow

  if name == "gelu":
    k = np.sqrt(2.0 / np.pi)
    t = np.tanh(k * (x + 0.044715 * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
  if name in ("silu", "quick_gelu"):
    a = 1.0 if name == "silu" else 1.702
    s = sig(a * x)
    return x * s, s + a * x * s * (1 - s)
  if name == "sigmoid":
    s = sig(x)
    return s, s * (1 - s)
  if name == "relu":
    return np.maximum(x, 0), (x > 0).astype(np.float64)
  if name == "squared_relu":
    return np.maximum(x, 0) ** 2, 2 * np.maximum(x, 0)
  if name == "linear":
    return x, np.ones_like(x)
  if name == "clamped_silu":
    c = np.minimum(x, lim)
    s = sig(alpha * c)
    return c * s, np.where(x <= lim, s + alpha * c * s * (1 - s), 0.0)
  assert name == "clamped_linear"
  return np.clip(x, -lim, lim) + off, (np.abs(x) <= lim).astype(np.float64)


def np_forward(x, act, params=None):
  if len(act) == 1:
    return np_half(act[0], x, params)[0]
  return np_half(act[0], x[..., 0, :], params)[0] * np_half(act[1], x[..., 1, :], params)[0]


def np_backward(g, x, act, params=None):
  g = g.astype(np.float64)
  if len(act) == 1:
    return g * np_half(act[0], x, params)[1]
  (fa, da), (fb, db) = np_half(act[0], x[..., 0, :], params), np_half(act[1], x[..., 1, :], params)
  return np.stack([g * fb * da, g * fa * db], axis=-2)


def jnp_half(name: str, x, params=None):
  """The same halves in jnp with jax.nn's functions: what jax.grad differentiates."""
  p = _p(params)
  fns = {"gelu": lambda v: jax.nn.gelu(v, approximate=True), "silu": jax.nn.silu, "relu": jax.nn.relu,
         "quick_gelu": lambda v: v * jax.nn.sigmoid(1.702 * v), "squared_relu": lambda v: jax.nn.relu(v) ** 2,
         "sigmoid": jax.nn.sigmoid, "linear": lambda v: v,
         "clamped_silu": lambda v: jnp.minimum(v, p["limit"]) * jax.nn.sigmoid(p["alpha"] * jnp.minimum(v, p["limit"])),
         "clamped_linear": lambda v: jnp.clip(v, -p["limit"], p["limit"]) + p["glu_linear_offset"]}
  return fns[name](x)


def jnp_formula(act, params=None):
  if len(act) == 1:
    return lambda x: jnp_half(act[0], x, params)
  return lambda x: jnp_half(act[0], x[..., 0, :], params) * jnp_half(act[1], x[..., 1, :], params)


def fwd_terms(x, act, params=None):
  """The magnitudes a float32 evaluation of the forward rounds: |x|, or |a| |h(b)| + |b| |f(a)| for a pair."""
  xf = np.abs(x.astype(np.float64))
  if len(act) == 1:
    return xf
  a, b = x[..., 0, :], x[..., 1, :]
  with np.errstate(invalid="ignore"):  # inf * 0 where an input is infinite: no bound there (NaN and inf are checked)
    t = np.abs(a) * np.abs(np_half(act[1], b, params)[0]) + np.abs(b) * np.abs(np_half(act[0], a, params)[0])
  return np.nan_to_num(t, nan=np.inf)


def bwd_terms(g, x, act, params=None):
  gf, xf = np.abs(g.astype(np.float64)), x.astype(np.float64)
  if len(act) == 1:
    return gf * (1 + np.abs(xf)) * (1 + xf * xf)
  a, b = xf[..., 0, :], xf[..., 1, :]
  fa, fb = np.abs(np_half(act[0], a, params)[0]), np.abs(np_half(act[1], b, params)[0])
  return np.stack([gf * (fb + np.abs(b)) * (1 + np.abs(a)) * (1 + a * a),
                   gf * (fa + np.abs(a)) * (1 + np.abs(b)) * (1 + b * b)], axis=-2)


# ---- the reference --------------------------------------------------------------------------------------------------


@cases
@pytest.mark.fast_cases(4)
def test_reference_matches_numpy(act, params):
  """Forward and backward of the float32 reference against float64 numpy, within 2^-17 of the terms each rounds (a
  wrong constant, clamp or half is off by 1e-3 or more)."""
  x = random_input(input_shape((64, 48), act), np.float32, seed=5, spread=3.0)
  g = random_input((64, 48), np.float32, seed=6, spread=1.0)
  with np.errstate(over="ignore"):
    y = reference_fwd(jnp.asarray(x), act, params, dtype=jnp.float32).data
    assert_close_to_reference(y, np_forward(x, act, params), fwd_terms(x, act, params), what="forward")
    dx = reference_bwd(jnp.asarray(g), jnp.asarray(x), act, params, dtype=jnp.float32).data
    assert_close_to_reference(dx, np_backward(g, x, act, params), bwd_terms(g, x, act, params), what="backward")


@cases
@pytest.mark.fast_cases(4)
def test_grad_matches_jax_grad_of_the_formula(act, params):
  """``te_jax.activation`` (the CPU handlers) and its gradient against jax.vjp of the jnp formula."""
  x = jax.device_put(random_input(input_shape((32, 40), act), np.float32, seed=7, spread=2.5), CPU)
  g = jax.device_put(random_input((32, 40), np.float32, seed=8, spread=1.0), CPU)
  y, vjp = jax.vjp(lambda x: te_jax.activation(x, act, params), x)
  y_ref, vjp_ref = jax.vjp(jnp_formula(act, params), x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(vjp(g)[0]), np.asarray(vjp_ref(g)[0]), rtol=2e-5, atol=1e-4)


def test_clamps_at_and_beyond_their_ends():
  """clamped_silu's gradient is zero above limit and passes at it; clamped_linear's is zero outside [-limit, limit]
  and passes at its ends; above limit the forward is the value at limit; NaN stays NaN. Reference and CPU handler."""
  lim = 1.5
  params = {"limit": lim, "alpha": 1.2, "glu_linear_offset": 0.5}
  a = np.array([lim - 0.25, lim, lim + 0.25, 100.0, np.nan, -3.0], np.float32)
  b = np.array([-lim - 0.25, -lim, lim, lim + 0.25, 0.5, np.nan], np.float32)
  x = np.stack([a, b])[None]
  g = np.full((1, 6), 2.0, np.float32)
  for fwd, bwd in [(lambda x: reference_fwd(x, CLAMPED, params, dtype=jnp.float32),
                    lambda g, x: reference_bwd(g, x, CLAMPED, params, dtype=jnp.float32)),
                   (lambda x: activation_fwd(x, CLAMPED, dtype=jnp.float32, activation_params=params),
                    lambda g, x: activation_bwd(g, x, CLAMPED, dtype=jnp.float32, activation_params=params))]:
    y = np.asarray(run_many(fwd, [(x,)], CPU)[0].data)[0]
    dx = np.asarray(run_many(bwd, [(g, x)], CPU)[0].data)[0]
    fa, dfa = np_half("clamped_silu", a[:4], params)
    hb = np.clip(b[:5].astype(np.float64), -lim, lim) + 0.5
    np.testing.assert_allclose(y[:4], fa * hb[:4], rtol=1e-6)
    assert y[2] == y[3] == np.float32(y[2])  # a above limit: the value at limit (b = lim there, then lim + 0.25)
    assert np.isnan(y[4]) and np.isnan(y[5])
    da, db = dx[0], dx[1]
    assert da[0] != 0 and da[1] != 0 and da[2] == 0 and da[3] == 0  # zero strictly above limit
    assert not np.signbit(da[2]) and not np.signbit(da[3])  # +0: a select
    np.testing.assert_allclose(da[:2], 2.0 * hb[:2] * dfa[:2], rtol=1e-6)
    assert db[0] == 0 and db[3] == 0  # zero outside [-limit, limit] ...
    np.testing.assert_allclose(db[1:3], 2.0 * fa[1:3], rtol=1e-6)  # ... and the gradient at its ends
    assert np.isnan(da[4])  # NaN in, NaN out


def test_reversed_and_bare_spellings():
  """``("linear", act)`` is ``(act, "linear")`` (the first half still the activated one), as Transformer Engine reverses
  it; so is the clamped pair reversed; a bare name is a 1-tuple."""
  assert normalize_activation_type(("linear", "gelu")) == ("gelu", "linear")
  assert normalize_activation_type(["clamped_linear", "clamped_silu"]) == CLAMPED
  assert normalize_activation_type("sigmoid") == ("sigmoid",)
  assert len(set(ACTIVATION_TYPES)) == len(ACTIVATION_TYPES) == 20
  x = jax.device_put(random_input((4, 2, 24), np.float32, seed=9), CPU)
  assert_hp_equal(te_jax.activation(x, ("linear", "silu")), te_jax.activation(x, ("silu", "linear")), what="reversed")
  assert parse_activation_type(("linear", "relu")) == ("relu", True)


# ---- the CPU handler -----------------------------------------------------------------------------------------------


@pytest.fixture
def cpu_handlers():
  assert native.has_target("cpu", "te_act_fwd_cpu") and native.has_target("cpu", "te_act_bwd_cpu"), \
      native.load_errors


def _inputs(act, dtype, seed):
  xs = [random_input(input_shape(s, act), dtype, seed=seed + i) for i, s in enumerate(SHAPES)]
  gs = [random_input(s, dtype, seed=seed + 100 + i, spread=2.0) for i, s in enumerate(SHAPES)]
  return xs, gs


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "bf16", "f16"])
@cases
@pytest.mark.fast_cases(3)
def test_cpu_forward(act, params, dtype, cpu_handlers):
  """The handler to E4M3 (with the transposed copy), float32 and the input dtype, one program for every shape."""
  xs, _ = _inputs(act, dtype, seed=11)
  exact = act in EXACT_ON_CPU
  kw = dict(activation_params=params)
  outs = run_many(lambda x: (activation_fwd(x, act, dtype=E4M3, scale=0.75, transpose=True, **kw),
                             activation_fwd(x, act, dtype=jnp.float32, **kw), activation_fwd(x, act, **kw)),
                  [(x,) for x in xs], CPU, "te_act_fwd_cpu", calls=2 if dtype is np.float32 else 3)
  refs = run_many(lambda x: (reference_fwd(x, act, params, dtype=E4M3, scale=0.75, transpose=True) if exact else None,
                             reference_fwd(x, act, params, dtype=jnp.float32),
                             reference_fwd(x, act, params, dtype=dtype) if exact else None), [(x,) for x in xs], CPU)
  for x, (q, h, s), (rq, rh, rs) in zip(xs, outs, refs, strict=True):
    what = f"shape {x.shape}"
    assert_fp8_equal(q.data_t, np.transpose(np.asarray(q.data), t_axes(q.data.ndim, 1)), what="data_t")
    if exact:
      assert_fp8_equal(q.data, rq.data, what=what)
      assert_f32_equal(q.amax, rq.amax, what=f"amax, {what}")
      assert_hp_equal(h.data, rh.data, what=f"f32, {what}")
      assert_hp_equal(s.data, rs.data, what=f"{np.dtype(dtype).name}, {what}")
    else:
      assert_close_to_reference(h.data, rh.data, fwd_terms(x, act, params), what=f"f32, {what}")
      assert_hp_equal(s.data, np.asarray(h.data).astype(dtype), what=f"{np.dtype(dtype).name} = f32 cast, {what}")
  if not exact:
    assert_fp8_consistent([q for q, _, _ in outs], [h.data for _, h, _ in outs], 0.75)


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "bf16", "f16"])
@cases
@pytest.mark.fast_cases(3)
def test_cpu_backward(act, params, dtype, cpu_handlers):
  """The handler to E5M2 (transposed copy, dbias) and float32."""
  xs, gs = _inputs(act, dtype, seed=12)
  exact = act in EXACT_ON_CPU
  feature_ndim = len(act)
  kw = {"dtype": E5M2, "scale": 2.0, "transpose": True, "dbias": True}
  args = list(zip(gs, xs))
  outs = run_many(lambda g, x: (activation_bwd(g, x, act, **kw, activation_params=params),
                                activation_bwd(g, x, act, dtype=jnp.float32, dbias=True, activation_params=params)),
                  args, CPU, "te_act_bwd_cpu", calls=2)
  refs = run_many(lambda g, x: (reference_bwd(g, x, act, params, **kw) if exact else None,
                                reference_bwd(g, x, act, params, dtype=jnp.float32)), args, CPU)
  for (g, x), (q, h), (rq, rh) in zip(args, outs, refs, strict=True):
    what = f"shape {x.shape}"
    assert q.data.shape == x.shape and q.dbias.shape == x.shape[-feature_ndim:]
    assert_fp8_equal(q.data_t, np.transpose(np.asarray(q.data), t_axes(x.ndim, feature_ndim)), what="data_t")
    assert_column_sums_close(np.asarray(q.dbias).reshape(-1), np.asarray(h.data).reshape(-1, q.dbias.size))
    if exact:
      assert_fp8_equal(q.data, rq.data, what=what)
      assert_f32_equal(q.amax, rq.amax, what=f"amax, {what}")
      assert_hp_equal(h.data, rh.data, what=f"f32, {what}")
    else:
      assert_close_to_reference(h.data, rh.data, bwd_terms(g, x, act, params), what=f"f32, {what}")
  if not exact:
    assert_fp8_consistent([q for q, _ in outs], [h.data for _, h in outs], 2.0)


def _special_pair() -> np.ndarray:
  v = np.array([0.0, -0.0, 1.0, -1.0, 1e-3, 5.0, -5.0, 7.0, -7.0, 7.5, -7.5, 20.0, -20.0, 88.0, -88.0, 1e4, -1e4,
                3e38, -3e38, np.inf, -np.inf, np.nan, 1e-30], np.float32)
  return np.stack([v, v[::-1]], axis=-2)[None]  # every value meets another


@pytest.mark.parametrize("act", [a for a in NEW_TYPES if len(a) == 2], ids=lambda a: "-".join(a))
def test_cpu_special_values(act, cpu_handlers):
  """Zeros, the clamps' ends, overflow, infinities and NaN: the handler where the reference is, NaN for NaN."""
  x = _special_pair()
  n = x.shape[-1]
  g = np.resize(np.array([1.0, -2.0, 0.5, np.inf], np.float32), (1, n))
  out = run_many(lambda x: activation_fwd(x, act, dtype=jnp.float32), [(x,)], CPU, "te_act_fwd_cpu")[0]
  ref = run_many(lambda x: reference_fwd(x, act, dtype=jnp.float32), [(x,)], CPU)[0]
  dx = run_many(lambda g, x: activation_bwd(g, x, act, dtype=jnp.float32), [(g, x)], CPU, "te_act_bwd_cpu")[0]
  rdx = run_many(lambda g, x: reference_bwd(g, x, act, dtype=jnp.float32), [(g, x)], CPU)[0]
  with np.errstate(invalid="ignore", over="ignore"):
    if act in EXACT_ON_CPU:
      assert_hp_equal(out.data, ref.data, what="forward")
      assert_hp_equal(dx.data, rdx.data, what="backward")
    else:
      assert_close_to_reference(out.data, ref.data, fwd_terms(x, act), what="forward")
      np.testing.assert_array_equal(np.isnan(np.asarray(dx.data)), np.isnan(np.asarray(rdx.data)), "NaNs")
  assert np.isnan(np.asarray(out.data)[0][np.isnan(x[0]).any(axis=0)]).all()


def test_vmap_and_jit_of_a_pair():
  x = random_input((3, 5, 2, 24), np.float32, seed=13)
  params = {"limit": 2.0}
  f = jax.jit(jax.vmap(lambda x: activation_fwd(x, CLAMPED, dtype=E4M3, scale=0.5, transpose=True,
                                                activation_params=params)))
  out = f(jax.device_put(x, CPU))
  for i in range(3):  # each element as its own call
    one = activation_fwd(jax.device_put(x[i], CPU), CLAMPED, dtype=E4M3, scale=0.5, transpose=True,
                         activation_params=params)
    assert_fp8_equal(out.out.data[i], one.out.data)
    assert_fp8_equal(out.out.data_t[i], one.out.data_t, what="data_t")
    assert_f32_equal(out.amax[i], one.amax)


# ---- argument checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), ("gelu", "relu")), ValueError,
     r"^activation_type must be \(act,\), \(act, 'linear'\) or \(act, act\) .*ACTIVATION_TYPES"),
    (lambda: activation_fwd(jnp.ones((3, 4)), ("linear",)), ValueError, "^activation_type must be"),
    (lambda: activation_fwd(jnp.ones((3, 4)), ("clamped_silu",)), ValueError, "^activation_type must be"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), ("silu", "clamped_linear")), ValueError, "^activation_type must be"),
    (lambda: activation_fwd(jnp.ones((3, 4)), ("relu", "relu")), ValueError, "^x of a gated activation"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), ("silu", "linear"), activation_params={"limit": 5.0}), ValueError,
     r"^activation_params apply to activation_type=\('clamped_silu', 'clamped_linear'\) only"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), CLAMPED, activation_params={"beta": 1.0}), ValueError,
     "^activation_params: unknown key 'beta'"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), CLAMPED, activation_params={"limit": 0.0}), ValueError,
     r"^activation_params\['limit'\] must be > 0"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), CLAMPED, activation_params={"limit": float("nan")}), ValueError,
     r"^activation_params\['limit'\] must be > 0"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), CLAMPED, activation_params={"alpha": float("inf")}), ValueError,
     r"^activation_params\['alpha'\] must be finite"),
    (lambda: activation_fwd(jnp.ones((3, 2, 4)), CLAMPED, activation_params={"alpha": "1.7"}), TypeError,
     r"^activation_params\['alpha'\] must be a real number"),
    (lambda: activation_bwd(jnp.ones((3, 4)), jnp.ones((3, 2, 4)), CLAMPED, activation_params=(7.0,)), TypeError,
     "^activation_params must be a dict"),
    (lambda: te_jax.activation(jnp.ones((3, 2, 4)), ("gelu", "gelu"), {"limit": 1.0}), ValueError,
     "^activation_params apply to"),
    (lambda: parse_activation_type(("relu", "relu")), ValueError, r"^activation_type must be \(act,\) or \(act, "
     r"'linear'\) here"),
], ids=["mixed-pair", "linear-alone", "clamped-alone", "half-clamped", "pair-shape", "params-not-clamped",
        "params-key", "limit-0", "limit-nan", "alpha-inf", "alpha-str", "params-tuple", "activation-params",
        "parse-pair"])
def test_bad_arguments_raise_before_xla(call, error, match):
  with pytest.raises(error, match=match):
    call()


# ---- modules -------------------------------------------------------------------------------------------------------


def _plain_mlp(p, x, act):
  """LayerNormMLP's block in float32 jnp with the jnp formula of the pair (flax.linen.LayerNorm's math)."""
  mean = x.mean(-1, keepdims=True)
  z = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * p["ln_scale"] + p["ln_bias"]
  h = jnp.einsum("...h,hnf->...nf", z, p["wi_kernel"]) + p["wi_bias"]
  a = jnp_formula(act)(h if len(act) == 2 else h[..., 0, :])
  return a @ p["wo_kernel"] + p["wo_bias"]


@pytest.mark.parametrize("act", NEW_TYPES, ids=lambda a: "-".join(a))
@pytest.mark.fast_cases(1)
def test_layernorm_mlp_fp8(act):
  """te_flax.LayerNormMLP with each new form under FP8 (current scaling): loss and parameter gradients within FP8's
  quantization of the float32 jnp block's (E4M3 forward, E5M2 gradients: a few percent; a wrong half or derivative
  is far more), the fused activation kernels in the compiled program. fc1's kernel is scaled by 4 so that the
  clamps (limit 7) cut."""
  model = te_flax.LayerNormMLP(intermediate_dim=128, activation_type=act, dtype=jnp.float32,
                               bias_init=nn.initializers.normal(0.1))
  x = jax.random.normal(jax.random.key(0), (4, 16, 64), jnp.float32)
  rec = Float8CurrentScaling()
  with te_jax.autocast(enabled=True, recipe=rec):
    v = model.init(jax.random.key(1), x)
  v = jax.tree_util.tree_map(lambda a: a, v)
  v["params"]["wi_kernel"] = v["params"]["wi_kernel"] * 4.0
  loss = lambda y: jnp.mean(y * y)  # noqa: E731

  def ours(v):
    return loss(model.apply(v, x))

  with te_jax.autocast(enabled=True, recipe=rec):
    step = jax.jit(jax.value_and_grad(ours))
    hlo = step.lower(v).compile().as_text()
    y, g = step(v)
  assert 'custom_call_target="te_act_fwd_cpu"' in hlo and 'custom_call_target="te_act_bwd_cpu"' in hlo
  y_ref, g_ref = jax.value_and_grad(lambda p: loss(_plain_mlp(p, x, act)))(v["params"])
  assert abs(float(y) - float(y_ref)) < 0.03 * float(y_ref), (float(y), float(y_ref))
  for name in ("wi_kernel", "wo_kernel", "wi_bias", "ln_scale"):
    # The clamps' gradients jump to zero at +-limit: fc1 outputs that E4M3's rounding of fc1's inputs moves across
    # it flip theirs, which doubles fc1's kernel gradient error (0.16 here, 0.09 for SwiGLU).
    bound = 0.25 if act == CLAMPED and name == "wi_kernel" else 0.15
    assert rel_error(g["params"][name], g_ref[name]) < bound, name
  # Without FP8 the module is the jnp block up to float32 summation order.
  y_hp, g_hp = jax.value_and_grad(ours)(v)
  assert abs(float(y_hp) - float(y_ref)) < 1e-5 * float(y_ref)
  for name in ("wi_kernel", "wo_kernel", "wi_bias", "ln_scale"):
    assert rel_error(g_hp["params"][name], g_ref[name]) < 1e-5, name
  if act == CLAMPED:
    h = jnp.einsum("...h,hnf->...nf", x, v["params"]["wi_kernel"])
    assert float(jnp.mean(jnp.abs(h) > 7.0)) > 0.01  # the clamps were reached


@pytest.mark.slow  # two module compiles
def test_transformer_layer_and_reversed_pair():
  """TransformerLayer takes a pair (pre-LN and post-LN); LayerNormMLP's ("linear", "gelu") is ("gelu", "linear")."""
  x = jax.random.normal(jax.random.key(2), (2, 8, 32), jnp.float32)
  for post in (False, True):
    layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=4,
                                     activation_type=("relu", "relu"), post_layernorm=post, dtype=jnp.float32)
    v = layer.init(jax.random.key(3), x, deterministic=True)
    y = layer.apply(v, x, deterministic=True)
    assert y.shape == x.shape and bool(jnp.isfinite(y).all())
  a = te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("linear", "gelu"), dtype=jnp.float32)
  b = te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("gelu", "linear"), dtype=jnp.float32)
  v = a.init(jax.random.key(4), x)
  assert_hp_equal(a.apply(v, x), b.apply(v, x), what="reversed pair")


def test_layernorm_mlp_rejects_a_mixed_pair():
  with pytest.raises(ValueError, match="^activation_type must be"):
    te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("gelu", "relu")).init(jax.random.key(0),
                                                                                      jnp.ones((2, 8)))


# ---- CUDA handlers on the GPU --------------------------------------------------------------------------------------

GPU_SHAPES = [(1, 1), (5, 7), (33, 130), (2, 3, 9), (200, 264), (1001, 1024), (4, 136, 128)]


def _gpu_check(act, params, dtype, shapes, gpu, fwd_fp8=E4M3, bwd_fp8=E5M2):
  """Forward to fwd_fp8 and to dtype, backward to bwd_fp8 (transposed copy, dbias) and float32: the CUDA handlers
  (their names in the HLO) bit for bit the reference on the same GPU (dbias within any summation order's bound)."""
  assert native.has_target("cuda", "te_act_fwd_cuda") and native.has_target("cuda", "te_act_bwd_cuda"), \
      native.load_errors
  feature_ndim = len(act)
  xs = [random_input(input_shape(s, act), dtype, seed=sum(s)) for s in shapes]
  gs = [random_input(s, dtype, seed=sum(s) + 1, spread=2.0) for s in shapes]
  args = list(zip(gs, xs))
  kw = dict(activation_params=params)

  def ours(g, x):
    return (activation_fwd(x, act, dtype=fwd_fp8, scale=0.75, transpose=True, **kw), activation_fwd(x, act, **kw),
            activation_bwd(g, x, act, dtype=bwd_fp8, scale=2.0, transpose=True, dbias=True, **kw),
            activation_bwd(g, x, act, dtype=jnp.float32, **kw))

  def ref(g, x):
    return (reference_fwd(x, act, params, dtype=fwd_fp8, scale=0.75, transpose=True),
            reference_fwd(x, act, params, dtype=dtype),
            reference_bwd(g, x, act, params, dtype=bwd_fp8, scale=2.0, transpose=True, dbias=True),
            reference_bwd(g, x, act, params, dtype=jnp.float32))

  run_many(lambda g, x: activation_fwd(x, act, **kw), args[:1], gpu, "te_act_fwd_cuda")
  run_many(lambda g, x: activation_bwd(g, x, act, **kw), args[:1], gpu, "te_act_bwd_cuda")
  assert_gpu_outputs_equal(act, dtype, feature_ndim, args, run_many(ours, args, gpu), run_many(ref, args, gpu))


@pytest.mark.gpu
@cases
def test_gpu_matches_reference(act, params, gpu):
  _gpu_check(act, params, ml_dtypes.bfloat16, GPU_SHAPES, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("act,params", [(("gelu", "gelu"), None), CASES[-1]], ids=["gelu-gelu", "clamped-params"])
def test_gpu_other_dtypes_and_formats(act, params, dtype, gpu):
  _gpu_check(act, params, dtype, [(256, 384), (200, 264), (3, 128, 256), (2048, 3072)], gpu, fwd_fp8=E5M2,
             bwd_fp8=E4M3)


@pytest.mark.gpu
def test_gpu_special_values(gpu):
  x = _special_pair()
  g = np.resize(np.array([1.0, -2.0, 0.5, np.inf], np.float32), (1, x.shape[-1]))
  for act in [a for a in NEW_TYPES if len(a) == 2]:
    out = run_many(lambda x: activation_fwd(x, act, dtype=jnp.float32), [(x,)], gpu, "te_act_fwd_cuda")[0]
    ref = run_many(lambda x: reference_fwd(x, act, dtype=jnp.float32), [(x,)], gpu)[0]
    dx = run_many(lambda g, x: activation_bwd(g, x, act, dtype=jnp.float32), [(g, x)], gpu, "te_act_bwd_cuda")[0]
    rdx = run_many(lambda g, x: reference_bwd(g, x, act, dtype=jnp.float32), [(g, x)], gpu)[0]
    assert_hp_equal(out.data, ref.data, what=f"forward {act}")
    assert_hp_equal(dx.data, rdx.data, what=f"backward {act}")


@pytest.mark.gpu
@pytest.mark.parametrize("act", [("gelu", "gelu"), CLAMPED], ids=["gelu-gelu", "clamped"])
def test_gpu_layernorm_mlp_runs_the_cuda_kernels(act, gpu):
  """The FP8 LayerNormMLP on the GPU runs the CUDA activation handlers, its loss within FP8's error of the jnp block."""
  model = te_flax.LayerNormMLP(intermediate_dim=256, activation_type=act, dtype=jnp.bfloat16)
  x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 64, 128), jnp.float32), gpu)
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
    v = model.init(jax.random.key(1), x)
    step = jax.jit(jax.value_and_grad(lambda v: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)))
    hlo = step.lower(v).compile().as_text()
    y, _ = step(v)
  assert 'custom_call_target="te_act_fwd_cuda"' in hlo and 'custom_call_target="te_act_bwd_cuda"' in hlo
  y_ref = jnp.mean(_plain_mlp(jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), v["params"]), x, act) ** 2)
  assert abs(float(y) - float(y_ref)) < 0.05 * float(y_ref)
