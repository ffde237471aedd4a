"""Non-finite values stay visible under FP8.

A saturating cast alone turns an inf into +-max (E4M3 has no inf), a finite value training goes on with: with
delayed scaling a normal-looking loss, with current scaling finite garbage, where BF16 gives inf/NaN. Every FP8 cast
therefore maps a non-finite input (+-inf, NaN) to NaN, in both formats, and keeps saturating finite values:

- the casts of quantize, quantize_interleaved, norm with FP8 output and activation with FP8 output, through the CPU
  handlers and the reference path, against a numpy oracle (NaN exactly where the cast's float32 input is not finite;
  every other byte the saturating cast's, a finite input whose scaled value overflows float32 included);
- a scale computed from the non-finite amax of the tensor itself (current scaling) still gives NaN;
- end to end: te_jax.dense, te_jax.layernorm_mlp and te_flax.TransformerLayer under every recipe in te_jax.recipe,
  with one inf in the input, give a non-finite output and loss as the same computation in BF16 does (the same
  programs on finite inputs give finite ones), and the delayed-scaling state keeps finite scales;
- on a GPU (``@pytest.mark.gpu``): the same through the CUDA kernels (quantize.cu, norm_fwd.cu, activation.cuh).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import te_jax
import te_jax.flax as te_flax
from conftest import assert_fp8_equal, isnan
from te_jax import recipe as te_recipe
from te_jax._core import native, scaling
from te_jax.ops.activation import activation_fwd
from te_jax.ops.norm import norm_fwd
from te_jax.ops.quantize import amax, quantize
from te_jax.ops.quantize_interleaved import interleave, quantize_interleaved

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8 = pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
IN_DTYPES = pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
PATHS = pytest.mark.parametrize("path", ["cpu", "reference"])
CPU = jax.devices("cpu")[0]
# Every recipe the package offers, by name: a new one is tested here the day it is added.
RECIPES = {name: getattr(te_recipe, name) for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                                       "MXFP8BlockScaling", "NVFP4BlockScaling")}
TARGETS = {"cpu": "_cpu\"", "gpu": "_cuda\""}


def test_every_recipe_is_covered():
  recipes = {n for n in te_recipe.__all__ if n not in ("Format", "MMParams", "Recipe")}
  assert recipes == set(RECIPES), recipes


def oracle(y, scale, fp8) -> np.ndarray:
  """The FP8 cast in numpy: ml_dtypes' cast of the clipped float32 product, NaN where ``y`` is not finite."""
  m = np.float32(ml_dtypes.finfo(fp8).max)
  y = np.asarray(y).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    return np.where(np.isfinite(y), np.clip(y * np.float32(scale), -m, m), np.float32(np.nan)).astype(fp8)


def special_input(dtype, fp8, shape=(5, 24)) -> np.ndarray:
  """Finite values inside and beyond the range (3e38: its product with a scale > 1 overflows float32), subnormals,
  zeros, and +-inf and NaN, wrapped over ``shape``."""
  m = float(ml_dtypes.finfo(fp8).max)
  v = np.array([0.0, -0.0, 1.0, -1.5, m, -m, 1.5 * m, -4 * m, 3e38, -3e38, 1e-30, 2.0**-9, np.inf, -np.inf, np.nan,
                -np.nan, 7.0, -0.25], np.float32)
  with np.errstate(over="ignore"):
    return np.resize(v, shape).astype(dtype)


def run(fn, args, path, device=CPU, monkeypatch=None):
  """``fn(*args)`` jitted on ``device``, through the native handlers (checked in the compiled HLO) or, for path
  "reference", the pure-JAX reference lowering (no native call in the HLO)."""
  if path == "reference":
    monkeypatch.setitem(native.registered, "cpu", [])
  args = jax.device_put(args, device)
  compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
  calls = compiled.as_text().count(TARGETS[device.platform])
  assert (calls == 0) if path == "reference" else (calls > 0), (path, calls)
  return compiled(*args)


def check_cast(q, y, scale, fp8, what):
  """``q`` is the cast of ``y * scale``: NaN exactly where ``y`` is not finite, the saturating cast elsewhere."""
  y32 = np.asarray(y).astype(np.float32)
  np.testing.assert_array_equal(isnan(q), ~np.isfinite(y32), err_msg=f"{what}: NaN positions")
  assert_fp8_equal(q, oracle(y32, scale, fp8), what=what)


# ---- the casts ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 4.0, 2.0**-6])
@PATHS
@IN_DTYPES
@FP8
def test_quantize(fp8, dtype, path, scale, monkeypatch):
  x = special_input(dtype, fp8)
  out = run(lambda x, s: quantize(x, s, fp8, transpose=True), (x, np.float32(scale)), path, monkeypatch=monkeypatch)
  check_cast(out.out.data, x, scale, fp8, "data")
  check_cast(out.out.data_t, x.T, scale, fp8, "data_t")
  assert not np.isfinite(np.asarray(out.amax))


@FP8
def test_quantize_interleaved(fp8, monkeypatch):
  """No CPU handler: the reference here, the CUDA kernel in test_gpu_casts."""
  check_interleaved(fp8, "reference", CPU, monkeypatch)


def check_interleaved(fp8, path, device, monkeypatch=None):
  parts = [special_input(np.float32, fp8, (6, 16)), np.roll(special_input(np.float32, fp8, (6, 16)), 5)]
  out = run(lambda a, b, s: quantize_interleaved([a, b], s, fp8, group=8, transpose=True), (*parts, np.float32(2.0)),
            path, device, monkeypatch)
  x = np.asarray(interleave([jnp.asarray(p) for p in parts], 8))
  check_cast(out.out.data, x, 2.0, fp8, "data")
  check_cast(out.out.data_t, x.T, 2.0, fp8, "data_t")


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@PATHS
@FP8
def test_norm_fp8_output(fp8, norm_type, path, monkeypatch):
  """A non-finite gamma (or beta) column makes y non-finite there; an inf in x makes its row's statistics non-finite
  (RMSNorm: rsigma 0, so only the inf itself is NaN). The FP8 output is NaN exactly where the float32 output of the
  same path is not finite."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((6, 40)).astype(np.float32)
  x[4, 3] = np.inf
  gamma = (1 + rng.standard_normal(40)).astype(np.float32)
  gamma[[5, 17, 30]] = [np.inf, -np.inf, np.nan]
  beta = rng.standard_normal(40).astype(np.float32)
  beta[21] = np.inf
  if norm_type == "rmsnorm":
    beta = None

  def f(x, g, *b):
    fp8_out = norm_fwd(x, g, *b, norm_type=norm_type, dtype=fp8, scale=8.0, transpose=True)
    return fp8_out, norm_fwd(x, g, *b, norm_type=norm_type, dtype=jnp.float32).out

  out, y = run(f, (x, gamma) + (() if beta is None else (beta,)), path, monkeypatch=monkeypatch)
  assert not np.all(np.isfinite(np.asarray(y)[4])) and not np.isfinite(np.asarray(y)[0, 5])
  check_cast(out.out.data, y, 8.0, fp8, "out")
  check_cast(out.out.data_t, np.asarray(y).T, 8.0, fp8, "out_t")


@pytest.mark.parametrize("act", [("gelu",), ("relu",), ("silu", "linear"), ("squared_relu", "linear")],
                         ids=lambda a: "-".join(a))
@PATHS
@FP8
def test_activation_fp8_output(fp8, act, path, monkeypatch):
  """NaN exactly where act(x) (the same path's float32 output) is not finite: relu(-inf) = 0 stays 0, gelu(inf) =
  inf becomes NaN. relu-type activations are exact, so their bytes are checked against the oracle too."""
  gated = len(act) == 2
  v = special_input(np.float32, fp8, (3, 2, 24) if gated else (3, 24))

  def f(x):
    return activation_fwd(x, act, dtype=fp8, scale=2.0), activation_fwd(x, act, dtype=jnp.float32).out

  out, y = run(f, (v,), path, monkeypatch=monkeypatch)
  y = np.asarray(y)
  assert not np.all(np.isfinite(y))
  np.testing.assert_array_equal(isnan(out.out.data), ~np.isfinite(y), err_msg="NaN positions")
  if act[0] in ("relu", "squared_relu"):
    check_cast(out.out.data, y, 2.0, fp8, "data")


@FP8
def test_current_scaling_keeps_the_nan(fp8):
  """The scale from a non-finite amax is the fallback (1.0): the finite values saturate, the inf is NaN."""
  x = jnp.asarray(np.array([[1.0, 1e6, np.inf, -2.0]], np.float32))
  a = amax(x)
  s = scaling.compute_scale(a, jnp.float32(1.0), scaling.fp8_max(fp8))
  assert not np.isfinite(float(a)) and float(s) == 1.0
  q = quantize(x, s, fp8).out.data
  assert_fp8_equal(q, oracle(x, 1.0, fp8))
  assert isnan(q)[0, 2] and not isnan(q)[0, 1]


@pytest.mark.parametrize("length", [16, 1024, 4096])
def test_amax_history_max_keeps_the_nan(length):
  """A NaN anywhere in the history gives a NaN amax (so compute_scale keeps the scale), however long the history:
  XLA:CPU's max reduction alone loses it in a 4096-entry one."""
  for pos in (0, 1, length // 2, length - 1):
    h = np.abs(np.random.default_rng(pos).standard_normal(length)).astype(np.float32)
    h[pos] = np.nan
    a = jax.jit(lambda h: scaling.amax_from_history(h, "max"))(jax.device_put(h, CPU))
    assert np.isnan(float(a)), (length, pos, float(a))
  assert float(jax.jit(scaling.amax_from_history)(jnp.arange(length, dtype=jnp.float32))) == length - 1


# ---- end to end -----------------------------------------------------------------------------------------------------


class _Layer(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "transformer":
      layer = te_flax.TransformerLayer(hidden_size=32, intermediate_dim=64, num_attention_heads=2,
                                       hidden_dropout=0.0, attention_dropout=0.0, dtype=jnp.bfloat16)
      return layer(x, deterministic=True)
    if self.kind == "layernorm_mlp":
      return te_flax.LayerNormMLP(intermediate_dim=64, activation_type=("gelu", "linear"), dtype=jnp.bfloat16)(x)
    return te_flax.DenseGeneral(32, dtype=jnp.bfloat16)(x)


def _functional(kind, x, recipe):
  """te_jax.dense / te_jax.layernorm_mlp called directly (the state as an argument under DelayedScaling)."""
  k = jax.random.normal(jax.random.key(3), (32, 2, 64), jnp.float32) / 8
  k2 = jax.random.normal(jax.random.key(4), (64, 32), jnp.float32) / 8
  delayed = isinstance(recipe, te_recipe.DelayedScaling)
  meta = te_jax.DenseFp8Meta.create(4) if delayed else None
  if kind == "dense":
    return te_jax.dense(x, k2.T, fp8_meta=meta, recipe=recipe)
  return te_jax.layernorm_mlp(x, jnp.ones(32), jnp.zeros(32), k, k2, activation_type=("gelu", "linear"),
                              fp8_meta_1=meta, fp8_meta_2=meta, recipe=recipe)


def _inputs():
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 16, 32), jnp.float32)).astype(ml_dtypes.bfloat16)
  bad = x.copy()
  bad[1, 5, 7] = np.inf
  return x, bad


def _module_case(kind, recipe_name, path, device, monkeypatch):
  """(loss and output of the finite input, loss and output of the input with one inf, new FP8 state) of one jitted
  value_and_grad step of a module under autocast(recipe) (recipe None: BF16)."""
  model = _Layer(kind)
  x, bad = _inputs()
  rec = None if recipe_name is None else RECIPES[recipe_name]()
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    variables = jax.device_put(model.init(jax.random.key(0), jnp.asarray(x)), device)

    def step(v, x):
      out = model.apply(v, x)
      loss = jnp.mean(out.astype(jnp.float32) ** 2)
      return loss, out

    if path == "reference":
      monkeypatch.setitem(native.registered, "cpu", [])
    f = jax.jit(jax.value_and_grad(step, has_aux=True))
    (loss, out), grads = f(variables, jax.device_put(x, device))
    (bad_loss, bad_out), bad_grads = f(variables, jax.device_put(bad, device))
  return (loss, out), (bad_loss, bad_out), bad_grads


def _check_end_to_end(finite, nonfinite, bad_grads, recipe_name):
  (loss, out), (bad_loss, bad_out) = finite, nonfinite
  assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(out, np.float32)))
  assert not np.isfinite(float(bad_loss)), bad_loss
  assert not np.all(np.isfinite(np.asarray(bad_out, np.float32)))
  if recipe_name == "DelayedScaling":  # the non-finite amax never enters the state: its scales stay finite
    scales = [s for p, s in jax.tree_util.tree_leaves_with_path(bad_grads.get(te_jax.FP8_COLLECTION, {}))
              if "scale" in jax.tree_util.keystr(p) and "inv" not in jax.tree_util.keystr(p)]
    assert scales and all(np.all(np.isfinite(np.asarray(s))) for s in scales)


# BF16 (recipe None) runs no FP8 op, so it has one path; each recipe runs on the CPU handlers and the reference path.
CASES = [(None, "cpu")] + [(r, p) for r in RECIPES for p in ("cpu", "reference")]


@pytest.mark.parametrize("recipe_name,path", CASES, ids=[f"{r or 'bf16'}-{p}" for r, p in CASES])
@pytest.mark.parametrize("kind", ["dense", "layernorm_mlp", "transformer"])
@pytest.mark.fast_cases(4)
def test_module_step_with_an_inf_is_not_finite(kind, recipe_name, path, monkeypatch):
  _check_end_to_end(*_module_case(kind, recipe_name, path, CPU, monkeypatch), recipe_name)


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["dense", "layernorm_mlp"])
@pytest.mark.fast_cases(3)
def test_functional_with_an_inf_is_not_finite(kind, recipe_name):
  x, bad = _inputs()
  rec = RECIPES[recipe_name]()
  f = jax.jit(lambda x: _functional(kind, x, rec))
  assert np.all(np.isfinite(np.asarray(f(jnp.asarray(x)), np.float32)))
  assert not np.all(np.isfinite(np.asarray(f(jnp.asarray(bad)), np.float32)))


# ---- the CUDA kernels -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@IN_DTYPES
@FP8
def test_gpu_casts(fp8, dtype, gpu):
  """quantize.cu (vector and generic kernels), norm_fwd.cu and activation.cuh on non-finite inputs."""
  for shape in [(64, 256), (5, 24)]:  # the 128x128-tile kernel (cols % 8 == 0, rows % 8 == 0) and the generic one
    x = special_input(dtype, fp8, shape)
    out = run(lambda x, s: quantize(x, s, fp8, transpose=True, dbias=True), (x, np.float32(4.0)), "cuda", gpu)
    check_cast(out.out.data, x, 4.0, fp8, f"data {shape}")
    check_cast(out.out.data_t, x.T, 4.0, fp8, f"data_t {shape}")
  check_interleaved(fp8, "cuda", gpu)
  x = np.random.default_rng(0).standard_normal((64, 256)).astype(dtype)
  gamma = np.ones(256, np.float32)
  gamma[[3, 100, 255]] = [np.inf, -np.inf, np.nan]
  x[7, 9] = np.inf

  def f(x, g):
    # the float32 output: an output in the input dtype would round twice (to bf16, then to FP8)
    return (norm_fwd(x, g, norm_type="rmsnorm", dtype=fp8, scale=8.0),
            norm_fwd(x, g, norm_type="rmsnorm", dtype=jnp.float32).out)

  out, y = run(f, (x, gamma), "cuda", gpu)
  check_cast(out.out.data, y, 8.0, fp8, "norm out")
  v = special_input(dtype, fp8, (64, 256))
  out, y = run(lambda x: (activation_fwd(x, ("relu",), dtype=fp8, scale=2.0),
                          activation_fwd(x, ("relu",), dtype=jnp.float32).out), (v,), "cuda", gpu)
  check_cast(out.out.data, y, 2.0, fp8, "activation out")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", [None, *RECIPES], ids=["bf16", *RECIPES])
@pytest.mark.parametrize("kind", ["dense", "layernorm_mlp", "transformer"])
def test_gpu_module_step_with_an_inf_is_not_finite(kind, recipe_name, gpu, monkeypatch):
  _check_end_to_end(*_module_case(kind, recipe_name, "cuda", gpu, monkeypatch), recipe_name)
