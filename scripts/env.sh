#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) and activate it. Sourced by the other scripts.
# torch is pinned to the CPU build here (the package itself accepts a range: users bring their own torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.env-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[env] installing dependencies"
    python -m pip install --quiet --upgrade pip
    python -m pip install --quiet "torch==2.13.0"
    python -m pip install --quiet -e "$ROOT[dev,lightning]"  # both Lightning namespaces: tests run both
    echo "$WANT" > "$STAMP"
fi
