"""How a te_jax op becomes a JAX primitive: one place for the lowering, batching and partitioning plumbing.

Each op is a pair of primitives, the pattern of jax's own cuDNN ops and of Transformer Engine:

- the *inner* primitive sees one device's buffers. It lowers to the op's XLA FFI handler on each platform that has
  one (``te_<op>_<platform>``) and to ``mlir.lower_fun(reference)`` everywhere else, so the pure-JAX reference is the
  fallback on any machine;
- the *outer* primitive is what the op's Python function binds. Its lowering wraps the inner one in
  ``custom_partitioning`` with a Shardy rule and a ``partition`` callback, so that under ``jax.jit`` with sharded
  inputs the handler runs shard-local and the op adds its own collectives (amax max-reduced, sums psum-reduced)
  instead of XLA all-gathering the inputs. Its vmap rule is the op's.

On a mesh with Explicit axes (``jax.make_mesh``'s default) every value's type carries its sharding, and each
primitive must say its outputs' (jax's "sharding in types"). The op's ``partition`` callback already says it: from
the operands' shardings it picks the ones the handler runs on and the outputs' they give. So the abstract evaluation
calls it with the operands' types (and the output sharding a caller asks for, ``wanted_sharding``) and types the
outputs with its answer; ``Op.bind`` then pins each output to its type, so that the partitioner lays it out as the
type says. Nothing of a shard-local computation (the partition's ``lower_fn``, the reference lowering) may carry
Explicit types: it is traced and lowered with the mesh's axes read as Auto, as the partition callback sees them
anyway, since XLA has no implementation of the sharding annotations Explicit types would add there.

Static parameters travel as one frozen, hashable config dataclass in the primitive parameter ``config``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.interpreters import batching, mlir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from te_jax._core import native
from te_jax._core.dtypes import HALF_DTYPES as _HALF
from te_jax._core.explicit import explicit_mesh
from te_jax._core.jax_compat import apply_primitive, require_devices_during_lowering
from te_jax._core.manual_axes import to_common_varying

__all__ = ["NativeSignature", "Op", "define_op", "full_spec", "mesh_axes", "output_aval", "sequential_batcher"]


def full_spec(sharding, ndim: int) -> tuple:
  """The PartitionSpec entries of ``sharding`` padded to ``ndim`` (all None when it is not a NamedSharding)."""
  spec = tuple(sharding.spec) if isinstance(sharding, jax.sharding.NamedSharding) else ()
  return spec + (None,) * (ndim - len(spec))


def mesh_axes(*entries) -> tuple[str, ...]:
  """The mesh axis names in PartitionSpec entries (None, a name, or a tuple of names), in order."""
  axes = []
  for e in entries:
    if e is not None:
      axes.extend(e if isinstance(e, tuple) else (e,))
  return tuple(axes)


def output_aval(like: jax.core.ShapedArray, shape, dtype) -> jax.core.ShapedArray:
  """An output type of an op whose input is ``like``: inside ``shard_map``, it varies over the mesh axes ``like``
  varies over (so ``check_vma`` sees per-shard values as such)."""
  if like.manual_axis_type.empty:
    return jax.core.ShapedArray(shape, dtype)
  sharding = jax.sharding.NamedSharding(like.sharding.mesh, jax.sharding.PartitionSpec())
  return jax.core.ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=like.manual_axis_type)


class Op:
  """The two primitives of one op; ``bind(*args, config=...)`` returns the outer primitive's results."""

  def __init__(self, inner: Primitive, outer: Primitive):
    self.inner = inner
    self.outer = outer

  def bind(self, *args, config) -> list[jax.Array]:
    """Inside ``shard_map`` the operands are first cast to vary over the same manual axes, as jax's own ops do, so
    that each result's type says it varies over every axis any operand does. With Explicit axes each result is
    pinned to the sharding its type says (``jax.sharding.reshard`` to it: a constraint, no data movement where the
    partition already lays it out so)."""
    outs = self.outer.bind(*to_common_varying(*args), config=config)
    if explicit_mesh(*outs) is None:
      return outs
    return [jax.sharding.reshard(o, jax.typeof(o).sharding) for o in outs]


def define_op(
    name: str,
    *,
    abstract_eval: Callable[..., Sequence[jax.core.ShapedArray]],
    reference: Callable[..., Sequence[jax.Array]],
    native_platforms: Sequence[str],
    ffi_attributes: Callable[[Any], dict[str, Any]],
    native_signature: Callable[[str, Any, Sequence[Any], Sequence[Any]], "NativeSignature"] | None = None,
    partition: Callable[..., Any],
    sharding_rule: Callable[..., str],
    batcher: Callable[..., Any] | None = None,
    wanted_sharding: Callable[[Any], Sequence[Any] | None] | None = None,
) -> Op:
  """Creates and registers the inner and outer primitives of an op.

  Args:
    name: the op name; primitives are ``te_<name>`` and ``te_<name>_outer``.
    abstract_eval: ``(*avals, config) -> [ShapedArray]``.
    reference: the pure-jnp reference, ``(*args, config) -> [Array]``; also the default lowering.
    native_platforms: the platforms ("cpu", "cuda") with an FFI handler, whose target is ``te_<name>_<platform>``.
    ffi_attributes: ``config -> {attribute: numpy scalar}`` passed to the FFI handler.
    native_signature: for handlers with a fixed signature whose optional operands/results the primitive omits,
      ``(platform, config, avals_in, avals_out) -> NativeSignature``, or None where the handler does not take the
      config (that call lowers to the reference).
    partition: custom_partitioning's partition callback, called as ``partition(config, mesh, arg_shapes,
      result_shape)``; its ``lower_fn`` must bind ``Op.inner``.
    sharding_rule: ``(config, mesh, value_types, result_types) -> Shardy rule string``.
    batcher: the vmap rule of the outer primitive; defaults to ``sequential_batcher``.
    wanted_sharding: ``config -> [PartitionSpec | None per result] | None``: the output shardings a caller asked
      for (``gemm``'s ``out_sharding``), which ``partition`` sees as the results' when it types them under
      Explicit axes; by default none (each result replicated, so ``partition`` keeps what the operands give).
  """
  typed_eval = _typed_abstract_eval(abstract_eval, partition, wanted_sharding)
  inner = Primitive(f"te_{name}")
  inner.multiple_results = True
  inner.def_impl(apply_primitive(inner))
  inner.def_abstract_eval(typed_eval)
  reference_lowering = _auto_axes_lowering(
      mlir.lower_fun(_with_rounded_operands(reference), multiple_results=True))
  mlir.register_lowering(inner, reference_lowering)
  for platform in native_platforms:
    mlir.register_lowering(
        inner,
        _auto_axes_lowering(_native_lowering(name, platform, f"te_{name}_{platform}", ffi_attributes,
                                             native_signature, reference_lowering)),
        platform=platform,
    )

  outer = Primitive(f"te_{name}_outer")
  outer.multiple_results = True
  outer.def_impl(apply_primitive(outer))
  outer.def_abstract_eval(typed_eval)

  def impl(config, *args):
    return tuple(inner.bind(*args, config=config))

  partitioned = custom_partitioning(impl, static_argnums=(0,))
  partitioned.def_partition(partition=_auto_axes_partition(partition), sharding_rule=sharding_rule)

  def outer_lowering(*args, config):
    return partitioned(config, *args)

  mlir.register_lowering(outer, mlir.lower_fun(outer_lowering, multiple_results=True))
  require_devices_during_lowering(outer)
  op = Op(inner, outer)
  batching.primitive_batchers[outer] = batcher or sequential_batcher(op)
  return op


class _Operand(NamedTuple):
  """What ``partition`` reads of an operand or result: its shape, dtype and sharding."""

  shape: tuple[int, ...]
  dtype: Any
  sharding: jax.sharding.NamedSharding


def _typed_abstract_eval(abstract_eval, partition, wanted_sharding):
  """``abstract_eval`` whose results, where an operand's type names Explicit mesh axes, carry the shardings
  ``partition`` gives them for the operands' shardings (and the ``wanted_sharding`` of the results)."""

  def rule(*avals, config):
    outs = abstract_eval(*avals, config=config)
    mesh = explicit_mesh(*avals)
    if mesh is None:
      return outs
    replicated = NamedSharding(mesh, P())
    args = tuple(_Operand(a.shape, a.dtype, a.sharding if explicit_mesh(a) is not None else replicated)
                 for a in avals)
    wanted = (wanted_sharding and wanted_sharding(config)) or [None] * len(outs)
    results = tuple(_Operand(o.shape, o.dtype, NamedSharding(mesh, P() if w is None else w))
                    for o, w in zip(outs, wanted, strict=True))
    _, _, out_shardings, _ = partition(config, mesh, args, results)
    explicit = set(mesh.explicit_axes)
    return [o.update(sharding=NamedSharding(mesh, P(*(_keep_axes(e, explicit) for e in full_spec(s, o.ndim)))))
            for o, s in zip(outs, out_shardings, strict=True)]

  return rule


def _keep_axes(entry, axes: set):
  """A PartitionSpec entry with only the mesh axes in ``axes``."""
  kept = tuple(a for a in mesh_axes(entry) if a in axes)
  return None if not kept else (kept[0] if len(kept) == 1 else kept)


def _auto_mesh():
  """The context mesh with its Explicit axes read as Auto (nothing changes where it has none)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.explicit_axes:
    return None
  return mesh.update_axis_types({a: AxisType.Auto for a in mesh.explicit_axes})


def _untyped(aval):
  """``aval`` without Explicit mesh axes in its sharding (the shard-local value it is lowered as)."""
  if not isinstance(aval, jax.core.ShapedArray) or explicit_mesh(aval) is None:
    return aval
  mesh = aval.sharding.mesh
  auto = mesh.update_axis_types({a: AxisType.Auto for a in mesh.explicit_axes})
  return aval.update(sharding=NamedSharding(auto, P(*(None,) * aval.ndim)))


def _auto_axes_lowering(lowering):
  """``lowering`` run with the context mesh's Explicit axes read as Auto and its operands' and results' types without
  them: what it emits is one shard's computation (or a whole one, unsharded), where Explicit types would make jax
  annotate every value with a sharding that XLA cannot implement inside a partitioned call."""

  def lowered(ctx, *args, config):
    auto = _auto_mesh()
    if auto is None and not any(explicit_mesh(a) is not None for a in ctx.avals_in):
      return lowering(ctx, *args, config=config)
    ctx = ctx.replace(avals_in=[_untyped(a) for a in ctx.avals_in], avals_out=[_untyped(a) for a in ctx.avals_out])
    if auto is None:
      return lowering(ctx, *args, config=config)
    with jax.sharding.use_abstract_mesh(auto):
      return lowering(ctx, *args, config=config)

  return lowered


def _auto_axes_partition(partition):
  """``partition`` whose ``lower_fn`` is traced with the context mesh's Explicit axes read as Auto: it computes one
  shard's outputs, whose values carry no mesh sharding (see ``_auto_axes_lowering``)."""

  def wrapped(config, mesh, arg_shapes, result_shape):
    out_mesh, lower_fn, result_shardings, arg_shardings = partition(config, mesh, arg_shapes, result_shape)

    def shard_local(*args):
      auto = _auto_mesh()
      if auto is None:
        return lower_fn(*args)
      with jax.sharding.use_abstract_mesh(auto):
        return lower_fn(*args)

    return out_mesh, shard_local, result_shardings, arg_shardings

  return wrapped


def _with_rounded_operands(reference: Callable) -> Callable:
  """``reference`` reading its 16-bit float operands as the rounded values a handler reads from its buffers.

  Under ``jax.jit`` XLA may keep a bfloat16/float16 producer's result in float32 where it feeds another op
  (``xla_allow_excess_precision``), so without this the reference, lowered inline, would see values its handler
  never sees and the two paths would differ in the last bits. Reading the operand's 16 bits (a bitcast, behind an
  optimization barrier so that it is not folded away) makes XLA produce exactly those bits, subnormals included;
  where the operand is already rounded it changes nothing.
  """

  def rounded(*args, config):
    return reference(*(_round(a) for a in args), config=config)

  return rounded


def _round(x):
  if not hasattr(x, "dtype") or jax.numpy.dtype(x.dtype) not in _HALF:
    return x
  bits = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, np.uint16))
  return jax.lax.bitcast_convert_type(bits, x.dtype)


class NativeSignature(NamedTuple):
  """How a primitive's operands/results map onto a fixed-signature FFI handler.

  Attributes:
    extra_operands: constant arrays appended to the primitive's operands (e.g. an empty optional bias).
    result_avals: every result the handler returns (workspaces included: XLA allocates them with the outputs).
    keep: which of those results the primitive returns, in order; one whose shape differs from the primitive's
      result (same size: a handler that sees 2-D rows) is reshaped to it.
    operand_order: the handler's operands as indices into (the primitive's operands, then ``extra_operands``);
      None: in that order.
    operand_shapes: the shapes the handler reads the primitive's operands as (each of the same size as the operand:
      a handler that sees 2-D rows); None: as they are.
  """

  extra_operands: Sequence[np.ndarray]
  result_avals: Sequence[Any]
  keep: Sequence[int]
  operand_order: Sequence[int] | None = None
  operand_shapes: Sequence[tuple[int, ...]] | None = None


def _native_lowering(name, platform, target, ffi_attributes, native_signature, reference_lowering):
  def lowering(ctx, *args, config):
    if not native.has_target(platform, target):
      native.warn_fallback(platform, name)
      return reference_lowering(ctx, *args, config=config)
    call = jax.ffi.ffi_lowering(target)
    if native_signature is None:
      return call(ctx, *args, **ffi_attributes(config))
    sig = native_signature(platform, config, ctx.avals_in, ctx.avals_out)
    if sig is None:  # a config the handler does not take
      return reference_lowering(ctx, *args, config=config)
    extra_avals = [jax.core.ShapedArray(a.shape, a.dtype) for a in sig.extra_operands]
    extra = [mlir.ir_constant(a) for a in sig.extra_operands]
    prim_avals = list(ctx.avals_in)
    if sig.operand_shapes is not None and any(tuple(s) != a.shape for s, a in zip(sig.operand_shapes, prim_avals)):
      shapes = [tuple(s) for s in sig.operand_shapes]
      reshape_in = mlir.lower_fun(lambda *vs: [v if v.shape == s else v.reshape(s) for v, s in zip(vs, shapes)],
                                  multiple_results=True)
      args = [v if isinstance(v, ir.Value) else v[0] for v in reshape_in(ctx.replace(), *args)]
      prim_avals = [jax.core.ShapedArray(s, a.dtype) for s, a in zip(shapes, prim_avals)]
    avals_in, operands = [*prim_avals, *extra_avals], [*args, *extra]
    if sig.operand_order is not None:
      avals_in, operands = [avals_in[i] for i in sig.operand_order], [operands[i] for i in sig.operand_order]
    results = call(ctx.replace(avals_in=avals_in, avals_out=list(sig.result_avals)), *operands,
                   **ffi_attributes(config))
    kept = [results[i] for i in sig.keep]
    handler_avals = [sig.result_avals[i] for i in sig.keep]
    if all(h.shape == a.shape for h, a in zip(handler_avals, ctx.avals_out)):
      return kept
    reshape = mlir.lower_fun(lambda *vs: [v.reshape(a.shape) for v, a in zip(vs, ctx.avals_out)],
                             multiple_results=True)
    return reshape(ctx.replace(avals_in=handler_avals), *kept)

  return lowering


def sequential_batcher(op: Op):
  """A vmap rule that runs the op once per batch element (``lax.map``).

  Right for ops with reductions over the whole input (amax, column sums), whose per-element results a single
  call over the stacked input would mix.
  """

  def rule(args, dims, *, config):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not batched
    moved = [
        jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None else jax.numpy.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    outs = jax.lax.map(lambda xs: tuple(op.bind(*xs, config=config)), tuple(moved))
    return list(outs), [0] * len(outs)

  return rule
