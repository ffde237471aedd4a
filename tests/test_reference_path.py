"""The pure-JAX reference path (``TE_JAX_REFERENCE=1``, or any op without a native handler here) against the native
CPU handlers, under ``jax.jit``: the README's FP8 MLP step gives the same loss and gradients bit for bit.

Where XLA feeds a bfloat16 producer's result to the next op in float32 (excess precision), the reference, lowered
inline, would otherwise read unrounded values that the handler never sees. The bias gradients are float32 column
sums, which the handler and XLA add in different orders: those agree within float32 summation error."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax.flax as te_flax
from te_jax._core import native
from te_jax.recipe import DelayedScaling


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(te_flax.DenseGeneral(256, dtype=jnp.bfloat16)(x))
    return te_flax.DenseGeneral(64, dtype=jnp.bfloat16)(x)


def _step(monkeypatch, reference: bool):
  if reference:
    monkeypatch.setitem(native.registered, "cpu", [])
  model, x = MLP(), jax.random.normal(jax.random.key(1), (128, 64), jnp.bfloat16)
  loss = lambda v, x: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)  # noqa: E731
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
    variables = te_flax.calibrate(loss, model.init(jax.random.key(0), x), x)
    return jax.jit(jax.value_and_grad(loss))(variables, x)


def test_reference_and_native_steps_are_bitwise_equal(monkeypatch):
  assert native.has_target("cpu", "te_quantize_cpu"), native.load_errors
  want = _step(monkeypatch, reference=False)
  got = _step(monkeypatch, reference=True)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # the loss
  got_leaves, want_leaves = (jax.tree_util.tree_flatten_with_path(t[1])[0] for t in (got, want))
  for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
    if jax.tree_util.keystr(path).endswith("['bias']"):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  assert float(want[0]) > 0
