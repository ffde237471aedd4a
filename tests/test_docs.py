"""The API reference's examples: every docstring example in te_jax runs, as a doctest, and gives what it shows; every
public class and function (the names in the package ``__all__`` lists) has a docstring, and every public class opens
with an example."""

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import flax.linen as nn
import pytest
from flax import nnx

import te_jax
import te_jax.flax
import te_jax.nnx

MODULES = sorted(m.name for m in pkgutil.walk_packages(te_jax.__path__, "te_jax.") if not m.name.split(".")[-1]
                 .startswith("_te_"))
PUBLIC_PACKAGES = ("te_jax", "te_jax.flax", "te_jax.nnx", "te_jax.recipe", "te_jax.compare")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, result


def _public(package):
  module = importlib.import_module(package)
  return [(f"{package}.{n}", getattr(module, n)) for n in module.__all__
          if inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n))]


@pytest.mark.parametrize("qualname,obj", [p for package in PUBLIC_PACKAGES for p in _public(package)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_public_names_are_documented(qualname, obj):
  doc = inspect.getdoc(obj)
  assert doc, f"{qualname} has no docstring"
  if inspect.isclass(obj) and issubclass(obj, (nn.Module, nnx.Module)):
    assert ">>> " in doc, f"{qualname}: a module's docstring opens with a usage example"


def test_every_module_is_covered():
  """The doctest run above walks the whole package, so a new module cannot be missed."""
  assert "te_jax.fused.dense" in MODULES and "te_jax.flax.transformer" in MODULES and "te_jax.ops.gemm" in MODULES
  assert "te_jax.nnx.transformer" in MODULES


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/guide.md", "docs/performance.md", "CONTRIBUTING.md")


def _examples():
  """(document, index, code) of every whole Python example of the documents (indented blocks are fragments)."""
  return [(doc, i, code) for doc in DOCUMENTS
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), flags=re.S | re.M))]


@pytest.mark.parametrize("doc,index,code", _examples(), ids=[f"{d}-{i}" for d, i, _ in _examples()])
def test_readme_examples_run(doc, index, code, tmp_path, monkeypatch):
  """Every whole Python example of the README and the docs (a block not indented into a list) runs as it is written,
  in a fresh namespace, in a scratch folder."""
  monkeypatch.chdir(tmp_path)
  exec(compile(code, f"{doc} python block {index}", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_document_links_resolve(doc):
  """Every relative link of the README and the docs names a file or folder of the repository (and an anchor, a heading
  of that file)."""
  for target in re.findall(r"\]\(([^)\s]+)\)", (ROOT / doc).read_text()):
    if re.match(r"[a-z]+://", target):
      continue
    path, _, anchor = target.partition("#")
    file = (ROOT / doc).parent / path if path else ROOT / doc
    assert file.exists(), f"{doc}: the link {target!r} names no file"
    if anchor and file.suffix == ".md":
      headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                  for h in re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)}
      assert anchor in headings, f"{doc}: the link {target!r} names no heading of {path or doc}"
