#!/usr/bin/env bash
# Create .venv and install weightsvc with its dev, trl, peft and nixl extras (the engine tests run TRL's trainer
# from this venv). Installs once, then again only when
# pyproject.toml changes: the install is editable, so changes to the code need none.
# A stamp in .venv holds the hash of what was installed; WEIGHTSVC_REINSTALL=1 installs regardless.
# torch is installed first and pinned, so pip never swaps in a multi-GB build by itself;
# set WEIGHTSVC_TORCH to another version (or install your CUDA build into .venv first) to change it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.weightsvc-install
# Debian's packages where root can install them (a fresh machine's package lists are empty: they are
# read first). nginx-light is the bench's reference server (P1_nginx); prometheus brings promtool, which
# checks the alerting rules and runs their unit tests (tests/integration/test_deploy_observability.py).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
  command -v promtool >/dev/null || missing+=(prometheus)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -q >/dev/null 2>&1 || echo "setup: apt-get update failed" >&2
    for package in "${missing[@]}"; do
      apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1 \
        || echo "setup: $package did not install" >&2
    done
  fi
fi
want=$("$PYTHON" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && [ "${WEIGHTSVC_REINSTALL:-0}" != 1 ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# (pip byte-compiles what it installs: where PYTHONDONTWRITEBYTECODE is set, as on CI machines, Python
# would otherwise compile torch's sources again in every process that imports it)
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${WEIGHTSVC_TORCH:-2.13.0}"
# (one editable install of this checkout at a time: the engine and verl venvs may be installing it too)
flock .install.lock .venv/bin/python -m pip install -q -e '.[dev,trl,peft,nixl]'
echo "$want" >"$STAMP"
