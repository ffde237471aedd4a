"""Porting from NVIDIA Transformer Engine's JAX modules: te_jax.flax.checkpoint's from_transformer_engine and
to_transformer_engine, and te_jax.flax.te_names (Transformer Engine's keyword names answered with te_jax's).

Transformer Engine's variable layout is built by hand from the facts of its source (transformer_engine/jax/flax:
the parameter names of LayerNorm, LayerNormDenseGeneral, LayerNormMLP, attention's fused 'qkv' and 'out', the
'fp8_metas' collection with '{x,kernel,grad}{postfix}_{scale,amax_history}', scales of shape (1,)); the converted
tree must be exactly the tree te_jax's own modules create (paths, shapes), its values where the layouts say, and the
round trip bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

import te_jax
import te_jax.flax as te_flax
from te_jax.flax.checkpoint import TE_FP8_COLLECTION, from_transformer_engine, to_transformer_engine
from te_jax.flax.te_names import TE_NAMES
from te_jax.recipe import DelayedScaling

HIDDEN, HEADS, HEAD_DIM, MLP, HISTORY, BUCKETS = 64, 4, 16, 128, 8, 32


def _values(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _te_gemm_state(postfix, seed):
  return {f"{role}{postfix}_{kind}": (_values((1,), seed + i) if kind == "scale" else _values((HISTORY,), seed + i))
          for i, (role, kind) in enumerate((r, k) for r in ("x", "kernel", "grad") for k in ("scale", "amax_history"))}


def _te_layer():
  """A Transformer Engine TransformerLayer (encoder, fused QKV, no biases) with relative position biases, in TE's
  variable layout."""
  params = {
      "self_attention": {
          "qkv": {"scale": _values(HIDDEN, 0), "ln_bias": _values(HIDDEN, 1),
                  "kernel": _values((HIDDEN, 3, HEADS * HEAD_DIM), 2)},
          "out": {"kernel": _values((HEADS * HEAD_DIM, HIDDEN), 3)},
      },
      "mlp": {"scale": _values(HIDDEN, 4), "ln_bias": _values(HIDDEN, 5), "wi_kernel": _values((HIDDEN, 1, MLP), 6),
              "wo_kernel": _values((MLP, HIDDEN), 7)},
      "relpos_bias": {"rel_embedding": _values((HEADS, BUCKETS), 8)},
  }
  fp8 = {"self_attention": {"qkv": _te_gemm_state("", 10), "out": _te_gemm_state("", 20)},
         "mlp": {**_te_gemm_state("_0", 30), **_te_gemm_state("_1", 40)}}
  return {"params": params, TE_FP8_COLLECTION: fp8}


def _shapes(tree):
  return {k: tuple(np.shape(v)) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def test_transformer_layer_from_te_is_te_jax_layout_and_round_trips():
  te = _te_layer()
  ours = from_transformer_engine(te, head_dim=HEAD_DIM)
  x = jnp.ones((2, 16, HIDDEN))
  layer = te_flax.TransformerLayer(hidden_size=HIDDEN, intermediate_dim=MLP, num_attention_heads=HEADS,
                                   enable_relative_embedding=True, relative_embedding_buckets=BUCKETS)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=HISTORY)):
    want = jax.eval_shape(lambda: layer.init(jax.random.key(0), x))
  assert sorted(ours) == sorted(want)
  for collection in want:
    assert _shapes(ours[collection]) == _shapes(want[collection]), collection
  # The values where the layouts say: TE's qkv kernel [:, part, head * head_dim + d] is te_jax's [:, head, part, d].
  te_qkv, our_qkv = te["params"]["self_attention"]["qkv"]["kernel"], ours["params"]["self_attention"]["qkv"]["kernel"]
  for h, p, d in ((0, 0, 0), (3, 2, 15), (1, 1, 7)):
    assert our_qkv[5, h, p, d] == te_qkv[5, p, h * HEAD_DIM + d]
  np.testing.assert_array_equal(ours["params"]["self_attention"]["out"]["kernel"].reshape(-1, HIDDEN),
                                te["params"]["self_attention"]["out"]["kernel"])
  np.testing.assert_array_equal(ours["params"]["mlp"]["ln_scale"], te["params"]["mlp"]["scale"])
  fp8 = ours[te_jax.FP8_COLLECTION]["mlp"]
  np.testing.assert_array_equal(fp8["wo_grad_amax_history"], te[TE_FP8_COLLECTION]["mlp"]["grad_1_amax_history"])
  assert fp8["wi_x_scale"] == te[TE_FP8_COLLECTION]["mlp"]["x_0_scale"][0]
  # The round trip, bit for bit.
  back = to_transformer_engine(ours, head_dim=HEAD_DIM)
  assert _shapes(back) == _shapes(te)
  jax.tree.map(np.testing.assert_array_equal, back, te)


def test_layer_norm_and_dense_general_keys():
  te = {"params": {"norm": {"scale": _values(HIDDEN, 0), "ln_bias": _values(HIDDEN, 1)},
                   "proj": {"scale": _values(HIDDEN, 2), "ln_bias": _values(HIDDEN, 3),
                            "kernel": _values((HIDDEN, 32), 4)},
                   "dense": {"kernel": _values((HIDDEN, 32), 5), "bias": _values(32, 6)}},
        TE_FP8_COLLECTION: {"dense": _te_gemm_state("", 7)}, "other": {"kept": jnp.ones(2)}}
  ours = from_transformer_engine(te)
  x = jnp.ones((2, HIDDEN))
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=HISTORY)):
    for name, module in (("norm", te_flax.LayerNorm()), ("proj", te_flax.LayerNormDenseGeneral(32, use_bias=False)),
                         ("dense", te_flax.DenseGeneral(32))):
      want = jax.eval_shape(lambda m=module: m.init(jax.random.key(0), x))
      assert _shapes(ours["params"][name]) == _shapes(want["params"]), name
      if name == "dense":
        assert _shapes(ours[te_jax.FP8_COLLECTION][name]) == _shapes(want[te_jax.FP8_COLLECTION])
  np.testing.assert_array_equal(ours["params"]["norm"]["bias"], te["params"]["norm"]["ln_bias"])
  np.testing.assert_array_equal(ours["params"]["proj"]["ln_scale"], te["params"]["proj"]["scale"])
  assert ours["other"] is te["other"]
  jax.tree.map(np.testing.assert_array_equal, to_transformer_engine(ours), te)


def test_bad_trees_are_named():
  te = _te_layer()
  with pytest.raises(ValueError, match=r"'self_attention/qkv/kernel' is a fused attention projection; give head_dim="):
    from_transformer_engine(te)
  with pytest.raises(ValueError, match=r"head_dim must be a positive int, got 0"):
    from_transformer_engine(te, head_dim=0)
  with pytest.raises(ValueError, match=r"variables must be a variables dict with 'params'"):
    from_transformer_engine(te["params"], head_dim=HEAD_DIM)
  blocks = {"params": {}, TE_FP8_COLLECTION: {"dense": {"x_scale": jnp.ones((4, 4))}}}
  with pytest.raises(ValueError, match=r"the FP8 scale 'dense/x_scale' has shape \(4, 4\)"):
    from_transformer_engine(blocks)
  with pytest.raises(ValueError, match=r"is no multiple of head_dim=24"):
    from_transformer_engine(te, head_dim=24)


# ---- Transformer Engine's keyword names ----------------------------------------------------------------------------


def test_te_names_are_te_jax_attributes():
  """Every te_jax name the table gives is an attribute of that te_jax module, and no Transformer Engine name in it
  is one (it would shadow an option)."""
  for module, names in TE_NAMES.items():
    fields = set(getattr(te_flax, module).__dataclass_fields__)
    for te_name, ours in names.items():
      assert te_name not in fields, (module, te_name)
      for name in ours.split(" and "):
        assert name in fields, (module, te_name, name)


@pytest.mark.parametrize("module", ["LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"])
def test_te_keywords_raise_naming_te_jax_names(module):
  cls = getattr(te_flax, module)
  args = (32,) if module == "LayerNormDenseGeneral" else ()
  for te_name, ours in TE_NAMES[module].items():
    with pytest.raises(TypeError, match=rf"{module} takes {ours} where Transformer Engine's takes {te_name}: pass "
                                        rf"{ours}='v'"):
      cls(*args, **{te_name: "v"})
  # te_jax's own names still construct, and a clone goes through the same constructor.
  layer = cls(*args, norm_type="rmsnorm")
  assert layer.clone().norm_type == "rmsnorm"
