#!/usr/bin/env bash
# Quick start: set up, then run the service on the embedded default (in-memory registry; the export
# on the GPU when one is visible, else on the CPU).
# Extra arguments go to `weightsvc serve` (e.g. --data-dir ./data --rounding rtn).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/weightsvc serve "$@"
