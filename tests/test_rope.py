"""te_jax.apply_rope / rope_frequencies and the rope_fwd / rope_bwd primitives.

- The reference against an independent formulation: complex multiplication ``(x1 + i x2) * exp(i angle)`` in
  float64 with numpy, the pairs picked by index arrays; rope_frequencies against the float64 formula.
- The CPU handler bitwise against the reference (fwd and bwd; every dtype, both layouts and pairings, R < D, odd H,
  D not a multiple of 8, per-sequence tables, special values), and bitwise against numpy float32 arithmetic (each
  product and sum rounded once): that checks the claim that neither contracts a multiply-add, independently of
  XLA. The reference needs its CPU product barrier for this: the last test here shows that without it XLA:CPU's
  fused multiply-adds would change results.
- grad against jax.grad of the reference, check_grads, no gradient for freqs; jit; vmap (x, tables or both);
  argument checks; sharding on 8 CPU devices (batch, heads and sequence sharded: no collective at all).
- On a GPU (``@pytest.mark.gpu``): the CUDA handlers bitwise against the reference compiled for the same GPU, with
  te_rope_fwd_cuda / te_rope_bwd_cuda in the compiled HLO.
"""

import doctest
import importlib
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
from conftest import assert_f32_equal
from te_jax._core import native
from te_jax.ops.rope import RopeConfig, rope_bwd, rope_bwd_ref, rope_fwd, rope_fwd_ref

CPU = jax.devices("cpu")[0]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
LAYOUTS = pytest.mark.parametrize("layout", ["BSHD", "SBHD"])
PAIRINGS = pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
# (B, S, H, D) in BSHD terms, R/2, per-sequence tables: R = D and R < D, odd H, D % 8 != 0, R % 16 != 0, one token.
CASES = [
    ((2, 5, 3, 16), 8, False),
    ((1, 7, 3, 12), 4, False),
    ((3, 4, 5, 10), 5, True),
    ((2, 3, 1, 2), 1, False),
    ((1, 33, 7, 130), 32, True),
    ((2, 1, 9, 64), 16, False),
    ((1, 1, 1, 40), 12, True),
    ((2, 6, 4, 128), 64, False),
]


# ---- helpers -------------------------------------------------------------------------------------------------------


def x_shape(case_shape, layout):
  b, s, h, d = case_shape
  return (b, s, h, d) if layout == "BSHD" else (s, b, h, d)


def random_x(shape, dtype, seed: int) -> np.ndarray:
  """Normal values scaled by 2^U(-4, 4): products and sums over many binades."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * np.exp2(rng.uniform(-4, 4, shape))).astype(dtype)


def random_freqs(b, s, half, batched: bool, seed: int) -> np.ndarray:
  """Angles of positions up to 4096 (every quadrant, and large arguments for cos/sin)."""
  rng = np.random.default_rng(seed)
  positions = rng.integers(0, 4096, (b, s) if batched else (s,))
  return np.array(te_jax.rope_frequencies(jnp.asarray(positions), 2 * half))


def tables(freqs):
  return jnp.cos(jnp.asarray(freqs)), jnp.sin(jnp.asarray(freqs))


def run_many(fn, args_list, device, targets=()):
  """``fn(*args)`` for each of ``args_list`` in one jitted program on ``device``; asserts that the compiled program
  calls each native target of ``targets`` once per element."""
  args_list = jax.device_put(args_list, device)
  compiled = jax.jit(lambda al: [fn(*a) for a in al]).lower(args_list).compile()
  for target in targets:
    assert compiled.as_text().count(f'custom_call_target="{target}"') == len(args_list), target
  return compiled(args_list)


def assert_bitwise(actual, expected, what):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, actual.shape,
                                                                             expected.dtype, expected.shape)
  assert_f32_equal(actual.astype(np.float32), expected.astype(np.float32), what=what)


def pair_index(d: int, half: int, interleaved: bool):
  """The feature indices of x1 and x2 of each pair (written from the definition, not from the reference)."""
  i = np.arange(half)
  return (2 * i, 2 * i + 1) if interleaved else (i, i + half)


def table_for_x(t, layout, shape):
  """A (S, R/2) or (B, S, R/2) numpy table broadcast to x's (.., .., H, R/2) positions."""
  if t.ndim == 2:
    t = t[None]
  t = t if layout == "BSHD" else np.swapaxes(t, 0, 1)
  return np.broadcast_to(t[:, :, None, :], shape[:3] + (t.shape[-1],))


@np.errstate(all="ignore")  # inf * 0, inf - inf: NaN, as intended
def numpy_f32_rotation(x, cos, sin, layout, interleaved, backward=False):
  """The rotation in numpy float32: every product and sum rounded once (numpy does not contract)."""
  xf = np.asarray(x).astype(np.float32)
  c = table_for_x(np.asarray(cos), layout, xf.shape)
  s = table_for_x(np.asarray(sin), layout, xf.shape)
  s = -s if backward else s
  i1, i2 = pair_index(xf.shape[-1], c.shape[-1], interleaved)
  y = xf.copy()
  x1, x2 = xf[..., i1], xf[..., i2]
  y[..., i1] = x1 * c - x2 * s
  y[..., i2] = x2 * c + x1 * s
  out = y.astype(np.asarray(x).dtype)
  rest = 2 * c.shape[-1]
  out[..., rest:] = np.asarray(x)[..., rest:]
  return out


@pytest.fixture(autouse=True)
def _cpu_handlers_registered():
  """Every CPU test here means the native handlers: a silent fallback to the reference must fail, not pass."""
  assert native.has_target("cpu", "te_rope_fwd_cpu") and native.has_target("cpu", "te_rope_bwd_cpu"), \
      native.load_errors


# ---- the reference against independent formulations ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@LAYOUTS
@PAIRINGS
@pytest.mark.fast_cases(2)
def test_reference_is_complex_rotation(dtype, layout, interleaved):
  """(x1 + i x2) * e^(i angle) in float64. Bound: the output rounding (half an ulp of x's dtype) plus float32
  arithmetic and XLA's float32 cos/sin (a few ulps) on the terms: 2^-20 (|x1| + |x2|)."""
  config = RopeConfig(layout=layout, interleaved=interleaved)
  inputs = [(random_x(x_shape(shape, layout), dtype, seed=k), random_freqs(shape[0], shape[1], half, batched, seed=k))
            for k, (shape, half, batched) in enumerate(CASES)]
  # Every case, forward and backward, in one compiled program.
  outs = run_many(lambda x, c, s: (rope_fwd_ref(x, c, s, config=config)[0], rope_bwd_ref(x, c, s, config=config)[0]),
                  [(x, *tables(freqs)) for x, freqs in inputs], CPU)
  for (shape, half, batched), (x, freqs), out in zip(CASES, inputs, outs, strict=True):
    shape_x = x.shape
    for backward in (False, True):
      y = np.asarray(out[backward])
      angle = table_for_x(freqs.astype(np.float64), layout, shape_x) * (-1 if backward else 1)
      x64 = x.astype(np.float64)
      i1, i2 = pair_index(shape_x[3], half, interleaved)
      z = (x64[..., i1] + 1j * x64[..., i2]) * np.exp(1j * angle)
      want = x64.copy()
      want[..., i1], want[..., i2] = z.real, z.imag
      terms = np.zeros_like(x64)
      terms[..., i1] = terms[..., i2] = np.abs(x64[..., i1]) + np.abs(x64[..., i2])
      bound = float(jnp.finfo(dtype).eps) / 2 * np.abs(want) + 2.0**-20 * terms
      err = np.abs(y.astype(np.float64) - want)
      worst = np.unravel_index(np.argmax(err - bound), err.shape)
      assert np.all(err <= bound), (shape_x, half, backward, worst, err[worst], bound[worst])
      np.testing.assert_array_equal(y[..., 2 * half:].view(np.uint8), x[..., 2 * half:].view(np.uint8))


def test_rope_frequencies_formula():
  angles = np.asarray(te_jax.rope_frequencies(7, 10, base=500000.0))
  want = np.arange(7)[:, None] * 500000.0 ** (-np.arange(0, 10, 2) / 10)
  assert angles.dtype == np.float32 and angles.shape == (7, 5)
  np.testing.assert_allclose(angles, want, rtol=2 * 2.0**-24, atol=0)  # the inverse wavelength, then the product
  positions = np.array([[3, 4, 5], [0, 1, 2]], np.int32)
  batched = np.asarray(te_jax.rope_frequencies(jnp.asarray(positions), 8))
  assert batched.shape == (2, 3, 4)
  np.testing.assert_array_equal(batched[1], np.asarray(te_jax.rope_frequencies(3, 8)))
  np.testing.assert_array_equal(batched[0], np.asarray(te_jax.rope_frequencies(6, 8))[3:])
  np.testing.assert_array_equal(np.asarray(te_jax.rope_frequencies(jnp.arange(3, 6), 8)), batched[0])


# ---- CPU handler vs reference ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@LAYOUTS
@PAIRINGS
@pytest.mark.fast_cases(3)
def test_cpu_matches_reference_bitwise(dtype, layout, interleaved):
  args, outs = handler_matches_reference(CASES, dtype, layout, interleaved, CPU, "cpu", seed=10)
  for (x, c, s), (y, dx) in zip(args, outs, strict=True):
    assert_bitwise(y, numpy_f32_rotation(x, c, s, layout, interleaved), what=f"fwd vs numpy {x.shape}")
    assert_bitwise(dx, numpy_f32_rotation(x, c, s, layout, interleaved, backward=True), what=f"bwd vs numpy {x.shape}")


def handler_matches_reference(cases, dtype, layout, interleaved, device, platform: str, seed: int) -> list:
  """The handler of ``platform`` on ``device``, forward and backward, bitwise against the reference run on the same
  device, for ``cases`` of ``dtype`` (the same cos/sin tables, computed once on the CPU, go to both programs);
  returns the (x, cos, sin) arguments and the handler's (y, dx) for each."""
  config = RopeConfig(layout=layout, interleaved=interleaved)
  args = []
  for k, (shape, half, batched) in enumerate(cases):
    x = random_x(x_shape(shape, layout), dtype, seed=seed + k)
    args.append((x, *tables(random_freqs(shape[0], shape[1], half, batched, seed=seed + k))))

  def ours(x, c, s):
    return (rope_fwd(x, c, s, layout=layout, interleaved=interleaved),
            rope_bwd(x, c, s, layout=layout, interleaved=interleaved))

  def ref(x, c, s):
    return rope_fwd_ref(x, c, s, config=config)[0], rope_bwd_ref(x, c, s, config=config)[0]

  outs = run_many(ours, args, device, targets=(f"te_rope_fwd_{platform}", f"te_rope_bwd_{platform}"))
  refs = run_many(ref, args, device)
  for (x, c, _), (y, dx), (ry, rdx) in zip(args, outs, refs, strict=True):
    assert_bitwise(y, ry, what=f"fwd {x.shape} R/2={c.shape[-1]}")
    assert_bitwise(dx, rdx, what=f"bwd {x.shape} R/2={c.shape[-1]}")
  return args, outs


@PAIRINGS
@np.errstate(over="ignore")  # 3e38 cast to float16: inf, as intended
def test_cpu_special_values(interleaved):
  """inf, NaN, signed zeros, the largest and tiniest values: NaN positions and every other bit as the reference."""
  specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0e38, -3.0e38, 1e-45, 1.0, -2.5], np.float32)
  rng = np.random.default_rng(5)
  x = rng.choice(specials, size=(2, 6, 3, 24)).astype(np.float32)
  freqs = random_freqs(2, 6, 12, True, seed=5)
  freqs[0, 0] = 0.0  # cos 1, sin 0: inf * 0 = NaN in the other term
  config = RopeConfig(interleaved=interleaved)
  c, s = tables(freqs)
  for dtype in DTYPES:
    xd = x.astype(dtype)
    y = rope_fwd(xd, c, s, interleaved=interleaved)
    assert_bitwise(y, jax.jit(lambda x, c, s: rope_fwd_ref(x, c, s, config=config)[0])(xd, c, s), what=str(dtype))
    # numpy keeps subnormal results, which XLA:CPU (and so the handler, on XLA's threads) flushes to zero
    normal = np.where(x == np.float32(1e-45), np.float32(1e-30), x).astype(dtype)
    assert_bitwise(rope_fwd(normal, c, s, interleaved=interleaved),
                   numpy_f32_rotation(normal, c, s, "BSHD", interleaved), what=f"{dtype} vs numpy")


def test_cpu_empty():
  c, s = tables(np.zeros((0, 4), np.float32))
  assert rope_fwd(jnp.zeros((2, 0, 3, 8), jnp.bfloat16), c, s).shape == (2, 0, 3, 8)


def test_without_the_barrier_xla_cpu_contracts():
  """Why the reference rounds its products through a barrier on the CPU: the plain formula compiled by XLA:CPU
  differs from the once-rounded float32 result (a fused multiply-add) for a good share of random inputs. If a
  future XLA stops contracting, this test fails and the barrier can go."""
  x = random_x((4, 64, 4, 32), np.float32, seed=6)
  c, s = tables(random_freqs(4, 64, 16, False, seed=6))

  def plain(x, c, s):
    x1, x2 = x[..., :16], x[..., 16:]
    c, s = c[None, :, None, :], s[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

  y = np.asarray(jax.jit(plain)(*jax.device_put((x, c, s), CPU)))
  want = numpy_f32_rotation(x, c, s, "BSHD", False)
  assert np.mean(y.view(np.uint32) != want.view(np.uint32)) > 0.01
  assert_bitwise(rope_fwd(x, c, s), want, what="handler")


# ---- grad, jit, vmap -------------------------------------------------------------------------------------------------


@LAYOUTS
@PAIRINGS
@pytest.mark.fast_cases(2)
def test_grad_matches_reference_grad(layout, interleaved):
  """jax.grad through apply_rope (the bwd handler) against jax.grad of the reference (JAX's own transpose of the
  forward formula, whose sums XLA:CPU may contract: a float32 rounding or two apart)."""
  shape = x_shape((2, 5, 3, 20), layout)
  x = jnp.asarray(random_x(shape, np.float32, seed=7))
  w = jnp.asarray(random_x(shape, np.float32, seed=8))
  freqs = jnp.asarray(random_freqs(2, 5, 8, True, seed=7))
  config = RopeConfig(layout=layout, interleaved=interleaved)

  def ours(x, f):
    return jnp.sum(te_jax.apply_rope(x, f, layout=layout, interleaved=interleaved) * w)

  def ref(x, f):
    return jnp.sum(rope_fwd_ref(x, jnp.cos(f), jnp.sin(f), config=config)[0] * w)

  dx, dfreqs = jax.grad(ours, argnums=(0, 1))(x, freqs)
  rdx = jax.grad(ref)(x, freqs)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), rtol=0, atol=2.0**-21 * float(jnp.max(jnp.abs(w))))
  np.testing.assert_array_equal(np.asarray(dfreqs), 0.0)  # freqs are not trained
  # the gradient is the bwd handler applied to w
  assert_bitwise(dx, rope_bwd(w, jnp.cos(freqs), jnp.sin(freqs), layout=layout, interleaved=interleaved), "dx")


def test_check_grads():
  x = jnp.asarray(random_x((2, 3, 2, 12), np.float32, seed=9))
  freqs = te_jax.rope_frequencies(3, 8)
  jax.test_util.check_grads(lambda x: te_jax.apply_rope(x, freqs), (x,), order=1, modes=["rev"], atol=1e-2,
                            rtol=1e-2)


def test_bf16_grad_dtype_and_jit():
  x = jnp.asarray(random_x((2, 4, 3, 16), ml_dtypes.bfloat16, seed=11))
  freqs = te_jax.rope_frequencies(4, 16)
  y, vjp = jax.vjp(lambda x: te_jax.apply_rope(x, freqs), x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  assert vjp(y)[0].dtype == jnp.bfloat16
  assert_bitwise(jax.jit(te_jax.apply_rope)(x, freqs), y, what="jit == eager")
  # the rotation by -angle undoes the rotation, up to the bf16 roundings of y and of the result (2^-8 each, relative
  # to the pair's magnitude)
  back, x32 = np.asarray(vjp(y)[0], np.float32), np.asarray(x, np.float32)
  i1, i2 = pair_index(16, 8, False)
  magnitude = np.abs(x32[..., i1]) + np.abs(x32[..., i2])
  for i in (i1, i2):
    assert np.all(np.abs(back[..., i] - x32[..., i]) <= 2.0**-7 * magnitude)


@LAYOUTS
def test_vmap(layout):
  """Batched x with shared tables, per-example tables, and both, against one call per element."""
  shape = x_shape((2, 5, 3, 16), layout)
  xs = jnp.asarray(random_x((3,) + shape, np.float32, seed=12))
  fs = jnp.asarray(np.stack([random_freqs(2, 5, 6, False, seed=12 + i) for i in range(3)]))
  fb = jnp.asarray(random_freqs(2, 5, 6, True, seed=20))  # (B, S, R/2), shared

  def one(x, f):
    return te_jax.apply_rope(x, f, layout=layout, interleaved=True)

  cases = [
      ((0, None), (xs, fs[0]), lambda i: (xs[i], fs[0])),
      ((0, 0), (xs, fs), lambda i: (xs[i], fs[i])),
      ((None, 0), (xs[0], fs), lambda i: (xs[0], fs[i])),
      ((0, None), (xs, fb), lambda i: (xs[i], fb)),
      ((2, None), (jnp.moveaxis(xs, 0, 2), fs[0]), lambda i: (xs[i], fs[0])),
  ]

  @jax.jit
  def batched(all_args):
    """Each case's vmapped output and the gradient of sum(output^2) with respect to its first argument."""
    results = []
    for (in_axes, _, _), (a, f) in zip(cases, all_args):
      mapped = lambda a, f=f, in_axes=in_axes: jax.vmap(one, in_axes=in_axes)(a, f)  # noqa: E731
      results.append((mapped(a), jax.grad(lambda a, mapped=mapped: jnp.sum(mapped(a) ** 2))(a)))
    return results

  one_jit = jax.jit(one)
  for (in_axes, args, pick), (out, g) in zip(cases, batched([c[1] for c in cases]), strict=True):
    assert g.shape == args[0].shape
    for i in range(3):
      assert_bitwise(out[i], one_jit(*pick(i)), what=f"vmap {in_axes} element {i}")
    # The gradient of sum(y^2) is the reference's backward rotation (by -angle) of the cotangent 2y, element by
    # element; with x shared (in_axes None), the sum of those over the elements.
    per_element = [numpy_f32_rotation(2 * np.asarray(out[i]), *tables(pick(i)[1]), layout, True, backward=True)
                   for i in range(3)]
    if in_axes[0] is None:
      want = per_element[0].astype(np.float64) + per_element[1] + per_element[2]
      np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=4 * 2.0**-24 * np.abs(want).max())
    else:
      assert_bitwise(jnp.moveaxis(g, in_axes[0], 0), np.stack(per_element), what=f"grad, vmap {in_axes}")


# ---- argument checks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error,match", [
    (lambda: te_jax.rope_frequencies(8, 7), ValueError, "^rotary_dim must be a positive even int"),
    (lambda: te_jax.rope_frequencies(8, 0), ValueError, "^rotary_dim must be"),
    (lambda: te_jax.rope_frequencies(8, 8, base=0.0), ValueError, "^base must be"),
    (lambda: te_jax.rope_frequencies(jnp.arange(4.0), 8), TypeError, "^positions_or_seq_len must be an int"),
    (lambda: te_jax.rope_frequencies(jnp.zeros((1, 2, 3), jnp.int32), 8), ValueError,
     r"^positions_or_seq_len must be \(S,\)"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8)), jnp.ones((4, 5))), ValueError, "^freqs must be .* R <= 8"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8)), jnp.ones((4, 2)), layout="BHSD"), ValueError,
     "^layout must be 'BSHD' or 'SBHD'"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8)), jnp.ones((3, 2))), ValueError, r"^freqs must be \(4, R/2\)"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8)), jnp.ones((4, 2)), layout="SBHD"), ValueError,
     r"^freqs must be \(1, R/2\)"),
    (lambda: te_jax.apply_rope(jnp.ones((2, 4, 2, 8)), jnp.ones((3, 4, 2))), ValueError,
     r"^freqs must be .*\(2, 4, R/2\)"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8), jnp.int32), jnp.ones((4, 2))), TypeError,
     "^x must be float32, bfloat16 or float16, got int32"),
    (lambda: te_jax.apply_rope(jnp.ones((4, 2, 8)), jnp.ones((4, 2))), ValueError, r"^x must be \(B, S, H, D\)"),
    (lambda: te_jax.apply_rope(jnp.ones((1, 4, 2, 8)), jnp.ones((4, 2), jnp.bfloat16)), TypeError,
     "^freqs must be float32"),
    (lambda: rope_fwd(jnp.ones((1, 4, 2, 8)), jnp.ones((4, 2)), jnp.ones((4, 3))), ValueError,
     "^cos and sin must have the same shape"),
], ids=["odd-rotary-dim", "zero-rotary-dim", "base", "float-positions", "positions-rank", "R>D", "layout",
        "seq-mismatch", "sbhd-seq-mismatch", "batch-mismatch", "int-x", "x-rank", "bf16-freqs", "sin-shape"])
def test_bad_arguments_raise_before_xla(call, error, match):
  with pytest.raises(error, match=match):
    call()
  with pytest.raises(error, match=match):  # under jit: at trace time, with the same message
    jax.jit(call)()


# ---- sharding on 8 CPU devices ---------------------------------------------------------------------------------------

_COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(-start)?\(")


@pytest.mark.parametrize("layout,spec,batched", [
    ("BSHD", P("a", None, "b", None), False),   # batch and heads
    ("BSHD", P(None, "a", "b", None), False),   # sequence (tables sliced locally) and heads
    ("BSHD", P("b", "a", None, None), True),    # batch and sequence, per-sequence tables
    ("SBHD", P("a", "b", None, None), False),   # sequence and batch
    ("SBHD", P(None, "b", "a", None), True),    # batch and heads, per-sequence tables
], ids=["bshd-batch-heads", "bshd-seq-heads", "bshd-batch-seq-batched", "sbhd-seq-batch", "sbhd-batch-heads-batched"])
def test_sharded_equals_unsharded(layout, spec, batched):
  """Forward and backward shard-local: the same bits as one device, and no collective in the compiled program."""
  mesh = Mesh(np.array(jax.devices("cpu")).reshape(4, 2), ("a", "b"))
  shape = x_shape((4, 8, 8, 24), layout)
  x = random_x(shape, ml_dtypes.bfloat16, seed=13)
  w = random_x(shape, ml_dtypes.bfloat16, seed=14)
  freqs = random_freqs(4, 8, 8, batched, seed=13)

  def f(x, w, freqs):
    y, vjp = jax.vjp(lambda x: te_jax.apply_rope(x, freqs, layout=layout, interleaved=True), x)
    return y, vjp(w)[0]

  args = (jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(w, NamedSharding(mesh, spec)),
          jax.device_put(freqs, NamedSharding(mesh, P())))
  compiled = jax.jit(f).lower(*args).compile()
  y, dx = compiled(*args)
  ry, rdx = jax.jit(f)(*jax.device_put((x, w, freqs), CPU))
  assert_bitwise(y, ry, what="y")
  assert_bitwise(dx, rdx, what="dx")
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), y.sharding
  hlo = compiled.as_text()
  for target in ("te_rope_fwd_cpu", "te_rope_bwd_cpu"):
    assert hlo.count(f'custom_call_target="{target}"') == 1, target
  assert not _COLLECTIVES.search(hlo), _COLLECTIVES.search(hlo).group(0)


def test_sharded_head_dim_is_gathered_correctly():
  """D holds the pairs, so it is never split: a D-sharded x is made whole first, and the result is still right."""
  mesh = Mesh(np.array(jax.devices("cpu")), ("x",))
  x = random_x((2, 4, 3, 16), np.float32, seed=15)
  freqs = random_freqs(2, 4, 8, False, seed=15)
  sharded = jax.device_put(x, NamedSharding(mesh, P(None, None, None, "x")))
  y = jax.jit(te_jax.apply_rope)(sharded, jnp.asarray(freqs))
  assert_bitwise(y, te_jax.apply_rope(jax.device_put(x, CPU), jnp.asarray(freqs)), what="y")


# ---- CUDA handlers vs reference on the GPU ---------------------------------------------------------------------------

# The CPU cases (scalar paths: D % 8 != 0, R % 16 != 0; several tokens per block) plus vector-path shapes, one with
# more than 256 units per token (two blocks per token); the benchmark's Llama shape for bfloat16 only (one large
# case per layout and pairing is enough, and GPU time is scarce).
GPU_CASES = CASES + [((2, 512, 8, 128), 32, True), ((3, 100, 5, 72), 16, False), ((2, 64, 40, 128), 32, False)]
GPU_LARGE = [((4, 2048, 32, 128), 64, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@LAYOUTS
@PAIRINGS
def test_gpu_matches_reference_bitwise(dtype, layout, interleaved, gpu):
  assert native.has_target("cuda", "te_rope_fwd_cuda") and native.has_target("cuda", "te_rope_bwd_cuda"), \
      native.load_errors
  cases = GPU_CASES + (GPU_LARGE if dtype is ml_dtypes.bfloat16 else [])
  handler_matches_reference(cases, dtype, layout, interleaved, gpu, "cuda", seed=30)


@pytest.mark.gpu
def test_gpu_apply_rope_grad_and_specials(gpu):
  """apply_rope under jit on the GPU (cos/sin computed there), forward and backward, with special values."""
  rng = np.random.default_rng(40)
  specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.0e38, 1e-45, 1.0], np.float32)
  x = jax.device_put(rng.choice(specials, size=(2, 9, 3, 40)).astype(ml_dtypes.bfloat16), gpu)
  w = jax.device_put(random_x((2, 9, 3, 40), ml_dtypes.bfloat16, seed=41), gpu)
  freqs = jax.device_put(random_freqs(2, 9, 16, True, seed=40), gpu)
  config = RopeConfig(interleaved=False)

  def ours(x, w, f):
    y, vjp = jax.vjp(lambda x: te_jax.apply_rope(x, f), x)
    return y, vjp(w)[0]

  def ref(x, w, f):
    c, s = jnp.cos(f), jnp.sin(f)
    return rope_fwd_ref(x, c, s, config=config)[0], rope_bwd_ref(w, c, s, config=config)[0]

  compiled = jax.jit(ours).lower(x, w, freqs).compile()
  hlo = compiled.as_text()
  assert 'custom_call_target="te_rope_fwd_cuda"' in hlo and 'custom_call_target="te_rope_bwd_cuda"' in hlo
  y, dx = compiled(x, w, freqs)
  ry, rdx = jax.jit(ref)(x, w, freqs)
  assert_bitwise(y, ry, what="y")
  assert_bitwise(dx, rdx, what="dx")


# ---- docstring examples ----------------------------------------------------------------------------------------------


def test_docstring_examples():
  result = doctest.testmod(importlib.import_module("te_jax.ops.rope"))
  assert result.attempted > 0 and result.failed == 0, result
