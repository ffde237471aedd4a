"""The benchmark results files and what is generated from them: the tables for humans and the README's table.

  python benchmarks/report.py                          # the tables of results/h200.json
  python benchmarks/report.py --results results/cpu.json
  python benchmarks/report.py --write docs/performance.md     # rewrites h200.json's block there
  python benchmarks/report.py --results results/nvidia_h100_80gb_hbm3.json --write docs/performance.md  # that file's
  python benchmarks/report.py --check docs/performance.md     # exit 1, with the difference, when that block is stale

Each results file has its block (between its markers, ``markers``) in one document, docs/performance.md.

One machine-written results file per device (``results/h200.json``; ``results/cpu.json`` for the CPU smoke run, not
committed): ``{"format": 1, "device": {...}, "rows": [...]}``, one row per line. A row is keyed by
``(bench, case, impl)`` and carries, besides its measurements, the run it comes from: ``commit``, ``date``,
``versions``, ``copy_gbps`` / ``copy_loop_gbps`` (the copy-bandwidth ceilings of that run) and ``runs``. A run
replaces the rows it measures and keeps the others (``merge``), so the file holds the newest measurement of every
row, each with its own provenance.

No jax here: the test of the results file and of the README block (tests/test_benchmark_results.py) stays fast.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
FORMAT = 1
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


def markers(source: str) -> tuple[str, str]:
  """The README markers of a results file's block: ``BEGIN``/``END`` for results/h200.json, the file's stem in them
  for another device's (``<!-- benchmarks:nvidia_h100_80gb_hbm3:begin -->``)."""
  stem = pathlib.Path(source).stem
  return (BEGIN, END) if stem == "h200" else (f"<!-- benchmarks:{stem}:begin -->", f"<!-- benchmarks:{stem}:end -->")

# Fields every row has: its key, whether it ran as intended, and its run's provenance.
KEY_FIELDS = ("bench", "case", "impl")
RUN_FIELDS = ("commit", "date", "versions", "copy_gbps", "copy_loop_gbps", "runs")
REQUIRED = {"bench": str, "case": str, "impl": str, "ok": bool, "commit": str, "date": str, "versions": dict,
            "copy_gbps": (int, float, type(None)), "copy_loop_gbps": (int, float, type(None)),
            "runs": (int, type(None))}


# ---- the results file -------------------------------------------------------------------------------------------


def results_name(device_kind: str, gpu: bool) -> str:
  """The results file's stem for a device: ``h200`` for an H200, ``cpu`` without a GPU, else the device kind."""
  if not gpu:
    return "cpu"
  if "H200" in device_kind.upper():
    return "h200"
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "gpu"


def current_commit(repo: pathlib.Path = HERE.parent) -> str:
  """The environment's ``TE_JAX_COMMIT`` when set (the GPU machine gets a copy of the working tree, whose own .git,
  if any, need not be this tree's); else ``git rev-parse --short HEAD`` of ``repo``, with "-dirty" when a tracked file
  differs from it; else "unknown"."""
  if os.environ.get("TE_JAX_COMMIT"):
    return os.environ["TE_JAX_COMMIT"]

  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()

  try:
    if pathlib.Path(git("rev-parse", "--show-toplevel")).resolve() != repo.resolve():
      raise ValueError("not the repository's own checkout")
    head = git("rev-parse", "--short", "HEAD")
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
  except (OSError, ValueError, subprocess.SubprocessError):
    return "unknown"


def key(row: dict) -> tuple[str, str, str]:
  return row["bench"], row["case"], row["impl"]


def empty(device: dict | None = None) -> dict:
  return {"format": FORMAT, "device": device, "rows": []}


def load(path: pathlib.Path) -> dict:
  """The results in ``path``, or an empty results dict when the file does not exist."""
  if not path.exists():
    return empty()
  results = json.loads(path.read_text())
  if results.get("format") != FORMAT:
    raise ValueError(f"{path}: format {results.get('format')!r}, expected {FORMAT}")
  return results


def _finite(value: Any) -> Any:
  """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite(v) for v in value]
  return value


def dumps(results: dict) -> str:
  """The file's text: the header fields, then one row per line (so that a diff shows which rows a run changed)."""
  head = {k: v for k, v in results.items() if k != "rows"}
  lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(_finite(v))}," for k, v in head.items()]
  rows = [json.dumps(_finite(r)) for r in results["rows"]]
  lines.append('  "rows": [' + ("" if rows else "]"))
  if rows:
    lines += [f"    {r}," for r in rows[:-1]] + [f"    {rows[-1]}", "  ]"]
  return "\n".join(lines + ["}"]) + "\n"


def save(path: pathlib.Path, results: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(dumps(results))
  tmp.replace(path)  # a run killed at its time limit leaves the previous file, never half a file


def merge(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
  """``old`` with each row that ``new`` measures again replaced in place; rows of ``new`` with a new key go after
  the last row of their benchmark (at the end for a new benchmark); every other row of ``old`` is kept."""
  fresh = {key(r): r for r in new}
  rows = [fresh.pop(key(r), r) for r in old]
  for r in new:
    if key(r) not in fresh:
      continue
    del fresh[key(r)]
    last = max((i for i, o in enumerate(rows) if o["bench"] == r["bench"]), default=len(rows) - 1)
    rows.insert(last + 1, r)
  return rows


def stamp(rows: Iterable[dict], run: dict) -> list[dict]:
  """Each row with its run's fields (``RUN_FIELDS``) added last."""
  return [{**{k: v for k, v in r.items() if k not in RUN_FIELDS}, **{k: run.get(k) for k in RUN_FIELDS}}
          for r in rows]


def update(path: pathlib.Path, rows: Sequence[dict], run: dict, device: dict) -> dict:
  """Merges ``rows`` of one run into the results file at ``path``; returns the new results."""
  results = load(path)
  results["device"] = device
  results["rows"] = merge(results["rows"], stamp(rows, run))
  save(path, results)
  return results


def problems(results: dict) -> list[str]:
  """What is wrong with a results dict: missing or mistyped top-level keys and row fields, repeated keys."""
  found = []
  if set(results) != {"format", "device", "rows"}:
    found.append(f"top-level keys {sorted(results)}, expected ['device', 'format', 'rows']")
  if results.get("format") != FORMAT:
    found.append(f"format {results.get('format')!r}, expected {FORMAT}")
  seen = set()
  for i, row in enumerate(results.get("rows", [])):
    for field, types in REQUIRED.items():
      if field not in row:
        found.append(f"row {i}: no {field!r}")
      elif not isinstance(row[field], types):
        found.append(f"row {i}: {field!r} is {type(row[field]).__name__}")
    if all(isinstance(row.get(f), str) for f in KEY_FIELDS):
      if key(row) in seen:
        found.append(f"row {i}: key {key(row)} repeated")
      seen.add(key(row))
  return found


# ---- tables for humans ------------------------------------------------------------------------------------------

MEMORY_BOUND_COLUMNS = (
    ("case", "case"), ("impl", "impl"), ("ms", "ms"), ("ms (loop)", "ms_loop"), ("ms (1 sync call)", "ms_sync"),
    ("GB/s", "gbps"), ("% copy BW", "pct_copy"), ("% copy BW (loop)", "pct_copy_loop"), ("vs XLA", "speedup_vs_xla"),
    ("handler", "handler"), ("ok", "ok"), ("note", "note"),
)
LAYER_COLUMNS = (
    ("case", "case"), ("impl", "impl"), ("ms", "ms"), ("TFLOP/s", "tflops"), ("vs Flax bf16", "speedup_vs_bf16"),
    ("vs Flax fp8", "speedup_vs_flax_fp8"), ("ms (1 sync call)", "ms_sync"),
    ("vs Flax bf16 (sync)", "speedup_vs_bf16_sync"), ("vs Flax fp8 (sync)", "speedup_vs_flax_fp8_sync"),
    ("temp MiB", "temp_mib"), ("temp vs Flax fp8", "temp_vs_flax_fp8"), ("SM MHz", "sm_mhz"), ("W", "power_w"),
    ("handler", "handler"), ("ok", "ok"), ("note", "note"),
)
COLUMNS = {
    "quantize": MEMORY_BOUND_COLUMNS, "norm": MEMORY_BOUND_COLUMNS, "activation": MEMORY_BOUND_COLUMNS,
    "softmax": MEMORY_BOUND_COLUMNS, "rope": MEMORY_BOUND_COLUMNS,
    "dense": LAYER_COLUMNS, "layernorm_mlp": LAYER_COLUMNS, "transformer": LAYER_COLUMNS,
    "gemm": (("case", "case"), ("impl", "impl"), ("ms", "ms"), ("TFLOP/s", "tflops"), ("vs XLA bf16", "speedup_vs_xla"),
             ("rel err vs bf16", "rel_err_vs_bf16"), ("handler", "handler"), ("ok", "ok"), ("note", "note")),
    "gemm_accuracy": (("case", "case"), ("error of", "impl"), ("rms", "rel_rms"), ("max", "rel_max"),
                      ("bias", "bias"), ("handler", "handler"), ("ok", "ok"), ("note", "note")),
    "attention": (("case", "case"), ("impl", "impl"), ("ms", "ms"), ("TFLOP/s", "tflops"),
                  ("vs jax.nn cudnn", "speedup_vs_jax_cudnn"), ("temp MiB", "temp_mib"), ("err O", "err_o"),
                  ("err dQ", "err_dq"), ("err dK", "err_dk"), ("err dV", "err_dv"), ("handler", "handler"),
                  ("ok", "ok"), ("note", "note")),
}
_DEFAULT_COLUMNS = (("case", "case"), ("impl", "impl"), ("ms", "ms"), ("ok", "ok"), ("note", "note"))


def _cell(v: Any) -> str:
  if v is None:
    return ""
  if isinstance(v, bool):
    return "yes" if v else "NO"
  if isinstance(v, float):
    if not math.isfinite(v):
      return ""
    if v and abs(v) < 1e-2:
      return f"{v:.2e}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
  return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
  """A markdown table of ``rows``; ``columns`` are (header, key) pairs."""
  lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
  lines += ["| " + " | ".join(_cell(r.get(k)) for _, k in columns).replace("\n", " ") + " |" for r in rows]
  return "\n".join(lines)


def run_label(row: dict) -> str:
  """``2026-11-29 19:01 UTC, commit abc1234``: when and on what a row was measured."""
  return f"{_date(row['date'])}, commit {row['commit']}"


def _date(iso: str) -> str:
  return iso[:16].replace("T", " ") + " UTC"


def tables(rows: Sequence[dict]) -> str:
  """One markdown table per benchmark, in the order the rows come, each followed by the runs its rows are from."""
  benches = list(dict.fromkeys(r["bench"] for r in rows))
  out = []
  for bench in benches:
    group = [r for r in rows if r["bench"] == bench]
    runs = "; ".join(dict.fromkeys(run_label(r) for r in group if "date" in r))
    out.append(f"## {bench}\n\n{markdown_table(group, COLUMNS.get(bench, _DEFAULT_COLUMNS))}\n"
               + (f"\nmeasured {runs}\n" if runs else ""))
  return "\n".join(out)


def header(results: dict) -> str:
  """The device and, per run the rows come from, its versions and copy bandwidth."""
  dev = results.get("device") or {}
  lines = [f"# te_jax benchmarks: {dev.get('name', 'unknown device')}", ""]
  for label, (versions, copy, copy_loop) in _runs(results["rows"]).items():
    lines.append(f"- {label}: {_versions(versions)}; copy {_gbps(copy)} GB/s per call, {_gbps(copy_loop)} in a loop")
  return "\n".join(lines) + "\n"


def _runs(rows: Sequence[dict]) -> dict[str, tuple[dict, Any, Any]]:
  """{run label: (versions, copy GB/s, copy GB/s in a loop)}, newest run first."""
  ordered = sorted(rows, key=lambda r: r["date"], reverse=True)
  return {run_label(r): (r["versions"], r.get("copy_gbps"), r.get("copy_loop_gbps")) for r in ordered}


_VERSION_NAMES = (("te_jax", "te_jax"), ("jax", "jax"), ("jaxlib", "jaxlib"), ("flax", "flax"),
                  ("cuda_driver", "CUDA driver"), ("cuda_runtime", "CUDA runtime"), ("cublaslt", "cuBLASLt"),
                  ("cudnn", "cuDNN"))


def _versions(versions: dict) -> str:
  return ", ".join(f"{name} {versions[k]}" for k, name in _VERSION_NAMES if versions.get(k))


def _gbps(v: Any) -> str:
  return f"{v:,.0f}" if isinstance(v, (int, float)) else "-"


# ---- the README block -------------------------------------------------------------------------------------------

# What the README shows: the headline comparisons. (bench, impls in display order); a layer's first case that is not
# the stack's; a kernel's first two cases (its headline shapes; `python benchmarks/run.py --show` prints them all).
README_LAYERS = (
    ("transformer", ("te_jax TransformerLayer fp8", "te_jax TransformerLayer fp8 (fast accumulation)",
                     "te_jax TransformerLayer fp8 block scaling", "te_jax.nnx TransformerLayer fp8",
                     "te_jax TransformerLayer fp8, 1-device mesh, every rule",
                     "flax layer fp8", "flax layer bf16")),
    ("layernorm_mlp", ("te_jax LayerNormMLP fp8", "flax block fp8", "flax block bf16")),
    ("dense", ("te_jax DenseGeneral fp8", "te_jax DenseGeneral fp8 (fast accumulation)",
               "te_jax DenseGeneral fp8 block scaling", "flax Dense fp8",
               "flax Dense bf16")),
)
README_STACK = ("te_jax TransformerLayer fp8", "flax layer fp8", "flax layer bf16")
README_GEMM = ("te_jax fp8 (fast acc)", "te_jax fp8", "xla bf16", "torch._scaled_mm fp8 (fast acc)",
               "torch._scaled_mm fp8")
README_BLOCK_GEMM = ("te_jax fp8 block", "te_jax fp8 per-tensor", "xla bf16")
README_KERNELS = ("quantize", "norm", "activation", "softmax", "rope")
README_KERNEL_CASES = 2
# The block-scaled quantize's cases (one per scaling mode) join quantize's first ones.
README_BLOCK_MODES = ("BLOCK_1X128+T", "BLOCK_128X128+T", "MXFP8_1X32+T", "NVFP4_1X16+T amax computed")
README_ATTENTION = ("te_jax fused", "jax.nn cudnn")


def _ms(v: Any) -> str:
  if not isinstance(v, (int, float)) or not math.isfinite(v):
    return "-"
  return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def _x(v: Any) -> str:
  return f"{v:.2f}x" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _pct(v: Any) -> str:
  return f"{v:.0f}%" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _mib(v: Any) -> str:
  return f"{v:,.0f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _pick(rows: Sequence[dict], bench: str, impls: Sequence[str], case: str | None = None) -> list[dict]:
  """The rows of ``bench`` (of ``case``, if given) whose impl is in ``impls``, in that order."""
  group = {r["impl"]: r for r in rows if r["bench"] == bench and (case is None or r["case"] == case)}
  return [group[i] for i in impls if i in group]


def _layer_lines(rows: Sequence[dict]) -> tuple[list[str], list[dict]]:
  lines, used = [], []
  for bench, impls in README_LAYERS:
    cases = list(dict.fromkeys(r["case"] for r in rows if r["bench"] == bench and not r["case"].startswith("stack")))
    for case in cases[:1]:
      for i, r in enumerate(_pick(rows, bench, impls, case)):
        lines.append(f"| {case if i == 0 else ''} | {r['impl']} | {_ms(r.get('ms'))} | {_ms(r.get('ms_sync'))} | "
                     f"{_x(r.get('speedup_vs_bf16'))} | {_x(r.get('speedup_vs_flax_fp8'))} | "
                     f"{_mib(r.get('temp_mib'))} | {_x(r.get('temp_vs_flax_fp8'))} |")
        used.append(r)
  stack = [r for r in rows if r["bench"] == "transformer" and r["case"].startswith("stack")]
  for case in list(dict.fromkeys(r["case"] for r in stack))[:1]:
    for i, r in enumerate(_pick(stack, "transformer", README_STACK, case)):
      lines.append(f"| {case if i == 0 else ''} | {r['impl']} | - | - | - | - | {_mib(r.get('temp_mib'))} | "
                   f"{_x(r.get('temp_vs_flax_fp8'))} |")
      used.append(r)
  return lines, used


def _gemm_row_lines(rows: Sequence[dict], bench: str, impls: Sequence[str], cases: Sequence[str],
                    per_tensor_share: bool) -> tuple[list[str], list[dict]]:
  """The GEMM table's lines of ``bench``'s ``cases``: ms, TFLOP/s, vs XLA BF16 (and, with ``per_tensor_share``, the
  share of the per-tensor FP8 GEMM's rate)."""
  lines, used = [], []
  for case in cases:
    for i, r in enumerate(_pick(rows, bench, impls, case)):
      tflops = r.get("tflops")
      share = f" {_pct(100 * r.get('vs_per_tensor_fp8', math.nan))} |" if per_tensor_share else ""
      lines.append(f"| {case if i == 0 else ''} | {r['impl']} | {_ms(r.get('ms'))} | "
                   f"{f'{tflops:,.0f}' if isinstance(tflops, (int, float)) else '-'} | "
                   f"{_x(r.get('speedup_vs_xla'))} |{share}")
      used.append(r)
  return lines, used


def _gemm_lines(rows: Sequence[dict]) -> tuple[list[str], list[dict]]:
  cases = list(dict.fromkeys(r["case"] for r in rows if r["bench"] == "gemm" and not r["case"].startswith("QKV")))
  return _gemm_row_lines(rows, "gemm", README_GEMM, cases[:1], per_tensor_share=False)


def _block_gemm_lines(rows: Sequence[dict]) -> tuple[list[str], list[dict]]:
  cases = list(dict.fromkeys(r["case"] for r in rows if r["bench"] == "gemm_block"))
  return _gemm_row_lines(rows, "gemm_block", README_BLOCK_GEMM, cases, per_tensor_share=True)


def _kernel_lines(rows: Sequence[dict]) -> tuple[list[str], list[dict]]:
  lines, used = [], []
  for bench in README_KERNELS:
    cases = list(dict.fromkeys(r["case"] for r in rows if r["bench"] == bench))
    block = [c for c in cases if bench == "quantize" and c.endswith(README_BLOCK_MODES)]
    for case in [c for c in cases if c not in block][:README_KERNEL_CASES] + block:
      pair = _pick(rows, bench, ("te_jax", "xla (jnp)"), case)
      if len(pair) != 2:
        continue
      te, xla = pair
      lines.append(f"| {bench} | {case} | {_ms(te.get('ms'))} | XLA {_ms(xla.get('ms'))} | "
                   f"{_x(te.get('speedup_vs_xla'))} | {_pct(te.get('pct_copy'))} | {_pct(te.get('pct_copy_loop'))} |")
      used += pair
  for case in dict.fromkeys(r["case"] for r in rows if r["bench"] == "attention"):
    pair = _pick(rows, "attention", README_ATTENTION, case)
    if len(pair) != 2:
      continue
    te, base = pair
    lines.append(f"| attention | {case} | {_ms(te.get('ms'))} | jax.nn {_ms(base.get('ms'))} | "
                 f"{_x(te.get('speedup_vs_jax_cudnn'))} | - | - |")
    used += pair
  return lines, used


def _wrap(text: str, indent: str = "") -> list[str]:
  """``text`` wrapped at 120 columns (the README's width), continuation lines indented by ``indent``."""
  return textwrap.wrap(text, 120, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def readme_block(results: dict, source: str = "benchmarks/results/h200.json", target: str = "README.md") -> str:
  """The performance block of the document ``target`` (between the markers, markers excluded), generated from
  ``results``."""
  rows = results["rows"]
  layer, layer_rows = _layer_lines(rows)
  gemm, gemm_rows = _gemm_lines(rows)
  block_gemm, block_gemm_rows = _block_gemm_lines(rows)
  kernel, kernel_rows = _kernel_lines(rows)
  used = layer_rows + gemm_rows + block_gemm_rows + kernel_rows
  out = [f"<!-- generated by `python benchmarks/report.py --results {source} --write {target}`; do not edit -->"]
  if not used:
    return "\n".join(out + [""] + _wrap(f"No results yet: `{source}` holds no rows of these benchmarks. The next "
                                       "`bash scripts/gpu_check.sh build bench` on the GPU machine measures them.")
                     + [""])
  if layer:
    out += ["", *_wrap("Layers, forward and backward (`jax.vjp` of `apply` w.r.t. the variables and the input), "
                       "DelayedScaling unless the row names another recipe; ms: median of 20 measurements of 10 calls "
                       "dispatched back to back; one call at "
                       "a time: median of 20 calls each waited on; temp: XLA's compiled scratch memory."), "",
            ("| layer | implementation | ms | ms, one call at a time | vs Flax BF16 | vs Flax FP8 | temp MiB | "
             "temp vs Flax FP8 |"), "|---|---|---|---|---|---|---|---|", *layer]
  if gemm:
    out += ["", *_wrap("FP8 GEMM (E4M3 operands quantized beforehand, bf16 out; `torch._scaled_mm` on the same FP8 "
                       "bytes where PyTorch is installed):"), "",
            "| GEMM | implementation | ms | TFLOP/s | vs XLA BF16 |", "|---|---|---|---|---|", *gemm]
  if block_gemm:
    out += ["", *_wrap("Block-scaled FP8 GEMMs (Float8BlockScaling's operands: 1 x 128 and 128 x 128 float32 scales, "
                       "cuBLASLt's block-scaled kernels, the scales' layout conversion included) beside the "
                       "per-tensor FP8 GEMM and XLA BF16 of the same shape:"), "",
            "| GEMM | implementation | ms | TFLOP/s | vs XLA BF16 | of per-tensor FP8 |", "|---|---|---|---|---|---|",
            *block_gemm]
  if kernel:
    out += ["", *_wrap("Kernels against XLA's compilation of the same math (`<op>_ref` under `jax.jit`; attention: "
                       "`jax.nn.dot_product_attention`'s cuDNN call), outputs checked against it; % of copy BW: bytes "
                       "read + written once against the same run's device copy, per call and in a jitted loop:"), "",
            "| kernel | case | te_jax ms | baseline ms | speed-up | % of copy BW | % of copy BW (loop) |",
            "|---|---|---|---|---|---|---|", *kernel]
  not_ok = [r for r in used if not r.get("ok")]
  if not_ok:
    out += ["", *_wrap("Rows not ok (handler not run, or outputs differ): "
                       + "; ".join(f"{r['bench']} {r['case']} {r['impl']}" for r in not_ok) + ".")]
  dev = results.get("device") or {}
  out += ["", *_wrap(f"{dev.get('name', 'unknown device')}"
                     + (f" (compute capability {dev['compute_capability']})" if dev.get("compute_capability") else "")
                     + f"; `{source}`, rows measured in these runs:")]
  for label, (versions, copy, copy_loop) in _runs(used).items():
    benches = ", ".join(dict.fromkeys(r["bench"] for r in used if run_label(r) == label))
    loop = f", {_gbps(copy_loop)} in a jitted loop" if copy_loop else ""
    out += _wrap(f"- {label} ({benches}): {_versions(versions)}; copy {_gbps(copy)} GB/s per call{loop}", "  ")
  return "\n".join(out + [""])


def _split(text: str, path: str, source: str = "benchmarks/results/h200.json") -> tuple[str, str, str]:
  """(before the block of ``source``, the block, after it); the markers stay in before/after."""
  begin, end = markers(source)
  if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
    raise ValueError(f"{path}: needs exactly one {begin} followed by one {end}")
  head, rest = text.split(begin)
  block, tail = rest.split(end)
  return head + begin, block.strip("\n"), end + tail


def _target(doc: pathlib.Path) -> str:
  """A document's path as the generated comment names it: from the repository root when it lies inside it."""
  path = doc.resolve()
  return str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else doc.name


def write_readme(readme: pathlib.Path, results: dict, source: str = "benchmarks/results/h200.json") -> bool:
  """Rewrites the block of ``readme``; returns whether it changed."""
  text = readme.read_text()
  head, block, tail = _split(text, str(readme), source)
  new = readme_block(results, source, _target(readme)).strip("\n")
  if new == block:
    return False
  readme.write_text(f"{head}\n{new}\n{tail}")
  return True


def check_readme(readme: pathlib.Path, results: dict, source: str = "benchmarks/results/h200.json") -> str:
  """"" when the block of ``readme`` is what ``results`` generate, else a unified diff (README -> generated)."""
  _, block, _ = _split(readme.read_text(), str(readme), source)
  new = readme_block(results, source, _target(readme)).strip("\n")
  if new == block:
    return ""
  return "\n".join(difflib.unified_diff(block.splitlines(), new.splitlines(), f"{readme} (block)", "generated",
                                        lineterm=""))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS / "h200.json", help="a results file")
  parser.add_argument("--write", type=pathlib.Path, metavar="README", help="rewrite README's benchmark block")
  parser.add_argument("--check", type=pathlib.Path, metavar="README",
                      help="exit 1, printing the difference, when README's benchmark block is stale")
  args = parser.parse_args(argv)
  results = load(args.results)
  source = os.path.relpath(args.results.resolve(), HERE.parent)
  if bad := problems(results):
    print(f"{args.results}: " + "; ".join(bad), file=sys.stderr)
    return 1
  if args.check:
    diff = check_readme(args.check, results, source)
    if diff:
      print(f"{args.check}: the benchmark block is not what {source} generates; run "
            f"`python benchmarks/report.py --results {source} --write {args.check}`.\n{diff}", file=sys.stderr)
      return 1
    return 0
  if args.write:
    changed = write_readme(args.write, results, source)
    print(f"{args.write}: benchmark block {'rewritten' if changed else 'already current'}", file=sys.stderr)
    return 0
  if not results["rows"]:
    print(f"{args.results}: no rows")
    return 0
  print(header(results) + "\n" + tables(results["rows"]), end="")
  return 0


if __name__ == "__main__":
  sys.exit(main())
