"""The models and the train step that the sharding tests run (test_parallel_layers.py on 8 devices of one process,
test_multiprocess.py across two processes): one te_jax module, or a 4-layer ``nn.scan`` stack of TransformerLayers,
with logical axis names, and three SGD steps under DelayedScaling; and the count of a compiled program's collectives
(test_nnx_sharding.py's too)."""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

import te_jax
import te_jax.flax as te_flax
from conftest import random_normal
from te_jax.recipe import DelayedScaling

B, S, HIDDEN, HEADS, FFN = 8, 16, 64, 4, 128
RECIPE = DelayedScaling(amax_history_len=4)
STEPS = 3


class Model(nn.Module):
  """One module of te_jax as a model's caller uses it: the input constrained as the residual stream is (batch, seq,
  hidden), the module's parameters named with logical axes."""

  kind: str
  context_parallel: str | None = None  # the mesh axis of context parallelism: the attention's (the sequence sharded)

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, ("batch", "seq", "act_embed"))
    if self.kind == "dense":  # column parallel: the features over the tensor axis, the sequence whole (gathered under
      # sequence parallelism) or, under context parallelism, sharded as the input's
      seq = "seq" if self.context_parallel else None
      return te_flax.DenseGeneral(FFN, kernel_axes=("embed", "mlp"), bias_axes=("mlp",), dtype=jnp.float32,
                                  output_axes=("batch", seq, "mlp"))(x)
    if self.kind in ("mlp", "swiglu"):  # swiglu: the gated kernel (H, 2, F), F split over the tensor axis
      act = ("silu", "linear") if self.kind == "swiglu" else ("gelu",)
      return te_flax.LayerNormMLP(intermediate_dim=FFN, activation_type=act, dtype=jnp.float32,
                                  logical_axes=True)(x, deterministic=True)
    if self.kind == "mha":
      return te_flax.MultiHeadAttention(head_dim=HIDDEN // HEADS, num_attention_heads=HEADS, dtype=jnp.float32,
                                        backend="unfused", logical_axes=True,
                                        context_parallel=self.context_parallel)(x, deterministic=True)
    layer = dict(hidden_size=HIDDEN, intermediate_dim=FFN, num_attention_heads=HEADS, layer_type="decoder",
                 dtype=jnp.float32, backend="unfused", logical_axes=True, context_parallel=self.context_parallel)
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


def init_case(kind, mesh, rules, context_parallel=None):
  """(model, its variables (unboxed, on one device), their shardings on ``mesh`` under ``rules``, input, target).
  With ``context_parallel`` the model's attention is context parallel over that mesh axis; its variables are the
  model's without (initialized on one device, as the comparison runs it)."""
  model = Model(kind, context_parallel)
  x = random_normal(1, (B, S, HIDDEN))
  target = random_normal(2, (B, S, FFN if kind == "dense" else HIDDEN))
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    boxed = Model(kind).init(jax.random.key(0), x)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  return model, nn.meta.unbox(boxed), shardings, x, target


def train_step(model):
  """``step(variables, x, target) -> (new variables, loss, gradients)``: SGD on the parameters, the FP8 state
  overwritten by its update, as ``TrainState.apply_gradients`` does, with each scale then rounded down to a power of
  two.

  Why the rounding: a tensor-parallel GEMM whose K is sharded dequantizes each shard's partial sum (``* 1 / (scale_x *
  scale_w)``, as one cuBLASLt call would its whole sum) before the psum. With a scale that is not a power of two that
  product rounds, so the sharded sum differs from the unsharded one in the last float32 bit; the next FP8 cast then
  rounds a few elements to the neighbouring FP8 value, and through a 4-layer stack and E5M2 gradients that moves
  gradients by a few percent (as much as a one-ulp change of the input does on one device). Power-of-two scales make
  every dequantization exact, so the sharded steps can be held to float32 summation-order tolerances at every step
  (the first step runs at the initial scales of 1 either way)."""

  def step(v, x, target):
    def loss_fn(v):
      return jnp.mean(model.apply(v, x) * target)

    loss, g = jax.value_and_grad(loss_fn)(v)
    new = {"params": jax.tree.map(lambda p, d: p - 0.5 * d, v["params"], g["params"]),
           te_jax.FP8_COLLECTION: jax.tree_util.tree_map_with_path(_power_of_two_scale, g[te_jax.FP8_COLLECTION])}
    return new, loss, g

  return step


def _power_of_two_scale(path, leaf):
  if not jax.tree_util.keystr(path).endswith("_scale']"):
    return leaf
  return jnp.exp2(jnp.floor(jnp.log2(leaf)))


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
