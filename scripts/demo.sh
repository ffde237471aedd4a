#!/usr/bin/env bash
# The main job: sets up .venv (scripts/setup_env.sh), says what this machine supports, then prints the FP8
# quantization report of examples/fp8_report.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh

python -m te_jax.doctor
echo
python examples/fp8_report.py
