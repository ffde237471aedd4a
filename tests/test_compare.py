"""te_jax.compare: the FP8 health counters against hand-computed cases and FP8 casts, the counters taken in a
step, the user-model API, the CLI's tiny preset end to end (report fields, non-empty PNGs), and bad arguments."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe
from te_jax.compare import PLOTS, cli, fp8_shares, health, run


def test_fp8_shares_hand_computed():
  tiny = 2.0**-9  # E4M3's smallest subnormal
  x = jnp.array([1.0, 500.0, -449.0, 448.0, 1e-4, -tiny / 2, tiny / 2 * 1.01, 0.0])
  saturated, flushed = fp8_shares(x, jnp.float32(1.0), "e4m3")
  assert (float(saturated), float(flushed)) == (2 / 8, 2 / 8)  # 500, -449 | 1e-4, the tie -tiny/2
  saturated, flushed = fp8_shares(x, jnp.float32(0.5), "e4m3")  # 500 * 0.5 fits; 1.01 * tiny / 4 flushes too
  assert (float(saturated), float(flushed)) == (0.0, 3 / 8)
  saturated, flushed = fp8_shares(x, jnp.float32(1.0), "e5m2")  # 57344 max, 2^-16 smallest: nothing lost
  assert (float(saturated), float(flushed)) == (0.0, 0.0)


@pytest.mark.parametrize("fmt,dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)])
def test_fp8_flush_share_is_what_the_cast_sends_to_zero(fmt, dtype):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-8, 0, 4096)).astype(np.float32)
  x[::97] = 0.0
  for scale in (1.0, 3.0, 1 / 7):
    cast = (x * np.float32(scale)).astype(dtype)
    _, flushed = fp8_shares(jnp.asarray(x), jnp.float32(scale), fmt)
    assert float(flushed) == pytest.approx(np.mean((x != 0) & (cast.astype(np.float32) == 0)), abs=1e-7)


def test_fp8_shares_refuses_an_unknown_format():
  with pytest.raises(ValueError, match="fmt must be one of"):
    fp8_shares(jnp.ones(3), jnp.float32(1.0), "e3m4")


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = te_flax.DenseGeneral(32, dtype=jnp.bfloat16, name="hidden")(x)
    return te_flax.DenseGeneral(16, dtype=jnp.bfloat16, name="out")(nn.gelu(x)).astype(jnp.float32)


def test_health_counters_of_kernels_and_inputs_hand_set():
  """Scales set by hand: the kernel and input shares are those of the values and scales the step casts with."""
  model = _Net()
  x = jnp.full((4, 16), 2.0).at[0, :4].set(1000.0)  # 4 of 64 inputs saturate with the scale 1 below
  with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
    variables = model.init(jax.random.key(0), x)
    state = jax.tree.map(lambda v: v, variables[te_jax.FP8_COLLECTION])
    state["hidden"]["x_scale"] = jnp.float32(1.0)
    state["hidden"]["kernel_scale"] = jnp.float32(1e3)  # 1.0 * 1e3 saturates, 0.01 * 1e3 does not
    state["out"]["kernel_scale"] = jnp.float32(1e-4)  # 1e-3 * 1e-4 < 2^-10 flushes, 10 * 1e-4 does not
    params = {"hidden": {**variables["params"]["hidden"], "kernel": jnp.full((16, 32), 0.01).at[0, :8].set(1.0)},
              "out": {**variables["params"]["out"], "kernel": jnp.full((32, 16), 1e-3).at[0, :3].set(10.0)}}
    variables = {**variables, "params": params, te_jax.FP8_COLLECTION: state}
    kernels = health.kernel_health(variables)
    with health.input_health():
      _, sown = model.apply(variables, x, mutable=[health.HEALTH_COLLECTION])
  inputs = health.flatten_sown(sown[health.HEALTH_COLLECTION])
  assert sorted(kernels) == ["hidden/kernel", "out/kernel"]
  assert [float(v) for v in kernels["hidden/kernel"]] == [8 / 512, 0.0]
  assert [float(v) for v in kernels["out/kernel"]] == [0.0, 1 - 3 / 512]
  assert sorted(inputs) == ["hidden/x", "out/x"]
  assert [float(v) for v in inputs["hidden/x"]] == [4 / 64, 0.0]


def _batches(n, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    x = rng.standard_normal((32, 16)).astype(np.float32)
    out.append((jnp.asarray(x, jnp.bfloat16), jnp.asarray(np.argmax(x[:, :16], -1), jnp.int32)))
  return out


def test_run_on_a_user_model(tmp_path):
  """run(model_fn, batches): both runs from the same parameters, the FP8 run with health rows at the chosen steps."""
  result = run(lambda fp8: _Net(), _batches(6, 0), steps=6, eval_batches=_batches(2, 1), lr=1e-2, health_every=3,
               eval_every=2, out=tmp_path, quiet=True)
  bf16, fp8 = result["runs"]
  assert (bf16["name"], fp8["name"]) == ("BF16", "FP8")
  assert [row["step"] for row in fp8["health"]] == [0, 3] and bf16["health"] == []
  assert set(fp8["health"][0]["shares"]) == {"hidden/kernel", "out/kernel", "hidden/x", "out/x"}
  assert {"hidden/grad", "out/x"} <= set(fp8["health"][0]["amax"])
  assert [s for s, _ in fp8["heldout_curve"]] == [2, 4, 6]
  assert len(fp8["train_curve"]) == 6 and len(fp8["step_times_s"]) == 4  # the two measured steps are not timed
  assert abs(fp8["train_curve"][0] - bf16["train_curve"][0]) < 0.05 * bf16["train_curve"][0]  # same start
  assert fp8["ratios"]["tokens_per_s"] == pytest.approx(fp8["tokens_per_s"] / bf16["tokens_per_s"])
  assert json.loads((tmp_path / "report.json").read_text())["runs"][1]["name"] == "FP8"


def test_run_refuses_bad_arguments():
  good = dict(steps=2, eval_batches=_batches(1, 1))
  with pytest.raises(ValueError, match="recipe must be one of"):
    run(lambda fp8: _Net(), _batches(2, 0), recipe="mxfp9", **good)
  with pytest.raises(ValueError, match="2 batches needed, got 1"):
    run(lambda fp8: _Net(), _batches(1, 0), **good)
  with pytest.raises(TypeError, match="must return a flax.linen.Module"):
    run(lambda fp8: "model", _batches(2, 0), **good)
  with pytest.raises(ValueError, match="eval_batches must hold at least one"):
    run(lambda fp8: _Net(), _batches(2, 0), steps=2, eval_batches=[])
  with pytest.raises(ValueError, match="--module must be path:attr"):
    cli.load_model_fn("no_colon")
  with pytest.raises(SystemExit):
    cli.main(["--steps", "0"])


def test_fast_accumulation_flag_sets_the_backward_gemms():
  default, fast = cli.fp8_recipe("delayed"), cli.fp8_recipe("current", fast_accumulation=True)
  assert default.fp8_gemm_dgrad.use_split_accumulator and default.fp8_gemm_wgrad.use_split_accumulator
  assert isinstance(fast, recipe.Float8CurrentScaling)
  assert not fast.fp8_gemm_dgrad.use_split_accumulator and not fast.fp8_gemm_wgrad.use_split_accumulator
  assert fast.fp8_gemm_fprop == default.fp8_gemm_fprop


@pytest.mark.slow  # ~65 s on 2 cores: two short training runs, BF16 and FP8, with their compiles
def test_tiny_preset_end_to_end(tmp_path, capsys):
  """The README's main job on CPU: the emulation note first, then the table, report.json and non-empty PNGs."""
  out = tmp_path / "report"
  cli.main(["--preset", "tiny", "--out", str(out)])
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0].startswith("NOTE: FP8 is emulated on CPU") and "not meaningful" in lines[0]
  assert lines[-1] == f"report and plots: {out.resolve()}"
  report = json.loads((out / "report.json").read_text())
  fields = {"description", "params", "recipe", "note", "device", "versions", "date", "runs", "plots", "table"}
  assert fields <= set(report)
  assert report["versions"]["jax"] and report["device"]["platform"] == "cpu"
  for r in report["runs"]:
    assert r["steps"] == 60 and len(r["train_curve"]) == 60
    for key in ("train_loss", "heldout_loss", "tokens_per_s", "step_s_median", "step_s_p90", "compile_s"):
      assert np.isfinite(r[key]) and r[key] > 0, key
    assert r["memory"]["xla_estimate_bytes"] > 0 and "memory_analysis" in r["memory"]["source"]
    assert r["heldout_loss"] < np.log(256)  # it learned something: below a uniform guess over bytes
  fp8 = report["runs"][1]
  assert len(fp8["health"]) == 5 and any(k.endswith("mlp/wi_kernel") for k in fp8["health"][0]["shares"])
  assert abs(fp8["ratios"]["heldout_loss"] - 1) < 0.05
  for name in PLOTS:
    assert (out / name).stat().st_size > 1000, name
