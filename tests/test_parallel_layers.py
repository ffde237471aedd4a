"""te_jax's Flax modules under ``jax.jit`` + NamedSharding on 8 CPU devices (forced in conftest.py), sharded through
``te_jax.flax.logical_axis_rules``.

Each case runs three train steps (SGD on the parameters, the FP8 state overwritten by its update, as
``TrainState.apply_gradients`` does) under DelayedScaling on a mesh, and the same steps on one device, and compares
the outputs, the gradients, the parameters and the FP8 state of every step. The compiled train step's collectives are
counted (kind, reduction, operand dtype) and checked against the list the layout calls for.
"""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as te_flax
from conftest import random_normal, rel_error
from te_jax.recipe import DelayedScaling

B, S, HIDDEN, HEADS, FFN = 8, 16, 64, 4, 128
RECIPE = DelayedScaling(amax_history_len=4)
STEPS = 3

# mesh name: (mesh shape, mesh axis names, logical_axis_rules arguments)
MESHES = {
    "dp8": ((8,), ("data",), dict(data="data")),
    "fsdp8": ((8,), ("fsdp",), dict(fsdp="fsdp")),
    "dp2xtp4-sp": ((2, 4), ("data", "tensor"), dict(data="data", tensor="tensor", sequence_parallel=True)),
}


class _Model(nn.Module):
  """One module of te_jax as a model's caller uses it: the input constrained as the residual stream is (batch, seq,
  hidden), the module's parameters named with logical axes."""

  kind: str

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, ("batch", "seq", "act_embed"))
    if self.kind == "dense":  # column parallel: the features over the tensor axis
      y = te_flax.DenseGeneral(FFN, kernel_axes=("embed", "mlp"), bias_axes=("mlp",), dtype=jnp.float32)(x)
      return nn.with_logical_constraint(y, ("batch", None, "mlp"))
    if self.kind == "mlp":
      return te_flax.LayerNormMLP(intermediate_dim=FFN, dtype=jnp.float32, logical_axes=True)(x, deterministic=True)
    if self.kind == "mha":
      return te_flax.MultiHeadAttention(head_dim=HIDDEN // HEADS, num_attention_heads=HEADS, dtype=jnp.float32,
                                        backend="unfused", logical_axes=True)(x, deterministic=True)
    layer = dict(hidden_size=HIDDEN, intermediate_dim=FFN, num_attention_heads=HEADS, layer_type="decoder",
                 dtype=jnp.float32, backend="unfused", logical_axes=True)
    if self.kind == "layer":
      return te_flax.TransformerLayer(**layer)(x, deterministic=True)
    assert self.kind == "scan", self.kind
    stack = nn.scan(_ScanBody, variable_axes={"params": 0, te_jax.FP8_COLLECTION: 0}, split_rngs={"params": True},
                    length=4, metadata_params={nn.PARTITION_NAME: None})
    return stack(layer, name="layers")(x, None)[0]


class _ScanBody(nn.Module):
  layer: dict

  @nn.compact
  def __call__(self, x, _):
    return te_flax.TransformerLayer(**self.layer, name="layer")(x, deterministic=True), None


# ---- collectives ---------------------------------------------------------------------------------------------------

_COLLECTIVE = re.compile(r"= (\([^=]*?\)|\S+) (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
                         r"(?:-start)?\(.*?to_apply=%([\w.\-]+)|= (\([^=]*?\)|\S+) (all-gather|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def collectives(hlo: str) -> collections.Counter:
  """The collectives of a compiled HLO module, counted per result (a combined all-reduce counts each of its
  operands): (kind, reduction or "", dtype)."""
  out = collections.Counter()
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(re.sub(r"/\*index=\d+\*/", "", line))
    if not m:
      continue
    if m.group(2):
      types, kind, name = m.group(1), m.group(2), m.group(3)
      body = re.search(rf"^%{re.escape(name)} \(.*?\n(.*?)^\}}", hlo, re.S | re.M)
      op = re.search(r"ROOT \S+ = \S+ ([\w-]+)\(", body.group(1)).group(1)
    else:
      types, kind, op = m.group(4), m.group(5), ""
    for dtype in re.findall(r"(\w+)\[[\d,]*\]", types):
      out[(kind, op, dtype)] += 1
  return out


# ---- the train steps -----------------------------------------------------------------------------------------------


def _init(kind, mesh, rules):
  model = _Model(kind)
  x = random_normal(1, (B, S, HIDDEN))
  target = random_normal(2, (B, S, FFN if kind == "dense" else HIDDEN))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    boxed = model.init(jax.random.key(0), x)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  return model, nn.meta.unbox(boxed), shardings, x, target


def _step_fn(model):
  def step(v, x, target):
    def loss_fn(v):
      return jnp.mean(model.apply(v, x) * target)

    loss, g = jax.value_and_grad(loss_fn)(v)
    new = {"params": jax.tree.map(lambda p, d: p - 0.5 * d, v["params"], g["params"]),
           te_jax.FP8_COLLECTION: g[te_jax.FP8_COLLECTION]}
    return new, loss, g

  return step


def run_case(kind, mesh_name):
  """(the sharded steps' results, the unsharded ones', the compiled sharded step's HLO)."""
  shape, names, rule_args = MESHES[mesh_name]
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)
  rules = te_flax.logical_axis_rules(**rule_args)
  model, v, shardings, x, target = _init(kind, mesh, rules)
  step = _step_fn(model)
  act = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "act_embed"), rules))
  results = {}
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    one = jax.jit(step)
    vs, xs, ts = v, x, target
    results["one"] = []
    for _ in range(STEPS):
      vs, loss, g = one(vs, xs, ts)
      results["one"].append((vs, loss, g))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      sharded = jax.jit(step, out_shardings=(shardings, None, shardings))
      vs, xs = jax.device_put(v, shardings), jax.device_put(x, act)
      out_names = ("batch", None, "mlp") if kind == "dense" else ("batch", "seq", "act_embed")
      ts = jax.device_put(target, NamedSharding(mesh, nn.logical_to_mesh_axes(out_names, rules)))
      hlo = sharded.lower(vs, xs, ts).compile().as_text()
      results["mesh"] = []
      for _ in range(STEPS):
        vs, loss, g = sharded(vs, xs, ts)
        results["mesh"].append((vs, loss, g))
  return results["mesh"], results["one"], hlo


def kernel_gather_sources(hlo: str) -> list[str]:
  """For each all-gather of a rank >= 2 array: the dtype of what it gathers. XLA:CPU moves FP8 collectives as f16
  (a lossless convert before, one back after); such an all-gather reports the FP8 dtype its operand was converted
  from."""
  types = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", hlo, re.M)}
  sources = []
  for m in re.finditer(r"= (\w+)\[(\d+(?:,\d+)+)\]\S* all-gather(?:-start)?\(%([\w.\-]+)\)", hlo):
    dtype, operand = m.group(1), m.group(3)
    line = re.search(rf"^\s*%{re.escape(operand)} = .*$", hlo, re.M).group(0)
    called = re.search(r"calls=%([\w.\-]+)", line)
    inputs = re.findall(r"\(%([\w.\-]+)", line) + re.findall(r", %([\w.\-]+)", line.split("calls=")[0])
    widened = [types.get(i) for i in inputs if types.get(i, "").startswith("f8")]
    if called:
      body = re.search(rf"^%{re.escape(called.group(1))} \((.*?)\) ->", hlo, re.M).group(1)
      widened += re.findall(r": (f8\w+)\[", body)
    sources.append(widened[0] if dtype == "f16" and widened else dtype)
  return sources
