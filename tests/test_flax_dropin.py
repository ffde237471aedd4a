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
