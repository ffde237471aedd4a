"""The benchmark results files and the tables generated from them (benchmarks/report.py; no jax, no GPU).

Each results file's block (in docs/performance.md, or in the README if it is moved there) must be what the file
generates, so that a results file committed without ``python benchmarks/report.py ... --write`` fails
here.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402 - benchmarks/ is not a package

RESULTS = ROOT / "benchmarks" / "results" / "h200.json"


DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "performance.md")


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")), ids=lambda p: p.stem)
def test_every_device_block_is_generated_from_its_results(path):
  """Every results file committed has its block (h200.json: BEGIN/END; another device's: its own markers) in exactly
  one of the documents, generated from it."""
  source = f"benchmarks/results/{path.name}"
  begin, _ = report.markers(source)
  (doc,) = [d for d in DOCUMENTS if begin in d.read_text()] or [None]
  assert doc is not None, f"{source} has no block ({begin}) in {[d.name for d in DOCUMENTS]}"
  diff = report.check_readme(doc, report.load(path), source)
  assert not diff, (f"{doc.name}'s {path.stem} block is stale; run `python benchmarks/report.py --results {source} "
                    f"--write {doc.relative_to(ROOT)}`:\n{diff}")


def test_check_exits_nonzero_and_names_the_difference(tmp_path):
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{report.BEGIN}\n| a stale | table |\n{report.END}\noutro\n")
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--results", str(RESULTS),
                         "--check", str(readme)], capture_output=True, text=True, check=False)
  assert proc.returncode == 1
  assert "-| a stale | table |" in proc.stderr
  assert report.write_readme(readme, report.load(RESULTS))
  text = readme.read_text()
  assert text.startswith(f"intro\n{report.BEGIN}\n") and text.endswith(f"\n{report.END}\noutro\n")
  assert not report.check_readme(readme, report.load(RESULTS))


def test_results_file_structure():
  text = RESULTS.read_text()
  results = json.loads(text)
  assert report.problems(results) == []
  assert results["device"]["name"] == "NVIDIA H200"
  assert text == report.dumps(results), "the file is not in report.dumps's layout (one row per line)"
  for row in results["rows"]:
    assert {"jax", "jaxlib", "flax", "te_jax", "cuda_driver", "cudnn"} <= set(row["versions"]), row["versions"]


def _row(bench, case, impl, ms):
  return {"bench": bench, "case": case, "impl": impl, "ok": True, "ms": ms}


def _run(date, commit):
  return {"commit": commit, "date": date, "versions": {"jax": "0.11.2"}, "copy_gbps": 4000.0, "copy_loop_gbps": None,
          "runs": 20}


def test_a_run_replaces_its_rows_and_keeps_the_others(tmp_path):
  path = tmp_path / "h200.json"
  device = {"name": "NVIDIA H200"}
  first = [_row("quantize", "a", "te_jax", 1.0), _row("quantize", "a", "xla (jnp)", 2.0),
           _row("quantize", "b", "te_jax", 3.0), _row("gemm", "c", "xla bf16", 4.0)]
  report.update(path, first, _run("2026-12-01T00:00:00+00:00", "aaaaaaa"), device)
  second = [_row("quantize", "a", "te_jax", 0.5), _row("quantize", "d", "te_jax", 6.0),
            _row("norm", "e", "te_jax", 7.0)]
  results = report.update(path, second, _run("2026-12-05T00:00:00+00:00", "bbbbbbb-dirty"), device)

  assert results == report.load(path)
  assert report.problems(results) == []
  got = [(r["bench"], r["case"], r["impl"], r["ms"], r["commit"]) for r in results["rows"]]
  assert got == [
      ("quantize", "a", "te_jax", 0.5, "bbbbbbb-dirty"),     # measured again: replaced in place
      ("quantize", "a", "xla (jnp)", 2.0, "aaaaaaa"),        # not measured again: kept, with its own run
      ("quantize", "b", "te_jax", 3.0, "aaaaaaa"),
      ("quantize", "d", "te_jax", 6.0, "bbbbbbb-dirty"),     # new key: after its benchmark's rows
      ("gemm", "c", "xla bf16", 4.0, "aaaaaaa"),
      ("norm", "e", "te_jax", 7.0, "bbbbbbb-dirty"),         # new benchmark: at the end
  ]
  assert results["rows"][0]["date"] == "2026-12-05T00:00:00+00:00"
  assert results["rows"][1]["date"] == "2026-12-01T00:00:00+00:00"


def test_problems_names_missing_fields_and_repeated_keys():
  row = {"bench": "quantize", "case": "a", "impl": "te_jax", "ok": True, **_run("2026-12-01T00:00:00+00:00", "x")}
  assert report.problems({"format": report.FORMAT, "device": None, "rows": [row]}) == []
  bad = {k: v for k, v in row.items() if k != "commit"} | {"case": "b"}
  found = report.problems({"format": report.FORMAT, "device": None, "rows": [bad, row, row]})
  assert found == ["row 0: no 'commit'", "row 2: key ('quantize', 'a', 'te_jax') repeated"]


def test_non_finite_numbers_are_written_as_null(tmp_path):
  path = tmp_path / "cpu.json"
  report.update(path, [_row("transformer", "stack", "flax layer fp8", float("nan"))],
                _run("2026-12-05T00:00:00+00:00", "x"), {"name": "cpu"})
  assert json.loads(path.read_text())["rows"][0]["ms"] is None


def test_commit_comes_from_the_environment_first(tmp_path, monkeypatch):
  monkeypatch.setenv("TE_JAX_COMMIT", "abc1234-dirty")
  assert report.current_commit(tmp_path) == "abc1234-dirty"
  assert report.current_commit() == "abc1234-dirty"  # even in a git checkout: the GPU machine's need not be this tree
  monkeypatch.delenv("TE_JAX_COMMIT")
  assert report.current_commit(tmp_path) == "unknown"


@pytest.mark.parametrize("rows", [[], [_row("attention", "x", "te_jax fused", 1.0)]])
def test_readme_block_without_rows_says_so(rows):
  block = report.readme_block({"format": report.FORMAT, "device": None, "rows": rows})
  assert "No results yet" in block
