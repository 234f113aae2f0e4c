#!/usr/bin/env bash
# Set up the environment if needed, then run the whole quality gate: ruff, mypy and the test suite.
#
#   bash scripts/test.sh             the development environment (.venv): ruff, mypy, every test
#   bash scripts/test.sh --oldest    every declared floor (.venv-oldest): the tests that are not slow, then
#   bash scripts/test.sh --newest    the newest releases (.venv-newest): ... the slow FSDP2, resume and CLI ones
#
# Further arguments go to pytest (in the development environment only).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    --oldest | --newest)
        export GRADACC_VERSIONS="${1#--}"
        . scripts/env.sh
        python -c "import sys, torch, pytorch_lightning, lightning, jsonargparse
print(f'[test] {sys.argv[1]}: Python {sys.version.split()[0]}, torch {torch.__version__},'
      f' pytorch_lightning {pytorch_lightning.__version__}, lightning {lightning.__version__},'
      f' jsonargparse {jsonargparse.__version__}')" "$GRADACC_VERSIONS"
        echo "[test] pytest, the tests that are not slow"
        python -m pytest -m "not slow"
        echo "[test] pytest, the slow FSDP2, resume and CLI tests"
        python -m pytest -m slow tests/distributed/test_fsdp_core.py tests/distributed/test_model_parallel.py \
            tests/callback/test_resume.py tests/callback/test_resume_stateful_dataloader.py \
            tests/callback/test_window_plan.py tests/callback/test_auto.py tests/cli tests/test_distribution.py
        ;;
    *)
        . scripts/env.sh
        echo "[test] ruff"
        ruff check src tests examples benchmarks build_support
        ruff format --check --quiet src tests examples benchmarks build_support
        echo "[test] mypy"; mypy
        echo "[test] pytest"; python -m pytest "$@"
        ;;
esac
