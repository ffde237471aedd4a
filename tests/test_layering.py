"""The architecture, checked from the source: te_jax's layers import only downward, there are no import cycles, no
module takes a private name (one not in the other module's ``__all__``) from another, and only the compat module
touches JAX's private APIs.

Layers, bottom to top: ``te_jax._core`` and ``te_jax.recipe`` (infrastructure); ``te_jax.ops`` (primitives);
``te_jax.fused`` (differentiable ops built from several primitives); ``te_jax.flax`` (Flax linen modules) and beside it
``te_jax.nnx`` (Flax NNX modules, which may use ``te_jax.flax.params``' axis names and checks); then the package
itself and ``te_jax.doctor``; then ``te_jax.compare`` (BF16 against FP8 on a model), which may use everything.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "te_jax"
LAYERS = {"te_jax._core": 0, "te_jax.recipe": 0, "te_jax.ops": 1, "te_jax.fused": 2, "te_jax.flax": 3,
          "te_jax.nnx": 3, "te_jax.doctor": 4, "te_jax": 4, "te_jax.compare": 5}
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
  assert {layer(m) for m in MODULES} == {0, 1, 2, 3, 4, 5}


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
