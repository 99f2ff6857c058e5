#!/usr/bin/env bash
# Sets up ptops and runs the main job: a tiny TorchTitan training (FSDP2, 2 ranks, CPU).
# Extra arguments go to `ptops launch`, e.g. scripts/demo.sh --set train.steps=40
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir=runs/demo-$(date +%Y%m%d-%H%M%S)
exec .venv/bin/ptops launch titan-tiny --run-dir "$run_dir" "$@"
