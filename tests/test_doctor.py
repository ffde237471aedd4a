"""`python -m te_jax.doctor`: runs in a fresh interpreter, plain and --json, and reports what this machine has."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from te_jax import recipe

REPO = pathlib.Path(__file__).resolve().parents[1]
KEYS = {"te_jax", "python", "packages", "backend", "devices", "gpus", "cuda", "extensions", "reference_forced", "fp8",
        "check", "recipes", "attention"}
RECIPES = {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"}


def _doctor(*args: str, reference: bool = False) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  env.pop("TE_JAX_REFERENCE", None)
  if reference:
    env["TE_JAX_REFERENCE"] = "1"
  return subprocess.run([sys.executable, "-m", "te_jax.doctor", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def info() -> dict:
  proc = _doctor("--json")
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)


def test_plain_report_exits_zero():
  proc = _doctor()
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("te_jax ")
  for section in ("JAX backend:", "Extension modules:", "TE_JAX_REFERENCE: not set", "Recipes:", *RECIPES):
    assert section in proc.stdout


def test_json_keys(info):
  assert set(info) == KEYS
  assert set(info["recipes"]) == RECIPES
  assert {r["mode"] for r in info["recipes"].values()} <= {"native", "emulated"}
  assert all(r["reason"] for r in info["recipes"].values())
  assert set(info["packages"]) >= {"jax", "jaxlib", "flax", "optax"}
  assert info["cuda"]["cudnn"]["version"]  # a version or "not found", never missing
  assert all(hasattr(recipe, name) for name in info["recipes"])


def test_cpu_module_loaded_and_registered(info):
  cpu = info["extensions"]["cpu"]
  assert cpu["loaded"], cpu["error"]
  assert cpu["error"] is None
  assert "te_quantize_cpu" in cpu["targets"]


def test_native_handler_agrees_with_reference(info):
  check = info["check"]
  assert "error" not in check, check
  assert check["bitwise_equal_to_reference"]
  if info["backend"] == "cpu":
    assert check["handler"] == "te_quantize_cpu"


def test_recipe_modes_follow_the_machine(info):
  if not info["gpus"]:
    assert info["fp8"]["supported"] is False
    assert all(r["mode"] == "emulated" for r in info["recipes"].values())
    return
  min_cc = min(tuple(int(v) for v in g["compute_capability"].split(".")) for g in info["gpus"])
  per_tensor = "native" if info["extensions"]["cuda"]["loaded"] and min_cc >= (8, 9) else "emulated"
  assert info["fp8"]["supported"] is (min_cc >= (8, 9))
  assert info["recipes"]["DelayedScaling"]["mode"] == per_tensor
  assert info["recipes"]["Float8CurrentScaling"]["mode"] == per_tensor
  block = "native" if info["extensions"]["cuda"]["loaded"] and min_cc == (9, 0) else "emulated"
  assert info["recipes"]["Float8BlockScaling"]["mode"] == block
  block_fp = "native" if info["extensions"]["cuda"]["loaded"] and min_cc[0] == 10 else "emulated"
  assert info["recipes"]["MXFP8BlockScaling"]["mode"] == block_fp
  assert info["recipes"]["NVFP4BlockScaling"]["mode"] == block_fp


def test_reference_forced():
  proc = _doctor("--json", reference=True)
  assert proc.returncode == 0, proc.stderr
  info = json.loads(proc.stdout)
  assert info["reference_forced"] is True
  for ext in info["extensions"].values():
    assert not ext["loaded"] and not ext["targets"]
    assert "TE_JAX_REFERENCE" in ext["error"]
  assert all(r["mode"] == "emulated" for r in info["recipes"].values())
  assert info["check"]["handler"] == "the pure-JAX reference"
  assert "TE_JAX_REFERENCE: set" in _doctor(reference=True).stdout
