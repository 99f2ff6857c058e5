#!/usr/bin/env bash
# Sets up ptops and runs its test suite (real TorchTitan and TRL training on CPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k titan (or -n 0: one process, no workers).
# Two pytest-xdist workers: a run's imports and waits leave much of a 2-core machine idle; tests/conftest.py
# hands out the longest modules first; a module stays on one worker (its shared runs are made once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --servers
exec .venv/bin/python -m pytest -ra --durations=30 --timeout 900 -n 2 --dist loadfile --no-loadscope-reorder "$@"
