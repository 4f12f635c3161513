#!/usr/bin/env bash
# The GPU checks, one script (bench/gpu.py): MFU of the GPT-2-small-sized LM and the ~1B LM created
# sharded on one GPU, written to bench/RESULTS-gpu.md. Under 8 minutes on an H100/H200-class GPU.
#
#   bench/gpu.sh                          # on the GPU machine (makes .venv-cuda first: make venv FLAVOR=cuda)
#   bench/gpu.sh --cpu --out /tmp/g.md    # the same steps on CPU at toy sizes
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " == *" --cpu "* ]]; then
    python=${PYTHON:-.venv/bin/python}
else
    [[ -x .venv-cuda/bin/python ]] || make venv FLAVOR=cuda
    python=${PYTHON:-.venv-cuda/bin/python}
fi
exec "$python" -m bench.gpu "$@"
