"""The event loop during a push of many small tensors and the pulls of it: the worst /healthz answer
(polled every 50 ms from a process of its own) on the probe port (answered off the loop) and on the
HTTP port (from the loop), and the worst loop block the server itself measured (the
`weightsvc_event_loop_lag_seconds` bucket that holds it), phase by phase; and, polled the same way,
an idle process's answer: what the machine itself adds (a core shared with other work). With --sync-mib, then a
push of that many MiB of fp32 masters and N pullers at once (--pullers).

    python scripts/loop_at_scale.py 100000
    python scripts/loop_at_scale.py 400000 --push-only
    python scripts/loop_at_scale.py 100000 --sync-mib 1024 --pullers 8

Run it twice after the kernels change: the first push of a new build compiles them (numba holds the
GIL while it compiles), which is not what a running service sees.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's weightsvc
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import ServeProcess
from weightsvc.cli.bench._common import make_model
from weightsvc.cli.bench.loop import HealthPoller
from weightsvc.cli.bench.peers import fanout_pull_seconds

IDLE = """
import http.server as h
class Handler(h.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = h.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def lag_buckets(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {line.split('le="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("weightsvc_event_loop_lag_seconds_bucket")}


def worst_bucket(before: dict[str, float], after: dict[str, float]) -> str:
    """The smallest bucket bound that holds every observation made between the two readings."""
    total = after["+Inf"] - before["+Inf"]
    return next(le for le in after if after[le] - before[le] >= total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tensors", type=int)
    parser.add_argument("--push-only", action="store_true", help="leave out the manifest fetch")
    parser.add_argument("--sync-mib", type=int, default=0, help="then push this many MiB of masters ...")
    parser.add_argument("--pullers", type=int, default=8, help="... and pull them with this many processes at once")
    args = parser.parse_args()
    # Names short enough that 400,000 of them fit the safetensors header bound (100 MB).
    masters = {f"experts.{i:06d}.w":
               np.full((4, 4), 0.01 + i % 7 * 1e-3, np.float32) for i in range(args.tensors)}
    server = ServeProcess("--max-message-bytes", str(64 << 20))
    idle = subprocess.Popen([sys.executable, "-c", IDLE], stdout=subprocess.PIPE, text=True)
    assert idle.stdout is not None
    idle_url = f"http://127.0.0.1:{idle.stdout.readline().strip()}"
    try:
        def phase(name: str, run: Callable[[], object]) -> None:
            before, start = lag_buckets(server.url), time.perf_counter()
            probes, http, control = HealthPoller(server.probes), HealthPoller(server.url), HealthPoller(idle_url)
            run()
            took, probes_worst, http_worst = time.perf_counter() - start, probes.worst(), http.worst()
            print(f"{name}: {took:.1f} s, /healthz worst: probe port {probes_worst * 1000:.0f} ms, HTTP port "
                  f"{http_worst * 1000:.0f} ms, an idle process {control.worst() * 1000:.0f} ms; loop lag worst <= "
                  f"{worst_bucket(before, lag_buckets(server.url))} s; RssAnon "
                  f"{server.memory()['RssAnon'] >> 20} MiB", flush=True)

        def push() -> None:
            with LearnerClient(server.target) as learner:
                learner.push(1, masters, model="moe")

        phase(f"push {args.tensors}", push)
        phase("pull grpc", lambda: InferenceClient(server.target).pull("moe", 1))
        phase("pull http", lambda: InferenceClient(server.url).pull("moe", 1))
        if not args.push_only:
            phase("manifest http", lambda: InferenceClient(server.url).manifest("moe", 1))
        if args.sync_mib:
            model = make_model(args.sync_mib)
            phase(f"push {args.sync_mib} MiB", lambda: LearnerClient(server.target).push(1, model))
            for target in (server.target, server.url):
                phase(f"{args.pullers} pullers {'http' if target == server.url else 'grpc'}",
                      lambda t=target: fanout_pull_seconds(t, args.pullers))  # type: ignore[misc]
    finally:
        server.stop()
        idle.kill()


if __name__ == "__main__":
    main()
