"""Loads the native extension modules and registers their XLA FFI targets.

Never raises at import. A missing module, a missing CUDA library or no GPU means the ops lower to their pure-JAX
reference; the first lowering that falls back on a platform where a native handler was expected logs one warning.
``TE_JAX_REFERENCE=1`` forces the reference path everywhere (for A/B numerics and benchmarks); it is read once,
here, at import.
"""

from __future__ import annotations

import importlib
import logging
import os
import types

import jax

__all__ = ["REFERENCE_FORCED", "has_target", "load_errors", "modules", "registered", "warn_fallback", "workspace"]

logger = logging.getLogger("te_jax")

#: Platforms with a native module: the jax lowering platform name and the extension module that serves it.
_MODULES = {"cpu": "_te_cpu", "cuda": "_te_cuda"}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _reference_forced(value: str) -> bool:
  """``TE_JAX_REFERENCE``'s value as a bool; anything else is reported (once, here) and read as off."""
  if value.strip().lower() in _TRUE:
    return True
  if value.strip().lower() not in _FALSE:
    logger.warning("te_jax: TE_JAX_REFERENCE=%r is not one of %s (on) or %s (off); the native handlers stay on",
                   value, "/".join(_TRUE), "/".join(v for v in _FALSE if v))
  return False


REFERENCE_FORCED: bool = _reference_forced(os.environ.get("TE_JAX_REFERENCE", ""))

#: The loaded extension module per platform (None where it did not load).
modules: dict[str, types.ModuleType | None] = {}
#: Why a module is not loaded, per platform.
load_errors: dict[str, str] = {}
#: FFI target names registered with XLA, per platform.
registered: dict[str, list[str]] = {}
_warned: set[str] = set()


def _load(platform: str, module_name: str) -> None:
  modules[platform] = None
  registered[platform] = []
  if REFERENCE_FORCED:
    load_errors[platform] = "TE_JAX_REFERENCE=1 forces the pure-JAX path"
    return
  try:
    module = importlib.import_module(f"te_jax.{module_name}")
  except (ImportError, OSError) as e:  # not built, or a shared library (libcublasLt, ...) missing
    load_errors[platform] = f"{type(e).__name__}: {e}"
    return
  try:
    for name, capsule in module.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform.upper() if platform == "cuda" else platform)
      registered[platform].append(name)
  except Exception as e:  # noqa: BLE001 - any registration failure means the reference path, never a failed import
    load_errors[platform] = f"FFI registration failed: {type(e).__name__}: {e}"
    registered[platform] = []
    return
  modules[platform] = module


for _platform, _name in _MODULES.items():
  _load(_platform, _name)


def has_target(platform: str, target: str) -> bool:
  """Whether ``target`` is registered for ``platform`` ("cpu" or "cuda")."""
  return target in registered.get(platform, ())


def workspace(platform: str, target: str, *args) -> jax.core.ShapedArray:
  """The workspace result that the ``te_<target>_<platform>`` handler needs, as its module computes it.

  The handler checks and carves its workspace with the same C++ function (ffi/include/te_jax/workspace.h), exported
  as ``<target>_workspace(*args)`` (the handler's input shape and attributes; see ffi/cuda/module.cc), so the kernel
  geometry is defined only there. Called from native lowerings, where the module is loaded.
  """
  count, dtype = getattr(modules[platform], f"{target}_workspace")(*args)
  return jax.core.ShapedArray((count,), dtype)


def warn_fallback(platform: str, op: str) -> None:
  """Logs once per platform that ``op`` runs on the pure-JAX reference where a native handler was expected."""
  if platform in _warned or REFERENCE_FORCED:
    return
  _warned.add(platform)
  reason = load_errors.get(platform, "no native handler for this op")
  logger.warning("te_jax: %s on %s uses the pure-JAX reference path (%s). `python -m te_jax.doctor` says more.",
                 op, platform, reason)
