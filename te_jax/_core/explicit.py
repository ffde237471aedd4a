"""Explicit mesh axes (``jax.make_mesh``'s default): values whose types carry their sharding.

On a mesh with Explicit axes jax types every value with its ``NamedSharding`` (``jax.typeof(x).sharding``), each op
says its outputs' from its operands', and a value's layout changes only where the program says so
(``jax.sharding.reshard``). te_jax follows it in three places, all here or in ``te_jax._core.primitive``:

- each primitive types its outputs with the shardings its ``partition`` callback gives them (``primitive``);
- a ``custom_vjp`` must return each cotangent with its primal's type: ``typed_vjp`` reshards them to it (a weight
  gradient whose GEMM leaves it replicated over the axis that shards the weight, FSDP, is then sliced, as jax's
  own ``dot_general`` transpose would);
- a sharding constraint is a ``jax.sharding.reshard`` on Explicit axes, a ``with_sharding_constraint`` on Auto ones
  (``constrain``), since jax accepts each only on its own kind of axis.

Where no value carries Explicit axes every function here changes nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["constrain", "explicit_mesh", "explicit_sharding", "reshape", "retype", "typed_vjp"]


def explicit_mesh(*values) -> jax.sharding.AbstractMesh | None:
  """The mesh of the first of ``values`` (arrays or their types; anything else is skipped) whose type names a mesh
  with Explicit axes; None where none does."""
  for v in values:
    aval = v if isinstance(v, jax.core.ShapedArray) else (jax.typeof(v) if hasattr(v, "shape") else None)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.explicit_axes:
      return mesh
  return None


def explicit_sharding(x) -> NamedSharding | None:
  """``x``'s sharding where its type carries one (Explicit axes), else None."""
  return None if explicit_mesh(x) is None else jax.typeof(x).sharding


def _reshard_to(x, sharding: NamedSharding | None):
  if sharding is None or x is None or not hasattr(x, "shape") or jax.typeof(x).sharding == sharding:
    return x
  return jax.sharding.reshard(x, sharding)


def constrain(x: jax.Array, spec: P | NamedSharding | None) -> jax.Array:
  """``x`` laid out as ``spec`` (a ``PartitionSpec`` of the mesh in context, or a ``NamedSharding``): a
  ``jax.sharding.reshard`` where the mesh's axes are Explicit (the type changes with it), a
  ``jax.lax.with_sharding_constraint`` where they are Auto; ``x`` itself without a spec or a mesh."""
  if spec is None:
    return x
  mesh = spec.mesh if isinstance(spec, NamedSharding) else (explicit_mesh(x) or jax.sharding.get_abstract_mesh())
  if mesh.empty:
    return x
  sharding = spec if isinstance(spec, NamedSharding) else NamedSharding(mesh, spec)
  if mesh.explicit_axes and not mesh.auto_axes:
    return _reshard_to(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def retype(x: jax.Array, spec: P | None) -> jax.Array:
  """``x`` resharded to ``spec`` (a ``PartitionSpec`` of its mesh) where its type carries Explicit axes; ``x`` itself
  otherwise (an Auto mesh's partitioner places it as the program around it asks)."""
  mesh = explicit_mesh(x)
  return x if spec is None or mesh is None else _reshard_to(x, NamedSharding(mesh, spec))


def reshape(x: jax.Array, shape: Sequence[int]) -> jax.Array:
  """``x.reshape(shape)``; on Explicit mesh axes with the output typed as the same bytes' layout: the dims are grouped
  into runs of equal size before and after, and each run's mesh axes (its dims' in order) go to its first output dim
  (a dim split into several keeps its sharding on the leading one; dims merged into one take theirs in order), which
  jax's reshape leaves to its caller where a run both splits and merges dims."""
  shape = tuple(int(d) for d in shape)
  if -1 in shape:
    known = math.prod(d for d in shape if d != -1)
    shape = tuple(x.size // known if d == -1 else d for d in shape)
  mesh = explicit_mesh(x)
  if mesh is None or tuple(x.shape) == shape:
    return x.reshape(shape)
  spec = tuple(jax.typeof(x).sharding.spec) + (None,) * (x.ndim - len(jax.typeof(x).sharding.spec))
  out: list = [None] * len(shape)
  i = j = 0
  while i < x.ndim or j < len(shape):
    i0, j0, a, b = i, j, 1, 1
    if i < x.ndim:
      a *= x.shape[i]
      i += 1
    if j < len(shape):
      b *= shape[j]
      j += 1
    while a != b:
      if a < b:
        a *= x.shape[i]
        i += 1
      else:
        b *= shape[j]
        j += 1
    axes = tuple(ax for e in spec[i0:i] if e is not None for ax in (e if isinstance(e, tuple) else (e,)))
    if j > j0 and axes:
      out[j0] = axes[0] if len(axes) == 1 else axes
  return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, P(*out)))


class _Types:
  """The primal types' shardings, a pytree without leaves: it rides in a ``custom_vjp``'s residuals as static data.
  One ``(treedef, shardings)`` per differentiable argument, a sharding (or None) per leaf."""

  def __init__(self, args: tuple):
    self.args = args


jax.tree_util.register_pytree_node(_Types, lambda t: ((), t.args), lambda args, _: _Types(args))


def _is_leaf(p) -> bool:
  return hasattr(p, "perturbed")  # a CustomVJPPrimal, what fwd gets under symbolic_zeros=True


def typed_vjp(fwd: Callable, bwd: Callable, nondiff_argnums: Sequence[int] = ()) -> tuple[Callable, Callable]:
  """``(fwd, bwd)`` of a ``custom_vjp`` whose bwd returns each array cotangent resharded to its primal's type
  (Explicit axes only; elsewhere nothing changes)."""
  nondiff = frozenset(nondiff_argnums)

  @functools.wraps(fwd)
  def typed_fwd(*args):
    out, res = fwd(*args)
    types = []
    for i, a in enumerate(args):
      if i not in nondiff:
        leaves, tree = jax.tree.flatten(a, is_leaf=_is_leaf)
        types.append((tree, tuple(explicit_sharding(getattr(v, "value", v)) for v in leaves)))
    return out, (_Types(tuple(types)), res)

  @functools.wraps(bwd)
  def typed_bwd(*args):
    *static, (types, res), g = args
    cts = bwd(*static, res, g)
    out = []
    for ct, (tree, shardings) in zip(cts, types.args, strict=True):
      if ct is None or not any(s is not None for s in shardings):
        out.append(ct)
        continue
      leaves = tree.flatten_up_to(ct)
      out.append(tree.unflatten([_reshard_to(c, s) for c, s in zip(leaves, shardings)]))
    return tuple(out)

  return typed_fwd, typed_bwd
