"""te_jax's layers inside ``jax.shard_map`` on 8 CPU devices (forced in conftest.py).

A train step written per device (data parallel: replicated parameters, batch-sharded input; tensor parallel: column- and
row-sharded kernels; FSDP: kernels all-gathered where used) must give what the same step gives under ``jax.jit`` on the
global arrays: the outputs, the parameter gradients (summed over the batch shards by the cast of each replicated weight
to the input's varying axes, as jax's own ops do) and the FP8 scales, which are those of the whole tensors
(delayed-scaling states from the max-reduced amaxes, current scaling from the whole tensor's amax).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as te_flax
from te_jax.recipe import DelayedScaling, Float8CurrentScaling
from conftest import rel_error
from te_jax.ops.gemm import gemm
from test_sharding import all_reduces

RECIPES = {"bf16": None, "delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling()}


def _mesh(shape, names):
  return Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)


def _rows_of_many_scales(shape, seed):
  """Rows whose magnitudes rise from 2^0 to 2^7 in 8 blocks, so each batch shard of up to 8 has an amax of its own."""
  rng = np.random.default_rng(seed)
  rows = np.exp2(np.arange(shape[0]) * 8 // shape[0]).reshape(-1, *(1,) * (len(shape) - 1))
  return jnp.asarray(rng.standard_normal(shape) * rows, jnp.float32)


def _assert_close_trees(got, want, fp8: bool, what: str):
  """float32 within summation-order rounding (relative to each tensor's largest element); under FP8 an E5M2 gradient
  element may flip by a quarter of its value where such a difference crosses a rounding boundary (~1e-5 in norm),
  while a per-shard scale moves whole tensors (>= 1e-2)."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
    name = f"{what}{jax.tree_util.keystr(path)}"
    if fp8:
      assert rel_error(a, b) < 1e-3, (name, rel_error(a, b))
    else:
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))), err_msg=name)


def _layer_step(layer, global_size: int):
  """One train step's pieces: the output, and the gradients of mean(y) over the global batch w.r.t. the variables
  (params and FP8 state: the state's "gradient" is its update)."""

  def step(v, x):
    y, vjp = jax.vjp(lambda v: layer.apply(v, x, deterministic=True), v)
    return y, vjp(jnp.full_like(y, 1.0 / global_size))[0]

  return step


def _next_variables(v, g):
  """SGD on the parameters; the FP8 state overwritten by its update, as TrainState.apply_gradients does."""
  out = {"params": jax.tree.map(lambda p, d: p - 0.1 * d, v["params"], g["params"])}
  if te_jax.FP8_COLLECTION in v:
    out[te_jax.FP8_COLLECTION] = g[te_jax.FP8_COLLECTION]
  return out


@pytest.mark.slow  # 8-device parallel steps
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_data_parallel_layer_steps_match_jit(recipe):
  """Three train steps of a decoder TransformerLayer per device (batch over 8 shards, replicated variables and
  out_specs P() for them) against the same steps under jit: outputs, gradients and FP8 states agree at every step."""
  rec = RECIPES[recipe]
  mesh = _mesh((8,), ("data",))
  layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type="decoder",
                                   enable_rotary_pos_emb=True, dtype=jnp.float32, backend="unfused")
  x = _rows_of_many_scales((16, 8, 32), seed=1)
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    v = layer.init(jax.random.key(2), x, deterministic=True)
    step = _layer_step(layer, x.size)
    on_jit = jax.jit(step)
    per_device = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P())))
    v_jit = v_sm = v
    for i in range(3):
      y_jit, g_jit = on_jit(v_jit, x)
      y_sm, g_sm = per_device(v_sm, x)
      np.testing.assert_allclose(y_sm, y_jit, rtol=1e-5, atol=1e-5, err_msg=f"step {i}: y")
      _assert_close_trees(g_sm, g_jit, rec is not None, f"step {i}: ")
      v_jit, v_sm = _next_variables(v_jit, g_jit), _next_variables(v_sm, g_sm)
  if isinstance(rec, DelayedScaling):
    hist = jax.tree.leaves(v_sm[te_jax.FP8_COLLECTION])
    assert any(np.count_nonzero(np.asarray(h)) >= 3 for h in hist)  # the histories really rolled


def _dense_with_state(x, recipe):
  layer = te_flax.DenseGeneral(32, dtype=jnp.float32, use_bias=True)
  with te_jax.autocast(enabled=True, recipe=recipe):
    v = layer.init(jax.random.key(3), x)
  return layer, v


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_delayed_state_sees_the_whole_tensors_amax(check_vma):
  """The updated history of a replicated state holds the amax of the whole input, kernel and output gradient (not
  one shard's), exactly; also with check_vma=False, where the step must psum the gradients itself."""
  mesh = _mesh((8,), ("data",))
  x = _rows_of_many_scales((64, 16), seed=4)
  recipe = DelayedScaling(amax_history_len=4)
  layer, v = _dense_with_state(x, recipe)
  g_out = _rows_of_many_scales((64, 32), seed=5)[::-1]  # the largest gradient rows on other shards than x's

  def step(v, x, g_out):
    y, vjp = jax.vjp(lambda v: layer.apply(v, x), v)
    g = vjp(g_out)[0]
    if not check_vma:
      g = {"params": jax.lax.psum(g["params"], "data"), te_jax.FP8_COLLECTION: g[te_jax.FP8_COLLECTION]}
    return g

  with te_jax.autocast(enabled=True, recipe=recipe):
    g = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                              check_vma=check_vma))(v, x, g_out)
    g_jit = jax.jit(step if check_vma else lambda v, x, g_out: jax.vjp(lambda v: layer.apply(v, x), v)[1](g_out)[0])(
        v, x, g_out)
  state = g[te_jax.FP8_COLLECTION]
  kernel = v["params"]["kernel"]
  for name, tensor in (("x", x), ("kernel", kernel), ("grad", g_out)):
    np.testing.assert_array_equal(np.asarray(state[f"{name}_amax_history"], np.float32)[0],
                                  np.max(np.abs(np.asarray(tensor))), err_msg=name)
  _assert_close_trees(g, g_jit, True, "")


def _pmax_sizes(jaxpr) -> list[int]:
  """The element counts of the pmax reductions in a jaxpr, its sub-jaxprs included (shard_map, pjit, custom_vjp)."""
  sizes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pmax":
      sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.invars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sizes.extend(_pmax_sizes(sub.jaxpr))
        elif isinstance(sub, jax.extend.core.Jaxpr):
          sizes.extend(_pmax_sizes(sub))
  return sizes


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_data_parallel_amax_reductions(recipe):
  """The collectives a data-parallel FP8 dense step adds for its scales: under DelayedScaling one max-reduction of
  the three amaxes together (in the backward); under current scaling one for the input and one for the output
  gradient, none for the replicated kernel. (XLA may then combine reductions; this counts what te_jax asks for.)"""
  rec = RECIPES[recipe]
  mesh = _mesh((8,), ("data",))
  x = _rows_of_many_scales((64, 16), seed=6)
  layer, v = _dense_with_state(x, rec)

  def step(v, x):
    y, vjp = jax.vjp(lambda v: layer.apply(v, x), v)
    return vjp(jnp.ones_like(y))[0]

  with te_jax.autocast(enabled=True, recipe=rec):
    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    sizes = _pmax_sizes(jax.make_jaxpr(f)(v, x).jaxpr)
    hlo = jax.jit(f).lower(v, x).compile().as_text()
  assert sizes == ([3] if recipe == "delayed" else [1, 1]), sizes
  assert set(all_reduces(hlo)) == {"maximum", "add"}, all_reduces(hlo)


def _mlp(x, w1, w2, metas, recipe):
  h = te_jax.dense(x, w1, fp8_meta=metas[0], recipe=recipe)
  return te_jax.dense(jax.nn.gelu(h), w2, fp8_meta=metas[1], recipe=recipe)


def _all_gather_rows(w):
  return jax.lax.all_gather(w, "data", axis=0, tiled=True)


# (mesh, kernel specs, what the per-device step does with the kernels and the output)
PARALLEL = {
    # first kernel column-sharded, second row-sharded over "model", the output psum-reduced; batch over "data"
    "tp": (((2, 4), ("data", "model")), (P(None, "model"), P("model")), lambda w: w,
           lambda y: jax.lax.psum(y, "model")),
    # FSDP: both kernels' rows sharded over "data", all-gathered where they are used
    "fsdp": (((8,), ("data",)), (P("data"), P("data")), _all_gather_rows, lambda y: y),
}


@pytest.mark.slow  # 8-device parallel steps
@pytest.mark.parametrize("layout", list(PARALLEL))
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_model_parallel_mlp_matches_jit(recipe, layout):
  """A two-dense MLP per device, tensor parallel or FSDP: output, kernel gradients and delayed states as under jit
  on the whole kernels."""
  rec = RECIPES[recipe]
  (shape, names), kernel_specs, use_kernel, reduce_out = PARALLEL[layout]
  rng = np.random.default_rng(7)
  x = _rows_of_many_scales((32, 16), seed=8)
  w1 = jnp.asarray(rng.standard_normal((16, 64)) * np.exp2(np.arange(64) % 4), jnp.float32)  # shards differ
  w2 = jnp.asarray(rng.standard_normal((64, 16)) * np.exp2(np.arange(64) % 4)[:, None], jnp.float32)
  metas = (te_jax.DenseFp8Meta.create(4), te_jax.DenseFp8Meta.create(4)) if recipe == "delayed" else (None, None)

  def grads(x, w1, w2, metas, use_kernel=lambda w: w, reduce_out=lambda y: y):
    f = lambda w1, w2, m: reduce_out(_mlp(x, use_kernel(w1), use_kernel(w2), m, rec))  # noqa: E731
    y, vjp = jax.vjp(f, w1, w2, metas)
    return y, vjp(jnp.ones_like(y))

  y_jit, (d1_jit, d2_jit, m_jit) = jax.jit(grads)(x, w1, w2, metas)
  per_device = jax.shard_map(functools.partial(grads, use_kernel=use_kernel, reduce_out=reduce_out),
                             mesh=_mesh(shape, names), in_specs=(P("data"), *kernel_specs, P()),
                             out_specs=(P("data"), (*kernel_specs, P())))
  y_sm, (d1_sm, d2_sm, m_sm) = jax.jit(per_device)(x, w1, w2, metas)
  assert rel_error(y_sm, y_jit) < 1e-3, rel_error(y_sm, y_jit)  # an E4M3 rounding of the hidden layer may flip
  assert rel_error(d1_sm, d1_jit) < 1e-3 and rel_error(d2_sm, d2_jit) < 1e-3, (rel_error(d1_sm, d1_jit), rel_error(d2_sm, d2_jit))
  if recipe == "delayed":
    for a, b in zip(jax.tree.leaves(m_sm), jax.tree.leaves(m_jit), strict=True):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6)
    assert float(m_sm[0].kernel.amax_history[0]) == float(np.max(np.abs(np.asarray(w1))))
    assert float(m_sm[1].kernel.amax_history[0]) == float(np.max(np.abs(np.asarray(w2))))


def test_primitives_vary_over_every_operands_axes():
  """A te_jax GEMM of an lhs varying over "data" with an rhs varying over "model" varies over both (jax's own dot
  does the same): out_specs that claim less fail to type-check instead of returning one shard's values."""
  mesh = _mesh((2, 4), ("data", "model"))
  lhs = jnp.ones((32, 16), jnp.bfloat16)
  rhs = jnp.ones((16, 64), jnp.bfloat16)

  def local(a, b):
    out = gemm(a, b)
    assert jax.typeof(out).manual_axis_type.varying == {"data", "model"}, jax.typeof(out)
    return out

  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(None, "model")),
                              out_specs=P("data", "model")))(lhs, rhs)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 16.0)
  with pytest.raises(Exception, match="model"):
    jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(None, "model")), out_specs=P("data")))(lhs, rhs)



@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dpa", [False, True], ids=["bf16-attention", "fp8-attention"])
def test_gpu_layer_step_in_shard_map_matches_jit(gpu, fp8_dpa):
  """On a one-GPU mesh (its axis still typed as varying): the FP8 layer's step with te_jax's CUDA kernels and cuDNN
  attention gives the jit step's output, gradients and state."""
  import re  # noqa: PLC0415

  mesh = Mesh(np.array([gpu]), ("data",))
  layer = te_flax.TransformerLayer(hidden_size=256, intermediate_dim=1024, num_attention_heads=2, layer_type="decoder",
                                   self_attn_mask_type="causal", dtype=jnp.bfloat16)
  x = jax.device_put(_rows_of_many_scales((2, 128, 256), seed=9).astype(jnp.bfloat16), gpu)
  rec = DelayedScaling(amax_history_len=4, fp8_dpa=fp8_dpa)
  with te_jax.autocast(enabled=True, recipe=rec):
    v = jax.device_put(layer.init(jax.random.key(10), x, deterministic=True), gpu)
    step = _layer_step(layer, x.size)
    per_device = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P())))
    hlo = per_device.lower(v, x).compile().as_text()
    y_sm, g_sm = per_device(v, x)
    y_jit, g_jit = jax.jit(step)(v, x)
  targets = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
  for t in ("te_gemm_cuda", "te_norm_fwd_cuda", "te_norm_bwd_cuda", "te_act_fwd_cuda", "te_act_bwd_cuda"):
    assert t in targets, (t, sorted(targets))
  assert ("__cudnn$fmhaSoftmaxF8" in targets) == fp8_dpa, sorted(targets)
  assert rel_error(np.asarray(y_sm, np.float32), np.asarray(y_jit, np.float32)) < 1e-3
  _assert_close_trees(g_sm, g_jit, True, "")
