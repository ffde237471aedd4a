"""te_jax.compare: the FP8 health counters (kernels, inputs, output gradients) against hand-computed cases and FP8
casts, taken in the compare loop's own step, per layer under nn.scan; the user-model API, the CLI's tiny preset end
to end (report fields, non-empty PNGs), and bad arguments."""

import json
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax.training import train_state

import te_jax
import te_jax.flax as te_flax
from te_jax import recipe
from te_jax.compare import PLOTS, RECIPES, api, cli, fp8_shares, health, report, run
from te_jax.compare.train import Run, health_step
from te_jax.ops.quantize import saturating_cast


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


def _set_state(variables, **values):
  """``variables`` with every FP8 state leaf named as a key of ``values`` set to it (a list: one per scanned layer)."""
  def set_leaf(path, leaf):
    name = path[-1].key
    return jnp.asarray(values[name], leaf.dtype).reshape(leaf.shape) if name in values else leaf
  return {**variables, te_jax.FP8_COLLECTION: jax.tree_util.tree_map_with_path(set_leaf,
                                                                               variables[te_jax.FP8_COLLECTION])}


def _health_step(model, variables, x, loss):
  """One train step of the compare loop's health step (SGD at rate 0: the parameters stay) under delayed scaling,
  ``loss(outputs)`` its loss: (the health rows, the variables after it)."""
  run_ = Run("FP8", model, recipe.DelayedScaling(), 1)
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.0))
  with te_jax.autocast(enabled=True, recipe=run_.recipe):
    step = jax.jit(health_step(run_, lambda outputs, batch: loss(outputs)))
    state, _, shares = step(state, health.grad_probes(variables), (x,))
  return health.rows(shares), state.params


def test_grad_counters_hand_computed():
  """The loss sum(y * w) makes the output gradient w exactly; with the grad scale 16 set in the state, 2^13 * 16
  saturates E5M2 (max 57344), 2^-22 * 16 and the tie 2^-21 * 16 = 2^-17 flush, 2^-20 * 16 (E5M2's smallest
  subnormal, 2^-16), 1 and 0 do not: 10 and 20 + 6 of 256. The probes leave the step's own gradient as it was."""
  layer = te_flax.DenseGeneral(16, dtype=jnp.bfloat16)
  x = jnp.ones((16, 16), jnp.bfloat16)
  w = np.ones(256, np.float32)
  w[:10], w[10:30], w[30:36], w[36:41], w[41:56] = 2.0**13, -2.0**-22, 2.0**-21, -2.0**-20, 0.0
  w = jnp.asarray(w.reshape(16, 16))
  loss = lambda y: jnp.sum(y.astype(jnp.float32) * w)  # noqa: E731
  with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
    variables = _set_state(layer.init(jax.random.key(0), x), grad_scale=16.0)
    plain = jax.jit(jax.grad(lambda v: loss(layer.apply(v, x))))(variables)[te_jax.FP8_COLLECTION]
  rows, after = _health_step(layer, variables, x, loss)
  assert rows["grad"] == [10 / 256, 26 / 256]
  state = after[te_jax.FP8_COLLECTION]
  assert float(state["grad_amax_history"][0]) == 2.0**13  # the GEMM's backward quantized this very gradient
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state, plain))


class _Parts(nn.Module):
  """A DenseGeneral unstacked into three parts (a fused QKV projection), for the counters of a tuple output."""

  @nn.compact
  def __call__(self, x):
    return te_flax.DenseGeneral((3, 32), unstack_axis=-2, dtype=jnp.bfloat16)(x)


_GEMMS = {  # module, its GEMM output's gradient's state prefix, the outputs the GEMM makes (the rest: other tensors)
    "dense": (te_flax.DenseGeneral(64, dtype=jnp.bfloat16), "", lambda out: [out]),
    "unstacked": (_Parts(), "", list),
    "layernorm_dense": (te_flax.LayerNormDenseGeneral(64, return_layernorm_output=True, dtype=jnp.bfloat16), "",
                        lambda out: [out[0]]),
    "layernorm_mlp": (te_flax.LayerNormMLP(intermediate_dim=64, dtype=jnp.bfloat16), "wo_", lambda out: [out]),
    "dot_general": (nn.Dense(64, dtype=jnp.bfloat16, dot_general_cls=te_flax.Fp8DotGeneral), "", lambda out: [out]),
}


@pytest.mark.parametrize("kind", sorted(_GEMMS))
@pytest.mark.fast_cases(2)
def test_grad_counters_agree_with_an_e5m2_cast(kind):
  """Output gradients of every magnitude (zeros among them) and a grad scale of 3: the counters are what
  jnp.float8_e5m2 makes of gradient * scale (rounded in float32, as the GEMM's backward multiplies), taken over the
  GEMM's output only (not a normalized input the layer also returns); the backward quantized that gradient (its
  amax is the state's new one)."""
  model, prefix, gemm_outputs = _GEMMS[kind]
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
  with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
    variables = _set_state(model.init(jax.random.key(0), x), **{f"{prefix}grad_scale": 3.0})
    out = model.apply(variables, x)
  weights = []
  for leaf in jax.tree.leaves(out):
    w = (rng.standard_normal(leaf.shape) * 10.0 ** rng.uniform(-9, 5, leaf.shape)).astype(ml_dtypes.bfloat16)
    w = w.astype(np.float32)  # the gradient reaching the layer's bf16 output: exact
    w.flat[::13] = 0.0
    band = (np.abs(w * np.float32(3.0)) >= 57344) & (np.abs(w * np.float32(3.0)) < 61440)
    w[band] = 1.0  # values that round to the max even unclipped: a cast cannot tell whether they saturate
    weights.append(jnp.asarray(w))

  def loss(outputs):
    return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(jax.tree.leaves(outputs), weights))

  rows, after = _health_step(model, variables, x, loss)
  ((name, shares),) = [(k, v) for k, v in rows.items() if k.endswith(f"{prefix}grad")]
  n_gemm = len(jax.tree.leaves(gemm_outputs(out)))
  g = np.concatenate([np.ravel(w) for w in weights[:n_gemm]])
  cast = np.asarray((jnp.asarray(g) * jnp.float32(3.0)).astype(jnp.float8_e5m2).astype(jnp.float32))
  expected = [np.mean(np.isinf(cast)), np.mean((g != 0) & (cast == 0))]
  assert 0 < expected[0] < 0.5 and 0 < expected[1] < 0.5
  te_cast = np.asarray(saturating_cast(jnp.asarray(g), jnp.float32(3.0), jnp.float8_e5m2).astype(jnp.float32))
  assert np.mean((g != 0) & (te_cast == 0)) == expected[1]  # te_jax's own cast flushes the same values
  assert shares == pytest.approx(expected, abs=1e-7)
  assert health.latest_amaxes(after)[name] == np.max(np.abs(g))
  if kind == "dot_general":  # its kernel is nn.Dense's parameter: the interceptor counts it with its input
    assert {"Fp8DotGeneral_0/x", "Fp8DotGeneral_0/kernel"} <= set(rows)


class _Unaligned(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = te_flax.DenseGeneral(16, dtype=jnp.bfloat16, name="fp8")(x)
    return te_flax.DenseGeneral(10, dtype=jnp.bfloat16, name="high_precision")(x)  # 10: not a multiple of 16


def test_grad_counters_leave_out_gemms_that_do_not_run_in_fp8():
  x = jnp.ones((16, 16), jnp.bfloat16)
  with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
    variables = _Unaligned().init(jax.random.key(0), x)
  rows, _ = _health_step(_Unaligned(), variables, x, lambda y: jnp.sum(y.astype(jnp.float32)))
  assert "fp8/grad" in rows and "high_precision/grad" not in rows


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return te_flax.DenseGeneral(16, dtype=jnp.bfloat16, name="dense")(x), None


class _Scanned(nn.Module):
  """Three DenseGeneral layers under nn.scan, the input counters' collection scanned as the FP8 state is."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Layer, variable_axes={"params": 0, te_jax.FP8_COLLECTION: 0, health.HEALTH_COLLECTION: 0},
                    split_rngs={"params": True}, length=3)
    return stack(name="layers")(x, None)[0]


def test_counters_per_layer_under_scan():
  """Identity kernels: the top layer (2, grad scale 1) hands the loss's gradient w on unchanged; layer 1 (scale 16)
  saturates its 2^13s, which reach layer 0 clipped to 57344 / 16 = 3584; layer 0 (scale 1/16) flushes its 2^-14s
  (2^-18 <= 2^-17). Every counter and amax comes per layer: layer 1's input saturates (x scale 2000: 0.448 * 2000,
  layer 0's output with its kernel clipped to 448 / 1000), layer 0's kernel (kernel scale 1000: its 16 ones)."""
  model = _Scanned()
  x = jnp.ones((16, 16), jnp.bfloat16)
  w = np.ones(256, np.float32)
  w[:12], w[12:20], w[20:30] = 2.0**13, -2.0**-14, 0.0
  w = jnp.asarray(w.reshape(16, 16))
  with te_jax.autocast(enabled=True, recipe=recipe.DelayedScaling()):
    variables = model.init(jax.random.key(0), x)
  params = {"layers": {"dense": {"kernel": jnp.broadcast_to(jnp.eye(16), (3, 16, 16)), "bias": jnp.zeros((3, 16))}}}
  variables = _set_state({**variables, "params": params}, grad_scale=[1 / 16, 16.0, 1.0],
                         x_scale=[1.0, 2000.0, 1.0], kernel_scale=[1000.0, 1.0, 1.0])
  rows, after = _health_step(model, variables, x, lambda y: jnp.sum(y.astype(jnp.float32) * w))
  at = lambda i, operand: rows[f"layers/dense[{i}]/{operand}"]  # noqa: E731
  assert [at(i, "grad") for i in range(3)] == [[0.0, 8 / 256], [12 / 256, 0.0], [0.0, 0.0]]
  assert [at(i, "x") for i in range(3)] == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
  assert [at(i, "kernel") for i in range(3)] == [[16 / 256, 0.0], [0.0, 0.0], [0.0, 0.0]]
  assert len(rows) == 9
  amax = health.latest_amaxes(after)
  assert [amax[f"layers/dense[{i}]/grad"] for i in range(3)] == [3584.0, 2.0**13, 2.0**13]


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
  assert set(fp8["health"][0]["shares"]) == {"hidden/kernel", "out/kernel", "hidden/x", "out/x", "hidden/grad",
                                             "out/grad"}
  assert {"hidden/grad", "out/x"} <= set(fp8["health"][0]["amax"])
  assert "FP8 health of the FP8 run over 2 measured steps: output gradients saturated up to" in result["table"]
  assert set(result["health_operands"]) == set(report.HEALTH_OPERANDS)
  assert [s for s, _ in fp8["heldout_curve"]] == [2, 4, 6]
  assert len(fp8["train_curve"]) == 6 and len(fp8["step_times_s"]) == 4  # the two measured steps are not timed
  assert abs(fp8["train_curve"][0] - bf16["train_curve"][0]) < 0.05 * bf16["train_curve"][0]  # same start
  assert fp8["ratios"]["tokens_per_s"] == pytest.approx(fp8["tokens_per_s"] / bf16["tokens_per_s"])
  assert json.loads((tmp_path / "report.json").read_text())["runs"][1]["name"] == "FP8"


def test_a_run_with_no_timed_step_says_so(tmp_path):
  """Health counters at every step leave the FP8 run untimed: its speed figures are None, never nan, and the table
  prints "-" and "not measured" with the reason."""
  result = run(lambda fp8: _Net(), _batches(3, 0), steps=3, eval_batches=_batches(1, 1), health_every=1,
               out=tmp_path, quiet=True)
  bf16, fp8 = result["runs"]
  assert fp8["tokens_per_s"] is None and fp8["step_s_median"] is None and fp8["ratios"]["tokens_per_s"] is None
  assert bf16["tokens_per_s"] > 0 and bf16["timing_note"] is None
  assert "nan" not in result["table"] and "tokens/s not measured" in result["table"]
  assert "no step of the FP8 run was timed: each of its 3 steps took the FP8 health counters" in result["table"]
  assert json.loads((tmp_path / "report.json").read_text())["runs"][1]["tokens_per_s"] is None
  # The command line spaces its health steps at least two apart, so that half the steps or more are timed.
  assert [cli.health_every(6, 5), cli.health_every(100, 5), cli.health_every(6, 0)] == [2, 20, 0]


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
  for bad in (["--amax-history-len", "0"], ["--recipe", "current", "--amax-history-len", "16"]):
    with pytest.raises(SystemExit):
      cli.main(bad)


def test_fast_accumulation_flag_sets_the_backward_gemms():
  default, fast = cli.fp8_recipe("delayed"), cli.fp8_recipe("current", fast_accumulation=True)
  assert default.fp8_gemm_dgrad.use_split_accumulator and default.fp8_gemm_wgrad.use_split_accumulator
  assert isinstance(fast, recipe.Float8CurrentScaling)
  assert not fast.fp8_gemm_dgrad.use_split_accumulator and not fast.fp8_gemm_wgrad.use_split_accumulator
  assert fast.fp8_gemm_fprop == default.fp8_gemm_fprop
  assert default.amax_history_len == recipe.DelayedScaling().amax_history_len
  assert cli.fp8_recipe("delayed", amax_history_len=16).amax_history_len == 16


@pytest.mark.slow  # ~30 s on 2 cores: four runs of two steps, with their compiles
def test_seeds_flag_summarizes_every_seed(tmp_path, capsys):
  out = tmp_path / "seeds"
  summary = cli.main(["--preset", "tiny", "--steps", "2", "--batch", "2", "--seq", "32", "--seeds", "2", "--seed", "3",
                      "--evals", "1", "--eval-batches", "1", "--health", "0", "--out", str(out)])
  printed = capsys.readouterr().out.strip().splitlines()
  assert printed[-1].startswith(f"reports and plots: {out.resolve()}")
  assert [r["seed"] for r in summary["seeds"]] == [3, 4]
  for r, rep in zip(summary["seeds"], summary["reports"]):
    runs = {x["name"]: x for x in rep["runs"]}
    assert r["bf16_heldout"] == runs["BF16"]["heldout_loss"] and r["fp8_heldout"] == runs["FP8"]["heldout_loss"]
  ratios = [r["heldout_ratio"] for r in summary["seeds"]]
  assert summary["heldout_ratio_mean"] == pytest.approx(sum(ratios) / 2)
  assert summary["heldout_ratio_standard_error"] == pytest.approx(abs(ratios[0] - ratios[1]) / 2)
  # the two seeds start from different parameters and batches
  assert summary["reports"][0]["runs"][0]["train_curve"][0] != summary["reports"][1]["runs"][0]["train_curve"][0]
  saved = json.loads((out / "seeds.json").read_text())
  assert saved["heldout_ratio_mean"] == summary["heldout_ratio_mean"] and len(saved["seeds"]) == 2
  assert (out / "seed-3" / "report.json").exists() and (out / "seed-4" / "loss.png").stat().st_size > 0
  assert any(line.startswith("FP8 vs BF16 over 2 seeds: held-out loss") for line in printed)


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
  for row in fp8["health"]:  # every layer's output gradients; fc1's (inside the fused MLP) has its amax only
    for i in range(2):
      grads = {f"layer_{i}/mlp/wo_grad", f"layer_{i}/self_attention/qkv/grad", f"layer_{i}/self_attention/out/grad"}
      assert grads <= set(row["shares"]) and f"layer_{i}/mlp/wi_grad" not in row["shares"]
      assert f"layer_{i}/mlp/wi_grad" in row["amax"]
  assert abs(fp8["ratios"]["heldout_loss"] - 1) < 0.05
  for name in PLOTS:
    assert (out / name).stat().st_size > 1000, name


def test_every_recipe_has_a_name():
  """--recipe names every recipe te_jax has, each its class with its defaults."""
  assert {type(cli.fp8_recipe(name)) for name in RECIPES} == set(typing.get_args(recipe.Recipe))
  assert cli.fp8_recipe("block") == recipe.Float8BlockScaling()
  assert cli.fp8_recipe("nvfp4") == recipe.NVFP4BlockScaling()


def test_ctrl_c_keeps_the_finished_run(tmp_path, monkeypatch):
  """Ctrl-C during the second run: report.json and the plots hold the first (FP8) run and name the missing one; the
  command line prints one line and exits 130, with no traceback."""
  real = api.train_run

  def interrupt_bf16(run_, *args, **kwargs):
    if run_.name == "BF16":
      raise KeyboardInterrupt
    return real(run_, *args, **kwargs)

  monkeypatch.setattr(api, "train_run", interrupt_bf16)
  with pytest.raises(api.Interrupted) as e:
    run(lambda fp8: _Net(), _batches(2, 0), steps=2, eval_batches=_batches(1, 1), out=tmp_path, quiet=True)
  assert e.value.missing == ["BF16"]
  saved = json.loads((tmp_path / "report.json").read_text())
  assert [r["name"] for r in saved["runs"]] == ["FP8"] and saved["missing"] == ["BF16"]
  assert "partial report: the BF16 run did not finish" in saved["table"]
  assert (tmp_path / "loss.png").stat().st_size > 0
  def interrupted(*args, **kwargs):
    raise api.Interrupted(tmp_path, ["BF16"])

  monkeypatch.setattr(cli, "_compare", interrupted)
  monkeypatch.setattr(cli.lm, "load_corpus", lambda n: (np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)))
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--preset", "tiny", "--out", str(tmp_path)])
  assert exit_.value.code == 130
