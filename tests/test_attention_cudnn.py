"""te_jax.dot_product_attention's fused (cuDNN) backend.

- Its glue (layouts, zero rows, left padding, key padding masks, FP8) on any machine, with cuDNN's call emulated.
- On a GPU (``@pytest.mark.gpu``): the fused (cuDNN) backend against the unfused one for every configuration cuDNN
  takes, in bfloat16: each is compared with the float32 reference, and the fused error must stay within twice the
  unfused bfloat16 error plus a small floor (the flash-attention tolerance rule); the HLO holds ``__cudnn$fmha``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import B, H, assert_auto_backend, padding_mask, qkv, randn, segments

import te_jax
import te_jax.flax as te_flax
from te_jax.fused import attention, attention_cudnn
from te_jax.fused.attention import fp8_attention_support

# ---- GPU: cuDNN against the unfused backend ------------------------------------------------------------------------

GPU_T, GPU_S, GPU_D = 256, 256, 64


def _gpu_case(mask_type, bias_type, window, kv_heads, t=GPU_T, s=GPU_S, layout="BSHD", segment=False):
  q, k, v = qkv(t, s, kv_heads=kv_heads, dtype=jnp.bfloat16, d=GPU_D)
  mask = segment_ids = bias = None
  if segment:
    segment_ids = segments([[t // 2, t // 4, t // 8], [t - 3]], t)
  elif mask_type.startswith("padding"):
    mask = padding_mask(t, s, q_lens=(t - 40, t), kv_lens=(s - 17, s - 1))
  elif mask_type == "arbitrary":
    mask = jnp.asarray(np.random.default_rng(3).random((1, 1, t, s)) < 0.5)
  if bias_type == "post_scale_bias":
    bias = randn(11, (1, H, t, s), jnp.bfloat16)
  elif bias_type == "per_example_bias":  # a (B, 1, T, S) bias: one per example, shared by the heads
    bias, bias_type = randn(12, (B, 1, t, s), jnp.bfloat16), "post_scale_bias"
  return dict(q=q, k=k, v=v, bias=bias, mask=mask, segment_ids=segment_ids, attn_mask_type=mask_type,
              attn_bias_type=bias_type, window_size=window, layout=layout)


def _run_backend(case, backend, dtype=None):
  def f(q, k, v, bias):
    cast = (lambda x: x) if dtype is None else (lambda x: None if x is None else x.astype(dtype))
    return te_jax.dot_product_attention(cast(q), cast(k), cast(v), cast(bias), case["mask"],
                                        segment_ids=case["segment_ids"], attn_mask_type=case["attn_mask_type"],
                                        attn_bias_type=case["attn_bias_type"], window_size=case["window_size"],
                                        backend=backend).astype(jnp.float32)

  args = (case["q"], case["k"], case["v"], case["bias"])
  cot = randn(42, case["q"].shape[:3] + (case["v"].shape[-1],))
  argnums = (0, 1, 2, 3) if case["bias"] is not None else (0, 1, 2)

  def loss(*a):
    out = f(*a)
    return jnp.sum(out * cot), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
  hlo = fn.lower(*args).compile().as_text()
  (_, out), grads = fn(*args)
  return out, [g.astype(jnp.float32) for g in grads], hlo


GPU_CASES = [
    ("no_mask", None, None, 4), ("causal", None, None, 4), ("causal", None, None, 2), ("causal", None, None, 1),
    ("padding", None, None, 4), ("padding_causal", None, None, 2), ("arbitrary", None, None, 4),
    ("causal", None, (32, 0), 4), ("no_mask", None, (16, 16), 4), ("causal_bottom_right", None, None, 4),
    ("no_mask", "post_scale_bias", None, 4), ("causal", "post_scale_bias", None, 2),
    ("padding", "post_scale_bias", None, 4), ("causal", "alibi", None, 4), ("no_mask", "alibi", None, 2),
    ("no_mask", "per_example_bias", None, 2), ("padding_causal", "per_example_bias", None, 4),
]


def _assert_close_to_reference(fused, unfused, ref, what):
  """err(fused) <= 2 err(unfused in bf16) + floor, both against the float32 unfused result."""
  scale = float(jnp.max(jnp.abs(ref))) or 1.0
  err_fused = float(jnp.max(jnp.abs(fused - ref)))
  err_unfused = float(jnp.max(jnp.abs(unfused - ref)))
  assert err_fused <= 2 * err_unfused + 2e-3 * scale, (what, err_fused, err_unfused, scale)


def _check_fused(case, emulated=False):
  assert te_jax.attention_backend(case["q"], case["k"], case["v"], case["bias"], case["mask"],
                                  segment_ids=case["segment_ids"], attn_mask_type=case["attn_mask_type"],
                                  attn_bias_type=case["attn_bias_type"],
                                  window_size=case["window_size"]).name == "fused"
  fused, g_fused, hlo = _run_backend(case, "fused")
  assert ("__cudnn$fmha" in hlo) != emulated
  unfused, g_unfused, hlo_unfused = _run_backend(case, "unfused")
  assert "__cudnn$fmha" not in hlo_unfused
  ref, g_ref, _ = _run_backend(case, "unfused", jnp.float32)
  assert np.all(np.isfinite(fused))
  _assert_close_to_reference(fused, unfused, ref, "output")
  for name, a, b, r in zip(("dq", "dk", "dv", "dbias"), g_fused, g_unfused, g_ref):
    assert np.all(np.isfinite(a)), name
    _assert_close_to_reference(a, b, r, name)


# ---- the fused backend's glue on any machine, with cuDNN's call emulated ---------------------------------------------


@pytest.fixture
def emulated_cudnn(monkeypatch):
  """Replaces JAX's cuDNN attention calls by XLA code with the semantics measured on an H200 (cuDNN 9.19): the causal
  mask is top-left (j <= i) for any T, S; a sliding window of length w keeps i - w < j <= i; the bias is added after
  the scaling, and its gradient flows only when has_dbias; FP8 takes the descale factors of q, k, v and writes
  O * scale_o in E4M3. Everything te_jax does around the call (bias and mask folding, zeroed rows, layouts, the FP8
  scaling) then runs on the CPU against the unfused backend."""
  from jax._src.cudnn import fused_attention_stablehlo as real  # noqa: PLC0415

  def attend(q, k, v, bias, scale, causal, window):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return jax.nn.dot_product_attention(*f32, bias=bias, scale=scale, is_causal=causal,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="xla")

  def dot_product_attention(q, k, v, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v, scale, seed,
                            dropout_rate, variadic_args, mask_type, layout, window, cudnn_version, return_residual):
    assert layout == real.AttentionLayout.BTNH.value and dropout_rate == 0.0 and not return_residual
    assert all(x.size == 0 for x in (q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v))
    has_bias, has_dbias = variadic_args
    assert q.dtype == k.dtype == v.dtype and (not has_bias or bias.dtype == q.dtype)
    b = (bias if has_dbias else jax.lax.stop_gradient(bias)).astype(jnp.float32) if has_bias else None
    return attend(q, k, v, b, scale, mask_type == real.MaskType.CAUSAL, window).astype(q.dtype)

  def fp8_fwd(q8, k8, v8, params, scale, causal, layout, cudnn_version):
    descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = params
    assert q8.dtype == k8.dtype == v8.dtype == jnp.float8_e4m3fn
    assert abs(float(scale_s.reshape(())) * float(descale_s.reshape(())) - 1.0) < 1e-6
    out = attend(q8.astype(jnp.float32) * descale_q, k8.astype(jnp.float32) * descale_k,
                 v8.astype(jnp.float32) * descale_v, None, scale, causal, None)
    return (out * scale_o).astype(jnp.float8_e4m3fn), jnp.zeros((1, 1, 1, 1)), jnp.zeros((1, 1, 1, 1))

  fake = type("EmulatedCudnn", (), dict(
      AttentionLayout=real.AttentionLayout, MaskType=real.MaskType, check_layout=staticmethod(real.check_layout),
      get_large_negative_number=staticmethod(real.get_large_negative_number),
      _dot_product_attention=staticmethod(dot_product_attention),
      _dot_product_attention_fp8_fwd=staticmethod(fp8_fwd)))
  monkeypatch.setattr(attention_cudnn, "cudnn_attention", lambda: (fake, 91900))
  monkeypatch.setattr(attention_cudnn, "_gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(attention.native, "REFERENCE_FORCED", False)  # noqa: SLF001


# The GPU cases' glue, three compiled value-and-gradient programs each (~3 s on a 2-core CPU), runs with the slow
# tests; the cases of the emulation alone, and one GPU case of each mask kind, in every run.
_EMULATED_FAST = {("causal", None, None, 2), ("padding_causal", None, None, 2), ("causal", None, (32, 0), 4),
                  ("padding", "post_scale_bias", None, 4)}
EMULATED_CASES = [c if c in _EMULATED_FAST else pytest.param(c, marks=pytest.mark.slow) for c in GPU_CASES] + [
    ("padding", None, None, 2, "segments"), ("padding_causal", None, None, 4, "segments"),
    ("causal", None, (7, 0), 4, "T<S"), ("causal_bottom_right", None, None, 4, "T<S"),
    ("causal", "alibi", None, 2, "T>S")]


@pytest.mark.parametrize("case", EMULATED_CASES,
                         ids=["-".join(map(str, getattr(c, "values", [c])[0])) for c in EMULATED_CASES])
@pytest.mark.fast_cases(3)
def test_fused_glue_with_emulated_cudnn(emulated_cudnn, case):
  mask_type, bias_type, window, kv_heads, *extra = case
  t, s = {"T<S": (16, 32), "T>S": (32, 16)}.get(extra[0] if extra else None, (32, 32))
  _check_fused(_gpu_case(mask_type, bias_type, window, kv_heads, t=t, s=s, segment=extra == ["segments"]),
               emulated=True)


def test_fused_glue_sbhd_and_zero_rows_with_emulated_cudnn(emulated_cudnn):
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  got = te_jax.dot_product_attention(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), attn_mask_type="causal",
                                     qkv_layout="SBHD", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused")
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got, 0, 1), np.float32), np.asarray(want, np.float32))
  mask = np.ones((B, 1, 32, 32), bool)
  mask[0, 0, 5, :] = False  # query 5 of example 0 sees nothing
  out = te_jax.dot_product_attention(q, k, v, None, jnp.asarray(mask), attn_mask_type="arbitrary", backend="fused")
  assert np.all(np.asarray(out[0, 5], np.float32) == 0) and np.any(np.asarray(out[0, 4], np.float32) != 0)


def test_fused_glue_left_padding_with_emulated_cudnn(emulated_cudnn):
  """Left padding with a causal mask: the first rows see only padded keys under cuDNN's causal mask, although the
  padding mask alone leaves later keys open; they must still come out 0."""
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  pad = np.arange(32)[None, :] < np.asarray([6, 0])[:, None]  # example 0: the first 6 tokens are padding
  mask = jnp.asarray((~pad[:, None, :] & np.ones((B, 32, 1), bool))[:, None])  # keys only: queries stay unmasked
  out = te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type="padding_causal", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type="padding_causal", backend="unfused")
  assert np.all(np.asarray(out[0, :6], np.float32) == 0) and np.all(np.asarray(want[0, :6], np.float32) == 0)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def _check_key_padding_mask(backend, mask_type):
  """A (B, 1, 1, S) mask of padded keys is the (B, 1, T, S) mask with that row for every query: the same outputs and
  gradients."""
  q, k, v = qkv(16, 24, dtype=jnp.bfloat16, d=64)
  pad = np.arange(24)[None, :] >= np.asarray([20, 24])[:, None]  # example 0: its last 4 keys are padding
  keys_only = jnp.asarray(~pad[:, None, None, :])
  full = jnp.broadcast_to(keys_only, (B, 1, 16, 24))
  mask_type = mask_type + ("_bottom_right" if mask_type == "padding_causal" else "")

  def run(mask):
    f = lambda q, k, v: te_jax.dot_product_attention(q, k, v, None, mask, attn_mask_type=mask_type,  # noqa: E731
                                                     backend=backend)
    out, vjp = jax.vjp(f, q, k, v)
    return [np.asarray(a, np.float32) for a in (out, *vjp(jnp.ones_like(out)))]

  for a, b in zip(run(keys_only), run(full)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["unfused", "fused"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_key_padding_mask_broadcasts_over_queries(emulated_cudnn, backend, mask_type):
  _check_key_padding_mask(backend, mask_type)  # the fused backend through the emulated cuDNN call


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_fused_key_padding_mask(mask_type):
  _check_key_padding_mask("fused", mask_type)


@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_fp8_glue_with_emulated_cudnn(emulated_cudnn, mask_type):
  """With the FP8 call emulated exactly (dequantized inputs, E4M3 output), the error is that of quantizing q, k, v
  and O to E4M3 with te_jax's scales: a few 2^-4 relative roundings; the gradient is the bf16 one."""
  q, k, v = qkv(32, 32, dtype=jnp.bfloat16, d=64)
  assert te_jax.attention_backend(q, k, v, attn_mask_type=mask_type, fp8_dpa=True).name == "fused"
  out = np.asarray(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True), np.float32)
  ref = np.asarray(te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                attn_mask_type=mask_type, backend="unfused"))
  scale = np.max(np.abs(ref))
  assert np.max(np.abs(out - ref)) <= 0.25 * scale and np.mean(np.abs(out - ref)) <= 0.02 * scale
  grad = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True)
                                    .astype(jnp.float32)))(q)
  want = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, backend="fused")
                                    .astype(jnp.float32)))(q)
  np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(want, np.float32))
  with pytest.raises(ValueError, match="fp8_dpa=True cannot run"):
    te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=(4, 0), fp8_dpa=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type,bias_type,window,kv_heads", GPU_CASES,
                         ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_fused_matches_unfused(mask_type, bias_type, window, kv_heads):
  _check_fused(_gpu_case(mask_type, bias_type, window, kv_heads))


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
def test_fused_segment_ids(mask_type):
  _check_fused(_gpu_case(mask_type, None, None, 2, segment=True))


@pytest.mark.gpu
@pytest.mark.parametrize("t,s,mask_type", [(128, 256, "causal"), (256, 128, "causal"), (128, 256,
                                                                                    "causal_bottom_right")])
def test_fused_cross_lengths(t, s, mask_type):
  _check_fused(_gpu_case(mask_type, None, None, 4, t=t, s=s))


@pytest.mark.gpu
def test_fused_fully_masked_rows_are_zero():
  q, k, v = qkv(64, 64, dtype=jnp.bfloat16, d=64)
  mask = np.ones((B, 1, 64, 64), bool)
  mask[0, 0, 5, :] = False  # query 5 of example 0 sees nothing
  out = te_jax.dot_product_attention(q, k, v, None, jnp.asarray(mask), attn_mask_type="arbitrary", backend="fused")
  assert np.all(np.asarray(out[0, 5], np.float32) == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


@pytest.mark.gpu
def test_fused_sbhd_layout():
  q, k, v = qkv(128, 128, dtype=jnp.bfloat16, d=64)
  got = te_jax.dot_product_attention(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), attn_mask_type="causal",
                                     qkv_layout="SBHD", backend="fused")
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused")
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(got, 0, 1), np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
def test_auto_picks_fused_and_unfused_with_reasons():
  q, k, v = qkv(128, 128, dtype=jnp.bfloat16, d=64)
  assert te_jax.attention_backend(q, k, v, attn_mask_type="causal").name == "fused"
  choice = te_jax.attention_backend(q, k, v, attn_mask_type="causal", dropout_rate=0.1)
  assert choice.name == "unfused" and "dropout" in choice.reason
  choice = te_jax.attention_backend(*qkv(16, 16), attn_mask_type="causal")
  assert choice.name == "unfused" and "float32" in choice.reason
  choice = te_jax.attention_backend(*qkv(128, 128, dtype=jnp.bfloat16, d=20))
  assert choice.name == "unfused" and "head dim 20" in choice.reason
  choice = te_jax.attention_backend(*qkv(127, 127, dtype=jnp.bfloat16, d=64), attn_bias_type="alibi")
  assert choice.name == "unfused" and "odd sequence length" in choice.reason


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_fp8_forward(mask_type):
  """FP8 (E4M3) forward against the float32 result, and the backward against the bf16 one.

  E4M3 keeps 3 mantissa bits: each of q, k, v, P and O is rounded to within 2^-4 of itself. Measured on an H200
  (cuDNN 9.19, this shape): max error 12% (no mask) and 8% (causal) of max|out|, mean error 0.6%; the bounds below
  are 25% and 2%. A wrong scale or descale factor is off by a factor, far outside them."""
  ok, reason = fp8_attention_support(128, 256, 256, training=False)
  assert ok, reason
  q, k, v = qkv(256, 256, dtype=jnp.bfloat16, d=128)
  f8 = jax.jit(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True))
  hlo = f8.lower(q, k, v).compile().as_text()
  assert "__cudnn$fmhaSoftmaxF8" in hlo
  ref = te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), attn_mask_type=mask_type,
                                     backend="unfused")
  out = np.asarray(f8(q, k, v), np.float32)
  err = np.abs(out - np.asarray(ref))
  scale = float(jnp.max(jnp.abs(ref)))
  assert err.max() <= 0.25 * scale and err.mean() <= 0.02 * scale, (err.max(), err.mean(), scale)
  g = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type, fp8_dpa=True)
                                 .astype(jnp.float32)))(q)
  g_bf16 = jax.grad(lambda q: jnp.sum(te_jax.dot_product_attention(q, k, v, attn_mask_type=mask_type)
                                      .astype(jnp.float32)))(q)
  g, g_bf16 = np.asarray(g, np.float32), np.asarray(g_bf16, np.float32)
  # The same cuDNN backward on the same inputs; its dQ accumulation order may vary between runs.
  assert np.max(np.abs(g - g_bf16)) <= 1e-2 * np.max(np.abs(g_bf16))


@pytest.mark.gpu
def test_fused_module_under_jit_and_vmap():
  q, k, v = qkv(128, 128, kv_heads=2, dtype=jnp.bfloat16, d=64)
  module = te_flax.DotProductAttention(head_dim=64, num_attention_heads=H, num_gqa_groups=2)
  assert module.backend_for(q, k, v).name == "fused"
  out = jax.jit(lambda q, k, v: module.apply({}, q, k, v, deterministic=True))(q, k, v)
  want = te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="unfused")
  _assert_close_to_reference(out.astype(jnp.float32), want.astype(jnp.float32),
                             te_jax.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                          attn_mask_type="causal"), "module")
  stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v)]
  got = jax.vmap(lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused"))(
      *stacked)
  for n in range(2):
    one = te_jax.dot_product_attention(*(x[n] for x in stacked), attn_mask_type="causal", backend="fused")
    np.testing.assert_array_equal(np.asarray(got[n], np.float32), np.asarray(one, np.float32))


def test_every_gpu_case_is_a_valid_configuration():
  """The GPU cases are valid arguments (checked here on any machine, so that a GPU run fails only on numerics)."""
  for mask_type, bias_type, window, kv_heads in GPU_CASES:
    case = _gpu_case(mask_type, bias_type, window, kv_heads, t=16, s=16)
    choice = te_jax.attention_backend(case["q"], case["k"], case["v"], case["bias"], case["mask"],
                                      segment_ids=case["segment_ids"], attn_mask_type=mask_type,
                                      attn_bias_type=case["attn_bias_type"], window_size=window)
    assert_auto_backend(choice)
