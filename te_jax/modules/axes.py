"""The logical axis names of te_jax's parameters and activations, and what the modules read from the logical axis
rules in context (``flax.linen.logical_axis_rules``, which is also ``flax.nnx.logical_axis_rules``): which mesh axes
a name maps to, and the sharding constraints of a residual stream under sequence and context parallelism. Also the
checks of the modules' size arguments."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from te_jax._core.explicit import constrain as constrain_to
from te_jax._core.explicit import typed_vjp

__all__ = ["ACT", "ACT_EMBED", "BATCH", "EMBED", "EXPERT", "HEADS", "HEAD_DIM", "Initializer", "LOGICAL_AXES", "MLP", "QKV",
           "SEQ", "axes", "constrain", "context_parallel_axes", "explicit_out", "features_tuple", "gather_sequence",
           "is_int", "logical_constraint", "rule_axes", "rule_shards", "seq_first_to_batch_first", "sequence_kept",
           "stream_input", "stream_sharding"]

Initializer = Callable[..., jax.Array]

# Logical axis names of the parameters (with ``logical_axes=True``): the hidden size, attention heads, the head dim,
# the q/k/v (or k/v) packing axis, the MLP's intermediate size and its gated-pair axis.
EMBED, HEADS, HEAD_DIM, QKV, MLP, ACT = "embed", "heads", "kv", "qkv", "mlp", "act"
# ... and of the activations between the blocks (the residual stream): batch, sequence, hidden. Mapping "seq" to the
# tensor-parallel mesh axis gives sequence parallelism (norms, dropout and residual adds on sequence shards).
BATCH, SEQ, ACT_EMBED = "batch", "seq", "act_embed"
# ... and of a mixture-of-experts block's experts (the leading dim of its stacked expert kernels and biases): mapped
# to a mesh axis, each device holds the kernels of E / size experts (expert parallelism's weights).
EXPERT = "expert"
LOGICAL_AXES = (EMBED, HEADS, HEAD_DIM, QKV, MLP, ACT, BATCH, SEQ, ACT_EMBED, EXPERT)


def axes(enabled: bool, *names: str | None) -> tuple[str | None, ...]:
  """The logical axis names of a parameter, or () (no names) when the module does not name its axes."""
  return names if enabled else ()


def rule_shards(name: str | None) -> bool:
  """Whether the logical axis rules in effect (``nn.logical_axis_rules``) map logical axis ``name`` to a mesh axis."""
  return name is not None and nn.logical_to_mesh_axes((name,))[0] is not None


def rule_axes(name: str | None) -> tuple[str, ...]:
  """The mesh axes the logical axis rules in context map ``name`` to (none without rules)."""
  if name is None or not nn.get_logical_axis_rules():
    return ()
  entry = nn.logical_to_mesh_axes((name,))[0]
  return () if entry is None else _as_tuple(entry)


def _tensor_parallel_axes() -> tuple[str, ...]:
  """The mesh axes of tensor parallelism under the rules in context: those of the heads and of the MLP."""
  return tuple(dict.fromkeys(rule_axes(HEADS) + rule_axes(MLP)))


def sequence_kept(name: str | None = SEQ) -> bool:
  """Whether the rules in context shard logical axis ``name`` (a sequence) over a mesh axis tensor parallelism does not
  use: such a sequence stays sharded through a tensor-parallel layer (context parallelism), where one sharded over the
  tensor axis is gathered before it (sequence parallelism)."""
  tensor = _tensor_parallel_axes()
  return any(a not in tensor for a in rule_axes(name))


def _hashable_rules(rules) -> tuple:
  return tuple((n, tuple(a) if isinstance(a, list) else a) for n, a in rules)


def _gathered_rules(name: str | None) -> tuple | None:
  """The rules in context (as a hashable tuple) with ``name`` mapped to its mesh axes less the tensor-parallel ones;
  None without rules."""
  rules = nn.get_logical_axis_rules()
  if not rules:
    return None
  others = _hashable_rules(r for r in rules if r[0] != name)
  if name is None:
    return others
  kept = tuple(a for a in rule_axes(name) if a not in _tensor_parallel_axes())
  return ((name, kept[0] if len(kept) == 1 else (kept or None)),) + others


def logical_constraint(x: jax.Array, names: tuple[str | None, ...], rules=None) -> jax.Array:
  """``nn.with_logical_constraint(x, names, rules=rules)``, except on a mesh whose axes are all Explicit, where jax
  takes no sharding constraint that changes a value's type: there ``x`` is resharded to the names' sharding (its
  type then says it), as Flax's NNX variables are."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.are_all_axes_explicit:
    return nn.with_logical_constraint(x, tuple(names), rules=rules)
  if rules is None and not nn.get_logical_axis_rules():
    return x
  return constrain_to(x, nn.logical_to_mesh_axes(tuple(names), rules))


def gather_sequence(x: jax.Array, names: tuple[str | None, ...], seq: int) -> jax.Array:
  """``x`` constrained to the logical axis ``names`` (``nn.with_logical_constraint``), its sequence (``names[seq]``)
  gathered over the tensor-parallel mesh axes (those of the heads and the MLP: sequence parallelism, where each tensor
  shard computes its heads or MLP columns over the whole sequence) and kept sharded over any other (context
  parallelism): an activation as a tensor-parallel layer reads it. A no-op outside ``nn.logical_axis_rules``."""
  rules = _gathered_rules(names[seq])
  return x if rules is None else logical_constraint(x, tuple(names), rules=list(rules))


def stream_input(x: jax.Array, names: tuple[str | None, ...], seq: int) -> jax.Array:
  """``gather_sequence(x, names, seq)`` for a layer's input that is a residual stream with the logical axis ``names``,
  its gradient constrained back to ``names``, the stream's own sharding, rather than to the gathered one (a plain
  constraint's transpose): a layer that writes its input gradient on the stream's shards (its dgrad GEMM's
  ``grad_sharding``, from ``stream_sharding``: a reduce-scatter under sequence parallelism) hands it on as it is,
  where the gathered sharding would all-gather it again. A no-op outside ``nn.logical_axis_rules``."""
  rules = _gathered_rules(names[seq])
  if rules is None:
    return x
  return _stream_input(x, tuple(names), rules, _hashable_rules(nn.get_logical_axis_rules()))


def explicit_out(names: tuple[str | None, ...] | None) -> jax.sharding.PartitionSpec | None:
  """The ``PartitionSpec`` of the logical axis ``names`` under the rules in context where the mesh in context has
  Explicit axes: the ``out_sharding`` a layer passes its fused op for an output it constrains to ``names`` (there
  the op must type its output so, reading its input accordingly); None elsewhere, where the constraint after the op
  does the same."""
  mesh = jax.sharding.get_abstract_mesh()
  if not names or mesh.empty or not mesh.are_all_axes_explicit or not nn.get_logical_axis_rules():
    return None
  return nn.logical_to_mesh_axes(tuple(names))


def stream_sharding(names: tuple[str | None, ...]) -> jax.sharding.PartitionSpec | None:
  """The ``PartitionSpec`` of the logical axis ``names`` under the rules in context, where a mesh is set
  (``jax.set_mesh``); else None: what a fused layer's ``grad_sharding`` takes for a residual stream's gradient."""
  if not nn.get_logical_axis_rules() or meta.get_global_mesh() is None:
    return None
  return nn.logical_to_mesh_axes(tuple(names))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _stream_input(x, names, gathered_rules, stream_rules):
  return logical_constraint(x, names, rules=list(gathered_rules))


def _stream_input_fwd(x, names, gathered_rules, stream_rules):
  return _stream_input(x, names, gathered_rules, stream_rules), None


def _stream_input_bwd(names, gathered_rules, stream_rules, _, g):
  del gathered_rules
  return (logical_constraint(g, names, rules=list(stream_rules)),)


_stream_input.defvjp(*typed_vjp(_stream_input_fwd, _stream_input_bwd, nondiff_argnums=(1, 2, 3)))


def context_parallel_axes() -> dict[str, tuple[str, ...]]:
  """``batch_axes`` and ``head_axes`` for ``te_jax.context_parallel_attention`` from the Flax logical axis rules in
  context (``nn.logical_axis_rules``): the mesh axes of ``BATCH`` and ``HEADS`` (none where no rule maps them, as
  Flax reads rules); {} without rules (the function's defaults: the batch over every other mesh axis)."""
  if not nn.get_logical_axis_rules():
    return {}
  batch, heads = nn.logical_to_mesh_axes((BATCH, HEADS))
  return {"batch_axes": () if batch is None else _as_tuple(batch), "head_axes": () if heads is None else _as_tuple(heads)}


def seq_first_to_batch_first(x: jax.Array | None, transposed: bool) -> jax.Array | None:
  return x if x is None or not transposed else jnp.swapaxes(x, 0, 1)


def _as_tuple(x) -> tuple:
  return tuple(x) if isinstance(x, Sequence) and not isinstance(x, str) else (x,)


def is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def features_tuple(features) -> tuple[int, ...]:
  """``features`` (an int or a sequence of ints) as a tuple of positive ints, or a ValueError that names it."""
  out = _as_tuple(features)
  if not out or not all(is_int(f) and f > 0 for f in out):
    raise ValueError(f"features must be a positive int or a non-empty sequence of them, got {features!r}")
  return tuple(int(f) for f in out)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  """``x`` constrained to the logical axis ``names`` under the rules in context (a no-op without rules or names)."""
  return logical_constraint(x, tuple(names)) if names else x
