"""Checkpoints between Flax's own Transformer blocks and te_jax's fused modules, and from BF16 into FP8 train states.

A pre-LN Flax block (``nn.LayerNorm``, ``nn.MultiHeadDotProductAttention`` with separate query / key / value / out
``DenseGeneral`` kernels, ``nn.LayerNorm``, an MLP of two ``nn.Dense``; Flax's lm1b and wmt examples) keeps the same
numbers as ``te_jax.flax.TransformerLayer``, or a block of ``MultiHeadAttention`` named ``self_attention`` and
``LayerNormMLP`` named ``mlp``, in another layout: the norms live inside the fused modules (``ln_scale``,
``ln_bias``), q, k and v share one ``(hidden, heads, 3, head_dim)`` kernel, and the MLP's kernels are ``wi_kernel``
``(hidden, 1, intermediate)`` and ``wo_kernel``. ``flax_block_to_te`` and ``te_block_to_flax`` move one block's tree
between the two, exactly (stacking and slicing only: the round trip is bit for bit); ``convert_blocks`` applies one
at each block of a model, ``convert_like`` to every subtree shaped like the parameters (Adam's ``mu`` and ``nu``),
and ``convert_train_state`` to a whole ``TrainState``. ``restore_into_fp8`` puts a BF16 checkpoint's parameters (and
optimizer state) into an FP8 train state whose FP8 state is fresh. Every tree is checked: a missing or extra
parameter, or one of another shape, raises naming its path.

>>> import jax, jax.numpy as jnp, te_jax.flax as te_flax
>>> def dense(*shape):
...   return {"kernel": jnp.zeros(shape)}
>>> flax_block = {
...     "LayerNorm_0": {"scale": jnp.ones(64), "bias": jnp.zeros(64)},
...     "MultiHeadDotProductAttention_0": {"query": dense(64, 4, 16), "key": dense(64, 4, 16),
...                                        "value": dense(64, 4, 16), "out": dense(4, 16, 64)},
...     "LayerNorm_1": {"scale": jnp.ones(64), "bias": jnp.zeros(64)},
...     "MlpBlock_0": {"Dense_0": {"kernel": jnp.zeros((64, 128)), "bias": jnp.zeros(128)},
...                    "Dense_1": {"kernel": jnp.zeros((128, 64)), "bias": jnp.zeros(64)}}}
>>> te_block = te_flax.flax_block_to_te(flax_block)
>>> jax.tree.map(jnp.shape, te_block["self_attention"]["qkv"])
{'kernel': (64, 4, 3, 16), 'ln_bias': (64,), 'ln_scale': (64,)}
>>> jax.tree.map(jnp.shape, te_block["mlp"])["wi_kernel"]
(64, 1, 128)
>>> back = te_flax.te_block_to_flax(te_block)
>>> jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, flax_block))
True
>>> del flax_block["LayerNorm_1"]["scale"]
>>> te_flax.flax_block_to_te(flax_block)
Traceback (most recent call last):
...
ValueError: flax_block_to_te: the Flax block has no 'LayerNorm_1/scale', which 'mlp/ln_scale' needs ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import meta

from te_jax._core.scaling import FP8_COLLECTION

__all__ = ["FlaxLayout", "TE_FP8_COLLECTION", "convert_blocks", "convert_like", "convert_train_state",
           "flax_block_to_te", "from_transformer_engine", "restore_into_fp8", "te_block_to_flax",
           "to_transformer_engine"]


@dataclasses.dataclass(frozen=True)
class FlaxLayout:
  """Where a pre-LN Flax block keeps its submodules ('/'-separated paths inside the block). The defaults are the
  names Flax gives them automatically, as in Flax's lm1b and wmt examples' ``EncoderDecoder1DBlock``.

  >>> import te_jax.flax as te_flax
  >>> te_flax.FlaxLayout(mlp_in="mlp/fc1", mlp_out="mlp/fc2").mlp_in
  'mlp/fc1'

  Attributes:
    attention_norm: the ``nn.LayerNorm`` before attention (its ``scale``, ``bias``).
    attention: the ``nn.MultiHeadDotProductAttention`` (its ``query``, ``key``, ``value``, ``out``).
    mlp_norm: the ``nn.LayerNorm`` before the MLP.
    mlp_in, mlp_out: the MLP's two ``nn.Dense`` (``kernel``, ``bias``); one activation between them (not gated).
  """

  attention_norm: str = "LayerNorm_0"
  attention: str = "MultiHeadDotProductAttention_0"
  mlp_norm: str = "LayerNorm_1"
  mlp_in: str = "MlpBlock_0/Dense_0"
  mlp_out: str = "MlpBlock_0/Dense_1"


@dataclasses.dataclass(frozen=True)
class _Rule:
  """Flax leaves ``flax`` (paths in the block) <-> the te leaf ``te``; ``to_te`` joins them, ``to_flax`` splits it.
  An optional rule's leaves are absent on both sides or present on both."""

  flax: tuple[str, ...]
  te: str
  to_te: Callable
  to_flax: Callable
  optional: bool = False


def _same(x):
  return x


def _stack_qkv(q, k, v):  # (..., heads, head_dim) x 3 -> (..., heads, 3, head_dim): te's fused QKV, heads major
  return jnp.stack([q, k, v], axis=-2)


def _unstack_qkv(qkv):
  return tuple(qkv[..., i, :] for i in range(3))


def _rules(layout: FlaxLayout) -> tuple[_Rule, ...]:
  attn, one = layout.attention, lambda fn: (lambda x: (fn(x),))  # noqa: E731
  qkv = lambda name: tuple(f"{attn}/{p}/{name}" for p in ("query", "key", "value"))  # noqa: E731
  return (
      _Rule((f"{layout.attention_norm}/scale",), "self_attention/qkv/ln_scale", _same, one(_same)),
      _Rule((f"{layout.attention_norm}/bias",), "self_attention/qkv/ln_bias", _same, one(_same), optional=True),
      _Rule(qkv("kernel"), "self_attention/qkv/kernel", _stack_qkv, _unstack_qkv),
      _Rule(qkv("bias"), "self_attention/qkv/bias", _stack_qkv, _unstack_qkv, optional=True),
      _Rule((f"{attn}/out/kernel",), "self_attention/out/kernel", _same, one(_same)),
      _Rule((f"{attn}/out/bias",), "self_attention/out/bias", _same, one(_same), optional=True),
      _Rule((f"{layout.mlp_norm}/scale",), "mlp/ln_scale", _same, one(_same)),
      _Rule((f"{layout.mlp_norm}/bias",), "mlp/ln_bias", _same, one(_same), optional=True),
      # te's wi_kernel has an axis for the activations of a gated MLP: 1 here, (hidden, 1, intermediate).
      _Rule((f"{layout.mlp_in}/kernel",), "mlp/wi_kernel", lambda k: k[..., None, :], one(lambda k: k[..., 0, :])),
      _Rule((f"{layout.mlp_in}/bias",), "mlp/wi_bias", lambda b: b[..., None, :], one(lambda b: b[..., 0, :]),
            optional=True),
      _Rule((f"{layout.mlp_out}/kernel",), "mlp/wo_kernel", _same, one(_same)),
      _Rule((f"{layout.mlp_out}/bias",), "mlp/wo_bias", _same, one(_same), optional=True),
  )


def _flat(tree: Any, what: str, caller: str) -> dict[str, Any]:
  if not isinstance(tree, Mapping):
    raise TypeError(f"{caller}: {what} must be a dict of parameters, got {type(tree).__name__}")
  flat = traverse_util.flatten_dict(tree, sep="/")
  for path, leaf in flat.items():
    if isinstance(leaf, meta.AxisMetadata):
      raise TypeError(f"{caller}: {what}'s {path!r} is boxed ({type(leaf).__name__}); unbox the tree first "
                      "(flax.linen.meta.unbox)")
  return flat


def _convert(block: Mapping, layout: FlaxLayout, *, to_te: bool, caller: str) -> dict:
  if not isinstance(layout, FlaxLayout):
    raise TypeError(f"{caller}: layout must be a te_jax.flax.FlaxLayout, got {type(layout).__name__}")
  source = "Flax" if to_te else "te_jax"
  flat = _flat(block, f"the {source} block", caller)
  out, used = {}, set()
  for rule in _rules(layout):
    sources = rule.flax if to_te else (rule.te,)
    present = [p in flat for p in sources]
    if not any(present) and rule.optional:
      continue
    if not all(present):
      needs = repr(rule.te) if to_te else ", ".join(repr(p) for p in rule.flax)
      raise ValueError(f"{caller}: the {source} block has no {sources[present.index(False)]!r}, which {needs} needs "
                       f"({layout})")
    used.update(sources)
    if to_te:
      out[rule.te] = rule.to_te(*(flat[p] for p in rule.flax))
    else:
      out.update(zip(rule.flax, rule.to_flax(flat[rule.te])))
  extra = sorted(set(flat) - used)
  if extra:
    raise ValueError(f"{caller}: the {source} block has {extra[0]!r}, which has no place in the other layout "
                     f"(unconverted: {extra}); only pre-LN blocks of LayerNorm, attention and a two-layer MLP convert")
  return traverse_util.unflatten_dict(out, sep="/")


def flax_block_to_te(block: Mapping, layout: FlaxLayout = FlaxLayout()) -> dict:
  """One Flax block's parameter tree (or any tree of the same paths: Adam's moments of it) in the layout of
  ``TransformerLayer`` (pre-LN, ``layer_type="decoder"`` or ``"encoder"``, no cross attention): ``self_attention``
  (``qkv`` with the norm, ``out``) and ``mlp`` (``LayerNormMLP``'s). Biases, and the norms' ``bias``, convert where
  the Flax block has them (give ``use_bias`` to match).

  Args:
    block: the block's unboxed parameters (``flax.linen.meta.unbox``), e.g. ``params["decoder"]["encoderdecoderblock_0"]``.
    layout: where the Flax block keeps its submodules (``FlaxLayout``).

  Raises:
    ValueError: naming the first parameter that is missing, or that the other layout has no place for.
  """
  return _convert(block, layout, to_te=True, caller="flax_block_to_te")


def te_block_to_flax(block: Mapping, layout: FlaxLayout = FlaxLayout()) -> dict:
  """The inverse of ``flax_block_to_te``: a te_jax block's tree in the Flax block's layout, bit for bit."""
  return _convert(block, layout, to_te=False, caller="te_block_to_flax")


def _get(tree: Mapping, path: str, caller: str):
  node = tree
  for i, key in enumerate(path.split("/")):
    if not isinstance(node, Mapping) or key not in node:
      where = "/".join(path.split("/")[:i]) or "the top level"
      keys = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise ValueError(f"{caller}: the tree has no block {path!r} (no {key!r} at {where}; there: {keys})")
    node = node[key]
  return node


def _set(tree: Mapping, path: str, value) -> dict:
  key, _, rest = path.partition("/")
  return {**tree, key: _set(tree[key], rest, value) if rest else value}


def convert_blocks(convert: Callable[[Mapping], dict], tree: Mapping, blocks: Sequence[str]) -> dict:
  """``tree`` with ``convert`` (``flax_block_to_te``, ``te_block_to_flax``) applied to each of its ``blocks``
  ('/'-separated paths, e.g. ``"decoder/encoderdecoderblock_0"``); everything else unchanged.

  Raises:
    ValueError: a block that is not in ``tree``, naming it.
  """
  if isinstance(blocks, str):
    raise TypeError("convert_blocks: blocks is a sequence of paths, not one string")
  out = dict(tree)
  for path in blocks:
    out = _set(out, path, convert(_get(out, path, "convert_blocks")))
  return out


def convert_like(convert: Callable[[Any], Any], tree: Any, params: Any) -> Any:
  """``tree`` (an optimizer state) with ``convert`` applied to every subtree structured as ``params`` (Adam's ``mu``
  and ``nu``, momentum traces), the rest (step counts, empty states) unchanged.

  >>> import jax.numpy as jnp, optax, te_jax.flax as te_flax
  >>> params = {"w": jnp.ones(3)}
  >>> state = optax.adam(1e-3).init(params)
  >>> moved = te_flax.convert_like(lambda p: {"v": p["w"]}, state, params)
  >>> sorted(moved[0].mu), int(moved[0].count)
  (['v'], 0)

  Raises:
    ValueError: no subtree of ``tree`` is structured as ``params`` (the conversion would do nothing).
  """
  structure = jax.tree.structure(params)
  found = []

  def matches(node) -> bool:
    return jax.tree.structure(node) == structure

  def apply(node):
    if matches(node):
      found.append(True)
      return convert(node)
    return node

  out = jax.tree.map(apply, tree, is_leaf=matches)
  if not found:
    raise ValueError("convert_like: no subtree of the tree is structured like the parameters, so nothing would be "
                     f"converted (the parameters' structure: {structure})")
  return out


def convert_train_state(state, convert: Callable[[Any], Any]):
  """A ``flax.training.train_state.TrainState`` (anything with ``params`` and ``opt_state`` and ``replace``) with its
  parameters and the optimizer's moments of them converted by ``convert``: e.g.
  ``functools.partial(convert_blocks, flax_block_to_te, blocks=[...])``."""
  return state.replace(params=convert(state.params), opt_state=convert_like(convert, state.opt_state, state.params))


def _check_same_params(got: Mapping, want: Mapping, caller: str) -> None:
  """Raises naming the first path that ``got`` lacks or has in excess of ``want``, or where their shapes differ."""
  got_flat, want_flat = _flat(got, "the checkpoint's parameters", caller), _flat(want, "the model's parameters", caller)
  missing, extra = sorted(set(want_flat) - set(got_flat)), sorted(set(got_flat) - set(want_flat))
  if missing:
    raise ValueError(f"{caller}: the checkpoint has no parameter {missing[0]!r}, which the model has (missing: "
                     f"{missing}; convert the checkpoint's layout first, e.g. with flax_block_to_te)")
  if extra:
    raise ValueError(f"{caller}: the checkpoint has the parameter {extra[0]!r}, which the model does not have "
                     f"(extra: {extra})")
  for path, value in want_flat.items():
    if np.shape(got_flat[path]) != np.shape(value):
      raise ValueError(f"{caller}: the parameter {path!r} is {np.shape(got_flat[path])} in the checkpoint and "
                       f"{np.shape(value)} in the model")


def _cast_like(params: Mapping, like: Mapping, caller: str) -> dict:
  """``params`` (checked against ``like``) with each leaf cast to the dtype of ``like``'s."""
  _check_same_params(params, like, caller)
  flat, like_flat = traverse_util.flatten_dict(params, sep="/"), traverse_util.flatten_dict(like, sep="/")
  return traverse_util.unflatten_dict({k: jnp.asarray(v, jnp.result_type(like_flat[k])) for k, v in flat.items()},
                                      sep="/")


def restore_into_fp8(state, params: Mapping, opt_state: Any = None):
  """An FP8 train state holding a BF16 (no FP8 state) checkpoint's parameters, and its optimizer state if given.

  ``state`` is a fresh FP8 ``TrainState`` (``params`` the whole variables dict of ``model.init`` under
  ``te_jax.autocast`` with ``DelayedScaling``, as the train step differentiates it): its FP8 state is kept as it was
  initialised, its ``params`` collection replaced by ``params``, each cast to the dtype the model declares. With
  ``opt_state`` (the checkpoint's: the same optimizer's state over ``params``), the optimizer continues from it, moments
  and step counts (``TrainState.create`` gives the FP8 state no optimizer state: it is written, not optimized). The train state's ``step`` is left to the caller
  (``state.replace(step=...)``).

  Raises:
    ValueError: ``state`` has no FP8 state; the checkpoint's parameters do not match the model's (the path named);
      ``opt_state`` is not the state of the same optimizer over ``params``.
  """
  caller = "restore_into_fp8"
  variables = state.params
  if not isinstance(variables, Mapping) or "params" not in variables or FP8_COLLECTION not in variables:
    keys = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
    raise ValueError(f"{caller}: the train state's params must be the whole variables dict with the FP8 state "
                     f"({{'params': ..., {FP8_COLLECTION!r}: ...}}, from model.init under te_jax.autocast with "
                     f"DelayedScaling), got {keys}")
  new = {**variables, "params": _cast_like(params, variables["params"], caller)}
  if opt_state is None:
    return state.replace(params=new)
  # Flax's TrainState.create leaves the FP8 collection out of the optimizer (its "gradient" is written, not
  # optimized): the optimizer state of an FP8 train state has the BF16 checkpoint's structure.
  fresh = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  saved = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  fresh_paths = [jax.tree_util.keystr(p) for p, _ in fresh]
  saved_paths = [jax.tree_util.keystr(p) for p, _ in saved]
  if fresh_paths != saved_paths or jax.tree.structure(state.opt_state) != jax.tree.structure(opt_state):
    missing, extra = sorted(set(fresh_paths) - set(saved_paths)), sorted(set(saved_paths) - set(fresh_paths))
    where = (f"it has no {missing[0]} (missing: {missing})" if missing else f"it has {extra[0]}, which the train "
             f"state's does not (extra: {extra})" if extra else "its containers differ")
    raise ValueError(f"{caller}: opt_state is not the state of the train state's optimizer over these parameters: "
                     f"{where}")
  leaves = []
  for path, (_, want), (_, got) in zip(fresh_paths, fresh, saved):
    if np.shape(got) != np.shape(want):
      raise ValueError(f"{caller}: opt_state{path} is {np.shape(got)} in the checkpoint and {np.shape(want)} in the "
                       "train state")
    leaves.append(jnp.asarray(got, jnp.result_type(want)))
  return state.replace(params=new, opt_state=jax.tree.unflatten(jax.tree.structure(state.opt_state), leaves))


# ---- from NVIDIA Transformer Engine's JAX modules ------------------------------------------------------------------
#
# Transformer Engine's transformer_engine.jax.flax modules keep (from its source): a LayerNorm's parameters as
# 'scale' and 'ln_bias'; LayerNormDenseGeneral's and LayerNormMLP's norm as 'scale' and 'ln_bias' (te_jax: 'ln_scale',
# 'ln_bias'); attention's fused projections flat over the heads, 'qkv' (hidden, 3, heads * head_dim), 'query'
# (hidden, heads * head_dim), 'kv' (hidden, 2, groups * head_dim), 'out' (heads * head_dim, hidden), and unfused
# (fuse_qkv_params=False) 'key' and 'value' (hidden, groups * head_dim) (te_jax: (hidden, heads, 3, head_dim), (hidden,
# heads, head_dim), (hidden, groups, 2, head_dim), (heads, head_dim, hidden), (hidden, groups, head_dim)); the FP8
# state in the 'fp8_metas' collection, one '{x,kernel,grad}{postfix}_scale' of shape (1,) and '_amax_history' per
# GEMM, postfix '' for a dense layer and '_0' / '_1' for LayerNormMLP's two GEMMs (te_jax: te_jax.FP8_COLLECTION,
# scales of shape (), LayerNormMLP's 'wi_' / 'wo_' prefixes).

TE_FP8_COLLECTION = "fp8_metas"
_TE_MLP_GEMMS = (("_0", "wi_"), ("_1", "wo_"))
# A module of these names beside 'out' and 'qkv' or 'query' is an attention projection.
_TE_ATTENTION = ("qkv", "query", "kv", "key", "value", "out")


def _heads_split(x, parts: int | None, head_dim: int, to_te: bool):
  """A fused projection's trailing feature dims between TE's ((parts,) heads * head_dim) and te_jax's (heads,
  (parts,) head_dim); ``parts`` None: no parts axis."""
  if to_te:
    if parts is None:
      return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    heads = x.shape[-3]
    return jnp.swapaxes(x, -3, -2).reshape(*x.shape[:-3], parts, heads * head_dim)
  if x.shape[-1] % head_dim:
    raise ValueError(f"a fused projection's last dim {x.shape[-1]} is no multiple of head_dim={head_dim}")
  if parts is None:
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)
  return jnp.swapaxes(x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim), -3, -2)


def _attention_leaf(module: str, name: str, x, head_dim: int | None, to_te: bool, path: str, caller: str):
  if name not in ("kernel", "bias"):
    return x
  if head_dim is None:
    raise ValueError(f"{caller}: {path!r} is a fused attention projection; give head_dim= to reshape it")
  if module == "out":
    if name == "bias":
      return x
    if to_te:
      return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return x.reshape(x.shape[0] // head_dim, head_dim, *x.shape[1:])
  return _heads_split(x, {"qkv": 3, "kv": 2}.get(module), head_dim, to_te)


def _te_params(flat: dict, head_dim: int | None, to_te: bool, caller: str) -> dict:
  modules: dict[str, dict[str, Any]] = {}
  for path, leaf in flat.items():
    parent, _, name = path.rpartition("/")
    modules.setdefault(parent, {})[name] = leaf
  out = {}
  for parent, leaves in modules.items():
    prefix = f"{parent}/" if parent else ""
    grand, _, module = parent.rpartition("/")
    siblings = {p.rpartition("/")[2] for p in modules if p.rpartition("/")[0] == grand}
    attention = module in _TE_ATTENTION and "out" in siblings and bool({"qkv", "query"} & siblings)
    norm_key = "ln_scale" if not to_te else "scale"
    has_gemm = "kernel" in leaves or "wi_kernel" in leaves
    for name, x in leaves.items():
      new = name
      if has_gemm and name == ("scale" if not to_te else "ln_scale"):
        new = norm_key  # the norm inside LayerNormDenseGeneral / LayerNormMLP
      elif not has_gemm and "scale" in leaves and name == ("ln_bias" if not to_te else "bias"):
        new = "bias" if not to_te else "ln_bias"  # LayerNorm's bias
      if attention:
        x = _attention_leaf(module, name, x, head_dim, to_te, prefix + name, caller)
      out[prefix + new] = x
  return out


def _te_fp8(flat: dict, to_te: bool, caller: str) -> dict:
  out = {}
  for path, leaf in flat.items():
    parent, _, name = path.rpartition("/")
    prefix = f"{parent}/" if parent else ""
    new = name
    for te_postfix, ours in _TE_MLP_GEMMS:
      for role in ("x", "kernel", "grad"):
        te_name, our_name = f"{role}{te_postfix}_", f"{ours}{role}_"
        if not to_te and name.startswith(te_name):
          new = our_name + name[len(te_name):]
        elif to_te and name.startswith(our_name):
          new = te_name + name[len(our_name):]
    if name.endswith("_scale"):
      if np.size(leaf) != 1:
        raise ValueError(f"{caller}: the FP8 scale {path!r} has shape {np.shape(leaf)}; a per-tensor scale is one "
                         "value (delayed scaling's state converts, a block-scaled recipe keeps none)")
      leaf = jnp.reshape(leaf, (1,) if to_te else ())
    elif not name.endswith("_amax_history"):
      raise ValueError(f"{caller}: {path!r} in the FP8 collection is neither a scale nor an amax history")
    out[prefix + new] = leaf
  return out


def _te_convert(variables: Mapping, head_dim: int | None, to_te: bool, caller: str) -> dict:
  if not isinstance(variables, Mapping) or "params" not in variables:
    keys = sorted(variables) if isinstance(variables, Mapping) else type(variables).__name__
    raise ValueError(f"{caller}: variables must be a variables dict with 'params' (model.init's), got {keys}")
  if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
    raise ValueError(f"{caller}: head_dim must be a positive int, got {head_dim!r}")
  src_fp8, dst_fp8 = (FP8_COLLECTION, TE_FP8_COLLECTION) if to_te else (TE_FP8_COLLECTION, FP8_COLLECTION)
  out = {}
  for collection, tree in variables.items():
    if collection == "params":
      flat = _te_params(_flat(tree, "params", caller), head_dim, to_te, caller)
      out["params"] = traverse_util.unflatten_dict(flat, sep="/")
    elif collection == src_fp8:
      out[dst_fp8] = traverse_util.unflatten_dict(_te_fp8(_flat(tree, collection, caller), to_te, caller), sep="/")
    else:
      out[collection] = tree
  return out


def from_transformer_engine(variables: Mapping, *, head_dim: int | None = None) -> dict:
  """The variables of a model of Transformer Engine's JAX modules (``transformer_engine.jax.flax``: ``LayerNorm``,
  ``DenseGeneral``, ``LayerNormDenseGeneral``, ``LayerNormMLP``, ``MultiHeadAttention``, ``RelativePositionBiases``,
  ``TransformerLayer``) as the same model of te_jax's modules takes them.

  >>> import jax.numpy as jnp, te_jax
  >>> from te_jax.flax.checkpoint import from_transformer_engine
  >>> te = {"params": {"mlp": {"scale": jnp.ones(64), "ln_bias": jnp.zeros(64), "wi_kernel": jnp.zeros((64, 1, 128)),
  ...                          "wo_kernel": jnp.zeros((128, 64))}},
  ...       "fp8_metas": {"mlp": {"x_0_scale": jnp.ones(1), "x_0_amax_history": jnp.zeros(16)}}}
  >>> ours = from_transformer_engine(te)
  >>> sorted(ours["params"]["mlp"]), ours[te_jax.FP8_COLLECTION]["mlp"]["wi_x_scale"].shape
  (['ln_bias', 'ln_scale', 'wi_kernel', 'wo_kernel'], ())

  Renamed: the norms' ``scale`` inside ``LayerNormDenseGeneral`` / ``LayerNormMLP`` (``ln_scale`` here) and a
  ``LayerNorm``'s ``ln_bias`` (``bias``); the ``fp8_metas`` collection (``te_jax.FP8_COLLECTION``), its scales
  (shape (1,) there, () here) and ``LayerNormMLP``'s GEMM postfixes ``_0`` / ``_1`` (prefixes ``wi_`` / ``wo_``).
  Reshaped: attention's projections (``qkv``, ``query``, ``kv``, ``out``, and the separate ``key`` and ``value`` of
  ``fuse_qkv_params=False``: flat over the heads there, a heads dim here), which needs ``head_dim``. Every other key and collection is kept as it is: the two libraries' names
  agree there (``kernel``, ``bias``, ``wi_kernel``, ``wo_bias``, ``rel_embedding``, ``self_attention``, ``mlp``).

  Raises:
    ValueError: a tree that is not a variables dict, an attention without ``head_dim``, or an FP8 state that is not
      delayed scaling's.
  """
  return _te_convert(variables, head_dim, to_te=False, caller="from_transformer_engine")


def to_transformer_engine(variables: Mapping, *, head_dim: int | None = None) -> dict:
  """The inverse of ``from_transformer_engine``: te_jax variables in Transformer Engine's layout, bit for bit."""
  return _te_convert(variables, head_dim, to_te=True, caller="to_transformer_engine")
