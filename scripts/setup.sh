#!/usr/bin/env bash
# Create .venv and install weightsvc with its dev extra. Idempotent; safe to re-run.
# torch is installed first and pinned, so pip never swaps in a multi-GB build by itself;
# set WEIGHTSVC_TORCH to another version (or install your CUDA build into .venv first) to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${WEIGHTSVC_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
