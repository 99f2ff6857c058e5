#!/usr/bin/env bash
# Sets up ptops and runs its test suite (real TorchTitan and TRL training on CPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k titan
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --servers
exec .venv/bin/python -m pytest -ra --durations=15 --timeout 900 "$@"
