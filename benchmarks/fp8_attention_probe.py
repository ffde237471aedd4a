"""cuDNN's FP8 flash attention, forward and backward, against its bf16 flash attention at the GPT layer's shape.

What it answers: how much an FP8 attention (forward and backward, scales known before the call, as delayed scaling
gives them) could save in the GPT layer, and at what error. It calls JAX's cuDNN FP8 custom calls
(``__cudnn$fmhaSoftmaxF8`` and ``__cudnn$fmhaSoftmaxBackwardF8``, through JAX's private primitives) directly, with
every scale set from the exact amax of the tensor it scales (computed once from a float32 reference, the best a
delayed-scaling state can give), and times three things in one process, steady state (calls back to back):

- bf16: ``jax.nn.dot_product_attention(implementation="cudnn")``, forward and backward;
- FP8 kernels: the two FP8 calls on E4M3 inputs, outputs left in FP8;
- FP8 with casts: the same, plus the bf16 -> E4M3 casts of q, k, v and dO and the E4M3 -> bf16 casts of O, dQ, dK
  and dV (what a layer without fused casts pays).

Errors: RMS of (result - float32 reference) over RMS of the reference, the reference computed on the same
(dequantized) inputs, for O, dQ, dK and dV; bf16's error against the same reference is printed beside.

Measured on the H200 (2026-12-04, jax 0.11.2, cuDNN 9.19, CUDA 13; benchmarks/NOTES.md): the FP8 kernels take
1.40 ms against bf16's 1.27-1.29 (0.91x), 1.74 ms with the casts (0.73x); O is within 3.4% (RMS) of the reference,
but dQ, dK and dV are 53-71% off (bf16: 0.3-0.4%), dV included, which no choice of the dP scale touches. JAX's own
test of these calls is skipped on CUDA 13 and checks the gradients to an absolute 3.0. So at this shape an FP8
backward would be slower even if its numbers held, which is why ``te_jax.dot_product_attention(fp8=True)`` runs its
backward in the input precision.

  python benchmarks/fp8_attention_probe.py
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fa

import harness

B, S, H, D = 4, 2048, 32, 128
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
SCALE = 1.0 / math.sqrt(D)
LAYOUT = fa.AttentionLayout.BTNH.value


def _reference(q, k, v, do):
  """float32 attention (causal) on BTNH arrays: O, dQ, dK, dV and the amax of the scores' gradient.

  cuDNN's FP8 names: S is the softmax output (scaled by ``scale_s``), dP the gradient of the softmax input (the
  operand of the dQ and dK GEMMs, scaled by ``scale_dP``), here the gradient of the scaled scores."""
  mask = jnp.tril(jnp.ones((S, S), bool))

  def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * SCALE

  def from_scores(s, v):
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")

  o, vjp = jax.vjp(lambda q, k, v: from_scores(scores(q, k), v), q, k, v)
  dq, dk, dv = vjp(do)
  _, scores_vjp = jax.vjp(lambda s: from_scores(s, v), scores(q, k))
  (ds,) = scores_vjp(do)
  return o, dq, dk, dv, jnp.max(jnp.abs(ds))


def _unit(x):
  """A scalar as the (1, 1, 1, 1) float32 factor cuDNN takes."""
  return jnp.reshape(x, (1, 1, 1, 1)).astype(jnp.float32)


def _cast(x, scale):
  """The saturating E4M3 cast of x * scale."""
  return jnp.clip(x.astype(jnp.float32) * jnp.reshape(scale, ()), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _q(x, amax):
  """x in E4M3 scaled by 448 / amax, and that scale and its inverse as cuDNN takes them."""
  scale = E4M3_MAX / amax
  return _cast(x, scale), _unit(scale), _unit(1.0 / scale)


def _fp8_calls(q8, k8, v8, do8, s):
  """The FP8 forward (training) and backward calls; returns O, dQ, dK, dV (E4M3) and the amaxes."""
  out8, amax_s, amax_o, stats = fa._dot_product_attention_fp8_fwd_p_wrapper.bind(  # noqa: SLF001
      q8, k8, v8, s["descale_q"], s["descale_k"], s["descale_v"], s["descale_s"], s["scale_s"], s["scale_o"],
      scale=SCALE, use_causal_mask=True, layout=LAYOUT, is_training=True)
  dq8, dk8, dv8, amax_dq, amax_dk, amax_dv, amax_dp = fa._dot_product_attention_fp8_bwd_p_wrapper.bind(  # noqa: SLF001
      q8, k8, v8, out8, do8, stats, s["descale_q"], s["descale_k"], s["descale_v"], s["descale_o"], s["descale_dO"],
      s["descale_s"], s["descale_dP"], s["scale_s"], s["scale_dQ"], s["scale_dK"], s["scale_dV"], s["scale_dP"],
      scale=SCALE, use_causal_mask=True, layout=LAYOUT)
  return (out8, dq8, dk8, dv8), (amax_s, amax_o, amax_dq, amax_dk, amax_dv, amax_dp)


def _rel(x, ref):
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((x - ref) ** 2) / jnp.mean(ref ** 2)))


def main() -> int:
  if jax.default_backend() != "gpu":
    print("fp8_attention_probe: needs a GPU (cuDNN)", file=sys.stderr)
    return 1
  fa.check_cudnn_version()
  keys = jax.random.split(jax.random.key(7), 4)
  q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.float32) for x in keys)

  amax = {n: jnp.max(jnp.abs(x)) for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
  q8, sq, dsq = _q(q, amax["q"])
  k8, sk, dsk = _q(k, amax["k"])
  v8, sv, dsv = _q(v, amax["v"])
  do8, sdo, dsdo = _q(do, amax["do"])
  deq = [x8.astype(jnp.float32) * ds.reshape(()) for x8, ds in ((q8, dsq), (k8, dsk), (v8, dsv), (do8, dsdo))]
  o_ref, dq_ref, dk_ref, dv_ref, amax_dp = _reference(*deq)  # amax_dp: of the scores' gradient

  s = {"descale_q": dsq, "descale_k": dsk, "descale_v": dsv, "descale_dO": dsdo,
       "scale_s": _unit(E4M3_MAX), "descale_s": _unit(1 / E4M3_MAX)}
  for name, ref in (("o", o_ref), ("dQ", dq_ref), ("dK", dk_ref), ("dV", dv_ref)):
    a = jnp.max(jnp.abs(ref))
    s[f"scale_{name}"] = _unit(E4M3_MAX / a)
    s[f"descale_{name}"] = _unit(a / E4M3_MAX)
  s["scale_dP"], s["descale_dP"] = _unit(E4M3_MAX / amax_dp), _unit(amax_dp / E4M3_MAX)

  kernels = jax.jit(lambda q8, k8, v8, do8: _fp8_calls(q8, k8, v8, do8, s))

  def with_casts(q, k, v, do):
    q8, k8, v8, do8 = (_cast(x, sc) for x, sc in ((q, sq), (k, sk), (v, sv), (do, sdo)))
    outs, amaxes = _fp8_calls(q8, k8, v8, do8, s)
    descales = (s["descale_o"], s["descale_dQ"], s["descale_dK"], s["descale_dV"])
    return [(x.astype(jnp.float32) * d.reshape(())).astype(jnp.bfloat16) for x, d in zip(outs, descales)], amaxes

  with_casts = jax.jit(with_casts)

  def bf16(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
                       q, k, v)
    return (out, *vjp(do))

  bf16 = jax.jit(bf16)
  qb, kb, vb, dob = (x.astype(jnp.bfloat16) for x in deq)

  outs8, amaxes = kernels(q8, k8, v8, do8)
  fp8 = [x.astype(jnp.float32) * s[f"descale_{n}"].reshape(()) for x, n in zip(outs8, ("o", "dQ", "dK", "dV"))]
  outs16 = bf16(qb, kb, vb, dob)
  refs = (o_ref, dq_ref, dk_ref, dv_ref)
  print("amax s, o, dQ, dK, dV, dP (cuDNN):", [f"{float(a.reshape(())):.4g}" for a in amaxes])
  print("amax o, dQ, dK, dV, dP (reference):", [f"{float(jnp.max(jnp.abs(r))):.4g}" for r in refs],
        f"{float(amax_dp):.4g}")
  for name, x8, x16, ref in zip(("O", "dQ", "dK", "dV"), fp8, outs16, refs):
    print(f"{name}: relative RMS error FP8 {_rel(x8, ref):.4f}, bf16 {_rel(x16, ref):.5f}")

  t_bf16 = harness.time_calls(bf16, qb, kb, vb, dob, runs=20, batch=10)
  t_kernels = harness.time_calls(kernels, q8, k8, v8, do8, runs=20, batch=10)
  t_casts = harness.time_calls(with_casts, qb, kb, vb, dob, runs=20, batch=10)
  t_bf16_again = harness.time_calls(bf16, qb, kb, vb, dob, runs=20, batch=10)
  print(f"| attention B={B} S={S} H={H} D={D} causal, fwd+bwd | ms | vs bf16 |")
  print("|---|---|---|")
  for name, t in (("cuDNN bf16", t_bf16), ("cuDNN FP8 kernels", t_kernels), ("cuDNN FP8 + casts", t_casts),
                  ("cuDNN bf16 (again)", t_bf16_again)):
    print(f"| {name} | {t.ms:.3f} | {t_bf16.ms / t.ms:.2f}x |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
