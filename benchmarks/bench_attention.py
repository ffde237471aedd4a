"""Causal self-attention fwd+bwd: te_jax.dot_product_attention (fused = cuDNN, unfused = jnp) vs
``jax.nn.dot_product_attention(implementation="cudnn")``, same shapes, same process.

Shape B=4, S=2048, H=32, D=128, bfloat16, causal. The timed function returns the output and the gradients with
respect to q, k and v (``jax.vjp`` applied to a random output gradient).

FLOPs: the two GEMMs of the forward pass (Q K^T and P V) are 2 * 2*B*H*S*S*D = 4*B*H*S*S*D multiply-adds counted as
2 FLOPs each; the backward pass has 5 GEMMs of the same size (the recomputed Q K^T, dV, dP, dQ, dK), 2.5 times the
forward's; a causal mask halves the useful work. Total: 4*B*H*S*S*D * (1 + 2.5) / 2 (what FlashAttention reports).

On a GPU a second case measures cuDNN's FP8 flash attention, forward and backward, against its bf16 one: why
``te_jax.dot_product_attention(fp8=True)`` (the recipe's ``fp8_dpa``) runs its backward in the input precision. It
calls JAX's cuDNN FP8 custom calls (``__cudnn$fmhaSoftmaxF8``, ``__cudnn$fmhaSoftmaxBackwardF8``, through JAX's
private primitives) with every scale set from the exact amax of the tensor it scales (computed once from a float32
reference: the best a delayed-scaling state can give), and times, in the same process and on the same (dequantized)
inputs: the bf16 call; the two FP8 calls on E4M3 inputs with FP8 outputs; the same with the bf16 -> E4M3 casts of q,
k, v, dO and the E4M3 -> bf16 casts of O, dQ, dK, dV (what a layer without fused casts pays). Each row's errors are
the RMS of (result - float32 reference) over the reference's RMS, for O, dQ, dK and dV. On 2026-12-04 the FP8 kernels
took 0.91x bf16's time (0.73x with the casts) and their dQ, dK, dV were 53-71% off (bf16: 0.3-0.4%).

  python benchmarks/bench_attention.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import harness
import te_jax
from te_jax._core import jax_compat

SHAPES = ((4, 2048, 32, 128),)  # (B, S, H, D)


def _fwd_bwd(attn):
  def f(q, k, v, dout):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(dout)

  return jax.jit(f)


def bench_shape(ctx: harness.Context, shape, key) -> list[dict]:
  b, s, h, d = shape
  s = max(s // ctx.shrink, 16)
  kq, kk, kv, kd = jax.random.split(key, 4)
  q, k, v, dout = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(jnp.bfloat16) for x in (kq, kk, kv, kd))
  impls = {
      "te_jax fused": lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal", backend="fused"),
      "te_jax unfused": lambda q, k, v: te_jax.dot_product_attention(q, k, v, attn_mask_type="causal",
                                                                     backend="unfused"),
      "jax.nn cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
  }
  if not ctx.gpu:  # no cuDNN: the smoke run times the unfused path only
    impls = {"te_jax unfused": impls["te_jax unfused"]}
  flops = 4.0 * b * h * s * s * d * (1 + 2.5) / 2
  rows, outputs, fns = [], {}, {}
  for name, attn in impls.items():
    fn = fns[name] = _fwd_bwd(attn)
    t = harness.time_calls(fn, q, k, v, dout, runs=ctx.runs, batch=ctx.batch)
    compiled = fn.lower(q, k, v, dout).compile()
    hlo = compiled.as_text()
    out, grads = fn(q, k, v, dout)
    outputs[name] = [np.asarray(x, np.float32) for x in (out, *grads)]
    problems = []
    cudnn = "__cudnn$fmha" in hlo
    if ctx.gpu and cudnn != (name != "te_jax unfused"):
      problems.append(f"cuDNN attention in HLO: {cudnn}")
    if not all(np.all(np.isfinite(x)) for x in outputs[name]):
      problems.append("non-finite output")
    rows.append({
        "bench": "attention",
        "case": f"causal B={b} S={s} H={h} D={d} bf16 fwd+bwd",
        "impl": name,
        "ms": t.ms,
        "timing": t.as_dict(),
        "tflops": flops / (t.ms * 1e-3) / 1e12,
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "handler": "cuDNN fmha" if cudnn else "xla",
        "ok": not problems,
        "note": "; ".join(problems),
    })
  # Agreement: every output and gradient within bf16 tolerance of the first implementation's (relative to its scale).
  base = next(iter(outputs.values()))
  for r in rows:
    for what, a, e in zip(("out", "dq", "dk", "dv"), outputs[r["impl"]], base, strict=True):
      err = float(np.max(np.abs(a - e))) / max(float(np.max(np.abs(e))), 1e-6)
      if err > 2**-5:
        r["ok"] = False
        r["note"] = "; ".join(filter(None, [r["note"], f"{what} differs by {err:.3g} of its scale"]))
  ref = {r["impl"]: r["ms"] for r in rows}.get("jax.nn cudnn")
  for r in rows:
    r["speedup_vs_jax_cudnn"] = ref / r["ms"] if ref else float("nan")
  if ctx.gpu:
    try:  # JAX's private FP8 calls may move between versions: that must not lose the rows above
      rows += fp8_rows(ctx, (b, s, h, d), jax.random.fold_in(key, 8), fns["jax.nn cudnn"], flops)
    except Exception as e:  # noqa: BLE001
      rows.append({"bench": "attention", "case": fp8_case(b, s, h, d),
                   "impl": "cuDNN fp8 kernels", "ms": float("nan"), "ok": False, "note": f"failed: {e!r}"[:300]})
  return rows


# ---- cuDNN's FP8 attention (see the module docstring) ------------------------------------------------------------

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


def _unit(x):
  """A scalar as the (1, 1, 1, 1) float32 factor cuDNN takes."""
  return jnp.reshape(x, (1, 1, 1, 1)).astype(jnp.float32)


def _cast(x, scale):
  """The saturating E4M3 cast of x * scale."""
  return jnp.clip(x.astype(jnp.float32) * jnp.reshape(scale, ()), -E4M3_MAX, E4M3_MAX).astype(E4M3)


@jax.jit
def _reference(q, k, v, do):
  """float32 causal attention on BTNH arrays: O, dQ, dK, dV and the amax of the gradient of the scaled scores.

  cuDNN's FP8 names: S is the softmax output (scaled by ``scale_s``), dP the gradient of the softmax input (the
  operand of the dQ and dK GEMMs, scaled by ``scale_dP``)."""
  n, scale = q.shape[1], 1.0 / np.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones((n, n), bool))

  def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale

  def from_scores(s, v):
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")

  o, vjp = jax.vjp(lambda q, k, v: from_scores(scores(q, k), v), q, k, v)
  dq, dk, dv = vjp(do)
  _, scores_vjp = jax.vjp(lambda s: from_scores(s, v), scores(q, k))
  (ds,) = scores_vjp(do)
  return o, dq, dk, dv, jnp.max(jnp.abs(ds))


def fp8_case(b: int, s: int, h: int, d: int) -> str:
  return f"causal B={b} S={s} H={h} D={d} fp8 e4m3 fwd+bwd, scales from exact amaxes"


def _rel(x, ref) -> float:
  x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.sqrt(jnp.mean((x - ref) ** 2) / jnp.mean(ref**2)))


def fp8_rows(ctx: harness.Context, shape, key, bf16_fn, flops: float) -> list[dict]:
  """The FP8 case: bf16 (``bf16_fn``, jax.nn's cuDNN call fwd+bwd), the FP8 kernels, and the FP8 kernels with casts."""
  b, s, h, d = shape
  case = fp8_case(b, s, h, d)
  fa, why = jax_compat.cudnn_attention()
  if fa is None:
    return [{"bench": "attention", "case": case, "impl": "cuDNN fp8 kernels", "ms": float("nan"), "ok": False,
             "note": str(why)}]
  scale_qk = 1.0 / float(np.sqrt(d))
  layout = fa.AttentionLayout.BTNH.value
  q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.float32) for x in jax.random.split(key, 4))
  sc = {}
  fp8_in = []
  for name, x in (("q", q), ("k", k), ("v", v), ("dO", do)):
    scale = E4M3_MAX / jnp.max(jnp.abs(x))
    sc[f"scale_{name}"], sc[f"descale_{name}"] = _unit(scale), _unit(1.0 / scale)
    fp8_in.append(_cast(x, scale))
  deq = [x8.astype(jnp.float32) * sc[f"descale_{n}"].reshape(()) for x8, n in zip(fp8_in, ("q", "k", "v", "dO"))]
  refs = _reference(*deq)
  amax_dp = refs[-1]
  sc["scale_s"], sc["descale_s"] = _unit(E4M3_MAX), _unit(1 / E4M3_MAX)
  for name, ref in zip(("o", "dQ", "dK", "dV"), refs[:4]):
    a = jnp.max(jnp.abs(ref))
    sc[f"scale_{name}"], sc[f"descale_{name}"] = _unit(E4M3_MAX / a), _unit(a / E4M3_MAX)
  sc["scale_dP"], sc["descale_dP"] = _unit(E4M3_MAX / amax_dp), _unit(amax_dp / E4M3_MAX)

  def calls(q8, k8, v8, do8):
    """The FP8 forward (training) and backward calls: O, dQ, dK, dV in E4M3."""
    out8, _, _, stats = fa._dot_product_attention_fp8_fwd_p_wrapper.bind(  # noqa: SLF001
        q8, k8, v8, sc["descale_q"], sc["descale_k"], sc["descale_v"], sc["descale_s"], sc["scale_s"], sc["scale_o"],
        scale=scale_qk, use_causal_mask=True, layout=layout, is_training=True)
    dq8, dk8, dv8, *_ = fa._dot_product_attention_fp8_bwd_p_wrapper.bind(  # noqa: SLF001
        q8, k8, v8, out8, do8, stats, sc["descale_q"], sc["descale_k"], sc["descale_v"], sc["descale_o"],
        sc["descale_dO"], sc["descale_s"], sc["descale_dP"], sc["scale_s"], sc["scale_dQ"], sc["scale_dK"],
        sc["scale_dV"], sc["scale_dP"], scale=scale_qk, use_causal_mask=True, layout=layout)
    return out8, dq8, dk8, dv8

  def with_casts(q, k, v, do):
    outs = calls(*(_cast(x, sc[f"scale_{n}"]) for x, n in zip((q, k, v, do), ("q", "k", "v", "dO"))))
    return [(x.astype(jnp.float32) * sc[f"descale_{n}"].reshape(())).astype(jnp.bfloat16)
            for x, n in zip(outs, ("o", "dQ", "dK", "dV"))]

  bf16_in = [x.astype(jnp.bfloat16) for x in deq]
  variants = (("jax.nn cudnn (bf16)", bf16_fn, bf16_in), ("cuDNN fp8 kernels", jax.jit(calls), fp8_in),
              ("cuDNN fp8 + casts", jax.jit(with_casts), bf16_in))
  rows = []
  for impl, fn, args in variants:
    outs = fn(*args)
    outs = [outs[0], *outs[1]] if impl.startswith("jax.nn") else list(outs)
    if impl == "cuDNN fp8 kernels":
      outs = [x.astype(jnp.float32) * sc[f"descale_{n}"].reshape(()) for x, n in zip(outs, ("o", "dQ", "dK", "dV"))]
    t = harness.time_calls(fn, *args, runs=ctx.runs, batch=ctx.batch, warmup=1)
    targets = harness.custom_call_targets(fn, *args)
    problems = [] if all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in outs) else ["non-finite output"]
    fp8_calls = [t for t in targets if t.startswith("__cudnn$fmha") and "F8" in t]
    if "fp8" in impl and {"Backward" in t for t in fp8_calls} != {True, False}:
      problems.append(f"not cuDNN's FP8 forward and backward in HLO: {sorted(targets)}")
    rows.append({"bench": "attention", "case": case, "impl": impl, "ms": t.ms, "timing": t.as_dict(),
                 "tflops": flops / (t.ms * 1e-3) / 1e12,
                 **{f"err_{n}": _rel(x, r) for n, x, r in zip(("o", "dq", "dk", "dv"), outs, refs)},
                 "handler": ", ".join(sorted(x for x in targets if x.startswith("__cudnn"))) or "xla",
                 "ok": not problems, "note": "; ".join(problems)})
  for r in rows:
    r["speedup_vs_jax_cudnn"] = rows[0]["ms"] / r["ms"]
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, shape in enumerate(SHAPES):
    shape_rows = bench_shape(ctx, shape, jax.random.key(300 + i))
    for r in shape_rows:
      errors = f", dQ {r['err_dq']:.3g} off" if "err_dq" in r else ""
      print(f"attention {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r.get('tflops', float('nan')):.0f} TFLOP/s, "
            f"{r.get('speedup_vs_jax_cudnn', float('nan')):.2f}x vs jax.nn cudnn{errors}"
            + (f" [{r['note']}]" if not r["ok"] else ""), file=sys.stderr, flush=True)
    rows += shape_rows
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_attention", "--no-write"]))
