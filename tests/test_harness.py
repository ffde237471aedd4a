"""The test harness itself (tests/conftest.py): what it changes must not change any value.

jax.random.normal and truncated_normal of rank >= 2 are drawn flat and reshaped (to spare XLA:CPU's compile of the
multi-dimensional counter); random_normal takes its values from one pooled 1-D draw. Both must give exactly the
values of JAX's own functions.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import conftest

REAL = conftest._REAL_DRAWS  # noqa: SLF001 - JAX's own functions, which the harness replaced
SHAPES = [(2, 3), (2, 2, 3), (1, 2, 1, 3)]  # small: the real multi-dimensional draws compile slowly


def _bits(a):
  a = np.asarray(a)
  return a.reshape(-1).view(np.uint8)


def test_flat_draws_are_jax_own_values():
  """float32 only: the dtype enters after the bits, elementwise (and each real draw here costs a compile)."""
  dtype = jnp.float32
  assert jax.random.normal is conftest._flat_normal
  key = jax.random.key(3)
  for shape in SHAPES:
    np.testing.assert_array_equal(_bits(jax.random.normal(key, shape, dtype)),
                                  _bits(REAL["normal"](key, shape, dtype)), err_msg=str(shape))
    np.testing.assert_array_equal(
        _bits(jax.random.truncated_normal(key, -2, 2, shape, dtype)),
        _bits(REAL["truncated_normal"](key, -2, 2, shape, dtype)), err_msg=str(shape))
  # An initializer as Flax calls it, and under jit and vmap.
  init = jax.nn.initializers.lecun_normal()
  real = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
  np.testing.assert_array_equal(_bits(init(key, (2, 2, 3), dtype)), _bits(real(key, (2, 2, 3), dtype)))
  keys = jax.random.split(key, 2)
  batched = jax.jit(jax.vmap(lambda k: jax.random.normal(k, (2, 2, 3), dtype)))(keys)
  for i in range(2):
    np.testing.assert_array_equal(_bits(batched[i]), _bits(REAL["normal"](keys[i], (2, 2, 3), dtype)))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
def test_random_normal_is_jax_random_normal(dtype):
  for seed, shape in [(0, (2, 3, 1, 2)), (5, (7,)), (2, (0, 4)), (4, (1500, 3))]:
    want = REAL["normal"](jax.random.key(seed), shape, jnp.float32).astype(dtype)
    got = conftest.random_normal(seed, shape, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=str(shape))
