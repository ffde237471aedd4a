#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup_env.sh), then runs pytest. Extra arguments go to pytest.
# Without a GPU the tests marked `gpu` are skipped; everything else runs on the CPU (native CPU handlers and the
# pure-JAX reference).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh

rc=0
python -m pytest -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
