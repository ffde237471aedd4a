"""te_flax modules as drop-ins for Flax's: whatever ``nn.DenseGeneral`` accepts works, under FP8 too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from te_jax.recipe import DelayedScaling

FP8 = te_jax.FP8_COLLECTION
RECIPE = DelayedScaling(amax_history_len=4)
X = jax.random.normal(jax.random.key(0), (2, 8, 32), jnp.float32)


def _same_as_flax(kwargs, x=X, **apply_kwargs):
  ours, theirs = te_flax.DenseGeneral(**kwargs), nn.DenseGeneral(**kwargs)
  v = theirs.init(jax.random.key(1), x)
  np.testing.assert_array_equal(np.asarray(ours.apply(v, x, **apply_kwargs)), np.asarray(theirs.apply(v, x)))
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(1), x)) == jax.tree.map(jnp.shape, v)
  return v


@pytest.mark.parametrize("kwargs", [
    dict(features=4), dict(features=(2, 3), axis=(-1,)), dict(features=16, batch_dims=(0,)),
    dict(features=(4, 4), axis=(-2, -1), batch_dims=(0,)), dict(features=16, precision=jax.lax.Precision.HIGHEST),
    dict(features=16, dot_general=jax.lax.dot_general), dict(features=16, use_bias=False),
], ids=["head-4", "tuple", "batch-dims", "batch-dims-2-axes", "precision", "dot-general", "no-bias"])
def test_matches_flax_dense_general(kwargs):
  _same_as_flax(kwargs)


def test_unaligned_head_under_fp8_runs_in_high_precision_and_keeps_its_state():
  """A 4-class head cannot be an FP8 GEMM (sizes multiples of 16): it runs as Flax's would, and a train step hands
  its FP8 state back unchanged."""
  head = te_flax.DenseGeneral(features=4)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    v = head.init(jax.random.key(1), X)
    np.testing.assert_array_equal(np.asarray(head.apply(v, X)), np.asarray(nn.DenseGeneral(4).apply(v, X)))
    state = train_state.TrainState.create(apply_fn=head.apply, params=v, tx=optax.sgd(0.1))
    after = state.apply_gradients(grads=jax.grad(lambda p: jnp.sum(head.apply(p, X) ** 2))(state.params))
  jax.tree.map(np.testing.assert_array_equal, after.params[FP8], v[FP8])
  assert not np.array_equal(after.params["params"]["kernel"], v["params"]["kernel"])


@pytest.mark.parametrize("make", [
    lambda: te_flax.DenseGeneral(features=(2, 8), unstack_axis=-2),
    lambda: te_flax.LayerNormDenseGeneral(features=(2, 24), unstack_axis=-2),
    lambda: te_flax.LayerNormDenseGeneral(features=4),
    lambda: te_flax.LayerNormMLP(intermediate_dim=20, activation_type=("silu", "linear")),
], ids=["dense-2x8", "ln-dense-2x24", "ln-dense-4", "ln-mlp-20"])
def test_gemms_fp8_cannot_take_run_in_high_precision(make):
  """A layer whose GEMMs FP8 cannot take (a size not a multiple of 16: the whole width, or each part's of a projection
  handed out in parts, which the forward runs as a batch of GEMMs) computes under delayed scaling exactly what it
  computes without FP8, gradients included, and hands its state back unchanged."""
  x = jnp.ones((2, 16, 32), jnp.float32) * jnp.linspace(-1, 1, 32)
  module = make()
  loss = lambda v: sum(jnp.sum(o ** 2) for o in jax.tree.leaves(module.apply(v, x)))  # noqa: E731
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    v = module.init(jax.random.key(1), x)
    got, grads = jax.value_and_grad(loss)(v)
  want, want_grad = jax.value_and_grad(loss)({"params": v["params"]})
  np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, grads["params"], want_grad["params"])
  jax.tree.map(np.testing.assert_array_equal, grads[FP8], v[FP8])


@pytest.mark.parametrize("head_dim,fuse", [(8, True), (24, True), (40, False)])
def test_multi_query_attention_with_unaligned_kv_parts_trains_under_fp8(head_dim, fuse):
  """MQA whose key and value parts are each ``head_dim`` wide (8 mod 16) while together they are a multiple of 16:
  the kv projection runs in high precision, the rest in FP8; the step's loss is FP8's distance from BF16's."""
  x = jnp.ones((2, 16, 32), jnp.float32) * jnp.linspace(-1, 1, 32)
  module = te_flax.MultiHeadAttention(head_dim=head_dim, num_attention_heads=4, num_gqa_groups=1,
                                      fuse_qkv_params=fuse)
  loss = lambda v: jnp.sum(module.apply(v, x, x)[0] ** 2)  # noqa: E731
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    v = module.init(jax.random.key(1), x, x)
    got, grads = jax.value_and_grad(loss)(v)
  want = loss({"params": v["params"]})
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(got, want, rtol=0.1)  # E4M3's 2**-4 relative rounding, through two GEMMs


@pytest.mark.parametrize("module", ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"])
def test_logically_partitioned_initializers(module):
  """Initializers that name their axes (nn.with_logical_partitioning, as partitioned Flax models write them) keep
  their names on the parameters, reshaped as Flax's DenseGeneral reshapes them; names given both ways raise."""
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  make = {"DenseGeneral": lambda **kw: te_flax.DenseGeneral(features=16, kernel_init=init, **kw),
          "LayerNormDenseGeneral": lambda **kw: te_flax.LayerNormDenseGeneral(features=16, kernel_init=init, **kw),
          "LayerNormMLP": lambda **kw: te_flax.LayerNormMLP(intermediate_dim=16, kernel_init=init, **kw)}[module]
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    v = make().init(jax.random.key(1), X)
    out = make().apply(v, X)
  assert out.shape[:2] == X.shape[:2]
  specs = nn.get_partition_spec(v)["params"]
  kernel = specs.get("kernel", specs.get("wi_kernel"))
  assert isinstance(kernel, jax.sharding.PartitionSpec) and "embed" in tuple(kernel)
  if module == "DenseGeneral":
    flax_v = nn.DenseGeneral(features=16, kernel_init=init).init(jax.random.key(1), X)
    assert nn.get_partition_spec(flax_v)["params"]["kernel"] == kernel
    with pytest.raises(ValueError, match="names the parameter's axes already"):
      make(kernel_axes=("embed", "mlp")).init(jax.random.key(1), X)


def test_argument_errors_name_the_argument():
  with pytest.raises(ValueError, match="batch_dims .* must be consecutive leading dimensions"):
    te_flax.DenseGeneral(features=4, batch_dims=(1,)).init(jax.random.key(0), X)
  with pytest.raises(ValueError, match="dot_general or dot_general_cls, not both"):
    te_flax.DenseGeneral(features=4, dot_general=jax.lax.dot_general,
                         dot_general_cls=te_flax.Fp8DotGeneral).init(jax.random.key(0), X)


# A lm1b-sized attention: 512 features, 8 heads of 64. The sample std of n draws has a relative standard error of
# about 1 / sqrt(2 n) (0.14% for a 512 x 512 part); the test allows five of them (of the two samples compared). A fan
# computed from the fused kernel is off by 9% to 42% (fan_avg over k, v: 9%; fan_avg over q, k, v: sqrt(2); fan_out:
# sqrt(2) or sqrt(3)); lecun_normal's fan_in is the same either way, and is there for the values' check.
QKV_INITS = {
    "xavier_uniform": nn.initializers.xavier_uniform(),
    "fan_out_normal": nn.initializers.variance_scaling(1.0, "fan_out", "normal"),
    "lecun_normal": nn.initializers.lecun_normal(),
    "logical_xavier": nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "heads", "qkv", "kv")),
}


@pytest.mark.parametrize("kernel", ["qkv", "kv"])
@pytest.mark.parametrize("init_name", list(QKV_INITS))
@pytest.mark.fast_cases(2)
def test_fused_qkv_parts_are_initialized_as_separate_kernels(init_name, kernel):
  """Each part of a fused q/k/v (or k/v) kernel has the distribution of Flax's separate query kernel for the same
  kernel_init, and is exactly ``kernel_init`` on one part's 2-D shape with its own key of ``jax.random.split``."""
  hidden, heads, head_dim = 512, 8, 64
  init = QKV_INITS[init_name]
  calls = []

  def recording(key, shape, dtype=jnp.float32):
    calls.append((key, shape))
    return init(key, shape, dtype)

  x = jnp.zeros((1, 4, hidden))
  # GQA (2 key/value heads of 8) gives a query kernel and a fused (hidden, 2, 2, D) key/value one.
  mha = te_flax.MultiHeadAttention(head_dim=head_dim, num_attention_heads=heads, input_layernorm=False,
                                   num_gqa_groups=heads if kernel == "qkv" else 2, kernel_init=recording)
  params = nn.unbox(mha.init(jax.random.key(0), x, deterministic=True)["params"])
  fused = params[kernel]["kernel"]
  parts, kv_heads = (3, heads) if kernel == "qkv" else (2, 2)
  assert fused.shape == (hidden, kv_heads, parts, head_dim)
  # Flax's separate kernel of one part: the query kernel of its attention (8 heads); for GQA's key/value heads,
  # a DenseGeneral to (2, 64), as a separate key or value kernel of 2 heads would be.
  if kernel == "qkv":
    flax_part = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=heads * head_dim, kernel_init=init).init(
        jax.random.key(1), x)["params"]["query"]["kernel"]
  else:
    flax_part = nn.DenseGeneral(features=(kv_heads, head_dim), kernel_init=init).init(jax.random.key(1), x)[
        "params"]["kernel"]
  flax_std = float(jnp.std(nn.unbox(flax_part)))
  n = hidden * kv_heads * head_dim
  tol = 5 * np.sqrt(1 / (2 * n) + 1 / (2 * n))
  for i in range(parts):
    std = float(jnp.std(fused[:, :, i]))
    assert abs(std / flax_std - 1) < tol, (init_name, i, std, flax_std)
  # The initializer's calls for this kernel: one per part, on one part's 2-D shape, with distinct keys (the first
  # calls of that shape: the output projection's (512, 512) comes later).
  mine = [(k, s) for k, s in calls if s == (hidden, kv_heads * head_dim)][:parts]
  assert len({str(jax.random.key_data(k)) for k, _ in mine}) == parts
  for i, (key, shape) in enumerate(mine):
    want = nn.unbox(init(key, shape, jnp.float32)).reshape(hidden, kv_heads, head_dim)
    np.testing.assert_array_equal(fused[:, :, i], want)


def test_fused_parts_use_the_split_key():
  """``flat_init`` with a part axis: part i is the initializer on one part's 2-D shape with key
  ``jax.random.split(rng, parts)[i]``."""
  from te_jax.flax.params import flat_init  # noqa: PLC0415

  init = nn.initializers.xavier_uniform()
  rng = jax.random.key(3)
  kernel = flat_init(init, 1, part_axis=2)(rng, (16, 2, 3, 4), jnp.float32)
  for i, key in enumerate(jax.random.split(rng, 3)):
    np.testing.assert_array_equal(kernel[:, :, i], init(key, (16, 8), jnp.float32).reshape(16, 2, 4))
