"""te_jax.scaled_softmax / scaled_masked_softmax / scaled_upper_triang_masked_softmax and their primitives.

Tolerance (the tolerance rule of CONTRIBUTING.md, from flash-attention): the handlers compute the reference's float32
formulas in another order (reductions, exp), so they are not bitwise equal to it. Against a float64 evaluation of the
same formulas on the same inputs, a handler's largest error must be at most twice the largest error of the jnp
reference at the same precision (same input and output dtype), plus ``noise`` = 4 float32 roundings of the largest
term (the largest output for the forward; ``|scale * y| * (|dy| + sum|dy * y|)`` for the backward): the error of one
element is a matter of rounding luck (one handler 1.7 ulps off at the largest output where XLA happened to be 0.5 off,
on a 4100-element row), so the rule compares the largest errors with that margin. Masked positions (and the causal
upper triangle) must be exactly 0, and NaN positions must match.

- The reference itself against jax.nn.softmax (plain, masked with ``where``, causal) and jax.grad.
- The CPU handlers against the reference: odd row lengths, 1-element rows, rows > 4096, every dtype, masks broadcast
  along any leading dims, fully masked rows, -inf / large / NaN logits, scale factors.
- Gradients (custom_vjp) against jax.grad of the reference and check_grads; vmap; sharding on 8 CPU devices (the
  sharded op runs shard-local: no collectives in the HLO, the causal query offset of each shard applied).
- Bad arguments raise a TypeError/ValueError naming the argument, before XLA.
- On a GPU (``@pytest.mark.gpu``): the CUDA handlers against the reference on the same cases, every register-path
  configuration and the long-row path, and the HLO holds te_softmax_fwd_cuda / te_softmax_bwd_cuda.
"""

import re

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import F32_U
from te_jax._core import native
from te_jax.ops.softmax import SoftmaxConfig, softmax_bwd, softmax_bwd_ref, softmax_fwd, softmax_fwd_ref

CPU = jax.devices("cpu")[0]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
KINDS = ("plain", "masked", "causal")
# Row lengths: 1 element, odd, multiples of 8 and not, one register chunk, > 4096.
SHAPES = [(1, 1), (3, 1), (1, 7), (5, 13), (2, 3, 31), (4, 8, 64), (2, 3, 16, 130), (1, 2, 9, 9), (3, 4100)]
SCALES = [1.0, 0.125, 3.0]


# ---- helpers -------------------------------------------------------------------------------------------------------


def random_logits(shape, dtype, seed: int, spread: float = 3.0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return (spread * rng.standard_normal(shape)).astype(dtype)


def random_mask(shape, seed: int, p: float = 0.3) -> np.ndarray:
  """A bool mask (True = masked out) with about ``p`` masked, and its first row fully masked when it has rows."""
  rng = np.random.default_rng(seed)
  mask = rng.random(shape) < p
  if mask.ndim >= 2 and mask.shape[-2] > 1:
    mask.reshape(-1, shape[-1])[0] = True
  return mask


def causal_mask(shape, q_offset: int = 0) -> np.ndarray:
  i = np.arange(shape[-2])[:, None] + q_offset
  j = np.arange(shape[-1])[None, :]
  return np.broadcast_to(j > i, shape)


def fwd64(x, masked, scale: float) -> np.ndarray:
  """The forward formulas in float64 (``masked``: bool, broadcast to x's shape, True = masked out); the logit scale
  is the float32 one the kernels use, and ``scale * x`` is rounded to float32 as in every implementation."""
  z = (x.astype(np.float32) * np.float32(scale)).astype(np.float64)
  z = np.where(masked, -np.inf, z)
  with np.errstate(invalid="ignore", over="ignore"):
    m = np.max(z, axis=-1, keepdims=True)
    empty = m == -np.inf
    e = np.exp(z - np.where(empty, 0.0, m))
    return np.where(empty, 0.0, e / np.sum(e, axis=-1, keepdims=True))


def bwd64(dy, y, scale: float, above=None) -> np.ndarray:
  dy64, y64 = dy.astype(np.float64), y.astype(np.float64)
  prod = dy64 * y64 if above is None else np.where(above, 0.0, dy64 * y64)
  dx = (float(np.float32(scale)) * y64) * (dy64 - prod.sum(axis=-1, keepdims=True))
  return dx if above is None else np.where(above, 0.0, dx)


def bwd_terms(dy, y, scale: float) -> np.ndarray:
  dy64, y64 = np.abs(dy.astype(np.float64)), np.abs(y.astype(np.float64))
  return abs(float(np.float32(scale))) * y64 * (dy64 + (dy64 * y64).sum(axis=-1, keepdims=True))


def assert_within_tolerance(ours, ref32, ref64, terms, what: str, zero=None):
  """The tolerance rule (CONTRIBUTING.md): max|ours - f64| <= 2 max|ref32 - f64| + 4 u max|terms|; exact
  zeros where ``zero``; NaN positions equal."""
  ours, ref32 = np.asarray(ours), np.asarray(ref32)
  assert ours.dtype == ref32.dtype and ours.shape == ref32.shape, (what, ours.dtype, ours.shape, ref32.shape)
  o, r = ours.astype(np.float64), ref32.astype(np.float64)
  nan = np.isnan(ref64)
  np.testing.assert_array_equal(np.isnan(o), nan, err_msg=f"{what}: NaN positions")
  np.testing.assert_array_equal(np.isnan(r), nan, err_msg=f"{what}: NaN positions of the reference")
  if zero is not None:
    assert np.all(o[zero & ~nan] == 0.0), f"{what}: masked positions must be exactly 0"
  ok = ~nan
  if not ok.any():
    return
  err, err_ref = np.abs(o - ref64)[ok].max(), np.abs(r - ref64)[ok].max()
  noise = 4 * F32_U * np.max(np.where(ok & np.isfinite(terms), terms, 0.0))
  assert err <= 2 * err_ref + noise, f"{what}: error {err} > 2 * {err_ref} (reference) + {noise}"


def full_mask(kind, shape, mask=None):
  """The positions masked out, broadcast to ``shape``."""
  if kind == "masked":
    return np.broadcast_to(mask, shape)
  if kind == "causal":
    return causal_mask(shape)
  return np.zeros(shape, bool)


def reference(x, kind, scale, mask=None):
  masks = () if mask is None else (jnp.asarray(mask).reshape((1,) * (x.ndim - mask.ndim) + mask.shape),)
  return softmax_fwd_ref(x, jnp.int32(0), *masks, config=SoftmaxConfig(kind=kind, scale=scale))[0]


def reference_bwd(dy, y, kind, scale):
  return softmax_bwd_ref(dy, y, jnp.int32(0), config=SoftmaxConfig(kind=kind, scale=scale))[0]


def compiled_targets(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def check_case(kind, x, scale, device, target_platform, mask=None, seed=0, what=""):
  """Forward and backward of the handler on ``device`` against the reference on the same device and float64."""
  x = np.asarray(x)
  xs = jax.device_put(x, device)
  ms = None if mask is None else jax.device_put(mask, device)
  dy = random_logits(x.shape, x.dtype, seed=seed + 1, spread=1.0)
  dys = jax.device_put(dy, device)

  def ours(x, dy, *m):
    y = softmax_fwd(x, *m, kind=kind, scale_factor=scale)
    return y, softmax_bwd(dy, y, kind=kind, scale_factor=scale)

  def ref(x, dy, y, *m):  # the backward from the handler's own y (its input)
    return reference(x, kind, scale, *m), reference_bwd(dy, y, kind, scale)

  args = (xs, dys) + (() if ms is None else (ms,))
  compiled = jax.jit(ours).lower(*args).compile()  # one compile per case: GPU time goes to the kernels
  hlo = compiled.as_text()
  for direction in ("fwd", "bwd"):
    target = f"te_softmax_{direction}_{target_platform}"
    assert hlo.count(f'custom_call_target="{target}"') == 1, f"{target} not in the compiled program"
  y, dx = compiled(*args)
  ry, dx_ref = jax.jit(ref)(xs, dys, y, *args[2:])
  masked = full_mask(kind, x.shape, mask)
  y64 = fwd64(x, masked, scale)
  assert_within_tolerance(y, ry, y64, np.abs(y64), f"y, {what}", zero=masked)
  # Against float64 of the backward formula on that same y.
  y_in = np.asarray(y)
  above = causal_mask(x.shape) if kind == "causal" else None
  with np.errstate(invalid="ignore", over="ignore"):
    assert_within_tolerance(dx, dx_ref, bwd64(dy, y_in, scale, above), bwd_terms(dy, y_in, scale), f"dx, {what}",
                            zero=above)


# ---- the reference itself ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES)
def test_reference_matches_jax_nn(scale):
  x = random_logits((2, 3, 7, 33), np.float32, seed=1)
  mask = random_mask((2, 1, 7, 33), seed=2)
  xs = jnp.asarray(x)
  plain = jax.nn.softmax(xs * np.float32(scale), axis=-1)
  np.testing.assert_allclose(reference(xs, "plain", scale), plain, rtol=1e-6, atol=1e-7)
  full = np.broadcast_to(mask, x.shape)
  rows = ~full.all(axis=-1)  # jax.nn.softmax has no defined value on a fully masked row
  masked = jax.nn.softmax(xs * np.float32(scale), axis=-1, where=~full)
  ours = np.asarray(reference(xs, "masked", scale, mask))
  np.testing.assert_allclose(ours[rows], np.where(full, 0.0, masked)[rows], rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(ours[~rows], 0.0)
  causal = jax.nn.softmax(xs * np.float32(scale), axis=-1, where=~causal_mask(x.shape))
  np.testing.assert_allclose(reference(xs, "causal", scale), np.where(causal_mask(x.shape), 0.0, causal), rtol=1e-6,
                             atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_backward_is_the_gradient(kind):
  """The backward formula against jax.vjp of the forward reference (float32, 1e-5 relative)."""
  x = jnp.asarray(random_logits((3, 5, 17), np.float32, seed=3))
  dy = jnp.asarray(random_logits((3, 5, 17), np.float32, seed=4, spread=1.0))
  mask = jnp.asarray(random_mask((3, 1, 17), seed=5)) if kind == "masked" else None
  y, vjp = jax.vjp(lambda x: reference(x, kind, 0.5, mask), x)
  np.testing.assert_allclose(reference_bwd(dy, y, kind, 0.5), vjp(dy)[0], rtol=1e-5, atol=1e-6)


# ---- CPU handlers vs reference -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _cpu_handlers_registered():
  """Every CPU test here means the native handlers: a silent fallback to the reference must fail, not pass."""
  assert native.has_target("cpu", "te_softmax_fwd_cpu") and native.has_target("cpu", "te_softmax_bwd_cpu"), \
      native.load_errors


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["plain", "causal"])
@pytest.mark.fast_cases(2)
def test_cpu_plain_and_causal(kind, dtype):
  for i, shape in enumerate(SHAPES):
    scale = SCALES[i % len(SCALES)]
    check_case(kind, random_logits(shape, dtype, seed=10 + i), scale, CPU, "cpu", seed=i, what=f"{kind} {shape}")


# (logits shape, mask shape): every broadcast pattern, lower-rank masks, and a full mask.
MASK_CASES = [
    ((2, 3, 5, 12), (2, 1, 5, 12)),
    ((2, 3, 5, 12), (2, 3, 5, 12)),
    ((2, 3, 5, 12), (1, 1, 1, 12)),
    ((2, 3, 5, 12), (2, 1, 1, 12)),
    ((2, 3, 5, 12), (1, 3, 1, 12)),
    ((2, 3, 5, 12), (5, 12)),
    ((2, 3, 5, 12), (12,)),
    ((4, 7, 33), (4, 1, 33)),
    ((3, 4100), (3, 4100)),
    ((2, 1, 6, 9), (1, 1, 6, 9)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,mask_shape", MASK_CASES, ids=str)
@pytest.mark.fast_cases(6)
def test_cpu_masked(shape, mask_shape, dtype):
  x = random_logits(shape, dtype, seed=sum(shape))
  mask = random_mask(mask_shape, seed=sum(mask_shape))
  check_case("masked", x, 0.25, CPU, "cpu", mask=mask, seed=3, what=f"mask {mask_shape}")


def special_logits(dtype) -> tuple[np.ndarray, np.ndarray]:
  """Rows of -inf, large, tiny and NaN logits, and the mask of the masked case (True = masked out)."""
  big = float(ml_dtypes.finfo(dtype).max) / 2
  rows = [
      [0.0, -np.inf, 1.0, -np.inf, 2.0, 0.5, -1.0, 3.0],    # some -inf
      [-np.inf] * 8,                                         # all -inf: zeros
      [big, big, -big, 0.0, 1.0, big, -1.0, 2.0],            # large: exact ties at the max
      [1e-6, -1e-6, 0.0, 0.0, 1e-3, -1e-3, 2e-6, 0.0],       # nearly uniform
      [np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],           # NaN in the (unmasked) first key: NaN row
      [1.0, np.nan, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],           # NaN in a key the mask hides: a normal row
      [np.inf, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],           # +inf: NaN row (as jax.nn.softmax)
      [30.0, -30.0, 60.0, -60.0, 10.0, 0.0, 0.0, 80.0],      # exp underflow of the others
  ]
  mask = np.zeros((len(rows), 8), bool)
  mask[1, 0] = True
  mask[3] = True                                             # fully masked: zeros
  mask[5, 1] = True
  return np.array(rows, np.float32).astype(dtype), mask


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_special_values(kind, dtype):
  x, mask = special_logits(dtype)
  with np.errstate(invalid="ignore", over="ignore"):
    check_case(kind, x, 1.0, CPU, "cpu", mask=mask if kind == "masked" else None, what=f"special {kind}")
  y = np.asarray(te_jax.scaled_softmax(jax.device_put(x, CPU))).astype(np.float32)
  np.testing.assert_array_equal(y[1], 0.0)  # all -inf: zeros, not NaN
  assert np.isnan(y[4]).all() and np.isnan(y[6]).all()
  ym = np.asarray(te_jax.scaled_masked_softmax(jax.device_put(x, CPU), mask)).astype(np.float32)
  np.testing.assert_array_equal(ym[3], 0.0)  # fully masked: zeros, not uniform
  assert np.isfinite(ym[5]).all() and ym[5, 1] == 0.0  # a masked NaN is 0


def test_cpu_scale_overflow_gives_nan_row():
  x = np.array([[3e38, 1.0, 0.0], [1.0, 2.0, 3.0]], np.float32)
  y = np.asarray(te_jax.scaled_softmax(jax.device_put(x, CPU), scale_factor=2.0))
  assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("shape", [(2, 2, 9, 130), (3, 4100)], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_logit_makes_the_whole_row_nan(kind, shape):
  """A NaN logit in a key no mask hides (key 0, which the causal mask never hides) makes its whole row NaN, masked
  positions included, through the CPU handler and the jitted reference alike: the formulas' max is NaN. XLA:CPU's max
  reduction alone dropped the NaN in the masked and causal references of these shapes (rows came out NaN at key 0
  only)."""
  x = random_logits(shape, np.float32, seed=5)
  x[..., 0] = np.nan
  x[..., 1::2] = -np.inf
  mask = random_mask(shape, seed=6)
  mask[..., 0] = False
  masks = (mask,) if kind == "masked" else ()
  ours = jax.jit(lambda x, *m: softmax_fwd(x, *m, kind=kind))(jax.device_put(x, CPU), *masks)
  ref = jax.jit(lambda x, *m: reference(x, kind, 1.0, *m))(jax.device_put(x, CPU), *masks)
  for name, y in (("handler", ours), ("reference", ref)):
    assert np.isnan(np.asarray(y)).all(), (name, int((~np.isnan(np.asarray(y)).all(-1)).sum()), "rows not all NaN")


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3)], ids=str)
def test_cpu_empty(shape):
  x = jnp.zeros(shape, jnp.float32)
  y = te_jax.scaled_upper_triang_masked_softmax(x)
  assert y.shape == shape
  assert jax.grad(lambda x: te_jax.scaled_softmax(x).sum())(x).shape == shape


# ---- gradients, jit, vmap ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_matches_reference_grad(kind, dtype):
  x = jax.device_put(random_logits((2, 3, 6, 20), dtype, seed=6), CPU)
  w = jax.device_put(random_logits((2, 3, 6, 20), np.float32, seed=7, spread=1.0), CPU)
  mask = jax.device_put(random_mask((2, 1, 6, 20), seed=8), CPU)
  public = {"plain": lambda x: te_jax.scaled_softmax(x, 0.5),
            "masked": lambda x: te_jax.scaled_masked_softmax(x, mask, 0.5),
            "causal": lambda x: te_jax.scaled_upper_triang_masked_softmax(x, 0.5)}[kind]
  ref = lambda x: reference(x, kind, 0.5, mask if kind == "masked" else None)  # noqa: E731

  def loss(f):
    return lambda x: jnp.sum(f(x).astype(jnp.float32) * w)

  g = jax.jit(jax.grad(loss(public)))(x)
  rg = jax.jit(jax.grad(loss(ref)))(x)
  assert g.dtype == x.dtype and g.shape == x.shape
  tol = {np.float32: 1e-5, ml_dtypes.bfloat16: 2e-2, np.float16: 2e-3}[dtype]
  np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(rg, np.float32), rtol=tol, atol=tol)
  hlo = compiled_targets(jax.grad(loss(public)), x)
  assert 'custom_call_target="te_softmax_bwd_cpu"' in hlo
  masked = full_mask(kind, x.shape, np.asarray(mask))
  np.testing.assert_array_equal(np.asarray(g, np.float32)[masked], 0.0)  # no gradient through masked keys


@pytest.mark.parametrize("kind", KINDS)
def test_check_grads(kind):
  x = jax.device_put(random_logits((2, 4, 5), np.float32, seed=9, spread=1.0), CPU)
  mask = jax.device_put(random_mask((2, 4, 5), seed=10, p=0.25), CPU)
  f = {"plain": lambda x: te_jax.scaled_softmax(x, 1.5),
       "masked": lambda x: te_jax.scaled_masked_softmax(x, mask, 1.5),
       "causal": lambda x: te_jax.scaled_upper_triang_masked_softmax(x, 1.5)}[kind]
  jax.test_util.check_grads(f, (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_fully_masked_row_has_zero_gradient():
  x = jax.device_put(random_logits((2, 4, 6), np.float32, seed=11), CPU)
  mask = np.zeros((2, 4, 6), bool)
  mask[0, 1] = True
  g = jax.grad(lambda x: jnp.sum(te_jax.scaled_masked_softmax(x, mask) * jnp.arange(6.0)))(x)
  np.testing.assert_array_equal(np.asarray(g)[0, 1], 0.0)
  assert np.isfinite(np.asarray(g)).all()


def test_mask_gets_no_gradient():
  x = jnp.ones((2, 3), jnp.float32)
  mask = jnp.array([[False, True, False], [True, True, True]])
  _, vjp = jax.vjp(te_jax.scaled_masked_softmax, x, mask)
  dx, dmask = vjp(jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], jnp.float32))
  assert dmask.dtype == jax.dtypes.float0
  # y = (1/2, 0, 1/2) and a fully masked row of zeros: dx = y * (dy - sum(dy * y)), exact in float32.
  np.testing.assert_array_equal(np.asarray(dx), [[-0.5, 0.0, 0.5], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("kind", KINDS)
def test_vmap(kind):
  x = random_logits((3, 2, 5, 9), np.float32, seed=12)
  mask = random_mask((2, 1, 9), seed=13)
  batched_mask = random_mask((3, 2, 5, 9), seed=14)
  fn = {"plain": lambda x, m: te_jax.scaled_softmax(x, 2.0),
        "masked": lambda x, m: te_jax.scaled_masked_softmax(x, m, 2.0),
        "causal": lambda x, m: te_jax.scaled_upper_triang_masked_softmax(x, 2.0)}[kind]
  cases = [(x, mask, (0, None)), (np.moveaxis(x, 0, 2), mask, (2, None)), (x, batched_mask, (0, 0)),
           (x[0], batched_mask, (None, 0))]
  for xs, ms, axes in cases:
    out = jax.jit(jax.vmap(fn, in_axes=axes))(jax.device_put(xs, CPU), jax.device_put(ms, CPU))
    for i in range(3):
      xi = xs[i] if axes[0] == 0 else xs if axes[0] is None else np.moveaxis(xs, axes[0], 0)[i]
      mi = ms if axes[1] is None else ms[i]
      want = fn(jax.device_put(xi, CPU), jax.device_put(mi, CPU))
      np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(want), err_msg=f"{kind} {axes} element {i}")
  g = jax.vmap(jax.grad(lambda x: jnp.sum(fn(x, mask) ** 2)))(jax.device_put(x, CPU))
  for i in range(3):
    want = jax.grad(lambda x: jnp.sum(fn(x, mask) ** 2))(jax.device_put(x[i], CPU))
    np.testing.assert_allclose(np.asarray(g[i]), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_scale_factor_is_static_under_jit():
  x = jax.device_put(random_logits((4, 8), np.float32, seed=15), CPU)
  f = jax.jit(te_jax.scaled_softmax, static_argnums=1)
  np.testing.assert_array_equal(np.asarray(f(x, 0.5)), np.asarray(te_jax.scaled_softmax(x, 0.5)))


# ---- argument checks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((2, 3)), jnp.zeros((2, 3), jnp.int32)), TypeError,
     "^mask must be a bool"),
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((2, 3)), jnp.zeros((2, 3), jnp.float32)), TypeError,
     "^mask must be a bool"),
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((2, 3, 4)), jnp.zeros((3, 3, 4), bool)), ValueError,
     "^mask of shape"),
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((2, 3, 4)), jnp.zeros((2, 3, 1), bool)), ValueError,
     "^mask of shape"),
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((3, 4)), jnp.zeros((1, 3, 4), bool)), ValueError,
     "^mask of shape"),
    (lambda: te_jax.scaled_softmax(jnp.ones((2, 3), jnp.int32)), TypeError, "^logits must be float32"),
    (lambda: te_jax.scaled_upper_triang_masked_softmax(jnp.ones((2, 3), jnp.float8_e4m3fn)), TypeError,
     "^logits must be float32"),
    (lambda: te_jax.scaled_softmax(jnp.ones((5,))), ValueError, r"^logits must have rank >= 2"),
    (lambda: te_jax.scaled_masked_softmax(jnp.ones((5,)), jnp.zeros((5,), bool)), ValueError,
     r"^logits must have rank >= 2"),
    (lambda: te_jax.scaled_softmax(jnp.ones((2, 3)), scale_factor=jnp.float32(2.0)), TypeError,
     "^scale_factor must be a static Python float"),
    (lambda: te_jax.scaled_softmax(jnp.ones((2, 3)), scale_factor=float("inf")), ValueError,
     "^scale_factor must be finite"),
    (lambda: softmax_fwd(jnp.ones((2, 3)), kind="causal_bottom_right"), ValueError, "^kind must be one of"),
    (lambda: softmax_fwd(jnp.ones((2, 3)), kind="masked"), ValueError, "^mask is required"),
    (lambda: softmax_fwd(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), kind="plain"), ValueError,
     "^mask is only taken by kind='masked'"),
    (lambda: softmax_bwd(jnp.ones((2, 4)), jnp.ones((2, 3)), kind="plain"), ValueError, "^dy must have y's shape"),
    (lambda: softmax_bwd(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((2, 3)), kind="plain"), ValueError,
     "^dy must have y's shape"),
], ids=["int-mask", "float-mask", "mask-dim", "mask-last-dim", "mask-rank", "int-logits", "fp8-logits", "rank-1",
        "masked-rank-1", "traced-scale", "inf-scale", "op-kind", "op-no-mask", "op-mask-not-masked", "op-dy-shape",
        "op-dy-dtype"])
def test_bad_arguments_raise_before_xla(call, error, match):
  with pytest.raises(error, match=match):
    call()
  with pytest.raises(error, match=match):  # under jit: at trace time, with the same message
    jax.jit(call)()


def test_traced_scale_factor_raises():
  with pytest.raises(TypeError, match="^scale_factor must be a static Python float"):
    jax.jit(te_jax.scaled_softmax)(jnp.ones((2, 3)), 0.5)


# ---- sharding on 8 CPU devices -------------------------------------------------------------------------------------

_COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(")


@pytest.mark.parametrize("kind,spec,mask_shape", [
    ("plain", P("a", "b", None, None), None),
    ("masked", P("a", "b", None, None), (4, 1, 8, 24)),   # heads sharded, the mask broadcast along them
    ("masked", P(None, "a", "b", None), (4, 4, 8, 24)),   # heads and queries sharded, the mask with them
    ("causal", P(None, None, ("a", "b"), None), None),    # queries sharded 8 ways: each shard's query offset
    ("causal", P("a", None, "b", None), None),
], ids=["plain", "masked-heads", "masked-queries", "causal-queries", "causal-batch+queries"])
def test_sharded_equals_unsharded(kind, spec, mask_shape):
  mesh = Mesh(np.array(jax.devices("cpu")).reshape(4, 2), ("a", "b"))
  shape = (4, 4, 8, 24)
  x = random_logits(shape, np.float32, seed=16)
  dy = random_logits(shape, np.float32, seed=17, spread=1.0)
  mask = random_mask(mask_shape, seed=18) if mask_shape else None

  def f(x, dy, *m):
    fn = {"plain": lambda x: te_jax.scaled_softmax(x, 0.5),
          "masked": lambda x: te_jax.scaled_masked_softmax(x, m[0], 0.5),
          "causal": lambda x: te_jax.scaled_upper_triang_masked_softmax(x, 0.5)}[kind]
    y, vjp = jax.vjp(fn, x)
    return y, vjp(dy)[0]

  sharding = NamedSharding(mesh, spec)
  extra = ()
  if mask is not None:
    mask_spec = P(*(s if m != 1 else None for s, m in zip(spec, mask_shape)))
    extra = (jax.device_put(mask, NamedSharding(mesh, mask_spec)),)
  args = (jax.device_put(x, sharding), jax.device_put(dy, sharding), *extra)
  compiled = jax.jit(f).lower(*args).compile()
  y, dx = compiled(*args)
  ry, rdx = jax.jit(f)(*jax.device_put((x, dy) + (() if mask is None else (mask,)), CPU))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ry))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(rdx))
  assert y.sharding.is_equivalent_to(sharding, 4)
  hlo = compiled.as_text()
  assert hlo.count('custom_call_target="te_softmax_fwd_cpu"') == 1
  assert hlo.count('custom_call_target="te_softmax_bwd_cpu"') == 1
  found = _COLLECTIVES.search(hlo)
  assert not found, found.group(0)


def test_sharded_key_axis_is_gathered():
  """The softmax axis must be whole on each device: a sharded one is all-gathered (the rule asks for it
  replicated), and the result is still right."""
  mesh = Mesh(np.array(jax.devices("cpu")), ("x",))
  x = random_logits((4, 8, 16), np.float32, seed=19)
  xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "x")))
  f = jax.jit(lambda x: te_jax.scaled_upper_triang_masked_softmax(x, 0.5))
  hlo = f.lower(xs).compile().as_text()
  assert re.search(r"\ball-gather(-start)?\(", hlo)
  np.testing.assert_array_equal(np.asarray(f(xs)), np.asarray(f(jax.device_put(x, CPU))))


# ---- CUDA handlers vs reference on the GPU -------------------------------------------------------------------------

# Every register-path configuration (8..256 threads a row, 1, 2 or 4 chunks a thread), rows not a multiple of 8
# (scalar accesses), 8192 (the largest register row) and longer rows (the multi-pass path).
GPU_SHAPES = [(1, 1), (3, 1), (5, 13), (7, 64), (3, 5, 128), (2, 200), (9, 512), (4, 1000), (2, 3, 1024),
              (64, 2048), (2, 16, 2048), (5, 4100), (3, 8192), (2, 8200), (2, 20000), (2, 3, 777)]
GPU_MASK_CASES = MASK_CASES + [((2, 4, 64, 2048), (2, 1, 64, 2048)), ((2, 4, 16, 2048), (2, 1, 1, 2048)),
                               ((2, 3, 12000), (1, 3, 12000)), ((2, 2, 8, 1001), (2, 1, 8, 1001))]


def _gpu_registered():
  assert native.has_target("cuda", "te_softmax_fwd_cuda") and native.has_target("cuda", "te_softmax_bwd_cuda"), \
      native.load_errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["plain", "causal"])
def test_gpu_plain_and_causal(kind, dtype, gpu):
  _gpu_registered()
  for i, shape in enumerate(GPU_SHAPES):
    scale = SCALES[i % len(SCALES)]
    check_case(kind, random_logits(shape, dtype, seed=20 + i), scale, gpu, "cuda", seed=i, what=f"{kind} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,mask_shape", GPU_MASK_CASES, ids=str)
def test_gpu_masked(shape, mask_shape, dtype, gpu):
  _gpu_registered()
  x = random_logits(shape, dtype, seed=sum(shape))
  mask = random_mask(mask_shape, seed=sum(mask_shape))
  check_case("masked", x, 0.25, gpu, "cuda", mask=mask, seed=5, what=f"mask {mask_shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_special_values(kind, dtype, gpu):
  _gpu_registered()
  x, mask = special_logits(dtype)
  for cols in (8, 3000, 9000):  # one chunk; the register path; the long-row path
    xs = np.tile(x, (1, cols // 8))
    ms = np.tile(mask, (1, cols // 8))
    with np.errstate(invalid="ignore", over="ignore"):
      check_case(kind, xs, 1.0, gpu, "cuda", mask=ms if kind == "masked" else None, what=f"special {kind} {cols}")


@pytest.mark.gpu
def test_gpu_grad_uses_the_cuda_handlers(gpu):
  _gpu_registered()
  x = jax.device_put(random_logits((2, 4, 32, 64), ml_dtypes.bfloat16, seed=21), gpu)
  mask = jax.device_put(random_mask((2, 1, 32, 64), seed=22), gpu)
  for f in (lambda x: te_jax.scaled_softmax(x, 0.125), lambda x: te_jax.scaled_masked_softmax(x, mask, 0.125),
            lambda x: te_jax.scaled_upper_triang_masked_softmax(x, 0.125)):
    hlo = compiled_targets(jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32) ** 2)), x)
    assert 'custom_call_target="te_softmax_fwd_cuda"' in hlo and 'custom_call_target="te_softmax_bwd_cuda"' in hlo
