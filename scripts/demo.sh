#!/usr/bin/env bash
# Set up the environment if needed, then run the main job: the quickstart experiment from YAML.
# Extra arguments are passed on, e.g. `bash scripts/demo.sh --trainer.max_epochs=2`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
lightning-gradacc fit --config quickstart "$@"
