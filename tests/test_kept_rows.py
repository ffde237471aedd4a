"""Rows kept as (B, S) on 8 CPU devices (forced in conftest.py): ``gemm``'s ``keep_rows`` and ``contract_dims``, the
fused layers' ``keep_rows`` and ``grad_sharding``, and the norm backward on its gradient's rows.

A residual stream sharded over two mesh axes at once, batch over one and sequence over another (context parallelism;
under sequence parallelism, the stream's gradient), is no sharding of the merged (B * S) rows of a 2-D GEMM: folding
them makes XLA all-gather the sequence. Kept as two dims they stay where they are. Each case checks the compiled
program's collectives, the output's sharding and the values against the unsharded computation; on one device the
options change nothing, bit for bit.
"""

import collections
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
from conftest import F32_U
from te_jax._core import native
from te_jax.ops.gemm import gemm
from te_jax.ops.norm import norm_bwd, norm_fwd
from te_jax.recipe import DelayedScaling

DEVICES = jax.devices("cpu")
B, S, K, N = 4, 16, 64, 32
_COLLECTIVE = re.compile(r"= (\w+\[[\d,]*\])\S* (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
                         r"(?:-start)?\(")


def _mesh(shape, names):
  return Mesh(np.array(DEVICES[:8]).reshape(shape), names)


def _collectives(hlo: str) -> collections.Counter:
  """(kind, result type) of each collective of a compiled program: the type says what moved (a kernel shard, an
  activation block)."""
  return collections.Counter((kind, ty) for ty, kind in _COLLECTIVE.findall(hlo))


def _normal(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _bound(a2d, b2d):
  """Twice gamma_K * sum_k |a b|: any two float32 summation orders of the same K products are within it (Higham,
  eq. 4.4), as test_gemm.py's sharding tests bound them."""
  k = a2d.shape[1]
  return 2 * (k - 1) * F32_U / (1 - (k - 1) * F32_U) * (np.abs(a2d).astype(np.float64) @ np.abs(b2d).T)


def _run(f, args, out_sharding):
  compiled = jax.jit(f, out_shardings=out_sharding).lower(*args).compile()
  return compiled(*args), _collectives(compiled.as_text())


# ---- gemm ----------------------------------------------------------------------------------------------------------

CP = (("fsdp", "tensor", "cp"), (2, 2, 2))


def test_kept_rows_stay_sharded_over_two_axes():
  """Column parallel on a context-parallel stream: lhs (B, S, K) with B over fsdp and S over cp, the kernel's N over
  tensor and its K over fsdp (FSDP). The rows stay where they are, the kernel is gathered over fsdp (as for a 2-D
  lhs); folded into M the rows would be all-gathered over cp first."""
  mesh = _mesh(CP[1], CP[0])
  x, w = _normal((B, S, K), 0), _normal((N, K), 1)
  args = (jax.device_put(x, NamedSharding(mesh, P("fsdp", "cp"))), jax.device_put(w, NamedSharding(mesh, P("tensor",
                                                                                                         "fsdp"))))
  out, found = _run(lambda a, b: gemm(a, b, dtype=jnp.float32, keep_rows=True), args, None)
  assert found == collections.Counter({("all-gather", f"f32[{N // 2},{K}]"): 1}), found  # the kernel's N shard
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "cp", "tensor")), 3), out.sharding
  want = x.reshape(-1, K).astype(np.float64) @ w.T.astype(np.float64)
  assert np.all(np.abs(np.asarray(out).reshape(-1, N) - want) <= _bound(x.reshape(-1, K), w))
  _, folded = _run(lambda a, b: gemm(a, b, dtype=jnp.float32), args, None)
  assert ("all-gather", f"f32[{B // 2},{S},{K}]") in folded, folded  # the sequence gathered: what keep_rows avoids


def test_weight_gradient_contracts_two_sharded_dims():
  """A weight gradient from kept rows: (K, B, S) and (N, B, S), B over fsdp and S over cp, contracted together
  (contract_dims=2), the gradient wanted as its kernel is sharded (K over fsdp, N over tensor): one all-reduce over cp,
  then one reduce-scatter over fsdp onto K."""
  mesh = _mesh(CP[1], CP[0])
  xt, gt = _normal((K, B, S), 2), _normal((N, B, S), 3)
  args = (jax.device_put(xt, NamedSharding(mesh, P(None, "fsdp", "cp"))),
          jax.device_put(gt, NamedSharding(mesh, P("tensor", "fsdp", "cp"))))
  out, found = _run(lambda a, b: gemm(a, b, dtype=jnp.float32, contract_dims=2), args,
                    NamedSharding(mesh, P("fsdp", "tensor")))
  # summed over cp whole, then reduce-scattered over fsdp onto its K
  assert found == collections.Counter({("all-reduce", f"f32[{K},{N // 2}]"): 1,
                                       ("reduce-scatter", f"f32[{K // 2},{N // 2}]"): 1}), found
  a, b = xt.reshape(K, -1), gt.reshape(N, -1)
  assert np.all(np.abs(np.asarray(out) - a.astype(np.float64) @ b.T.astype(np.float64)) <= _bound(a, b))


@pytest.mark.parametrize("mesh_case", ["sequence-parallel", "context-parallel"])
def test_kept_rows_scatter_onto_the_stream(mesh_case):
  """Row parallel (K over tensor) with the output's rows taken from its consumer (scatter_rows) and lhs's rows kept:
  onto a sequence-parallel stream one reduce-scatter over tensor; onto a context-parallel one (S over cp, whole over
  tensor) one all-reduce over tensor, lhs's S staying on cp. The residual goes on once, after the reduction."""
  if mesh_case == "sequence-parallel":
    mesh, lhs, stream, want = _mesh((2, 4), ("data", "tensor")), P("data", None, "tensor"), P("data", "tensor"), \
        {("reduce-scatter", f"f32[{B // 2},{S // 4},{N}]"): 1}
  else:
    mesh, lhs, stream, want = _mesh(CP[1], CP[0]), P("fsdp", "cp", "tensor"), P("fsdp", "cp"), \
        {("all-reduce", f"f32[{B // 2},{S // 2},{N}]"): 1}
  x, w, r = _normal((B, S, K), 4), _normal((N, K), 5), np.full((B, S, N), 1000.0, np.float32)
  args = (jax.device_put(x, NamedSharding(mesh, lhs)), jax.device_put(w, NamedSharding(mesh, P(None, "tensor"))),
          jax.device_put(r, NamedSharding(mesh, stream)))
  out, found = _run(lambda a, b, r: gemm(a, b, residual=r, dtype=jnp.float32, keep_rows=True, scatter_rows=True),
                    args, NamedSharding(mesh, stream))
  assert found == collections.Counter(want), found
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, stream), 3), out.sharding
  exact = x.reshape(-1, K).astype(np.float64) @ w.T.astype(np.float64)
  err = np.abs(np.asarray(out).reshape(-1, N) - 1000.0 - exact)
  assert np.all(err <= _bound(x.reshape(-1, K), w) + 2 * 1000.0 * F32_U)


def test_kept_rows_unsharded_are_the_gemm():
  """On one device keep_rows and contract_dims are reshapes: the folded GEMM's values, bit for bit, FP8 included."""
  x, w = _normal((B, S, K), 6), _normal((N, K), 7)
  one = jax.jit(lambda a, b: gemm(a, b, dtype=jnp.float32))
  np.testing.assert_array_equal(jax.jit(lambda a, b: gemm(a, b, dtype=jnp.float32, keep_rows=True))(x, w),
                                one(x, w))
  q = lambda v: te_jax.ops.quantize.quantize(v, jnp.float32(1.0), jnp.float8_e4m3fn).out.data  # noqa: E731
  xt, gt = q(_normal((K, B, S), 8)), q(_normal((N, B, S), 9))
  s = jnp.float32(0.5)
  two = gemm(te_jax.QuantizedTensor(xt, s), te_jax.QuantizedTensor(gt, s), dtype=jnp.float32, contract_dims=2)
  np.testing.assert_array_equal(two, gemm(te_jax.QuantizedTensor(xt.reshape(K, -1), s),
                                          te_jax.QuantizedTensor(gt.reshape(N, -1), s), dtype=jnp.float32))


# (gemm call, its operands, the operand and result types the cuBLASLt handler is called with)
CUDA_LOWERINGS = {
    "keep-rows": (dict(keep_rows=True), ((B, S, K), (N, K)), (f"{B * S}x{K}", f"{N}x{K}"), f"{B * S}x{N}"),
    "contract-dims": (dict(contract_dims=2), ((K, B, S), (N, B, S)), (f"{K}x{B * S}", f"{N}x{B * S}"), f"{K}x{N}"),
    "keep-rows-parts": (dict(keep_rows=True, rhs_parts=True), ((B, S, K), (3, N, K)), (f"{B * S}x{K}", f"3x{N}x{K}"),
                        f"{B * S}x{N}"),
}


@pytest.mark.parametrize("case", CUDA_LOWERINGS)
def test_cuda_handler_reads_2d_operands(case, monkeypatch):
  """The CUDA handler is 2-D: lowered for the GPU (here, without one, the handler taken as registered), kept rows and
  several contracted dims reach it reshaped to (M, K) and (N, K) (the same bytes), its (M, N) output reshaped back."""
  kwargs, shapes, handler_in, handler_out = CUDA_LOWERINGS[case]
  monkeypatch.setitem(native.registered, "cuda", [*native.registered.get("cuda", ()), "te_gemm_cuda"])
  monkeypatch.setitem(native.modules, "cuda", types.SimpleNamespace(gemm_workspace=lambda *a: (256, np.uint8)))
  one = jnp.float32(1.0)

  def f(a, b):
    return gemm(te_jax.QuantizedTensor(a, one), te_jax.QuantizedTensor(b, one), dtype=jnp.bfloat16, **kwargs)

  args = [jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn) for shape in shapes]
  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  (call,) = [line for line in text.splitlines() if "custom_call @te_gemm_cuda" in line]
  operands, results = re.search(r": \((.*)\) -> \((.*)\)$", call).groups()
  assert re.findall(r"tensor<([\dx]+)xf8E4M3FN>", operands) == list(handler_in), call
  assert set(re.findall(r"tensor<([\dx]+)xbf16>", results)) == {handler_out}, call  # (each part's)


@pytest.mark.parametrize("kwargs,match", [
    (dict(contract_dims=0), "contract_dims must be a positive int"),
    (dict(contract_dims=2, transpose_lhs=True), "untransposed operands"),
    (dict(keep_rows=True, transpose_rhs=True), "untransposed operands"),
    (dict(contract_dims=3), r"contract_dims=3 needs lhs of rank >= 4"),
])
def test_argument_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    gemm(jnp.ones((B, S, K)), jnp.ones((N, S, K)), dtype=jnp.float32, **kwargs)


def test_contracted_dims_must_match():
  with pytest.raises(ValueError, match="contracting dims differ"):
    gemm(jnp.ones((K, B, S)), jnp.ones((N, S, B)), dtype=jnp.float32, contract_dims=2)


# ---- the norm's backward -------------------------------------------------------------------------------------------


def test_norm_backward_runs_on_the_gradients_rows():
  """The saved input gathered over the sequence (a sequence-parallel layer's), the output gradient on the sequence
  shards (a fused layer's grad_sharding): the backward runs on those shards, x and the statistics sliced locally, and
  dx stays there; the parameter gradients are summed over both axes. Rows taken from x would all-gather dz."""
  mesh = _mesh((2, 4), ("data", "tensor"))
  x, dz = _normal((B, S, K), 10), _normal((B, S, K), 11)
  gamma, beta = 1 + 0.1 * _normal((K,), 12), 0.1 * _normal((K,), 13)
  fwd = norm_fwd(x, gamma, beta)
  gathered, stream = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", "tensor"))
  args = (jax.device_put(dz, stream), *(jax.device_put(a, gathered) for a in (x, fwd.mean, fwd.rsigma)), gamma)
  out, found = _run(lambda dz, x, mean, rsigma, g: norm_bwd(dz, x, mean, rsigma, g), args, None)
  assert out[0].sharding.is_equivalent_to(stream, 3), out[0].sharding
  assert set(found) <= {("all-reduce", f"f32[{K}]"), ("all-reduce", f"(f32[{K}], f32[{K}])")}, found  # dgamma, dbeta
  ref = norm_bwd(dz, x, fwd.mean, fwd.rsigma, gamma)
  np.testing.assert_array_equal(out[0], ref[0])  # row-wise: the same rows computed the same way
  for got, want in zip(out[1:], ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # sums over (B, S) in another order


# ---- the fused layers ----------------------------------------------------------------------------------------------


def _layer_steps(fn, args, metas):
  """Two DelayedScaling steps of sum(fn(...)^2): the loss and every gradient (the state's update included)."""
  def loss(*a):
    return jnp.sum(fn(*a).astype(jnp.float32) ** 2)
  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args) + len(metas)))))
  out = []
  for _ in range(2):
    value, grads = grad(*args, *metas)
    out.append((value, grads))
    metas = grads[len(args):]
  return out


LAYERS = {
    "layernorm_mlp": (lambda x, g, b, k1, k2, m1, m2, **kw: te_jax.layernorm_mlp(
        x, g, b, k1, k2, residual=x, fp8_meta_1=m1, fp8_meta_2=m2, **kw), 2),
    "layernorm_dense": (lambda x, g, b, k1, k2, m1, **kw: te_jax.layernorm_dense(
        x, g, b, k1[:, 0].reshape(K, 2, N), unstack_axis=-2, fp8_meta=m1, **kw)[1], 1),  # one part: the unstacking
    "dense": (lambda x, g, b, k1, k2, m1, **kw: te_jax.dense(x, k1[:, 0], residual=x[..., :2 * N], fp8_meta=m1,
                                                           **kw), 1),
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.fast_cases(1)
def test_layer_options_unsharded_are_the_layer(layer):
  """keep_rows and grad_sharding (and fc2's scatter_rows) on one device: the plain layer's loss, gradients and FP8
  state updates, bit for bit, over two DelayedScaling steps."""
  fn, n_metas = LAYERS[layer]
  x = jnp.asarray(_normal((B, S, K), 14))
  args = (x, 1 + 0.1 * _normal((K,), 15), 0.1 * _normal((K,), 16), _normal((K, 1, 2 * N), 17) / 8,
          _normal((2 * N, K), 18) / 8)
  metas = tuple(te_jax.DenseFp8Meta.create(4) for _ in range(n_metas))
  options = dict(keep_rows=True) if layer == "dense" else dict(keep_rows=True, grad_sharding=P())
  if layer == "layernorm_mlp":
    options["scatter_rows"] = True
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    plain = _layer_steps(fn, args, metas)
    with jax.set_mesh(Mesh(np.array(DEVICES[:1]), ("x",))):
      kept = _layer_steps(lambda *a: fn(*a, **options), args, metas)
      if layer != "dense":
        grad_only = _layer_steps(lambda *a: fn(*a, grad_sharding=P()), args, metas)
        for (v, g), (v_ref, g_ref) in zip(grad_only, plain, strict=True):
          jax.tree.map(np.testing.assert_array_equal, (v, g), (v_ref, g_ref))
  for (v, g), (v_ref, g_ref) in zip(kept, plain, strict=True):
    jax.tree.map(np.testing.assert_array_equal, (v, g), (v_ref, g_ref))


@pytest.mark.parametrize("call,match", [
    (lambda x: te_jax.layernorm_dense(x[0], jnp.ones(K), jnp.zeros(K), jnp.ones((K, N)), keep_rows=True),
     r"keep_rows and grad_sharding need x of shape \(B, S, H\)"),
    (lambda x: te_jax.layernorm_dense(x, jnp.ones(K), jnp.zeros(K), jnp.ones((K, N)), grad_sharding="data"),
     "grad_sharding must be a jax.sharding.PartitionSpec"),
    (lambda x: te_jax.layernorm_mlp(x[0], jnp.ones(K), jnp.zeros(K), jnp.ones((K, 1, N)), jnp.ones((N, K)),
                                    grad_sharding=P()), r"need x of shape \(B, S, H\)"),
    (lambda x: te_jax.dense(x[0], jnp.ones((K, N)), keep_rows=True), r"keep_rows needs two non-contracted dims"),
])
def test_layer_argument_errors(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call(jnp.ones((B, S, K)))
