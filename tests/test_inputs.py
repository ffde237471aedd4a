"""What users pass, handled as jnp would: integer and NumPy inputs to the fused ops, and the one environment switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax._core import native
from te_jax.recipe import DelayedScaling, Float8CurrentScaling

KERNEL = jax.random.normal(jax.random.key(0), (32, 16))


@pytest.mark.parametrize("recipe", [None, Float8CurrentScaling()], ids=["high-precision", "fp8"])
def test_integer_input_is_promoted_with_the_kernel(recipe):
  """An int32 input computes in the kernel's float dtype (jnp.dot's promotion), never casts the kernel to int."""
  x = jnp.arange(4 * 32, dtype=jnp.int32).reshape(4, 32) % 5
  got = te_jax.dense(x, KERNEL, recipe=recipe)
  want = te_jax.dense(x.astype(jnp.float32), KERNEL, recipe=recipe)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if recipe is None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(x, np.float32) @ np.asarray(KERNEL), rtol=1e-5, atol=1e-4)


def test_numpy_float64_inputs_run_eagerly_and_under_jit():
  x, k = np.random.default_rng(0).normal(size=(4, 32)), np.asarray(KERNEL, np.float64)
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
    eager = te_jax.dense(x, k)
    jitted = jax.jit(te_jax.dense)(x, k)
    ln = te_jax.layernorm_dense(x, np.ones(32), np.zeros(32), k)
  assert eager.dtype == jitted.dtype == ln.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_delayed_scaling_without_state_names_the_argument():
  with pytest.raises(ValueError, match="DelayedScaling needs fp8_meta"):
    te_jax.dense(jnp.ones((4, 32)), KERNEL, recipe=DelayedScaling())
  with pytest.raises(TypeError, match="fp8_meta must be a te_jax.DenseFp8Meta"):
    te_jax.dense(jnp.ones((4, 32)), KERNEL, recipe=DelayedScaling(), fp8_meta=(1, 2, 3))


@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("ON", True), ("", False), ("0", False),
                                          ("false", False), ("no", False), ("maybe", False)])
def test_reference_switch_reads_booleans(value, forced, caplog):
  assert native._reference_forced(value) is forced  # noqa: SLF001
  assert ("is not one of" in caplog.text) == (value == "maybe")
