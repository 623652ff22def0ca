# Sourced by scripts/setup_engines.sh and scripts/setup_verl.sh: a venv of its own for a suite whose
# packages conflict with .venv's, outside the checkout (shared by checkouts), built once per requirement,
# torch and Python version and reused; older ones of the same name are removed. torch is installed first
# and pinned, so pip never swaps in a multi-GB build. Then this checkout, editable, every time (a few
# seconds; setuptools warns on every editable install: its output is shown only if the install fails).
#
#   outside_venv NAME REQUIREMENT EXTRAS REINSTALL [VENV]   prints the venv's path on its last line
#
# REINSTALL=1 rebuilds it; VENV names another place for it. A function `after_install VENV` defined by
# the caller runs once the requirement is installed.

# pip's notes about package index locations this machine lacks, one per package, say nothing.
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

outside_venv() {
  local name=$1 requirement=$2 extras=$3 reinstall=$4 venv=${5:-}
  local python=${PYTHON:-python3} torch="torch==${WEIGHTSVC_TORCH:-2.13.0}"
  local want cache out
  want=$(echo "$requirement $torch $("$python" -V)" | "$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/weightsvc
  venv=${venv:-$cache/$name-$want}
  if ! [ -x "$venv/bin/python" ] || ! [ -f "$venv/.ready" ] || [ "$reinstall" = 1 ]; then
    rm -rf "$venv"
    find "$cache" -maxdepth 1 -name "$name-*" ! -path "$venv" -exec rm -rf {} + 2>/dev/null || true
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$torch"
    "$venv/bin/python" -m pip install -q "$requirement"
    if declare -F after_install >/dev/null; then after_install "$venv"; fi
    touch "$venv/.ready"
  fi
  # (one editable install of this checkout at a time: each writes its egg-info)
  if ! out=$(flock .install.lock "$venv/bin/python" -m pip install -q -e ".[$extras]" 2>&1); then
    echo "$out" >&2
    return 1
  fi
  echo "$venv"
}
