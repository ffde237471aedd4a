"""The one module that uses JAX's private APIs (``jax._src``), each behind a small function that says why.

Every use here is pinned by a test against the jax version the project supports (``pyproject.toml``); when a JAX
upgrade moves one of them, this file is the only one to change.
"""

from __future__ import annotations

import functools
import types

import jax
from jax._src import config as _config
from jax._src import dispatch as _dispatch

__all__ = ["apply_primitive", "backends_are_initialized", "check_vma_enabled", "cudnn_attention", "differentiated_from_outside",
           "enable_eager_extended_dtype_add", "require_devices_during_lowering"]


def apply_primitive(primitive):
  """The eager implementation of ``primitive`` (compile and run it alone), as jax's own primitives use: what
  ``primitive.def_impl`` takes."""
  return functools.partial(_dispatch.apply_primitive, primitive)


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (and XLA has read ``XLA_FLAGS``): flags added to the environment later
  change nothing in this process."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

  return bool(xla_bridge.backends_are_initialized())


def require_devices_during_lowering(primitive) -> None:
  """Marks ``primitive`` as needing the devices while it is lowered: ``custom_partitioning`` inside a lowering rule
  reads the mesh from them."""
  _dispatch.prim_requires_devices_during_lowering.add(primitive)


def check_vma_enabled() -> bool:
  """Whether the enclosing ``jax.shard_map`` tracks which manual axes each value varies over (its ``check_vma``)."""
  return bool(_config._check_vma.value)  # noqa: SLF001


def cudnn_attention() -> tuple[types.ModuleType | None, str | int]:
  """JAX's cuDNN attention module and the cuDNN version, or ``(None, why not)``. The module's entry points are the
  only ones that take the options te_jax needs (whether the bias needs a gradient; the FP8 inference call)."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415 - GPU builds only
    from jax._src.lib import cuda_versions  # noqa: PLC0415
  except ImportError as e:
    return None, f"jax has no cuDNN attention module ({e})"
  if cuda_versions is None:
    return None, "jaxlib has no CUDA support (no cuDNN)"
  return fa, cuda_versions.cudnn_get_version()


def differentiated_from_outside(value) -> bool:
  """Whether ``value`` is being differentiated by a trace other than the one running now: a differentiated value that
  a loop body (``lax.scan``, ``nn.scan``'s broadcast variables) or a ``vmap`` closes over. Autodiff adds the
  cotangents of such a value over the iterations or the batch. jax has no public way to ask for the running trace."""
  from jax._src import core  # noqa: PLC0415
  from jax._src.interpreters import ad  # noqa: PLC0415

  tracers = tuple(t for t in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None)) if t)
  if not isinstance(value, tracers):
    return False
  return value._trace is not core.trace_ctx.trace  # noqa: SLF001


def enable_eager_extended_dtype_add() -> bool:
  """Lets autodiff add cotangents of extended-dtype arrays outside ``jit``.

  Flax's FP8 state travels in ``fp32_max_grad``, an extended dtype whose "addition" is a max. Under ``jit`` autodiff
  uses the dtype's own add; outside it, a per-array-type table that has no entry for extended-dtype arrays (jax
  0.11). The entry added here runs that same add, jitted, eagerly. Returns whether it could be added: without it only
  the eager (un-jitted) differentiation of a module applied twice is lost.
  """
  try:
    from jax._src import ad_util, earray  # noqa: PLC0415
  except ImportError:  # pragma: no cover - depends on jax's internals
    return False
  adders = getattr(ad_util, "raw_jaxval_adders", None)
  if adders is None or not hasattr(ad_util, "add_jaxvals"):  # pragma: no cover
    return False
  adders.setdefault(earray.EArray, jax.jit(ad_util.add_jaxvals))
  return True
