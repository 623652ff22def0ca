#!/usr/bin/env bash
# The real-engine tests (tests/engines, marker `engine`): vLLM on the CPU, in the environment
# scripts/setup_engines.sh builds once and reuses. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(scripts/setup_engines.sh | tail -n 1)
WEIGHTSVC_ENGINES=1 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider -m engine tests/engines "$@"
