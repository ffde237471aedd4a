"""The options of each linen module (``te_jax.flax.X``) against those of its NNX twin (``te_jax.nnx.X``).

The modules compared are the ``flax.linen.Module`` subclasses in ``te_jax.flax.__all__`` and the ``flax.nnx.Module``
subclasses in ``te_jax.nnx.__all__``, by name; a module on one side only is a difference too. A linen module's
options are its dataclass fields (less ``parent`` and ``name``), an NNX module's the parameters of its ``__init__``
(less ``self`` and ``rngs``).

Every difference is in one of two tables:

- ``CONVENTIONS``: where the two frameworks legitimately spell an option differently (NNX builds its variables in
  the constructor, so it takes the input sizes that linen reads off the first call, ...), each with its reason;
- ``KNOWN_GAPS``: an option (or a whole module) one side lacks and could have, with the side that lacks it.

The test asserts that the actual differences are exactly those of the two tables: an option added to one side only
fails it (add it to the other side, or list it here with its reason), and so does closing a gap (an option added to
the side that lacked it): then remove its ``KNOWN_GAPS`` entry. Options on both sides must have the same default
(initializers compared by what they give on a fixed key and shape, since linen's and NNX's initializer objects are
different functions), unless ``CONVENTIONS`` lists the option under the same name on both sides, with the reason
its defaults differ.
"""

import dataclasses
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import te_jax.flax as te_flax
import te_jax.nnx as te_nnx

# (module, linen options, NNX options): the reason the two spell it so. A row whose two sides are the same single
# option says that option's default differs on purpose.
CONVENTIONS = {
    ("DenseGeneral", ("features",), ("in_features", "out_features")):
        "NNX creates the kernel in the constructor, so it takes the contracted sizes too (nn.DenseGeneral's features "
        "against nnx.LinearGeneral's in_features and out_features)",
    ("DenseGeneral", ("batch_dims",), ("batch_axis",)):
        "NNX creates the kernel in the constructor, so it takes the batch axes with their sizes (nn.DenseGeneral's "
        "batch_dims against nnx.LinearGeneral's batch_axis mapping)",
    ("DenseGeneral", (), ("kernel_metadata", "bias_metadata")):
        "NNX variables take metadata when created (nnx.LinearGeneral's keywords); linen's come from the initializer "
        "(nn.with_logical_partitioning) and kernel_axes / bias_axes",
    ("LayerNorm", (), ("num_features",)):
        "NNX creates scale and bias in the constructor (nnx.LayerNorm's num_features); linen reads the input's last "
        "dim",
    ("LayerNormDenseGeneral", ("features",), ("in_features", "out_features")):
        "NNX creates the norm's parameters and the kernel in the constructor, so it takes the hidden size too",
    ("LayerNormMLP", (), ("in_features",)):
        "NNX creates the norm's parameters and both kernels in the constructor; linen reads the hidden size off the "
        "input",
    ("MultiHeadAttention", (), ("in_features",)):
        "NNX creates the projections in the constructor; linen reads the hidden size off the input",
    ("MultiHeadAttention", (), ("attention_type",)):
        "linen picks its projections (one qkv kernel, or query and kv) at init from whether the call gives inputs_kv; "
        "NNX builds them before any call",
    ("TransformerLayer", (), ("cross_attention",)):
        "linen creates a decoder's cross attention when init sees encoded; NNX builds it before any call",
    ("MultiHeadAttention", (), ("decode",)):
        "NNX takes decode at construction, as nnx.MultiHeadAttention does (and the call may override it); linen takes "
        "it per call",
    ("TransformerLayer", (), ("decode",)):
        "NNX takes decode at construction, as nnx.MultiHeadAttention does (and the call may override it); linen takes "
        "it per call",
    ("MoEBlock", (), ("in_features",)):
        "NNX creates the router, the experts' kernels and the norm in the constructor; linen reads the hidden size off "
        "the input",
}

# (module, option; None for the whole module): (the side that lacks it, what it is).
KNOWN_GAPS: dict = {}

REQUIRED = "<required>"
_SKIP_LINEN, _SKIP_NNX = {"parent", "name"}, {"self", "rngs"}


def _modules(package, base) -> dict[str, type]:
  return {n: getattr(package, n) for n in package.__all__
          if inspect.isclass(getattr(package, n)) and issubclass(getattr(package, n), base)}


LINEN, NNX = _modules(te_flax, nn.Module), _modules(te_nnx, nnx.Module)


def linen_options(cls) -> dict:
  """A linen module's options and their defaults (``REQUIRED`` for none)."""
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in _SKIP_LINEN:
      continue
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
    else:
      out[f.name] = REQUIRED
  return out


def nnx_options(cls) -> dict:
  """An NNX module's constructor options and their defaults (``REQUIRED`` for none)."""
  out = {}
  for p in inspect.signature(cls.__init__).parameters.values():
    if p.name in _SKIP_NNX:
      continue
    assert p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD), f"te_jax.nnx.{cls.__name__} hides options in *{p.name}"
    out[p.name] = REQUIRED if p.default is p.empty else p.default
  return out


def actual_differences() -> dict[tuple[str, str | None], str]:
  """(module, option or None) -> the side lacking it, for every module and option on one side only."""
  out = {}
  for module in sorted(set(LINEN) | set(NNX)):
    if module not in NNX or module not in LINEN:
      out[(module, None)] = "nnx" if module not in NNX else "linen"
      continue
    linen, nnx_ = set(linen_options(LINEN[module])), set(nnx_options(NNX[module]))
    out.update({(module, o): "nnx" for o in linen - nnx_})
    out.update({(module, o): "linen" for o in nnx_ - linen})
  return out


def _renamings():
  return {k: v for k, v in CONVENTIONS.items() if k[1] != k[2]}


def listed_differences() -> dict[tuple[str, str | None], str]:
  out = {}
  for module, linen, nnx_ in _renamings():
    out.update({(module, o): "nnx" for o in linen})
    out.update({(module, o): "linen" for o in nnx_})
  out.update({key: side for key, (side, _) in KNOWN_GAPS.items()})
  return out


def _initializer(value) -> bool:
  return callable(value) and not isinstance(value, type)


def same_default(a, b) -> bool:
  """Whether two defaults are the same: equal values, or initializers that give the same arrays."""
  if a is b:
    return True
  if _initializer(a) and _initializer(b):
    key = jax.random.key(0)
    for shape in ((16, 8), (4, 6, 10)):
      for dtype in (jnp.float32, jnp.bfloat16):
        x, y = a(key, shape, dtype), b(key, shape, dtype)
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(np.asarray(x, np.float32),
                                                                          np.asarray(y, np.float32)):
          return False
    return True
  if _initializer(a) or _initializer(b):
    return False
  try:
    return bool(a == b) and type(a) is type(b)
  except Exception:  # noqa: BLE001 - values without a plain == (arrays) are different defaults unless identical
    return False


def test_the_tables_are_well_formed():
  for (module, linen, nnx_), reason in CONVENTIONS.items():
    assert module in LINEN and module in NNX, f"CONVENTIONS: {module} is not a module of both packages"
    assert isinstance(linen, tuple) and isinstance(nnx_, tuple) and (linen or nnx_), (module, linen, nnx_)
    assert linen == nnx_ or not set(linen) & set(nnx_), f"CONVENTIONS: {module} {linen} / {nnx_}"
    assert isinstance(reason, str) and reason, f"CONVENTIONS: {module} {linen} / {nnx_} gives no reason"
  for (module, option), (side, note) in KNOWN_GAPS.items():
    assert side in ("linen", "nnx") and note, f"KNOWN_GAPS: {module}.{option}: {side!r}, {note!r}"
  listed = [(m, o) for m, linen, nnx_ in _renamings() for o in linen + nnx_]
  assert len(listed) == len(set(listed)), "CONVENTIONS lists an option twice"
  both = set(listed) & set(KNOWN_GAPS)
  assert not both, f"in CONVENTIONS and KNOWN_GAPS both: {sorted(both, key=str)}"


def test_the_modules_are_found():
  """The comparison sees the modules (a renamed base class or ``__all__`` would otherwise make it vacuous)."""
  common = {"DenseGeneral", "Fp8DotGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP",
            "DotProductAttention", "MultiHeadAttention", "TransformerLayer"}
  assert common <= set(LINEN) and common <= set(NNX)


def test_options_differ_only_as_listed():
  actual, listed = actual_differences(), listed_differences()

  def show(diffs):
    return "\n".join(f"  {m}.{o or '<module>'}: {'NNX' if s == 'nnx' else 'linen'} lacks it"
                     for (m, o), s in sorted(diffs, key=str))

  unlisted = set(actual.items()) - set(listed.items())
  stale = set(listed.items()) - set(actual.items())
  message = []
  if unlisted:
    message.append("differences in neither CONVENTIONS nor KNOWN_GAPS (give the other side the option, or list it "
                   "with its reason):\n" + show(unlisted))
  if stale:
    message.append("listed, but not (or no longer) a difference (a gap closed? remove its entry):\n" + show(stale))
  assert not message, "\n".join(message)


def test_shared_options_have_the_same_defaults():
  differ = {}
  for module in sorted(set(LINEN) & set(NNX)):
    linen, nnx_ = linen_options(LINEN[module]), nnx_options(NNX[module])
    for option in sorted(set(linen) & set(nnx_)):
      if not same_default(linen[option], nnx_[option]):
        differ[(module, option)] = f"linen {linen[option]!r}, NNX {nnx_[option]!r}"
  listed = {(m, linen[0]) for m, linen, nnx_ in CONVENTIONS if linen == nnx_}
  unlisted = "\n".join(f"  {m}.{o}: {d}" for (m, o), d in sorted(differ.items()) if (m, o) not in listed)
  stale = sorted(listed - set(differ))
  assert not unlisted, f"defaults that differ, not listed in CONVENTIONS:\n{unlisted}"
  assert not stale, f"CONVENTIONS lists a default difference that is none: {stale}"


def test_same_default_tells_initializers_apart():
  """The default comparison can fail: different initializers, and different values, are told apart."""
  assert same_default(nn.initializers.lecun_normal(), nnx.initializers.lecun_normal())
  assert not same_default(nn.initializers.lecun_normal(), nnx.initializers.variance_scaling(1.0, "fan_in", "normal"))
  assert not same_default(nn.initializers.zeros_init(), nnx.initializers.ones_init())
  assert same_default(jnp.float32, jnp.float32) and not same_default(jnp.float32, jnp.bfloat16)
  assert not same_default(1e-6, 1e-5) and not same_default(None, REQUIRED) and not same_default(1, True)
