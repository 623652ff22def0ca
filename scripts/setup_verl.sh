#!/usr/bin/env bash
# The environment of the verl tests (tests/verl): verl and Ray beside weightsvc, in a venv of its own
# outside the checkout (scripts/outside_venv.sh), built once and reused; its path is printed on the
# last line. WEIGHTSVC_VERL_REINSTALL=1 rebuilds it; WEIGHTSVC_VERL_REQUIREMENT installs another verl.
# verl pins transformers < 5.11: .venv's TRL needs a newer one beside its `kernels`, the engine venv's
# vLLM for the CPU >= 5.16.1. Its own torch is pinned first (verl pins none; its extras would bring a
# CUDA build). verl finds the backend through the entry point the editable install records.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/outside_venv.sh
outside_venv verl "${WEIGHTSVC_VERL_REQUIREMENT:-verl==0.9.1}" dev,verl "${WEIGHTSVC_VERL_REINSTALL:-0}" "${WEIGHTSVC_VERL_VENV:-}"
