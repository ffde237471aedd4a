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
from conftest import rel_error
from parallel_model import B, HEADS, HIDDEN, RECIPE, S, STEPS, Model, collectives, init_case, train_step

# mesh name: (mesh shape, mesh axis names, logical_axis_rules arguments)
MESHES = {
    "dp8": ((8,), ("data",), dict(data="data")),
    "fsdp8": ((8,), ("fsdp",), dict(fsdp="fsdp")),
    "dp2xtp4-sp": ((2, 4), ("data", "tensor"), dict(data="data", tensor="tensor", sequence_parallel=True)),
    "fsdp2xtp2xcp2": ((2, 2, 2), ("fsdp", "tensor", "cp"), dict(fsdp="fsdp", tensor="tensor", context="cp")),
}


# ---- the train steps -----------------------------------------------------------------------------------------------


def run_case(kind, mesh_name, dump_dir):
  """(the sharded steps' results, the unsharded ones', the compiled sharded step's HLO, its HLO after SPMD
  partitioning)."""
  shape, names, rule_args = MESHES[mesh_name]
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), names)
  rules = te_flax.logical_axis_rules(**rule_args)
  cp_axis = rule_args.get("context")
  model, v, shardings, x, target = init_case(kind, mesh, rules, context_parallel=cp_axis)
  step = train_step(model)
  act = NamedSharding(mesh, nn.logical_to_mesh_axes(("batch", "seq", "act_embed"), rules))
  results = {}
  with te_jax.autocast(enabled=True, recipe=RECIPE):
    one = jax.jit(train_step(Model(kind)))  # the same variables, no context parallelism
    vs, xs, ts = v, x, target
    results["one"] = []
    for _ in range(STEPS):
      vs, loss, g = one(vs, xs, ts)
      results["one"].append((vs, loss, g))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      sharded = jax.jit(step, out_shardings=(shardings, None, shardings))
      if cp_axis is not None:  # the attention's load balancing: tokens in zig-zag order (the loss is a mean over them)
        x, target = (te_jax.to_zigzag(a, mesh.shape[cp_axis]) for a in (x, target))
      vs, xs = jax.device_put(v, shardings), jax.device_put(x, act)
      out_names = ("batch", "seq" if cp_axis else None, "mlp") if kind == "dense" else ("batch", "seq", "act_embed")
      ts = jax.device_put(target, NamedSharding(mesh, nn.logical_to_mesh_axes(out_names, rules)))
      hlo, spmd = partitioned_hlo(sharded.lower(vs, xs, ts), dump_dir)
      results["mesh"] = []
      for _ in range(STEPS):
        vs, loss, g = sharded(vs, xs, ts)
        results["mesh"].append((vs, loss, g))
  return results["mesh"], results["one"], hlo, spmd


def partitioned_hlo(lowered, dump_dir) -> tuple[str, str]:
  """(the compiled HLO, the HLO right after SPMD partitioning). The second holds the collectives as the partitioner
  wrote them, in their dtypes: XLA:CPU later moves FP8 collectives as f16 (a lossless convert on each side), which a
  GPU does not."""
  compiled = lowered.compile(compiler_options={"xla_dump_to": str(dump_dir),
                                               "xla_dump_hlo_pass_re": "spmd-partitioning"})
  suffix = ".after_spmd-partitioning.before_control-dep-rewriter.txt"
  (path,) = [p for p in dump_dir.iterdir() if p.name.endswith(suffix)]
  return compiled.as_text(), path.read_text()


# ---- the cases -----------------------------------------------------------------------------------------------------

KINDS = ("dense", "mlp", "swiglu", "mha", "layer", "scan")


def _c(**counts) -> collections.Counter:
  """A collectives Counter from keyword names: ar_max, ar_add (all-reduce), rs_add (reduce-scatter), ag_<dtype>."""
  kinds = {"ar_max": ("all-reduce", "maximum", "f32"), "ar_add": ("all-reduce", "add", "f32"),
           "rs_add": ("reduce-scatter", "add", "f32"), "ag_f32": ("all-gather", "", "f32"),
           "ag_f16": ("all-gather", "", "f16")}
  return collections.Counter({kinds[k]: v for k, v in counts.items() if v})


# The compiled train step's collectives, per operand (see ``collectives``), as measured and reviewed:
# - dp8: the amaxes max-reduced (x, grad, plus kernel where it is sharded) and every gradient sum all-reduced, with the
#   loss's; no all-gather.
# - fsdp8: the kernels all-gathered in FP8 (XLA:CPU widens FP8 collectives to f16: ag_f16; _check_layout finds them
#   f8e4m3fn in the partitioned program), once for the forward GEMM and once for dgrad; the norm scales and biases
#   (1-D) gathered in f32; every kernel gradient reduce-scattered, the 1-D ones all-reduced and sliced.
# - dp2xtp4-sp: the sequence all-gathered before each block's first GEMM and the output gradient before its backward
#   (f32 activations); each block's row-parallel GEMM (attention out-projection, MLP fc2) reduce-scattered onto the
#   sequence-sharded residual stream, and in the backward pass each block's column-parallel GEMM with its fused norm
#   (QKV projection, MLP fc1) reduce-scatters its input gradient onto the stream too (rs_add: two per block): the dgrad
#   GEMM's (batch, seq, hidden) output takes the stream's sharding (the layer's grad_sharding), the norm's backward
#   runs on the sequence shards, and its scale and bias gradients are all-reduced over data and tensor together (the
#   same operand count as over data alone). Before, those input gradients were all-reduced over the tensor axis and
#   sliced: one ar_add per block more, and two rs_add per layer fewer.
# - fsdp2xtp2xcp2 (context parallelism: the residual stream (batch over fsdp, sequence over cp), whole over tensor,
#   every op of every layer on the sequence shards): fsdp8's parameter gathers, per kernel one FP8 gather over fsdp
#   for the forward GEMM and one for dgrad (ag_f16), the 1-D norm parameters (and fc2's bias, added after fc2's sum)
#   in f32; the attention's K and V all-gathered over cp only (ag_f32, 2 per attention) and their gradients
#   reduce-scattered back over cp (rs_add, 2); each kernel gradient summed over cp (ar_add) and reduce-scattered over
#   fsdp (rs_add); the 1-D gradients all-reduced over fsdp and cp; each row-parallel GEMM's output (attention
#   out-projection, fc2) and each fused-norm column-parallel GEMM's input gradient (QKV, fc1) all-reduced over tensor
#   (f32 activation blocks: without sequence parallelism the stream is whole over tensor); the amaxes max-reduced;
#   the loss summed over cp and fsdp (and tensor, for the dense layer's tensor-sharded output). "dense" has no dgrad
#   (its input's gradient is unused): its kernel gathered once.
EXPECTED = {
    ("dense", "dp8"): _c(ar_max=2, ar_add=3),
    ("dense", "fsdp8"): _c(ar_max=3, ag_f16=1, rs_add=1, ar_add=2),
    ("dense", "dp2xtp4-sp"): _c(ag_f32=1, ar_max=3, ar_add=4),
    ("dense", "fsdp2xtp2xcp2"): _c(ag_f16=1, ar_max=3, rs_add=1, ar_add=5),
    ("mlp", "dp8"): _c(ar_max=4, ar_add=7),
    ("mlp", "fsdp8"): _c(ag_f32=3, ag_f16=4, ar_max=6, rs_add=2, ar_add=5),
    ("mlp", "dp2xtp4-sp"): _c(ag_f32=2, ar_max=6, rs_add=2, ar_add=8),
    ("mlp", "fsdp2xtp2xcp2"): _c(ag_f32=3, ag_f16=4, ar_max=6, rs_add=2, ar_add=10),
    ("mha", "dp8"): _c(ar_max=4, ar_add=5),
    ("mha", "fsdp8"): _c(ag_f32=2, ag_f16=4, rs_add=2, ar_max=6, ar_add=3),
    ("mha", "dp2xtp4-sp"): _c(ag_f32=2, ar_max=6, rs_add=2, ar_add=6),
    ("mha", "fsdp2xtp2xcp2"): _c(ag_f32=4, ag_f16=4, ar_max=6, rs_add=4, ar_add=8),
    ("layer", "dp8"): _c(ar_max=8, ar_add=9),
    ("layer", "fsdp8"): _c(ag_f32=4, ag_f16=8, rs_add=4, ar_max=12, ar_add=5),
    ("layer", "dp2xtp4-sp"): _c(ag_f32=4, ar_max=12, rs_add=4, ar_add=10),
    ("layer", "fsdp2xtp2xcp2"): _c(ag_f32=6, ag_f16=8, ar_max=12, rs_add=6, ar_add=14),
    # nn.scan: the layer's collectives once, in the loop body (run once per layer), plus the loss's; under FSDP the
    # backward loop gathers the two norm scales again.
    ("scan", "dp8"): _c(ar_max=8, ar_add=9),
    ("scan", "fsdp8"): _c(ag_f32=6, ag_f16=8, ar_max=12, rs_add=4, ar_add=5),
    ("scan", "dp2xtp4-sp"): _c(ag_f32=4, ar_max=12, rs_add=4, ar_add=10),
    ("scan", "fsdp2xtp2xcp2"): _c(ag_f32=8, ag_f16=8, ar_max=12, rs_add=6, ar_add=14),
}
# SwiGLU (the gated (H, 2, F) kernel, F split over the tensor axis, its parts merged into fc1's N shard by shard)
# communicates exactly as GELU's MLP.
EXPECTED.update({("swiglu", mesh): EXPECTED["mlp", mesh] for mesh in MESHES})


def _params():
  for kind in KINDS:
    for mesh_name in MESHES:
      marks = [] if kind == "dense" else [pytest.mark.slow]  # 8-device train steps: 10-40 s each on 2 cores
      yield pytest.param(kind, mesh_name, id=f"{kind}-{mesh_name}", marks=marks)


# Sharded against one device, every leaf of every step (variables after the step, gradients): float32 sums taken in
# another order (the batch's and the sequence's sums of the weight gradients split over the shards and all-reduced, the
# row-parallel GEMMs' partial sums added across the tensor shards, XLA's kernels blocked for other shapes) differ in the
# last bits (observed <= 3e-7 relative), and where such a value lands next to a rounding boundary of the next FP8 cast,
# that one element rounds to the neighbouring FP8 value (a quarter of its size in E5M2). The "layer" case shows one on
# dp2xtp4-sp and on fsdp2xtp2xcp2 alike: one element of the query/key/value gradient in E5M2 at step 1, the QKV
# kernel's gradient off by a rank-one term (one column, 2e-4 relative), and the norm's bias and scale gradients by
# 1.8e-4. A per-shard amax or a dropped collective moves whole tensors (>= 1e-2).
LEAF_RTOL = 1e-3
# The loss, a mean of B * S * hidden float32 products summed in another order: observed differences <= 5e-9.
LOSS_ATOL = 1e-7


def _check_steps(got, want):
  bitwise = total = 0
  for i, ((v, loss, g), (v_ref, loss_ref, g_ref)) in enumerate(zip(got, want, strict=True)):
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=0, atol=LOSS_ATOL, err_msg=f"step {i}: loss")
    for what, tree, ref in (("variables", v, v_ref), ("gradients", g, g_ref)):
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, jax.tree_util.keystr(path), a.shape, b.shape)
        err = rel_error(a, b)
        assert err <= LEAF_RTOL, f"step {i}, {what}{jax.tree_util.keystr(path)}: relative error {err}"
        bitwise += int(np.array_equal(a, b))
        total += 1
  histories = [h for p, h in jax.tree_util.tree_leaves_with_path(got[-1][0][te_jax.FP8_COLLECTION])
               if jax.tree_util.keystr(p).endswith("_amax_history']")]
  assert histories and all(np.count_nonzero(np.asarray(h)[..., :STEPS]) == np.asarray(h)[..., :STEPS].size
                           for h in histories)  # every history rolled at each step: the FP8 state is live
  return bitwise, total


# Row-parallel GEMMs per kind: the blocks whose output is the residual stream. Each such block (attention, MLP) has
# one column-parallel GEMM with a fused norm before it (QKV projection, fc1), whose dgrad output is the stream's
# gradient.
ROW_PARALLEL = {"dense": 0, "mlp": 1, "swiglu": 1, "mha": 1, "layer": 2, "scan": 2}
ATTENTION = {"dense": 0, "mlp": 0, "swiglu": 0, "mha": 1, "layer": 1, "scan": 1}

_GATHER = re.compile(r"= (\w+)\[([\d,]+)\]\S* all-gather(?:-start)?\(.*replica_groups=\S+ (\{\S*\}),.*"
                     r"dimensions=\{(\d+)\}")
_SCATTER = re.compile(r"= (\w+)\[([\d,]+)\]\S* reduce-scatter\(.*replica_groups=\S+ (\{\S*\}),.*"
                      r"dimensions=\{(\d+)\}")
_ALL_REDUCE = re.compile(r"= (\w+)\[([\d,]+)\]\S* all-reduce(?:-start)?\(.*replica_groups=\S+ (\{\S*\})")


def _check_layout(kind, mesh_name, spmd):
  """What the layout requires, whatever the counts, in the partitioned program: no all-gather of activations under
  dp8 and fsdp8 (only parameters: every FSDP kernel in FP8, E4M3 bytes (its scale is replicated), the 1-D norm
  parameters and biases in f32); under sequence parallelism only (batch shard, S, hidden) activations, in f32, each
  row-parallel GEMM ending in one reduce-scatter over the tensor axis onto the stream's (batch shard, sequence shard,
  hidden) blocks and each fused-norm column-parallel GEMM's input gradient reduce-scattered onto them too, no
  activation all-reduced in either pass (only scalars in the forward: amaxes and the loss); under context
  parallelism no activation gathered but the attention's K and V over cp, the only reductions of activations their
  gradients' reduce-scatters over cp and the tensor-parallel sums of (batch shard, sequence shard, hidden) blocks
  over the tensor axis."""
  gathers = [m.groups()[:2] for m in re.finditer(r"= (\w+)\[([\d,]+)\]\S* all-gather(?:-start)?\(", spmd)]
  if mesh_name == "dp8":
    assert not gathers, gathers
  elif mesh_name == "fsdp8":
    kernels = [dtype for dtype, shape in gathers if "," in shape]
    assert kernels and all(dtype == "f8e4m3fn" for dtype in kernels), gathers
    assert all(dtype == "f32" for dtype, shape in gathers if "," not in shape), gathers
  elif mesh_name == "dp2xtp4-sp":
    assert gathers and all((dtype, shape) == ("f32", f"{B // 2},{S},{HIDDEN}") for dtype, shape in gathers), gathers
    scatters = _SCATTER.findall(spmd)
    stream_block = ("f32", f"{B // 2},{S // 4},{HIDDEN}", "{'tensor'}", "1")
    assert scatters == [stream_block] * (2 * ROW_PARALLEL[kind]), scatters
    forward_sums = [line for line in spmd.splitlines() if re.search(r"= f32\[\d[\d,]*\]\S* all-reduce\(", line)
                    and "transpose(" not in line]
    assert not forward_sums, forward_sums
    activation_sums = re.findall(rf"= f32\[{B // 2},{S}[\d,]*\]\S* all-reduce\(", spmd)
    assert not activation_sums, activation_sums
  else:
    kv_shape = f"{B // 2},{S},{HEADS // 2},{HIDDEN // HEADS}"  # one batch and head shard of the whole K or V
    kv = [g for g in _GATHER.findall(spmd) if g[1] == kv_shape]
    assert kv == [("f32", kv_shape, "{'cp'}", "1")] * (2 * ATTENTION[kind]), gathers
    others = [(dtype, shape) for dtype, shape in gathers if shape != kv_shape]  # the parameters
    assert all(dtype == "f8e4m3fn" if "," in shape else dtype == "f32" for dtype, shape in others), gathers
    kv_grads = ("f32", f"{B // 2},{S // 2},{HEADS // 2},{HIDDEN // HEADS}", "{'cp'}", "1")
    scatters = _SCATTER.findall(spmd)
    assert scatters.count(kv_grads) == 2 * ATTENTION[kind], scatters
    assert all(g == kv_grads or g[2] == "{'fsdp'}" for g in scatters), scatters  # else: the kernel gradients'
    activations = [g for g in _ALL_REDUCE.findall(spmd) if g[1].startswith(f"{B // 2},")]
    assert activations == [("f32", f"{B // 2},{S // 2},{HIDDEN}", "{'tensor'}")] * (2 * ROW_PARALLEL[kind]), \
        activations


@pytest.mark.parametrize("kind,mesh_name", list(_params()))
@pytest.mark.fast_cases(2)
def test_sharded_steps_match_one_device(kind, mesh_name, tmp_path):
  got, want, hlo, spmd = run_case(kind, mesh_name, tmp_path)
  _check_layout(kind, mesh_name, spmd)
  _check_steps(got, want)
  assert collectives(hlo) == EXPECTED[kind, mesh_name], dict(collectives(hlo))


# ---- the rule table ------------------------------------------------------------------------------------------------


def test_logical_axis_rules_table():
  rules = te_flax.logical_axis_rules(data="data", fsdp="fsdp", tensor="tensor", sequence_parallel=True)
  assert sorted(name for name, _ in rules) == sorted(te_flax.LOGICAL_AXES)  # one rule per logical name
  assert dict(rules) == {"batch": ("data", "fsdp"), "seq": "tensor", "act_embed": None, "embed": "fsdp",
                         "heads": "tensor", "kv": None, "qkv": None, "mlp": "tensor", "act": None, "expert": None}
  assert dict(te_flax.logical_axis_rules())["batch"] is None  # nothing sharded: every name replicated
  assert dict(te_flax.logical_axis_rules(tensor="t"))["seq"] is None  # no sequence parallelism unless asked
  assert dict(te_flax.logical_axis_rules(context="cp"))["seq"] == "cp"
  assert dict(te_flax.logical_axis_rules(data=("replica", "data")))["batch"] == ("replica", "data")
  # MaxText-style: a plain list, usable as nn.logical_axis_rules with a model's own names appended
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "tensor"))
  table = te_flax.logical_axis_rules(data="data", tensor="tensor") + [("vocab", "tensor")]
  assert nn.logical_to_mesh_sharding(P("embed", "vocab"), mesh, table).spec == P(None, "tensor")


@pytest.mark.parametrize("kwargs,match", [
    (dict(data="x", fsdp="x"), "one kind of parallelism"),
    (dict(tensor="t", context="t"), "one kind of parallelism"),
    (dict(sequence_parallel=True), "give tensor="),
    (dict(tensor="t", context="c", sequence_parallel=True), "give one of them"),
    (dict(fsdp=""), "non-empty strings"),
    (dict(data=("a", 3)), "non-empty strings"),
])
def test_logical_axis_rules_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    te_flax.logical_axis_rules(**kwargs)


def test_layernorm_mlp_logical_axes():
  mlp = te_flax.LayerNormMLP(intermediate_dim=32, activation_type=("silu", "linear"), logical_axes=True)
  specs = nn.get_partition_spec(mlp.init(jax.random.key(0), jnp.ones((2, 4, 16))))["params"]
  assert specs == {"ln_scale": P("embed"), "ln_bias": P("embed"), "wi_kernel": P("embed", "act", "mlp"),
                   "wi_bias": P("act", "mlp"), "wo_kernel": P("mlp", "embed"), "wo_bias": P("embed")}
  both = te_flax.LayerNormMLP(intermediate_dim=32, logical_axes=True, wo_kernel_axes=("mlp", None))
  with pytest.raises(ValueError, match="wo_kernel_axes"):
    both.init(jax.random.key(0), jnp.ones((2, 4, 16)))


@pytest.mark.parametrize("recipe,ln_out", [(te_jax.recipe.Float8CurrentScaling(), False), (RECIPE, True)],
                         ids=["current", "layernorm-output"])
def test_gated_mlp_keeps_fc1_split(recipe, ln_out):
  """SwiGLU under tensor parallelism on its other paths (current scaling; the norm's output returned, which runs the
  layer as its parts): the same values and gradients as on one device, and no all-gather of a kernel or of fc1's
  (rows, 2, F) output or gradient (only the sequence-parallel stream's gathers)."""
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "tensor"))
  rules = te_flax.logical_axis_rules(data="data", tensor="tensor")
  mlp = te_flax.LayerNormMLP(intermediate_dim=128, activation_type=("silu", "linear"), dtype=jnp.float32,
                             logical_axes=True, return_layernorm_output=ln_out)
  x = jax.random.normal(jax.random.key(1), (B, S, HIDDEN))

  def loss(v, x):
    y = mlp.apply(v, x, deterministic=True, mutable=[te_jax.FP8_COLLECTION])[0]
    return sum(jnp.sum(jnp.sin(a)) for a in jax.tree.leaves(y))

  with te_jax.autocast(enabled=True, recipe=recipe):
    boxed = mlp.init(jax.random.key(0), x)
    v = nn.meta.unbox(boxed)
    step = jax.value_and_grad(loss)
    want = jax.jit(step)(v, x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
      vs = jax.device_put(v, shardings)
      xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
      sharded = jax.jit(step)
      got = sharded(vs, xs)
      hlo = sharded.lower(vs, xs).compile().as_text()
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
    assert rel_error(np.asarray(a), np.asarray(b)) <= LEAF_RTOL
  gathers = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather(?:-start)?\(", hlo)
  assert not [g for g in gathers if g.endswith(",2,128") or g.startswith("2,128")], gathers
