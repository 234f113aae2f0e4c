#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one short run: the CUDA-marked tests (DeepSpeed's fp32 and fp16
# oracles with Lightning's unmodified strategy among them, where deepspeed is installed; torch.compile
# exact in its default mode and refused with CUDA graphs), then a quick
# CUDA benchmark.
# Uses $PYTHON (default: .venv/bin/python if it exists, else python3), which must have a CUDA build of
# torch and this package's dependencies; results go to ${OUT:-.}/gpu-*.txt/md.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-.}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
status=0
"$PYTHON" -m pytest -m cuda -q -p no:cacheprovider --no-header -rs tests 2>&1 | tee "$OUT/gpu-tests.txt" || status=1
"$PYTHON" -m benchmarks --device cuda --quick --out "$OUT/gpu-benchmarks.md" 2>&1 | tee "$OUT/gpu-benchmarks.txt" || status=1
exit $status
