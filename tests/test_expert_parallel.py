"""``te_jax.fused.expert_parallel.expert_parallel_moe`` on 8 CPU devices (forced in conftest.py): the experts sharded
over a mesh axis (EP), alone and with data parallelism (DP) and tensor parallelism of each expert's hidden dim (TP),
against the same layers on one device.

The one-device computation is made of te_jax's own pieces: ``permute`` of each device's tokens on their own (the
capacity counted per device, as the expert-parallel layer counts it), one ``grouped_dense`` of every expert over all
of its rows (the devices' rows in device order), the activation, the second ``grouped_dense``, ``unpermute``. Under
the block-scaled recipes (1 x 128, MXFP8's 1 x 32) the tokens and the output gradient are cast and dequantized first,
where the expert-parallel layer casts them before its all-to-alls (so that the weight gradient's transposed copies
are cast from the same values), and with data parallelism each data shard's rows of an expert form a group of their
own (a kernel per group, the same expert's: their gradients sum), since each device lays out its groups on whole
token blocks.

Each case runs three SGD steps in a jitted train step (the loss a sum of the outputs times a target, so that the
gradients are O(1) and FP8 casts them with the initial scales of 1) and compares every step's outputs, gradients
(kernels, tokens and router logits) and delayed-scaling states. The compiled step's collectives are counted in the
program right after SPMD partitioning, where they keep their dtypes (XLA:CPU later moves FP8 collectives as f16).
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import random_normal, rel_error
from te_jax.fused.expert_parallel import expert_parallel_moe
from te_jax.fused.grouped_dense import grouped_dense, grouped_fp8_meta
from te_jax.fused.moe_permute import permute, unpermute
from te_jax.fused.moe_router import route
from te_jax.fused.quantizer import quantizer_for
from te_jax.ops.activation import activation
from te_jax.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                           NVFP4BlockScaling)

E, K, H, T, CF = 8, 2, 32, 16, 1.0  # experts, choices per token, hidden, tokens per device, capacity factor
STEPS, LR = 3, 0.01
RECIPES = {"none": None, "delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling()}
# mesh name: (shape, axis names, the tokens' axes, the tensor axis)
MESHES = {"ep8": ((8,), ("ep",), ("ep",), None),
          "ep4xdp2": ((2, 4), ("dp", "ep"), ("dp", "ep"), None),
          "ep2xdp2xtp2": ((2, 2, 2), ("dp", "ep", "tp"), ("dp", "ep"), "tp")}


def _mesh(name):
  shape, names, _, _ = MESHES[name]
  return Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)


def _hidden(recipe):
  """F, the experts' hidden dim: 1 x 128 blocks along it must not straddle two tensor shards, so 128 per shard."""
  return 256 if isinstance(recipe, Float8BlockScaling) else 64


# ---- the layer on the mesh and on one device ----------------------------------------------------------------------


def _ep_layer(mesh_name, recipe, act, capacity_factor=CF):
  _, _, token_axes, tp = MESHES[mesh_name]
  mesh = _mesh(mesh_name)
  tokens = P(token_axes)
  wi_spec = P("ep", None, None, tp) if len(act) == 2 else P("ep", None, tp)

  def body(x, logits, wi, wo, wi_meta, wo_meta):
    return expert_parallel_moe(x, route(logits, K), wi, wo, axis="ep", capacity_factor=capacity_factor,
                               activation_type=act,
                               tensor_axis=tp, wi_fp8_meta=wi_meta, wo_fp8_meta=wo_meta, recipe=recipe)

  return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, wi_spec, P("ep", tp), P("ep"), P("ep")),
                       out_specs=tokens)


def _fake_cast(recipe, role, v):
  q = quantizer_for(recipe)
  dtype = q.fwd_dtype if role == "x" else q.bwd_dtype
  return q.quantize(role, None, v, dtype).out.dequantize(v.dtype)


def _one_device_layer(shards, recipe, act, replicas=1):
  """The same layers on one device, over ``shards`` devices' tokens (see the module docstring), of which each
  ``shards // replicas`` consecutive ones form one data shard (the experts' devices of one replica of the experts)."""
  block = recipe is not None and quantizer_for(recipe).mode_for("x").block is not None

  @jax.custom_vjp
  def x_cast(x):  # under block scaling: the tokens as the expert-parallel layer sends them; their gradient as it is
    return _fake_cast(recipe, "x", x)

  x_cast.defvjp(lambda x: (x_cast(x), None), lambda _, g: (g,))

  @jax.custom_vjp
  def grad_cast(y):  # and the output gradient as it sends it
    return y

  grad_cast.defvjp(lambda y: (y, None), lambda _, g: (_fake_cast(recipe, "grad", g),))

  def layer(x, logits, wi, wo, wi_meta, wo_meta):
    r = route(logits, K)
    xs, experts, weights = (a.reshape(shards, -1, a.shape[-1]) for a in (x, r.experts, r.weights))
    parts = [permute(xs[s], experts[s], E, capacity_factor=CF) for s in range(shards)]
    c = parts[0][2].config.capacity
    rows = jnp.stack([p[0] for p in parts]).reshape(shards, E, c, H).transpose(1, 0, 2, 3).reshape(-1, H)
    if block:
      rows = x_cast(rows)
    wi, groups = wi.reshape(E, H, -1), E
    if block and replicas > 1:  # the weight gradient's operands are blocked along each data shard's own rows of an
      # expert (the group-aligned layout pads each device's groups), as one group per expert and data shard does here
      wi, wo, groups = jnp.repeat(wi, replicas, axis=0), jnp.repeat(wo, replicas, axis=0), E * replicas
    sizes = jnp.full((groups,), shards * c // groups * E, jnp.int32)
    h = grouped_dense(rows, wi, sizes, fp8_meta=wi_meta, recipe=recipe)
    a = activation(h.reshape(h.shape[0], 2, -1) if len(act) == 2 else h, act)
    y = grouped_dense(a, wo, sizes, fp8_meta=wo_meta, recipe=recipe)
    if block:
      y = grad_cast(y)
    ys = y.reshape(E, shards, c, H).transpose(1, 0, 2, 3).reshape(shards, E * c, H)
    return jnp.concatenate([unpermute(ys[s], parts[s][2], weights[s]) for s in range(shards)])

  return layer


def _train_step(layer):
  """``step(params, metas, x, logits, target) -> (params, metas, results)``: SGD on the kernels, the delayed-scaling
  states overwritten by their updates; the results are the output, the loss and the gradients (kernels, tokens,
  router logits)."""

  def step(params, metas, x, logits, target):
    def loss(params, metas, x, logits):
      out = layer(x, logits, params["wi"], params["wo"], metas["wi"], metas["wo"])
      return jnp.sum(out * target), out

    (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(params, metas, x, logits)
    g, new_metas, gx, g_logits = grads
    params = jax.tree.map(lambda p, d: p - LR * d, params, g)
    return params, new_metas, dict(out=out, loss=value, grads=g, x=gx, logits=g_logits)

  return step


def _inputs(mesh_name, recipe, act):
  shards = 8 if MESHES[mesh_name][3] is None else 4
  f = _hidden(recipe)
  n = 2 if len(act) == 2 else 1
  x = random_normal(1, (shards * T, H))
  logits = random_normal(2, (shards * T, E))
  target = random_normal(3, (shards * T, H))
  wi = random_normal(4, (E, H, n, f) if n == 2 else (E, H, f)) / np.sqrt(H)
  wo = random_normal(5, (E, f, H)) / np.sqrt(f)
  stateful = isinstance(recipe, DelayedScaling)
  meta = grouped_fp8_meta(E, recipe.amax_history_len) if stateful else None
  return shards, {"wi": wi, "wo": wo}, {"wi": meta, "wo": meta}, x, logits, target


def run_case(mesh_name, recipe_name, dump_dir, act=("gelu",)):
  """(the mesh's steps, the one device's steps, the compiled mesh step's HLO, its HLO right after SPMD
  partitioning, which keeps the collectives' dtypes: XLA:CPU later moves FP8 collectives as f16)."""
  recipe = RECIPES[recipe_name]
  shards, params, metas, x, logits, target = _inputs(mesh_name, recipe, act)
  replicas = 2 if "dp" in MESHES[mesh_name][1] else 1
  one = jax.jit(_train_step(_one_device_layer(shards, recipe, act, replicas)))
  lowered = jax.jit(_train_step(_ep_layer(mesh_name, recipe, act))).lower(params, metas, x, logits, target)
  mesh_step = lowered.compile(compiler_options={"xla_dump_to": str(dump_dir),
                                                "xla_dump_hlo_pass_re": "spmd-partitioning"})
  (spmd,) = [f.read_text() for f in dump_dir.iterdir()
             if f.name.endswith(".after_spmd-partitioning.before_control-dep-rewriter.txt")]
  results = {}
  for name, step in (("one", one), ("mesh", mesh_step)):
    p, m, out = params, metas, []
    for _ in range(STEPS):
      p, m, res = step(p, m, x, logits, target)
      out.append(dict(params=p, metas=m, **res))
    results[name] = out
  return results["mesh"], results["one"], mesh_step.as_text(), spmd

_PARTITIONED = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute)"
                          r"\(.*?replica_groups=\S+ \{([^}]*)\}")


def _partitioned_collectives(spmd: str) -> collections.Counter:
  """The collectives of the program right after SPMD partitioning (one instruction each, in their own dtypes):
  (kind, reduction or "", dtype, mesh axes) -> count."""
  out = collections.Counter()
  for line in spmd.splitlines():
    m = _PARTITIONED.search(line)
    if not m:
      continue
    dtype, _, kind, axes = m.groups()
    op = ""
    if kind == "all-reduce":
      name = re.search(r"to_apply=%([\w.\-]+)", line).group(1)
      body = re.search(rf"^%{re.escape(name)} \(.*?\n(.*?)^\}}", spmd, re.S | re.M).group(1)
      op = re.search(r"ROOT \S+ = \S+ ([\w-]+)\(", body).group(1)
    out[(kind, op, dtype, axes.replace("'", ""))] += 1
  return out


def _hlo_dtype(dtype) -> str:
  """The HLO name of a dtype: f32, f8e4m3fn, f8e8m0fnu, ..."""
  name = jnp.dtype(dtype).name
  return name.replace("float8_", "f8") if name.startswith("float8") else {"float32": "f32"}[name]


def _expected(mesh_name, recipe_name) -> collections.Counter:
  """The collectives the layout calls for, in the partitioned program (see ``test_sharded_steps_match_one_device``)."""
  _, names, token_axes, tp = MESHES[mesh_name]
  recipe = RECIPES[recipe_name]
  axes = lambda *a: ",".join(n for n in names if n in a)  # noqa: E731 - mesh order
  c = collections.Counter()
  c["all-reduce", "add", "f32", axes(*token_axes)] += 1  # the loss
  if recipe is None:
    c["all-to-all", "", "f32", "ep"] += 4  # dispatch, combine, and their transposes
  else:
    q = quantizer_for(recipe)
    c["all-to-all", "", _hlo_dtype(q.fwd_dtype), "ep"] += 1  # the tokens
    c["all-to-all", "", _hlo_dtype(q.bwd_dtype), "ep"] += 1  # the output gradient
    c["all-to-all", "", "f32", "ep"] += 2  # the combine and the input gradient, in their dtype
    mode = q.mode_for("x")
    if mode.block is not None:
      c["all-to-all", "", _hlo_dtype(mode.scale_dtype), "ep"] += 2  # the tokens' and the gradient's scale rows
  if "dp" in names:
    c["all-reduce", "add", "f32", "dp"] += 2  # each kernel's gradient, over the data shards
  if tp:
    c["all-reduce", "add", "f32", "tp"] += 2  # the second GEMM's partial sums; the tokens' gradient's
  if isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
    c["all-reduce", "maximum", "f32", axes(*token_axes, tp)] += 1  # each expert's amax of the sent tokens (the rows
    # vary over the tensor axis once cast like the kernels)
    c["all-reduce", "maximum", "f32", axes(*token_axes)] += 1  # ... and of the sent output gradient
    inner = axes("dp", tp)  # where an expert's other tensors (the activation, its gradient) are split
    if isinstance(recipe, DelayedScaling):
      c["all-gather", "", "f32", "ep"] += 2  # every expert's x and gradient scales, for the senders
      if inner:
        c["all-reduce", "maximum", "f32", inner] += 2  # each GEMM's state update: its amaxes of the whole tensors
    else:
      if inner:
        c["all-reduce", "maximum", "f32", inner] += 2  # the activation's and its gradient's per-expert amaxes
      if tp:
        c["all-reduce", "maximum", "f32", "tp"] += 2  # each expert's kernels' amaxes
  return c


def _check_collectives(mesh_name, recipe_name, hlo, spmd):
  got = _partitioned_collectives(spmd)
  assert got == _expected(mesh_name, recipe_name), sorted(got.items())
  gathers = [m.groups()[:2] for m in _PARTITIONED.finditer(spmd) if m.group(3) == "all-gather"]
  assert all(g == ("f32", str(E)) for g in gathers), gathers  # only the experts' scales: no tokens gathered
  compiled = re.findall(r"^\s*%\S+ = .*? (all-to-all|all-gather|all-reduce)(?:-start)?\(", hlo, re.M)
  block = RECIPES[recipe_name] is not None and quantizer_for(RECIPES[recipe_name]).mode_for("x").block is not None
  assert compiled.count("all-to-all") == 4 + 2 * block, compiled
  assert compiled.count("all-gather") == len(gathers), compiled


# Sharded against one device, leaf by leaf. Bitwise where the math is the same: at the first step, every output,
# input gradient and router-logit gradient (each row's dot products over the whole K, in the same order) without the
# tensor axis, and every FP8 state (maxes of those bitwise-equal tensors). Elsewhere only float32 summation orders
# differ: the weight gradients contract over the tokens in other blocks (the one-device GEMM's rows hold every
# device's, the data shards' partial sums are all-reduced), and the tensor axis adds the second GEMM's partial sums
# across its shards; observed <= 5e-7 relative at the first step. From the second step the kernels carry those
# differences; where one lands next to an FP8 rounding boundary an element rounds to the neighbouring FP8 value (1/8
# of itself in E4M3, 1/4 in E5M2), which moves a tensor of thousands of elements by ~1e-3 in norm, as
# tests/test_parallel_layers.py finds. A per-device scale, a wrong expert's scale or a dropped collective moves whole
# tensors (>= 1e-2).
LEAF_RTOL = 1e-3
# Without FP8 nothing rounds but the float32 sums: those of the weight gradients have at most 8 devices * C = 32
# terms, whose rounding in any order stays within 32 u = 1.9e-6 of their magnitudes (observed <= 2e-7 relative).
HIGH_PRECISION_RTOL = 1e-5


def _check_steps(got, want, mesh_name, recipe_name):
  tp = MESHES[mesh_name][3] is not None
  rtol = HIGH_PRECISION_RTOL if RECIPES[recipe_name] is None else LEAF_RTOL
  for i, (a, b) in enumerate(zip(got, want, strict=True)):
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
      name = f"step {i}{jax.tree_util.keystr(path)}"
      u, v = np.asarray(u), np.asarray(v)
      assert u.shape == v.shape and u.dtype == v.dtype, name
      first = path[0].key
      if i == 0 and (first == "metas" or (not tp and first in ("out", "x", "logits"))):
        np.testing.assert_array_equal(u, v, err_msg=name)
      else:
        assert rel_error(u, v) <= rtol, (name, rel_error(u, v))
  if got[0]["metas"]["wi"] is not None:  # every history rolled at each step: the state is live
    histories = [np.asarray(m.amax_history) for m in (*got[-1]["metas"]["wi"], *got[-1]["metas"]["wo"])]
    assert all(np.count_nonzero(h[:, :STEPS]) == h[:, :STEPS].size for h in histories)


def _cases():
  for mesh_name in MESHES:
    for recipe_name in RECIPES:
      yield pytest.param(mesh_name, recipe_name, id=f"{mesh_name}-{recipe_name}")


@pytest.mark.parametrize("mesh_name,recipe_name", list(_cases()))
@pytest.mark.fast_cases(2)
def test_sharded_steps_match_one_device(mesh_name, recipe_name, tmp_path):
  """EP=8, EP=4 x DP=2 and EP=2 x DP=2 x TP=2 against one device, under no recipe and the three FP8 recipes whose
  tokens travel by rows; the partitioned program's collectives are exactly the layout's: four all-to-alls over the
  expert axis (the tokens in E4M3 and the output gradient in the recipe's gradient format, the combine and the input
  gradient in float32, 1 x 128 scale rows beside their data), the kernels' gradients summed over the data axis, the
  tensor axis's two partial sums, per-tensor scaling's per-expert amaxes (the senders' over every token shard,
  the experts' other tensors' over the data and tensor axes) and delayed scaling's scales gathered for the senders;
  no token is all-gathered."""
  got, want, hlo, spmd = run_case(mesh_name, recipe_name, tmp_path)
  _check_collectives(mesh_name, recipe_name, hlo, spmd)
  _check_steps(got, want, mesh_name, recipe_name)


@pytest.mark.slow  # another 8-device train step
def test_gated_experts_match_one_device(tmp_path):
  """SwiGLU experts (wi (E, H, 2, F), the hidden dim sharded over the tensor axis with both halves in each shard)
  under delayed scaling on EP=2 x DP=2 x TP=2."""
  got, want, hlo, spmd = run_case("ep2xdp2xtp2", "delayed", tmp_path, act=("silu", "linear"))
  _check_collectives("ep2xdp2xtp2", "delayed", hlo, spmd)
  _check_steps(got, want, "ep2xdp2xtp2", "delayed")


def test_capacity_overflow_drops_as_permute():
  """Routing that overloads two experts: each device drops exactly the choices ``permute`` drops on its own tokens
  with the same capacity (by token order), a token whose choices all overflowed gets zeros, and the others get what
  they get without any dropping (the same rows' dot products: bitwise)."""
  mesh_name = "ep4xdp2"
  shards, params, _, x, logits, _ = _inputs(mesh_name, None, ("gelu",))
  logits = logits.at[:, :2].add(4.0)  # experts 0 and 1 first for almost every token
  layer = jax.jit(_ep_layer(mesh_name, None, ("gelu",)))
  out = np.asarray(layer(x, logits, params["wi"], params["wo"], None, None))
  want = np.asarray(jax.jit(_one_device_layer(shards, None, ("gelu",)))(x, logits, params["wi"], params["wo"], None,
                                                                        None))
  np.testing.assert_array_equal(out, want)
  r = route(logits, K)
  dropped = np.concatenate([np.asarray(permute(xs, es, E, capacity_factor=CF)[2].dropped) for xs, es in
                            zip(x.reshape(shards, T, H), r.experts.reshape(shards, T, K))])
  assert dropped.sum() >= shards * T // 2, dropped.sum()  # the test overflows
  all_dropped, none_dropped = dropped.all(axis=1), ~dropped.any(axis=1)
  assert all_dropped.any() and none_dropped.any()
  np.testing.assert_array_equal(out[all_dropped], 0.0)
  dropless = jax.jit(_ep_layer(mesh_name, None, ("gelu",), capacity_factor=E / K))  # every device's every choice
  full = np.asarray(dropless(x, logits, params["wi"], params["wo"], None, None))
  np.testing.assert_array_equal(out[none_dropped], full[none_dropped])
  assert not np.array_equal(out[~none_dropped], full[~none_dropped])


def _traced(mesh_name="ep8", **kwargs):
  """Traces one call on the mesh (no compile) with ``kwargs`` replacing the arguments."""
  mesh = _mesh(mesh_name)
  args = dict(wi=jnp.ones((E, H, 64)), wo=jnp.ones((E, 64, H)), axis="ep", capacity_factor=CF)
  args.update(kwargs)
  wi, wo = args.pop("wi"), args.pop("wo")
  routing = args.pop("routing", None)

  def body(x, logits, wi, wo):
    return expert_parallel_moe(x, route(logits, K) if routing is None else routing, wi, wo, **args)

  spec = P("ep")
  fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
  return jax.eval_shape(fn, jnp.ones((8 * T, H)), jnp.zeros((8 * T, E)), wi, wo)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(axis="expert"), ValueError, r"axis='expert' must name the expert mesh axis"),
    (dict(tensor_axis="tp"), ValueError, r"tensor_axis='tp' must name"),
    (dict(tensor_axis="ep"), ValueError, "tensor_axis and axis must differ"),
    (dict(wi=jnp.ones((E, H + 1, 64))), ValueError, r"wi must be \(E / P, H, F\) with H = x's 32"),
    (dict(activation_type=("silu", "linear")), ValueError, r"wi must be \(E / P, H, 2, F\)"),
    (dict(wo=jnp.ones((E, 64, H + 1))), ValueError, r"wo must be \(E / P, F, H\) = \(1, 64, 32\)"),
    (dict(capacity_factor=None), ValueError, "capacity_factor must be a float > 0"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be a finite Python float > 0"),
    (dict(routing=(0, 1)), TypeError, "routing must be the Routing route returned"),
    (dict(recipe=DelayedScaling()), ValueError, "DelayedScaling needs wi_fp8_meta"),
    (dict(recipe=DelayedScaling(amax_history_len=4), wi_fp8_meta=grouped_fp8_meta(2, 4),
          wo_fp8_meta=grouped_fp8_meta(2, 4)), ValueError, r"wi_fp8_meta.x must hold one state per group"),
    (dict(recipe=Float8CurrentScaling(), wi=jnp.ones((E, H, 40)), wo=jnp.ones((E, 40, H))), ValueError,
     "needs H=32 and F=40 to be multiples of 16"),
    (dict(recipe=NVFP4BlockScaling()), ValueError, "NVFP4BlockScaling casts the tokens as NVFP4_1X16"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    _traced(**kwargs)


def test_outside_shard_map():
  x = jnp.ones((T, H))
  with pytest.raises(ValueError, match="call it inside jax.shard_map over a mesh with that axis"):
    expert_parallel_moe(x, route(jnp.zeros((T, E)), K), jnp.ones((1, H, 64)), jnp.ones((1, 64, H)), axis="ep",
                        capacity_factor=CF)
