"""The block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling) through the fused ops and the
modules: each GEMM's operands are the quantize references' tensors (1 x 128 / 128 x 128, 1 x 32 E8M0, 1 x 16 E4M3
with a global scale) and the GEMM the emulated one (bfloat16 dequantization, float32 accumulation), on the CPU; no
FP8 state is kept; the linen and NNX modules train under autocast."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax import recipe
from te_jax._core.quantized_tensor import ScalingMode
from te_jax.fused.quantizer import quantizer_for
from te_jax.ops.quantize_block import quantize_block_ref, quantize_nvfp4_ref

BF16 = jnp.bfloat16
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FP8_ACCUM_U = 2.0**-14  # Hopper's FP8 MMA accumulator (tests/test_gemm.py)

# Exact references below need NVFP4 without its random parts; they are tested on their own.
RECIPES = {
    "block": recipe.Float8BlockScaling(),
    "block-f32-hybrid": recipe.Float8BlockScaling(power_of_two_scales=False, fp8_format=recipe.Format.HYBRID),
    "mxfp8": recipe.MXFP8BlockScaling(),
    "nvfp4-nearest": recipe.NVFP4BlockScaling(stochastic_rounding=False, random_hadamard_transform=False),
}


def _deq(q):
  return q.dequantize(BF16)


def _reference_cast(r, role, x, with_transposed=True):
  """The quantize reference's tensor of ``role`` for recipe ``r`` (x 2-D, its copy over its own rows)."""
  fwd = r.fp8_format.fwd_dtype if hasattr(r, "fp8_format") else None
  bwd = r.fp8_format.bwd_dtype if hasattr(r, "fp8_format") else None
  dtype = bwd if role == "grad" else fwd
  if isinstance(r, recipe.NVFP4BlockScaling):
    return quantize_nvfp4_ref(x, block_2d=role == "kernel" and r.weight_block_2d, with_transposed=with_transposed)
  if isinstance(r, recipe.MXFP8BlockScaling):
    return quantize_block_ref(x, ScalingMode.MXFP8_1X32, dtype, with_transposed=with_transposed)
  mode = ScalingMode.BLOCK_128X128 if role == "kernel" else ScalingMode.BLOCK_1X128
  return quantize_block_ref(x, mode, dtype, power_of_two_scales=r.power_of_two_scales,
                            with_transposed=with_transposed)


def _dot(a, b):
  """a (M, K) . b (N, K)^T in float32 from bfloat16 operands: the emulated GEMM."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.fast_cases(2)
def test_dense_forward_and_gradients_are_the_quantized_gemms(name):
  """Output, dgrad and wgrad are the emulated GEMMs of the reference-quantized operands: forward x (1 x B) with the
  kernel's transposed copy, dgrad the gradient with the kernel, wgrad the transposed copies of x and the gradient;
  the bias gradient the gradient's column sums."""
  r = RECIPES[name]
  m, k, n = 48, 256, 160
  x = jax.random.normal(jax.random.key(0), (m, k), BF16)
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.05
  b = jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  gy = jax.random.normal(jax.random.key(3), (m, n), BF16)

  y, vjp = jax.vjp(lambda x, w, b: te_jax.dense(x, w, b, recipe=r), x, w, b)
  dx, dw, db = vjp(gy)

  qx, qw, qg = _reference_cast(r, "x", x), _reference_cast(r, "kernel", w), _reference_cast(r, "grad", gy)
  want_y = (_dot(_deq(qx), _deq(qw.transposed())) + b.astype(BF16)).astype(BF16)  # the bias in the output dtype
  want_dx = _dot(_deq(qg), _deq(qw)).astype(BF16)
  want_dw = _dot(_deq(qx.transposed()), _deq(qg.transposed()))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32))
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(db), np.asarray(jnp.sum(gy.astype(jnp.float32), 0)), rtol=1e-6)


@pytest.mark.parametrize("name", ["block", "nvfp4"])
@pytest.mark.fast_cases(1)
def test_block_recipes_keep_no_state_and_declare_none(name):
  r = RECIPES.get(name, recipe.NVFP4BlockScaling())
  q = quantizer_for(r)
  assert q.state_variables == () and not q.stateful and not q.fused_cast
  layer = te_flax.LayerNormMLP(intermediate_dim=64)
  with te_jax.autocast(enabled=True, recipe=r):
    variables = layer.init(jax.random.key(0), jnp.ones((2, 16, 32), BF16), deterministic=True)
  assert set(variables) == {"params"}


def _hadamard_free_error(r, m=64, k=128, n=64, seed=0):
  """Relative errors of (y, dx, dw) of te_jax.dense under ``r`` against float32 math."""
  x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)
  w = jax.random.normal(jax.random.key(seed + 1), (k, n), jnp.float32) / np.sqrt(k)
  x = x.at[:, 3].multiply(30.0).astype(BF16)  # an outlier channel: what the Hadamard transform spreads
  gy = jax.random.normal(jax.random.key(seed + 2), (m, n), BF16)
  got = jax.vjp(lambda x, w: te_jax.dense(x, w, recipe=r), x, w)
  want = jax.vjp(lambda x, w: x.astype(jnp.float32) @ w, x, w)
  pairs = [(got[0], want[0]), *zip(got[1](gy), want[1](gy.astype(jnp.float32)))]
  return [float(jnp.linalg.norm(a.astype(jnp.float32) - c) / jnp.linalg.norm(c)) for a, c in pairs]


def test_nvfp4_rounding_and_hadamard_transform():
  """Stochastic rounding of gradients and the Hadamard transform of the weight gradient's operands: deterministic
  for the same inputs, different from round to nearest, and within NVFP4's error of float32 math (the transform
  cancels in the product: the weight gradient is not made worse by it)."""
  full = recipe.NVFP4BlockScaling()
  nearest = RECIPES["nvfp4-nearest"]
  e_full, e_near = _hadamard_free_error(full), _hadamard_free_error(nearest)
  assert e_full == _hadamard_free_error(full)  # the same bits twice: no hidden randomness
  assert e_full != e_near
  # The forward has neither; only its global scale moves (shared with the transformed copy, whose amax may be larger).
  assert abs(e_full[0] - e_near[0]) < 0.05 * e_near[0], (e_full, e_near)
  assert all(e < 0.25 for e in e_full), e_full
  assert e_full[2] < 1.5 * e_near[2], (e_full, e_near)


def test_nvfp4_hadamard_transform_needs_whole_token_blocks():
  """Rows kept as (B, S, K): the weight gradient's operands are (K, B, S), transformed over blocks of S."""
  quantizer = quantizer_for(recipe.NVFP4BlockScaling())
  x = jnp.ones((2, 20, 32), BF16)
  with pytest.raises(ValueError, match=r"blocks of 16 tokens.*random_hadamard_transform=False"):
    quantizer.quantize("x", None, x, quantizer.fwd_dtype, transpose=True, transpose_batch_dims=0)
  q = quantizer.quantize("x", None, jnp.ones((2, 32, 32), BF16), quantizer.fwd_dtype, transpose=True,
                         transpose_batch_dims=0).out
  assert q.data_t.shape == (32, 2, 32) and q.scale_inv_t.shape == (32, 2, 2)


@pytest.mark.parametrize("bad,match", [
    (dict(power_of_two_scales=1), r"power_of_two_scales must be a bool"),
    (dict(fp8_format="E4M3"), r"fp8_format must be a te_jax.recipe.Format"),
])
def test_block_recipe_arguments_are_checked(bad, match):
  with pytest.raises(ValueError, match=match):
    recipe.Float8BlockScaling(**bad)


def test_nvfp4_recipe_arguments_are_checked():
  with pytest.raises(ValueError, match=r"stochastic_rounding must be a bool"):
    recipe.NVFP4BlockScaling(stochastic_rounding="yes")
  with pytest.raises(ValueError, match=r"hadamard_seed must be an int >= 0"):
    recipe.NVFP4BlockScaling(hadamard_seed=-1)


@pytest.mark.fast_cases(1)
@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(), recipe.MXFP8BlockScaling(), recipe.NVFP4BlockScaling()],
                         ids=["block", "mxfp8", "nvfp4"])
def test_linen_and_nnx_layers_train_under_autocast(r):
  """A TransformerLayer in linen and in NNX, the same parameters: outputs equal, and two optax steps under
  ``autocast(recipe=r)`` lower the loss in both."""
  x = jax.random.normal(jax.random.key(0), (2, 16, 32), BF16)
  kw = dict(hidden_size=32, intermediate_dim=64, num_attention_heads=2, layer_type="encoder", hidden_dropout=0.0,
            attention_dropout=0.0)
  linen = te_flax.TransformerLayer(**kw)
  with te_jax.autocast(enabled=True, recipe=r):
    variables = linen.init(jax.random.key(1), x, deterministic=True)
  assert set(variables) == {"params"}
  model = te_nnx.TransformerLayer(**kw, rngs=nnx.Rngs(0))
  te_nnx.from_linen(model, variables)
  with te_jax.autocast(enabled=True, recipe=r):
    np.testing.assert_array_equal(np.asarray(linen.apply(variables, x, deterministic=True), np.float32),
                                  np.asarray(model(x, deterministic=True), np.float32))

  def loss(v):
    return jnp.mean(linen.apply(v, x, deterministic=True).astype(jnp.float32) ** 2)

  tx = optax.adam(1e-2)
  opt = tx.init(variables)
  losses = []
  with te_jax.autocast(enabled=True, recipe=r):
    step = jax.jit(jax.value_and_grad(loss))
    for _ in range(2):
      value, grads = step(variables)
      updates, opt = tx.update(grads, opt)
      variables = optax.apply_updates(variables, updates)
      losses.append(float(value))
  assert losses[-1] < losses[0], losses

  def nnx_loss(m):
    return jnp.mean(m(x, deterministic=True).astype(jnp.float32) ** 2)

  nnx_losses = []
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  with te_jax.autocast(enabled=True, recipe=r):
    for _ in range(2):
      value, grads = te_nnx.value_and_grad(nnx_loss)(model)
      optimizer.update(model, grads)
      nnx_losses.append(float(value))
  assert nnx_losses[-1] < nnx_losses[0], nnx_losses


def test_scan_and_remat_run_block_scaling():
  """No state: a stack of DenseGeneral layers under nn.scan with nn.remat gives the unscanned stack's values."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return te_flax.DenseGeneral(64, name="dense")(h).astype(h.dtype), None

  Stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
  x = jax.random.normal(jax.random.key(0), (16, 64), BF16)
  r = recipe.Float8BlockScaling()
  with te_jax.autocast(enabled=True, recipe=r):
    v = Stack().init(jax.random.key(1), x, None)
    y, grads = jax.value_and_grad(lambda v: jnp.sum(Stack().apply(v, x, None)[0].astype(jnp.float32)))(v)
    h = x
    for i in range(2):
      layer = jax.tree.map(lambda a, i=i: a[i], v["params"]["dense"])
      h = te_jax.dense(h, layer["kernel"], layer.get("bias"), recipe=r).astype(h.dtype)
  np.testing.assert_allclose(float(y), float(jnp.sum(h.astype(jnp.float32))), rtol=1e-6)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("r", [recipe.Float8BlockScaling(), recipe.NVFP4BlockScaling()], ids=["block", "nvfp4"])
@pytest.mark.fast_cases(1)
def test_dense_sharded_as_on_one_device(r):
  """The batch over 4 devices and the kernel's features over 2 (data x tensor parallel), jitted with NamedSharding:
  the output as on one device bit for bit (block scales are local to their blocks), the gradients within the rounding
  of their sharded contractions, and no all-gather of an activation or its gradient."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from parallel_model import collectives

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  # 128 tokens and 128 features a shard: the weight gradient's 1 x 128 blocks run along the tokens, the kernel's
  # 128 x 128 blocks over its features, whole in each shard.
  x = jax.random.normal(jax.random.key(0), (512, 256), BF16)
  w = jax.random.normal(jax.random.key(1), (256, 256), jnp.float32) * 0.05
  gy = jax.random.normal(jax.random.key(2), (512, 256), BF16)

  def step(x, w):
    y, vjp = jax.vjp(lambda x, w: te_jax.dense(x, w, recipe=r), x, w)
    return y, *vjp(gy)

  want = jax.jit(step)(x, w)
  shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  xs, ws = shard(x, P("data", None)), shard(w, P(None, "model"))
  sharded = jax.jit(step)
  got = sharded(xs, ws)
  (y, dx, dw), (want_y, want_dx, want_dw) = got, want
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
  # dgrad contracts the sharded features, wgrad the sharded batch: each shard's partial product is rounded to the
  # output dtype (bfloat16 for dx, as the per-tensor and the BF16 layers do) and the partials are added: within a
  # rounding of bfloat16 (float32 for dw) of the unsharded result, in norm.
  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(dx, want_dx) < 2**-8, rel(dx, want_dx)
  assert rel(dw, want_dw) < 2**-20, rel(dw, want_dw)
  gathers = [c for c in collectives(sharded.lower(xs, ws).compile().as_text()) if c[0] == "all-gather"]
  assert not any(dtype in ("bf16", "f8e4m3fn", "f4e2m1fn") and kind for kind, _, dtype in gathers), gathers


def test_a_block_straddling_shards_raises():
  """The kernel's 128 x 128 blocks over 128 features split over 2 devices: a clear error naming the dim, the mesh
  axis and the block, not a quantization that depends on the mesh."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jnp.ones((128, 256), BF16)
  w = jax.device_put(jnp.ones((256, 128), jnp.float32), NamedSharding(mesh, P(None, "model")))
  with pytest.raises(Exception, match=r"sharded over mesh axis model into 2 shards.*BLOCK_128X128 blocks of 128"):
    jax.jit(lambda x, w: te_jax.dense(x, w, recipe=recipe.Float8BlockScaling()))(x, w)


@pytest.mark.gpu
def test_block_scaled_dense_runs_native_on_the_gpu(gpu):
  """On the GPU, Float8BlockScaling's three GEMMs run through te_gemm_cuda (cuBLASLt's block-scaled kernels on
  compute capability 9.0) and each is within the tolerance rule of the float64 product of its dequantized operands,
  against the emulated GEMM (bfloat16 dequantization) as the same math at our precision, plus the noise term of
  Hopper's FP8 MMA accumulator (about 14 bits kept within each 128-wide K block before the float32 promotion), as in
  tests/test_gemm_block.py: ``sqrt(K) * 2**-14 * max sum|a||b|``. The float32 wgrad shows it; the bfloat16 outputs'
  rounding hides it."""
  r = recipe.Float8BlockScaling()
  m, k, n = 1024, 512, 768
  x = jax.device_put(jax.random.normal(jax.random.key(0), (m, k), BF16), gpu)
  w = jax.device_put(jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.05, gpu)
  gy = jax.device_put(jax.random.normal(jax.random.key(2), (m, n), BF16), gpu)

  def step(x, w):
    y, vjp = jax.vjp(lambda x, w: te_jax.dense(x, w, recipe=r), x, w)
    return y, *vjp(gy)

  hlo = jax.jit(step).lower(x, w).compile().as_text()
  assert "te_gemm_cuda" in hlo
  y, dx, dw = jax.jit(step)(x, w)
  # The reference operands as XLA:CPU computes the quantize reference: its float32 divisions are IEEE's, as the
  # kernels' are (XLA:GPU's compilation of the reference rounds some block scales differently).
  cpu = jax.devices("cpu")[0]
  qx, qw, qg = (_reference_cast(r, role, jax.device_put(v, cpu))
                for role, v in (("x", x), ("kernel", w), ("grad", gy)))
  f64 = lambda q: np.asarray(q.dequantize(jnp.float32), np.float64)  # noqa: E731
  emu = lambda a, b: np.asarray(_dot(_deq(a), _deq(b)), np.float64)  # noqa: E731  (on the CPU, with its operands)
  for name, got, a, b in (("forward", y, qx, qw.transposed()), ("dgrad", dx, qg, qw),
                           ("wgrad", dw, qx.transposed(), qg.transposed())):
    exact = f64(a) @ f64(b).T
    ours = np.asarray(got, np.float64)
    same_math = emu(a, b)
    if got.dtype == BF16:  # rounded to the output dtype, as the layer's output is
      same_math = np.asarray(jnp.asarray(same_math, jnp.float32).astype(BF16), np.float64)
    err, ref_err = np.max(np.abs(ours - exact)), np.max(np.abs(same_math - exact))
    k = f64(a).shape[-1]
    noise = np.sqrt(k) * FP8_ACCUM_U * float((np.abs(f64(a)) @ np.abs(f64(b)).T).max())
    assert err <= 2 * ref_err + noise, (name, err, ref_err, noise)
