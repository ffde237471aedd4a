"""Runs the benchmarks (each ``bench_*.py`` beside this file) and merges their rows into the device's results file.

  python benchmarks/run.py                   # GPU: full shapes -> results/h200.json; no GPU: every dimension / 32,
                                             # a quick smoke run -> results/cpu.json (not committed)
  python benchmarks/run.py --only bench_gemm --only bench_dense
  python benchmarks/run.py --show            # the tables of results/h200.json, nothing run (--show cpu: cpu.json)

A benchmark module has ``run(ctx: harness.Context) -> list[dict]``: rows keyed by (bench, case, impl), each with an
``ok`` flag. After each benchmark its rows go into the results file (``report.update``): they replace the rows with
the same keys and the others stay, each stamped with this run's commit, date, versions (``te_jax.doctor``) and copy
bandwidth, so a run stopped at its time limit keeps what it measured. Each benchmark prints its elapsed seconds; the
tables of this run's rows come last, then the seconds of every benchmark. The headline benchmarks run first.
Exit code 1 when a benchmark failed, or a row is not ok (the te_jax path did not run its native handler, or its
outputs differ from the baseline's).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import pathlib
import sys
import time
import traceback

import report

HERE = pathlib.Path(__file__).resolve().parent
ORDER = ("bench_transformer", "bench_layernorm_mlp", "bench_dense", "bench_gemm", "bench_attention", "bench_quantize",
         "bench_norm", "bench_activation", "bench_softmax", "bench_rope")
BENCHMARKS = tuple(n for n in ORDER if (HERE / f"{n}.py").exists()) + tuple(
    sorted(p.stem for p in HERE.glob("bench_*.py") if p.stem not in ORDER))


def _show(name: str) -> int:
  path = pathlib.Path(name) if name.endswith(".json") else report.RESULTS / f"{name}.json"
  return report.main(["--results", str(path)])


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmarks (or, with --show, prints a results file's tables); returns the exit code."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
  parser.add_argument("--runs", type=int, help="measurements per timing (default: 20 on a GPU, 5 on a CPU)")
  parser.add_argument("--no-write", action="store_true", help="print the tables, write no results file")
  parser.add_argument("--show", nargs="?", const="h200", metavar="NAME",
                      help="print the tables of results/NAME.json (default h200) and run nothing")
  args = parser.parse_args(argv)
  if args.show is not None:
    return _show(args.show)

  import jax  # noqa: PLC0415 - --show needs neither jax nor a device

  import harness  # noqa: PLC0415
  from te_jax import doctor  # noqa: PLC0415

  t_start = time.perf_counter()
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  device = jax.devices()[0]
  gpu = jax.default_backend() == "gpu"
  # A CPU run is a smoke test of the benchmark code, not a measurement: small shapes, few runs, short loops.
  shrink, runs, inner = (1, args.runs or 20, 50) if gpu else (32, args.runs or 5, 10)
  info = doctor.collect()
  if info["reference_forced"]:
    print("WARNING: TE_JAX_REFERENCE=1: the te_jax rows measure the pure-JAX path", file=sys.stderr, flush=True)
  copy = harness.copy_bandwidth(1 << 30 if gpu else 1 << 24, runs=runs)
  print(f"copy bandwidth: {copy['gbps']:,.0f} GB/s (read + write)"
        + ("" if copy["hlo_copies"] else "; WARNING: the compiled copy holds no copy op, so this is no ceiling"),
        file=sys.stderr, flush=True)
  copy_loop = harness.copy_bandwidth_loop(1 << 29 if gpu else 1 << 22, inner=inner, runs=runs)
  print(f"copy bandwidth in a jitted loop: {copy_loop['gbps']:,.0f} GB/s (read + write)", file=sys.stderr, flush=True)
  clocks = harness.ClockSampler.start() if gpu else None
  ctx = harness.Context(gpu=gpu, platform="cuda" if gpu else "cpu", shrink=shrink, copy_gbps=copy["gbps"],
                        copy_loop_gbps=copy_loop["gbps"], runs=runs, inner=inner, clocks=clocks)

  gpu_info = info["gpus"][0] if info["gpus"] else {}
  device_info = {"name": device.device_kind, "platform": device.platform, "count": len(jax.devices()),
                 "compute_capability": gpu_info.get("compute_capability"), "shrink": shrink}
  run_info = {
      "commit": report.current_commit(),
      "date": date,
      "versions": {
          "te_jax": info["te_jax"], "python": info["python"], **info["packages"],
          "cuda_driver": info["cuda"]["driver_version"], "cuda_runtime": info["cuda"]["runtime_version"],
          "cublaslt": info["cuda"]["cublaslt_version"], "cudnn": info["cuda"]["cudnn"]["version"],
      },
      "copy_gbps": copy["gbps"],
      "copy_loop_gbps": copy_loop["gbps"],
      "runs": runs,
  }
  path = report.RESULTS / f"{report.results_name(device.device_kind, gpu)}.json"
  print(f"commit {run_info['commit']}; results: {'none written' if args.no_write else path}", file=sys.stderr,
        flush=True)
  if run_info["commit"] == "unknown":
    print("WARNING: no git checkout and no TE_JAX_COMMIT: the rows get commit 'unknown'", file=sys.stderr, flush=True)

  rows, failures, elapsed = [], {}, {}
  for name in args.only or BENCHMARKS:
    t0 = time.perf_counter()
    print(f"=== {name}", file=sys.stderr, flush=True)
    try:
      bench_rows = importlib.import_module(name).run(ctx)
    except Exception:  # noqa: BLE001 - one broken benchmark must not lose the others' numbers
      failures[name] = traceback.format_exc()
      bench_rows = []
    elapsed[name] = time.perf_counter() - t0
    status = f"FAILED:\n{failures[name]}" if name in failures else f"{len(bench_rows)} rows"
    print(f"=== {name}: {elapsed[name]:.1f} s, {status}", file=sys.stderr, flush=True)
    rows += bench_rows
    if bench_rows and not args.no_write:
      report.update(path, bench_rows, run_info, device_info)
  if clocks:
    clocks.stop()

  print(report.tables(report.stamp(rows, run_info)), end="", flush=True)
  for name in failures:
    print(f"\n## {name.removeprefix('bench_')}\n\nFAILED; the traceback is in the log above.", flush=True)
  print("\nelapsed: " + ", ".join(f"{n.removeprefix('bench_')} {s:.0f} s" for n, s in elapsed.items())
        + f"; total {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
  return 1 if failures or not all(r["ok"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
