"""scale_3v1: pullers from sharded replicas (on Redis) against pullers from one replica."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from weightsvc.cli.bench._common import PULLERS, best, make_model, row, serve
from weightsvc.cli.bench.peers import Pullers
from weightsvc.client import InferenceClient, LearnerClient


def scale_bench(*, size_mib: int = 512, repeat: int = 3, redis_url: str = "redis://127.0.0.1:6379/0",
                log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """scale_3v1: aggregate pull throughput of 8 pullers from 3 sharded replicas vs from 1 (each
    deployment on its own Redis prefix). Every puller asks replica 0 and gathers the parts from their
    owners, as InferenceClient does. None when no Redis answers at `redis_url`."""
    import redis

    say = log or (lambda _m: None)
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        say(f"scale_3v1: no Redis at {redis_url}; skipped")
        return {"scale_3v1": None, "report": {"scale_3v1": _row("no Redis")}}
    model = make_model(size_mib)
    seconds = {}
    with Pullers(PULLERS) as pullers:  # one process each for every round: their start is not timed
        for count in (1, 3):
            prefix = f"weightsvc-bench-{os.getpid()}-{count}"
            servers = [serve(2, "--redis-url", redis_url, "--redis-prefix", prefix, "--replica-id", f"r{i}")
                       for i in range(count)]
            try:
                with LearnerClient(servers[0].target) as learner:
                    learner.push(1, model)
                seconds[count] = best(lambda: pullers.seconds(servers[0].target), repeat)  # noqa: B023
                served = InferenceClient(servers[0].target).manifest().data_bytes
                say(f"{PULLERS} pullers from {count} replica(s): {PULLERS * served / seconds[count] / 1e9:.2f} GB/s")
            finally:
                for server in servers:
                    server.stop()
                client = redis.Redis.from_url(redis_url)
                for key in client.scan_iter(f"{prefix}:*"):
                    client.delete(key)
    gbps = {count: round(PULLERS * served / s / 1e9, 3) for count, s in seconds.items()}
    ratio = round(seconds[1] / seconds[3], 3)
    return {
        "scale_3v1": ratio,
        "details": {"scale_1_replica_gbps": gbps[1], "scale_3_replicas_gbps": gbps[3]},
        "report": {"scale_3v1": _row(f"{ratio:.2f}x")},
    }


def _row(value: str) -> dict[str, str]:
    what = f"{PULLERS} pullers from 3 sharded replicas vs from 1, aggregate"
    return row(what, value, f"cores here: {os.cpu_count()}")

