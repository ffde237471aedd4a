#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup_env.sh), then runs pytest. Extra arguments go to pytest.
# Without a GPU the tests marked `gpu` are skipped; everything else runs on the CPU (native CPU handlers and the
# pure-JAX reference). The tests marked `slow` (multi-step training, 8-device parallel layers, huge inputs: minutes on
# a 2-core CPU) are left out (-m "not slow") unless the arguments choose tests themselves: a marker expression
# (`bash scripts/test.sh -m slow` runs just those, as CI does in a step of its own) or test paths
# (`bash scripts/test.sh tests/test_norm.py` runs that whole file).
#
# Without arguments the files are split between two pytest processes, one per core of the 2-core CI machine: the
# suite is bound by XLA's compiles, each of which uses one core. The first process prints as it goes, the second's
# output follows it, then one line with the counts of both. These runs compile with XLA's backend optimization level 0
# (XLA_FLAGS=--xla_backend_optimization_level=0: LLVM's passes off, XLA's HLO passes and fusions as always), a third
# less time; the files whose tests pin down numerics that LLVM's optimizations decide (a multiply and add contracted
# into one FMA: test_norm.py, test_rope.py; MoEBlock's Explicit-mesh and Auto-mesh programs, whose load-balancing
# losses agree bit for bit at the default level and differ by an ulp at level 0: test_moe_block.py) run at XLA's
# default level, as users' programs do. With arguments, and in CI's slow step, everything runs at the default level.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

chooses=0
for arg in "$@"; do
  case "$arg" in
    -m | -m* | --markexpr | --markexpr=*) chooses=1 ;;
    -*) ;;
    *) [ -e "${arg%%::*}" ] && chooses=1 ;;
  esac
done

if [ "$#" -gt 0 ]; then
  marker=()
  [ "$chooses" -eq 1 ] || {
    marker=(-m "not slow")
    echo "test.sh: the tests not marked slow (-m \"not slow\"); bash scripts/test.sh -m slow runs the slow ones"
  }
  source scripts/setup_env.sh
  rc=0
  python -m pytest -q "${marker[@]}" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
  fi
  exit "$rc"
fi

echo "test.sh: the tests not marked slow (-m \"not slow\"), in two pytest processes; bash scripts/test.sh -m slow runs" \
  "the slow ones"
source scripts/setup_env.sh

# Two groups of test files of about equal time: seconds per file measured on a 2-core machine at XLA's default level
# (a new file counts 10; at level 0 a file takes about 0.65 of that). The second group starts with the files run at the
# default level (printed first).
EXACT=(tests/test_norm.py tests/test_rope.py tests/test_moe_block.py)
mapfile -t groups < <(python - "${EXACT[@]}" <<'PY'
import pathlib, sys
seconds = {"nnx": 125, "block_recipes": 50, "nnx_attention_parity": 65, "transformer": 61, "docs": 61, "quantize": 59,
           "decoder_lm_port": 40, "gemm_block": 54, "nonfinite": 46, "properties": 45, "attention": 42,
           "checkpoint": 41, "flax_dense": 38, "context_parallel": 25, "compare": 31, "module_bodies": 31, "dense": 28,
           "expert_parallel": 30, "determinism": 4, "compare_moe": 12,
           "gemm": 27, "quantize_block": 25, "fused_layers": 25, "layering": 24, "train_steps": 24,
           "nnx_sharding": 22, "parallel_layers": 21, "activation": 19, "softmax": 17, "norm": 16, "residual": 15,
           "activation_pairs": 13, "activation_params": 8,
           "doctor": 15, "attention_cudnn": 14, "rope": 14, "attention_masks": 13, "quantize_interleaved": 11,
           "moe_block": 36, "te_layer_options": 12, "te_attention_inputs": 12,
           "explicit_sharding": 39}
exact = [pathlib.Path(f) for f in sys.argv[1:]]
files = [f for f in sorted(pathlib.Path("tests").glob("test_*.py")) if f not in exact]
weight = {f: 0.65 * seconds.get(f.stem[len("test_"):], 10) for f in files}
groups, totals = ([], []), [0.0, sum(seconds.get(f.stem[len("test_"):], 10) for f in exact)]
for f in sorted(files, key=lambda f: -weight[f]):
  i = totals.index(min(totals))
  groups[i].append(str(f))
  totals[i] += weight[f]
for g in groups:
  print(" ".join(sorted(g)))
PY
)
read -ra first <<< "${groups[0]}"
read -ra second <<< "${groups[1]}"

log_first=$(mktemp)
log_second=$(mktemp)
trap 'rm -f "$log_first" "$log_second"' EXIT
FAST_XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
rc_second=0
{
  rc_exact=0
  python -m pytest -q -m "not slow" "${EXACT[@]}" > "$log_second" 2>&1 || rc_exact=$?
  rc_rest=0
  XLA_FLAGS="$FAST_XLA_FLAGS" python -m pytest -q -m "not slow" "${second[@]}" >> "$log_second" 2>&1 || rc_rest=$?
  # Either run failing fails the process; no test collected is a failure for the EXACT files, which always have some.
  [ "$rc_exact" -eq 0 ] && [ "$rc_rest" -eq 0 -o "$rc_rest" -eq 5 ] || exit $(( rc_exact ? rc_exact : rc_rest ))
} &
pid_second=$!
rc_first=0
XLA_FLAGS="$FAST_XLA_FLAGS" python -m pytest -q -m "not slow" "${first[@]}" 2>&1 | tee "$log_first" || rc_first=$?
wait "$pid_second" || rc_second=$?
echo
echo "test.sh: the second process (${EXACT[*]} at XLA's default level, then ${second[*]}):"
cat "$log_second"

# One line with the counts of both processes' closing lines.
python - "$log_first" "$log_second" <<'PY'
import re, sys
counts = {}
for path in sys.argv[1:]:
  # Every pytest run's closing line (the second process holds two runs).
  closing = [l for l in open(path).read().splitlines()
             if re.search(r"\d+ (passed|failed|skipped|deselected|error).* in [\d.]+s", l)]
  for n, what in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", " ".join(closing)):
    what = "error" if what.startswith("error") else what
    counts[what] = counts.get(what, 0) + int(n)
order = ["passed", "failed", "skipped", "deselected", "error", "xfailed", "xpassed"]
print("test.sh: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in order if k in ("passed", "failed") or counts.get(k)))
PY

if [ "$rc_first" -eq 5 ] && [ "$rc_second" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
for rc in "$rc_first" "$rc_second"; do
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    exit "$rc"
  fi
done
exit 0
