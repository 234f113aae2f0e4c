#!/usr/bin/env bash
# Create or refresh a virtual environment and activate it. Sourced by the other scripts.
#
# GRADACC_VERSIONS picks which versions it holds:
#   dev     (default) .venv: Python 3.11, the CPU build of torch==2.13.0, the newest of the rest
#   oldest  .venv-oldest: the oldest supported Python and every declared floor (scripts/versions/oldest.txt)
#   newest  .venv-newest: the newest supported Python and the newest release of everything pyproject.toml
#           admits (torch included: this machine's pip cap on torch is lifted for that install)
# The package itself accepts ranges (pyproject.toml): users bring their own torch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADACC_VERSIONS="${GRADACC_VERSIONS:-dev}"

# An interpreter of one minor version: on PATH, or one pyenv installed (its shims refuse versions that are
# not selected, so they are run once to see that they work).
find_python() {
    local version="$1" candidate
    for candidate in "python$version" "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/"$version".*/bin/"python$version"; do
        if "$candidate" -c "" >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

case "$GRADACC_VERSIONS" in
    dev)
        VENV="$ROOT/.venv"
        PYTHON="${PYTHON:-$(find_python 3.11 || command -v python3)}"
        ;;
    oldest)
        VENV="$ROOT/.venv-oldest"
        PYTHON="$(find_python 3.10)" || { echo "[env] Python 3.10 (the oldest supported) not found" >&2; exit 1; }
        ;;
    newest)
        VENV="$ROOT/.venv-newest"
        PYTHON="$(find_python 3.13)" || { echo "[env] Python 3.13 (the newest supported) not found" >&2; exit 1; }
        ;;
    *)
        echo "[env] GRADACC_VERSIONS must be dev, oldest or newest, not '$GRADACC_VERSIONS'" >&2
        exit 2
        ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
STAMP="$VENV/.env-stamp"
PINS="$ROOT/scripts/versions/$GRADACC_VERSIONS.txt"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" "$PINS" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[env] installing dependencies ($GRADACC_VERSIONS)"
    python -m pip install --quiet --upgrade pip
    # oldest, newest: none of this machine's pip configuration (it caps torch at the releases on its disk)
    case "$GRADACC_VERSIONS" in
        dev)  # both Lightning namespaces: the tests run both
            python -m pip install --quiet -c "$PINS" "torch==2.13.0"
            python -m pip install --quiet -c "$PINS" -e "$ROOT[dev,lightning]"
            # the DeepSpeed oracles (tests/distributed/test_deepspeed.py; skipped where it is missing): its
            # ops are JIT-built when used, and its build must see this torch, not a CUDA one of its own
            DS_BUILD_OPS=0 python -m pip install --quiet --no-build-isolation -c "$PINS" "deepspeed>=0.19.8,<0.20"
            ;;
        # no wheel cache either: these installs take CUDA builds of torch of several GB, and a cached copy
        # beside the installed one filled a CI machine's disk
        oldest)
            PIP_CONFIG_FILE=/dev/null python -m pip install --quiet --no-cache-dir -c "$PINS" -e "$ROOT[dev,lightning]"
            ;;
        newest)
            PIP_CONFIG_FILE=/dev/null python -m pip install --quiet --no-cache-dir --upgrade --upgrade-strategy eager \
                -e "$ROOT[dev,lightning]"
            ;;
    esac
    echo "$WANT" > "$STAMP"
fi
