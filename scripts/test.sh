#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup_env.sh), then runs pytest. Extra arguments go to pytest.
# Without a GPU the tests marked `gpu` are skipped; everything else runs on the CPU (native CPU handlers and the
# pure-JAX reference). The tests marked `slow` (multi-step training, 8-device parallel layers, huge inputs: minutes on
# a 2-core CPU) are left out (-m "not slow") unless the arguments choose tests themselves: a marker expression
# (`bash scripts/test.sh -m slow` runs just those, as CI does in a step of its own) or test paths
# (`bash scripts/test.sh tests/test_norm.py` runs that whole file).
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
marker=()
if [ "$chooses" -eq 0 ]; then
  marker=(-m "not slow")
  echo "test.sh: the tests not marked slow (-m \"not slow\"); bash scripts/test.sh -m slow runs the slow ones"
fi

source scripts/setup_env.sh

rc=0
python -m pytest -q "${marker[@]}" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
