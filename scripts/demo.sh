#!/usr/bin/env bash
# The main job: sets up .venv (scripts/setup_env.sh), says what this machine supports, then trains the byte-level LM
# in BF16 and in FP8 side by side from the same weights and batches (python -m te_jax.compare: the tiny preset on a
# CPU, gpt-small on a GPU) and prints the table; the plots and report.json go to the folder its last line names.
# Extra arguments go to te_jax.compare (e.g. --preset distill-tiny, --recipe current, --module my_model.py:make).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh

python -m te_jax.doctor
echo
python -m te_jax.compare "$@"
