"""The architecture, checked from the source: te_jax's layers import only downward, there are no import cycles, no
module takes a private name (one not in the other module's ``__all__``) from another, and only the compat module
touches JAX's private APIs.

Layers, bottom to top: ``te_jax._core`` and ``te_jax.recipe`` (infrastructure); ``te_jax.ops`` (primitives);
``te_jax.fused`` (differentiable ops built from several primitives); ``te_jax.modules`` (the modules' framework-neutral
bodies); ``te_jax.flax`` (Flax linen modules) and beside it ``te_jax.nnx`` (Flax NNX modules, which may use
``te_jax.flax.params``' axis names and checks); then the package
itself and ``te_jax.doctor``; then ``te_jax.compare`` (BF16 against FP8 on a model), which may use everything.

The public API: what the ``__all__`` of ``te_jax``, ``te_jax.flax``, ``te_jax.nnx`` and ``te_jax.ops`` list is what
users call, each name either used by the README, docs/ or examples/ (``PUBLIC``) or one of a few public names those
leave to the docstrings (``DOCSTRING_API``, each with its reason); a helper one layer shares with another is imported
from the module that defines it (and lists it in its own ``__all__``), never through a package's ``__init__``.
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "te_jax"
LAYERS = {"te_jax._core": 0, "te_jax.recipe": 0, "te_jax.ops": 1, "te_jax.fused": 2, "te_jax.modules": 3,
          "te_jax.flax": 4, "te_jax.nnx": 4, "te_jax.doctor": 5, "te_jax": 5, "te_jax.compare": 6}
JAX_COMPAT = "te_jax._core.jax_compat"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def layer(module: str) -> int:
  """The layer of a module: that of the longest prefix in LAYERS."""
  prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
  return LAYERS[prefix]


def exported(module: str) -> set[str] | None:
  """The names in a module's ``__all__`` (None when it has none)."""
  for node in TREES[module].body:
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      return set(ast.literal_eval(node.value))
  return None


def imports(module: str):
  """(imported module, name or None, line) for every te_jax import of ``module``, anywhere in its source."""
  package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(TREES[module]):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, None, node.lineno
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
      for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:  # a submodule
          yield f"{base}.{alias.name}", None, node.lineno
        else:
          yield base, alias.name, node.lineno


def edges():
  for module in MODULES:
    for target, name, line in imports(module):
      if target.split(".")[0] == "te_jax":
        yield module, target, name, line


def test_every_module_is_in_a_layer():
  assert {layer(m) for m in MODULES} == {0, 1, 2, 3, 4, 5, 6}


def test_imports_go_down_the_layers():
  upward = [f"{m}:{line} imports {t} (layer {layer(t)} above {layer(m)})" for m, t, _, line in edges()
            if t in MODULES and layer(t) > layer(m)]
  assert not upward, "\n".join(upward)


def test_no_import_cycles():
  graph = {m: sorted({t for src, t, _, _ in edges() if src == m and t in MODULES and t != m}) for m in MODULES}
  # A package's __init__ importing its own submodules is how the public API is listed, not a cycle through them.
  graph = {m: [t for t in ts if not t.startswith(m + ".")] for m, ts in graph.items()}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for t in graph[m]:
      if state.get(t) == "open":
        cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
      elif t not in state:
        visit(t)
    stack.pop()
    state[m] = "done"

  for m in graph:
    if m not in state:
      visit(m)
  assert not cycles, "\n".join(cycles)


def test_no_private_name_crosses_modules():
  bad = []
  for module, target, name, line in edges():
    if name is None or target == module or target not in MODULES:
      continue
    names = exported(target)
    if name.startswith("_") or names is None or name not in names:
      bad.append(f"{module}:{line} takes {name!r} from {target}, which does not list it in __all__")
  for module, tree in TREES.items():  # attribute access: te_jax_module._private
    aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in n.names if (getattr(n, "module", None) or a.name).startswith("te_jax")}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        bad.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
  assert not bad, "\n".join(bad)


def test_every_module_lists_its_interface():
  """Each module says which of its names other modules may use; packages that only hold modules may say nothing."""
  missing = [m for m in MODULES if exported(m) is None and any(
      isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_") for n in TREES[m].body)]
  assert not missing, missing


def test_private_jax_only_in_the_compat_module():
  users = sorted({f"{m}:{line}" for m in MODULES if m != JAX_COMPAT for t, _, line in imports(m)
                  if t == "jax._src" or t.startswith("jax._src.")})
  assert not users, users


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_stay_small(module):
  """A file past ~800 lines is two files."""
  assert len(MODULES[module].read_text().splitlines()) <= 800


# The public API, package by package: the names of ``__all__`` that the README, docs/ or examples/ use.
PUBLIC = {
    "te_jax": {
        "FP8_COLLECTION", "FP8_RESIDUAL", "QuantizedTensor", "ScalingMode", "activation", "apply_rope",
        "attention_backend", "autocast", "context_parallel_attention", "dense", "dot_general", "dot_product_attention",
        "expert_capacity", "expert_parallel_moe", "group_align", "grouped_dense", "layernorm", "layernorm_dense",
        "layernorm_mlp", "load_balancing_loss", "ops", "permute", "recipe", "route", "scaled_softmax",
        "SequenceDescriptor", "segment_positions", "to_zigzag", "unpermute", "update_expert_bias", "z_loss",
        "zigzag_order",
    },
    "te_jax.flax": {
        "DenseGeneral", "DotProductAttention", "FlaxLayout", "Fp8DotGeneral", "Fp8Einsum", "LOGICAL_AXES", "LayerNorm",
        "LayerNormDenseGeneral", "LayerNormMLP", "MultiHeadAttention", "RelativePositionBiases", "Softmax",
        "TransformerLayer", "accumulate_gradients", "calibrate", "convert_blocks", "convert_train_state",
        "flax_block_to_te", "logical_axis_rules", "restore_into_fp8", "split_fp8_state", "te_block_to_flax",
    },
    "te_jax.nnx": {
        "DenseGeneral", "DotProductAttention", "Fp8DotGeneral", "Fp8Einsum", "Fp8State", "LayerNorm",
        "LayerNormDenseGeneral", "LayerNormMLP", "MultiHeadAttention", "RelativePositionBiases", "Softmax",
        "TransformerLayer", "calibrate", "from_linen", "grad", "to_linen", "update_fp8_state", "value_and_grad",
    },
    "te_jax.ops": {"activation", "gemm", "norm", "quantize", "quantize_interleaved", "rope", "scale_update", "softmax"},
}
# The exceptions: public names of ``__all__`` that the documents leave to the docstrings, each with why a user calls
# it. A name here is user API all the same (tests call it through the package); not a helper exported for another
# layer's sake, which belongs in its defining module's ``__all__`` only.
DOCSTRING_API = {
    "te_jax": {
        "DenseFp8Meta": "the fp8_meta state te_jax.dense, layernorm_dense and layernorm_mlp take under DelayedScaling "
                        "(their docstrings and argument errors name te_jax.DenseFp8Meta)",
        "context_parallel_backend": "context_parallel_attention's attention_backend: which backend a call gets, why",
        "from_zigzag": "the inverse of to_zigzag: outputs back into the sequence's natural order",
        "make_attention_mask": "the mask dot_product_attention applies for a mask type, segment_ids and window, as an "
                               "array",
        "rope_frequencies": "the angles apply_rope takes (its freqs argument)",
        "scaled_masked_softmax": "scaled_softmax's masked form",
        "scaled_upper_triang_masked_softmax": "scaled_softmax's causal form",
    },
    "te_jax.flax": {
        "convert_like": "a checkpoint conversion applied to the optimizer state's parameter-shaped subtrees "
                        "(convert_train_state's building block, for a state of one's own)",
        "MoEBlock": "the mixture-of-experts MLP; its docstring shows the train step with its losses and expert bias",
    },
    "te_jax.nnx": {
        "AuxLoss": "the variables of MoEBlock's auxiliary losses, which a train step sums into its loss",
        "MoEBlock": "the mixture-of-experts MLP; its docstring shows the train step with its losses and expert bias",
    },
    "te_jax.ops": {
        "grouped_gemm": "the grouped (ragged) GEMMs of mixture-of-experts layers that te_jax.grouped_dense runs, "
                        "documented in its docstrings",
        "quantize_block": "the block-scaled quantize references (quantize_block_ref, quantize_nvfp4_ref), which the "
                          "block-scaling recipes and their kernels build on; documented in its docstrings",
    },
}
DOCUMENTS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT.parent / "docs").glob("*.md")),
             *sorted(f"examples/{p.name}" for p in (ROOT.parent / "examples").glob("*.py")))
# A name the documents use as another library's (``nn.make_attention_mask``, ``jax.grad``) is not te_jax's.
_FOREIGN = "".join(rf"(?<!\b{p}\.)" for p in ("nn", "nnx", "jax", "jnp", "np", "lax", "optax", "linen"))


def _used_in_documents(name: str) -> list[str]:
  pattern = re.compile(rf"{_FOREIGN}(?<!\w){re.escape(name)}(?!\w)")
  return [doc for doc in DOCUMENTS if pattern.search((ROOT.parent / doc).read_text())]


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_package_exports_are_the_public_api(package):
  """A package lists what users call: each name of its ``__all__`` is in PUBLIC or DOCSTRING_API, and each of those in
  its ``__all__``."""
  names = exported(package)
  public, docstring_api = PUBLIC[package], set(DOCSTRING_API[package])
  assert not public & docstring_api, f"{package}: in PUBLIC and DOCSTRING_API both: {sorted(public & docstring_api)}"
  unknown = sorted(names - public - docstring_api)
  assert not unknown, (f"{package}.__all__ lists {unknown}, neither in PUBLIC (used by the documents) nor in "
                       "DOCSTRING_API: a user's name goes in one of them; a helper another layer needs is imported "
                       "from its defining module's __all__ instead")
  stale = sorted((public | docstring_api) - names)
  assert not stale, f"PUBLIC / DOCSTRING_API list {stale}, which {package}.__all__ does not"
  assert all(isinstance(r, str) and r for r in DOCSTRING_API[package].values()), "each exception gives its reason"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_used_by_the_documents(package):
  """PUBLIC is what the README, docs/ and examples/ use: a name they do not mention belongs in DOCSTRING_API."""
  unused = sorted(n for n in PUBLIC[package] if not _used_in_documents(n))
  assert not unused, f"{package}: PUBLIC names no document uses: {unused} (move them to DOCSTRING_API, with why)"


def _package_names(module: str):
  """(package, name, line) for each name ``module`` takes from a public package's ``__init__``, by ``from package
  import name`` or as an attribute (``te_flax.name`` after ``import te_jax.flax as te_flax``); submodules and dunder
  names (``te_jax.__version__``) are not names of the API."""
  for target, name, line in imports(module):
    if target in PUBLIC and name is not None:
      yield target, name, line
  bound = {}  # local name -> the te_jax module it binds
  for node in ast.walk(TREES[module]):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "te_jax":
          bound[alias.asname or "te_jax"] = alias.name if alias.asname else "te_jax"
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("te_jax") and not node.level:
      for alias in node.names:
        if f"{node.module}.{alias.name}" in MODULES:
          bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
  for node in ast.walk(TREES[module]):
    chain = []
    while isinstance(node, ast.Attribute):
      chain.append(node.attr)
      node = node.value
    if not (isinstance(node, ast.Name) and node.id in bound and chain):
      continue
    target = bound[node.id]
    for attr in reversed(chain):
      if f"{target}.{attr}" in MODULES:
        target = f"{target}.{attr}"
        continue
      if target in PUBLIC and not attr.startswith("__"):
        yield target, attr, node.lineno
      break


def test_te_jax_takes_only_public_names_from_the_packages():
  """Within te_jax, a package's ``__init__`` is a way in for users only: a module takes from it only its public names
  (as te_jax.compare and te_jax.doctor do, on top of everything), and a helper shared across layers (the NNX modules'
  use of ``te_jax.flax.params``, the FP8 state types of ``te_jax.fused``) comes from its defining module."""
  bad = sorted({f"{module}:{line} takes {name!r} from {package}" for module in MODULES
                for package, name, line in _package_names(module)
                if name not in PUBLIC[package] and name not in DOCSTRING_API[package]})
  assert not bad, "\n".join(bad) + "\n(import helpers from the module that defines them)"


def test_the_package_rule_can_fail():
  """``_package_names`` sees both ways of taking a name from a package (so the rule above is not vacuous)."""
  found = {(p, n) for p, n, _ in _package_names("te_jax.compare.lm")}
  assert ("te_jax.flax", "TransformerLayer") in found and ("te_jax", "zigzag_order") in found, found
