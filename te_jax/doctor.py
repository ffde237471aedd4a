"""What this machine supports: ``python -m te_jax.doctor`` (a report) or ``python -m te_jax.doctor --json``.

Reports the package versions, the JAX backend and devices, each GPU's compute capability, the CUDA driver, runtime,
cuBLASLt and cuDNN versions, which te_jax extension modules loaded (and why not), the XLA FFI targets they registered,
whether ``TE_JAX_REFERENCE=1`` forces the pure-JAX path, a one-op check that the native handler runs and agrees with
the reference bit for bit, for each recipe whether its GEMMs run natively here or are emulated (the pure-JAX path, or
block-scaled operands dequantized into bfloat16), and why, and which attention backend (cuDNN or jnp) typical
configurations get, and why.

Never fails for want of a GPU or a CUDA library: what is missing is reported and the exit code is 0. Only a failing
``import te_jax`` exits non-zero.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import platform
import re
import site
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax._core import native

__all__ = ["RECIPES", "collect", "format_report", "main"]

RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling")
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")
_FP8_CC = (8, 9)  # Ada and Hopper: FP8 tensor cores
_BLOCK_CC = (9, 0)  # Hopper: cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMMs
_BLOCK_FP_CC = (10, 0)  # Blackwell: MXFP8 and NVFP4 block-scaled tensor-core GEMMs


def _package_version(name: str) -> str:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _cuda_version(v: int) -> str | None:
  """13000 -> "13.0"; 0 (no driver) -> None."""
  return f"{v // 1000}.{v % 1000 // 10}" if v else None


def _library_version(v: int) -> str:
  """cuBLAS(Lt) and cuDNN 9 encode ``major*10000 + minor*100 + patch``: 131000 -> "13.10.0"."""
  return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


def _cc_tuple(cc: str | None) -> tuple[int, int] | None:
  m = re.match(r"(\d+)\.(\d+)", cc or "")
  return (int(m.group(1)), int(m.group(2))) if m else None


def _cudnn() -> dict[str, Any]:
  """Loads libcudnn.so.9 from the nvidia-cudnn wheel or the default loader path and asks its version."""
  roots = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages(), *sys.path]
  candidates = [os.path.join(r, "nvidia", "cudnn", "lib", "libcudnn.so.9") for r in dict.fromkeys(roots) if r]
  candidates = [c for c in candidates if os.path.exists(c)] + ["libcudnn.so.9"]
  for path in candidates:
    try:
      get_version = ctypes.CDLL(path).cudnnGetVersion
    except (OSError, AttributeError):
      continue
    get_version.restype, get_version.argtypes = ctypes.c_size_t, []
    return {"version": _library_version(get_version()), "path": path}
  return {"version": "not found", "path": None}


def _cuda(cuda_module) -> dict[str, Any]:
  info: dict[str, Any] = {"driver_version": None, "runtime_version": None, "cublaslt_version": None}
  if cuda_module is not None:
    try:
      info["driver_version"] = _cuda_version(cuda_module.cuda_driver_version())
      info["runtime_version"] = _cuda_version(cuda_module.cuda_runtime_version())
      info["cublaslt_version"] = _library_version(cuda_module.cublaslt_version())
    except Exception as e:  # noqa: BLE001 - a broken CUDA install is something to report, not to crash on
      info["error"] = f"{type(e).__name__}: {e}"
  info["cudnn"] = _cudnn()
  return info


def _self_check() -> dict[str, Any]:
  """Quantizes a small tensor on the default device: which handler ran, and does it match the reference bit for bit."""
  from te_jax.ops.quantize import QuantizeConfig, quantize_ref  # noqa: PLC0415 - private, only needed here

  try:
    x = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32).astype(jnp.bfloat16) * 100
    scale = jnp.float32(2.0)
    native = jax.jit(lambda x, s: te_jax.ops.quantize.quantize(x, s, jnp.float8_e4m3fn, transpose=True))
    config = QuantizeConfig(out_dtype=jnp.dtype(jnp.float8_e4m3fn), transpose=True)
    ref = jax.jit(lambda x, s: quantize_ref(x, s, config=config))
    hlo = native.lower(x, scale).compile().as_text()
    targets = sorted(set(re.findall(r'custom_call_target="(te_[A-Za-z0-9_]+)"', hlo)))
    got, want = native(x, scale), ref(x, scale)
    equal = all(np.array_equal(np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8))
                for a, b in zip((got.out.data, got.out.data_t, got.amax), want, strict=True))
    return {"op": "quantize (64, 256) bf16 -> E4M3 + transpose",
            "handler": targets[0] if targets else "the pure-JAX reference", "bitwise_equal_to_reference": equal}
  except Exception as e:  # noqa: BLE001 - report the failure; the rest of the report is still useful
    return {"op": "quantize", "error": f"{type(e).__name__}: {e}"}


def _recipes(min_cc: tuple[int, int] | None, cuda_loaded: bool) -> dict[str, dict[str, str]]:
  """{recipe: {"mode": "native" | "emulated", "reason": ...}}: whether the recipe's GEMMs run on FP8 (FP4) tensor
  cores here, or its numerics run at high-precision speed (the pure-JAX path, or block-scaled operands dequantized
  into bfloat16)."""
  def row(native: bool, reason: str) -> dict[str, str]:
    return {"mode": "native" if native else "emulated", "reason": reason}

  if native.REFERENCE_FORCED:
    return {r: row(False, "TE_JAX_REFERENCE=1 forces the pure-JAX path") for r in RECIPES}
  if min_cc is None:
    return {r: row(False, "no GPU: the pure-JAX path, same FP8 numerics") for r in RECIPES}
  cc = f"{min_cc[0]}.{min_cc[1]}"
  if not cuda_loaded:
    per_tensor = row(False, "the CUDA module is not loaded (see extension modules): the pure-JAX path")
  elif min_cc < _FP8_CC:
    per_tensor = row(False, f"compute capability {cc} < 8.9: no FP8 tensor cores")
  else:
    per_tensor = row(True, f"compute capability {cc} >= 8.9 and the CUDA module is loaded")
  if not cuda_loaded:
    block, block_fp = per_tensor, per_tensor
  else:
    if min_cc == _BLOCK_CC:
      block = row(True, f"compute capability {cc}: cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMMs")
    else:
      block = row(False, f"cuBLASLt's 1x128 / 128x128 block-scaled GEMMs are for compute capability 9.0; on {cc} "
                         "the quantize is native and the GEMM dequantizes into bfloat16")
    if min_cc[0] == _BLOCK_FP_CC[0]:
      block_fp = row(True, f"compute capability {cc}: cuBLASLt's block-scaled tensor-core GEMMs (built, never run on "
                           "this project's own machines)")
    else:
      block_fp = row(False, f"hardware GEMMs need compute capability 10.x (Blackwell); on {cc} the quantize is native "
                            "and the GEMM dequantizes into bfloat16")
  return {
      "DelayedScaling": per_tensor,
      "Float8CurrentScaling": per_tensor,
      "Float8BlockScaling": block,
      "MXFP8BlockScaling": block_fp,
      "NVFP4BlockScaling": block_fp,
  }


def collect() -> dict[str, Any]:
  """Gathers everything the report shows.

  Returns:
    A JSON-serialisable dict with keys ``te_jax``, ``python``, ``packages``, ``backend``, ``devices``, ``gpus``,
    ``cuda``, ``extensions``, ``reference_forced``, ``fp8``, ``check``, ``recipes`` and ``attention``.
  """
  info: dict[str, Any] = {
      "te_jax": te_jax.__version__,
      "python": platform.python_version(),
      "packages": {name: _package_version(name) for name in _PACKAGES},
  }
  try:
    info["backend"] = jax.default_backend()
    devices = jax.devices()
  except RuntimeError as e:
    info["backend"], devices = f"error: {e}", []
  info["devices"] = [{"id": d.id, "platform": d.platform, "kind": d.device_kind} for d in devices]
  cuda_module = native.modules.get("cuda")
  info["cuda"] = _cuda(cuda_module)
  info["gpus"] = [{
      "id": d.id,
      "name": d.device_kind,
      "compute_capability": str(getattr(d, "compute_capability", None) or "unknown"),
      "driver_version": info["cuda"]["driver_version"],
      "runtime_version": info["cuda"]["runtime_version"],
  } for d in devices if d.platform in ("gpu", "cuda")]
  info["extensions"] = {
      platform_: {
          "loaded": native.modules.get(platform_) is not None,
          "error": native.load_errors.get(platform_),
          "targets": list(native.registered.get(platform_, [])),
      } for platform_ in native.modules
  }
  info["reference_forced"] = native.REFERENCE_FORCED
  ccs = [c for c in (_cc_tuple(g["compute_capability"]) for g in info["gpus"]) if c]
  min_cc = min(ccs) if ccs else None
  fp8 = min_cc is not None and min_cc >= _FP8_CC
  reason = "no GPU" if min_cc is None else f"compute capability {min_cc[0]}.{min_cc[1]} {'>=' if fp8 else '<'} 8.9"
  info["fp8"] = {"supported": fp8, "reason": reason}
  info["check"] = _self_check()
  info["recipes"] = _recipes(min_cc, cuda_module is not None)
  info["attention"] = te_jax.fused.attention.backend_report()
  return info


def format_report(info: dict[str, Any]) -> str:
  """Renders ``collect()``'s dict as a short plain-text report.

  Args:
    info: what ``collect()`` returned.

  Returns:
    The report, one fact per line.
  """
  pkgs = "  ".join(f"{k} {v}" for k, v in info["packages"].items())
  lines = [f"te_jax {info['te_jax']} doctor", f"Python {info['python']}  {pkgs}"]
  devices = ", ".join(f"{d['platform']}:{d['id']} {d['kind']}" for d in info["devices"]) or "none"
  lines.append(f"JAX backend: {info['backend']} ({len(info['devices'])} device(s): {devices})")
  if not info["gpus"]:
    lines.append("GPUs: none")
  for g in info["gpus"]:
    lines.append(f"GPU {g['id']}: {g['name']}, compute capability {g['compute_capability']}, "
                 f"driver CUDA {g['driver_version'] or 'none'}, runtime CUDA {g['runtime_version'] or 'n/a'}")
  cuda = info["cuda"]
  lines.append(f"CUDA: driver {cuda['driver_version'] or 'none'}, runtime {cuda['runtime_version'] or 'n/a'} "
               f"(te_jax CUDA module), cuBLASLt {cuda['cublaslt_version'] or 'n/a'}, cuDNN {cuda['cudnn']['version']}"
               + (f" ({cuda['cudnn']['path']})" if cuda["cudnn"]["path"] else ""))
  if "error" in cuda:
    lines.append(f"  CUDA query failed: {cuda['error']}")
  lines.append("Extension modules:")
  for name, ext in info["extensions"].items():
    state = "loaded" if ext["loaded"] else f"not loaded ({ext['error']})"
    lines.append(f"  {name:<5} {state}; FFI targets: {', '.join(ext['targets']) or 'none'}")
  forced = "set: the pure-JAX reference path is forced everywhere" if info["reference_forced"] else "not set"
  lines.append(f"TE_JAX_REFERENCE: {forced}")
  fp8 = info["fp8"]
  lines.append(f"FP8 tensor cores: {'yes' if fp8['supported'] else 'no'} ({fp8['reason']})")
  check = info["check"]
  if "error" in check:
    lines.append(f"Check: {check['op']} FAILED: {check['error']}")
  else:
    agree = "bitwise equal to the reference" if check["bitwise_equal_to_reference"] else "DIFFERS from the reference"
    lines.append(f"Check: {check['op']} on {info['backend']} ran {check['handler']}: {agree}")
  lines.append("Recipes:")
  for name, r in info["recipes"].items():
    lines.append(f"  {name:<21} {r['mode']:<11}  {r['reason']}")
  lines.append("Attention backends:")
  for name, r in info["attention"].items():
    lines.append(f"  {name:<34} {r['name']:<11} {r['reason']}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """Prints the report (or its JSON with ``--json``); returns the exit code, 0."""
  parser = argparse.ArgumentParser(prog="python -m te_jax.doctor", description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  args = parser.parse_args(argv)
  info = collect()
  print(json.dumps(info, indent=2) if args.json else format_report(info))
  return 0


if __name__ == "__main__":
  sys.exit(main())
