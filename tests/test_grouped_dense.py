"""The grouped (ragged) GEMM of mixture-of-experts layers (te_jax.ops.grouped_gemm) and grouped_dense on it.

- The reference against a float64 numpy loop over the groups (tolerance rule, CONTRIBUTING.md), both forms, high
  precision, per-tensor FP8 with per-group scales and block-scaled operands; balanced, skewed and empty groups and
  sizes summing below M; a non-finite value reaching only its own group; invalid sizes (NaN traced, raising concrete).
- The primitive against the reference under jit and vmap; sharded rows on 8 CPU devices, with the collectives.
- grouped_dense under each recipe: output and gradients are the per-group GEMMs of the reference-quantized operands
  (each group's rows and each expert's kernel quantized on their own; block-scaled ones over each group padded to
  whole blocks); delayed scaling's state after a few steps is a per-group loop of te_jax.dense's; traced group sizes
  under one compilation; high precision against jax.grad of a per-group jnp loop; the arguments' errors;
- rows laid out once by permute(align=group_align(...)) and taken as they are (groups_aligned=True): bit for bit
  the values, gradients and FP8 state of grouped_dense's own padded layout, under jit; unaligned concrete sizes
  raise.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import F32_U
from te_jax import QuantizedTensor, ScalingMode, recipe
from te_jax._core import scaling
from te_jax.fused.grouped_dense import group_align, grouped_dense, grouped_fp8_meta, token_align
from te_jax.fused.linear import Fp8Config
from te_jax.fused.moe_permute import permute, unpermute
from te_jax.ops.grouped_gemm import GroupedGemmConfig, group_amax, grouped_gemm, grouped_gemm_ref
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_block import quantize_block_ref, quantize_nvfp4_ref

BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
S = ScalingMode
M, K, N, G = 48, 128, 32, 3
SIZES = {"balanced": [16, 16, 16], "skewed": [40, 3, 5], "empty": [0, 30, 18], "below": [5, 0, 20]}
_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def _normal(seed, shape, dtype=F32, scale=1.0):
  rng = np.random.default_rng(seed)
  return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _bounds(sizes):
  ends = np.cumsum(sizes)
  return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(F32)).astype(np.float64)


def assert_rule(ours, exact, base, abs_prod, k: int, what: str):
  """err(ours, f64) <= 2 * err(base, f64) + noise, noise = sqrt(K) * u * max sum|a||b| (tests/test_gemm.py's rule:
  two correct float32 accumulations in different orders may be on either side of each other)."""
  ours = np.asarray(jnp.asarray(ours).astype(F32)).astype(np.float64)
  assert ours.shape == exact.shape, (what, ours.shape, exact.shape)
  assert np.all(np.isfinite(ours)), f"{what}: non-finite output"
  err = float(np.abs(ours - exact).max(initial=0.0))
  err_base = float(np.abs(np.asarray(base, np.float64) - exact).max(initial=0.0))
  noise = math.sqrt(k) * F32_U * float(np.max(abs_prod, initial=0.0))
  assert err <= 2 * err_base + noise, f"{what}: err {err:.3g} > 2 * baseline err {err_base:.3g} + noise {noise:.3g}"


# ---- the reference and the primitive -------------------------------------------------------------------------------


def _operands(kind, ragged_contracting, seed=0):
  """(lhs, rhs, their float64 values (rhs per group), the float32 values the reference multiplies) of one kind."""
  lhs_shape, rhs_shape = ((K, M), (N, M)) if ragged_contracting else ((M, K), (G, N, K))
  a, b = _normal(seed, lhs_shape), _normal(seed + 1, rhs_shape)
  if kind == "hp-f32":
    return a, b, _f64(a), _f64(b)
  if kind == "hp-bf16":
    a, b = a.astype(BF16), b.astype(BF16)
    return a, b, _f64(a), _f64(b)
  if kind == "fp8":  # per-group scales of a spread of magnitudes
    sa, sb = jnp.asarray([0.5, 4.0, 0.125], F32), jnp.asarray([2.0, 0.25, 8.0], F32)
    qa, qb = QuantizedTensor(a.astype(E4M3), sa), QuantizedTensor(b.astype(E5M2), sb)
    return qa, qb, _f64(qa.data), _f64(qb.data)  # scales applied by the caller, per group
  mode_a, mode_b = (S.BLOCK_1X128, S.BLOCK_128X128) if kind == "block" else (S.MXFP8_1X32, S.MXFP8_1X32)
  if kind == "nvfp4":
    qa = quantize_nvfp4_ref(a)
    qb = jax.vmap(quantize_nvfp4_ref)(b) if b.ndim == 3 else quantize_nvfp4_ref(b)  # a global scale per matrix
  else:
    qa = quantize_block_ref(a, mode_a)
    qb = quantize_block_ref(b, S.BLOCK_1X128 if ragged_contracting and kind == "block" else mode_b)
  deq = lambda q: _f64(jax.vmap(lambda t: t.dequantize(BF16))(q) if q.global_scale_inv is not None and  # noqa: E731
                       q.global_scale_inv.ndim else q.dequantize(BF16))
  return qa, qb, deq(qa), deq(qb)


def _loop64(kind, ragged_contracting, a64, b64, sizes):
  """The float64 grouped GEMM, one group at a time (with per-group scales for kind "fp8"); also in float32 and the
  sums of |products|."""
  sa, sb = np.array([0.5, 4.0, 0.125]), np.array([2.0, 0.25, 8.0])
  outs = {np.float64: None, np.float32: None, "abs": None}
  for dt in outs:
    f = (lambda v: np.abs(v)) if dt == "abs" else (lambda v, dt=dt: v.astype(dt))
    if ragged_contracting:
      out = np.zeros((G, K, N), np.float64)
      for g, (lo, hi) in enumerate(_bounds(sizes)):
        ag, bg = a64[:, lo:hi], b64[:, lo:hi]
        if kind == "fp8":
          ag, bg = ag * sa[g], bg * sb[g]
        out[g] = (f(ag) @ f(bg).T).astype(np.float64)
    else:
      out = np.zeros((M, N), np.float64)
      for g, (lo, hi) in enumerate(_bounds(sizes)):
        ag, bg = a64[lo:hi], b64[g]
        if kind == "fp8":
          ag, bg = ag * sa[g], bg * sb[g]
        out[lo:hi] = (f(ag) @ f(bg).T).astype(np.float64)
    outs[dt] = out
  return outs[np.float64], outs[np.float32], outs["abs"]


KINDS = ["hp-f32", "hp-bf16", "fp8", "block", "mxfp8", "nvfp4"]


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ragged_contracting", [False, True], ids=["rows", "contracting"])
def test_reference_is_the_float64_group_loop(ragged_contracting, kind, sizes):
  lhs, rhs, a64, b64 = _operands(kind, ragged_contracting)
  out = grouped_gemm(lhs, rhs, jnp.asarray(SIZES[sizes], jnp.int32), dtype=F32,
                     ragged_contracting=ragged_contracting)
  exact, base, abs_prod = _loop64(kind, ragged_contracting, a64, b64, SIZES[sizes])
  assert_rule(out, exact, base, abs_prod, M if ragged_contracting else K, f"{kind} {sizes}")
  if not ragged_contracting:  # the rows past the groups are zeros
    np.testing.assert_array_equal(np.asarray(out)[sum(SIZES[sizes]):], 0.0)


def test_a_non_finite_value_stays_in_its_group():
  x, w = _normal(0, (M, K)), _normal(1, (G, N, K))
  sizes = jnp.asarray(SIZES["balanced"], jnp.int32)
  out = np.asarray(grouped_gemm(x, w.at[1, 0, 0].set(jnp.inf), sizes, dtype=F32))
  assert np.isfinite(out[:16]).all() and np.isfinite(out[32:]).all() and not np.isfinite(out[16:32, 0]).any()
  dw = np.asarray(grouped_gemm(x.T.at[0, 20].set(jnp.nan), x.T, sizes, dtype=F32, ragged_contracting=True))
  assert np.isfinite(dw[0]).all() and np.isfinite(dw[2]).all() and np.isnan(dw[1, 0]).all()


def test_invalid_group_sizes_raise_when_concrete_and_give_nan_when_traced():
  x, w = _normal(0, (M, K)), _normal(1, (G, N, K))
  for bad in ([-1, 10, 10], [20, 20, 20]):
    with pytest.raises(ValueError, match=r"group_sizes must be >= 0 and sum to at most the 48 grouped rows"):
      grouped_gemm(x, w, jnp.asarray(bad, jnp.int32))
    out = jax.jit(lambda s: grouped_gemm(x, w, s, dtype=F32))(jnp.asarray(bad, jnp.int32))
    assert np.isnan(np.asarray(out)).all()


def _bound(lhs, rhs, sizes, config):
  """The primitive's operands as grouped_gemm binds them, for its reference."""
  if isinstance(lhs, QuantizedTensor):
    extra = (lhs.global_scale_inv, rhs.global_scale_inv) if lhs.mode is S.NVFP4_1X16 else ()
    return (lhs.data, rhs.data, sizes, lhs.scale_inv, rhs.scale_inv, *extra)
  one = jnp.ones((), F32)
  return (lhs, rhs, sizes, one, one)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("kind", ["fp8", "hp-bf16", "block", "nvfp4"])
@pytest.mark.parametrize("ragged_contracting", [False, True], ids=["rows", "contracting"])
def test_primitive_is_the_reference_under_jit_and_vmap(ragged_contracting, kind):
  lhs, rhs, _, _ = _operands(kind, ragged_contracting)
  sizes = jnp.asarray(SIZES["skewed"], jnp.int32)
  mode = None if not isinstance(lhs, QuantizedTensor) else (lhs.mode, rhs.mode)
  config = GroupedGemmConfig(jnp.dtype(F32), ragged_contracting, *(mode or (None, None)))
  want = grouped_gemm_ref(*_bound(lhs, rhs, sizes, config), config=config)[0]
  f = jax.jit(lambda a, b, s: grouped_gemm(a, b, s, dtype=F32, ragged_contracting=ragged_contracting))
  np.testing.assert_array_equal(np.asarray(f(lhs, rhs, sizes)), np.asarray(want))
  # vmap over a batch of (lhs, rhs, sizes): each element its own grouped GEMM
  stack = lambda t: jax.tree.map(lambda v: jnp.stack([v, v]), t)  # noqa: E731
  batched_sizes = jnp.stack([sizes, jnp.asarray(SIZES["empty"], jnp.int32)])
  got = jax.jit(jax.vmap(f))(stack(lhs), stack(rhs), batched_sizes)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(f(lhs, rhs, batched_sizes[1])))


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("kind", ["fp8", "hp-f32", "block"])
def test_sharded_rows_stay_sharded(kind):
  """Rows over 'data' (and the first form's N over 'model', but not a block-scaled rhs's): the output sharded alike, the
  same values, no collective; the second form's sharded M ends in one all-reduce, its K and N shard the output
  (block-scaled operands keep M whole there: their blocks run along it)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  sizes = jnp.asarray([10, 25, 12], jnp.int32)
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))  # noqa: E731
  block = kind == "block"
  cases = [(False, (P("data", None), P(None, None if block else "model", None)), P("data", None if block else "model"),
            [])]
  if not block:
    cases.append((True, (P(None, "data"), P("model", "data")), P(None, None, "model"), ["all-reduce"]))
  for form, specs, out_spec, collectives in cases:
    lhs, rhs, _, _ = _operands(kind, form)
    if isinstance(lhs, QuantizedTensor):  # the scales shard with their rows (block) or stay whole (per group)
      lhs = dataclasses.replace(lhs, data=put(lhs.data, specs[0]),
                                scale_inv=put(lhs.scale_inv, P(specs[0][0], None) if block else P()))
      rhs = dataclasses.replace(rhs, data=put(rhs.data, specs[1]))
    else:
      lhs, rhs = put(lhs, specs[0]), put(rhs, specs[1])
    f = jax.jit(lambda a, b, s, form=form: grouped_gemm(a, b, s, dtype=F32, ragged_contracting=form))
    got = f(lhs, rhs, sizes)
    want = f(*jax.device_put((lhs, rhs), jax.devices()[0]), sizes)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), got.ndim), got.sharding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)
    assert _COLLECTIVE.findall(f.lower(lhs, rhs, sizes).compile().as_text()) == collectives, kind


def test_group_amax_is_each_groups_max():
  x = _normal(0, (M, K)).at[20, 3].set(-100.0)
  got = np.asarray(group_amax(x, jnp.asarray(SIZES["empty"], jnp.int32)))
  x64 = np.abs(_f64(x))
  np.testing.assert_array_equal(got, [0.0, x64[:30].max(), x64[30:].max()])
  assert got[1] == 100.0


# ---- grouped_dense -------------------------------------------------------------------------------------------------

# Exact references need NVFP4 without its random parts (tests/test_block_recipes.py tests those).
RECIPES = {
    "delayed": recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "nvfp4": recipe.NVFP4BlockScaling(stochastic_rounding=False, random_hadamard_transform=False),
}
# Delayed scaling's scales as a step would find them: one per group, of different magnitudes.
_DELAYED_SCALES = jnp.asarray([0.5, 8.0, 2.0], F32)


def _delayed_meta():
  meta = grouped_fp8_meta(G, 4)
  return jax.tree.map(lambda v: v if v.ndim == 2 else _DELAYED_SCALES, meta)


def _group_casts(r, name, x, w, gy, sizes):
  """Per group, the reference-quantized operands of the three GEMMs, dequantized (float32 values): x's rows and its
  transposed copy, the kernel's transposed copy and itself, the gradient's rows and its copy. Each group's rows are
  padded with zero rows to whole blocks of the token dim (its copy's blocks start at the group)."""
  fp8 = Fp8Config.of(r, x, w, None)
  align = token_align(fp8)
  fwd, bwd = fp8.fwd_dtype, fp8.bwd_dtype
  amax = te_jax.ops.quantize.amax

  @jax.jit  # one program for every group: the casts op by op took seconds
  def casts(xg, wg, gg, g):
    if name in ("delayed", "current"):
      def cast(t, dtype):
        scale = _DELAYED_SCALES[g] if name == "delayed" else scaling.compute_scale(
            amax(t), jnp.float32(1.0), scaling.fp8_max(dtype))
        return quantize(t, scale, dtype, transpose=True).out
      qx, qw, qg = cast(xg, fwd), cast(wg, fwd), cast(gg, bwd)
    elif name == "nvfp4":  # x's and the gradient's global scales are the whole tensor's
      qx = quantize_nvfp4_ref(xg, with_transposed=True, global_amax=amax(x))
      qw = quantize_nvfp4_ref(wg, block_2d=True, with_transposed=True)
      qg = quantize_nvfp4_ref(gg, with_transposed=True, global_amax=amax(gy))
    else:
      mode = S.MXFP8_1X32 if name == "mxfp8" else S.BLOCK_1X128
      wmode = S.MXFP8_1X32 if name == "mxfp8" else S.BLOCK_128X128
      qx = quantize_block_ref(xg, mode, fwd, power_of_two_scales=name == "block", with_transposed=True)
      qw = quantize_block_ref(wg, wmode, fwd, power_of_two_scales=name == "block", with_transposed=True)
      qg = quantize_block_ref(gg, mode, bwd, power_of_two_scales=name == "block", with_transposed=True)
    deq = (lambda q: q.dequantize(F32)) if name in ("delayed", "current") else (lambda q: q.dequantize(BF16))
    return dict(x=deq(qx), x_t=deq(qx.transposed()), w_t=deq(qw.transposed()), w=deq(qw), g=deq(qg),
                g_t=deq(qg.transposed()))

  out = []
  rows = -(-max(max(sizes), 1) // align) * align  # every group padded alike (whole zero blocks change nothing)
  for g, (lo, hi) in enumerate(_bounds(sizes)):
    pad = rows - (hi - lo)
    xg, gg = jnp.pad(x[lo:hi], ((0, pad), (0, 0))), jnp.pad(gy[lo:hi], ((0, pad), (0, 0)))
    parts = casts(xg, w[g], gg, g)
    out.append({**parts, "x": parts["x"][:hi - lo], "g": parts["g"][:hi - lo]})
  return out


def _oracle(parts, b, sizes, rows, out_dtype):
  """Float64, float32 and |.| sums of y, dx and dw from the per-group dequantized operands."""
  res = {}
  for name, a_key, b_key, k in (("y", "x", "w_t", K), ("dx", "g", "w", N), ("dw", "x_t", "g_t", None)):
    vals = {}
    for kind in ("64", "32", "abs"):
      full = np.zeros((G, K, N) if name == "dw" else (rows, K if name == "dx" else N), np.float64)
      for g, ((lo, hi), p) in enumerate(zip(_bounds(sizes), parts)):
        a, c = _f64(p[a_key]), _f64(p[b_key])
        prod = {"64": lambda a, c: a @ c.T, "32": lambda a, c: (a.astype(np.float32) @ c.astype(np.float32).T),
                "abs": lambda a, c: np.abs(a) @ np.abs(c).T}[kind](a, c).astype(np.float64)
        if name == "y" and b is not None and kind != "abs":
          prod = prod + _f64(b[g].astype(out_dtype))
        if name == "dw":
          full[g] = prod
        else:
          full[lo:hi] = prod
      if kind == "32" and name != "dw":  # rounded to the output dtype, as ours is
        full = _f64(jnp.asarray(full.astype(np.float32)).astype(out_dtype))
      vals[kind] = full
    res[name] = (vals["64"], vals["32"], vals["abs"], k or max(rows, 1))
  return res


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_dense_is_the_per_group_gemms_of_quantized_operands(name, sizes):
  r = RECIPES[name]
  x, w, b = _normal(0, (M, K), BF16), _normal(1, (G, K, N), F32, 0.05), _normal(2, (G, N), F32)
  gy = _normal(3, (M, N), BF16)
  meta = _delayed_meta() if name == "delayed" else None
  group_sizes = jnp.asarray(SIZES[sizes], jnp.int32)
  @jax.jit
  def run(x, w, b, m, gy):
    y, vjp = jax.vjp(lambda x, w, b, m: grouped_dense(x, w, group_sizes, b, fp8_meta=m, recipe=r), x, w, b, m)
    return y, *vjp(gy)[:3]

  y, dx, dw, db = run(x, w, b, meta, gy)
  assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (BF16, BF16, F32, F32)
  want = _oracle(_group_casts(r, name, x, w, gy, SIZES[sizes]), b, SIZES[sizes], M, BF16)
  for got, what in ((y, "y"), (dx, "dx"), (dw, "dw")):
    assert_rule(got, *want[what][:3], want[what][3], f"{name} {sizes} {what}")
  used = sum(SIZES[sizes])
  np.testing.assert_array_equal(np.asarray(y[used:], F32), 0.0)
  np.testing.assert_array_equal(np.asarray(dx[used:], F32), 0.0)
  want_db = np.stack([_f64(gy)[lo:hi].sum(0) for lo, hi in _bounds(SIZES[sizes])])
  np.testing.assert_allclose(np.asarray(db), want_db, rtol=1e-5, atol=1e-5)


def test_delayed_state_after_steps_is_the_per_group_loop_of_dense():
  """Three steps with new inputs each: the grouped state (histories and scales) is, bit for bit, the states of G
  te_jax.dense calls, one per group, each with its own DenseFp8Meta; the outputs agree within FP8 rounding."""
  r = RECIPES["delayed"]
  sizes = SIZES["skewed"]
  w = _normal(1, (G, K, N), F32, 0.05)
  meta = grouped_fp8_meta(G, 4)
  metas = [te_jax.DenseFp8Meta.create(4) for _ in range(G)]
  group_sizes = jnp.asarray(sizes, jnp.int32)
  def step(layer):
    @jax.jit
    def run(x, w, m, gy):
      y, vjp = jax.vjp(lambda x, w, m: layer(x, w, m), x, w, m)
      return y, vjp(gy)[2]
    return run

  grouped = step(lambda x, w, m: grouped_dense(x, w, group_sizes, fp8_meta=m, recipe=r))
  dense = step(lambda x, w, m: te_jax.dense(x, w, fp8_meta=m, recipe=r))
  for i in range(3):
    x, gy = _normal(10 + i, (M, K), BF16, 2.0 ** i), _normal(20 + i, (M, N), BF16)
    y, meta = grouped(x, w, meta, gy)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
      yg, metas[g] = dense(x[lo:hi], w[g], metas[g], gy[lo:hi])
      np.testing.assert_allclose(np.asarray(y[lo:hi], F32), np.asarray(yg, F32), rtol=2 ** -7, atol=2 ** -7)
  for g in range(G):
    for field in te_jax.DenseFp8Meta._fields:
      mine, theirs = getattr(meta, field), getattr(metas[g], field)
      np.testing.assert_array_equal(np.asarray(mine.amax_history[g]), np.asarray(theirs.amax_history), field)
      np.testing.assert_array_equal(np.asarray(mine.scale[g]), np.asarray(theirs.scale), field)
  assert float(meta.x.scale[0]) != float(meta.x.scale[2])  # per-group scales, not one


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", ["current", "block"])
def test_traced_group_sizes_compile_once(name):
  """Group sizes as a jitted argument: new routings reuse the one compilation and give the eager results."""
  traces = []

  def loss(x, w, sizes):
    traces.append(None)
    return jnp.sum(grouped_dense(x, w, sizes, recipe=RECIPES[name]).astype(F32) ** 2)

  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  x, w = _normal(0, (M, K), BF16), _normal(1, (G, K, N), F32, 0.05)
  first = f(x, w, jnp.asarray(SIZES["balanced"], jnp.int32))
  s = jnp.asarray(SIZES["empty"], jnp.int32)
  got, want = f(x, w, s), jax.value_and_grad(loss, argnums=(0, 1))(x, w, s)
  assert len(traces) == 2  # the jitted function once for both sizes, the eager call once
  assert float(first[0]) != float(got[0])
  for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(c, F32))


def test_high_precision_is_jax_grad_of_a_per_group_loop():
  x, w, b = _normal(0, (M, K), F32), _normal(1, (G, K, N), F32, 0.05), _normal(2, (G, N), F32)
  sizes = SIZES["below"]

  def loop(x, w, b):
    y = jnp.zeros((M, N), F32)
    for g, (lo, hi) in enumerate(_bounds(sizes)):
      y = y.at[lo:hi].set(jnp.dot(x[lo:hi], w[g], precision="highest") + b[g])
    return y

  gy = _normal(3, (M, N), F32)
  mine = jax.vjp(lambda *a: grouped_dense(*a[:2], jnp.asarray(sizes, jnp.int32), a[2]), x, w, b)
  theirs = jax.vjp(loop, x, w, b)
  np.testing.assert_allclose(np.asarray(mine[0]), np.asarray(theirs[0]), rtol=1e-5, atol=1e-5)
  for a, c in zip(mine[1](gy), theirs[1](gy)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


def test_fp8_layout_rounds_each_group_to_whole_blocks():
  """The aligned layout: 128 for 1 x 128 blocks, 32 for MXFP8, 16 for NVFP4 and per-tensor scaling."""
  x, w = jnp.ones((M, K), BF16), jnp.ones((G, K, N), F32)
  aligns = {name: token_align(Fp8Config.of(r, x, w, None)) for name, r in RECIPES.items()}
  assert aligns == {"delayed": 16, "current": 16, "block": 128, "mxfp8": 32, "nvfp4": 16}


def test_group_align_is_the_layouts_multiple():
  """group_align of a recipe, of its quantizer and of a kernel shape is the padded layout's multiple; 1 without FP8
  and for dims an FP8 GEMM cannot take."""
  x, w = jnp.ones((M, K), BF16), jnp.ones((G, K, N), F32)
  for r in RECIPES.values():
    want = token_align(Fp8Config.of(r, x, w, None))
    assert group_align(r) == group_align(r, w.shape) == group_align(Fp8Config.of(r, x, w, None).quantizer) == want
    assert group_align(r, (G, K, 24)) == 1
  assert group_align(None, w.shape) == 1
  with pytest.raises(TypeError, match=r"group_align: recipe must be a te_jax.recipe Recipe.*got str"):
    group_align("delayed")
  with pytest.raises(ValueError, match=r"kernel_shape must be the kernel's \(G, K, N\), got \(128, 32\)"):
    group_align(RECIPES["block"], (K, N))


def _moe_layer(name, align, bias):
  """tokens -> permute(align) -> grouped_dense -> unpermute, jitted, with its vjp: the values, the gradients of the
  tokens, kernel and bias, and the delayed-scaling state's new value."""
  r = RECIPES[name]

  @jax.jit
  def run(tokens, experts, weights, w, b, meta, g):
    def f(tokens, w, b, meta):
      rows, sizes, plan = permute(tokens, experts, G, align=align)
      y = grouped_dense(rows, w, sizes, b, fp8_meta=meta if name == "delayed" else None, recipe=r,
                        groups_aligned=align > 1)
      return unpermute(y, plan, weights)
    out, vjp = jax.vjp(f, tokens, w, b, meta)
    return out, vjp(g)

  return run


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("name", list(RECIPES))
def test_pre_aligned_groups_are_the_padded_layout_bit_for_bit(name):
  """permute(align=group_align) + groups_aligned=True against permute(align=1) + grouped_dense's own layout: the
  same bits in the output, every gradient and the FP8 state (skewed routing, an expert with no token, a bias)."""
  t, k = 40, 2
  tokens, w = _normal(0, (t, K), BF16), _normal(1, (G, K, N), F32, 0.05)
  b = _normal(2, (G, N), F32, 0.1)
  experts = jnp.asarray(np.random.default_rng(3).choice([0, 2, 2, 2], size=(t, k)), jnp.int32)  # expert 1: none
  weights = _normal(4, (t, k), F32)
  g = _normal(5, (t, N), BF16)
  align = group_align(RECIPES[name], w.shape)
  assert align > 1
  args = (tokens, experts, weights, w, b, _delayed_meta(), g)
  padded, aligned = _moe_layer(name, 1, True)(*args), _moe_layer(name, align, True)(*args)
  leaves_p, leaves_a = jax.tree.leaves(padded), jax.tree.leaves(aligned)
  assert len(leaves_p) == len(leaves_a) == 1 + 3 + 6  # the output; the tokens', kernel's, bias's and state's grads
  for a, c in zip(leaves_a, leaves_p):
    np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(c, F32))
  assert float(jnp.abs(padded[0].astype(F32)).max()) > 0


def test_pre_aligned_group_sizes_are_checked_where_concrete():
  x, w = _normal(0, (M, K), BF16), _normal(1, (G, K, N), F32, 0.05)
  sizes = jnp.asarray([16, 20, 12], jnp.int32)
  with pytest.raises(ValueError, match=r"group_sizes must be multiples of 16 .*got group_sizes\[1\] = 20 in "
                                       r"\[16, 20, 12\]: lay the rows out with te_jax.permute\(..., align=16\)"):
    grouped_dense(x, w, sizes, recipe=RECIPES["current"], groups_aligned=True)
  with pytest.raises(ValueError, match=r"multiples of 128"):
    grouped_dense(x, w, jnp.asarray([0, 0, 48], jnp.int32), recipe=RECIPES["block"], groups_aligned=True)
  with pytest.raises(TypeError, match=r"groups_aligned must be a bool, got 1"):
    grouped_dense(x, w, sizes, groups_aligned=1)
  # no FP8 (no recipe, or dims an FP8 GEMM cannot take): any sizes are aligned
  y = grouped_dense(x, w, sizes, groups_aligned=True)
  np.testing.assert_array_equal(np.asarray(y, F32), np.asarray(grouped_dense(x, w, sizes), F32))


def test_unaligned_dims_run_in_high_precision_and_keep_the_state():
  x, w = _normal(0, (M, 24), BF16), _normal(1, (G, 24, N), F32, 0.05)
  meta = grouped_fp8_meta(G, 4)
  sizes = jnp.asarray(SIZES["balanced"], jnp.int32)
  @jax.jit
  def run(x, w, m):
    y, vjp = jax.vjp(lambda x, w, m: grouped_dense(x, w, sizes, fp8_meta=m, recipe=RECIPES["delayed"]), x, w, m)
    return y, grouped_dense(x, w, sizes), vjp(jnp.ones_like(y))[2]

  y, want, new = run(x, w, meta)
  np.testing.assert_array_equal(np.asarray(y, F32), np.asarray(want, F32))
  for a, c in zip(jax.tree.leaves(new), jax.tree.leaves(meta)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_differentiating_the_kernel_without_the_state_raises():
  x, w = _normal(0, (M, K), BF16), _normal(1, (G, K, N), F32, 0.05)
  sizes = jnp.asarray(SIZES["balanced"], jnp.int32)
  meta = grouped_fp8_meta(G, 4)
  with pytest.raises(ValueError, match=r"differentiates an FP8 layer's kernel but not its delayed-scaling state"):
    jax.grad(lambda w: jnp.sum(grouped_dense(x, w, sizes, fp8_meta=meta, recipe=RECIPES["delayed"]).astype(F32)))(w)


@pytest.mark.parametrize("call,error,match", [
    (lambda x, w, s: grouped_dense(x[None], w, s), ValueError, r"x must be \(M, K\)"),
    (lambda x, w, s: grouped_dense(x, w[:, :64], s), ValueError, r"kernel must be \(G, K, N\) with K = x's 128"),
    (lambda x, w, s: grouped_dense(x, w, s[:2]), ValueError, r"group_sizes must be \(3,\)"),
    (lambda x, w, s: grouped_dense(x, w, s.astype(F32)), TypeError, r"group_sizes must be a 1-D int32 array"),
    (lambda x, w, s: grouped_dense(x, w, s, jnp.ones((N,))), ValueError, r"bias must be \(3, 32\)"),
    (lambda x, w, s: grouped_dense(x, w, s, recipe=RECIPES["delayed"]), ValueError, r"DelayedScaling needs fp8_meta"),
    (lambda x, w, s: grouped_dense(x, w, s, fp8_meta=te_jax.DenseFp8Meta.create(4), recipe=RECIPES["delayed"]),
     ValueError, r"fp8_meta.x must hold one state per group.*grouped_fp8_meta\(3, L\)"),
    (lambda x, w, s: grouped_gemm(x, QuantizedTensor(w.astype(E4M3), jnp.ones(())), s), TypeError,
     r"lhs and rhs must be of one kind"),
    (lambda x, w, s: grouped_gemm(x.astype(E4M3), w, s), TypeError, r"lhs is a bare float8_e4m3fn array"),
    (lambda x, w, s: grouped_gemm(QuantizedTensor(x.astype(E4M3), jnp.ones((2,))),
                                  QuantizedTensor(w.astype(E4M3), jnp.ones(())), s), TypeError,
     r"lhs.scale_inv must be float32 of shape \(\) or \(3,\)"),
    (lambda x, w, s: grouped_gemm(QuantizedTensor(x.astype(E5M2), jnp.ones(())),
                                  QuantizedTensor(w.astype(E5M2), jnp.ones(())), s), TypeError, r"E5M2 x E5M2"),
    (lambda x, w, s: grouped_gemm(x, w[:2], s), ValueError, r"rhs has 2 matrices but group_sizes 3 groups"),
    (lambda x, w, s: grouped_gemm(x, w, s, ragged_contracting=True), ValueError,
     r"ragged_contracting needs lhs \(K, M\) and rhs \(N, M\)"),
    (lambda x, w, s: grouped_gemm(x, w, s, dtype=jnp.int8), ValueError, r"dtype must be bfloat16"),
])
def test_bad_arguments_are_named(call, error, match):
  x, w = jnp.ones((M, K), BF16), jnp.ones((G, N, K), BF16)
  if "grouped_dense" in call.__code__.co_names:
    w = jnp.ones((G, K, N), F32)
  with pytest.raises(error, match=match):
    call(x, w, jnp.asarray(SIZES["balanced"], jnp.int32))
