#!/usr/bin/env bash
# Sets up ptops and runs the main job: a supervised tiny TorchTitan training (FSDP2, 2 ranks, CPU)
# that survives an injected crash of rank 1 at step 12: the supervisor detects it, restarts from
# the last good checkpoint and finishes all steps. Then prints status and diagnosis of the run.
# Extra arguments go to `ptops launch`, e.g. scripts/demo.sh --set train.steps=40
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run_dir=runs/demo-$(date +%Y%m%d-%H%M%S)
.venv/bin/ptops launch titan-tiny --supervise --run-dir "$run_dir" --fault crash:rank=1,step=12 "$@"
echo
.venv/bin/ptops status "$run_dir"
echo
.venv/bin/ptops diagnose "$run_dir"
echo
echo "final checkpoint digest: $(.venv/bin/ptops ckpt digest "$run_dir")"
