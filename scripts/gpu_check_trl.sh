#!/usr/bin/env bash
# The TRL GPU check: trl-sft/dpo/grpo-tiny on one CUDA GPU under the supervisor, uninterrupted and
# with rank 0 SIGKILLed at step 6: is the final digest equal on a GPU too? bench/results/gpu_check_trl.json.
# Without a CUDA GPU it prints one line and exits 0.
#   bash scripts/gpu_check_trl.sh [RUNS_DIR] [--recipes trl-sft-tiny,trl-gkd-tiny]  (default: every tiny TRL recipe)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check_trl.py "$@"
