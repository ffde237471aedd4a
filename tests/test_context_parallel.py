"""Context-parallel attention (``te_jax.context_parallel_attention``) on 8 CPU devices (forced in conftest.py).

The sequence is sharded over the "cp" mesh axis (2, 4 or 8 devices; with the batch over "dp" too), in zig-zag order
for the load-balanced cases: the output and the gradients of q, k and v, put back in the natural order, equal those
of ``te_jax.dot_product_attention`` on the whole sequence on one device. Tolerance: the largest absolute error of
each tensor within 1e-5 times its largest element (float32: the blocks' log-sum-exp merge and the block-wise sums of
the backward reorder float32 sums; over all 64 cases the largest measured is 4.6e-7 of it, in dv). The compiled programs hold exactly the collectives of the
strategy, over the "cp" axis only: collective-permutes of K/V (and dK/dV, key segment ids) for the ring, all-gathers
of K/V (and key segment ids) and reduce-scatters of dK/dV for all_gather; never a collective of Q.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_normal
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import te_jax
import te_jax.flax as te_flax
import te_jax.nnx as te_nnx
from te_jax.recipe import DelayedScaling

B, T, H, HK, D = 2, 32, 4, 2, 8  # GQA: the K/V head count (2) tells a gathered K/V from a gathered Q (4 heads)
TOL = 1e-5


def _mesh(dp: int, cp: int) -> Mesh:
  return Mesh(np.array(jax.devices("cpu")[:dp * cp]).reshape(dp, cp), ("dp", "cp"))


def _segment_ids(seed: int) -> np.ndarray:
  """Packed rows: 1-4 segments of random lengths, then padding (0), the last row all one segment."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(B - 1):
    cuts = np.sort(rng.choice(np.arange(1, T), size=rng.integers(1, 5), replace=False))
    ids = np.searchsorted(cuts, np.arange(T), side="right") + 1
    ids[ids == ids.max()] = 0  # the last piece is padding
    rows.append(ids)
  rows.append(np.ones(T, np.int64))
  return np.stack(rows).astype(np.int32)


# ---- reading the compiled program's collectives --------------------------------------------------------------------

_COLLECTIVE = re.compile(r"= (\([^)]*\)|\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")


def _groups(line: str) -> list[set[int]]:
  """The device groups of one collective (source/target pairs for a permute)."""
  if m := re.search(r"source_target_pairs=\{(.*?)\}\}", line):
    return [set(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)", m.group(1) + "}")]
  if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
    shape, dims = [int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")]
    ids = np.arange(np.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return [set(g) for g in ids.reshape(shape).tolist()]
  if m := re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line):
    return [set(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
  raise AssertionError(f"unread device groups: {line[:300]}")


def _collectives(hlo: str, mesh: Mesh, within_cp: bool = True) -> list[tuple[str, str]]:
  """(kind, result type) of every collective; with ``within_cp``, asserts that each runs within the "cp" groups of
  ``mesh``."""
  cp_groups = [set(row) for row in np.arange(mesh.size).reshape(mesh.devices.shape).tolist()]
  found = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    found.append((m.group(2), m.group(1)))
    if not within_cp:
      continue
    axes = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
    if axes:  # the mesh form names its axes
      assert axes.group(1).replace("'", "").split(",") == ["cp"], line[:300]
    else:
      for group in _groups(line):
        assert any(group <= g for g in cp_groups), f"a collective across the cp groups: {line[:300]}"
  return found


def _check_collectives(hlo: str, mesh: Mesh, strategy: str, grad: bool):
  found = _collectives(hlo, mesh)
  kinds = {kind for kind, _ in found}
  if strategy == "all_to_all":  # Q, K, V and the output (dO, dQ, dK, dV): all-to-alls; the segment ids gathered
    assert "all-to-all" in kinds and kinds <= {"all-to-all", "all-gather"}, found
    assert all(len(re.search(r"\[([\d,]*)\]", r).group(1).split(",")) == 2 for k, r in found if k == "all-gather"), found
    return
  if strategy == "ring":
    assert kinds == {"collective-permute"}, found
  else:
    assert kinds == ({"all-gather", "reduce-scatter"} if grad else {"all-gather"}), found
  local_b, local_t = B // mesh.shape["dp"], T // mesh.shape["cp"]
  for kind, result in found:  # K/V blocks (Hk heads), key segment ids (2-D), dK/dV: never Q (H heads)
    dims = [int(x) for x in re.search(r"\[([\d,]*)\]", result).group(1).split(",")]
    assert dims[0] == local_b and (len(dims) == 2 or dims[2] == HK), (kind, result)
    if kind != "all-gather":
      assert dims[1] == local_t, (kind, result)


# ---- the function ------------------------------------------------------------------------------------------------


def _inputs(mask_type: str):
  q = random_normal(0, (B, T, H, D))
  k = random_normal(1, (B, T, HK, D))
  v = random_normal(2, (B, T, HK, D))
  w = random_normal(3, (B, T, H, D))  # the loss's weights: sum(out * w)
  ids = jnp.asarray(_segment_ids(4)) if mask_type.startswith("padding") else None
  return q, k, v, w, ids


def _reference(q, k, v, w, ids, mask_type):
  def loss(q, k, v):
    out = te_jax.dot_product_attention(q, k, v, segment_ids=ids, attn_mask_type=mask_type, backend="unfused")
    return jnp.sum(out * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def _assert_close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  err, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
  assert err <= TOL * scale, f"{what}: max error {err:.3g} > {TOL} * {scale:.3g}"


def check_against_unsharded(dp, cp, strategy, load_balanced, mask_type):
  mesh = _mesh(dp, cp)
  q, k, v, w, ids = _inputs(mask_type)
  want_out, want_grads = _reference(q, k, v, w, ids, mask_type)
  zigzag = load_balanced and "causal" in mask_type
  order = (lambda x: te_jax.to_zigzag(x, cp)) if zigzag else (lambda x: x)
  natural = (lambda x: te_jax.from_zigzag(x, cp)) if zigzag else (lambda x: x)
  sharding = NamedSharding(mesh, P("dp", "cp"))
  qs, ks, vs, ws = (jax.device_put(order(x), sharding) for x in (q, k, v, w))
  ids_s = None if ids is None else jax.device_put(order(ids), sharding)

  def attend(q, k, v, ids):
    return te_jax.context_parallel_attention(q, k, v, axis="cp", mesh=mesh, strategy=strategy,
                                             load_balanced=load_balanced, attn_mask_type=mask_type, segment_ids=ids)

  def step(q, k, v, ids, w):  # the gradients of sum(out * w), without the loss's own all-reduce
    out, pull = jax.vjp(lambda q, k, v: attend(q, k, v, ids), q, k, v)
    return out, pull(w)

  step = jax.jit(step).lower(qs, ks, vs, ids_s, ws).compile()
  _check_collectives(step.as_text(), mesh, strategy, grad=True)
  forward = jax.jit(attend).lower(qs, ks, vs, ids_s).compile()
  _check_collectives(forward.as_text(), mesh, strategy, grad=False)

  out, grads = step(qs, ks, vs, ids_s, ws)
  assert out.sharding.is_equivalent_to(sharding, 4), out.sharding
  _assert_close(natural(out), want_out, "out")
  _assert_close(natural(forward(qs, ks, vs, ids_s)), want_out, "out (forward only)")
  for name, g, want in zip("qkv", grads, want_grads, strict=True):
    _assert_close(natural(g), want, f"d{name}")


FAST = [(1, 4, "ring", True, "padding_causal"), (1, 4, "ring", False, "causal"), (2, 4, "ring", True, "causal"),
        (2, 4, "all_gather", True, "padding_causal"), (1, 2, "all_gather", False, "no_mask"),
        (2, 4, "all_to_all", True, "padding_causal")]
# all_to_all splits the H = 4 query heads over the devices: up to cp = 4 (the 2 K/V heads repeated onto 4)
ALL = [(dp, cp, strategy, lb, mask) for dp, cp in ((1, 2), (1, 4), (1, 8), (2, 4))
       for strategy in ("all_gather", "ring", "all_to_all") if not (strategy == "all_to_all" and cp > H)
       for lb in (True, False) for mask in ("causal", "no_mask", "padding_causal", "padding")]
CASES = FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in ALL if c not in FAST]


@pytest.mark.parametrize("dp,cp,strategy,load_balanced,mask_type", CASES,
                         ids=lambda v: str(v) if not isinstance(v, bool) else ("lb" if v else "contiguous"))
@pytest.mark.fast_cases(2)
def test_matches_unsharded_attention(dp, cp, strategy, load_balanced, mask_type):
  check_against_unsharded(dp, cp, strategy, load_balanced, mask_type)


def test_zigzag_order():
  order = te_jax.zigzag_order(16, 4)
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
  np.testing.assert_array_equal(te_jax.to_zigzag(x, 4), x[:, order])
  np.testing.assert_array_equal(te_jax.from_zigzag(te_jax.to_zigzag(x, 4), 4), x)
  np.testing.assert_array_equal(te_jax.to_zigzag(x.swapaxes(1, 2), 4, axis=-1), x[:, order].swapaxes(1, 2))
  # each device's two chunks together cover as many causal (query, key) pairs as any other's
  work = [sum(p + 1 for p in shard) for shard in order.reshape(4, 4)]
  assert len(set(work)) == 1, work
  with pytest.raises(ValueError, match="2 \\* cp = 8"):
    te_jax.zigzag_order(12, 4)


BAD = [
    (dict(axis="model"), "'model' is not an axis of the mesh"),
    (dict(strategy="tree"), "strategy must be one of"),
    (dict(attn_mask_type="arbitrary"), "attn_mask_type='arbitrary' is not supported"),
    (dict(attn_mask_type="causal_bottom_right"), "attn_mask_type='causal_bottom_right' is not supported"),
    (dict(attn_mask_type="padding"), "attn_mask_type='padding' needs segment_ids"),
    (dict(attn_mask_type="padding", mask=jnp.ones((B, 1, 1, T), bool)), "mask: context parallel attention"),
    (dict(dropout_rate=0.1), "dropout_rate=0.1"),
    (dict(qkv_layout="SBHD"), "qkv_layout='SBHD'"),
    (dict(strategy="ring", backend="fused"), "backend='fused' with strategy='ring'"),
    (dict(batch_axes="dp", mesh_shape=(1, 4)), None),  # fine: a dp axis of size 1
    (dict(batch_axes="tp"), "batch_axes=\\('tp',\\)"),
    (dict(head_axes="cp"), "includes the context-parallel axis"),
    (dict(seq=12), "multiples of 2 \\* cp = 8"),
    (dict(strategy="all_to_all", mesh_shape=(1, 8)), "4 query heads per device are not a multiple of 8"),
]


@pytest.mark.parametrize("overrides,match", BAD, ids=[str(m) for _, m in BAD])
def test_arguments_are_checked(overrides, match):
  overrides = dict(overrides)
  mesh = _mesh(*overrides.pop("mesh_shape", (2, 4)))
  seq = overrides.pop("seq", T)
  x = jnp.zeros((B, seq, H, D))
  kw = dict(axis="cp", mesh=mesh, attn_mask_type="causal") | overrides
  if match is None:
    assert te_jax.context_parallel_attention(x, x, x, **kw).shape == x.shape
    return
  with pytest.raises(ValueError, match=match):
    te_jax.context_parallel_attention(x, x, x, **kw)


def test_mesh_from_context():
  mesh = _mesh(2, 4)
  x = random_normal(5, (B, T, H, D))
  with pytest.raises(ValueError, match="needs a mesh"):
    te_jax.context_parallel_attention(x, x, x, axis="cp")
  with jax.set_mesh(mesh):
    out = jax.jit(lambda x: te_jax.context_parallel_attention(x, x, x, axis="cp", attn_mask_type="no_mask"))(x)
  _assert_close(out, te_jax.dot_product_attention(x, x, x), "out")


# ---- the modules -----------------------------------------------------------------------------------------------


def _fp8_steps(layer, variables, x, positions, segment_ids, steps: int):
  """``steps`` SGD steps on mean(y^2) under DelayedScaling, the FP8 state overwritten by its update; returns each
  step's output and gradients, the last variables and the compiled step's HLO."""

  def step(v, x):
    def loss(v):
      y = layer.apply(v, x, segment_ids=segment_ids, positions=positions, deterministic=True)
      return jnp.mean(y * y), y
    (_, y), g = jax.value_and_grad(loss, has_aux=True)(v)
    new = {"params": jax.tree.map(lambda p, d: p - 0.1 * d, v["params"], g["params"]),
           te_jax.FP8_COLLECTION: g[te_jax.FP8_COLLECTION]}
    return y, g, new

  compiled = jax.jit(step).lower(variables, x).compile()
  history = []
  for _ in range(steps):
    y, g, variables = compiled(variables, x)
    history.append((y, g))
  return history, variables, compiled.as_text()


@pytest.mark.slow  # ~8 s on 2 cores; the quick run keeps the context-parallel layers of test_examples' LM
@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_transformer_layer_dp2_cp4_matches_unsharded(strategy):
  """A decoder TransformerLayer (GQA, RoPE, packed sequences) with context_parallel="cp" on a dp2 x cp4 mesh, inputs,
  segment ids and RoPE positions in zig-zag order: two FP8 (DelayedScaling) train steps give the unsharded layer's
  outputs, gradients and FP8 state."""
  mesh = _mesh(2, 4)
  kw = dict(hidden_size=32, intermediate_dim=64, num_attention_heads=4, num_gqa_groups=2, layer_type="decoder",
            self_attn_mask_type="padding_causal", enable_rotary_pos_emb=True, dtype=jnp.float32, backend="unfused")
  x = random_normal(6, (B, T, 32))
  ids = jnp.asarray(_segment_ids(7))
  plain = te_flax.TransformerLayer(**kw)
  sharded = te_flax.TransformerLayer(**kw, context_parallel="cp", cp_strategy=strategy)
  with te_jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
    variables = plain.init(jax.random.key(0), x, segment_ids=ids, deterministic=True)
    want, want_state, _ = _fp8_steps(plain, variables, x, None, ids, steps=2)
    order = te_jax.zigzag_order(T, 4)
    with jax.set_mesh(mesh):
      xs, ids_s = (jax.device_put(te_jax.to_zigzag(a, 4), NamedSharding(mesh, P("dp", "cp"))) for a in (x, ids))
      got, got_state, hlo = _fp8_steps(sharded, variables, xs, jnp.asarray(order), ids_s, steps=2)
  # besides the attention's, all-reduces: the FP8 amaxes and the weight gradients, over dp and cp
  kinds = {kind for kind, _ in _collectives(hlo, mesh, within_cp=False)}
  assert {"ring": "collective-permute", "all_gather": "all-gather", "all_to_all": "all-to-all"}[strategy] in kinds, kinds
  for i, ((y, g), (y_want, g_want)) in enumerate(zip(got, want, strict=True)):
    _assert_close(te_jax.from_zigzag(y, 4), y_want, f"step {i}: output")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g["params"]), jax.tree.leaves(g_want["params"]),
                            strict=True):
      _assert_close(a, b, f"step {i}: d{jax.tree_util.keystr(path)}")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_state[te_jax.FP8_COLLECTION]),
                          jax.tree.leaves(want_state[te_jax.FP8_COLLECTION]), strict=True):
    _assert_close(a, b, f"FP8 state{jax.tree_util.keystr(path)}")


def test_rope_in_zigzag_order_needs_positions():
  mha = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=2, enable_rotary_pos_emb=True,
                                   context_parallel="cp", mesh=_mesh(1, 2))
  x = jnp.zeros((B, 8, 16))
  with pytest.raises(ValueError, match="positions=te_jax.zigzag_order"):
    mha.init(jax.random.key(0), x, deterministic=True)


@pytest.mark.parametrize("overrides,match", [(dict(window_size=(4, 0)), "window_size"),
                                             (dict(attn_bias_type="alibi"), "bias"),
                                             (dict(fp8_dpa=True), "fp8_dpa")])
def test_module_options_cp_does_not_support(overrides, match):
  attn = te_flax.DotProductAttention(head_dim=D, num_attention_heads=H, context_parallel="cp", mesh=_mesh(1, 2),
                                     **overrides)
  x = jnp.zeros((B, 8, H, D))
  with pytest.raises(ValueError, match=match):
    attn.init(jax.random.key(0), x, x, x, deterministic=True)


@pytest.mark.slow  # two more compilations of the layer
def test_nnx_multi_head_attention_context_parallel():
  mesh = _mesh(2, 4)
  x = random_normal(8, (B, T, 32))
  kw = dict(num_gqa_groups=2, attn_mask_type="causal", enable_rotary_pos_emb=True, dtype=jnp.float32,
            backend="unfused")
  plain = te_nnx.MultiHeadAttention(32, 8, 4, **kw, rngs=nnx.Rngs(0))
  sharded = te_nnx.MultiHeadAttention(32, 8, 4, **kw, context_parallel="cp", cp_strategy="ring", mesh=mesh,
                                      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="positions"):
    sharded(x)
  want = plain(x)
  got = jax.jit(lambda x: sharded(x, positions=jnp.asarray(te_jax.zigzag_order(T, 4))))(te_jax.to_zigzag(x, 4))
  _assert_close(te_jax.from_zigzag(got, 4), want, "out")
