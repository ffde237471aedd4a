"""te_jax on meshes with Explicit axes (``jax.make_mesh``'s default), against the same mesh with Auto axes and one
device.

Each op (and its gradients, where it has them) runs under ``jax.jit`` on a 2 x 4 mesh of the 8 CPU devices
(conftest.py) whose axes are Explicit, then Auto, then unsharded on one device. On both meshes the results must be
the unsharded ones: bitwise where the sharding splits no sum (casts, row-wise ops, GEMMs whose K is whole), within
float32 summation order otherwise (the tolerance rule: the error of the same sums in float32, doubled). Explicit and
Auto give the same bits and compile to the same collectives; on the Explicit mesh every output is laid out as its
type says, and the types are te_jax's rules (``te_jax.ops.gemm.output_spec`` for GEMMs). The modules run the train
step of tests/parallel_model.py on both kinds of mesh, data and tensor parallel through te_jax's logical axis rules.
"""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from conftest import random_normal
from parallel_model import collectives, init_case, train_step
from te_jax import ScalingMode
from te_jax.ops.gemm import gemm, output_spec
from te_jax.ops.quantize import quantize
from te_jax.ops.quantize_block import quantize_block

R = te_jax.recipe
SHAPE, NAMES = (2, 4), ("data", "model")
KINDS = (AxisType.Explicit, AxisType.Auto)


def _mesh(kind, shape=SHAPE, names=NAMES):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names), devices=jax.devices("cpu")[:8])


def _bf16(seed, shape):
  return random_normal(seed, shape).astype(jnp.bfloat16)


def _with_grads(fn, diff):
  """``fn``'s outputs and the gradients of half their squared sum (the outputs themselves, pulled back) with respect
  to the arguments ``diff``."""
  if not diff:
    return fn

  def loss(*args):
    return sum(jnp.sum(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(fn(*args))) / 2

  return lambda *args: (fn(*args), jax.grad(loss, argnums=diff)(*args))


def _bits(a):
  return np.atleast_1d(np.asarray(a)).view(np.uint8)


def _spec(sharding, ndim):
  spec = tuple(sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def run_both(fn, args, specs, diff=()):
  """``fn`` (with gradients for ``diff``) jitted on the Explicit mesh, on the Auto one (its outputs laid out as the
  Explicit ones are typed, so that both programs end alike) and on one device: ({kind: (outputs, collectives, the
  Explicit outputs' types)}, the unsharded outputs)."""
  f = _with_grads(fn, diff)
  results, types = {}, None
  for kind in KINDS:
    mesh = _mesh(kind)
    with jax.set_mesh(mesh):
      sargs = [a if s is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
      if types is None:
        jitted = jax.jit(f)
        types = jitted.trace(*sargs).jaxpr.out_avals
      else:
        tree = jax.tree.structure(jax.eval_shape(f, *sargs))
        jitted = jax.jit(f, out_shardings=tree.unflatten([NamedSharding(mesh, t.sharding.spec) for t in types]))
      compiled = jitted.lower(*sargs).compile()
      results[kind] = (compiled(*sargs), collectives(compiled.as_text()), types)
  one = jax.jit(f)(*(jax.device_put(a, jax.devices("cpu")[0]) for a in args))
  return results, one


def check(fn, args, specs, diff=(), exact=True, out_specs=None, same_collectives=True):
  """The checks of the module docstring; ``exact``: sharded == unsharded bit for bit (True), within summation order
  (False), or "forward": the forward's outputs within summation order and the gradients not against one device: an
  FP8 layer whose GEMM sums partial products over shards rounds its output differently in the last bit, and the
  gradient's FP8 cast then moves a few elements by an E5M2 step (the sharded gradients are held to the unsharded ones
  with power-of-two scales in tests/test_parallel_layers.py; here, to the Auto mesh's bits). ``out_specs``: the
  PartitionSpecs the first outputs' types must have on the Explicit mesh. ``same_collectives``: compare the
  collectives with the Auto mesh's (returned either way)."""
  results, one = run_both(fn, args, specs, diff)
  (explicit, c_explicit, types), (auto, c_auto, _) = results[AxisType.Explicit], results[AxisType.Auto]
  assert c_explicit == c_auto or not same_collectives, (dict(c_explicit), dict(c_auto))
  leaves_e, leaves_a, leaves_1 = jax.tree.leaves(explicit), jax.tree.leaves(auto), jax.tree.leaves(one)
  for e, a in zip(leaves_e, leaves_a, strict=True):  # the same program either way
    np.testing.assert_array_equal(_bits(e), _bits(a))
  if exact == "forward":
    leaves_e, leaves_1 = jax.tree.leaves(explicit[0] if diff else explicit), jax.tree.leaves(one[0] if diff else one)
  for e, r in zip(leaves_e, leaves_1, strict=True):
    if exact is True:
      np.testing.assert_array_equal(_bits(e), _bits(r))
    elif exact is False:
      _assert_summation_close(np.asarray(e, np.float32), np.asarray(r, np.float32), e.dtype)
    else:
      _assert_fp8_close(np.asarray(e, np.float32), np.asarray(r, np.float32), e.dtype)
  for e, t in zip(jax.tree.leaves(explicit), types, strict=True):  # laid out as typed
    assert _spec(e.sharding, e.ndim) == _spec(t.sharding, e.ndim), (e.sharding, t)
  for e, want in zip(leaves_e, out_specs or ()):
    assert _spec(e.sharding, e.ndim) == _spec(NamedSharding(e.sharding.mesh, want), e.ndim), (e.sharding, want)
  return c_explicit


def _assert_summation_close(got, want, dtype):
  """Within summation order: a sharded sum adds at most 8 partial sums (one per device), each rounded to the result's
  ``dtype``, where one device rounds once; twice that bound, 2 * 8 ulps of the array's largest value."""
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  np.testing.assert_allclose(got, want, rtol=0, atol=2 * 8 * float(jnp.finfo(dtype).eps) * scale)


def _assert_fp8_close(got, want, dtype):
  """An FP8 layer's output on shards against one device's: its GEMMs' partial sums (and XLA's dot blocking for a
  shard's shape) round differently in the last bit, so an FP8 cast downstream rounds a few elements to the
  neighbouring FP8 value. All but 1 % of the elements within summation order, and every one within an E4M3 step
  (2 ** -3) of the array's largest value."""
  scale = float(np.max(np.abs(want))) if want.size else 0.0
  off = np.abs(got - want) > 2 * 8 * float(jnp.finfo(dtype).eps) * scale
  assert off.mean() <= 0.01, f"{off.sum()} of {off.size} elements beyond summation order"
  np.testing.assert_allclose(got, want, rtol=0, atol=float(jnp.finfo(jnp.float8_e4m3fn).eps) * scale)


# ---- ops -----------------------------------------------------------------------------------------------------------

X, W, WT = (64, 64), (64, 128), (128, 64)
# The fused layers' shapes: every shard of a sharded dim holds whole blocks of the block recipes (128 x 128 weights).
XL, WL = (256, 256), (256, 512)


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("spec", [P("data", "model"), P(("data", "model"), None), P(None, "model")])
def test_quantize(spec):
  check(lambda x: quantize(x, jnp.float32(0.5), transpose=True, dbias=False), [_bf16(0, X)], [spec],
        out_specs=[spec])


def test_quantize_block():
  x = _bf16(1, (256, 128))
  check(lambda x: quantize_block(x, ScalingMode.MXFP8_1X32, with_transposed=True), [x], [P("data", None)],
        out_specs=[P("data", None)])


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("lhs_spec,rhs_spec,exact", [
    (P("data", None), P("model", None), True),  # rows and columns: no collective
    (P("data", "model"), P(None, "model"), False),  # K sharded: the partial sums all-reduced
    (P("data", None), P("model", "data"), False),  # rhs's K over the rows' axis: rhs gathered over it
])
def test_gemm(lhs_spec, rhs_spec, exact):
  args = [_bf16(2, X), _bf16(3, WT)]
  want = P(*output_spec([lhs_spec[0]], [lhs_spec[1]], [rhs_spec[1]], [rhs_spec[0]]))
  check(lambda a, b: gemm(a, b, dtype=jnp.float32), args, [lhs_spec, rhs_spec], exact=exact, out_specs=[want])


def test_gemm_out_sharding_reduce_scatters():
  """K over 'model', the output wanted with its columns over it: a reduce-scatter, typed as asked."""
  c = check(lambda a, b: gemm(a, b, dtype=jnp.float32, out_sharding=P("data", "model")), [_bf16(2, X), _bf16(3, WT)],
            [P("data", "model"), P(None, "model")], exact=False, out_specs=[P("data", "model")])
  assert c[("reduce-scatter", "add", "f32")] == 1 and not c[("all-reduce", "add", "f32")], dict(c)


def test_norm():
  args = [_bf16(4, X), random_normal(5, (64,)), random_normal(6, (64,))]
  check(lambda x, g, b: te_jax.layernorm(x, g, b), args, [P("data", None), None, None], diff=(0, 1, 2), exact=False,
        out_specs=[P("data", None)])


def test_activation():
  check(lambda x: te_jax.activation(x, ("gelu",)), [_bf16(7, X)], [P("data", "model")], diff=(0,),
        out_specs=[P("data", "model")])


def test_softmax():
  check(lambda x: te_jax.scaled_softmax(x, 0.5), [_bf16(8, (2, 4, 16, 16))], [P("data", "model")], diff=(0,),
        out_specs=[P("data", "model")])


def test_rope():
  freqs = te_jax.rope_frequencies(16, 8)
  check(lambda x, f: te_jax.apply_rope(x, f), [_bf16(9, (2, 16, 4, 8)), freqs], [P("data", None, "model"), None],
        diff=(0,), out_specs=[P("data", None, "model")])


def test_attention():
  q = _bf16(10, (2, 16, 4, 16))
  check(lambda q, k, v: te_jax.dot_product_attention(q, k, v, backend="unfused"), [q, q, q],
        [P("data", None, "model")] * 3, diff=(0, 1, 2), exact=False, out_specs=[P("data", None, "model")])


# The fused layers under every recipe family: data parallel, row parallel (K over 'model') and FSDP (the kernel's K
# over the batch's axis). The block recipes need each shard to hold whole blocks: 256 rows.
RECIPES = {"bf16": None, "current": R.Float8CurrentScaling(), "block": R.Float8BlockScaling(),
           "mxfp8": R.MXFP8BlockScaling()}
LAYOUTS = {"dp": (P("data", None), P(None, "model")), "row": (P("data", "model"), P("model", None)),
           "fsdp": (P("data", None), P("data", "model"))}


@pytest.mark.fast_cases(3)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_dense(recipe, layout):
  x_spec, w_spec = LAYOUTS[layout]
  want = P(*output_spec([x_spec[0]], [x_spec[1]], [w_spec[0]], [w_spec[1]]))
  args = [random_normal(11, XL), random_normal(12, WL)]
  if recipe == "block" and layout == "row":  # x's K (256) over 4 shards would cut its 1 x 128 blocks: a typed
    # sharding is the caller's, and the block quantizer says so rather than gathering x behind its back
    with jax.set_mesh(_mesh(AxisType.Explicit)), pytest.raises(ValueError, match="would cut its BLOCK_1X128 blocks"):
      jax.jit(lambda x, w: te_jax.dense(x, w, recipe=RECIPES[recipe]))(
          *(jax.device_put(a, s) for a, s in zip(args, (x_spec, w_spec))))
    return
  fp8_sums = recipe != "bf16" and layout == "row"
  check(lambda x, w: te_jax.dense(x, w, recipe=RECIPES[recipe]), args, [x_spec, w_spec], diff=(0, 1),
        exact="forward" if fp8_sums else False, out_specs=[want])


@pytest.mark.parametrize("recipe", ["bf16", "current"])
def test_dense_out_sharding(recipe):
  """Row parallel with the output wanted over 'model' too: typed so in high precision and FP8 alike, the forward
  FP8 GEMM's partial sums reduce-scattered onto it. The Auto mesh, given the same output shardings, resolves the
  backward differently (all-to-alls of the FP8 gradient), so the collectives are checked on their own here."""
  args = [random_normal(11, XL), random_normal(12, WL)]
  c = check(lambda x, w: te_jax.dense(x, w, recipe=RECIPES[recipe], out_sharding=P("data", "model")), args,
            list(LAYOUTS["row"]), diff=(0, 1), exact="forward" if recipe != "bf16" else False,
            out_specs=[P("data", "model")], same_collectives=recipe == "bf16")
  if recipe != "bf16":  # te_jax's GEMM; XLA:CPU all-reduces a high-precision dot and slices
    assert c[("reduce-scatter", "add", "f32")] >= 1 and not c[("all-to-all", "", "f16")], dict(c)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("recipe", ["current", "bf16", "mxfp8"])
def test_layernorm_dense(recipe):
  args = [random_normal(13, (256, 64)), random_normal(14, (64,)), random_normal(15, (64,)), random_normal(16, W)]
  check(lambda x, g, b, w: te_jax.layernorm_dense(x, g, b, w, recipe=RECIPES[recipe]), args,
        [P("data", None), None, None, P(None, "model")], diff=(0, 1, 2, 3), exact=False, out_specs=[P("data", "model")])


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("recipe", ["current", "bf16", "block"])
def test_layernorm_mlp(recipe):
  args = [random_normal(17, (256, 64)), random_normal(18, (64,)), random_normal(19, (64,)),
          random_normal(20, (64, 1, 128)), random_normal(21, (128, 64))]
  check(lambda x, g, b, w1, w2: te_jax.layernorm_mlp(x, g, b, w1, w2, recipe=RECIPES[recipe]), args,
        [P("data", None), None, None, None, None], diff=(0, 1, 2, 3, 4),
        exact="forward" if recipe != "bf16" else False, out_specs=[P("data", None)])


def test_out_sharding_errors():
  x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16))
  with pytest.raises(TypeError, match="out_sharding must be a jax.sharding.PartitionSpec"):
    te_jax.dense(x, w, out_sharding=("data", None))
  with pytest.raises(ValueError, match="out_sharding .* more entries"):
    te_jax.dense(x, w, out_sharding=P(None, None, None))
  with pytest.raises(ValueError, match="out_sharding and rhs_parts"):
    gemm(x, jnp.ones((2, 16, 32), jnp.bfloat16), rhs_parts=True, out_sharding=P())


# ---- modules -------------------------------------------------------------------------------------------------------

MESHES = {
    "dp8": ((8,), ("data",), dict(data="data")),
    "dp2xtp4-sp": ((2, 4), ("data", "tensor"), dict(data="data", tensor="tensor", sequence_parallel=True)),
    "fsdp8": ((8,), ("fsdp",), dict(fsdp="fsdp")),
}
MODULES = ("dense", "mlp", "swiglu", "mha", "layer")


def _train_step(kind, mesh_name, axis_type):
  shape, names, rule_args = MESHES[mesh_name]
  mesh = _mesh(axis_type, shape, names)
  rules = te_flax.logical_axis_rules(**rule_args)
  model, v, shardings, x, target = init_case(kind, mesh, rules)
  act = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "act_embed"), rules))
  out_names = ("batch", None, "mlp") if kind == "dense" else ("batch", "seq", "act_embed")
  with te_jax.autocast(enabled=True, recipe=R.DelayedScaling(amax_history_len=4)), jax.set_mesh(mesh), \
      nn.logical_axis_rules(rules):
    step = jax.jit(train_step(model), out_shardings=(shardings, None, shardings))
    vs, xs = jax.device_put(v, shardings), jax.device_put(x, act)
    ts = jax.device_put(target, NamedSharding(mesh, nn.logical_to_mesh_axes(out_names, rules)))
    compiled = step.lower(vs, xs, ts).compile()
    return compiled(vs, xs, ts), collectives(compiled.as_text())


# Where the Explicit mesh still compiles a collective more than the Auto one, counted (kind, op, dtype): under FSDP
# a 1-D parameter (a bias or norm scale) is gathered in f32 where the Auto partitioner computes on its shards.
EXTRA = {("mlp", "fsdp8"): 1, ("swiglu", "fsdp8"): 1, ("mha", "fsdp8"): 1, ("layer", "fsdp8"): 3,
         ("layer", "dp2xtp4-sp"): 1}


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("kind", MODULES)
def test_module_train_step(kind, mesh_name):
  """A train step (forward, gradients, FP8 state update) of each module: bit for bit the Auto mesh's."""
  (explicit, c_explicit), (auto, c_auto) = (_train_step(kind, mesh_name, t) for t in KINDS)
  for e, a in zip(jax.tree.leaves(explicit), jax.tree.leaves(auto), strict=True):
    np.testing.assert_array_equal(np.asarray(e), np.asarray(a))
  extra = c_explicit - c_auto
  assert not c_auto - c_explicit, (dict(c_explicit), dict(c_auto))
  assert extra == collections.Counter({("all-gather", "", "f32"): EXTRA.get((kind, mesh_name), 0)}) - \
      collections.Counter(), (dict(c_explicit), dict(c_auto))


def test_nnx_dense_general_out_sharding():
  """te_jax.nnx.DenseGeneral(x, out_sharding=...) as nnx.LinearGeneral takes it: the output typed so, in high
  precision and FP8, row parallel; the FP8 GEMM reduce-scatters onto the wanted columns."""
  mesh = _mesh(AxisType.Explicit)
  layer = te_nnx.DenseGeneral(64, 128, use_bias=False, rngs=nnx.Rngs(0))
  x = _bf16(22, (256, 64))
  for recipe in (None, R.Float8CurrentScaling()):
    with jax.set_mesh(mesh):
      layer.kernel.value = jax.device_put(layer.kernel.value, P("model", None))
      xs = jax.device_put(x, P("data", "model"))

      @jax.jit
      def f(x):
        with te_jax.autocast(enabled=recipe is not None, recipe=recipe):
          return layer(x, out_sharding=P("data", "model"))

      y = f(xs)
      hlo = f.lower(xs).compile().as_text()
    assert _spec(y.sharding, 2) == ("data", "model")
    assert jax.typeof(y).sharding.spec == P("data", "model") or _spec(jax.typeof(y).sharding, 2) == ("data", "model")
    ref = te_jax.dense(x.astype(jnp.float32), layer.kernel[...], recipe=recipe)  # the layer computes in float32
    close = _assert_summation_close if recipe is None else _assert_fp8_close
    close(np.asarray(y, np.float32), np.asarray(ref, np.float32), y.dtype)
    if recipe is not None:  # te_jax's FP8 GEMM reduce-scatters (XLA:CPU all-reduces a high-precision dot and slices)
      assert collectives(hlo)[("reduce-scatter", "add", "f32")] == 1, dict(collectives(hlo))
