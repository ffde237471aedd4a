"""Deterministic runs: the same program on the same inputs gives the same bits, run after run, so that a loss spike
can be replayed.

Three things vary between two GPU runs of one program, and each has its switch:

- te_jax's GEMM (``te_gemm_cuda``) times cuBLASLt's candidate algorithms at a problem's first call and keeps the
  fastest; near-ties go either way from one process to the next, and two algorithms round differently. Deterministic,
  it takes the heuristic's first candidate, which depends only on the problem and the library.
- XLA's own GPU ops: its autotuned GEMMs and fusions, scatter-adds (an embedding's gradient), cuDNN attention's
  backward. ``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS`` makes XLA pick and run them deterministically; XLA
  reads that variable once, when JAX starts its backends, so it must be set before the first computation.
- te_jax's own kernels need nothing: their amaxes fold with an unsigned ``atomicMax`` of the bit patterns (exact and
  order independent), their partial sums (norm and bias gradients) add in a fixed order.

``TE_JAX_DETERMINISTIC=1`` in the environment turns on all three: importing te_jax adds XLA's flag to ``XLA_FLAGS``
(JAX's backends not yet started), and every ``autocast`` is deterministic unless told otherwise.
``te_jax.autocast(..., deterministic=True)`` turns on te_jax's part and checks XLA's: on a GPU without the flag it
raises and says how to set it, rather than running half deterministic.
"""

from __future__ import annotations

import os
import shlex

import jax

__all__ = ["ENV_VAR", "XLA_FLAG", "check_xla_deterministic", "env_requested", "request_xla_deterministic"]

ENV_VAR = "TE_JAX_DETERMINISTIC"
XLA_FLAG = "--xla_gpu_deterministic_ops=true"
_FLAG_NAME = XLA_FLAG.split("=", 1)[0]


def env_requested() -> bool:
  """Whether ``TE_JAX_DETERMINISTIC`` asks for deterministic runs ("1", "true", "yes", "on"; "0", "false", "no",
  "off" or unset do not); any other value raises, naming the variable."""
  value = os.environ.get(ENV_VAR, "").strip().lower()
  if value in ("", "0", "false", "no", "off"):
    return False
  if value in ("1", "true", "yes", "on"):
    return True
  raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: set it to 1 (deterministic runs) or 0 (the default)")


def _xla_flag_value() -> str | None:
  """The value ``XLA_FLAGS`` gives XLA's deterministic-ops flag (its last mention wins), or None."""
  value = None
  for token in shlex.split(os.environ.get("XLA_FLAGS", "")):
    name, _, given = token.partition("=")
    if name == _FLAG_NAME:
      value = given if given else "true"
  return value


def _xla_flag_on() -> bool:
  return (_xla_flag_value() or "").lower() in ("true", "1")


def _backends_started() -> bool:
  from te_jax._core import jax_compat  # pylint: disable=import-outside-toplevel

  return jax_compat.backends_are_initialized()


def request_xla_deterministic() -> bool:
  """Adds XLA's deterministic-ops flag to ``XLA_FLAGS`` if JAX's backends have not started yet (the flag is read
  then). Returns whether the flag is on for this process. A flag set to false by the user is left alone: raises."""
  if _xla_flag_on():
    return True
  if _xla_flag_value() is not None:
    raise ValueError(f"XLA_FLAGS sets {_FLAG_NAME}={_xla_flag_value()}, but deterministic runs were asked for "
                     f"({ENV_VAR} or --deterministic): drop that flag from XLA_FLAGS or set it to true")
  if _backends_started():
    return False
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + XLA_FLAG).strip()
  return True


def check_xla_deterministic() -> None:
  """On a GPU, raises unless XLA runs its own ops deterministically (the flag in ``XLA_FLAGS`` when JAX started):
  te_jax's GEMMs alone do not make a run repeatable. Other platforms' XLA ops are deterministic already."""
  if jax.default_backend() != "gpu" or _xla_flag_on():
    return
  raise RuntimeError(
      "autocast(deterministic=True) on a GPU needs XLA's deterministic ops too, which XLA reads from XLA_FLAGS when "
      f"JAX starts: run with XLA_FLAGS='{XLA_FLAG}' (or {ENV_VAR}=1, which sets it when te_jax is imported before "
      "the first JAX computation)")
