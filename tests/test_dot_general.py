"""te_jax.fused.dot_general: jax.lax.dot_general with any dimension numbers in FP8, and the layers on it
(Fp8DotGeneral, Fp8Einsum in linen and NNX).

- High precision (no autocast): bit for bit jax.lax.dot_general, for every einsum of a Gemma-style attention and MLP.
- FP8: the forward and both gradients against the same math on the quantized operands (quantize, then dot) in
  float32 and float64, within CONTRIBUTING.md's tolerance rule (on a GPU with the noise term of Hopper's FP8
  accumulator); the FP8 state of a train step is that step's amaxes. The batched form is te_jax's strided batched
  GEMM (three of them per step: forward, dgrad, wgrad), a sharded batch stays sharded; block-scaled recipes run
  without batch dims and raise with them.
- The layers: nnx.Einsum(einsum_op=Fp8Einsum()), nnx.Linear(dot_general=Fp8DotGeneral()), jnp.einsum's _dot_general,
  nn.DenseGeneral(batch_dims=..., dot_general_cls=Fp8DotGeneral), te_flax.Fp8Einsum; every bad argument named.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
import flax.linen as nn

import te_jax
from conftest import assert_within_rule
from te_jax.flax.dense import Fp8DotGeneral as LinenDot
from te_jax.flax.dense import Fp8Einsum as LinenEinsum
from te_jax.fused.dot_general import DotGeneralDims, dot_general
from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.modules.dense import einsum_dims
from te_jax.nnx.dense import Fp8DotGeneral as NnxDot
from te_jax.nnx.dense import Fp8Einsum as NnxEinsum
from te_jax.nnx.fp8_state import value_and_grad
from te_jax.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

FP8 = te_jax.FP8_COLLECTION
HISTORY = 4
ROLES = ("x", "kernel", "grad")
# Unit roundoff of the accumulator of Hopper's FP8 tensor cores: about 14 bits (tests/test_gemm.py's FP8_ACCUM_U).
FP8_ACCUM_U = 2.0**-14

# The einsums of a Gemma-style block (B batch, T/S sequence, D model, N heads, H head dim, F MLP hidden), each with
# its operands' shapes: the projections (input, kernel) and attention's two batched products (activations).
GEMMA = {
    "q_proj": ("BTD,NDH->BTNH", (2, 16, 32), (4, 32, 16)),
    "out_proj": ("BTNH,NHD->BTD", (2, 16, 4, 16), (4, 16, 32)),
    "mlp": ("BTD,DF->BTF", (2, 16, 32), (32, 48)),
    "logits": ("BTNH,BSNH->BNTS", (2, 16, 4, 16), (2, 32, 4, 16)),
    "encoded": ("BNTS,BSNH->BTNH", (2, 4, 16, 32), (2, 32, 4, 16)),
    "odd_rows": ("BSNH,BTNH->BNTS", (3, 5, 2, 16), (3, 16, 2, 16)),  # M = 5 rows per batch index: padded
}


def _draw(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _operands(name):
  spec, ls, rs = GEMMA[name]
  return spec, _draw(ls, 0), _draw(rs, 1)


def _dims(spec, a, b):
  dims, _, order = einsum_dims(spec, a.ndim, b.ndim)
  return dims, order


def _fp8(x, scale, dtype):
  """x quantized per tensor with ``scale`` and dequantized (the saturating cast of te_jax's quantize), float64."""
  x = np.asarray(x, np.float32) * np.float32(scale)
  top = float(ml_dtypes.finfo(dtype).max)
  q = np.clip(x, -top, top).astype(dtype)
  return q.astype(np.float64) * np.float64(np.float32(1) / np.float32(scale))


def _einsum_grads(spec, a, b, g, dtype):
  """(out, dlhs, drhs) of einsum ``spec`` on a, b with output cotangent g, accumulated in ``dtype``."""
  ins, out = spec.split("->")
  ls, rs = ins.split(",")
  a, b, g = (np.asarray(v, dtype) for v in (a, b, g))
  return (np.einsum(spec, a, b), np.einsum(f"{out},{rs}->{ls}", g, b), np.einsum(f"{ls},{out}->{rs}", a, g))


# ---- high precision ------------------------------------------------------------------------------------------------


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("name", list(GEMMA))
def test_high_precision_is_lax_dot_general(name):
  spec, a, b = _operands(name)
  dims, _ = _dims(spec, a, b)
  want = jax.lax.dot_general(a, b, dims)
  np.testing.assert_array_equal(np.asarray(dot_general(a, b, dims)), np.asarray(want))
  ga, gb = jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dims) ** 2), (0, 1))(a, b)
  oa, ob = jax.grad(lambda a, b: jnp.sum(dot_general(a, b, dims) ** 2), (0, 1))(a, b)
  np.testing.assert_array_equal(np.asarray(oa), np.asarray(ga))
  np.testing.assert_array_equal(np.asarray(ob), np.asarray(gb))


def test_einsum_dims_match_jnp_einsum():
  """einsum_dims's dot_general, transposed by its order, is jnp.einsum's result, bit for bit (one dot either way)."""
  for spec, ls, rs in GEMMA.values():
    a, b = _draw(ls, 0), _draw(rs, 1)
    dims, order = _dims(spec, a, b)
    ours = jnp.transpose(jax.lax.dot_general(a, b, dims), order)
    assert ours.shape == jnp.einsum(spec, a, b).shape
    np.testing.assert_allclose(np.asarray(ours), np.asarray(jnp.einsum(spec, a, b)), rtol=1e-6, atol=1e-5)
  # A letter in one operand only and not in the output is summed first.
  dims, summed, order = einsum_dims("BTDX,DF->BTF", 4, 2)
  assert summed == ((3,), ()) and dims == (((2,), (0,)), ((), ())) and order == (0, 1, 2)


# ---- FP8 -----------------------------------------------------------------------------------------------------------


def _einsum_specs(spec):
  """The einsums of the forward, dlhs and drhs (as ``_einsum_grads`` computes them), each with its operands' indices
  into (lhs, rhs, output cotangent)."""
  ins, out = spec.split("->")
  ls, rs = ins.split(",")
  return (f"{ls},{rs}->{out}", (0, 1)), (f"{out},{rs}->{ls}", (2, 1)), (f"{ls},{out}->{rs}", (0, 2))


def _assert_within_fp8_rule(ours, r32, r64, spec, x, y, what):
  """The tolerance rule with test_gemm_block's ``check_close`` noise term, ``sqrt(K) * FP8_ACCUM_U * max sum|a||b|``:
  Hopper's FP8 tensor cores accumulate in about 14 bits (promoted to float32 only every few K blocks, never with
  fast accumulation), so two correct FP8 GEMMs differ by that much more than two float32 sums; the float32 term of
  ``assert_within_rule`` (4 u max|ref64|) is far below it. ``x``, ``y``: the einsum's float64 operands."""
  ins, out = spec.split("->")
  sizes = {c: d for term, v in zip(ins.split(","), (x, y)) for c, d in zip(term, v.shape)}
  k = math.prod(sizes[c] for c in set(ins) - set(out) - {","})
  ours, r32, r64 = (np.asarray(v, np.float64) for v in (ours, r32, r64))
  err, err32 = np.max(np.abs(ours - r64)), np.max(np.abs(r32 - r64))
  noise = math.sqrt(k) * FP8_ACCUM_U * float(np.max(np.einsum(spec, np.abs(x), np.abs(y))))
  assert err <= 2 * err32 + noise, f"{what}: error {err:.3g} > 2 * {err32:.3g} + {noise:.3g}"


def _check_fp8_step(spec, a, b, recipe, meta, fp8_accumulator=False):
  """One forward and backward of the FP8 einsum against quantize-then-dot; returns the updated state.
  ``fp8_accumulator``: the GEMMs ran on FP8 tensor cores (a GPU), whose accumulation noise the rule adds."""
  dims, order = _dims(spec, a, b)
  c = _draw(jnp.einsum(spec, a, b).shape, 2)

  def loss(a, b, meta):
    y = jnp.transpose(dot_general(a, b, dims, fp8_meta=meta, recipe=recipe), order)
    return jnp.sum(y * c), y

  (_, y), (ga, gb, new) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(a, b, meta)
  fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
  if meta is None:  # current scaling: each tensor's own amax
    scales = [float(ml_dtypes.finfo(d).max) / np.float32(np.abs(np.asarray(v)).max())
              for v, d in ((a, fwd), (b, fwd), (c, bwd))]
  else:
    scales = [float(s.scale) for s in meta]
  qa, qb, qc = (_fp8(v, s, d) for v, s, d in zip((a, b, c), scales, (fwd, fwd, bwd)))
  ref32, ref64 = _einsum_grads(spec, qa, qb, qc, np.float32), _einsum_grads(spec, qa, qb, qc, np.float64)
  for what, ours, r32, r64, (sub, (i, j)) in zip(("forward", "dlhs", "drhs"), (y, ga, gb), ref32, ref64,
                                                 _einsum_specs(spec)):
    if fp8_accumulator:
      _assert_within_fp8_rule(ours, r32, r64, sub, (qa, qb, qc)[i], (qa, qb, qc)[j], f"{spec} {what}")
    else:
      assert_within_rule(ours, r32, r64, f"{spec} {what}")
  return new, (a, b, c)


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("name", list(GEMMA))
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=HISTORY), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_against_quantize_then_dot(name, recipe):
  spec, a, b = _operands(name)
  meta = DenseFp8Meta.create(HISTORY) if isinstance(recipe, DelayedScaling) else None
  new, tensors = _check_fp8_step(spec, a, b, recipe, meta)
  if meta is None:
    assert new is None
    return
  # The state of the step: each operand's amax (one for the whole operand, batched or not) and its scale.
  for role, state, v in zip(ROLES, new, tensors):
    amax = np.float32(np.abs(np.asarray(v)).max())
    np.testing.assert_array_equal(np.asarray(state.amax_history), [amax] + [0] * (HISTORY - 1), err_msg=role)
    dtype = recipe.fp8_format.bwd_dtype if role == "grad" else recipe.fp8_format.fwd_dtype
    np.testing.assert_array_equal(np.asarray(state.scale), np.float32(ml_dtypes.finfo(dtype).max) / amax)
  # The next step casts with those scales.
  _check_fp8_step(spec, a * 3, b, recipe, new)


def _gemm_binds(jaxpr) -> list:
  """The configs of every te_jax GEMM a (closed) jaxpr binds, nested jaxprs included."""
  configs = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "te_gemm_outer":
      configs.append(eqn.params["config"])
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          configs += _gemm_binds(inner)
  return configs


@pytest.mark.parametrize("name", ["logits", "odd_rows"])
def test_batched_runs_te_jax_strided_batched_gemm(name):
  """A train step of the batched product binds te_jax's batched GEMM three times (forward, dgrad, wgrad) and no other
  GEMM; the rows of a batch index are padded to a multiple of 16 (odd_rows: M = 5), the wgrad contracting them."""
  spec, a, b = _operands(name)
  dims, _ = _dims(spec, a, b)
  recipe = Float8CurrentScaling()
  step = jax.value_and_grad(lambda a, b: jnp.sum(dot_general(a, b, dims, recipe=recipe)), (0, 1))
  configs = _gemm_binds(jax.make_jaxpr(step)(a, b).jaxpr)
  assert len(configs) == 3 and all(c.batched for c in configs), configs
  assert all(not c.fast_accum for c in configs[1:]) and configs[0].fast_accum  # the recipe's fprop / dgrad / wgrad


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["logits", "encoded", "odd_rows", "q_proj"])
def test_gpu_fp8_gemms_run_on_the_gpu(name):
  """On the GPU every GEMM of a train step is te_jax's cuBLASLt GEMM (te_gemm_cuda in the compiled HLO; batched: the
  strided batched form, three calls, and no XLA GEMM: XLA:GPU does not rewrite a dot of FP8 arrays in float32 into its
  FP8 GEMM), and the values are quantize-then-dot's within the tolerance rule with the FP8 accumulator's noise."""
  spec, a, b = _operands(name)
  recipe = DelayedScaling(amax_history_len=HISTORY)
  dims, order = _dims(spec, a, b)
  step = jax.jit(lambda a, b, m: jax.value_and_grad(lambda a, b, m: jnp.sum(
      jnp.transpose(dot_general(a, b, dims, fp8_meta=m, recipe=recipe), order) * 1.0), (0, 1, 2))(a, b, m))
  hlo = step.lower(a, b, DenseFp8Meta.create(HISTORY)).compile().as_text()
  if dims[1][0]:  # batched: forward, dgrad, wgrad, each one te_gemm_cuda
    assert hlo.count('custom_call_target="te_gemm_cuda"') == 3, hlo.count("te_gemm_cuda")
    assert "__cublas$" not in hlo and not re.search(r"\bdot\(", hlo)
  else:
    assert "te_gemm_cuda" in hlo
  _check_fp8_step(spec, a, b, recipe, DenseFp8Meta.create(HISTORY), fp8_accumulator=True)


def test_fp8_unaligned_batched_runs_high_precision_and_keeps_state():
  """A batched product whose K is not a multiple of 16 runs as jax.lax.dot_general, its state handed back as it was."""
  a, b = _draw((2, 8, 12), 0), _draw((2, 16, 12), 1)
  dims = (((2,), (2,)), ((0,), (0,)))
  meta = DenseFp8Meta.create(HISTORY)
  recipe = DelayedScaling(amax_history_len=HISTORY)
  y, vjp = jax.vjp(lambda a, b, m: dot_general(a, b, dims, fp8_meta=m, recipe=recipe), a, b, meta)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.lax.dot_general(a, b, dims)))
  new = vjp(jnp.ones_like(y))[2]
  jax.tree.map(np.testing.assert_array_equal, new, meta)


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_batched_sharded_over_the_batch_is_unsharded_bit_for_bit(axis_type):
  """A batched product data parallel over 8 devices: the unsharded gradients bit for bit, the output and the
  gradients sharded over the batch, and no collective but scalars' all-reduces (the per-tensor amaxes: one scale for
  the whole operand; the loss). The loss is the test's own sum over the sharded output: 8 partial sums, within
  float32's reordering bound of the unsharded sum."""
  cpu = jax.devices("cpu")  # the 8 CPU devices tests/conftest.py provides, on a GPU machine too
  mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),), devices=cpu)
  a, b = (jax.device_put(x, cpu[0]) for x in (_draw((8, 16, 4, 16), 0), _draw((8, 32, 4, 16), 1)))
  dims = (((3,), (3,)), ((0, 2), (0, 2)))
  recipe = Float8CurrentScaling()
  step = jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(dot_general(a, b, dims, recipe=recipe) ** 2), (0, 1)))
  want = step(a, b)
  sharded = [jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))) for x in (a, b)]
  with jax.set_mesh(mesh):
    got = step(*sharded)
    hlo = step.lower(*sharded).compile().as_text()
  jax.tree.map(np.testing.assert_array_equal, got[1], want[1])
  n = 8 * 4 * 16 * 32  # the summed output's elements; each term is positive
  assert abs(float(got[0]) - float(want[0])) <= 2 * n * 2.0**-24 * float(want[0])
  assert all(g.sharding.spec[0] == "data" for g in got[1])
  collectives = re.findall(r"= (.*?) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(",
                           hlo)
  assert collectives and all(c == "all-reduce" and not re.search(r"\[\d", t) for t, c in collectives), collectives


def test_block_scaled_recipes():
  """Without batch dims a block-scaled recipe runs as te_jax.dense (its value and gradients bit for bit); with them it
  raises, naming the recipe and the per-tensor recipes to pass instead."""
  recipe = Float8BlockScaling()
  a, b = _draw((2, 16, 128), 0), _draw((128, 128), 1)  # 'BTD,DF->BTF' of 128-wide blocks
  dims, _ = _dims("BTD,DF->BTF", a, b)
  ours = jax.value_and_grad(lambda a, b: jnp.sum(dot_general(a, b, dims, recipe=recipe) ** 2), (0, 1))(a, b)
  want = jax.value_and_grad(lambda a, b: jnp.sum(te_jax.dense(a, b, recipe=recipe) ** 2), (0, 1))(a, b)
  jax.tree.map(np.testing.assert_array_equal, ours, want)
  spec, a, b = _operands("logits")
  dims, _ = _dims(spec, a, b)
  with pytest.raises(ValueError, match=r"runs per-tensor recipes only \(DelayedScaling, Float8CurrentScaling\), got "
                                       r"Float8BlockScaling: give this call recipe=te_jax.recipe.DelayedScaling\(\)"):
    dot_general(a, b, dims, recipe=recipe)


def test_a_step_that_leaves_the_state_out_raises():
  """Differentiating rhs (the kernel) but not the delayed-scaling state would freeze it: raises, as te_jax.dense."""
  spec, a, b = _operands("logits")
  dims, _ = _dims(spec, a, b)
  meta, recipe = DenseFp8Meta.create(HISTORY), DelayedScaling(amax_history_len=HISTORY)
  with pytest.raises(ValueError, match=r"differentiates an FP8 layer's kernel but not its delayed-scaling state"):
    jax.grad(lambda b: jnp.sum(dot_general(a, b, dims, fp8_meta=meta, recipe=recipe)))(b)


def test_bad_arguments_are_named():
  a, b = jnp.ones((2, 16, 32)), jnp.ones((2, 32, 16))
  with pytest.raises(TypeError, match=r"dimension_numbers must be"):
    dot_general(a, b, ((2, 1),))
  with pytest.raises(ValueError, match=r"contracting dims have sizes \(32,\) in lhs .* and \(16,\) in rhs"):
    dot_general(a, b, (((2,), (2,)), ((0,), (0,))))
  with pytest.raises(ValueError, match=r"lhs contracting axis 5 is out of range for rank 3"):
    DotGeneralDims.of((((5,), (1,)), ((), ())), a.shape, b.shape)
  with pytest.raises(ValueError, match=r"both contracting and batch dims"):
    dot_general(a, jnp.ones((2, 16, 32)), (((0,), (0,)), ((0,), (0,))))
  with pytest.raises(TypeError, match=r"lhs must be a float array, got int32"):
    dot_general(jnp.ones((2, 16, 32), jnp.int32), b, (((2,), (1,)), ((0,), (0,))))
  with pytest.raises(ValueError, match=r"runs per-tensor recipes only .* got MXFP8BlockScaling"):
    dot_general(a, b, (((2,), (1,)), ((0,), (0,))), recipe=MXFP8BlockScaling())
  with pytest.raises(ValueError, match=r"DelayedScaling needs fp8_meta"):
    dot_general(a, b, (((2,), (1,)), ((0,), (0,))), recipe=DelayedScaling())
  for spec, match in (("BTD,DF", "two operands, an explicit output"), ("...D,DF->...F", "letters only"),
                      ("BTD,DF,FG->BTG", "two operands"), ("BTT,DF->BF", "must name each of its 3 dims once"),
                      ("BTD,DF->BQ", "the output 'BQ' must name each dim once, from the operands")):
    with pytest.raises(ValueError, match=match):
      einsum_dims(spec, 3, 2)


# ---- NNX -----------------------------------------------------------------------------------------------------------


class NnxAttention(nnx.Module):
  """Gemma's attention einsums: projections as nnx.Einsum with Fp8Einsum, the batched products as Fp8Einsum."""

  def __init__(self, rngs):
    self.q = nnx.Einsum("BTD,NDH->BTNH", (4, 32, 16), einsum_op=NnxEinsum(), rngs=rngs)
    self.k = nnx.Einsum("BSD,NDH->BSNH", (4, 32, 16), einsum_op=NnxEinsum(), rngs=rngs)
    self.logits = NnxEinsum()
    self.encoded = NnxEinsum()
    self.out = nnx.Einsum("BTNH,NHD->BTD", (4, 16, 32), einsum_op=NnxEinsum(), rngs=rngs)
    self.mlp = nnx.Linear(32, 48, dot_general=NnxDot(), rngs=rngs)

  def __call__(self, x):
    q, k = self.q(x), self.k(x)
    probs = jax.nn.softmax(self.logits("BTNH,BSNH->BNTS", q, k) / 4.0, axis=-1)
    return self.mlp(self.out(self.encoded("BNTS,BSNH->BTNH", probs, k)))


def _plain_attention(m, x):
  p = lambda layer: layer.kernel[...]  # noqa: E731
  q = jnp.einsum("BTD,NDH->BTNH", x, p(m.q))  # nnx.Einsum without bias_shape: no bias
  k = jnp.einsum("BSD,NDH->BSNH", x, p(m.k))
  probs = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k) / 4.0, axis=-1)
  out = jnp.einsum("BTNH,NHD->BTD", jnp.einsum("BNTS,BSNH->BTNH", probs, k), p(m.out))
  return out @ m.mlp.kernel[...] + m.mlp.bias[...]


@pytest.mark.slow
def test_nnx_attention_train_step():
  x = _draw((2, 16, 32), 0)
  recipe = DelayedScaling(amax_history_len=HISTORY)
  with te_jax.autocast(enabled=True, recipe=recipe):
    model = NnxAttention(nnx.Rngs(0))
  # Outside autocast the layers are their Flax computation.
  np.testing.assert_allclose(np.asarray(model(x)), np.asarray(_plain_attention(model, x)), rtol=1e-5, atol=1e-5)
  with te_jax.autocast(enabled=True, recipe=recipe):
    loss, grads = value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    y = model(x)
  assert np.isfinite(float(loss))
  plain = _plain_attention(model, x)
  assert float(jnp.max(jnp.abs(y - plain))) <= 0.1 * float(jnp.max(jnp.abs(plain)))
  # Every GEMM's state took this step's amaxes: the q projection's input is x.
  np.testing.assert_array_equal(np.asarray(model.q.einsum_op.x_amax_history[...]),
                                [np.abs(np.asarray(x)).max()] + [0] * (HISTORY - 1))
  for layer in (model.q.einsum_op, model.k.einsum_op, model.logits, model.encoded, model.out.einsum_op,
                model.mlp.dot_general):
    for role in ROLES:
      assert float(getattr(layer, f"{role}_amax_history")[...][0]) > 0, role
  assert set(jax.tree.leaves(jax.tree.map(lambda g: bool(jnp.all(jnp.isfinite(g))), grads))) == {True}


def test_jnp_einsum_takes_fp8_dot_general():
  spec, a, b = _operands("logits")
  recipe = Float8CurrentScaling()
  dot = NnxDot(recipe)
  ours = jnp.einsum(spec, a, b, _dot_general=dot)
  dims, order = _dims(spec, a, b)
  # jnp.einsum may hand the operands over in the other order: the same FP8 product (each operand cast by its amax).
  np.testing.assert_allclose(np.asarray(ours), np.asarray(jnp.transpose(
      dot_general(a, b, dims, recipe=recipe), order)), rtol=1e-5, atol=1e-5)


# ---- linen ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_linen_dense_general_batch_dims_and_einsum():
  x = _draw((4, 16, 32), 0)
  recipe = DelayedScaling(amax_history_len=HISTORY)
  ours = nn.DenseGeneral(48, batch_dims=(0,), dot_general_cls=LinenDot)
  theirs = nn.DenseGeneral(48, batch_dims=(0,))
  with te_jax.autocast(enabled=True, recipe=recipe):
    variables = ours.init(jax.random.key(0), x)
    c = _draw((4, 16, 48), 3)
    grads = jax.grad(lambda v: jnp.sum(ours.apply(v, x) * c))(variables)
    y = ours.apply(variables, x)
  plain = theirs.apply({"params": variables["params"]}, x)
  assert float(jnp.max(jnp.abs(y - plain))) <= 0.1 * float(jnp.max(jnp.abs(plain)))
  new = grads[FP8]["Fp8DotGeneral_0"]
  for role, v in zip(ROLES, (x, variables["params"]["kernel"], c)):
    np.testing.assert_array_equal(np.asarray(new[f"{role}_amax_history"]),
                                  [np.abs(np.asarray(v)).max()] + [0] * (HISTORY - 1))
  # Fp8Einsum: its state in the module's variables, the FP8 product of quantize-then-dot.
  spec, a, b = _operands("encoded")
  with te_jax.autocast(enabled=True, recipe=recipe):
    variables = LinenEinsum().init(jax.random.key(0), spec, a, b)
    grads = jax.grad(lambda v: jnp.sum(LinenEinsum().apply(v, spec, a, b)))(variables)
  assert float(grads[FP8]["x_amax_history"][0]) == float(jnp.max(jnp.abs(a)))
  np.testing.assert_array_equal(np.asarray(LinenEinsum().apply(variables, spec, a, b)),
                                np.asarray(jnp.transpose(jax.lax.dot_general(a, b, _dims(spec, a, b)[0]),
                                                         _dims(spec, a, b)[1])))
