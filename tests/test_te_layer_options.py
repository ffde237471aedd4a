"""Transformer Engine's layer options on te_jax's modules, against references written from their documented meaning
(Transformer Engine's transformer_engine/jax/flax/transformer.py and module.py):

- ``fuse_qkv_params`` (TransformerLayer, MultiHeadAttention): False gives separate ``query``, ``key`` and ``value``
  kernels, Transformer Engine's names; the unfused layer whose kernels are the fused kernel's slices computes the
  fused layer's function (values and gradients); ``from_transformer_engine`` converts an unfused tree.
- ``intermediate_dropout_dims`` (TransformerLayer; LayerNormMLP, Transformer Engine's
  ``intermediate_hidden_dropout_dims``): the mask, recovered through an identity fc2, is shared along the broadcast
  dims and not along the others, and the output is a numpy reference that applies it.
- checkpoint names (``quantization_checkpoint_name`` of DenseGeneral / LayerNormDenseGeneral / LayerNormMLP,
  LayerNormMLP's ``ffn1_ckpt_name`` / ``ffn2_ckpt_name``): under ``save_only_these_names`` of those names,
  ``jax.checkpoint`` saves exactly the tensors so named (``print_saved_residuals``), and the gradients are the
  plain step's bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax.flax.checkpoint import from_transformer_engine, to_transformer_engine
from te_jax.recipe import DelayedScaling

H, HEADS, D, F = 32, 4, 8, 32
RECIPE = DelayedScaling(amax_history_len=4)


def _normal(seed, shape, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _shapes(tree):
  return {k: tuple(np.shape(v)) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def _layer(**kw):
  return te_flax.TransformerLayer(hidden_size=H, intermediate_dim=F, num_attention_heads=HEADS, dtype=jnp.float32,
                                  backend="unfused", **kw)


# ---- fuse_qkv_params -----------------------------------------------------------------------------------------------


def _unfused_params(fused: dict) -> dict:
  """A fused layer's parameters as the unfused layer's: each attention's ``query``, ``key`` and ``value`` kernels the
  slices of its ``qkv`` (hidden, heads, 3, head_dim) or ``kv`` (hidden, groups, 2, head_dim) kernel."""
  out = {}
  for name, sub in fused.items():
    if not isinstance(sub, dict) or "out" not in sub:
      out[name] = sub
      continue
    attn = {k: v for k, v in sub.items() if k not in ("qkv", "kv")}
    if "qkv" in sub:
      qkv = dict(sub["qkv"])
      kernel = qkv.pop("kernel")
      attn["query"] = {**qkv, "kernel": kernel[:, :, 0]}
      attn["key"], attn["value"] = {"kernel": kernel[:, :, 1]}, {"kernel": kernel[:, :, 2]}
    else:
      kv = sub["kv"]["kernel"]
      attn["key"], attn["value"] = {"kernel": kv[:, :, 0]}, {"kernel": kv[:, :, 1]}
    out[name] = attn
  return out


@pytest.mark.parametrize("kw", [dict(), dict(num_gqa_groups=2),
                                dict(layer_type="decoder", enable_rotary_pos_emb=True)],
                         ids=["mha", "gqa", "decoder"])
@pytest.mark.fast_cases(1)
def test_unfused_qkv_is_the_fused_layer_on_its_kernel_slices(kw):
  x, enc = _normal(0, (2, 6, H)), _normal(1, (2, 5, H))
  args = (x, enc) if kw.get("layer_type") == "decoder" else (x,)
  fused, unfused = _layer(**kw), _layer(fuse_qkv_params=False, **kw)
  variables = fused.init(jax.random.key(0), *args, deterministic=True)
  params = _unfused_params(variables["params"])
  # Transformer Engine's names and te_jax's per-head shapes: query (hidden, heads, D), key / value (hidden, groups, D).
  want = jax.eval_shape(lambda: unfused.init(jax.random.key(0), *args, deterministic=True))["params"]
  assert _shapes(params) == _shapes(want)
  groups = kw.get("num_gqa_groups", HEADS)
  attentions = ["self_attention"] + (["encoder_decoder_attention"] if len(args) == 2 else [])
  for a in attentions:
    assert sorted(want[a]) == ["key", "out", "query", "value"], sorted(want[a])
    assert want[a]["key"]["kernel"].shape == want[a]["value"]["kernel"].shape == (H, groups, D)

  def loss(p, apply):
    return jnp.sum(jnp.sin(apply({"params": p}, *args, deterministic=True)))

  y_fused = fused.apply(variables, *args, deterministic=True)
  y_unfused = unfused.apply({"params": params}, *args, deterministic=True)
  np.testing.assert_allclose(y_unfused, y_fused, rtol=1e-5, atol=1e-5)  # float32 GEMMs of other shapes
  g_fused = _unfused_params(jax.grad(loss)(variables["params"], fused.apply))
  g_unfused = jax.grad(loss)(params, unfused.apply)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g_unfused, g_fused)


def test_unfused_qkv_nnx_is_linen_bit_for_bit():
  x = _normal(2, (2, 6, H))
  layer = _layer(fuse_qkv_params=False)
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    model = te_nnx.TransformerLayer(H, F, HEADS, fuse_qkv_params=False, dtype=jnp.float32, backend="unfused",
                                    rngs=nnx.Rngs(0))
    te_nnx.from_linen(model, variables)  # the same names and shapes, or it raises
    y_linen = layer.apply(variables, x, deterministic=True)
    y_nnx = model(x, deterministic=True)
  assert sorted(variables["params"]["self_attention"]) == ["key", "out", "query", "value"]
  assert sorted(variables[te_jax.FP8_COLLECTION]["self_attention"]) == ["key", "out", "query", "value"]
  np.testing.assert_array_equal(np.asarray(y_nnx), np.asarray(y_linen))


def test_from_transformer_engine_converts_unfused_qkv():
  """Transformer Engine's unfused attention: ``query`` (a LayerNormDenseGeneral, hidden -> heads * head_dim),
  ``key`` and ``value`` (DenseGeneral, hidden -> groups * head_dim), flat over the heads."""
  groups = 2
  te = {"params": {"self_attention": {
      "query": {"scale": _normal(3, H), "ln_bias": _normal(4, H), "kernel": _normal(5, (H, HEADS * D))},
      "key": {"kernel": _normal(6, (H, groups * D))}, "value": {"kernel": _normal(7, (H, groups * D))},
      "out": {"kernel": _normal(8, (HEADS * D, H))}},
      "mlp": {"scale": _normal(9, H), "ln_bias": _normal(10, H), "wi_kernel": _normal(11, (H, 1, F)),
              "wo_kernel": _normal(12, (F, H))}}}
  ours = from_transformer_engine(te, head_dim=D)
  x = jnp.ones((2, 6, H))
  want = jax.eval_shape(lambda: _layer(fuse_qkv_params=False, num_gqa_groups=groups).init(
      jax.random.key(0), x, deterministic=True))
  assert _shapes(ours["params"]) == _shapes(want["params"])
  te_key, our_key = te["params"]["self_attention"]["key"]["kernel"], ours["params"]["self_attention"]["key"]["kernel"]
  for g, d in ((0, 0), (1, 7), (1, 3)):
    np.testing.assert_array_equal(our_key[:, g, d], te_key[:, g * D + d])
  jax.tree.map(np.testing.assert_array_equal, to_transformer_engine(ours, head_dim=D), te)


# ---- intermediate_dropout_dims -------------------------------------------------------------------------------------


def _ln(x, scale, bias, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _gelu(x):  # the tanh approximation (jax.nn.gelu's default, te_jax's "gelu")
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _np(tree):
  return jax.tree.map(lambda v: np.asarray(v, np.float64), tree)


def _shared_mask(y, a, scale, dims):
  """The dropout mask of ``y = (a * mask * scale) @ I`` (``scale``: 1 / (1 - rate)), checked to be one value along
  ``dims``, 0 or 1, both present and not the same everywhere; the full mask. Entries of ``a`` too small to tell
  the two apart within float32 noise only need to agree with their group's value."""
  m = np.asarray(y, np.float64) / (scale * a)
  clear = np.abs(a) > 1e-2
  group = np.nanmedian(np.where(clear, m, np.nan), axis=dims, keepdims=True)
  assert np.all(np.isfinite(group)), group
  full = np.broadcast_to(np.round(group), m.shape)
  assert np.all((np.abs(group) < 1e-4) | (np.abs(group - 1) < 1e-4)), group
  np.testing.assert_allclose(np.asarray(y, np.float64), a * full * scale, atol=1e-5)
  assert set(np.unique(full)) == {0.0, 1.0}
  return full


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_layernorm_mlp_intermediate_dropout_dims_share_the_mask(framework):
  x = _normal(20, (4, 6, H))
  dims = (1,)
  kw = dict(activation_type=("gelu",), intermediate_dropout=0.5, intermediate_dropout_dims=dims, use_bias=False,
            dtype=jnp.float32)
  if framework == "linen":
    mlp = te_flax.LayerNormMLP(F, **kw)
    params = mlp.init(jax.random.key(0), x, deterministic=True)["params"]
    run = lambda p: mlp.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(7)})  # noqa
  else:
    def run(p):
      model = te_nnx.LayerNormMLP(H, F, **kw, rngs=nnx.Rngs(0, dropout=7))
      te_nnx.from_linen(model, {"params": p})
      return model(x, deterministic=False)
    params = nnx.to_pure_dict(nnx.state(te_nnx.LayerNormMLP(H, F, **kw, rngs=nnx.Rngs(0)), nnx.Param))
  p = _np(params)
  a = _gelu(_ln(np.asarray(x, np.float64), p["ln_scale"], p["ln_bias"]) @ p["wi_kernel"][:, 0, :])
  mask = _shared_mask(run({**params, "wo_kernel": jnp.eye(F, H)}), a, 2.0, dims)
  # The same key, the layer's own fc2: the reference with that mask.
  np.testing.assert_allclose(run(params), (a * mask * 2.0) @ p["wo_kernel"], rtol=1e-5, atol=1e-5)


def _attention_ref(p, x):
  """Pre-LN self attention of te_jax's fused layout (qkv (H, heads, 3, D)), no mask, logits scaled 1/sqrt(D)."""
  z = _ln(x, p["qkv"]["ln_scale"], p["qkv"]["ln_bias"])
  q, k, v = (np.einsum("bsh,hnd->bsnd", z, p["qkv"]["kernel"][:, :, i]) for i in range(3))
  logits = np.einsum("bsnd,btnd->bnst", q, k) / np.sqrt(D)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum("bnst,btnd,ndh->bsh", w, v, p["out"]["kernel"])


def test_transformer_layer_intermediate_dropout_dims_share_the_mask():
  x = _normal(21, (3, 5, H))
  dims = (0, -1)  # one draw per position, shared by the examples and the features
  layer = _layer(intermediate_dropout=0.5, intermediate_dropout_dims=dims)
  params = layer.init(jax.random.key(0), x, deterministic=True)["params"]
  run = lambda p: layer.apply({"params": p}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})  # noqa
  p = _np(params)
  xs = np.asarray(x, np.float64)
  y1 = xs + _attention_ref(p["self_attention"], xs)
  m = p["mlp"]
  a = _gelu(_ln(y1, m["ln_scale"], m["ln_bias"]) @ m["wi_kernel"][:, 0, :])
  identity = {**params, "mlp": {**params["mlp"], "wo_kernel": jnp.eye(F, H)}}
  mask = _shared_mask(np.asarray(run(identity), np.float64) - y1, a, 2.0, (0, 2))
  np.testing.assert_allclose(run(params), y1 + (a * mask * 2.0) @ m["wo_kernel"], rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match=r"intermediate_dropout_dims must be a sequence of dims of the 3-D tensor"):
    _layer(intermediate_dropout_dims=(3,)).init(jax.random.key(0), x, deterministic=True)
  with pytest.raises(ValueError, match=r"intermediate_dropout_dims must be a sequence of dims of the 2-D tensor"):
    te_flax.LayerNormMLP(F, intermediate_dropout_dims=(2,)).init(jax.random.key(0), x[0])
  with pytest.raises(TypeError, match=r"LayerNormMLP takes intermediate_dropout_dims where Transformer Engine's "
                                      r"takes intermediate_hidden_dropout_dims"):
    te_flax.LayerNormMLP(F, intermediate_hidden_dropout_dims=(1,))


# ---- checkpoint names ----------------------------------------------------------------------------------------------


def _saved(capsys, loss, *args):
  """The residuals ``jax.checkpoint``'s ``loss`` saves for its backward pass (not its arguments): one line each,
  ``dtype[shape] named 'name' ...``."""
  jax.ad_checkpoint.print_saved_residuals(loss, *args)
  return [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]


def _remat_check(capsys, apply, variables, x, names, compare: bool = False):
  """``apply``'s squared-sum loss under ``jax.checkpoint`` saving only ``names``: the saved residuals; with
  ``compare``, its gradients checked bit for bit against the plain loss's."""
  loss = lambda v, x: jnp.sum(apply(v, x) ** 2)  # noqa: E731
  remat = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(*names))
  saved = _saved(capsys, remat, variables, x)
  if compare:
    plain, kept = (jax.jit(jax.grad(f))(variables, x) for f in (loss, remat))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(kept), jax.tree.leaves(plain), strict=True):
      np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  return saved


class _TwoDense(nn.Module):
  """Two FP8 dense layers whose saved tensors are named apart."""

  def setup(self):
    self.first = te_flax.DenseGeneral(32, quantization_checkpoint_name="first_fp8")
    self.second = te_flax.DenseGeneral(32, quantization_checkpoint_name="second_fp8")

  def __call__(self, x):
    return self.second(jax.nn.relu(self.first(x)))


def test_quantization_checkpoint_name_replaces_a_layer_s_fp8_residual_name(capsys):
  x = _normal(30, (16, 32))
  model = _TwoDense()
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = model.init(jax.random.key(0), x)
    first = _remat_check(capsys, model.apply, variables, x, ["first_fp8"], compare=True)
    both = _remat_check(capsys, model.apply, variables, x, ["first_fp8", "second_fp8"])
    default = _remat_check(capsys, model.apply, variables, x, [te_jax.FP8_RESIDUAL])
  # The first layer's transposed FP8 input and FP8 kernel, named as it says; the second's are recomputed.
  assert len(first) == 2 and all(s.startswith("f8_e4m3fn[") and "'first_fp8'" in s for s in first), first
  assert len(both) == 4 and sum("'second_fp8'" in s for s in both) == 2, both
  assert default == [], default  # renamed, not named twice


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_layernorm_mlp_checkpoint_names(capsys, framework):
  x = _normal(31, (16, H))
  names = dict(quantization_checkpoint_name="mlp_fp8", ffn1_ckpt_name="fc1_out", ffn2_ckpt_name="fc2_out")
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    if framework == "linen":
      mlp = te_flax.LayerNormMLP(F, dtype=jnp.float32, **names)
      variables = mlp.init(jax.random.key(0), x)
      apply = mlp.apply
    else:
      graphdef, variables = nnx.split(te_nnx.LayerNormMLP(H, F, dtype=jnp.float32, **names, rngs=nnx.Rngs(0)))
      apply = lambda state, x: nnx.merge(graphdef, state)(x)  # noqa: E731
    fp8 = _remat_check(capsys, apply, variables, x, ["mlp_fp8"], compare=True)
    fc1 = _remat_check(capsys, apply, variables, x, ["fc1_out"])
    fc2 = _remat_check(capsys, apply, variables, x, ["fc2_out"])
    default = _remat_check(capsys, apply, variables, x, ["ffn1", "ffn2", te_jax.FP8_RESIDUAL])
  # Both GEMMs' transposed FP8 inputs and FP8 kernels; fc1's output (the activation's input, which its backward
  # reads); fc2's output (the squared loss's backward reads it).
  assert len(fp8) == 4 and all(s.startswith("f8_e4m3fn[") and "'mlp_fp8'" in s for s in fp8), fp8
  assert len(fc1) == 1 and fc1[0].startswith(f"f32[16,{F}]") and "'fc1_out'" in fc1[0], fc1
  assert len(fc2) == 1 and fc2[0].startswith(f"f32[16,{H}]") and "'fc2_out'" in fc2[0], fc2
  assert default == [], default


def test_transformer_layer_mlp_names_are_transformer_engine_s(capsys):
  x = _normal(32, (2, 8, H))
  layer = _layer()
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    variables = layer.init(jax.random.key(0), x, deterministic=True)
    apply = lambda v, x: layer.apply(v, x, deterministic=True)  # noqa: E731
    ffn1 = _remat_check(capsys, apply, variables, x, ["ffn1"], compare=True)
    fp8 = _remat_check(capsys, apply, variables, x, [te_jax.FP8_RESIDUAL])
  assert len(ffn1) == 1 and ffn1[0].startswith(f"f32[16,{F}]") and "'ffn1'" in ffn1[0], ffn1
  # Every GEMM's two FP8 tensors: qkv, out, fc1, fc2.
  assert len(fp8) == 8 and all(s.startswith("f8_e4m3fn[") for s in fp8), fp8


def test_bad_checkpoint_names_are_named():
  x = jnp.ones((4, H))
  with pytest.raises(TypeError, match=r"quantization_checkpoint_name must be a non-empty str .* got 3"):
    te_flax.DenseGeneral(32, quantization_checkpoint_name=3).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"ffn1_ckpt_name must be a non-empty str .* got ''"):
    te_nnx.LayerNormMLP(H, F, ffn1_ckpt_name="", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"quantization_checkpoint_name must be a non-empty str"):
    te_flax.LayerNormDenseGeneral(32, quantization_checkpoint_name=b"x").init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"quantization_checkpoint_name must be a non-empty str"):
    te_jax.dense(x, jnp.ones((H, 16)), quantization_checkpoint_name=["a"])
