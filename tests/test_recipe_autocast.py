"""te_jax.recipe and te_jax.autocast.

- Recipes: each bad field raises a ValueError that names it; recipes are frozen, hashable and compare by value;
  the formats' dtypes.
- autocast: the state inside and outside (and nested, and after an exception), the default recipe, bad arguments;
  and the reason it lives in a jax user context: a jitted function traced under one recipe is retraced when called
  outside autocast or under another recipe, and gives that context's numerics, never silently the cached ones.
- The quantizers' state: the variables a recipe's quantizer declares are those the linen and NNX modules create
  (names, shapes, dtypes, values, order), and a stateless recipe declares none.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import recipe
from te_jax.recipe import DelayedScaling, Float8CurrentScaling, Format
from te_jax._core.autocast import AutocastState, get_autocast_state
from te_jax._core.scaling import ScaleState
from te_jax.fused.linear import keeps_state
from te_jax.fused.quantizer import DenseFp8Meta, quantizer_for, state_combine

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)


# ---- recipes -------------------------------------------------------------------------------------------------------


def test_delayed_scaling_defaults_are_transformer_engines():
  r = DelayedScaling()
  assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
  assert Float8CurrentScaling().fp8_format is Format.HYBRID
  for r in (DelayedScaling(), Float8CurrentScaling()):  # fast forward GEMM, full-precision dgrad and wgrad
    assert [p.use_split_accumulator for p in (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad)] == [
        False, True, True]


@pytest.mark.parametrize("kwargs,field", [
    ({"margin": -1}, "margin"),
    ({"margin": float("nan")}, "margin"),
    ({"margin": "1"}, "margin"),
    ({"margin": True}, "margin"),
    ({"amax_history_len": 0}, "amax_history_len"),
    ({"amax_history_len": -3}, "amax_history_len"),
    ({"amax_history_len": 16.0}, "amax_history_len"),
    ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ({"amax_compute_algo": "MAX"}, "amax_compute_algo"),
    ({"fp8_format": "E4M3"}, "fp8_format"),
    ({"fp8_format": "HYBRID"}, "fp8_format"),
    ({"fp8_format": None}, "fp8_format"),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_delayed_scaling_validation(kwargs, field):
  with pytest.raises(ValueError, match=rf"^{field} must be"):
    DelayedScaling(**kwargs)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("field", ["fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"])
@pytest.mark.parametrize("bad", [True, None, {"use_split_accumulator": True}])
def test_gemm_params_validation(cls, field, bad):
  with pytest.raises(ValueError, match=rf"^{field} must be a te_jax.recipe.MMParams"):
    cls(**{field: bad})


@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_mm_params_validation(bad):
  with pytest.raises(ValueError, match=r"^use_split_accumulator must be a bool"):
    recipe.MMParams(use_split_accumulator=bad)


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID", 1, None])
def test_current_scaling_validation(fmt):
  with pytest.raises(ValueError, match=r"^fp8_format must be a te_jax.recipe.Format"):
    Float8CurrentScaling(fp8_format=fmt)


def test_valid_edge_values():
  r = DelayedScaling(margin=0, amax_history_len=1, amax_compute_algo="most_recent", fp8_format=Format.E4M3)
  assert r.amax_history_len == 1 and r.amax_compute_algo == "most_recent"


@pytest.mark.parametrize("r", [DelayedScaling(amax_history_len=16), Float8CurrentScaling()], ids=["delayed", "current"])
def test_recipes_are_frozen(r):
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.fp8_format = Format.E4M3
  # replace() goes through validation too.
  with pytest.raises(ValueError, match="fp8_format"):
    dataclasses.replace(r, fp8_format="E4M3")


def test_recipes_are_hashable_and_compare_by_value():
  a, b = DelayedScaling(amax_history_len=16), DelayedScaling(amax_history_len=16)
  assert a == b and hash(a) == hash(b)
  assert a != DelayedScaling(amax_history_len=32)
  assert Float8CurrentScaling() == Float8CurrentScaling()
  assert Float8CurrentScaling() != Float8CurrentScaling(Format.E4M3)
  assert DelayedScaling() != Float8CurrentScaling()
  table = {a: 1, Float8CurrentScaling(): 2}
  assert table[b] == 1 and table[Float8CurrentScaling()] == 2
  state = AutocastState(True, a)
  assert hash(state) == hash(AutocastState(True, b))


def test_format_dtypes():
  assert Format.HYBRID.fwd_dtype == E4M3 and Format.HYBRID.bwd_dtype == E5M2
  assert Format.E4M3.fwd_dtype == E4M3 and Format.E4M3.bwd_dtype == E4M3
  assert {f.value for f in Format} == {"E4M3", "HYBRID"}
  assert recipe.Format("HYBRID") is Format.HYBRID


# ---- autocast state ------------------------------------------------------------------------------------------------


def test_state_outside_any_autocast():
  s = get_autocast_state()
  assert not s.enabled and s.recipe is None and s.fp8_recipe is None


def test_state_inside_and_restored():
  r = DelayedScaling(amax_history_len=8)
  with te_jax.autocast(enabled=True, recipe=r) as yielded:
    s = get_autocast_state()
    assert s is yielded
    assert s.enabled and s.recipe == r and s.fp8_recipe == r
    inner = Float8CurrentScaling(Format.E4M3)
    with te_jax.autocast(enabled=True, recipe=inner):
      assert get_autocast_state().fp8_recipe == inner
    assert get_autocast_state() == s
    with te_jax.autocast(enabled=False):
      assert get_autocast_state().fp8_recipe is None
    assert get_autocast_state() == s
  assert not get_autocast_state().enabled


def test_state_restored_after_an_exception():
  with pytest.raises(RuntimeError, match="boom"):
    with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
      raise RuntimeError("boom")
  assert get_autocast_state() == AutocastState()


def test_default_recipe_is_delayed_scaling():
  with te_jax.autocast(enabled=True) as s:
    assert s.recipe == DelayedScaling() and s.fp8_recipe == DelayedScaling()
  with te_jax.autocast() as s:  # disabled, but the recipe is still filled in
    assert not s.enabled and s.recipe == DelayedScaling() and s.fp8_recipe is None


@pytest.mark.parametrize("bad", ["DelayedScaling", Format.HYBRID, object(), DelayedScaling], ids=str)
def test_bad_recipe_type(bad):
  want = r"pass DelayedScaling\(\)" if bad is DelayedScaling else r"recipe must be one of .*Float8BlockScaling\(\).*got"
  with pytest.raises(ValueError, match=want):
    with te_jax.autocast(enabled=True, recipe=bad):
      pass
  assert get_autocast_state() == AutocastState()


@pytest.mark.parametrize("name", ["enabled", "allow_emulation"])
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_autocast_flags_must_be_bools(name, bad):
  """``enabled="no"`` would be truthy: every flag is checked, and the state is left as it was."""
  with pytest.raises(TypeError, match=f"autocast: {name} must be a bool, got {bad!r}"):
    with te_jax.autocast(**{name: bad}):
      pass
  assert get_autocast_state() == AutocastState()


def test_fp8_support_check_passes_on_this_machine():
  """On CPU (the FP8 numerics are emulated on purpose) and on the H200 (compute capability 9.0) enabling autocast
  raises nothing."""
  with te_jax.autocast(enabled=True):
    pass
  with te_jax.autocast(enabled=True, allow_emulation=True) as s:
    assert s.allow_emulation


class _FakeDevice:
  def __init__(self, platform, compute_capability=None, device_kind="fake"):
    self.platform, self.device_kind = platform, device_kind
    if compute_capability is not None:
      self.compute_capability = compute_capability


@pytest.mark.parametrize("cc,raises", [("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False), ("10.0", False)])
def test_fp8_support_check_on_a_simulated_gpu(monkeypatch, cc, raises):
  """jax.local_devices() faked to hold a GPU of compute capability ``cc`` (next to a CPU device): below 8.9 enabling
  autocast raises and names the fix, unless allow_emulation=True; disabled autocast never checks; the state is
  left as it was."""
  gpu = _FakeDevice("gpu", cc, device_kind="Fake GPU")
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_FakeDevice("cpu"), gpu])
  if raises:
    with pytest.raises(RuntimeError, match=rf"FP8 needs compute capability >= 8\.9, but Fake GPU has {cc}\. "
                                           r"Pass autocast\(\.\.\., allow_emulation=True\)"):
      with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        pass
    assert get_autocast_state() == AutocastState()
  else:
    with te_jax.autocast(enabled=True) as s:
      assert s.enabled
  with te_jax.autocast(enabled=True, allow_emulation=True) as s:
    assert s.enabled and s.allow_emulation
  with te_jax.autocast(enabled=False) as s:
    assert not s.enabled


# ---- retracing -----------------------------------------------------------------------------------------------------


def _inputs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((32, 16)) / 5, jnp.float32)
  return jax.device_put((x, kernel), jax.devices("cpu")[0])


RETRACE_RECIPES = {
    "delayed": (DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)),
    "current": (Float8CurrentScaling(), Float8CurrentScaling(Format.E4M3)),
}


@pytest.mark.parametrize("first,second", RETRACE_RECIPES.values(), ids=RETRACE_RECIPES)
def test_jit_retraces_when_autocast_changes(first, second):
  """A Python side effect counts traces. Traced inside autocast(enabled=True), then called outside, under another
  recipe, and under enabled=False: each is a new trace with that context's numerics. Returning to a context seen
  before reuses its trace."""
  traces = []

  @jax.jit
  def f(x, kernel, meta):
    traces.append(get_autocast_state())
    return te_jax.dense(x, kernel, fp8_meta=meta)

  x, kernel = _inputs()
  # Used by DelayedScaling only: scales from the inputs' amaxes, as after a step of training.
  meta = te_jax.DenseFp8Meta(*(ScaleState(jnp.zeros(4), 448.0 / jnp.max(jnp.abs(v)))
                               for v in (x, kernel, x)))
  plain = np.asarray(jax.lax.dot_general(x, kernel, (((1,), (0,)), ((), ()))))

  with te_jax.autocast(enabled=True, recipe=first):
    fp8 = np.asarray(f(x, kernel, meta))
  assert len(traces) == 1 and traces[-1].fp8_recipe == first
  assert not np.array_equal(fp8, plain)  # quantized: the inputs are not FP8-representable
  np.testing.assert_allclose(fp8, plain, rtol=0.2, atol=0.2)  # but close (a sanity check; test_dense has the bounds)

  outside = np.asarray(f(x, kernel, meta))
  assert len(traces) == 2 and traces[-1].fp8_recipe is None
  np.testing.assert_array_equal(outside, plain)  # the high-precision result, not the cached FP8 one

  with te_jax.autocast(enabled=True, recipe=second):
    np.asarray(f(x, kernel, meta))
  assert len(traces) == 3 and traces[-1].fp8_recipe == second

  with te_jax.autocast(enabled=False, recipe=first):
    disabled = np.asarray(f(x, kernel, meta))
  assert len(traces) == 4 and traces[-1].fp8_recipe is None
  np.testing.assert_array_equal(disabled, plain)

  # Contexts seen before: their cached traces, with their numerics.
  with te_jax.autocast(enabled=True, recipe=first):
    np.testing.assert_array_equal(np.asarray(f(x, kernel, meta)), fp8)
  np.testing.assert_array_equal(np.asarray(f(x, kernel, meta)), plain)
  assert len(traces) == 4


def test_gradient_retraces_between_formats():
  """HYBRID and E4M3 differ only in the backward pass (E5M2 vs E4M3 gradients): the jitted gradient must be traced
  per format and give different kernel gradients."""
  traces = []

  @jax.jit
  def grad(x, kernel, g):
    traces.append(1)
    return jax.grad(lambda k: jnp.sum(te_jax.dense(x, k) * g))(kernel)

  x, kernel = _inputs()
  g = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)), jnp.float32)
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling(Format.HYBRID)):
    hybrid = np.asarray(grad(x, kernel, g))
  with te_jax.autocast(enabled=True, recipe=Float8CurrentScaling(Format.E4M3)):
    e4m3 = np.asarray(grad(x, kernel, g))
  plain = np.asarray(grad(x, kernel, g))
  assert len(traces) == 3
  assert not np.array_equal(hybrid, e4m3)
  np.testing.assert_allclose(plain, np.asarray(x, np.float64).T @ np.asarray(g, np.float64), rtol=1e-5, atol=1e-4)


def test_enabled_false_is_plain_math_in_a_flax_module():
  import flax.linen as nn

  import te_jax.flax as te_flax

  x, _ = _inputs()
  layer = te_flax.DenseGeneral(16)
  with te_jax.autocast(enabled=False, recipe=DelayedScaling(amax_history_len=4)):
    variables = layer.init(jax.random.key(0), x)
    out = layer.apply(variables, x)
  assert set(variables) == {"params"}  # no FP8 state when FP8 is off
  reference = nn.DenseGeneral(16).apply(variables, x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(reference))


# ---- the quantizers' state -----------------------------------------------------------------------------------------


def _held(pairs):
  """``(name, shape, dtype, value)`` of each variable, in order."""
  return [(name, tuple(v.shape), jnp.dtype(v.dtype), np.asarray(v).tolist()) for name, v in pairs]


def _declared(quantizer, prefixes=("",)):
  return [(p + v.name, v.shape, jnp.dtype(v.dtype), np.asarray(v.init(v.shape, v.dtype)).tolist())
          for p in prefixes for v in quantizer.state_variables]


def test_delayed_scaling_declares_the_state_the_modules_create():
  import te_jax.flax as te_flax
  import te_jax.nnx as te_nnx
  from flax import nnx

  r = DelayedScaling(amax_history_len=8)
  quantizer = quantizer_for(r)
  # The checkpoint layout: these names, in this order, a history of amax_history_len and a scalar per tensor.
  assert [(v.name, v.shape) for v in quantizer.state_variables] == [
      (f"{t}_{kind}", shape) for t in ("x", "kernel", "grad") for kind, shape in (("amax_history", (8,)),
                                                                                   ("scale", ()))]
  assert [v.combine for v in quantizer.state_variables] == ["max", "min"] * 3
  assert all(state_combine(v.name) == v.combine for v in quantizer.state_variables)
  assert quantizer_for(r, calibrating=True).state_variables == quantizer.state_variables
  assert quantizer.stateful and keeps_state(r)
  x = jnp.ones((16, 32))
  with te_jax.autocast(enabled=True, recipe=r):
    linen = te_flax.DenseGeneral(16).init(jax.random.key(0), x)[te_jax.FP8_COLLECTION]
    linen_mlp = te_flax.LayerNormMLP(64).init(jax.random.key(0), x)[te_jax.FP8_COLLECTION]
    layer = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0))
    mlp = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
  fp8_attributes = lambda m: [(n, v[...]) for n, v in vars(m).items() if isinstance(v, te_nnx.Fp8State)]  # noqa: E731
  assert _held(linen.items()) == _held(fp8_attributes(layer)) == _declared(quantizer)
  assert _held(linen_mlp.items()) == _held(fp8_attributes(mlp)) == _declared(quantizer, ("wi_", "wo_"))
  meta = quantizer.state_meta([linen[v.name] for v in quantizer.state_variables])
  assert isinstance(meta, DenseFp8Meta)
  assert jax.tree.all(jax.tree.map(jnp.array_equal, meta, DenseFp8Meta.create(8)))


def test_a_stateless_recipe_declares_no_state():
  import te_jax.flax as te_flax
  import te_jax.nnx as te_nnx
  from flax import nnx

  r = Float8CurrentScaling()
  quantizer = quantizer_for(r)
  assert quantizer.state_variables == () and not quantizer.stateful and not keeps_state(r) and not keeps_state(None)
  with pytest.raises(TypeError, match="keeps no state"):
    quantizer.state_meta([])
  x = jnp.ones((16, 32))
  with te_jax.autocast(enabled=True, recipe=r):
    assert set(te_flax.DenseGeneral(16).init(jax.random.key(0), x)) == {"params"}
    assert not jax.tree.leaves(nnx.state(te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(0)), te_nnx.Fp8State))
