#!/usr/bin/env bash
# The vLLM path of [trl.vllm] on a GPU node (a sibling of scripts/gpu_check.sh), a few minutes:
#  1. colocate: trl-grpo-tiny with vLLM inside the rank, supervised, a crash at step 4 -> resumed,
#     completed, no `vllm_fallback` event;
#  2. server (2+ GPUs): `trl vllm-serve` as the run's sidecar on the last GPU, the same crash; the
#     server is started once (kept across attempts), healthy, and gone after the launch.
# Results go to bench/results/gpu_check_vllm.json. Without a CUDA GPU, or without the vllm package
# (pip install '.[vllm]'), it prints one line and exits 0. Not yet run on a GPU.
#   bash scripts/gpu_check_vllm.sh [RUNS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PTOPS=$(dirname "$PY")/ptops
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check_vllm: no CUDA GPU here; nothing to check"; exit 0
fi
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "gpu_check_vllm: the vllm package is not installed (pip install '.[vllm]'); nothing to check"; exit 0
fi
RUNS=${1:-$(mktemp -d /tmp/ptops-vllm-check.XXXX)}
GPUS=$(nvidia-smi -L | wc -l)
mkdir -p bench/results
common=(--set train.steps=6 --set checkpoint.interval=2 --set launch.nproc=1 --set trl.per_device_batch_size=4
        --supervise --fault crash:rank=0,step=4 --no-mlflow --json)
"$PTOPS" launch trl-grpo-tiny --run-dir "$RUNS/colocate" --set 'trl.vllm.mode="colocate"' \
  --set trl.vllm.gpu_memory_utilization=0.3 "${common[@]}" > "$RUNS/colocate.json" || true
server=skipped
if [ "$GPUS" -ge 2 ]; then
  "$PTOPS" launch trl-grpo-tiny --run-dir "$RUNS/server" --set 'trl.vllm.mode="server"' \
    --set "trl.vllm.server_gpus=[$((GPUS - 1))]" --set trl.vllm.port=8765 "${common[@]}" > "$RUNS/server.json" || true
  server=ran
fi
"$PY" - "$RUNS" "$server" <<'PY'
import json, sys
from pathlib import Path
runs, server = Path(sys.argv[1]), sys.argv[2]
def check(name):
    d = runs / name
    ev = [json.loads(l) for l in (d / "events.jsonl").read_text().splitlines() if l.strip()]
    kinds = [e["kind"] for e in ev]
    return {"completed": "completed" in kinds, "restarts": kinds.count("restart"),
            "vllm_fallback": [e for e in ev if e["kind"] == "vllm_fallback"],
            "sidecar_started": kinds.count("sidecar_started"), "sidecar_died": kinds.count("sidecar_died")}
out = {"colocate": check("colocate")}
ok = out["colocate"]["completed"] and not out["colocate"]["vllm_fallback"] and out["colocate"]["restarts"] == 1
if server == "ran":
    out["server"] = check("server")
    s = out["server"]
    ok = ok and s["completed"] and not s["vllm_fallback"] and s["sidecar_started"] == 1 and s["sidecar_died"] == 0
out["ok"] = ok
Path("bench/results/gpu_check_vllm.json").write_text(json.dumps(out, indent=2))
print(json.dumps(out, indent=2))
sys.exit(0 if ok else 1)
PY
