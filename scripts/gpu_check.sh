#!/usr/bin/env bash
# The GPU check, one command for one device call (< 8 minutes on one H200; bench/README.md "GPU check"):
#   here:  bash scripts/gpu_wheels.sh      (builds .whl/: ptops + what the image lacks, <= 40 MiB)
#   there: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
# It installs the carried wheels into a target folder on PYTHONPATH (the image's torch untouched),
# then runs the stages of bench/gpu_check_all.py, each under its own time budget: the own-script
# engine on CUDA (bench/gpu_check_script.py), TRL recipes (bench/gpu_check_trl.py), TorchTitan
# (bench/gpu_check.py) where it imports. Results: bench/results/gpu_check*.json (copied to $OUT when
# the device tool sets it, with the stages' log). Without a CUDA GPU it prints one line and exits 0.
#   bash scripts/gpu_check.sh [RUNS_DIR] [--stages script,trl,titan] [--budget S] [--trl-recipes a,b]
#   bash scripts/gpu_check.sh --install-only   (GPU or not: install, print the environment line, run nothing)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
INSTALL_ONLY=0
[ "${1:-}" = "--install-only" ] && { INSTALL_ONLY=1; shift; }
cuda='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
if [ $INSTALL_ONLY = 0 ] && ! "$PY" -c "$cuda" >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false): nothing run"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  # the carried wheels, then ptops from this checkout (what travelled, not a wheel built earlier); the
  # carried ptops wheel only where the image cannot build it
  SITE=${GPU_CHECK_SITE:-/tmp/ptops-site}
  t0=$SECONDS
  pipt() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
  }
  # one pip call: a second one into the same target replaces its bin/ (py-spy's binary would go)
  mapfile -t deps < <(ls .whl/*.whl | grep -v '/ptops-')
  if ! pipt --no-build-isolation "${deps[@]}" . >/dev/null 2>&1; then
    echo "gpu_check: could not build ptops from this checkout here; using the carried .whl/ptops-*.whl" >&2
    pipt .whl/*.whl || { echo "gpu_check: installing the carried wheels (.whl/) failed" >&2; exit 2; }
  fi
  # PYTHONSAFEPATH: `python -m ptops` in the repository root must not import its source folder ptops/
  # (the installed package maps ops/, recipes/, ... into it; the folder alone does not)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONSAFEPATH=1
  echo "gpu_check: carried wheels and ptops installed into $SITE in $((SECONDS - t0)) s"
fi
"$PY" -c 'import ptops' 2>/dev/null \
  || { echo "gpu_check: ptops does not import: carry .whl (bash scripts/gpu_wheels.sh)" >&2; exit 2; }
if [ $INSTALL_ONLY = 1 ]; then  # to run one driver by hand after it: eval the printed line
  echo "export PYTHONPATH=${PYTHONPATH:-} PATH=$PATH PYTHONSAFEPATH=${PYTHONSAFEPATH:-}"; exit 0
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG=$(mktemp /tmp/gpu_check.XXXX.log)
"$PY" bench/gpu_check_all.py --log "$LOG" "$@"
rc=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp bench/results/gpu_check*.json "$OUT"/ 2>/dev/null
  cp "$LOG" "$OUT/gpu_check.log"
fi
exit $rc
