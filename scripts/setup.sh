#!/usr/bin/env bash
# Sets up ptops in ./.venv (idempotent, fast when nothing changed).
# --servers also installs the real servers the tests start (Debian packages, needs root).
# Installs the CPU build of torch first so pip never pulls a multi-GB CUDA build.
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
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages (first time ~2 min)" >&2
  quiet() { grep -vE "is ignored: it is neither|^\s*$" || true; }
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | quiet
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | quiet
  echo "$want" > "$stamp"
fi

# Real servers for the integration tests (Prometheus, promtool, Alertmanager from Debian).
if [ "${1:-}" = "--servers" ]; then
  bash scripts/setup_servers.sh
fi

# Tiny local assets (tokenizer); built once into ~/.cache/ptops, nothing downloaded.
.venv/bin/python -c 'from ptops.recipes import assets; assets.tokenizer_dir()'
echo "setup: ready (.venv/bin/ptops)" >&2
