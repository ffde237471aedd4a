"""Moving parameters and FP8 state between ``te_jax.flax`` (linen) and ``te_jax.nnx`` modules.

Every NNX module names its parameters, FP8 state variables and submodules as its linen twin names its parameters,
``te_jax.FP8_COLLECTION`` entries and submodules (DenseGeneral: ``kernel``, ``bias``; LayerNorm: ``scale``,
``bias``; LayerNormDenseGeneral: ``ln_scale``, ``ln_bias``, ``kernel``, ``bias``; LayerNormMLP: ``ln_scale``,
``ln_bias``, ``wi_kernel``, ``wi_bias``, ``wo_kernel``, ``wo_bias``; MultiHeadAttention: ``qkv``, or ``query``
and ``kv``, or ``query``, ``key`` and ``value``, then ``out``; TransformerLayer: ``self_attention``,
``encoder_decoder_attention``, ``mlp`` or ``wi`` and ``wo``, the post-LN norms; the FP8 state its recipe's
quantizer declares, under ``DelayedScaling``
``{prefix}{x,kernel,grad}_{amax_history,scale}``), with the same shapes, so one function pair converts every module:
a state stacked by ``nn.scan`` / ``nnx.vmap`` converts the same way. One exception:
``nn.Dense(dot_general_cls=te_flax.Fp8DotGeneral)`` keeps its GEMM's state under ``Fp8DotGeneral_0``,
``nnx.Linear(dot_general=te_nnx.Fp8DotGeneral())`` under ``dot_general``: rename that key.

Non-trained statistics travel too: linen's ``"batch_stats"`` collection is NNX's ``nnx.BatchStat`` variables (the
expert bias of ``MoEBlock``, as Flax's own BatchNorm keeps its running statistics).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from te_jax._core.scaling import FP8_COLLECTION
from te_jax.nnx.fp8_state import Fp8State

__all__ = ["from_linen", "to_linen"]

# The linen collections and the NNX variable types that hold them, in the order the variables dict lists them.
_COLLECTIONS = (("params", nnx.Param), (FP8_COLLECTION, Fp8State), ("batch_stats", nnx.BatchStat))


def to_linen(model: nnx.Module) -> dict:
  """The linen variables dict of ``model``'s twin: ``{"params": ..., te_jax.FP8_COLLECTION: ..., "batch_stats":
  ...}`` (the latter two only when the model has FP8 state, ``nnx.BatchStat`` variables), each a nested dict of
  arrays.

  >>> import jax, jax.numpy as jnp, te_jax, te_jax.flax as te_flax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> model = te_nnx.LayerNormMLP(32, 64, rngs=nnx.Rngs(0))
  >>> variables = te_nnx.to_linen(model)
  >>> y = te_flax.LayerNormMLP(intermediate_dim=64).apply(variables, jnp.ones((4, 32)))
  >>> bool(jnp.all(y == model(jnp.ones((4, 32)))))
  True
  """
  out = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param))}
  for collection, kind in _COLLECTIONS[1:]:
    state = nnx.to_pure_dict(nnx.state(model, kind))
    if jax.tree.leaves(state):
      out[collection] = state
  return out


def from_linen(model: nnx.Module, variables: Mapping) -> None:
  """Loads the linen variables dict of ``model``'s twin (``init``'s result: params and, under delayed scaling, the
  FP8 collection; ``"batch_stats"`` where the model has ``nnx.BatchStat`` variables) into ``model``, in place. Every
  parameter and state variable of the model must be given, with its shape and dtype, and nothing else: a mismatch
  raises, naming the paths.

  >>> import jax, jax.numpy as jnp, te_jax.flax as te_flax, te_jax.nnx as te_nnx
  >>> from flax import nnx
  >>> variables = te_flax.DenseGeneral(16).init(jax.random.key(0), jnp.ones((4, 32)))
  >>> model = te_nnx.DenseGeneral(32, 16, rngs=nnx.Rngs(1))
  >>> te_nnx.from_linen(model, variables)
  >>> bool(jnp.all(model.kernel[...] == variables["params"]["kernel"]))
  True
  """
  if not isinstance(variables, Mapping):
    raise TypeError(f"from_linen: variables must be the linen variables dict, got {type(variables).__name__}")
  known = [c for c, _ in _COLLECTIONS]
  unknown = set(variables) - set(known)
  if unknown:
    raise ValueError(f"from_linen: collections {sorted(unknown)} have no NNX twin here ({known} do)")
  for collection, kind in _COLLECTIONS:
    state = nnx.state(model, kind)
    want = _flat(nnx.to_pure_dict(state))
    given = _flat(dict(variables.get(collection, {})))
    missing, extra = sorted(set(want) - set(given)), sorted(set(given) - set(want))
    if missing or extra:
      raise ValueError(f"from_linen: {collection!r} does not match the model: missing {missing}, not in the model "
                       f"{extra}")
    wrong = [f"{'/'.join(p)}: {jnp.shape(given[p])} {jnp.result_type(given[p])} for {want[p].shape} "
             f"{want[p].dtype}" for p in want
             if jnp.shape(given[p]) != want[p].shape or jnp.result_type(given[p]) != want[p].dtype]
    if wrong:
      raise ValueError(f"from_linen: {collection!r} has other shapes or dtypes than the model: {wrong}")
    nnx.replace_by_pure_dict(state, _unflat({p: jnp.asarray(v) for p, v in given.items()}))
    nnx.update(model, state)


def _flat(tree: Mapping, prefix: tuple = ()) -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flat(v, (*prefix, str(k))))
    else:
      out[(*prefix, str(k))] = v
  return out


def _unflat(flat: dict) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out
