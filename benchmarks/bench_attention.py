"""Causal self-attention fwd+bwd: te_jax.dot_product_attention (fused = cuDNN, unfused = jnp) vs
``jax.nn.dot_product_attention(implementation="cudnn")``, same shapes, same process.

Shape B=4, S=2048, H=32, D=128, bfloat16, causal. The timed function returns the output and the gradients with
respect to q, k and v (``jax.vjp`` applied to a random output gradient).

FLOPs: the two GEMMs of the forward pass (Q K^T and P V) are 2 * 2*B*H*S*S*D = 4*B*H*S*S*D multiply-adds counted as
2 FLOPs each; the backward pass has 5 GEMMs of the same size (the recomputed Q K^T, dV, dP, dQ, dK), 2.5 times the
forward's; a causal mask halves the useful work. Total: 4*B*H*S*S*D * (1 + 2.5) / 2 (what FlashAttention reports).

  python benchmarks/bench_attention.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import harness
import te_jax

SHAPES = ((4, 2048, 32, 128),)  # (B, S, H, D)
COLUMNS = (
    ("case", "case"),
    ("impl", "impl"),
    ("ms", "ms"),
    ("TFLOP/s", "tflops"),
    ("vs jax.nn cudnn", "speedup_vs_jax_cudnn"),
    ("temp MiB", "temp_mib"),
    ("handler", "handler"),
    ("ok", "ok"),
    ("note", "note"),
)


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
  rows, outputs = [], {}
  for name, attn in impls.items():
    fn = _fwd_bwd(attn)
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
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = []
  for i, shape in enumerate(SHAPES):
    shape_rows = bench_shape(ctx, shape, jax.random.key(300 + i))
    for r in shape_rows:
      print(f"attention {r['case']} {r['impl']}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, "
            f"{r['speedup_vs_jax_cudnn']:.2f}x vs jax.nn cudnn" + (f" [{r['note']}]" if not r["ok"] else ""),
            file=sys.stderr, flush=True)
    rows += shape_rows
  return rows


if __name__ == "__main__":
  import run as runner  # noqa: PLC0415 - the driver lives beside this file

  sys.exit(runner.main(["--only", "bench_attention", "--no-write"]))
