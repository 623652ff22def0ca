#!/usr/bin/env bash
# On a CUDA machine with the project installed: the Triton kernels compiled for the GPU against the
# CPU kernels, bit for bit (tests/gpu); their speed there (K1/K2 on CUDA); and scale_3v1 with as many
# cores as the machine has (starts redis-server when none answers on 127.0.0.1:6379).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
python_json() { "$PY" -c "import json, sys; from weightsvc import _bench; print(json.dumps($1))"; }
TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
python_json "_bench.cuda_kernel_bench()"
if ! "$PY" -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  until "$PY" -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; do sleep 0.2; done
fi
python_json "_bench.scale_bench(size_mib=${SCALE_MIB:-1024}, log=lambda m: print(m, file=sys.stderr))"
