#!/usr/bin/env bash
# The environment of the verl tests (tests/verl): verl and Ray beside weightsvc, in a venv of its own,
# outside the checkout, built once per verl, torch and Python version and reused (its path is printed on
# the last line); WEIGHTSVC_VERL_REINSTALL=1 rebuilds it. Older ones are removed.
# verl pins transformers < 5.11: .venv's TRL needs a newer one beside its `kernels`, the engine venv's
# vLLM for the CPU >= 5.16.1. torch is installed first and pinned (verl pins none; its extras would
# bring a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's notes about package index locations this machine lacks, one per package, say nothing.
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
PYTHON=${PYTHON:-python3}
VERL=${WEIGHTSVC_VERL:-verl==0.9.1}
want=$(echo "$VERL torch==${WEIGHTSVC_TORCH:-2.13.0} $("$PYTHON" -V)" | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/weightsvc
VENV=${WEIGHTSVC_VERL_VENV:-$CACHE/verl-$want}
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$VENV/.ready" ] || [ "${WEIGHTSVC_VERL_REINSTALL:-0}" = 1 ]; then
  rm -rf "$VENV"
  find "$CACHE" -maxdepth 1 -name 'verl-*' ! -path "$VENV" -exec rm -rf {} + 2>/dev/null || true
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==${WEIGHTSVC_TORCH:-2.13.0}"
  "$VENV/bin/python" -m pip install -q "$VERL"
  touch "$VENV/.ready"
fi
# This checkout, editable, every time (a few seconds): the venv is shared by checkouts, and verl finds
# the backend through the entry point this install records.
if ! out=$("$VENV/bin/python" -m pip install -q -e '.[dev,verl]' 2>&1); then
  echo "$out" >&2
  exit 1
fi
echo "$VENV"
