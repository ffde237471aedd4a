"""Runs every benchmark (each ``bench_*.py`` beside this file) and writes the results; the tables are printed last.

  python benchmarks/run.py           # GPU: full shapes -> benchmarks/results/h200.json and h200.md
                                     # no GPU: every dimension / 32, a quick smoke run -> results/cpu.json and cpu.md

A benchmark module has ``run(ctx: harness.Context) -> list[dict]`` (rows, each with an ``ok`` flag) and ``COLUMNS``,
the (header, key) pairs of its table. The JSON holds the device, the versions (from ``te_jax.doctor``), the date, the
measured copy bandwidth (the ceiling of memory-bound ops) and every row; the markdown file holds one table per
benchmark. Exit code 1 when a benchmark failed, or a row is not ok (the te_jax path did not run its native handler,
or its outputs differ from the baseline's).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pathlib
import re
import sys
import traceback

import jax

import harness
from te_jax import doctor

HERE = pathlib.Path(__file__).resolve().parent
BENCHMARKS = tuple(sorted(p.stem for p in HERE.glob("bench_*.py")))
RESULTS = HERE / "results"


def _results_name(device_kind: str, gpu: bool) -> str:
  if not gpu:
    return "cpu"
  if "H200" in device_kind.upper():
    return "h200"
  return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "gpu"


def _header(result: dict) -> str:
  dev, copy = result["device"], result["copy_bandwidth"]
  versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
  return (f"# te_jax benchmarks: {dev['name']}\n\n"
          f"{result['date']}; {versions}.\n"
          f"Copy bandwidth (read + write, jitted jnp.copy of {copy['bytes'] // 2 >> 20} MiB): "
          f"{copy['gbps']:,.0f} GB/s per call; {result['copy_bandwidth_loop']['gbps']:,.0f} GB/s in a jitted loop "
          f"(x * s, {result['copy_bandwidth_loop']['bytes'] // 2 >> 20} MiB). % copy BW: ms against the first; "
          f"% copy BW (loop): ms (loop) against the second.\n"
          f"ms: median per call over {result['runs']} measurements, calls dispatched back to back (for small inputs, "
          f"per iteration of a jitted loop); ms (loop): per iteration of a jitted loop; ms (1 sync call): one "
          f"host-timed call, dispatch included. Bandwidths count bytes read + written.\n")


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmarks; returns the exit code."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
  parser.add_argument("--runs", type=int, help="measurements per timing (default: 20 on a GPU, 5 on a CPU)")
  parser.add_argument("--no-write", action="store_true", help="print the tables, write no files")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  gpu = jax.default_backend() == "gpu"
  # A CPU run is a smoke test of the benchmark code, not a measurement: small shapes, few runs, short loops.
  shrink, runs, inner = (1, args.runs or 20, 50) if gpu else (32, args.runs or 5, 10)
  copy = harness.copy_bandwidth(1 << 30 if gpu else 1 << 24, runs=runs)
  print(f"copy bandwidth: {copy['gbps']:,.0f} GB/s (read + write)"
        + ("" if copy["hlo_copies"] else "; WARNING: the compiled copy holds no copy op, so this is no ceiling"),
        file=sys.stderr, flush=True)
  copy_loop = harness.copy_bandwidth_loop(1 << 29 if gpu else 1 << 22, inner=inner, runs=runs)
  print(f"copy bandwidth in a jitted loop: {copy_loop['gbps']:,.0f} GB/s (read + write)", file=sys.stderr, flush=True)
  ctx = harness.Context(gpu=gpu, platform="cuda" if gpu else "cpu", shrink=shrink, copy_gbps=copy["gbps"],
                        copy_loop_gbps=copy_loop["gbps"], runs=runs, inner=inner)

  rows, tables, failures = [], [], {}
  for name in args.only or BENCHMARKS:
    try:
      module = importlib.import_module(name)
      bench_rows = module.run(ctx)
    except Exception:  # noqa: BLE001 - one broken benchmark must not lose the others' numbers
      failures[name] = traceback.format_exc()
      print(f"{name} FAILED:\n{failures[name]}", file=sys.stderr, flush=True)
      continue
    rows += bench_rows
    tables.append(f"## {name.removeprefix('bench_')}\n\n{harness.markdown_table(bench_rows, module.COLUMNS)}\n")

  info = doctor.collect()
  gpu_info = info["gpus"][0] if info["gpus"] else {}
  result = {
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
      "device": {"name": device.device_kind, "platform": device.platform, "count": len(jax.devices()),
                 "compute_capability": gpu_info.get("compute_capability"), "shrink": shrink},
      "versions": {
          "te_jax": info["te_jax"], "python": info["python"], **info["packages"],
          "cuda_driver": info["cuda"]["driver_version"], "cuda_runtime": info["cuda"]["runtime_version"],
          "cublaslt": info["cuda"]["cublaslt_version"], "cudnn": info["cuda"]["cudnn"]["version"],
      },
      "reference_forced": info["reference_forced"],
      "runs": runs,
      "copy_bandwidth": copy,
      "copy_bandwidth_loop": copy_loop,
      "rows": rows,
      "failures": failures,
  }
  tables += [f"## {name.removeprefix('bench_')}\n\nFAILED; the traceback is in the JSON.\n" for name in failures]
  text = "\n".join(tables)
  if not args.no_write:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / _results_name(device.device_kind, gpu)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_header(result) + "\n" + text)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}", file=sys.stderr, flush=True)
  print(text, end="", flush=True)
  return 1 if failures or not all(r["ok"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
