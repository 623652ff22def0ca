"""The event loop during a push of many small tensors and the pulls of it: the worst /healthz answer
(polled every 50 ms from a process of its own) and the worst loop block the server itself measured
(the `weightsvc_event_loop_lag_seconds` bucket that holds it), phase by phase.

    python scripts/loop_at_scale.py 100000
    python scripts/loop_at_scale.py 400000 --push-only

Run it twice after the kernels change: the first push of a new build compiles them (numba holds the
GIL while it compiles), which is not what a running service sees.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the suite's /healthz poller, from the repo
from tests.integration.test_scale import HealthPoller
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import ServeProcess


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
    args = parser.parse_args()
    # Names short enough that 400,000 of them fit the safetensors header bound (100 MB).
    masters = {f"experts.{i:06d}.w":
               np.full((4, 4), 0.01 + i % 7 * 1e-3, np.float32) for i in range(args.tensors)}
    server = ServeProcess("--max-message-bytes", str(64 << 20))
    try:
        def phase(name: str, run: Callable[[], object]) -> None:
            before, poller, start = lag_buckets(server.url), HealthPoller(server.url), time.perf_counter()
            run()
            took, worst = time.perf_counter() - start, poller.worst()
            print(f"{name}: {took:.1f} s, /healthz worst {worst * 1000:.0f} ms, loop lag worst <= "
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
    finally:
        server.stop()


if __name__ == "__main__":
    main()
