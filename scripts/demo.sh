#!/usr/bin/env bash
# The main job: sets up .venv (scripts/setup_env.sh), says what this machine supports, then trains the same MLP
# classifier in BF16 and in FP8 (DelayedScaling) side by side and prints loss, accuracy, step time and memory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh

python -m te_jax.doctor
echo
python examples/train_mlp.py "$@"
