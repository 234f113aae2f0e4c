#!/usr/bin/env bash
# Set up the environment if needed, then run the whole quality gate: ruff, mypy and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
echo "[test] ruff"; ruff check src tests examples benchmarks; ruff format --check --quiet src tests examples benchmarks
echo "[test] mypy"; mypy
echo "[test] pytest"; python -m pytest "$@"
