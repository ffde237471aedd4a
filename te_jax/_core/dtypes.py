"""The dtype families te_jax's ops accept, named once."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["FP8_DTYPES", "HALF_DTYPES", "HP_DTYPES"]

#: The FP8 formats: E4M3 (max 448, no inf) and E5M2 (max 57344).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: The high-precision floats every kernel reads and writes.
HP_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: The 16-bit floats (cuDNN attention's inputs).
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
