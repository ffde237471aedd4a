#!/usr/bin/env bash
# The one script for the GPU machine. GPU time is scarce, so one run does everything: build, doctor, GPU tests,
# benchmarks, the BF16-vs-FP8 training demo. A failing step does not stop the later ones; the summary table is printed last.
#
#   bash scripts/gpu_check.sh                 # logs in build/gpu_check/; with OUT=<dir>, logs and results go there too
#   bash scripts/gpu_check.sh build bench     # only some steps: build doctor bench tests sanitize demo (and ab, two
#                                             # trees compared: AB_BASE, AB_ARGS for benchmarks/ab.py compare, AB_S its
#                                             # limit; lm, the LM
#                                             # example;
#                                             # profile, kernel times of a layer step or, with PROFILE_ARGS="--bench
#                                             # ops", of single ops: PROFILE_ARGS for profile_layer.py;
#                                             # LM_ARGS for train_lm.py, LM_S its limit in seconds; DEMO_ARGS for
#                                             # python -m te_jax.compare, DEMO_S its limit; ncu, Nsight
#                                             # Compute counters of profile_layer.py's single ops:
#                                             # NCU_KERNELS, NCU_SKIP, NCU_SECTIONS, NCU_ARGS)
#   GPU_TESTS_S=400 GPU_TESTS="tests/test_norm.py" bash scripts/gpu_check.sh build tests   # limit and files of the GPU tests
#
# That machine has no network, and its system python3 already has jax 0.11.2 with the CUDA plugin, flax, optax,
# nanobind, scikit-build-core, cmake, ninja, nvcc and cuBLASLt: so no venv, and an in-place build without build
# isolation. The CUDA module is built for the H200 only (sm_90a) and must build (TE_JAX_CUDA=ON): a machine where it
# cannot is a failed check, not a silent fallback to the reference path.
#
# Each step has a time limit, and the whole run stays within GPU_CHECK_BUDGET_S seconds (default 570, under the
# machine's 10 minutes per command). The tests not marked `gpu` run only with GPU_CHECK_ALL_TESTS=1: CI runs them on
# every change anyway.
#
# Benchmarks: `benchmarks/run.py` merges its rows into the device's results file, benchmarks/results/h200.json on an
# H200 (each row with its run's commit, date, versions and copy bandwidth; OUT gets the file). That machine gets a copy
# of the working tree, whose .git (if any) need not be this tree's: pass the commit, e.g.
# `TE_JAX_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh build bench` (it wins over git), or the rows
# say "unknown". Back here: copy the results file into benchmarks/results/ and run `python benchmarks/report.py
# --results <it> --write docs/performance.md`. The whole suite is
# estimated at ~350 s on the H200 (from the earlier runs' op times and compile counts;
# each benchmark prints its seconds and the step log's last line sums them up), hence the step's 420 s: with the build
# it fits one call as `build bench`. The layers run first and each benchmark's rows are saved as it ends, so a run cut
# short loses only the last kernels' new rows.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LOGS=build/gpu_check
rm -rf "$LOGS" && mkdir -p "$LOGS"
touch "$LOGS/.start"
BUDGET=${GPU_CHECK_BUDGET_S:-570}
START=$SECONDS
STEPS=()
FAILED=0

# step NAME MAX_SECONDS LOG TAIL_LINES COMMAND: runs COMMAND (a command line for `bash -c`: a function exported below,
# or a command) with a time limit, appends its output to LOG, prints its last TAIL_LINES lines, records the status.
step() {
  local name=$1 max=$2 log=$3 lines=$4 cmd=$5
  local left=$((BUDGET - (SECONDS - START) - 10))
  if ((left < 15)); then
    STEPS+=("| $name | SKIPPED (no time left) | 0 |")
    FAILED=1
    return
  fi
  local limit=$((max < left ? max : left)) t0=$SECONDS rc=0 status
  echo "=== $name (limit ${limit}s): $cmd"
  timeout -k 10 "$limit" bash -c "$cmd" >> "$LOGS/$log" 2>&1 || rc=$?
  tail -n "$lines" "$LOGS/$log"
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMEOUT after ${limit}s" ;;
    5) status="FAIL (no tests collected)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || FAILED=1
  STEPS+=("| $name | $status | $((SECONDS - t0)) |")
  echo "=== $name: $status"
}

build() {
  SKBUILD_CMAKE_DEFINE="TE_JAX_CUDA=ON;TE_JAX_CUDA_ARCHS=90a-real" \
    python3 -m pip install -v --no-index --no-build-isolation --no-deps -e . \
    && python3 -c 'import te_jax._te_cuda as m; print("te_jax._te_cuda:", m.__file__)'
}

# Here the doctor must also see the GPU, the CUDA module loaded and its quantize handler bitwise equal to the
# reference: otherwise every later step would quietly measure the fallback.
doctor() {
  python3 -m te_jax.doctor && python3 -m te_jax.doctor --json > "$LOGS/doctor.json" || return 1
  python3 - "$LOGS/doctor.json" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
check = info["check"]
problems = [p for p, bad in (
    ("no GPU visible to jax", not info["gpus"]),
    ("CUDA module not loaded", not info["extensions"]["cuda"]["loaded"]),
    ("the quantize check did not run te_quantize_cuda bitwise equal to the reference",
     check.get("handler") != "te_quantize_cuda" or not check.get("bitwise_equal_to_reference")),
) if bad]
sys.exit("gpu_check: " + "; ".join(problems) if problems else 0)
PY
}

# The GPU tests, spread over GPU_TEST_PROCS pytest processes (default 8) that share the GPU: the suite is bound by
# XLA's compiles (one CPU core each), not by the GPU. Each process allocates GPU memory as it goes, not 75% up front.
# All GPU tests skipped (no GPU visible) is a failure, not a pass.
gpu_tests() {
  local procs=${GPU_TEST_PROCS:-8} i rc=0
  trap 'kill $(jobs -p) 2>/dev/null' TERM
  python3 -m pytest -q --collect-only -m gpu ${GPU_TESTS:-tests} 2>/dev/null | grep '::' > "$LOGS/.gpu_ids" || true
  [ -s "$LOGS/.gpu_ids" ] || { echo "gpu_check: no GPU test collected"; return 1; }
  echo "$(wc -l < "$LOGS/.gpu_ids") GPU tests in $procs processes"
  for ((i = 0; i < procs; i++)); do
    # Test ids dealt round-robin, so that each process gets a share of every file's cases.
    mapfile -t ids < <(awk -v n="$procs" -v k="$i" 'NR % n == k' "$LOGS/.gpu_ids")
    [ "${#ids[@]}" -gt 0 ] || continue
    # XLA's GEMM autotuning would dominate the compile of every test's reference program: off for the tests only.
    XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false \
      python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu "${ids[@]}" > "$LOGS/.pytest_gpu_$i" 2>&1 &
  done
  wait
  for f in "$LOGS"/.pytest_gpu_*; do
    grep -E "^(FAILED|ERROR)|^E  " "$f" | head -n 40
    tail -n 1 "$f"
    grep -qE "[0-9]+ failed|[0-9]+ error|no tests ran" "$f" && rc=1
    grep -qE "[0-9]+ passed" "$f" || rc=1
  done
  return $rc
}

# compute-sanitizer's four tools over tests/sanitize_kernels.py (every te_jax kernel at small and odd shapes), side by
# side, each instrumenting only te_jax's kernels (cuBLASLt's and cuDNN's are NVIDIA's to check). Each buffer its own
# allocation and no CUDA graphs, so that the tools see each kernel and each buffer's bounds. A report is a failure.
sanitize() {
  local tool rc=0 opts args
  trap 'kill $(jobs -p) 2>/dev/null' TERM
  for tool in memcheck initcheck racecheck synccheck; do
    opts=() args=()
    [ "$tool" = initcheck ] && opts=(--check-api-memory-access no)
    [ "$tool" = racecheck ] && args=(--skip gemm)
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
      compute-sanitizer --tool "$tool" --kernel-name kns=te_jax --error-exitcode 3 --print-limit 20 "${opts[@]}" \
      python3 tests/sanitize_kernels.py "${args[@]}" > "$LOGS/.sanitize_$tool" 2>&1 &
  done
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" python3 tests/sanitize_kernels.py --poison > "$LOGS/.sanitize_poison" 2>&1 &
  wait
  for tool in memcheck initcheck racecheck synccheck poison; do
    echo "--- $tool: $(grep -c ': ok$' "$LOGS/.sanitize_$tool") cases ok; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" \
      "$LOGS/.sanitize_$tool" | tail -n 1)"
    # Each finding with its first detail lines (the kernel, the thread, the address), then the rest of the output.
    grep -A4 -E "^========= [A-Z]" "$LOGS/.sanitize_$tool" | grep -vE "SUMMARY" | head -n 30
    grep -vE ": ok$|^=========|COMPUTE-SANITIZER" "$LOGS/.sanitize_$tool" | head -n 10
    grep -qE "sanitize_kernels: [0-9]+ cases in [0-9]+ s, 0 failed" "$LOGS/.sanitize_$tool" || rc=1
    [ "$tool" = poison ] || grep -qE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards" "$LOGS/.sanitize_$tool" || rc=1
  done
  [ -z "${OUT:-}" ] || mkdir -p "$OUT"
  [ -z "${OUT:-}" ] || for tool in memcheck initcheck racecheck synccheck poison; do
    head -c 200000 "$LOGS/.sanitize_$tool" > "$OUT/sanitize_$tool.log"
  done
  return $rc
}

# Two trees side by side (benchmarks/ab.py): AB_BASE is the source of the tree before a change (e.g. `git archive
# <commit> | tar -x -C build/ab_src`, carried to the machine), this tree the one after it. Both are built for sm_90a
# into directories of their own, at once; then bit-for-bit training records, checkpoints and step times, compared.
ab() {
  [ -n "${AB_BASE:-}" ] && [ -f "$AB_BASE/pyproject.toml" ] || { echo "ab: AB_BASE must be a te_jax source tree"; return 1; }
  local cfg="TE_JAX_CUDA=ON;TE_JAX_CUDA_ARCHS=90a-real" rc=0
  rm -rf build/ab && mkdir -p build/ab
  SKBUILD_CMAKE_DEFINE=$cfg python3 -m pip install --no-index --no-build-isolation --no-deps \
    --target build/ab/base_site "$AB_BASE" > build/ab/base_build.log 2>&1 &
  local base_pid=$!
  SKBUILD_CMAKE_DEFINE=$cfg SKBUILD_BUILD_DIR=build/ab/new_build python3 -m pip install --no-index \
    --no-build-isolation --no-deps --target build/ab/new_site . > build/ab/new_build.log 2>&1 || rc=1
  wait $base_pid || rc=1
  [ $rc -eq 0 ] || { tail -n 20 build/ab/base_build.log build/ab/new_build.log; return 1; }
  python3 benchmarks/ab.py compare --base build/ab/base_site --new build/ab/new_site --out build/ab ${AB_ARGS:-} || rc=1
  [ -z "${OUT:-}" ] || { mkdir -p "$OUT" && cp build/ab/ab.txt build/ab/programs_diff.txt "$OUT/" 2>/dev/null; }
  return $rc
}

if ! git rev-parse --git-dir >/dev/null 2>&1 && [ -z "${TE_JAX_COMMIT:-}" ]; then
  echo "gpu_check: no git checkout and no TE_JAX_COMMIT: the benchmark rows will say commit \"unknown\""
fi

export LOGS
export -f build doctor gpu_tests sanitize ab
# Steps to run, in this order: the arguments, or all of them (build first: the others need it).
WANT=" ${*:-build doctor tests bench demo} "
want() { [[ $WANT == *" $1 "* ]]; }
want build && step "build (CUDA sm_90a)" 300 build.log 12 build
want doctor && step "doctor" 60 doctor.log 40 doctor
want bench && step "benchmarks" "${GPU_BENCH_S:-420}" bench.log 60 "python3 benchmarks/run.py ${GPU_BENCH_ARGS:-}"
want tests && step "tests -m gpu" "${GPU_TESTS_S:-240}" tests_gpu.log 25 gpu_tests
want sanitize && step "compute-sanitizer (te_jax kernels)" "${SANITIZE_S:-300}" sanitize.log 60 sanitize
want demo && step "demo (te_jax.compare, BF16 vs FP8 LM)" "${DEMO_S:-360}" demo.log 16 \
  "python3 -m te_jax.compare --out $LOGS/compare ${DEMO_ARGS:---preset gpt-small --steps 500}"
want profile && step "profile (kernel times per layer step)" 180 profile.log 200 \
  "cd benchmarks && python3 profile_layer.py ${PROFILE_ARGS:-}"
want ncu && step "ncu (counters of a few te_jax kernels)" 240 ncu.log 80 \
  "XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --launch-skip ${NCU_SKIP:-0} --launch-count 10 \
   -k regex:'${NCU_KERNELS:-ActivationKernel|NormFwdKernel}' \
   ${NCU_SECTIONS:---section SpeedOfLight --section Occupancy --section LaunchStats --section InstructionStats \
   --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters} \
   --print-details all \
   python3 benchmarks/profile_layer.py --bench ops --ncu ${NCU_ARGS:-}"
want ab && step "A/B (AB_BASE vs this tree: bits, checkpoints, speed)" "${AB_S:-480}" ab.log 30 ab
want lm && step "LM (BF16 vs FP8 TransformerLayers)" "${LM_S:-240}" demo.log 16 \
  "python3 examples/train_lm.py ${LM_ARGS:-}"
if [ -n "${GPU_CHECK_ALL_TESTS:-}" ]; then
  step "tests -m \"not gpu\"" 150 tests_rest.log 15 'python3 -m pytest -q -m "not gpu" tests'
fi

# The device, and this run's headline rows (the GPT layer's ratios, quantize's acceptance shape) if the benchmarks got
# that far.
HEADLINE=$(python3 - <<'PY' 2>/dev/null
import datetime, glob, json, os
try:
  info = json.load(open("build/gpu_check/doctor.json"))
  gpus = ", ".join(f"{g['name']} (cc {g['compute_capability']})" for g in info["gpus"]) or "no GPU"
  print(f"device: {gpus}; driver CUDA {info['cuda']['driver_version']}; jax {info['packages']['jax']}")
except (OSError, ValueError, KeyError):
  print("device: unknown (no doctor.json)")
start = os.path.getmtime("build/gpu_check/.start")
for f in glob.glob("benchmarks/results/*.json"):
  rows = [r for r in json.load(open(f))["rows"]
          if datetime.datetime.fromisoformat(r["date"]).timestamp() >= start - 1]
  for r in rows:
    if r["impl"] == "te_jax TransformerLayer fp8" and r["case"].startswith("GPT layer"):
      print(f"GPT layer: {r['ms']:.2f} ms, {r['speedup_vs_bf16']:.2f}x Flax BF16, {r['speedup_vs_flax_fp8']:.2f}x "
            f"Flax FP8, ok={r['ok']}")
    if r["bench"] == "quantize" and r["impl"] == "te_jax" and r.get("note", "").startswith("acceptance shape"):
      print(f"acceptance: {r['case']}: {r['ms']:.4f} ms, {r['gbps']:,.0f} GB/s = {r['pct_copy']:.0f}% of copy, "
            f"{r['speedup_vs_xla']:.2f}x XLA, handler {r['handler']}, ok={r['ok']}")
PY
)

{
  echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START)) s"
  echo "$HEADLINE"
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  printf '%s\n' "${STEPS[@]}"
} > "$LOGS/summary.txt"

if [ -n "${OUT:-}" ]; then  # 8 logs, the summary, the benchmark results file and the compare report folder
  mkdir -p "$OUT"
  cp "$LOGS"/{build,doctor,tests_gpu,sanitize,bench,demo,profile,ncu}.log "$LOGS/summary.txt" "$OUT"/ 2>/dev/null
  [ -d "$LOGS/compare" ] && cp -r "$LOGS/compare" "$OUT"/
  find benchmarks/results -maxdepth 1 -type f -name '*.json' -newer "$LOGS/.start" | head -n 1 | xargs -r cp -t "$OUT"/
fi

echo
cat "$LOGS/summary.txt"
exit "$FAILED"
