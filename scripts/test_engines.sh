#!/usr/bin/env bash
# The real-engine tests (tests/engines, marker `engine`): vLLM on the CPU, in the environment
# scripts/setup_engines.sh builds once and reuses. Extra arguments go to pytest; when they name tests
# (tests/...), those run alone, without the rest of the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(scripts/setup_engines.sh | tail -n 1)
where=(tests/engines)
for arg in "$@"; do
  [[ $arg == tests/* ]] && where=()
done
WEIGHTSVC_ENGINES=1 "$VENV/bin/python" -m pytest -q -rs --durations=15 -p no:cacheprovider -m engine "${where[@]}" "$@"
