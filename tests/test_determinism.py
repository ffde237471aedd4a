"""Deterministic runs (te_jax._core.determinism): autocast(deterministic=True) reaches every GEMM's config, the
environment flag sets XLA's flag before JAX starts, half-deterministic set-ups raise with the fix, and on a GPU two
processes of the compare LM give the same bits."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe
from te_jax._core import determinism
from te_jax._core.autocast import get_autocast_state
from te_jax.compare import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gemm_configs(fn, *args):
  """The GemmConfig of every te_jax GEMM in fn's jaxpr (forward and, through grad, backward)."""
  configs = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if "config" in eqn.params and type(eqn.params["config"]).__name__ == "GemmConfig":
        configs.append(eqn.params["config"])
      for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(j, jax.extend.core.ClosedJaxpr):
            walk(j.jaxpr)
          elif isinstance(j, jax.extend.core.Jaxpr):
            walk(j)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return configs


def _dense_loss(x, w):
  return jnp.sum(te_jax.dense(x, w).astype(jnp.float32) ** 2)


def test_autocast_deterministic_reaches_every_gemm():
  """te_jax's FP8 GEMMs (forward, dgrad, wgrad); high-precision GEMMs are XLA's, which its flag makes
  deterministic."""
  x = jnp.ones((32, 64), jnp.bfloat16)
  w = jnp.ones((64, 48), jnp.bfloat16)
  grad = jax.grad(_dense_loss, argnums=(0, 1))
  with te_jax.autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
    plain = _gemm_configs(grad, x, w)
  with te_jax.autocast(enabled=True, recipe=recipe.Float8CurrentScaling(), deterministic=True):
    fixed = _gemm_configs(grad, x, w)
  assert len(plain) == len(fixed) == 3  # forward, dgrad, wgrad
  assert not any(c.deterministic for c in plain)
  assert all(c.deterministic for c in fixed)


def test_deterministic_is_inherited_and_overridden():
  assert get_autocast_state().deterministic is False
  with te_jax.autocast(deterministic=True):
    with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()) as inner:
      assert inner.deterministic is True
    with te_jax.autocast(enabled=True, deterministic=False) as off:
      assert off.deterministic is False
  with pytest.raises(TypeError, match="deterministic must be a bool, got 'yes'"):
    with te_jax.autocast(deterministic="yes"):
      pass


def test_gpu_without_xla_flag_raises_with_the_fix(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  with pytest.raises(RuntimeError, match="XLA_FLAGS='--xla_gpu_deterministic_ops=true'.*TE_JAX_DETERMINISTIC=1"):
    with te_jax.autocast(deterministic=True):
      pass
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true")
  with te_jax.autocast(deterministic=True) as state:
    assert state.deterministic


@pytest.mark.parametrize("value, want", [("1", True), ("on", True), ("0", False), ("", False)])
def test_env_var_values(monkeypatch, value, want):
  monkeypatch.setenv(determinism.ENV_VAR, value)
  assert determinism.env_requested() is want


def test_env_var_bad_value_names_it(monkeypatch):
  monkeypatch.setenv(determinism.ENV_VAR, "maybe")
  with pytest.raises(ValueError, match="TE_JAX_DETERMINISTIC='maybe': set it to 1"):
    determinism.env_requested()


def test_xla_flag_set_false_by_the_user_raises(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
  with pytest.raises(ValueError, match="drop that flag from XLA_FLAGS or set it to true"):
    determinism.request_xla_deterministic()


def test_xla_flag_too_late_is_reported(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  jax.devices()  # the backends have started in this process
  assert determinism.request_xla_deterministic() is False
  assert "xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]


def test_env_var_sets_the_xla_flag_at_import():
  """A fresh process: importing te_jax with TE_JAX_DETERMINISTIC=1 adds XLA's flag (which XLA accepts: the jitted
  GEMM runs) and makes autocast deterministic by default."""
  code = ("import os, jax.numpy as jnp, te_jax\n"
          "from te_jax._core.autocast import get_autocast_state\n"
          "print(get_autocast_state().deterministic, '--xla_gpu_deterministic_ops=true' in os.environ['XLA_FLAGS'])\n"
          "print(float(te_jax.dense(jnp.ones((16, 16)), jnp.ones((16, 16))).sum()))\n")
  env = {**os.environ, determinism.ENV_VAR: "1", "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
  assert out.split("\n")[:2] == ["True True", "4096.0"]


def test_compare_deterministic_after_jax_started_says_how():
  jax.devices()
  with pytest.raises(SystemExit) as e:
    cli.main(["--preset", "tiny", "--steps", "2", "--deterministic"])
  assert e.value.code == 2


@pytest.mark.gpu
def test_two_gpu_runs_of_the_compare_lm_are_bitwise_equal(tmp_path):
  """gpt-small, 30 steps of BF16 and of FP8 (delayed scaling), twice in fresh processes with --deterministic: every
  train loss and the held-out loss equal bit for bit. A third, default run gives the mode's cost (printed)."""
  reports = {}
  for name, extra in (("a", ["--deterministic"]), ("b", ["--deterministic"]), ("default", [])):
    out = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "te_jax.compare", "--preset", "gpt-small", "--steps", "30",
                           "--evals", "1", "--health", "0", "--out", str(out), *extra], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != determinism.ENV_VAR},
                          capture_output=True, text=True)
    assert done.returncode == 0, f"run {name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    reports[name] = {r["name"]: r for r in json.loads((out / "report.json").read_text())["runs"]}
  for run in ("BF16", "FP8"):
    a, b = reports["a"][run], reports["b"][run]
    np.testing.assert_array_equal(np.asarray(a["train_curve"]), np.asarray(b["train_curve"]))
    assert a["heldout_loss"] == b["heldout_loss"]
    cost = reports["default"][run]["tokens_per_s"] / a["tokens_per_s"]
    print(f"deterministic {run}: held-out {a['heldout_loss']:.6f} both runs; default/deterministic tokens/s "
          f"{cost:.3f}")
