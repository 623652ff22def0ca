#!/usr/bin/env bash
# The verl tests (tests/verl): verl 0.9.1 and Ray on the CPU, in the environment scripts/setup_verl.sh
# builds once and reuses. Extra arguments go to pytest; when they name tests (tests/...), those run
# alone, without the rest of the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(scripts/setup_verl.sh | tail -n 1)
where=(tests/verl)
for arg in "$@"; do
  [[ $arg == tests/* ]] && where=()
done
WEIGHTSVC_VERL=1 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider "${where[@]}" "$@"
