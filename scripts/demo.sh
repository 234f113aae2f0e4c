#!/usr/bin/env bash
# Set up the environment if needed, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
PYTHONPATH=. python examples/partial_window.py "$@"
