#!/usr/bin/env bash
# Sets up ptops in ./.venv (idempotent, fast when nothing changed).
# --servers also installs the real servers the tests start (Debian packages, needs root).
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

stamp=.venv/.ptops-setup
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages (first time ~2 min)" >&2
  quiet() { grep -vE "is ignored: it is neither|^\s*$" || true; }
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
if [ "${1:-}" = "--servers" ]; then
  bash scripts/setup_servers.sh
fi

# Tiny local assets (tokenizer); built once into ~/.cache/ptops, nothing downloaded.
.venv/bin/python -c 'from ptops.recipes import assets; assets.tokenizer_dir()'
echo "setup: ready (.venv/bin/ptops)" >&2
