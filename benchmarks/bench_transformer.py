"""A pre-LN GPT layer fwd+bwd: te_jax.flax.TransformerLayer (FP8, DelayedScaling) vs the same layer built from Flax
(``nn.LayerNorm``, ``nn.Dense``, ``jax.nn.dot_product_attention(implementation="cudnn")``), in FP8
(``dot_general_cls=Fp8DirectDotGeneralOp``) and in BF16, same process; and the compiled temp memory of a stack of
four such layers.

Layer: hidden 4096, 32 heads of 128, MLP 16384 with gelu (tanh form), causal self attention, no biases, float32
parameters, bfloat16 compute; one more te_jax row also runs attention's forward in FP8 (the recipe's ``fp8_dpa``,
where cuDNN supports it), another runs every FP8 GEMM with fast accumulation (the recipe's ``fp8_gemm_*``), another
under ``Float8BlockScaling`` (1 x 128 / 128 x 128 block scales). The timed
function is ``jax.vjp`` of ``apply`` w.r.t. the variables and the input, applied to a random output gradient, with the
output. The te_jax layer also runs with ``logical_axes=True`` under a (data, fsdp, tensor) mesh of one device and
every rule of ``te_flax.logical_axis_rules`` (sequence parallel included): the sharded code path at mesh size 1. The
same layer from ``te_jax.nnx`` (FP8) gets a row too: ``jax.vjp`` of ``nnx.merge(graphdef, state)(x)``
w.r.t. the state (parameters and ``Fp8State``) and the input; it and the linen te_jax row also record the time of
their first compile (``compile_s``: tracing, lowering and compiling a new jitted function of the same computation).
Rates count the GEMMs and causal attention (half the score matrix), forward and backward (``_flops``). Each row also
records the SM clock and power while it ran (``harness.ClockSampler``).

  python benchmarks/bench_transformer.py
"""

from __future__ import annotations

import contextlib
import sys
import time

import bench_dense
import flax.linen as nn
import harness
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import fp8_ops
from jax.sharding import Mesh

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax import recipe

LAYER = {"batch": 4, "seq": 2048, "hidden": 4096, "heads": 32, "mlp": 16384}
STACK = {"layers": 4, "batch": 8}


class FlaxGPTLayer(nn.Module):
  """The layer as a Flax user writes it."""

  hidden: int
  heads: int
  mlp: int
  fp8: bool

  @nn.compact
  def __call__(self, x):
    kw = {"dtype": jnp.bfloat16, "use_bias": False}
    if self.fp8:
      kw["dot_general_cls"] = fp8_ops.Fp8DirectDotGeneralOp
    b, s, _ = x.shape
    d = self.hidden // self.heads
    h = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16)(x)
    qkv = nn.Dense(3 * self.hidden, **kw)(h).reshape(b, s, 3, self.heads, d)
    a = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                     implementation="cudnn" if jax.default_backend() == "gpu" else None)
    x = x + nn.Dense(self.hidden, **kw)(a.reshape(b, s, self.hidden))
    h = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16)(x)
    h = nn.gelu(nn.Dense(self.mlp, **kw)(h), approximate=True)
    return x + nn.Dense(self.hidden, **kw)(h)


class Stack(nn.Module):
  """``layers`` copies of a layer in sequence."""

  make: object
  layers: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = self.make(name=f"layer_{i}")(x)
    return x


def _te_layer(c, **kw):
  return te_flax.TransformerLayer(hidden_size=c["hidden"], intermediate_dim=c["mlp"], num_attention_heads=c["heads"],
                                  layer_type="decoder", activation_type=("gelu",), dtype=jnp.bfloat16,
                                  **kw)


def _te_nnx_layer(c, rec):
  """te_jax.nnx's twin of ``_te_layer`` (built under ``rec``, which gives it its FP8 state)."""
  with te_jax.autocast(enabled=rec is not None, recipe=rec):
    return te_nnx.TransformerLayer(c["hidden"], c["mlp"], c["heads"], layer_type="decoder", activation_type=("gelu",),
                                   dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def nnx_fwd_bwd(graphdef, rec):
  """``layer_fwd_bwd`` for an NNX layer: ``(state, x, dy) -> (out, (d_state, dx))``, jitted."""
  def f(state, x, dy):
    with te_jax.autocast(enabled=rec is not None, recipe=rec):
      out, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x, deterministic=True), state, x)
    return out, vjp(dy)

  return jax.jit(f)


def warm_nnx_layer(model, rec, x, dy, steps: int = 3):
  """``harness.warm_layer`` for an NNX layer: the state after ``steps`` calls (the FP8 state's updates written
  back), the jitted function and the last output."""
  graphdef, state = nnx.split(model)
  fn = nnx_fwd_bwd(graphdef, rec)
  out = None
  for _ in range(steps):
    out, (grads, _) = fn(state, x, dy)
    fp8_grads, _ = nnx.split_state(grads, te_nnx.Fp8State, ...)
    nnx.update(model, fp8_grads)
    state = nnx.state(model)
  return state, fn, out


def compile_seconds(fn, *args) -> float:
  """Seconds to trace, lower and compile ``fn`` for ``args``: a first compile's time when ``fn`` is a jitted function
  not called before (``.lower().compile()`` of one already compiled comes from jax's caches)."""
  t0 = time.perf_counter()
  fn.lower(*args).compile()
  return time.perf_counter() - t0


def _flops(c) -> float:
  tokens, h, f = c["batch"] * c["seq"], c["hidden"], c["mlp"]
  gemm = 2 * tokens * (4 * h * h + 2 * h * f)  # qkv, out, fc1, fc2
  attention = 2 * 2 * c["batch"] * c["seq"] * c["seq"] * h / 2  # QK^T and PV, causal half
  return 3 * (gemm + attention)  # forward + backward (two GEMMs per forward GEMM)


# The stack's compiled memory is compared for these: each is a compile of four layers (with XLA's GEMM autotuning for
# the Flax ones) and nothing else. te_jax's layer with FP8 off (17.3-17.5 ms against Flax BF16's 17.2-17.5 until
# 2026-12-04; its stack 8,487 MiB) is no longer measured here: a compile of a layer and of a stack that no comparison
# used; bench_layernorm_mlp and bench_dense keep te_jax's BF16 rows.
NNX_IMPL = "te_jax.nnx TransformerLayer fp8"
MESH_IMPL = "te_jax TransformerLayer fp8, 1-device mesh, every rule"
STACK_IMPLS = ("te_jax TransformerLayer fp8", "flax layer fp8", "flax layer bf16")


def impls(c, layers: int | None = None):
  """{name: (model, recipe or None)} for config ``c``: the te_jax layer (FP8, FP8 with FP8 attention, FP8 with fast
  accumulation) and Flax's (FP8, BF16); with ``layers``, stacks of that many (``STACK_IMPLS`` only)."""
  te_kw = {"deterministic": True}
  delayed = recipe.DelayedScaling()
  make = {
      "te_jax TransformerLayer fp8": (lambda **k: _te_layer(c, **k), delayed, te_kw),
      "te_jax TransformerLayer fp8 + fp8 attention": (lambda **k: _te_layer(c, **k),
                                                      recipe.DelayedScaling(fp8_dpa=True), te_kw),
      "te_jax TransformerLayer fp8 (fast accumulation)": (lambda **k: _te_layer(c, **k),
                                                          bench_dense.recipe_with_fast_accumulation(delayed), te_kw),
      "te_jax TransformerLayer fp8 block scaling": (lambda **k: _te_layer(c, **k), recipe.Float8BlockScaling(), te_kw),
      "flax layer fp8": (lambda **k: FlaxGPTLayer(c["hidden"], c["heads"], c["mlp"], True, **k), None, {}),
      "flax layer bf16": (lambda **k: FlaxGPTLayer(c["hidden"], c["heads"], c["mlp"], False, **k), None, {}),
  }
  out = {}
  for name, (fn, rec, kw) in make.items():
    if layers is not None and name not in STACK_IMPLS:
      continue
    if layers is None:
      model = fn()
    elif kw:  # te_jax layers take deterministic=True: wrapped, since Stack passes x only
      model = Stack(lambda name, fn=fn: _Deterministic(fn(), name=name), layers)
    else:
      model = Stack(fn, layers)
    out[name] = (model, rec)
  return out


class _Deterministic(nn.Module):
  """Calls the wrapped te_jax layer with deterministic=True."""

  layer: nn.Module

  def __call__(self, x):
    return self.layer(x, deterministic=True)


def _config(ctx: harness.Context, batch: int) -> dict:
  c = {k: (v // ctx.shrink if k in ("seq", "hidden", "mlp") else v) for k, v in LAYER.items()}
  c["heads"] = max(1, c["heads"] // ctx.shrink)
  c["batch"] = batch
  return c


def bench_layer(ctx: harness.Context, key) -> list[dict]:
  c = _config(ctx, LAYER["batch"])
  kx, kd, ki = jax.random.split(key, 3)
  shape = (c["batch"], c["seq"], c["hidden"])
  x = jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, shape, jnp.float32).astype(jnp.bfloat16)
  rows = []
  delayed = recipe.DelayedScaling()
  layers = {**impls(c), NNX_IMPL: (None, delayed), MESH_IMPL: (_te_layer(c, logical_axes=True), delayed)}
  for name, (model, rec) in layers.items():
    with _mesh_of_one() if name == MESH_IMPL else contextlib.nullcontext():
      rows.append(_layer_row(ctx, c, name, model, rec, ki, x, dy))
  harness.add_ratios(rows, bf16="flax layer bf16", fp8="flax layer fp8")
  return rows


@contextlib.contextmanager
def _mesh_of_one():
  """The sharded code path at mesh size 1: a (data, fsdp, tensor) mesh of one device with every logical axis rule of
  ``te_flax.logical_axis_rules`` (sequence parallel included) applied to the layer's parameters and activations."""
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  rules = te_flax.logical_axis_rules(data="data", fsdp="fsdp", tensor="tensor", sequence_parallel=True)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def _layer_row(ctx, c, name, model, rec, ki, x, dy) -> dict:
  """One layer's row: its timing, memory and the problems its compiled program shows."""
  kw = {"deterministic": True} if name.startswith("te_jax") else {}
  if name == NNX_IMPL:
    nnx_model = _te_nnx_layer(c, rec)
    state, fn, out = warm_nnx_layer(nnx_model, rec, x, dy)
    args = (state, x, dy)
  else:
    fn = harness.layer_fwd_bwd(model, rec, **kw)
    variables, out = harness.warm_layer(model, rec, fn, ki, x, dy, **kw)
    args = (variables, x, dy)
  problems = []
  row = harness.layer_row(ctx, fn, args, flops=_flops(c), out=out, problems=problems)
  if name == NNX_IMPL:  # a new jitted function: traced, lowered and compiled anew
    row["compile_s"] = compile_seconds(nnx_fwd_bwd(nnx.graphdef(nnx_model), rec), *args)
  elif name in ("te_jax TransformerLayer fp8", MESH_IMPL):
    row["compile_s"] = compile_seconds(harness.layer_fwd_bwd(model, rec, **kw), *args)
  targets = row.pop("targets")
  if ctx.gpu and not any(t.startswith("__cudnn$fmha") for t in targets):
    problems.append("no cuDNN attention in HLO")
  if ctx.gpu and name.startswith(("te_jax TransformerLayer fp8", NNX_IMPL)) and "te_gemm_cuda" not in targets:
    problems.append("no te_gemm_cuda in HLO")
  if ctx.gpu and name.endswith("fp8 attention") and not any("F8" in t for t in targets if "fmha" in t):
    problems.append("no cuDNN FP8 attention in HLO")
  acceptance = {"te_jax TransformerLayer fp8": "acceptance: >= 1.1x Flax fp8, >= 1.65x Flax bf16",
                "te_jax TransformerLayer fp8 block scaling": "acceptance: >= 1.35x Flax bf16"}.get(name, "")
  if name in (NNX_IMPL, MESH_IMPL):
    acceptance = "acceptance: the linen te_jax row's time and memory"
  return {"bench": "transformer", "impl": name, **row, "ok": not problems,
          "case": f"GPT layer b{c['batch']} s{c['seq']} h{c['hidden']} mlp{c['mlp']} {c['heads']} heads "
                  "causal fwd+bwd",
          "note": "; ".join(problems) or acceptance}


def stack_memory(ctx: harness.Context, key) -> list[dict]:
  """Compiled temp memory of the 4-layer stack at batch 8 (compiled only, not run)."""
  c = _config(ctx, STACK["batch"])
  shape = (c["batch"], c["seq"], c["hidden"])
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  rows = []
  for name, (model, rec) in impls(c, STACK["layers"]).items():
    fn = harness.layer_fwd_bwd(model, rec)
    with te_jax.autocast(enabled=rec is not None, recipe=rec):
      variables = jax.eval_shape(lambda k, model=model: model.init(k, jnp.zeros(shape, jnp.bfloat16)), key)
    compiled = fn.lower(variables, x, x).compile()
    rows.append({
        "bench": "transformer",
        "case": f"stack of {STACK['layers']} layers b{c['batch']} s{c['seq']} h{c['hidden']}: compiled memory",
        "impl": name,
        "ms": float("nan"),
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "handler": "",
        "ok": True,
        "note": "acceptance: temp <= 0.8x Flax fp8" if name == "te_jax TransformerLayer fp8" else "",
    })
  harness.add_ratios(rows, bf16="flax layer bf16", fp8="flax layer fp8")
  return rows


def run(ctx: harness.Context) -> list[dict]:
  rows = bench_layer(ctx, jax.random.key(400))
  harness.print_layer_rows("transformer", rows)
  for r in rows:
    if "compile_s" in r:
      print(f"transformer {r['impl']}: first compile {r['compile_s']:.1f} s", file=sys.stderr, flush=True)
  stack = stack_memory(ctx, jax.random.key(401))
  for r in stack:
    print(f"transformer {r['case']} {r['impl']}: temp {r['temp_mib']:.0f} MiB ({r['temp_vs_flax_fp8']:.2f}x Flax fp8)",
          file=sys.stderr, flush=True)
  return rows + stack


if __name__ == "__main__":
  import run as runner

  sys.exit(runner.main(["--only", "bench_transformer", "--no-write"]))
