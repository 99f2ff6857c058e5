#!/usr/bin/env bash
# One command, < 10 min on one H200: an 8B-shaped llama3 (4 layers) with float8 and torch.compile
# under the supervisor, a crash and a hang injected, async checkpoints staged in pinned memory.
# Figures (step time, MFU, async vs sync blocking, detection/restart times) go to
# bench/results/gpu_check.json. Without a CUDA GPU it prints one line and exits 0.
#   bash scripts/gpu_check.sh [RUNS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check.py "$@"
