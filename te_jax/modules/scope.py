"""What a module body asks of its framework: ``Scope``.

A body (``te_jax.modules.dense``, ...) is written once, as two functions of a scope and the module's options: one
declares the parameters and the FP8 state from the sizes the layer is built for, the other computes the layer's
output, reading the parameters back by name. ``te_jax.flax`` runs both in a linen module's ``__call__`` (linen
creates parameters at ``init`` from the input's shape); ``te_jax.nnx`` runs the first in the module's constructor
(from its ``in_features``) and the second in its ``__call__``. Names, shapes, initializers and the order in which a
body asks for them are the same in both, so a linen checkpoint and an NNX module hold the same parameters, and
random initialization draws the same keys in the same order.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from te_jax.fused.quantizer import DenseFp8Meta
from te_jax.modules.axes import Initializer
from te_jax.recipe import Recipe

__all__ = ["Scope", "fields_of"]


class Scope(abc.ABC):
  """The variables of one module instance, as its framework keeps them."""

  @property
  @abc.abstractmethod
  def where(self) -> str:
    """The module, for error messages: its path in the model, or its class."""

  @abc.abstractmethod
  def param(self, name: str, init: Initializer, shape: tuple[int, ...], dtype: Any, *, n_in: int | None = None,
            part_axis: int | None = None, axes: tuple[str | None, ...] = ()) -> jax.Array:
    """The parameter ``name`` of ``shape``: created on first use, else read back (a stored one of another shape
    raises, naming the parameter).

    ``init(key, shape, dtype)`` creates it; with ``n_in``, ``init`` sees the 2-D ``(prod(shape[:n_in]),
    prod(shape[n_in:]))`` shape and its value is reshaped (``n_in=0``: the flat ``(prod(shape),)``), as Flax's dense
    layers initialize their kernels and biases; with ``part_axis`` (a feature axis), the kernel stacks separate
    projections along it, each initialized as a kernel of its own with its own key of ``jax.random.split``. ``axes``:
    logical axis names, as the framework attaches them (an initializer that names its axes itself keeps them; both
    at once raise)."""

  @abc.abstractmethod
  def declare_fp8_state(self, recipe: Recipe | None, prefixes: tuple[str, ...] = ("",), *,
                        groups: int | None = None) -> None:
    """Where the framework creates variables ahead of the call (NNX): the FP8 state of each GEMM (one per prefix)
    that ``recipe`` keeps; with ``groups``, one state per group of a grouped GEMM (``te_jax.grouped_dense``'s
    experts): each variable with a leading ``(groups,)`` dim. A no-op where the call creates them (linen)."""

  @abc.abstractmethod
  def fp8_state(self, recipe: Recipe | None, x: jax.Array, prefixes: tuple[str, ...] = ("",), *,
                groups: int | None = None) -> tuple[jax.Array, tuple[DenseFp8Meta | None, ...]]:
    """``(x, metas)``: the FP8 state of each GEMM (one per prefix) for the fused ops, None where ``recipe`` keeps
    none (with ``groups``, as ``declare_fp8_state`` declares it); a state the variables hold anyway is tied to
    ``x``, so the step hands it back unchanged."""

  @abc.abstractmethod
  def declare_dropout(self, name: str, rate: float, rng_name: str, broadcast_dims: tuple[int, ...] = ()) -> None:
    """Where the framework creates submodules ahead of the call (NNX): a dropout ``name`` of ``rate``, its masks from
    the ``rng_name`` stream, one mask value shared along ``broadcast_dims``. A no-op where the call creates it
    (linen)."""

  @abc.abstractmethod
  def dropout(self, name: str, rate: float, rng_name: str, x: jax.Array, deterministic: bool = False,
              broadcast_dims: tuple[int, ...] = ()) -> jax.Array:
    """``x`` through the dropout ``name`` (``rate``, masks from the ``rng_name`` stream, shared along
    ``broadcast_dims``, as declared); with ``deterministic``, ``x`` itself (linen still names the dropout then, as
    Flax's inline ``nn.Dropout`` does)."""

  @abc.abstractmethod
  def declare_rng(self, name: str, rng_name: str, needed: bool) -> None:
    """Where the framework creates variables ahead of the call (NNX): ``name``, a stream of keys forked from the
    ``rng_name`` stream, when ``needed``. A no-op where the call draws from the stream itself (linen)."""

  @abc.abstractmethod
  def rng(self, name: str, rng_name: str) -> jax.Array:
    """A fresh key of the ``rng_name`` stream (NNX: of the stream ``declare_rng`` made as ``name``)."""

  @abc.abstractmethod
  def submodule(self, name: str, options: Any, in_features: Any = None, **build: Any) -> Callable[..., Any]:
    """The child module ``name`` that ``options`` (a ``te_jax.modules`` options dataclass) describes, over inputs
    whose contracted sizes are ``in_features``: the framework's module of those options, created where the framework
    creates children (NNX: in the constructor; linen: at the call), else the one created then. ``build``: the
    arguments an NNX constructor takes beyond the options (``attention_type``, ``decode``), which linen reads from
    the call."""


def fields_of(options: Any) -> dict[str, Any]:
  """An options dataclass's fields by name (not copied, unlike ``dataclasses.asdict``): the arguments that build
  its module."""
  return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
