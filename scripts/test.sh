#!/usr/bin/env bash
# Sets up ptops and runs its test suite (real TorchTitan and TRL training on CPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -k titan, or -n 2 for two pytest-xdist workers
# (--dist loadfile is set; tests/conftest.py hands out the longest modules first). One process by default:
# on a 2-core machine two workers saturate the CPU and buy little (docs/history.md). `-m extended` runs the
# tests that repeat a default test's path (tests/conftest.py EXTENDED); docs/development.md lists the markers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --servers --vllm
# lint first (pyproject [tool.ruff]): seconds, and a formatting slip should not wait for an hour of tests
.venv/bin/ruff check --output-format concise . && .venv/bin/ruff format --check . \
  || { echo "lint: run \`.venv/bin/ruff format . && .venv/bin/ruff check --fix .\`" >&2; exit 1; }
exec .venv/bin/python -m pytest -ra --durations=30 --timeout 900 -n 0 --dist loadfile --no-loadscope-reorder "$@"
