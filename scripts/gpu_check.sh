#!/usr/bin/env bash
# The device check, on a CUDA machine with the project installed (scripts/setup.sh with a CUDA torch):
# the Triton kernels compiled for the GPU against the CPU kernels, bit for bit (tests/gpu), the
# service with --device cuda against --device cpu (tests/integration/test_device.py, on the GPU this
# time), the kernels' speed (K1/K2/K3 on CUDA, fp8 included), and a push of a 4 GiB model with
# --device cuda vs cpu vs raw TCP, and where the kernels' time goes (hash, counters, launch shape).
# With the [nixl] extra: a NIXL READ from VRAM to VRAM between two processes on the GPU, its bytes
# checked, against a device copy, and pull_into into tensors on the GPU (skipped, said in the JSON,
# without CUDA or NIXL). Prints one JSON object of figures. Runs in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export TRITON_INTERPRET=0
log=$(mktemp)
if "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/integration/test_device.py >"$log" 2>&1; then tests=passed; else tests=failed; fi
summary=$(tail -n 1 "$log")
"$PY" - "$tests" "$summary" <<'PYEOF'
import json, sys
from weightsvc.cli.bench import gpu


def nixl_vram():
    import importlib.util
    import torch
    if not torch.cuda.is_available():
        return {"nixl_vram": "skipped: no CUDA"}
    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        return {"nixl_vram": "skipped: NIXL is not installed (pip install 'weightsvc[nixl]')"}
    from weightsvc.cli.bench import fabric
    return fabric.vram_bench(size_mib=int(__import__("os").environ.get("NIXL_MIB", "1024")), repeat=3)


out = {"tests": sys.argv[1], "tests_summary": sys.argv[2]}
out.update(gpu.cuda_kernel_bench())
out.update(gpu.cuda_kernel_profile())
out.update(gpu.device_push_bench(size_mib=int(__import__("os").environ.get("PUSH_MIB", "4096"))))
out.update(nixl_vram())
print(json.dumps(out))
PYEOF
[ "$tests" = passed ] || { cat "$log" >&2; exit 1; }
