"""How well do FP8 formats hold realistic training tensors? A per-tensor, per-format quantization report.

For a few tensors shaped like what a Transformer layer sees (Gaussian activations, heavy-tailed activations with
outliers, a Xavier-initialised weight, small gradients), and for each FP8 format (E4M3, E5M2), this prints:

- the amax and the scale ``fp8_max / amax`` (the scale of a recipe with margin 0);
- the relative quantization error ``||dequant(quant(x)) - x|| / ||x||``;
- the fraction of elements saturated (``|x * scale| > fp8_max``, clamped to +-max) and the fraction flushed to zero
  (non-zero in ``x``, zero after the cast);
- whether ``quantize`` (the native handler, when one is registered) is bitwise equal to the pure-JAX reference,
  and which handler ran.

Each tensor is quantized twice: with *current* scaling (the scale from the tensor's own amax) and with *delayed*
scaling (the scale from the amax of the previous step's tensor, drawn from the same distribution), which is what
``DelayedScaling`` does and where heavy tails start to saturate.

  python examples/fp8_report.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.ops.quantize import QuantizeConfig, quantize_ref
from te_jax.ops.quantize import quantize

FORMATS = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
ROWS, COLS = 2048, 1024
OUTLIER_FEATURES = (7, 300, 511, 900)  # the same channels at every step, as in LLM activations


def _gaussian(rng: np.random.Generator) -> np.ndarray:
  return rng.standard_normal((ROWS, COLS))


def _heavy_tailed(rng: np.random.Generator) -> np.ndarray:
  """Student-t with 3 degrees of freedom, and a few outlier features 50x larger."""
  x = rng.standard_t(3, (ROWS, COLS))
  x[:, OUTLIER_FEATURES] *= 50.0
  return x


def _xavier(rng: np.random.Generator) -> np.ndarray:
  limit = np.sqrt(6.0 / (ROWS + COLS))
  return rng.uniform(-limit, limit, (ROWS, COLS))


def _small_gradients(rng: np.random.Generator) -> np.ndarray:
  return 1e-4 * rng.standard_normal((ROWS, COLS))


# name, sampler, dtype the tensor lives in during training.
TENSORS = (
    ("activations N(0,1)", _gaussian, jnp.bfloat16),
    ("activations t(3)+outliers", _heavy_tailed, jnp.bfloat16),
    ("weight Xavier", _xavier, jnp.float32),
    ("gradients ~1e-4", _small_gradients, jnp.bfloat16),
)


def _bits(x: jax.Array) -> np.ndarray:
  return np.asarray(x).reshape(-1).view(f"u{jnp.dtype(x.dtype).itemsize}")


def _handler(fn, *args) -> str:
  hlo = fn.lower(*args).compile().as_text()
  targets = sorted(set(re.findall(r'custom_call_target="(te_[A-Za-z0-9_]+)"', hlo)))
  return ", ".join(t.rsplit("_", 1)[-1] for t in targets) or "reference"


def analyse(x: jax.Array, scale: jax.Array, fmt: jnp.dtype) -> dict:
  """Quantizes ``x`` with ``scale`` on the native and the reference path; returns the error statistics."""
  native = jax.jit(lambda x, s: quantize(x, s, fmt, transpose=True))
  config = QuantizeConfig(out_dtype=fmt, transpose=True)
  reference = jax.jit(lambda x, s: quantize_ref(x, s, config=config))
  q = native(x, scale)  # CastOutput: q.out the QuantizedTensor (data, its transposed copy, scale_inv = 1 / scale)
  ref = reference(x, scale)
  same = all(np.array_equal(_bits(a), _bits(b)) for a, b in zip((q.out.data, q.out.data_t, q.amax), ref, strict=True))

  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  deq = np.asarray(q.out.dequantize(jnp.float32), np.float64)
  fp8_max = float(jnp.finfo(fmt).max)
  scaled = np.abs(np.asarray(x.astype(jnp.float32)) * np.float32(scale))
  return {
      "rel_err": np.linalg.norm(deq - x64) / np.linalg.norm(x64),
      "saturated": np.mean(scaled > fp8_max),
      "flushed": np.mean((x64 != 0) & (deq == 0)),
      "bitwise": same,
      "handler": _handler(native, x, scale),
  }


def main() -> None:
  rng = np.random.default_rng(0)
  header = (f"{'tensor':<26} {'format':<6} {'scaling':<8} {'amax':>9} {'scale':>9} {'rel err':>8} "
            f"{'saturated':>9} {'flushed':>8}  native == ref")
  lines = [header, "-" * len(header)]
  for name, sample, dtype in TENSORS:
    previous = jnp.asarray(sample(rng), dtype)  # the tensor of the step before, for delayed scaling
    x = jnp.asarray(sample(rng), dtype)
    for fmt in FORMATS:
      fmax = float(jnp.finfo(fmt).max)
      for scaling, amax in (("current", te_jax.ops.quantize.amax(x)), ("delayed", te_jax.ops.quantize.amax(previous))):
        scale = jnp.float32(fmax) / amax
        r = analyse(x, scale, fmt)
        fmt_name = "E4M3" if fmt == FORMATS[0] else "E5M2"
        lines.append(f"{name:<26} {fmt_name:<6} {scaling:<8} {float(amax):>9.3g} {float(scale):>9.3g} "
                     f"{r['rel_err']:>8.2%} {r['saturated']:>9.1e} {r['flushed']:>8.1e}  "
                     f"{'bitwise' if r['bitwise'] else 'DIFFERS'} ({r['handler']})")
  path = "TE_JAX_REFERENCE set: both paths are the pure-JAX reference" if all(
      line.endswith("(reference)") for line in lines[2:]) else f"handlers on {jax.default_backend()} in brackets"
  print(f"FP8 quantization report: {ROWS}x{COLS} tensors, data + transposed copy; {path}\n")
  print("\n".join(lines))
  print("\nrel err: ||dequant(quant(x)) - x|| / ||x||; saturated: fraction with |x * scale| > fp8_max; "
        "flushed: fraction non-zero in x and zero after the cast.\n"
        "current: scale from this tensor's amax; delayed: from the previous step's amax (DelayedScaling).")


if __name__ == "__main__":
  main()
